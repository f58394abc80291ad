"""The keyed-split attack at Llama-3-8B width: weight alignment + known-weights inversion on a
random-weight model with Llama-3-8B's shapes (issue 31).

    python bench/keyed_wide.py [--ks 1,2,4] [--noises 0,0.01] [--trunk-layers 1]
                               [--seqs 8] [--tokens 32] [--alphabet 64] [--vocab 128256]
                               [--seed 0] [--threads 2] [--out bench-out/keyed_wide.json]

The model: Llama-3-8B's config (hidden 4096, 32 query heads, 8 KV heads, head dim 128,
intermediate 14336, rope theta 500000, no rope scaling, RMSNorm eps 1e-5, vocab 128256) as a
transformers ``LlamaConfig`` read by :meth:`engine.config.ModelConfig.from_hf`, with
``n_layers = 2 k + trunk`` for each depth ``k`` (k local layers each side around the trunk).
Weights are drawn the way transformers initialises a Llama (every matrix and the embedding
N(0, 0.02²), norm weights 1), layer by layer from a generator seeded with ``(seed, layer)``,
and assembled with :meth:`engine.model.LayerWeights.from_tensors`. Only what the measurement
touches is built: the embedding, the head layers [0, k) and the trunk layers [k, k + trunk);
the tail layers and the LM head are never built (neither attack uses them).

For each k and keyed-noise level, with a fixed organisation key:

1. the organisation keys the trunk (:func:`engine.keyed.transform.derive` /
   :func:`~engine.keyed.transform.key_layers`) and checks on 32 random rows that the keyed
   trunk, turned back, computes what the plain trunk does;
2. the attacker runs :func:`engine.keyed.attacks.align_weights` on the public and keyed trunk
   weights (timed) and gets ``q_hat``; reported: :func:`~engine.keyed.attacks.rotation_error`;
3. input-side token recovery: ``--seqs`` random sequences of ``--tokens`` tokens go through the
   public head; the server observes ``h @ q`` (keyed) or ``h`` (plain split). The attacker
   turns the keyed states back with ``q_hat`` and inverts them with the audit's known-weights
   search (:func:`engine.audit.attacks.search_left_to_right`, the routine behind
   ``invert_known_weights``; same relative distance, same 1e-3 verification tolerance): left to
   right, every candidate token runs through the public head after the recovered prefix as one
   tree block, and the closest state wins. The prompt tokens are drawn from a fixed random
   ``--alphabet`` of token ids and the attacker tries the whole alphabet at every position (a
   random model gives no prior to order candidates by: at k = 1, nearest embedding and the
   audit's ridge-to-embedding decoder put the true token around 40,000th of 128256). A search
   of all 128256 ids would cost ~2000 times as much (extrapolated from the 64-token block: ~9
   minutes per position per layer on the 2-core machine). The plain split is the search's own
   observation (the check that the attack works); the keyed observations are scored against the
   same candidate states, i.e. with the prefix the plain search recovered. Where every keyed
   choice equals the plain one (``same_choices`` in the JSON) this is exactly the free-running
   search on the keyed states. Reported with each: the relative distance of the chosen
   candidate and of the closest other candidate (how much error in ``q_hat`` the search
   tolerates).

Top-1 comes with a Wilson 95% interval over positions. Run it under the shared CPU lock
(``flock /tmp/veil-cpu.lock``). On the 2-core Xeon: keying one trunk layer 23-30 s, alignment
2.2-3.5 min per trunk layer and noise level (6.5 min in a run on a busier machine), inversion
~0.3 s per position per head layer; 27 min for the defaults. Memory: peak 17.2 GB with one
trunk layer (the embedding 2.1 GB; ``align_weights`` holds both sides' matched MLP rows in
float64, ~10 GB per trunk layer), hence the default of one trunk layer.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import hashlib
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.cmd_bench import machine  # noqa: E402
from engine.audit.attacks import search_left_to_right  # noqa: E402
from engine.audit.report import pct  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.keyed.attacks import align_weights, rotation_error  # noqa: E402
from engine.keyed.transform import KeyedTransform, OrgKey, derive, key_layers  # noqa: E402
from engine.model import LayerStack, LayerWeights  # noqa: E402

# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json), layer count set per run
LLAMA3_8B: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
}
INIT_STD = 0.02  # transformers' Llama initializer_range
KEY = OrgKey(hashlib.sha256(b"veil bench keyed_wide fixed key").digest())
TOL = 1e-3  # invert_known_weights' verification tolerance


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def peak_gb() -> float:
    """Peak resident memory of this process so far, GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def llama3_8b_config(n_layers: int, vocab: int) -> ModelConfig:
    """Llama-3-8B's config with ``n_layers`` layers (and ``vocab`` tokens), as Veil reads it."""
    from transformers import LlamaConfig

    hf = LlamaConfig(**{**LLAMA3_8B, "vocab_size": vocab, "num_hidden_layers": n_layers})
    return ModelConfig.from_hf(hf)


def _gen(seed: int, what: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + what)


def random_embedding(cfg: ModelConfig, seed: int) -> torch.Tensor:
    """[V, H] float32, N(0, INIT_STD²), the same for every k."""
    g = _gen(seed, 1)
    return torch.empty(cfg.vocab_size, cfg.hidden_size).normal_(0.0, INIT_STD, generator=g)


def random_layer(cfg: ModelConfig, index: int, seed: int) -> LayerWeights:
    """Decoder layer ``index`` (float32, checkpoint names -> LayerWeights): the same weights
    for the same (seed, index) whatever the model's layer count."""
    g = _gen(seed, 1000 + index)
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    p = f"model.layers.{index}."
    t = {p + n: torch.empty(s).normal_(0.0, INIT_STD, generator=g) for n, s in shapes.items()}
    t[p + "input_layernorm.weight"] = torch.ones(h)
    t[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return LayerWeights.from_tensors(t, index, cfg)


def run_stack(stack: LayerStack, x: torch.Tensor) -> torch.Tensor:
    """One sequence [T, H] through ``stack`` from an empty cache."""
    stack.reset()
    out = stack.forward(x, torch.arange(x.shape[0]))
    stack.reset()
    return out


def wilson(hits: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score 95% interval of a proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = hits / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def invert_shared(
    head: LayerStack,
    embed: torch.Tensor,
    alphabet: list[int],
    truth: torch.Tensor,
    observed: dict[str, torch.Tensor],
) -> dict[str, dict[str, list[Any]]]:
    """Known-weights inversion of one sequence: the audit's left-to-right search over the whole
    ``alphabet`` per position on ``observed["plain"]``; every other observation [T, H] is
    scored against the same candidate states. Per observation: the chosen token, its relative
    distance and the closest other candidate's, per position."""
    cond: dict[str, dict[str, list[Any]]] = {
        name: {"chosen": [], "best": [], "second": [], "correct": []} for name in observed
    }
    obs = {name: o.float() for name, o in observed.items()}

    def distance(t: int, out: torch.Tensor) -> list[float]:
        plain: list[float] = []
        for name, o in obs.items():
            target = o[t]
            d = (out.float() - target).norm(dim=-1) / target.norm().clamp_min(1e-12)  # [b]
            two = d.topk(2, largest=False)
            c = cond[name]
            c["chosen"].append(alphabet[int(two.indices[0])])
            c["best"].append(float(two.values[0]))
            c["second"].append(float(two.values[1]))
            c["correct"].append(alphabet[int(two.indices[0])] == int(truth[t]))
            if name == "plain":
                plain = d.tolist()
        return plain

    res = search_left_to_right(
        head, embed, len(truth), lambda t: alphabet, distance, (len(alphabet),), TOL
    )
    # the search's own choice is the plain observation's nearest candidate
    assert res.top5[:, 0].tolist() == cond["plain"]["chosen"]
    return cond


def summarise(
    conds: list[dict[str, list[Any]]], plain: list[dict[str, list[Any]]]
) -> dict[str, Any]:
    """Top-1 with its Wilson interval, verified share and distances over all sequences."""
    correct = [c for x in conds for c in x["correct"]]
    best = torch.tensor([b for x in conds for b in x["best"]])
    second = torch.tensor([s for x in conds for s in x["second"]])
    hits, n = sum(correct), len(correct)
    same = all(x["chosen"] == p["chosen"] for x, p in zip(conds, plain, strict=True))
    return {
        "top1": hits / n,
        "top1_ci": wilson(hits, n),
        "hits": hits,
        "positions": n,
        "verified": float((best < TOL).float().mean()),
        "best_dist_median": float(best.median()),
        "best_dist_max": float(best.max()),
        "second_dist_min": float(second.min()),
        "same_choices": same,
    }


def measure_k(
    k: int,
    args: argparse.Namespace,
    embed: torch.Tensor,
    alphabet: list[int],
    seqs: torch.Tensor,
) -> list[dict[str, Any]]:
    n_layers = 2 * k + args.trunk_layers
    cfg = llama3_8b_config(n_layers, args.vocab)
    lo, hi = k, k + args.trunk_layers
    model_fp = f"bench-keyed-wide-llama3-8b-shape-seed{args.seed}-L{n_layers}"
    log(f"k={k}: {n_layers}-layer config; building public trunk layers [{lo}, {hi})")
    trunk = [random_layer(cfg, i, args.seed) for i in range(lo, hi)]
    plain_trunk = LayerStack(cfg, lo, trunk)
    probe = torch.empty(32, cfg.hidden_size).normal_(0.0, 1.0, generator=_gen(args.seed, 7))
    plain_out = run_stack(plain_trunk, probe)
    rows: list[dict[str, Any]] = []
    keys: dict[float, tuple[KeyedTransform, torch.Tensor]] = {}
    for noise in args.noises:
        t0 = time.perf_counter()
        tf = derive(KEY, cfg, model_fp, lo, hi, noise)
        keyed = key_layers(trunk, cfg, tf, KEY, model_fp)
        t_key = time.perf_counter() - t0
        out = tf.rotate_out(run_stack(LayerStack(cfg, lo, keyed), tf.rotate_in(probe)))
        check = float((out - plain_out).norm() / plain_out.norm())
        log(f"k={k} noise {noise:g}: keyed in {t_key:.0f} s (trunk check {check:.2g}); aligning")
        t0 = time.perf_counter()
        al = align_weights(trunk, keyed, cfg)
        t_align = time.perf_counter() - t0
        err = rotation_error(al.q_hat, tf.q)
        log(
            f"k={k} noise {noise:g}: alignment {t_align:.0f} s, {al.iterations} iterations, "
            f"q error {err:.2g}, peak {peak_gb():.1f} GB"
        )
        keys[noise] = (tf, al.q_hat.float())
        rows.append(
            {
                "k": k,
                "noise": noise,
                "n_layers": n_layers,
                "trunk_layers": [lo, hi],
                "key_s": round(t_key, 1),
                "align_s": round(t_align, 1),
                "align_iterations": al.iterations,
                "align_agreement": al.matched_agreement,
                "align_residual": al.residual,
                "q_error": err,
                "trunk_check_rel": check,
            }
        )
        del keyed, al, out
        gc.collect()
    del trunk, plain_trunk
    gc.collect()

    log(f"k={k}: building public head layers [0, {k})")
    head = LayerStack(cfg, 0, [random_layer(cfg, i, args.seed) for i in range(k)])
    results: dict[str, list[dict[str, list[Any]]]] = {"plain": []}
    for noise in args.noises:
        results[f"keyed {noise:g}"] = []
    t0 = time.perf_counter()
    for j, s in enumerate(seqs):
        h = run_stack(head, embed[s])  # [T, H]: the plain head output
        observed = {"plain": h}
        for noise, (tf, q_hat) in keys.items():
            seen = tf.rotate_in(h)  # what the keyed server receives: h @ q
            observed[f"keyed {noise:g}"] = seen @ q_hat.T  # the attacker turns it back
        conds = invert_shared(head, embed, alphabet, s, observed)
        for name, c in conds.items():
            results[name].append(c)
        log(
            f"k={k}: sequence {j + 1}/{len(seqs)} inverted "
            + ", ".join(f"{n} {sum(c['correct'])}/{len(s)}" for n, c in conds.items())
            + f" ({time.perf_counter() - t0:.0f} s)"
        )
    t_inv = time.perf_counter() - t0
    plain = summarise(results["plain"], results["plain"])
    for row in rows:
        row["invert_s"] = round(t_inv, 1)
        row["plain"] = plain
        row["keyed"] = summarise(results[f"keyed {row['noise']:g}"], results["plain"])
    del head
    gc.collect()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| k | keyed noise | alignment time | q error | plain split: input top-1 [95% CI] "
        "| keyed: input top-1 after alignment [95% CI] | keyed verified (< 1e-3) "
        "| keyed: chosen distance (median) | closest other candidate (min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, kd = r["plain"], r["keyed"]
        lines.append(
            f"| {r['k']} | {r['noise']:g} | {r['align_s']:.0f} s | {r['q_error']:.2g} | "
            f"{pct(p['top1'])} [{pct(p['top1_ci'][0])}, {pct(p['top1_ci'][1])}] | "
            f"{pct(kd['top1'])} [{pct(kd['top1_ci'][0])}, {pct(kd['top1_ci'][1])}] | "
            f"{pct(kd['verified'])} | {kd['best_dist_median']:.2g} | "
            f"{kd['second_dist_min']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ks", default="1,2,4", help="local layers each side (comma-separated)")
    ap.add_argument("--noises", default="0,0.01", help="keyed-trunk noise levels")
    ap.add_argument("--trunk-layers", type=int, default=1, help="trunk layers (~10 GB each)")
    ap.add_argument("--seqs", type=int, default=8, help="random token sequences")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--alphabet", type=int, default=64, help="token ids the prompts use")
    ap.add_argument("--vocab", type=int, default=LLAMA3_8B["vocab_size"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="results JSON")
    args = ap.parse_args()
    args.ks = [int(x) for x in args.ks.split(",")]
    args.noises = [float(x) for x in args.noises.split(",")]
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    cfg0 = llama3_8b_config(2 * max(args.ks) + args.trunk_layers, args.vocab)
    log(f"embedding [{cfg0.vocab_size}, {cfg0.hidden_size}] (no LM head: no attack uses it)")
    embed = random_embedding(cfg0, args.seed)
    g = _gen(args.seed, 2)
    alphabet = torch.randperm(args.vocab, generator=g)[: args.alphabet].tolist()
    seqs = torch.tensor(alphabet)[
        torch.randint(args.alphabet, (args.seqs, args.tokens), generator=g)
    ]
    rows: list[dict[str, Any]] = []
    for k in args.ks:
        rows += measure_k(k, args, embed, alphabet, seqs)
        log(f"k={k} done; peak memory {peak_gb():.1f} GB")
    wall = time.perf_counter() - t_start
    print()
    print(table(rows))
    mem = peak_gb()
    print(f"\nwall {wall:.0f} s, peak memory {mem:.1f} GB, {machine()}, {args.threads} threads")
    if args.out:
        out = {
            "date": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
            "cpu": machine(),
            "threads": args.threads,
            "torch": torch.__version__,
            "config": {**LLAMA3_8B, "vocab_size": args.vocab, "init_std": INIT_STD},
            "layers": "n_layers = 2k + trunk_layers; built: embedding, head [0, k), "
            "trunk [k, k + trunk_layers); not built: tail, LM head",
            "settings": {
                "ks": args.ks,
                "noises": args.noises,
                "trunk_layers": args.trunk_layers,
                "seqs": args.seqs,
                "tokens": args.tokens,
                "alphabet": args.alphabet,
                "seed": args.seed,
                "key_id": KEY.key_id,
                "tolerance": TOL,
            },
            "alphabet_ids": alphabet,
            "rows": rows,
            "wall_s": round(wall, 1),
            "peak_rss_gb": round(peak_gb(), 2),
        }
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1), encoding="utf-8")
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
