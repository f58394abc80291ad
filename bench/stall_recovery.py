"""Does speculation recover from one stalled round early in a session?

    python bench/stall_recovery.py [--stall-s 1.0] [--rtt-ms 80] [--max-new-tokens 96]
                                   [--prompts ../shared/bench/prompts.jsonl] [--n 4]

Starts a ``veil-trunk`` child behind the project's WAN emulator (demo model, k = 2, the shipped
draft head, float32 on the wire), then answers the first ``--n`` prompts with the speculative
decoder in one session, as the app does. With ``--stall-s`` > 0 the first drafted round of the
session waits that many seconds more for its answer (a Wi-Fi hiccup, a machine pausing); with
0 nothing is added. Prints each prompt's tok/s, tokens per round trip and one-token steps, and
the totals. Before the stall guard (``CostModel.stalled``) one 1-s stall could keep drafting
off for most of the session (docs/performance.md, "A fresh install's first session").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stall-s", type=float, default=1.0)
    ap.add_argument("--rtt-ms", type=float, default=80.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "bench" / "prompts.jsonl"))
    ap.add_argument("--n", type=int, default=4)
    args = ap.parse_args()

    import engine.speculative as spec
    from engine.chat import messages_for, prompt_ids
    from engine.generate import generate
    from engine.local_server import start_local_trunk
    from engine.sampling import SamplingParams
    from engine.split import SplitRunner, load_client
    from engine.transport import connect_trunk
    from engine.wan_proxy import WanProxy

    lines = Path(args.prompts).read_text().splitlines()
    prompts = [json.loads(line) for line in lines if line.strip()][: args.n]
    client = load_client("smollm2-135m-instruct", 2, warm_up=True)
    with start_local_trunk("smollm2-135m-instruct", min_local_layers=1) as srv:
        proxy = WanProxy("127.0.0.1", srv.port, args.rtt_ms).start()
        trunk = connect_trunk(
            proxy.address,
            client,
            server_key=srv.server_public_key,
            client_keys=srv.client_keys,
            wire_dtype="float32",
        )
        runner = SplitRunner(client, trunk)
        finish, stalled = runner.finish, [args.stall_s <= 0]

        def finish_with_a_stall(flight: Any) -> Any:
            if not stalled[0] and spec.runner_state(runner).rounds >= 1:  # first drafted round
                stalled[0] = True
                time.sleep(args.stall_s)
            return finish(flight)

        runner.finish = finish_with_a_stall  # type: ignore[method-assign]
        tokens = rounds = one = 0
        seconds = 0.0
        for p in prompts:
            ids = prompt_ids(client.tokenizer, messages_for(p["prompt"], None))
            params = SamplingParams(max_new_tokens=args.max_new_tokens)
            st = generate(runner, ids, params, decoder="speculative").stats
            tokens, seconds = tokens + st.new_tokens - 1, seconds + st.decode_s
            rounds, one = rounds + st.round_trips - 1, one + st.one_token_steps
            print(
                f"{p['id']:<22} {st.decode_tok_s:6.2f} tok/s  {st.tokens_per_round_trip:4.2f} "
                f"tokens/round trip  {st.one_token_steps:3d} one-token steps  "
                f"{st.stalled_rounds} rounds taken for stalls",
                flush=True,
            )
        proxy.stop()
    print(
        f"all: stall {args.stall_s:g} s, {tokens / seconds:.2f} tok/s, "
        f"{tokens / max(rounds, 1):.2f} tokens per round trip, {one} one-token steps"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
