"""`veil train-draft` from end to end: make data with the model, train a head, measure it on
held-out self-prompts, write the head file.

Everything lands in a work folder (by default in the user cache, one per model and split):
the recorded samples, a manifest of what making them cost, and a training checkpoint, so
``resume`` picks an interrupted run up where it stopped. A CUDA GPU is used when there is one.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.drafts import checkpoint as checkpoint_file
from engine.drafts.dataset import (
    DataOptions,
    Manifest,
    Report,
    _no_report,
    cpu_seconds,
    load_samples,
    make_data,
    trained_tokens,
)
from engine.drafts.head import DraftHead, DraftHeadNet, HeadShape, model_fingerprint, save_head
from engine.drafts.selfgen import TOPK, BatchModel, Sample
from engine.drafts.train import (
    Frozen,
    TrainOptions,
    depth_acceptance,
    draft_vocab,
    train_head,
    vocab_coverage,
)
from engine.errors import VeilError
from engine.loading import WeightReader, cache_root, load_config, resolve
from engine.model import rope_inv_freq
from engine.split import SplitPlan


@dataclass
class DraftTrainOptions:
    tokens: int = 160_000  # recorded positions (self-prompts + replies, + local text)
    steps: int = 0  # optimizer steps; 0: ten passes over the data
    resume: bool = False
    text_dir: Path | None = None
    local_layers: int = 2  # the split whose features the head reads (k at each end)
    vocab_size: int = 4096  # draft vocabulary (0: all tokens)
    intermediate: int | None = None  # head MLP width (default: half the model's)
    device: str | None = None  # None: cuda when available, else cpu
    work_dir: Path | None = None
    gen_batch: int = 0  # rows generated together; 0: 64 on a CPU, up to 1,024 on a GPU
    minutes: float = 0.0  # > 0: training stops after about this long (fewer steps)
    reply_tokens: int = 256
    heldout: float = 0.04  # share of samples kept aside for the acceptance report
    seed: int = 0


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_gen_batch(
    device: str,
    config: ModelConfig | None = None,
    reply_tokens: int = 256,
    prompt_tokens: int = 128,
) -> int:
    """Replies generated together: a CPU is busy with 64; a GPU fills with up to 1,024, as many
    as half its free memory holds once the model is loaded (``config`` given): per row the
    float32 KV caches of ``prompt_tokens + reply_tokens`` positions (twice: dropping finished
    rows copies them), the recorded features and top-k, and a few vocabulary-wide rows for the
    logits and sampling. The default model fits 1,024 rows on a large GPU; an 8B model far
    fewer."""
    if not device.startswith("cuda"):
        return 64
    if config is None or not torch.cuda.is_available():
        return 1024
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    span = prompt_tokens + reply_tokens
    kv = 2 * config.n_layers * config.n_kv_heads * config.head_dim * span * 4
    records = reply_tokens * (3 * config.hidden_size * 2 + TOPK * 6)
    vocab_rows = 4 * config.vocab_size * 4
    per_row = 2 * kv + records + vocab_rows
    return max(1, min(1024, int(0.5 * free) // per_row))


def split_heldout(samples: list[Sample], share: float) -> tuple[list[Sample], list[Sample]]:
    """A fixed, content-keyed share of the replies for measuring, the rest for training."""

    def key(s: Sample) -> int:
        return int(hashlib.sha1(s.tokens.numpy().tobytes()).hexdigest()[:8], 16)

    cut = int(share * 2**32)
    train = [s for s in samples if s.kind != "reply" or key(s) >= cut]
    held = [s for s in samples if s.kind == "reply" and key(s) < cut]
    return train, held


def feature_sample(samples: list[Sample], rows: int = 20_000) -> torch.Tensor:
    """Up to ``rows`` feature rows spread over the samples (for standardization)."""
    every = max(1, sum(len(s) - 1 for s in samples) // rows)
    parts = [s.feats[::every].float() for s in samples]
    return torch.cat(parts)[:rows]


def load_frozen(reader: Any, cfg: Any, vocab: torch.Tensor | None, device: str) -> Frozen:
    """The model's embedding, final norm and the draft vocabulary's LM head rows."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
    if not tied:
        names.append("lm_head.weight")
    t = reader.read(names, device=device)
    embed = t["model.embed_tokens.weight"]
    lm_head = embed if tied else t["lm_head.weight"]
    ids = vocab if vocab is not None else torch.arange(cfg.vocab_size)
    to_draft = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    to_draft[ids] = torch.arange(ids.numel())
    rows = lm_head[ids.to(device)].contiguous()
    return Frozen(embed, t["model.norm.weight"], rows, cfg.rms_eps, to_draft)


def train_draft(
    spec: str, out: Path, opts: DraftTrainOptions, report: Report = _no_report
) -> dict[str, Any]:
    """Make data, train, measure, save. Returns the summary also stored in the head file."""
    t_wall, t_cpu = time.perf_counter(), cpu_seconds()
    device = opts.device or default_device()
    resolved = resolve(spec)
    cfg = load_config(resolved.folder)
    reader = WeightReader(resolved.folder)
    plan = SplitPlan.symmetric(cfg.n_layers, opts.local_layers)
    taps = (plan.head, plan.n_layers - plan.tail, plan.n_layers)
    cf, wf = model_fingerprint(reader, cfg)
    work = opts.work_dir or cache_root() / "draft-train" / f"{cf}-{wf}-{taps[0]}-{taps[1]}"
    if not opts.resume and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    checkpoint_file.refuse_old(work)  # before hours of data making, not after

    # 1. data, made by the model
    man = Manifest(work)
    if man.data["tokens"] < opts.tokens or (opts.text_dir and not man.data.get("text_done")):
        model = BatchModel(resolved, taps, device=device)
        data = DataOptions(
            tokens=opts.tokens,
            batch=opts.gen_batch or default_gen_batch(device, cfg, opts.reply_tokens),
            reply_tokens=opts.reply_tokens,
            text_dir=opts.text_dir,
            seed=opts.seed,
        )
        man = make_data(model, work, data, report)
        del model
    samples = load_samples(work)
    if not samples:
        raise VeilError("the model produced no usable training text")
    train, held = split_heldout(samples, opts.heldout)

    # 2. the head, trained against the model's own distributions
    vocab: torch.Tensor | None = None
    if 0 < opts.vocab_size < cfg.vocab_size:
        vocab = draft_vocab(train, opts.vocab_size, cfg.vocab_size)
    ids = vocab if vocab is not None else torch.arange(cfg.vocab_size)
    frozen = load_frozen(reader, cfg, vocab, device)
    net = DraftHeadNet(HeadShape.for_model(cfg, opts.intermediate or cfg.intermediate_size // 2))
    net.set_feature_stats(feature_sample(train))
    net.reset_parameters(torch.Generator().manual_seed(opts.seed))
    net = net.to(device)
    inv_freq = rope_inv_freq(cfg).to(device)
    topts = TrainOptions(steps=opts.steps, seed=opts.seed, minutes=opts.minutes)
    state = None
    saved = checkpoint_file.load(work) if opts.resume else None
    if saved is not None and torch.equal(saved[2], ids.cpu()):
        try:
            net.load_state_dict(saved[0])
        except RuntimeError:
            raise checkpoint_file.CheckpointError(
                f"{work / checkpoint_file.FILE} is for another head shape; delete it and run "
                "again with --resume to restart training on the data already recorded"
            ) from None
        state = saved[1]

    def checkpoint(n: torch.nn.Module, st: dict[str, Any]) -> None:
        checkpoint_file.save(work, n, st, ids)

    result = train_head(
        net, frozen, train, inv_freq, topts, report=report, state=state, checkpoint=checkpoint
    )

    # 3. how the head alone does on held-out self-prompts
    report("measuring", 0, 1, {})
    acc = depth_acceptance(net, frozen, held, inv_freq) if held else {}
    info: dict[str, Any] = {
        "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": device,
        "data_tokens": man.data["tokens"],
        "samples": len(samples),
        "heldout_samples": len(held),
        "train_tokens": sum(trained_tokens(s) for s in train),
        "data_cpu_s": round(man.data["cpu_s"], 1),
        "data_wall_s": round(man.data["wall_s"], 1),
        "train_steps": result.steps,
        "train_cpu_s": round(result.cpu_s, 1),
        "train_wall_s": round(result.wall_s, 1),
        "final_loss": round(result.losses[-1], 4) if result.losses else None,
        "train_top1_by_step": [round(a, 4) for a in result.final_acc],
        "vocab_size": int(ids.numel()),
        "vocab_coverage_heldout": round(vocab_coverage(held, ids, cfg.vocab_size), 4)
        if held
        else None,
        "heldout_acceptance": acc,
        "options": {k: str(v) for k, v in asdict(opts).items()},
    }
    net = net.cpu()
    head = DraftHead(
        net, resolved.name, cf, wf, taps, vocab.cpu() if vocab is not None else None, info
    )
    save_head(head, out)
    info["run_cpu_s"] = round(cpu_seconds() - t_cpu, 1)
    info["run_wall_s"] = round(time.perf_counter() - t_wall, 1)
    (work / checkpoint_file.FILE).unlink(missing_ok=True)
    return info
