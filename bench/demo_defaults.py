"""How often the built-in model loops, by repetition penalty and reply length (the app's demo
defaults come from this measurement; see docs/app.md).

    python bench/demo_defaults.py [--penalties 1.0,1.1,1.2,1.3] [--max-new-tokens 512]
                                  [--out bench-out/demo_defaults.json]

Greedy replies of the default model, fully local, to office-style chat prompts (with the app's
default assistant style) and to the app's drafting prompts. A reply *loops* when some run of
8 words occurs 3 or more times in it. For drafting rewrites, *kept* is the share of the source's
words that survive (a penalty also penalises copying the prompt's words). Each penalty is one
greedy run per prompt at the longest length; the shorter length is read from the same run's
first tokens (greedy decoding makes them equal).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.core.drafting import ACTIONS, messages_for, plan_suggestion  # noqa: E402
from app.core.settings import PRESETS  # noqa: E402
from engine.chat import prompt_ids  # noqa: E402
from engine.generate import generate  # noqa: E402
from engine.loading import DEFAULT_MODEL  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.split import SplitRunner, load_client  # noqa: E402

CHAT = (
    "Write a polite reminder about Friday's team meeting",
    "Explain what an invoice number is for",
    "Suggest three subject lines for a newsletter",
    "Write a short e-mail asking a client to confirm their address, with my signature: "
    "Kind regards, Sam Patel, Office Manager",
    "How do I write a good out-of-office message?",
    "Give me five tips for keeping a tidy shared calendar",
    "Draft a thank-you note to a colleague who covered my shift",
    "What should a meeting agenda contain?",
    "Write a friendly reply declining a vendor's offer",
    "Summarize why backups matter, for a small office",
)
DOCS = (
    (
        "grammar",
        "hey so the printer on floor 2 is broke again, dont send stuff to it till "
        "friday ok. use the one near reception instead.",
    ),
    (
        "formal",
        "we cant do the meeting tmrw cause half the team is out sick, lets move it to "
        "next week sometime, ill send a new invite.",
    ),
    (
        "grammar",
        "Their going to send the invoices on monday, but we dont know witch address "
        "to use for the new client so pls check.",
    ),
    (
        "outline",
        "- welcome new staff\n- building access cards\n- IT accounts on day one\n"
        "- lunch with the team",
    ),
)
WORD = re.compile(r"[\w']+")


def loops(text: str, n: int = 8, times: int = 3) -> bool:
    words = WORD.findall(text.lower())
    grams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return bool(grams) and max(grams.values()) >= times


def kept(source: str, text: str) -> float:
    src = Counter(WORD.findall(source.lower()))
    out = Counter(WORD.findall(text.lower()))
    return sum((src & out).values()) / max(1, sum(src.values()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--penalties", default="1.0,1.1,1.2,1.3")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--short", type=int, default=256, help="the shorter length read off each run")
    ap.add_argument("--out", default="bench-out/demo_defaults.json")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady when shared)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    client = load_client(DEFAULT_MODEL, 1)
    n = client.config.n_layers
    client = load_client(DEFAULT_MODEL, (n + 1) // 2)  # fully local: no trunk
    runner = SplitRunner(client, None)
    tok = client.tokenizer
    system = PRESETS["Helpful assistant"]
    jobs = [("chat", p, [{"role": "system", "content": system}, {"role": "user", "content": p}])
            for p in CHAT]  # fmt: skip
    for key, text in DOCS:
        s = plan_suggestion(key, text, 0, len(text), 0)
        jobs.append((f"draft:{ACTIONS[key].key}", text, messages_for(s)))
    rows = []
    for rp in [float(x) for x in args.penalties.split(",")]:
        for kind, source, msgs in jobs:
            ids = prompt_ids(tok, msgs)
            t0 = time.perf_counter()
            res = generate(runner, ids, SamplingParams(args.max_new_tokens, repetition_penalty=rp))
            short_ids = res.token_ids[: args.short]
            short = tok.decode(short_ids, skip_special_tokens=True)
            row = {
                "penalty": rp, "kind": kind, "prompt": source[:60],
                "tokens": len(res.token_ids), "finish": res.finish_reason,
                "loops": loops(res.text), "loops_short": loops(short),
                "ends_short": len(res.token_ids) <= args.short and res.finish_reason == "eos",
                "kept": round(kept(source, res.text), 3) if kind.startswith("draft") else None,
                "secs": round(time.perf_counter() - t0, 1), "text": res.text,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "text"}), flush=True)
    summary = {}
    for rp in sorted({r["penalty"] for r in rows}):
        for group in ("chat", "draft"):
            rs = [r for r in rows if r["penalty"] == rp and r["kind"].startswith(group)]
            summary[f"{rp} {group}"] = {
                "n": len(rs),
                f"loops@{args.max_new_tokens}": sum(r["loops"] for r in rs),
                f"loops@{args.short}": sum(r["loops_short"] for r in rs),
                f"eos within {args.short}": sum(r["ends_short"] for r in rs),
                f"eos within {args.max_new_tokens}": sum(r["finish"] == "eos" for r in rs),
                "mean kept": round(sum(r["kept"] for r in rs) / len(rs), 3)
                if group == "draft"
                else None,
            }
    for k, v in summary.items():
        print(k, json.dumps(v))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
