"""How far could rounds in flight go? The outcome-guess hit rate that pipelined speculation
(issue 32, item 1) would live on, measured before building the protocol for it.

    python bench/pipeline_ceiling.py [--n 8] [--max-new-tokens 96] [--budget 24] [--out FILE]

A pipelined client sends round r+1 while round r is on the wire, conditioned on a guess of r's
outcome: the node where the accepted path ends (and the bonus token after it). This runs the
speculative decoder (default model, k = 2 through an in-process trunk, the shipped draft head,
trees of ``--budget`` nodes as the cost model picks at ~80 ms) and, for every round, ranks the
tree's nodes (root included) by the drafter's own probability that the walk ends there:
P(reach n) x (1 - sum of n's children's draft probabilities). It reports how often the true end
node is the top guess, or among the top 2 / 4 (a fan-out of guessed rounds). The bonus token
must be guessed too, so these are upper bounds on the exact-outcome hit rate; it also reports
how often the walk ended at the root (no draft accepted: the bonus is a token the drafter
ranked below every child it sent) or at a leaf (a whole branch accepted: the bonus is the next
draft, the easiest case). Counting only:
nothing here depends on this machine's speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Recorder:
    """A drafter proxy that keeps each proposed tree and each verified outcome."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.trees: list[Any] = []
        self.outcomes: list[tuple[int, list[int]]] = []  # (tree nodes sent, accepted path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose(self, context: Any, budget: int) -> Any:
        tree = self.inner.propose(context, budget)
        self.trees.append(tree)
        return tree

    def observe(self, v: Any) -> None:
        if len(v.tokens) > 1 and v.parents[1] == 0:  # a drafted round (not a prompt or a chain)
            self.outcomes.append((len(v.tokens) - 1, list(v.path)))
        self.inner.observe(v)


def end_ranking(parents: list[int], probs: list[float]) -> list[int]:
    """Block indices (0 = root, i + 1 = tree node i) by P(the walk ends there), best first."""
    n = len(parents)
    reach = [1.0] + [0.0] * n
    child_mass = [0.0] * (n + 1)
    for i, (p, q) in enumerate(zip(parents, probs, strict=True)):
        reach[i + 1] = reach[p + 1] * q
        child_mass[p + 1] += q
    end = [reach[i] * max(0.0, 1.0 - child_mass[i]) for i in range(n + 1)]
    return sorted(range(n + 1), key=lambda i: -end[i])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "bench" / "prompts.jsonl"))
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--budget", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from engine.chat import messages_for, prompt_ids
    from engine.loading import DEFAULT_MODEL
    from engine.sampling import SamplingParams
    from engine.speculative import SpecOptions, generate_speculative, runner_state
    from engine.split import SplitRunner, load_client, load_trunk

    torch.set_num_threads(2)
    client = load_client(DEFAULT_MODEL, 2)
    s, e = client.plan.trunk_range
    runner = SplitRunner(client, load_trunk(DEFAULT_MODEL, s, e))
    rec = Recorder(runner_state(runner).drafter)
    lines = Path(args.prompts).read_text().splitlines()
    prompts = [json.loads(x) for x in lines if x.strip()][: args.n]
    hits = {1: 0, 2: 0, 4: 0}
    ends = {"root": 0, "leaf": 0}  # where the walk ended: no draft accepted / a whole branch
    rounds = tokens = 0
    per_prompt = []
    for p in prompts:
        ids = prompt_ids(client.tokenizer, messages_for(p["prompt"], None))
        rec.trees.clear()
        rec.outcomes.clear()
        res = generate_speculative(
            runner,
            ids,
            SamplingParams(max_new_tokens=args.max_new_tokens),
            drafter=rec,  # type: ignore[arg-type]
            options=SpecOptions(fixed_budget=args.budget),
        )
        mine = {1: 0, 2: 0, 4: 0}
        leaf = root = 0
        # trees and outcomes pair up in order (every drafted round is proposed, then observed)
        for tree, (sent, path) in zip(rec.trees, rec.outcomes, strict=False):
            t = tree.prefix(sent)
            order = end_ranking(t.parents, t.probs)
            for k in mine:
                mine[k] += path[-1] in order[:k]
            root += path[-1] == 0
            leaf += path[-1] > 0 and path[-1] - 1 not in t.parents
        n_rounds = min(len(rec.trees), len(rec.outcomes))
        for k in hits:
            hits[k] += mine[k]
        rounds += n_rounds
        ends["root"] += root
        ends["leaf"] += leaf
        tokens += len(res.token_ids)
        per_prompt.append({"id": p["id"], "rounds": n_rounds, "hits": mine})
        print(
            p["id"],
            n_rounds,
            "rounds",
            {k: round(v / max(n_rounds, 1), 3) for k, v in mine.items()},
        )
    summary = {f"end_node_in_top_{k}": round(v / max(rounds, 1), 4) for k, v in hits.items()}
    summary |= {f"ended_at_{k}": round(v / max(rounds, 1), 4) for k, v in ends.items()}
    summary |= {"rounds": rounds, "tokens": tokens, "tokens_per_round": round(tokens / rounds, 3)}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "prompts": per_prompt}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
