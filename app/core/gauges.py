"""Numbers for the gauges panel: local memory for a split, process memory, a rolling tokens/s
history for the chart."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of one decoder layer (attention + MLP + its two norms)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q = h * cfg.n_heads * hd
    kv = 2 * h * cfg.n_kv_heads * hd
    o = cfg.n_heads * hd * h
    bias = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd if cfg.attn_bias else 0
    mlp = 3 * h * cfg.intermediate_size
    return q + kv + o + bias + mlp + 2 * h


def local_weight_bytes(cfg: ModelConfig, k: int, dtype: str = "float32") -> int:
    """Bytes of weights on this computer when ``k`` layers run locally at each end:
    embedding + LM head (once when tied) + final norm + the 2k local layers (k + k, fewer
    when both ends meet)."""
    per = DTYPE_BYTES.get(dtype.lower(), 4)
    emb = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else emb
    n_local = min(2 * k, cfg.n_layers)
    return per * (emb + head + cfg.hidden_size + n_local * layer_params(cfg))


def max_local_layers(cfg: ModelConfig) -> int:
    """The slider's rightmost value: every layer on this computer."""
    return (cfg.n_layers + 1) // 2


# What the performance panel calls this app's memory, and the line under it that says exactly
# what is counted. It is always more than "Model memory needed here" (the weights only).
RSS_LABEL = "Veil's memory use now"
RSS_SERVER_LABEL = "Veil's memory use now, with its built-in server"
VRAM_LABEL = "Graphics card memory in use"
PEAK_LABEL = "Veil's highest memory use"
MEMORY_NOTES = {
    RSS_LABEL: "This app: the model's weights here, their working memory and the window.",
    RSS_SERVER_LABEL: (
        "This app (the model's ends, their working memory, the window) and the built-in server "
        "on this computer, which runs the model's middle."
    ),
    VRAM_LABEL: "What this app has allocated on the graphics card.",
    PEAK_LABEL: "The most this app has used since it started (its current use is not known).",
}
MEMORY_NOTE = MEMORY_NOTES[RSS_LABEL]


def _rss(pid: int | None = None) -> int | None:
    """Resident memory of a process (this one when ``pid`` is None), None when unknown."""
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        pass
    except Exception:  # gone, or not ours to read
        return None
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def process_memory_bytes(device: str = "cpu", helpers: Sequence[int] = ()) -> tuple[int, str]:
    """(bytes, label): VRAM allocated on CUDA, else the resident memory (RSS) of this process
    plus the ``helpers`` (the built-in server's process id), and a label saying which."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.memory_allocated()), VRAM_LABEL
    own = _rss()
    if own is None:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, PEAK_LABEL
    extra = [b for b in (_rss(pid) for pid in helpers) if b is not None]
    return own + sum(extra), RSS_SERVER_LABEL if extra else RSS_LABEL


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


@dataclass
class GaugeState:
    """The latest values shown in the gauges panel (None = not known yet)."""

    tokens_per_s: float | None = None
    tokens_per_round_trip: float | None = None
    rtt_ms: float | None = None
    memory_bytes: int | None = None
    memory_label: str = RSS_LABEL
    connection: str = "Not started"
    generating: bool = False
    # (time, tokens/s, reply number): the chart joins points of one reply only
    history: deque[tuple[float, float, int]] = field(default_factory=lambda: deque(maxlen=600))
    run: int = 0

    def begin_run(self) -> None:
        """A new reply starts: its speed points are not joined to the previous reply's."""
        self.run += 1

    def record(self, tok_s: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.tokens_per_s = tok_s
        self.history.append((now, tok_s, self.run))

    def last_minute(self, now: float | None = None) -> list[tuple[float, float]]:
        """(seconds ago, tokens/s) points from the last 60 s, oldest first."""
        now = time.monotonic() if now is None else now
        return [(now - t, v) for t, v, _ in self.history if now - t <= 60.0]

    def last_minute_runs(self, now: float | None = None) -> list[list[tuple[float, float]]]:
        """The last minute's points as one list per reply, so a chart draws no line across
        the idle time between replies."""
        now = time.monotonic() if now is None else now
        out: list[list[tuple[float, float]]] = []
        last_run: int | None = None
        for t, v, run in self.history:
            if now - t > 60.0:
                continue
            if run != last_run:
                out.append([])
                last_run = run
            out[-1].append((now - t, v))
        return out
