"""The draft head's training set on disk: shards of recorded samples made by
:mod:`engine.drafts.selfgen`, a manifest with what making them cost, and resumption.

A work folder holds ``manifest.json`` and ``shard-NNNNN.pt`` files (lists of
:class:`~engine.drafts.selfgen.Sample` as plain tensors). Generation appends shards until the
token target is met, so an interrupted run resumes where it stopped (``--resume``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.drafts.selfgen import BatchModel, Sample, read_text_chunks, user_turn_prefix

# (stage, done, total, extra numbers) -> None; the CLI draws a bar from it
Report = Callable[[str, float, float, dict[str, float]], None]


def _no_report(stage: str, done: float, total: float, info: dict[str, float]) -> None:
    pass


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children."""
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


@dataclass
class DataOptions:
    tokens: int = 200_000  # recorded positions to make (prompts + replies, system prefix excluded)
    batch: int = 64  # rows generated together
    prompt_tokens: int = 64  # longest self-prompt
    reply_tokens: int = 256  # longest reply
    temperature: float = 1.0  # self-prompts are sampled
    top_p: float = 0.95
    text_dir: Path | None = None  # local text, read teacher-forced
    text_share: float = 0.3  # at most this share of the tokens from local text
    seed: int = 0


class Manifest:
    """``manifest.json``: shard list, token counts and the time spent making them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / "manifest.json"
        self.data: dict[str, Any] = {"shards": [], "tokens": 0, "cpu_s": 0.0, "wall_s": 0.0}
        if self.path.is_file():
            self.data.update(json.loads(self.path.read_text(encoding="utf-8")))

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1), encoding="utf-8")
        tmp.replace(self.path)


def save_shard(path: Path, samples: list[Sample]) -> None:
    rows = [
        {
            "tokens": s.tokens,
            "feats": s.feats,
            "top_ids": s.top_ids,
            "top_lp": s.top_lp,
            "start": s.start,
            "kind": s.kind,
        }
        for s in samples
    ]
    tmp = path.with_suffix(".tmp")
    torch.save(rows, tmp)
    os.replace(tmp, path)


def load_shard(path: Path) -> list[Sample]:
    rows = torch.load(path, weights_only=True)
    return [
        Sample(r["tokens"], r["feats"], r["top_ids"], r["top_lp"], int(r["start"]), str(r["kind"]))
        for r in rows
    ]


def load_samples(folder: Path) -> list[Sample]:
    m = Manifest(folder)
    out: list[Sample] = []
    for name in m.data["shards"]:
        out.extend(load_shard(folder / name))
    return out


def trained_tokens(s: Sample) -> int:
    return max(len(s) - 1 - s.start, 0)


def make_data(
    model: BatchModel,
    folder: Path,
    opts: DataOptions,
    report: Report = _no_report,
) -> Manifest:
    """Add shards to ``folder`` until it holds ``opts.tokens`` trained positions."""
    from engine.chat import messages_for, prompt_ids

    folder.mkdir(parents=True, exist_ok=True)
    man = Manifest(folder)
    tok = model.tokenizer
    eos = model.config.eos_token_ids
    prefix = user_turn_prefix(tok)

    def chat(text: str) -> list[int]:
        return prompt_ids(tok, messages_for(text))

    system_len = _common_prefix_len(chat("a"), chat("b"))
    if opts.text_dir is not None and not man.data.get("text_done"):
        _add_text(model, folder, man, opts, report)
    seen: set[str] = set(man.data.get("prompt_hashes", []))
    while man.data["tokens"] < opts.tokens:
        t_wall, t_cpu = time.perf_counter(), cpu_seconds()
        idx = len(man.data["shards"])
        gen = torch.Generator(device=model.device).manual_seed(opts.seed * 100_003 + idx)
        # 1. self-prompts: the model writes user messages after the user-turn prefix
        report("self-prompts", man.data["tokens"], opts.tokens, {})
        outs = model.run(
            [prefix] * opts.batch,
            opts.prompt_tokens,
            eos=eos,
            temperature=opts.temperature,
            top_p=opts.top_p,
            generator=gen,
        )
        prompts: list[list[int]] = []
        for new, _ in outs:
            if not new or new[-1] not in eos or len(new) < 5:
                continue  # cut off, or too short to be a request
            text = tok.decode(new[:-1], skip_special_tokens=True).strip()
            key = hashlib.sha1(text.encode()).hexdigest()[:12]
            if not text or key in seen:
                continue
            seen.add(key)
            prompts.append(chat(text))
        if not prompts:
            continue
        # 2. greedy replies, recorded
        report("replies", man.data["tokens"], opts.tokens, {"prompts": len(prompts)})
        prompts.sort(key=len)
        res = model.run(
            prompts, opts.reply_tokens, eos=eos, record_from=[system_len] * len(prompts)
        )
        samples = [s for _, s in res if s is not None and trained_tokens(s) > 0]
        name = f"shard-{idx:05d}.pt"
        save_shard(folder / name, samples)
        man.data["shards"].append(name)
        man.data["tokens"] += sum(trained_tokens(s) for s in samples)
        man.data["samples"] = man.data.get("samples", 0) + len(samples)
        man.data["prompt_hashes"] = sorted(seen)
        man.data["cpu_s"] += cpu_seconds() - t_cpu
        man.data["wall_s"] += time.perf_counter() - t_wall
        man.save()
        report("replies", man.data["tokens"], opts.tokens, {})
    return man


def _add_text(
    model: BatchModel, folder: Path, man: Manifest, opts: DataOptions, report: Report
) -> None:
    """Local text, teacher-forced in batches (the model reads it once; nothing is generated)."""
    assert opts.text_dir is not None
    t_wall, t_cpu = time.perf_counter(), cpu_seconds()
    limit = int(opts.tokens * opts.text_share)
    chunks = read_text_chunks(opts.text_dir, model.tokenizer, 256, limit)
    random.Random(opts.seed).shuffle(chunks)
    samples: list[Sample] = []
    for i in range(0, len(chunks), opts.batch):
        report("local text", i, len(chunks), {})
        part = chunks[i : i + opts.batch]
        # run() needs one generated token to finish; the recorded prompt is what we keep
        res = model.run(part, 1, eos=[], record_from=[0] * len(part))
        for ids, (_, s) in zip(part, res, strict=True):
            if s is None:
                continue
            n = len(ids)
            samples.append(
                Sample(
                    s.tokens[:n], s.feats[: n - 1], s.top_ids[: n - 1], s.top_lp[: n - 1], 0, "text"
                )
            )
    if samples:
        name = f"shard-{len(man.data['shards']):05d}.pt"
        save_shard(folder / name, samples)
        man.data["shards"].append(name)
        man.data["tokens"] += sum(trained_tokens(s) for s in samples)
        man.data["text_tokens"] = sum(trained_tokens(s) for s in samples)
    man.data["text_done"] = True
    man.data["cpu_s"] += cpu_seconds() - t_cpu
    man.data["wall_s"] += time.perf_counter() - t_wall
    man.save()


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
