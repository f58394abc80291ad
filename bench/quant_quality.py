"""What quantization costs in quality, per format, on the default model.

    python bench/quant_quality.py [--model FILE.gguf] [--text FILE ...] [--max-tokens 2048]
                                  [--n-prompts N] [--out OUT.json]

The reference is the float32 model: the GGUF (the default model's Q4_1 file unless ``--model``
names another) dequantized (``--client-quant none``). Each other variant runs fully local
through Veil's own loader and kernels:

* ``gguf-<type>``: the GGUF re-quantized by llama.cpp's own quantizer (``llama-cpp-python``,
  from the same Q4_1 file with requantization allowed; skipped if it is not importable) and
  loaded kept quantized (``--client-quant auto``); ``gguf-q4_1`` is the shipped file itself;
* ``int8`` / ``int4``: Veil's load-time quantization of the float32 model;
* ``...+i8a``: the same weights multiplied with int8 activations.

Metrics on a held-out text (Veil's own docs, written after the model was trained):
perplexity, and top-1 agreement with the float32 model at every position (teacher forced);
plus greedy agreement on the benchmark prompts (share of generated tokens identical to the
float32 model's before the first difference, and prompts fully identical).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LLAMA_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0")


def requantize(src: Path, out_dir: Path, ftype: str) -> Path | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    out = out_dir / f"{src.stem}-{ftype}.gguf"
    if out.is_file():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not quantize to {ftype} (rc {rc})")
    return out


def nll_and_top1(
    runner: Any, ids: list[int], chunk: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position negative log-likelihood of the next token and the argmax, in chunks of
    ``chunk`` tokens (each chunk a fresh context)."""
    nll, top = [], []
    for s in range(0, len(ids) - 1, chunk):
        piece = ids[s : s + chunk + 1]
        runner.reset()
        logits = runner.forward(piece[:-1], range(len(piece) - 1)).float()  # [L, V]
        lp = torch.log_softmax(logits, -1)
        tgt = torch.tensor(piece[1:])
        nll.append(-lp[torch.arange(len(tgt)), tgt])
        top.append(logits.argmax(-1))
    return torch.cat(nll), torch.cat(top)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    ap.add_argument("--text", nargs="*", default=None, help="held-out text files")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "bench" / "prompts.jsonl"))
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--n-prompts", type=int, default=0, help="only the first N prompts (0: all)")
    ap.add_argument("--work", default="bench-out/quality", help="where re-quantized files go")
    ap.add_argument("--only", default=None, help="comma-separated variant names to run")
    ap.add_argument("--out", default=None, help="results JSON (merged with an existing one)")
    args = ap.parse_args()

    from app.cmd_bench import machine
    from engine.chat import messages_for, prompt_ids
    from engine.generate import generate
    from engine.loading import embedded_gguf
    from engine.sampling import SamplingParams
    from engine.split import SplitRunner, load_client

    src = Path(args.model) if args.model else embedded_gguf()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    files = args.text or [str(ROOT / "docs" / n) for n in ("privacy.md", "architecture.md")]
    text = "\n\n".join(Path(f).read_text(encoding="utf-8") for f in files)
    variants: list[tuple[str, str, str]] = [
        ("float32", str(src), "none"),
        ("gguf-q4_1", str(src), "auto"),
    ]
    for ft in LLAMA_TYPES:
        path = requantize(src, work, ft)
        if path is not None:
            variants.append((f"gguf-{ft.lower()}", str(path), "auto"))
    variants += [("int8", str(src), "int8"), ("int4", str(src), "int4")]
    variants += [(n + "+i8a", m, q) for n, m, q in variants[1:]]
    if args.only:
        keep = set(args.only.split(","))
        variants = [v for v in variants if v[0] in keep or v[0] == "float32"]
    prompts = [json.loads(x) for x in Path(args.prompts).read_text().splitlines() if x.strip()]
    prompts = prompts[: args.n_prompts] if args.n_prompts > 0 else prompts

    from engine import kernels

    results: dict[str, Any] = {}
    if args.out and Path(args.out).is_file():
        results = json.loads(Path(args.out).read_text()).get("results", {})
    ref_file = work / "float32-reference.pt"
    ref_top: torch.Tensor | None = None
    ref_gen: list[list[int]] = []
    if ref_file.is_file():
        ref_top, ref_gen = torch.load(ref_file)
    for name, model, quant in variants:
        if name == "float32" and ref_top is not None:
            continue
        kernels.set_int8_activations(name.endswith("+i8a"))
        from engine.loading import load_config, resolve

        half = (load_config(resolve(model).folder).n_layers + 1) // 2  # fully local
        client = load_client(model, half, client_quant=quant)
        runner = SplitRunner(client, None)
        ids = client.tokenizer(text)["input_ids"][: args.max_tokens]
        nll, top = nll_and_top1(runner, ids)
        gens = []
        for p in prompts:
            pid = prompt_ids(client.tokenizer, messages_for(p["prompt"], None))
            runner.reset()
            gens.append(
                generate(runner, pid, SamplingParams(max_new_tokens=args.gen_tokens)).token_ids
            )
        row: dict[str, Any] = {
            "client_quant": client.client_quant,
            "local_param_bytes": client.local_param_bytes(),
            "formats": sorted(
                {w.fmt for w in _matrices(client) if hasattr(w, "fmt")}
                | (
                    {"float32"}
                    if any(isinstance(w, torch.Tensor) for w in _matrices(client))
                    else set()
                )
            ),
            "perplexity": round(math.exp(nll.mean().item()), 4),
            "tokens": len(ids),
        }
        if ref_top is None:
            ref_top, ref_gen = top, gens
            torch.save((top, gens), ref_file)
        else:
            row["top1_agreement"] = round((top == ref_top).float().mean().item(), 4)
            same_prefix = []
            for a, b in zip(gens, ref_gen, strict=True):
                n = 0
                while n < min(len(a), len(b)) and a[n] == b[n]:
                    n += 1
                same_prefix.append(n / max(len(b), 1))
            row["greedy_prefix_agreement"] = round(sum(same_prefix) / len(same_prefix), 4)
            row["greedy_identical_prompts"] = (
                f"{sum(a == b for a, b in zip(gens, ref_gen, strict=True))}/{len(gens)}"
            )
        results[name] = row
        print(name, json.dumps(row), flush=True)
    out = {"machine": machine(), "text_files": files, "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def _matrices(client: Any) -> list[Any]:
    out = [client.lm_head]
    for stack in (client.head, client.tail):
        for w in stack.layers:
            out += [w.wqkv, w.wo, w.wgu, w.wdown]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
