"""Decoding over a :class:`~engine.split.SplitRunner`: small functions that return their stats.

:class:`Output` owns everything that happens when a token is *committed* — EOS, stop strings,
max tokens, streaming detokenization, the user's callback — so every decoder (sequential here,
speculative in ``engine.speculative``) commits tokens one at a time through it and honours stop
conditions exactly, even in the middle of an accepted path.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch

from engine.detok import StreamingDetokenizer
from engine.errors import GenerationError
from engine.sampling import SamplingParams, pick
from engine.split import BlockStates, InFlight, SplitRunner

TextCallback = Callable[[str], None]
PrefillCallback = Callable[[int, int], None]  # (prompt rows read so far, rows in the prompt)
T = TypeVar("T")


class CancelToken:
    """Set from any thread; decoders check it between steps."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    round_trips: int = 0  # trunk calls (model calls when fully local), prefill included
    tree_nodes_sent: int = 0
    accepted_hist: dict[int, int] = field(default_factory=dict)
    draft_s: float = 0.0  # time spent drafting (proposing trees and learning from rounds)
    one_token_steps: int = 0  # speculative rounds sent without a tree (drafting did not pay)
    pipelined_rounds: int = 0  # rounds sent while the round before was in flight
    pipeline_hits: int = 0  # of which the bet on the round before was exact (verified)
    cold_rounds: int = 0  # rounds whose time included a first-use compile (not learned from)
    stalled_rounds: int = 0  # rounds far slower than predicted, alone (not learned from)

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first token (the first is counted in ttft)."""
        n = self.new_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def rows_per_token(self) -> float:
        """Trunk rows sent per token committed after the first (tree nodes, roots included;
        the prompt's rows are not counted): 1.0 for sequential decoding."""
        n = self.new_tokens - 1
        return self.tree_nodes_sent / n if n > 0 else 0.0

    @property
    def tokens_per_round_trip(self) -> float:
        return self.new_tokens / self.round_trips if self.round_trips else 0.0

    @property
    def draft_ms_per_round(self) -> float:
        """Drafting time per decode round trip (the prompt's included in the first)."""
        rounds = self.round_trips - 1
        return 1000 * self.draft_s / rounds if rounds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["decode_tok_s"] = self.decode_tok_s
        d["tokens_per_round_trip"] = self.tokens_per_round_trip
        d["rows_per_token"] = self.rows_per_token
        d["draft_ms_per_round"] = self.draft_ms_per_round
        d["accepted_hist"] = {str(k): v for k, v in sorted(self.accepted_hist.items())}
        return d


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # eos | stop | length | cancelled | context
    stats: GenerationStats


class Output:
    """Committed tokens, streamed text and stop conditions of one generation."""

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        eos_ids: Sequence[int],
        on_text: TextCallback | None = None,
    ) -> None:
        self.params = params
        self.eos = set(eos_ids)
        self.on_text = on_text
        self.detok = StreamingDetokenizer(tokenizer)
        self.token_ids: list[int] = []
        self.text = ""  # text released to the caller (stop strings removed)
        self._pending = ""  # decoded text held back because it may start a stop string
        self.finish_reason: str | None = None
        self._max_stop = max((len(s) for s in params.stop), default=0)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> bool:
        """Commit one token; returns True when generation must end here."""
        if self.done:
            raise GenerationError("internal: token committed after the end of generation")
        self.token_ids.append(token)
        if token in self.eos:
            self.finish_reason = "eos"
            self._release(self.detok.flush(), final=True)
            return True
        self._release(self.detok.push(token), final=False)
        if self.done:
            return True
        if len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
            self._release(self.detok.flush(), final=True)
            return True
        return False

    def finish(self, reason: str) -> None:
        if not self.done:
            self.finish_reason = reason
            self._release(self.detok.flush(), final=True)

    def _release(self, delta: str, final: bool) -> None:
        buf = self._pending + delta
        if self.params.stop and not self.done:
            hits = [(buf.find(s), s) for s in self.params.stop if s and s in buf]
            if hits:
                at = min(h[0] for h in hits)
                buf = buf[:at]
                self.finish_reason = "stop"
                final = True
        if final or not self._max_stop:
            out, self._pending = buf, ""
        else:
            hold = 0  # longest tail of buf that is a prefix of some stop string
            for s in self.params.stop:
                for n in range(min(len(s) - 1, len(buf)), hold, -1):
                    if buf.endswith(s[:n]):
                        hold = n
                        break
            out, self._pending = (buf[: len(buf) - hold], buf[len(buf) - hold :])
        if out:
            self.text += out
            if self.on_text:
                self.on_text(out)


@dataclass(frozen=True)
class Prefill:
    """How a decoder reads the prompt before the first new token.

    ``chunk=None`` reads it as one block. With ``chunk`` the prompt goes through the whole
    split (head, trunk, tail) as consecutive chain blocks of at most ``chunk`` rows; each
    attends to everything cached before it, which for a chain is exactly its prefix, so it is
    the same computation (as the transport's chunked steps, ``engine.transport.policy``; the
    float sums may round differently in the last bits). Between blocks ``on_progress(done,
    total)`` is called and the cancel token is checked, so a long prompt shows how far it is
    and can be stopped.

    Through a trunk server up to ``window`` blocks are in flight (:func:`read_prompt`): the
    client's head layers for block c+1 run while the trunk works on block c, and block c's
    tail layers while the trunk works on c+1. ``window=1`` waits for each block in turn."""

    chunk: int | None = None
    on_progress: PrefillCallback | None = None
    window: int = 3  # prompt blocks in flight (the server queues 4 steps of a session)

    def pieces(self, n: int) -> list[range]:
        """Row ranges of a prompt of ``n`` tokens, one per block."""
        if self.chunk is not None and self.chunk < 1:
            raise GenerationError("the prefill chunk must be at least 1 row")
        step = n if self.chunk is None else self.chunk
        return [range(lo, min(lo + step, n)) for lo in range(0, n, max(step, 1))]


def read_prompt(
    runner: SplitRunner,
    read: Callable[[BlockStates], T],
    prompt_ids: Sequence[int],
    prefill: Prefill | None,
    cancel: CancelToken | None,
) -> list[T] | None:
    """The prompt through the split in blocks (see :class:`Prefill`): ``read(states)`` of
    each block, in order, or None when cancelled between two blocks.

    Through a trunk server blocks are pipelined: block c+1 is started (its head layers run and
    its step is sent) before block c is finished (its trunk answer taken and its tail layers
    run), up to ``window`` blocks in flight. Every layer stack still sees the blocks in order,
    each attending to exactly its prefix, so the rows are those of reading them one by one."""
    pf = prefill or Prefill()
    if pf.window < 1:
        raise GenerationError("the prefill window must be at least 1 block")
    ids = list(prompt_ids)
    # only a trunk behind a link has anything to overlap (one in this process answers at once)
    window = pf.window if runner.remote and getattr(runner.trunk, "pipelines", False) else 1
    outs: list[T] = []
    flight: deque[tuple[int, InFlight]] = deque()

    def land() -> None:
        stop, f = flight.popleft()
        outs.append(read(runner.finish(f)))
        if pf.on_progress is not None:
            pf.on_progress(stop, len(ids))

    def stopped() -> bool:
        if cancel is None or not cancel.cancelled:
            return False
        if flight:  # a Stop is not kept waiting for the blocks in flight: they are dropped,
            runner.reset()  # and with them the caches that hold part of them
        return True

    for i, rows in enumerate(pf.pieces(len(ids))):
        if i and stopped():
            return None
        flight.append((rows.stop, runner.start(ids[rows.start : rows.stop], rows)))
        while len(flight) >= window:
            land()
    while flight:  # the last blocks (a Stop is heard between them too)
        if stopped():
            return None
        land()
    return outs


def cancelled_early(stats: GenerationStats) -> GenerationResult:
    """The result of a generation stopped while it read the prompt: no text."""
    return GenerationResult("", [], "cancelled", stats)


def check_context(runner: SplitRunner, prompt_len: int) -> None:
    limit = runner.client.config.max_position_embeddings
    if prompt_len >= limit:
        raise GenerationError(f"the prompt has {prompt_len} tokens; this model's limit is {limit}")
    if prompt_len == 0:
        raise GenerationError("empty prompt")


@dataclass
class Start:
    """What every decoder sets up before its first forward pass."""

    out: Output
    generator: torch.Generator | None
    stats: GenerationStats
    limit: int  # the model's context length


def start_generation(
    runner: SplitRunner,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    on_text: TextCallback | None,
) -> Start:
    """Validate the request, reset every cache and build the per-generation state."""
    params.validate()
    check_context(runner, len(prompt_ids))
    client = runner.client
    runner.reset()
    return Start(
        out=Output(client.tokenizer, params, client.config.eos_token_ids, on_text),
        generator=params.make_generator() if not params.greedy else None,
        stats=GenerationStats(prompt_tokens=len(prompt_ids)),
        limit=client.config.max_position_embeddings,
    )


def generate_sequential(
    runner: SplitRunner,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    on_text: TextCallback | None = None,
    cancel: CancelToken | None = None,
    prefill: Prefill | None = None,
) -> GenerationResult:
    """One token per trunk round trip: the reference every other decoder must equal."""
    t0 = time.perf_counter()
    st = start_generation(runner, prompt_ids, params, on_text)
    out, gen, stats, limit = st.out, st.generator, st.stats, st.limit
    ids = list(prompt_ids)
    blocks = read_prompt(runner, lambda s: runner.client.logits(s.final[-1:]), ids, prefill, cancel)
    if blocks is None:
        return cancelled_early(stats)
    logits = blocks[-1]  # [1, V]
    stats.round_trips += len(blocks)
    t_first = 0.0
    while True:
        tok = pick(logits[-1], params, ids, gen)
        ids.append(tok)
        if not t_first:
            t_first = time.perf_counter()
            stats.ttft_s = t_first - t0
        if out.push(tok):
            break
        if cancel is not None and cancel.cancelled:
            out.finish("cancelled")
            break
        if len(ids) >= limit:
            out.finish("context")
            break
        logits = runner.forward([tok], [len(ids) - 1])  # [1, V]
        stats.round_trips += 1
        stats.accepted_hist[1] = stats.accepted_hist.get(1, 0) + 1
    stats.new_tokens = len(out.token_ids)
    stats.decode_s = time.perf_counter() - t_first
    stats.tree_nodes_sent = stats.round_trips - len(blocks)  # one row per decode step
    return GenerationResult(out.text, out.token_ids, out.finish_reason or "length", stats)


Decoder = Callable[..., GenerationResult]
DECODERS: dict[str, Decoder] = {"sequential": generate_sequential}
_PLUGINS = ("engine.speculative",)  # modules that register more decoders on import


def available_decoders() -> dict[str, Decoder]:
    """All decoders, importing the optional decoder modules on first use."""
    import importlib

    for mod in _PLUGINS:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise
    return DECODERS


def generate(
    runner: SplitRunner,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    decoder: str = "sequential",
    on_text: TextCallback | None = None,
    cancel: CancelToken | None = None,
    prefill: Prefill | None = None,
) -> GenerationResult:
    """``prefill`` (optional) reads the prompt in blocks with progress (:class:`Prefill`)."""
    decoders = available_decoders()
    if decoder not in decoders:
        raise GenerationError(
            f"unknown decoder '{decoder}'", hint="choose one of: " + ", ".join(sorted(decoders))
        )
    with torch.inference_mode():
        if prefill is None:  # decoders registered by plugins need not know the option
            return decoders[decoder](runner, prompt_ids, params, on_text=on_text, cancel=cancel)
        return decoders[decoder](
            runner, prompt_ids, params, on_text=on_text, cancel=cancel, prefill=prefill
        )
