"""Speculative vs sequential decode, fully local, prompt by prompt, with and without a draft head.

    python bench/spec_vs_seq_local.py [--model SPEC] [--prompts FILE.jsonl] [--n 8]
                                      [--max-new-tokens 96] [--heads auto,none]
                                      [--exact-float] [--repeats 1] [--out FILE.json]
                                      [--server-rtt-ms MS]

One process, one loaded model (k = half the layers: fully local; with ``--server-rtt-ms`` k = 2
and the trunk in a ``veil-trunk serve`` child behind the WAN proxy), greedy. For every head choice
(``auto``: the head shipped for the model, if any; ``none``: the suffix/n-gram drafters alone;
or a head file) and every prompt, the sequential and the speculative decoder run back to back,
their order alternating from prompt to prompt so both see the same machine load. Reports each
prompt's decode tok/s of both (with ``--repeats R``, the median of R runs of each, the order
alternating run by run: one run's tok/s on a shared 2-core machine moves by 10-30 %), the
ratio, tokens per model call, the one-token steps the mode chooser took, and whether the token
ids are identical (they must be); then, per head choice, all prompts' tokens over all their
decode seconds for each decoder and that ratio. The speculative decoder keeps what it learned
about this runner (its rates) from prompt to prompt, as in the app.

Run it under the shared CPU lock (``flock /tmp/veil-cpu.lock``) and state the CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.chat import messages_for, prompt_ids  # noqa: E402
from engine.drafts.select import parse_head_choice  # noqa: E402
from engine.generate import GenerationResult, generate  # noqa: E402
from engine.loading import load_config, resolve  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.session import RunnerOptions, open_runner  # noqa: E402
from engine.speculative import draft_head_of, use_draft_head  # noqa: E402


def _row(r: GenerationResult) -> dict[str, Any]:
    s = r.stats
    return {
        "tok_s": round(s.decode_tok_s, 2),
        "new_tokens": s.new_tokens,
        "tokens_per_call": round(s.tokens_per_round_trip, 3),
        "one_token_steps": s.one_token_steps,
        "calls": s.round_trips,
    }


def _median(results: list[GenerationResult]) -> GenerationResult:
    """The run with the median decode tok/s (the lower middle one of an even count)."""
    ranked = sorted(results, key=lambda r: r.stats.decode_tok_s)
    return ranked[(len(ranked) - 1) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared/bench/prompts.jsonl"))
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--heads", default="auto,none")
    ap.add_argument("--exact-float", action="store_true")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--server-rtt-ms",
        type=float,
        default=None,
        help="through a veil-trunk child on this machine behind the WAN proxy at this RTT "
        "(k = 2) instead of fully local",
    )
    a = ap.parse_args(argv)
    if a.exact_float:
        import os

        os.environ["VEIL_INT8_ACTIVATIONS"] = "0"
    prompts = [json.loads(x) for x in Path(a.prompts).read_text().splitlines() if x.strip()]
    prompts = prompts[: a.n]
    n_layers = load_config(resolve(a.model).folder).n_layers
    srv = None
    if a.server_rtt_ms is None:
        runner = open_runner(RunnerOptions(model=a.model, local_layers=n_layers // 2), None)
    else:
        from engine.local_server import start_local_trunk
        from engine.split import SplitRunner, load_client

        client = load_client(a.model, 2, warm_up=True)
        srv = start_local_trunk(a.model, min_local_layers=2, rtt_ms=a.server_rtt_ms)
        runner = SplitRunner(client, srv.connect(client))
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    report: dict[str, Any] = {
        "model": a.model,
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "max_new_tokens": a.max_new_tokens,
        "exact_float": a.exact_float,
        "repeats": a.repeats,
        "server_rtt_ms": a.server_rtt_ms,
        "runs": [],
    }
    # warm-up: kernels compiled, caches touched, before anything is timed
    warm = prompt_ids(runner.client.tokenizer, messages_for("Hello"))
    generate(runner, warm, SamplingParams(max_new_tokens=8), decoder="sequential")
    for choice in a.heads.split(","):
        use_draft_head(runner, parse_head_choice(choice, runner.client))
        head = draft_head_of(runner)
        generate(runner, warm, SamplingParams(max_new_tokens=8), decoder="speculative")
        print(f"\n== head: {choice} ({head.path.name if head and head.path else 'no head'})")
        print(
            f"{'prompt':26s} {'seq tok/s':>9s} {'spec tok/s':>10s} {'ratio':>6s} "
            f"{'tok/call':>8s} {'1-tok':>5s} same"
        )
        totals = {"sequential": [0, 0.0], "speculative": [0, 0.0]}  # tokens, decode seconds
        for i, p in enumerate(prompts):
            ids = prompt_ids(runner.client.tokenizer, messages_for(p["prompt"]))
            runs: dict[str, list[GenerationResult]] = {"sequential": [], "speculative": []}
            for r in range(a.repeats):
                order = ["sequential", "speculative"]
                for d in order if (i + r) % 2 == 0 else order[::-1]:
                    runs[d].append(generate(runner, ids, params, decoder=d))
            res = {d: _median(rs) for d, rs in runs.items()}
            for d, rs in runs.items():
                totals[d][0] += sum(x.stats.new_tokens for x in rs)
                totals[d][1] += sum(x.stats.decode_s for x in rs)
            seq, spec = _row(res["sequential"]), _row(res["speculative"])
            same = all(
                x.token_ids == runs["sequential"][0].token_ids for rs in runs.values() for x in rs
            )
            ratio = spec["tok_s"] / seq["tok_s"] if seq["tok_s"] else 0.0
            report["runs"].append(
                {
                    "head": choice,
                    "prompt": p["id"],
                    "sequential": seq,
                    "speculative": spec,
                    "ratio": round(ratio, 3),
                    "identical": same,
                }
            )
            print(
                f"{p['id']:26s} {seq['tok_s']:9.1f} {spec['tok_s']:10.1f} {ratio:6.2f} "
                f"{spec['tokens_per_call']:8.2f} {spec['one_token_steps']:5d} {same}"
            )
        rate = {d: n / s if s > 0 else 0.0 for d, (n, s) in totals.items()}
        overall = rate["speculative"] / rate["sequential"] if rate["sequential"] else 0.0
        report.setdefault("overall", {})[choice] = {
            "sequential_tok_s": round(rate["sequential"], 2),
            "speculative_tok_s": round(rate["speculative"], 2),
            "ratio": round(overall, 3),
        }
        print(
            f"{'all prompts':26s} {rate['sequential']:9.1f} {rate['speculative']:10.1f} "
            f"{overall:6.2f}"
        )
    if runner.trunk is not None:
        runner.trunk.close()
    if srv is not None:
        srv.stop()
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
