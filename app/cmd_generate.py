"""`veil generate`: one reply, streamed to stdout or as one JSON object."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

from app.core.long_message import READ_CHUNK, shows_reading
from app.progress import CliProgress
from engine import kernels
from engine.chat import messages_for, prompt_ids
from engine.errors import GenerationError
from engine.generate import CancelToken, Prefill, available_decoders, generate
from engine.loading import DEFAULT_MODEL
from engine.sampling import SamplingParams
from engine.session import RunnerOptions, open_runner
from engine.split import warm_up_client


def add_common_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="SPEC",
        help=f"model: {DEFAULT_MODEL} (embedded default), a model folder, a .gguf file, "
        "or a Hugging Face repo id already in the local cache",
    )
    p.add_argument(
        "--local-layers",
        type=int,
        default=2,
        metavar="K",
        help="decoder layers run on this computer at each end (default 2; "
        "half the model's layers = fully local)",
    )
    p.add_argument(
        "--tail-layers",
        type=int,
        default=None,
        metavar="T",
        help="asymmetric split: tail layers (then --local-layers is the head)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="compute dtype: auto (default: float32 on a CPU, bfloat16 on CUDA), float32 (the "
        "reference), bfloat16 or float16 (on a CPU: faster where it has bf16/fp16 units, and "
        "speculative output is not guaranteed identical to sequential there)",
    )
    p.add_argument(
        "--client-quant",
        default="auto",
        choices=("auto", "none", "int8", "int4"),
        help="the client's weights: auto (default: a GGUF model's own quantized blocks, kept "
        "quantized; float checkpoints stay float), none (float: the reference path), int8 "
        "(per channel) or int4 (groups of 32), quantized once and cached",
    )
    p.add_argument("--exact-float", action="store_true", help=kernels.EXACT_FLOAT_HELP)
    # the default since int8 activations became it; still accepted from older scripts
    p.add_argument("--int8-activations", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--private-weights",
        default=None,
        metavar="FILE",
        help="organisation-private head/tail layers made by `veil privatize`",
    )
    p.add_argument(
        "--org-key",
        default=None,
        metavar="FILE",
        help="your organisation's key, for a trunk server that runs a model keyed to it "
        "(`veil-trunk keyed-model`); IT gives it out. A trunk run on this computer ignores it",
    )


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate one reply",
        description="Generate one chat reply and stream it to stdout.",
    )
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="system prompt")
    add_common_model_args(p)
    # no --model with --server: the server's model, fetched from it (see engine/delivery)
    p.set_defaults(model=None)
    p.add_argument(
        "--yes",
        action="store_true",
        help="with --server and no --model: download the server's model without asking",
    )
    p.add_argument(
        "--server",
        default=None,
        metavar="ADDR|INVITE",
        help="run the trunk on a veil-trunk server: tcp://HOST:PORT (its key saved before) "
        "or an invite code from `veil-trunk invite` (default: the trunk runs here)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plain TCP to a `veil-trunk serve --insecure` on this computer (loopback only)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when this text appears (repeatable)",
    )
    p.add_argument(
        "--decoder",
        default=default_decoder(),
        help="sequential, speculative, or pipelined (speculative with rounds in flight: round "
        "r+1 sent while round r is on the wire, where the cost model says it pays) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--draft-head",
        default="auto",
        metavar="auto|none|FILE",
        help="learned draft head for the speculative decoder: auto (the one shipped for this "
        "model, if any; default), none, or a file made by `veil train-draft`",
    )
    p.add_argument(
        "--attach",
        action="append",
        default=[],
        metavar="FILE",
        help="a document (PDF, .docx, .odt, .txt, .md) the reply should use; its passages that "
        "fit the model's context go into the prompt, numbered for citing (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def default_decoder() -> str:
    return "speculative" if "speculative" in available_decoders() else "sequential"


def runner_options(args: argparse.Namespace) -> RunnerOptions:
    server = getattr(args, "server", None)
    model = args.model if args.model is not None or server else DEFAULT_MODEL
    return RunnerOptions(
        model=model,
        local_layers=args.local_layers,
        tail_layers=args.tail_layers,
        server=getattr(args, "server", None),
        insecure=bool(getattr(args, "insecure", False)),
        dtype=args.dtype,
        device=args.device,
        private_weights=getattr(args, "private_weights", None),
        client_quant=getattr(args, "client_quant", "auto"),
        org_key=getattr(args, "org_key", None),
        confirm_download=download_prompt(bool(getattr(args, "yes", False))),
    )


def download_prompt(yes: bool) -> Any:
    """Ask before the server's model is downloaded (``--yes``: go ahead; no terminal: refuse
    with the size and the flag to pass)."""

    from app.core.gauges import human_bytes

    def confirm(manifest: Any, size: int) -> bool:
        what = f"the model {manifest.model} from the server: {human_bytes(size)}"
        if yes:
            print(f"veil: downloading {what}", file=sys.stderr)
            return True
        if not sys.stdin.isatty():
            raise GenerationError(
                f"connecting needs a one-time download of {what}",
                hint="run it again with --yes, or answer the question in a terminal",
            )
        answer = input(f"veil: download {what}? [y/N] ")
        return answer.strip().lower() in ("y", "yes")

    return confirm


def peak_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    params.validate()
    if getattr(args, "insecure", False) and not args.server:
        raise GenerationError("--insecure needs --server tcp://127.0.0.1:PORT")
    progress = CliProgress()
    attached = _read_attachments(args.attach, progress) if args.attach else None
    t0 = time.perf_counter()
    kernels.set_int8_activations(not getattr(args, "exact_float", False))
    opts = runner_options(args)
    runner = open_runner(opts, progress)
    head_name = _use_draft_head(runner, args)
    # the kernels' first-use compiles happen here, not inside the reply (after the inputs were
    # checked: a wrong flag gets its one error line at once)
    warm_up_client(runner.client, progress)
    progress.close()
    load_s = time.perf_counter() - t0
    messages = messages_for(args.prompt, args.system)
    sources: list[Any] = []
    if attached is not None:
        messages, sources = _with_attachments(attached, messages, runner, params)
    ids = prompt_ids(runner.client.tokenizer, messages)

    def stream(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    cancel = CancelToken()
    reading = CliProgress(enabled=shows_reading(len(ids)))  # a long prompt: a bar on stderr

    def read(done: int, total: int) -> None:
        reading("reading the prompt", done / total)
        if done == total:
            reading.close()

    try:
        res = generate(
            runner,
            ids,
            params,
            decoder=args.decoder,
            on_text=None if args.json else stream,
            cancel=cancel,
            # read in blocks as the app reads: through a server several travel at once
            prefill=Prefill(chunk=READ_CHUNK, on_progress=read),
        )
    finally:
        reading.close()
        if runner.trunk is not None:
            runner.trunk.close()
    if not args.json:
        sys.stdout.write("\n")
        return 0
    st = res.stats
    out: dict[str, Any] = {
        "text": res.text,
        "token_ids": res.token_ids,
        "new_tokens": st.new_tokens,
        "prompt_tokens": st.prompt_tokens,
        "finish_reason": res.finish_reason,
        "ttft_s": round(st.ttft_s, 4),
        "decode_tok_s": round(st.decode_tok_s, 3),
        "load_s": round(load_s, 3),
        "local_layers": args.local_layers,
        "head_layers": runner.client.plan.head,
        "tail_layers": runner.client.plan.tail,
        "fully_local": runner.client.plan.fully_local,
        "model": runner.client.name,
        "decoder": args.decoder,
        "dtype": str(runner.client.dtype).removeprefix("torch."),
        "client_quant": runner.client.client_quant,
        "int8_activations": kernels.int8_activations(),
        "kernels": kernels.status(),
        "quant_kernels": kernels.quant_status(),
        "local_param_bytes": runner.client.local_param_bytes(),
        "peak_memory_bytes": peak_memory_bytes(args.device),
        "round_trips": st.round_trips,
        "tokens_per_round_trip": round(st.tokens_per_round_trip, 4),
        "tree_nodes_sent": st.tree_nodes_sent,
        "accepted_hist": {str(k): v for k, v in sorted(st.accepted_hist.items())},
        "draft_ms_per_round": round(st.draft_ms_per_round, 3),
        "draft_head": head_name,
    }
    if attached is not None:
        out["sources"] = [
            {"n": s.n, "file": s.path, "page": s.page, "paragraph": s.para} for s in sources
        ]
    if opts.fetched is not None:  # the server's model: what came over the network
        out["model_part"] = {
            "part_id": opts.fetched.manifest.part_id,
            "part_bytes": opts.fetched.manifest.total_bytes,
            "fetched_bytes": opts.fetched.fetched_bytes,
            "local_layers_max": opts.fetched.manifest.k_max,
        }
    extra = getattr(runner.trunk, "json_stats", None)
    if callable(extra):
        out.update(extra())
    print(json.dumps(out))
    return 0


def _use_draft_head(runner: Any, args: argparse.Namespace) -> str | None:
    """Apply ``--draft-head``; returns the head file drafting uses (None: no learned head)."""
    choice = getattr(args, "draft_head", "auto")
    if args.decoder not in ("speculative", "pipelined"):
        return None
    from engine.drafts.select import parse_head_choice
    from engine.speculative import draft_head_of, use_draft_head

    try:
        use_draft_head(runner, parse_head_choice(choice, runner.client))
    except Exception:
        if runner.trunk is not None:
            runner.trunk.close()
        raise
    head = draft_head_of(runner)
    return str(head.path) if head is not None and head.path else None


def _read_attachments(paths: list[str], progress: CliProgress) -> tuple[Any, int]:
    """Read ``--attach`` files into an index that lives only in this process."""
    from app.core.documents.extract import DocumentError
    from app.core.documents.index import DocIndex

    index = DocIndex.in_memory()
    matter = index.create_matter("attached")
    index.add_paths(matter, paths)
    report = index.sync(matter, progress)
    progress.close()
    if report.failed:
        raise DocumentError(report.failed[0][1])
    return index, matter


def _with_attachments(
    attached: tuple[Any, int], messages: list[Any], runner: Any, params: SamplingParams
) -> tuple[list[Any], list[Any]]:
    """The prompt with the attached files' passages that fit; says on stderr which were used."""
    from app.core.documents.context import with_sources

    index, matter = attached
    limit = runner.client.config.max_position_embeddings - params.max_new_tokens
    messages, sources = with_sources(index, matter, messages, runner.client.tokenizer, limit)
    if sources:
        used = ", ".join(f"[{s.n}] {s.label()}" for s in sources)
        print(f"veil: using {len(sources)} passage(s): {used}", file=sys.stderr, flush=True)
    else:
        print(
            "veil: warning: no room for the attached files in this model's context "
            "(lower --max-new-tokens)",
            file=sys.stderr,
            flush=True,
        )
    return messages, sources
