"""`veil bench`: sequential vs speculative decoding against a real ``veil-trunk`` process behind
the WAN emulator; writes DIR/results.json, PNG plots and prints a table."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.errors import VeilError
from engine.loading import DEFAULT_MODEL

DECODERS = ("sequential", "speculative")
# with --pipeline: the speculative decoder with rounds in flight too (its own learned state)
ALL_DECODERS = (*DECODERS, "pipelined")
COLORS = {"sequential": "tab:gray", "speculative": "tab:blue", "pipelined": "tab:orange"}


class BenchError(VeilError):
    """Bad benchmark input (prompts file, options)."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark sequential vs speculative decoding over an emulated WAN",
        description="Start a local veil-trunk behind a WAN emulator, run every prompt with both "
        "decoders, write DIR/results.json and plots, and print a table.",
    )
    p.add_argument(
        "--prompts", default=None, metavar="FILE.jsonl", help='{"id","category","prompt"} per line'
    )
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="SPEC")
    p.add_argument("--local-layers", type=int, default=2, metavar="K")
    p.add_argument("--rtt-ms", type=float, default=80.0, help="emulated round trip (default 80)")
    p.add_argument("--bandwidth-mbit", type=float, default=None, metavar="B", help="link cap")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    p.add_argument(
        "--sweep-rtt",
        default=None,
        metavar="MS,MS,...",
        help="also run every prompt at these RTTs for the tok/s-vs-RTT plot (e.g. 0,20,80,150)",
    )
    p.add_argument(
        "--wire-dtype",
        default="float32",
        help="activations on the wire: float32 (default here, so the two decoders are compared "
        "without wire rounding noise) or float16 (the product default)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch's ops in the client and in the local trunk (default: half "
        "the cores each)",
    )
    p.add_argument(
        "--kernel-threads",
        type=int,
        default=None,
        help="CPU threads for the small-batch matrix kernel on each side (default: every core; "
        "the client and the trunk compute in turn)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="compute dtype of both sides: auto (default: the fastest exact-enough one for "
        "this CPU, as `veil generate`), float32, bfloat16 or float16",
    )
    p.add_argument(
        "--client-quant",
        default="auto",
        choices=("auto", "none", "int8", "int4"),
        help="the client's weights: auto (default, as `veil generate`: a GGUF model's own "
        "quantized blocks), none (float), int8 or int4",
    )
    p.add_argument(
        "--exact-float",
        action="store_true",
        help="quantized products with float activations (see `veil generate --help`)",
    )
    # the default since int8 activations became it; still accepted from older scripts
    p.add_argument("--int8-activations", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--draft-head",
        default="auto",
        metavar="auto|none|FILE",
        help="learned draft head for the speculative decoder (default: the one shipped for the "
        "model, if any)",
    )
    p.add_argument(
        "--keyed-trunk",
        default=None,
        metavar="DIR",
        help="serve this keyed trunk (`veil-trunk keyed-model prepare`) and connect with "
        "--org-key: the organisation-keyed split's cost",
    )
    p.add_argument("--org-key", default=None, metavar="FILE", help="the key of --keyed-trunk")
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="also run the speculative decoder with rounds in flight (the `pipelined` decoder: "
        "round r+1 sent on a bet while round r is on the wire, where the cost model says it "
        "pays), beside the same decoder without them",
    )
    p.add_argument("--out", default=None, metavar="DIR")
    p.set_defaults(func=run)
    from app import cmd_bench_client

    bench_sub = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    cmd_bench_client.add_parser(bench_sub)


def load_prompts(path: str) -> list[dict[str, str]]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise BenchError(f"cannot read the prompts file {path}: {exc.strerror or exc}") from None
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise BenchError(f'{path}:{n}: each line needs a non-empty "prompt" string')
        pid = str(obj.get("id") or f"prompt-{n}")
        if pid in seen:
            raise BenchError(f"{path}:{n}: duplicate id '{pid}'")
        seen.add(pid)
        out.append(
            {"id": pid, "category": str(obj.get("category") or "other"), "prompt": obj["prompt"]}
        )
    if not out:
        raise BenchError(f"{path} has no prompts")
    return out


def parse_rtts(text: str | None) -> list[float]:
    if not text:
        return []
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--sweep-rtt must be comma-separated numbers, got '{text}'") from None
    if any(v < 0 for v in vals):
        raise BenchError("--sweep-rtt values must be >= 0")
    return vals


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TPR = total generated tokens / total round trips (prefill included); tok/s = tokens after
    the first / decode seconds, over all prompts."""
    out: dict[str, Any] = {"tokens_per_round_trip": {}, "decode_tok_s": {}, "rows_per_token": {}}
    for d in decoders_of(rows):
        toks = sum(len(r[d]["token_ids"]) for r in rows)
        rts = sum(r[d]["round_trips"] for r in rows)
        dec_toks = sum(max(len(r[d]["token_ids"]) - 1, 0) for r in rows)
        dec_s = sum(r[d]["decode_s"] for r in rows)
        out["tokens_per_round_trip"][d] = round(_ratio(toks, rts), 4)
        out["decode_tok_s"][d] = round(_ratio(dec_toks, dec_s), 3)
        # trunk rows sent per token committed after the first (1.0 for sequential decoding)
        rows_sent = sum(r[d].get("trunk_rows", 0) for r in rows)
        out["rows_per_token"][d] = round(_ratio(rows_sent, dec_toks), 4)
    out["speedup"] = round(
        _ratio(out["decode_tok_s"]["speculative"], out["decode_tok_s"]["sequential"]), 3
    )
    out["all_identical"] = all(r["identical"] for r in rows)
    spec = [r["speculative"] for r in rows]
    rounds = sum(r["round_trips"] - 1 for r in spec)
    out["draft_ms_per_round"] = round(
        _ratio(1000 * sum(r.get("draft_s", 0.0) for r in spec), rounds), 3
    )
    if "pipelined" in decoders_of(rows):
        pipe = [r["pipelined"] for r in rows]
        tok_s = out["decode_tok_s"]
        out["pipelined"] = {
            "speedup": round(_ratio(tok_s["pipelined"], tok_s["sequential"]), 3),
            "vs_speculative": round(_ratio(tok_s["pipelined"], tok_s["speculative"]), 3),
            # its tokens per round trip count every block sent, the rounds sent ahead included
            "rounds_in_flight": sum(r["pipelined_rounds"] for r in pipe),
            "bets_won": sum(r["pipeline_hits"] for r in pipe),
        }
    return out


def decoders_of(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The decoders a run measured (sequential and speculative always; pipelined if asked)."""
    return [d for d in ALL_DECODERS if not rows or d in rows[0]]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def run_prompts(
    runner: Any,
    prompts: Sequence[dict[str, str]],
    max_new_tokens: int,
    bar: Any,
    pipelined: Any = None,
) -> list[dict[str, Any]]:
    """Each prompt through each decoder in turn; ``pipelined``: a second runner on the same
    client and trunk for the pipelined decoder (it learns apart, so neither decoder drafts from
    what the other was shown)."""
    from engine.chat import messages_for, prompt_ids
    from engine.generate import generate
    from engine.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens)
    rows = []
    for p in prompts:
        ids = prompt_ids(runner.client.tokenizer, messages_for(p["prompt"], None))
        row: dict[str, Any] = {"id": p["id"], "category": p["category"]}
        for d in (*DECODERS, "pipelined") if pipelined is not None else DECODERS:
            if bar is not None:
                bar.set_postfix_str(f"{p['id']} {d}")
            res = generate(pipelined if d == "pipelined" else runner, ids, params, decoder=d)
            st = res.stats
            row[d] = {
                "token_ids": res.token_ids,
                "round_trips": st.round_trips,
                "decode_tok_s": round(st.decode_tok_s, 3),
                "ttft_s": round(st.ttft_s, 4),
                "decode_s": round(st.decode_s, 4),
                "finish_reason": res.finish_reason,
                "trunk_rows": st.tree_nodes_sent,
                "rows_per_token": round(st.rows_per_token, 4),
            }
            if d != "sequential":
                row[d]["tokens_per_round_trip"] = round(st.tokens_per_round_trip, 4)
                row[d]["tree_nodes_sent"] = st.tree_nodes_sent
                row[d]["accepted_hist"] = {str(k): v for k, v in sorted(st.accepted_hist.items())}
                row[d]["draft_s"] = round(st.draft_s, 4)
                row[d]["draft_ms_per_round"] = round(st.draft_ms_per_round, 3)
            if d == "pipelined":
                row[d]["pipelined_rounds"] = st.pipelined_rounds
                row[d]["pipeline_hits"] = st.pipeline_hits
            if bar is not None:
                bar.update(1)
        want = row["sequential"]["token_ids"]
        row["identical"] = all(row[d]["token_ids"] == want for d in decoders_of([row]))
        rows.append(row)
    return rows


def plot(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    # tok/s vs RTT: measured points, and the curve the main run's measured compute predicts
    pts = sorted(results["sweep"], key=lambda s: s["rtt_ms"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    top = max([s["rtt_ms"] for s in pts] + [150.0])
    grid = [top * i / 60 for i in range(61)]
    decoders = decoders_of(results["prompts"])
    for d in decoders:
        color = COLORS[d]
        xs = [s["rtt_ms"] for s in pts]
        ys = [s["decode_tok_s"][d] for s in pts]
        ax.plot(xs, ys, "o-", color=color, label=f"{d} (measured)")
        m = results["model_fit"][d]
        pred = [
            _ratio(1.0, m["compute_s_per_token"] + m["round_trips_per_token"] * r / 1000)
            for r in grid
        ]
        ax.plot(grid, pred, "--", color=color, alpha=0.6, label=f"{d} (compute + RTT model)")
    ax.set_xlabel("round-trip time (ms)")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(f"{results['model']}, {results['max_new_tokens']} new tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    f = out / "tok_s_vs_rtt.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    files.append(f.name)
    # TPR by category
    cats: dict[str, list[dict[str, Any]]] = {}
    for r in results["prompts"]:
        cats.setdefault(r["category"], []).append(r)
    names = sorted(cats)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    width = 0.76 / len(decoders)
    for j, d in enumerate(decoders):
        vals = [summarize(cats[c])["tokens_per_round_trip"][d] for c in names]
        xs = [i + (j - (len(decoders) - 1) / 2) * width for i in range(len(names))]
        bars = ax.bar(xs, vals, width, color=COLORS[d], label=d)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("tokens per round trip")
    ax.set_title("Tokens committed per trunk round trip, by category")
    ax.legend(fontsize=8)
    fig.tight_layout()
    f = out / "tpr_by_category.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    files.append(f.name)
    return files


def model_fit(rows: Sequence[dict[str, Any]], rtt_ms: float) -> dict[str, Any]:
    """Per decoder: compute seconds per token (decode time minus the emulated RTT of each round
    trip) and round trips per token, to predict tok/s at other RTTs."""
    fit = {}
    for d in decoders_of(rows):
        toks = sum(max(len(r[d]["token_ids"]) - 1, 0) for r in rows)
        rts = sum(r[d]["round_trips"] - 1 for r in rows)  # decode round trips
        dec_s = sum(r[d]["decode_s"] for r in rows)
        compute = max(dec_s - rts * rtt_ms / 1000, 0.0)
        fit[d] = {
            "compute_s_per_token": round(_ratio(compute, toks), 6),
            "round_trips_per_token": round(_ratio(rts, toks), 6),
        }
    return fit


def table(results: dict[str, Any]) -> str:
    head = (
        f"{'prompt':<24} {'category':<15} {'seq tok/s':>9} {'spec tok/s':>10} "
        f"{'TPR':>5} {'same':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in results["prompts"]:
        s, p = r["sequential"], r["speculative"]
        lines.append(
            f"{r['id'][:24]:<24} {r['category'][:15]:<15} {s['decode_tok_s']:>9.2f} "
            f"{p['decode_tok_s']:>10.2f} {p['tokens_per_round_trip']:>5.2f} "
            f"{'yes' if r['identical'] else 'NO':>5}"
        )
    sm = results["summary"]
    lines.append("-" * len(head))
    lines.append(
        f"{'all':<24} {'':<15} {sm['decode_tok_s']['sequential']:>9.2f} "
        f"{sm['decode_tok_s']['speculative']:>10.2f} "
        f"{sm['tokens_per_round_trip']['speculative']:>5.2f} "
        f"{'yes' if sm['all_identical'] else 'NO':>5}"
    )
    lines.append(
        f"RTT {results['rtt_ms']:g} ms: speculative {sm['speedup']:.2f}x sequential tok/s, "
        f"{sm['tokens_per_round_trip']['speculative']:.2f} tokens per round trip "
        f"(sequential {sm['tokens_per_round_trip']['sequential']:.2f}); drafting "
        f"{sm.get('draft_ms_per_round', 0.0):.1f} ms per round, "
        f"{sm.get('rows_per_token', {}).get('speculative', 0.0):.2f} trunk rows per committed token"
        + (f" with the draft head {results['draft_head']}" if results.get("draft_head") else "")
    )
    pipe = sm.get("pipelined")
    if pipe is not None:
        lines.append(
            f"with rounds in flight: {sm['decode_tok_s']['pipelined']:.2f} tok/s, "
            f"{pipe['speedup']:.2f}x sequential, {pipe['vs_speculative']:.2f}x without them; "
            f"{sm['tokens_per_round_trip']['pipelined']:.2f} tokens per round trip counting the "
            f"{pipe['rounds_in_flight']} rounds sent ahead ({pipe['bets_won']} bets won)"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", None) == "client":
        from app import cmd_bench_client

        return cmd_bench_client.run(args)
    if not args.prompts or not args.out:
        raise BenchError("veil bench needs --prompts FILE.jsonl and --out DIR")
    prompts = load_prompts(args.prompts)
    if args.max_new_tokens < 1:
        raise BenchError("--max-new-tokens must be at least 1")
    if args.rtt_ms < 0:
        raise BenchError("--rtt-ms must be >= 0")
    if args.bandwidth_mbit is not None and args.bandwidth_mbit <= 0:
        raise BenchError("--bandwidth-mbit must be > 0")
    sweep = [r for r in parse_rtts(args.sweep_rtt) if r != args.rtt_ms]
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"cannot create {out}: {exc.strerror or exc}") from None

    import torch
    from tqdm import tqdm

    from app.progress import CliProgress
    from engine import kernels
    from engine.drafts.select import parse_head_choice
    from engine.generate import available_decoders
    from engine.local_server import start_local_trunk
    from engine.session import parse_dtype
    from engine.speculative import draft_head_of, forget, use_draft_head
    from engine.split import SplitRunner, load_client, warm_up_client
    from engine.wan_proxy import WanProxy

    if "speculative" not in available_decoders():
        raise BenchError("the speculative decoder is not available in this build")
    if args.threads is not None and args.threads < 1:
        raise BenchError("--threads must be at least 1")
    if args.kernel_threads is not None and args.kernel_threads < 1:
        raise BenchError("--kernel-threads must be at least 1")
    threads = args.threads or max(1, (os.cpu_count() or 2) // 2)
    kernel_threads = args.kernel_threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    kernels.set_threads(kernel_threads)
    kernels.set_int8_activations(not args.exact_float)
    progress = CliProgress()
    dtype = parse_dtype(args.dtype)
    keyed = getattr(args, "keyed_trunk", None)
    if (keyed is None) != (getattr(args, "org_key", None) is None):
        raise BenchError("--keyed-trunk and --org-key go together")
    client = load_client(
        args.model,
        args.local_layers,
        dtype=dtype,
        progress=progress,
        client_quant=args.client_quant,
        org_key=getattr(args, "org_key", None),
    )
    progress.close()
    if client.plan.fully_local:
        raise BenchError("--local-layers leaves no trunk to benchmark; use fewer local layers")
    warm_up_client(client, CliProgress())  # first-use compiles now, not in the first rounds
    print(
        f"veil bench: starting veil-trunk ({client.name}) behind a {args.rtt_ms:g} ms WAN emulator",
        file=sys.stderr,
    )
    # The server listens directly; our own WAN proxy sits in front so the RTT can be swept.
    with start_local_trunk(
        args.model,
        min_local_layers=1,
        dtype=args.dtype,
        threads=threads,
        kernel_threads=kernel_threads,
        extra_args=["--keyed-trunk", str(keyed)] if keyed else (),
    ) as srv:
        proxy = WanProxy(
            "127.0.0.1", srv.port, args.rtt_ms, bandwidth_mbit=args.bandwidth_mbit
        ).start()
        try:
            from engine.transport import connect_trunk

            trunk = connect_trunk(
                proxy.address,
                client,
                server_key=srv.server_public_key,
                client_keys=srv.client_keys,
                wire_dtype=args.wire_dtype,
            )
            try:
                runner = SplitRunner(client, trunk)
                head_choice = parse_head_choice(args.draft_head, client)
                use_draft_head(runner, head_choice)
                piped = SplitRunner(client, trunk) if args.pipeline else None
                if piped is not None:
                    use_draft_head(piped, head_choice)
                n_dec = 3 if piped is not None else 2
                total = n_dec * len(prompts) * (1 + len(sweep)) + n_dec
                with tqdm(total=total, desc="bench", file=sys.stderr, unit="run") as bar:
                    # warm-up (allocations, first-call overheads), not recorded
                    bar.set_postfix_str("warm-up")
                    run_prompts(runner, prompts[:1], min(8, args.max_new_tokens), None, piped)
                    bar.update(n_dec)
                    t0 = time.perf_counter()
                    rows = run_prompts(runner, prompts, args.max_new_tokens, bar, piped)
                    wall = time.perf_counter() - t0
                    summary = summarize(rows)
                    head = draft_head_of(runner)
                    points = [
                        {
                            "rtt_ms": args.rtt_ms,
                            "decode_tok_s": summary["decode_tok_s"],
                            "tokens_per_round_trip": summary["tokens_per_round_trip"],
                            "draft_ms_per_round": summary["draft_ms_per_round"],
                        }
                    ]
                    for rtt in sweep:
                        proxy.set_rtt(rtt)
                        # each pass starts as the first did: nothing learned from these prompts
                        forget(runner)
                        if piped is not None:
                            forget(piped)
                        run_prompts(runner, prompts[:1], min(8, args.max_new_tokens), None, piped)
                        s = summarize(run_prompts(runner, prompts, args.max_new_tokens, bar, piped))
                        points.append(
                            {
                                "rtt_ms": rtt,
                                "decode_tok_s": s["decode_tok_s"],
                                "tokens_per_round_trip": s["tokens_per_round_trip"],
                                "draft_ms_per_round": s["draft_ms_per_round"],
                                "all_identical": s["all_identical"],
                            }
                        )
                trunk_stats = trunk.json_stats()
            finally:
                trunk.close()
        finally:
            proxy.stop()
    results: dict[str, Any] = {
        "model": client.name,
        "rtt_ms": args.rtt_ms,
        "bandwidth_mbit": args.bandwidth_mbit,
        "max_new_tokens": args.max_new_tokens,
        "local_layers": args.local_layers,
        "wire_dtype": args.wire_dtype,
        "dtype": str(dtype).removeprefix("torch."),
        "client_quant": client.client_quant,
        "key_id": client.key_id,  # an organisation-keyed trunk (None: the public model)
        "int8_activations": kernels.int8_activations(),
        "machine": machine(),
        "client_threads": torch.get_num_threads(),
        "trunk_threads": threads,
        "kernel_threads": kernel_threads,
        "kernels": kernels.status(),
        "wall_s": round(wall, 2),
        "prompts": rows,
        "summary": summary,
        "sweep": points,
        "model_fit": model_fit(rows, args.rtt_ms),
        "draft_head": str(head.path) if head is not None else None,
        "draft_head_info": head.info if head is not None else None,
        "trunk": trunk_stats,
    }
    results["plots"] = plot(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(table(results))
    print(f"wrote {out / 'results.json'} and {', '.join(results['plots'])}")
    return 0
