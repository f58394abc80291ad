"""Rounds in flight, counted: how many bets win and what they buy, independent of machine speed.

    python bench/rounds_in_flight.py [--n 8] [--max-new-tokens 96] [--budgets 8,16] [--out FILE]

Runs the speculative decoder on the default model (k = 2, an in-process trunk, the shipped
draft head, ``--budget`` nodes a round as the cost model picks at ~80 ms) with rounds in flight
off and with every bet sent (``pipeline="always"``), and reports per setting: bets won per
round sent ahead, trunk rows per committed token, tokens per round trip counting every block
sent, and tokens per *waited* round trip — blocks whose answer the client waited a whole round
trip for (a round sent ahead comes back right after the one before it). On a trunk whose rows
are nearly free (a GPU behind a WAN), time per token follows the waited round trips; on the
2-core test machine the rows cost more than the waits they save (``veil bench --pipeline``).
Every output is checked against the pipeline-off output, token for token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "bench" / "prompts.jsonl"))
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--budgets", default="8,16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import torch

    import engine.speculative as spec
    from engine.chat import messages_for, prompt_ids
    from engine.loading import DEFAULT_MODEL
    from engine.sampling import SamplingParams
    from engine.split import SplitRunner, load_client, load_trunk

    torch.set_num_threads(2)
    rows = [json.loads(x) for x in Path(a.prompts).read_text().splitlines() if x.strip()][: a.n]
    client = load_client(DEFAULT_MODEL, 2)
    s, e = client.plan.trunk_range
    trunk = load_trunk(client.resolved, s, e)
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    results: list[dict[str, Any]] = []
    for budget in [int(b) for b in a.budgets.split(",")]:
        ref: dict[str, list[int]] = {}
        for mode in ("off", "always"):
            runner = SplitRunner(client, trunk)  # its own learned state, from nothing
            tot = {"tokens": 0, "blocks": 0, "ahead": 0, "won": 0, "rows": 0, "rounds": 0}
            for r in rows:
                ids = prompt_ids(client.tokenizer, messages_for(r["prompt"], None))
                opts = spec.SpecOptions(fixed_budget=budget, pipeline=mode)
                got = spec.generate_speculative(runner, ids, params, options=opts)
                if mode == "off":
                    ref[r["id"]] = got.token_ids
                elif got.token_ids != ref[r["id"]]:
                    raise SystemExit(f"{r['id']}: not the same tokens with rounds in flight")
                st = got.stats
                tot["tokens"] += st.new_tokens - 1  # after the first (the prompt's block)
                tot["blocks"] += st.round_trips - 1
                tot["ahead"] += st.pipelined_rounds
                tot["won"] += st.pipeline_hits
                tot["rows"] += st.tree_nodes_sent
                tot["rounds"] += sum(st.accepted_hist.values())
            waited = tot["blocks"] - tot["ahead"]
            res = {
                "budget": budget,
                "pipeline": mode,
                "tokens": tot["tokens"],
                "blocks_sent": tot["blocks"],
                "rounds_sent_ahead": tot["ahead"],
                "bets_won": tot["won"],
                "won_per_round_ahead": round(tot["won"] / max(tot["ahead"], 1), 3),
                "tokens_per_round_trip": round(tot["tokens"] / max(tot["blocks"], 1), 3),
                "tokens_per_waited_round_trip": round(tot["tokens"] / max(waited, 1), 3),
                "rows_per_token": round(tot["rows"] / max(tot["tokens"], 1), 3),
            }
            results.append(res)
            print(json.dumps(res), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
