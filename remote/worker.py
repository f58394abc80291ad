"""The trunk's batching worker: owns every session's KV caches and runs their steps in batches.

It knows nothing about sockets, keys or the wire: the server (``remote/server.py``) — or, later,
a Ray replica behind a gateway — validates a step, then hands it over as a :class:`Job`; the
worker answers each job exactly once with a :class:`Done` through the ``on_done`` callback, on its
own scheduler thread. The interface (documented in ``docs/architecture.md``):

* ``slot_bytes(start, end)`` — KV bytes per cached token for a session over [start, end);
* ``open(sid, start, end, capacity, owner)`` / ``close(sid)`` — a session's caches and the client
  key it belongs to (``close`` at any time: its queued jobs are answered ``unknown_session``
  without being computed; a chunk of it that is running finishes first);
* ``submit(job)`` — queue a step; jobs of one session run in the order submitted;
* ``start()`` / ``stop()``, ``stats(owner=None)`` (everything, or one key's own counters).

Scheduling (``remote/scheduler.py``): whenever the device is free, sessions' next chunks — one per
session, client keys taking turns by the rows each has had computed — join one batch up to
``max_batch_rows``; steps longer than ``prefill_chunk`` rows run as chunks at fixed offsets with
other sessions' steps in between (a lone prefill on the CPU kernels takes several at once).
The math (``engine/ragged.py``): projections over all rows at once, attention per session.

Failures stay with their session: a step that cannot be prepared (bad ``keep``, no memory to grow
its cache) fails alone before the batch runs; if the batch itself raises, every session in it is
run again alone (its cache slots are simply rewritten) and only those that fail again get an error.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import kernels
from engine import protocol as P
from engine.config import ModelConfig
from engine.kernels import batched as batched_kernel
from engine.model import LayerStack
from engine.quant import QuantWeight
from engine.ragged import Part, forward_parts, make_part, open_block
from remote.counters import WorkerCounters
from remote.loadmeter import LoadMeter
from remote.scheduler import Ready, Shares, chunk_rows, plan_batch
from remote.stages import Stage

log = logging.getLogger("veil.trunk.worker")

# Prefill chunks (rows) when not given: a short step waits for about one chunk's compute. On a
# GPU a 256-row chunk takes about as long as a few rows; on a CPU time grows with the rows (the
# default model's trunk: 8 rows ~40 ms, 32 rows ~75 ms, 256 rows ~600 ms, the same per-row
# cost from 32 rows up), so CPU chunks are small.
GPU_CHUNK = 256
CPU_CHUNK = 32


@dataclass
class WorkerOptions:
    max_batch_rows: int = 256  # rows per batch (a single chunk may be bigger when it must)
    prefill_chunk: int | None = None  # longest piece of one step in a batch (None: by device)
    batching: bool = True  # False: one step at a time, no chunks (the pre-batching server)
    pipeline: bool | None = None  # batches in flight across stages (None: if devices differ)
    max_context: int | None = None  # refuse positions at or past this (the server checks first)


@dataclass
class Job:
    """One validated step of one session."""

    sid: str
    step: int
    positions: list[int]
    parents: list[int] | None
    keep: list[int] | None
    hidden: torch.Tensor  # [B, H]
    want: bool = True  # False: a replay step, no output wanted
    out_dtype: torch.dtype = torch.float32  # the reply's dtype
    accepted: float = field(default_factory=time.perf_counter)  # when the server accepted it
    tag: Any = None  # the caller's (the server keeps its Session here)


@dataclass
class Done:
    """The one answer to a :class:`Job`."""

    job: Job
    hidden: torch.Tensor | None  # [B, H] on the CPU in job.out_dtype; None if not wanted/failed
    server_ms: float  # compute: wall time of the batches this step ran in
    queue_ms: float  # waiting: from acceptance to the reply, less server_ms
    batch_rows: int  # rows of the batch that finished it
    error: tuple[str, str] | None = None  # (protocol error code, message)
    load: P.Load | None = None  # the trunk's smoothed load when it finished (remote/loadmeter.py)


class SessionState:
    """One session's caches: a :class:`LayerStack` per stage its range reaches."""

    def __init__(
        self, sid: str, start: int, end: int, stacks: list[LayerStack | None], owner: str = ""
    ) -> None:
        self.sid = sid
        self.owner = owner  # the client key it belongs to (scheduling turns and counters)
        self.start = start
        self.end = end
        self.stacks = stacks
        self.closed = False
        self.busy = False  # a chunk of it is in a batch now
        self.queue: collections.deque[_Task] = collections.deque()

    def live(self) -> list[LayerStack]:
        return [s for s in self.stacks if s is not None]


@dataclass
class _Task:
    job: Job
    state: SessionState
    since: float  # ready since (arrival, or the end of its previous chunk)
    done_rows: int = 0
    first: int = 0  # this chunk's first row
    rows: int = 0  # this chunk's rows
    block_start: list[int] = field(default_factory=list)  # per stage (-1: no layers there)
    outputs: list[torch.Tensor] = field(default_factory=list)
    compute_s: float = 0.0
    x: torch.Tensor | None = None  # the chunk's hidden states between stages
    error: tuple[str, str] | None = None

    @property
    def total(self) -> int:
        return len(self.job.positions)


@dataclass
class _Batch:
    tasks: list[_Task]
    rows: int
    t0: float = 0.0
    t1: float = 0.0


class TrunkWorker:
    """Runs sessions' steps over ``stages`` (see the module docstring for the interface)."""

    def __init__(
        self,
        config: ModelConfig,
        stages: Sequence[Stage],
        dtype: torch.dtype,
        options: WorkerOptions,
        on_done: Callable[[Done], None],
    ) -> None:
        chunk_given = options.prefill_chunk
        if options.max_batch_rows < 1 or (chunk_given is not None and chunk_given < 1):
            raise ValueError("--max-batch-rows and --prefill-chunk must be at least 1")
        self.config = config
        self.stages = list(stages)
        self.dtype = dtype
        self.opts = options
        self.on_done = on_done
        self.max_steps = 1_000_000 if options.batching else 1
        on_cpu = all(s.device.type == "cpu" for s in stages)
        chunk = chunk_given or (CPU_CHUNK if on_cpu else GPU_CHUNK)
        self.chunk = chunk if options.batching else P.MAX_BLOCK
        devices = {str(s.device) for s in self.stages}
        pipe = options.pipeline if options.pipeline is not None else len(devices) > 1
        self.pipelined = pipe and len(self.stages) > 1
        self.max_in_flight = len(self.stages) if self.pipelined else 1
        # The pre-batching server ran the engine's usual kernels; batches need the invariant one.
        self.invariant = options.batching
        cpu32 = dtype == torch.float32 and any(s.device.type == "cpu" for s in self.stages)
        quantized = _quantized(self.stages)
        if cpu32:
            _warm_kernels(quantized)
        self.bit_identical = (
            options.batching
            and cpu32
            and all(s.device.type == "cpu" for s in self.stages)
            and batched_kernel.available()
            # quantized matrices: their kernels compute each row alone (tile decoding + BLAS,
            # where numba is missing, does not)
            and (not quantized or kernels.quant_available())
        )
        # A lone prefill (no other session has work queued, no other client key has a session
        # open) takes whole runs of its chunks, up to the batch budget: where every row gets its
        # bits alone, cutting a block at fewer of its C-row offsets changes none of them. Only
        # the key's own next step can arrive and wait for such a batch; another key's session
        # keeps chunks at C rows, so no one can make another person's steps wait longer.
        self.lone_rows = (
            max(self.chunk, options.max_batch_rows // self.chunk * self.chunk)
            if self.bit_identical
            else self.chunk
        )
        self._sessions: dict[str, SessionState] = {}
        self._orphans: list[SessionState] = []  # closed, maybe with jobs still to answer
        self._cond = threading.Condition()
        self._finished: list[_Batch] = []
        self._in_flight = 0
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._stage_q: list[collections.deque[_Batch]] = [collections.deque() for _ in self.stages]
        self.counters = WorkerCounters()
        self.load = LoadMeter()  # aggregate load each reply reports
        self._shares = Shares()  # the client keys' turns (scheduler thread, under the lock)

    # ------------------------------------------------------------------ interface

    def slot_bytes(self, start: int, end: int) -> int:
        """KV-cache bytes per cached token of a session over layers [start, end)."""
        c = self.config
        elt = torch.tensor([], dtype=self.dtype).element_size()
        total = 0
        for st in self.stages:
            r = st.covers(start, end)
            if r is not None:
                total += (r[1] - r[0]) * c.n_kv_heads * c.head_dim * elt * 2 + 8
        return total

    def open(self, sid: str, start: int, end: int, capacity: int, owner: str = "") -> None:
        """Allocate a session's caches (``capacity`` slots, growing by doubling) for the client
        key ``owner``."""
        stacks: list[LayerStack | None] = []
        for st in self.stages:
            r = st.covers(start, end)
            if r is None:
                stacks.append(None)
                continue
            a, b = r
            stacks.append(
                LayerStack(
                    self.config,
                    a,
                    [st.layers[i] for i in range(a, b)],
                    dtype=self.dtype,
                    device=st.device,
                    capacity=capacity,
                )
            )
        with self._cond:
            self._sessions[sid] = SessionState(sid, start, end, stacks, owner)
        self.counters.opened(owner)

    def close(self, sid: str) -> None:
        """Forget a session; its queued jobs are answered ``unknown_session``."""
        with self._cond:
            s = self._sessions.pop(sid, None)
            if s is not None:
                s.closed = True
                self._orphans.append(s)
                self._cond.notify_all()

    def submit(self, job: Job) -> None:
        """Queue one step (answered through ``on_done``, even for an unknown session)."""
        self.submit_many([job])

    def submit_many(self, jobs: Sequence[Job]) -> None:
        """Queue several steps at once: none of them starts before all are queued."""
        with self._cond:
            now = time.monotonic()
            for job in jobs:
                s = self._sessions.get(job.sid)
                if s is None:  # answered on the worker thread like every other job
                    s = SessionState(job.sid, 0, 0, [])
                    s.closed = True
                    self._orphans.append(s)
                s.queue.append(_Task(job, s, now))
            self._cond.notify_all()

    def start(self) -> None:
        if self._threads:
            return
        if self.bit_identical:
            log.info("batches are bit-identical to single steps (%s)", batched_kernel.status())
        elif self.opts.batching:
            log.info("batched results may differ from single steps in the last bits")
        t = threading.Thread(target=self._loop, name="veil-trunk-worker", daemon=True)
        self._threads.append(t)
        if self.pipelined:
            for i in range(len(self.stages)):
                self._threads.append(
                    threading.Thread(
                        target=self._stage_loop, args=(i,), name=f"veil-trunk-stage{i}", daemon=True
                    )
                )
        for th in self._threads:
            th.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for th in self._threads:
            th.join(timeout)
        self._threads = []

    def stats(self, owner: str | None = None) -> dict[str, Any]:
        """What the worker does and has done (for ``veil-trunk loadtest``, ``status`` and logs):
        its settings, and the counters of every key — or, with ``owner``, of that client key
        alone: its steps, the batches its work ran in, and in ``batch_rows_hist`` how many of
        *its own* rows each of those batches held, so nothing of other keys' work shows."""
        return {
            "batching": self.opts.batching,
            "max_batch_rows": self.opts.max_batch_rows,
            "prefill_chunk": self.chunk,
            "lone_prefill_rows": self.lone_rows,
            "bit_identical": self.bit_identical,
            "kernel": batched_kernel.status() if self.invariant else "engine default",
            "stages": [f"{s.device}:{s.lo}-{s.hi}" for s in self.stages],
            "pipelined": self.pipelined,
            **self.counters.snapshot(owner),
        }

    # ------------------------------------------------------------------ scheduler thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._finished and not self._work_ready():
                    self._cond.wait()
                if self._stopping:
                    return
                finished, self._finished = self._finished, []
                answers = self._flush_closed()
                for b in finished:
                    answers += self._complete(b)
                batch = self._plan() if self._in_flight < self.max_in_flight else None
                if batch is not None:
                    self._in_flight += 1
            self._answer(answers)
            if batch is None:
                continue
            self._prepare(batch)
            if self.pipelined:
                with self._cond:
                    self._stage_q[0].append(batch)
                    self._cond.notify_all()
                continue
            self._run(batch)
            with self._cond:
                self._finished.append(batch)

    def _work_ready(self) -> bool:
        if any(s.queue and not s.busy for s in self._orphans):
            return True
        if self._in_flight >= self.max_in_flight:
            return False
        return any(s.queue and not s.busy for s in self._all())

    def _all(self) -> list[SessionState]:
        return list(self._sessions.values())

    def _flush_closed(self) -> list[Done]:
        """Answer every queued job of a closed session (under the lock)."""
        out = []
        for s in self._orphans:
            while s.queue and not s.busy:
                t = s.queue.popleft()
                out.append(self._fail(t, (P.E_UNKNOWN_SESSION, "no such session")))
        self._orphans = [s for s in self._orphans if s.queue]
        return out

    def _plan(self) -> _Batch | None:
        ready = []
        heads: dict[str, _Task] = {}
        active, present = set(), set()
        sessions = self._all()
        lone = len({s.owner for s in sessions}) == 1 and sum(1 for s in sessions if s.queue) == 1
        chunk = self.lone_rows if lone else self.chunk
        for s in sessions:
            present.add(s.owner)
            if s.queue:
                active.add(s.owner)
            if s.queue and not s.busy and not s.closed:
                t = s.queue[0]
                heads[s.sid] = t
                rows = chunk_rows(t.total, t.done_rows, chunk)
                ready.append(Ready(s.sid, rows, t.since, s.owner, rows == t.total))
        self._shares.track(active)
        use = self._shares.usage
        o = self.opts
        chosen = plan_batch(
            ready, o.max_batch_rows, self.max_steps, self.chunk, use, len(present) > 1
        )
        if not chosen:
            return None
        self._shares.book(chosen)
        tasks = []
        for r in chosen:
            t = heads[r.key]
            t.first, t.rows = t.done_rows, r.rows
            t.state.busy = True
            tasks.append(t)
        return _Batch(tasks, sum(t.rows for t in tasks))

    def _prepare(self, batch: _Batch) -> None:
        """Open new blocks and cut this batch's rows out of each job. A job that cannot start
        fails here, alone, and is answered with the batch (worker thread, outside the lock: a
        busy session's tasks are the worker's)."""
        for t in batch.tasks:
            try:
                if t.first == 0:
                    self._open_block(t)
                t.x = t.job.hidden[t.first : t.first + t.rows]  # [n, H]
            except _StepError as exc:
                t.error = (exc.code, exc.message)
            except Exception as exc:
                log.exception("a step could not start")
                t.error = (P.E_INTERNAL, f"step failed on the server: {exc}")

    def _open_block(self, t: _Task) -> None:
        job, stacks = t.job, t.state.stacks
        n = len(job.positions)
        if job.hidden.dim() != 2 or job.hidden.shape != (n, self.config.hidden_size):
            raise _StepError(P.E_SHAPE, f"hidden states of shape {tuple(job.hidden.shape)}")
        live = t.state.live()
        cache = live[0].cache
        length = cache.length
        if job.keep is not None:
            prev = cache.length - cache.block_start
            if any(k < 0 or k >= prev for k in job.keep) or any(
                b <= a for a, b in zip(job.keep, job.keep[1:], strict=False)
            ):
                raise _StepError(P.E_BAD_MESSAGE, f"keep does not fit the previous block of {prev}")
            length = cache.block_start + len(job.keep)
        limit = self.opts.max_context
        if limit is not None and (max(job.positions) >= limit or length + n > limit):
            raise _StepError(P.E_CONTEXT, f"the session's context of {limit} tokens is full")
        pos = torch.tensor(job.positions, dtype=torch.long)  # [B]
        t.block_start = [-1 if s is None else open_block(s, pos, job.keep) for s in stacks]

    def _run(self, batch: _Batch) -> None:
        batch.t0 = time.perf_counter()
        for i in range(len(self.stages)):
            self._run_stage(i, batch)
        batch.t1 = time.perf_counter()

    def _stage_loop(self, i: int) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._stage_q[i]:
                    self._cond.wait()
                if self._stopping:
                    return
                batch = self._stage_q[i].popleft()
            if i == 0:
                batch.t0 = time.perf_counter()
            self._run_stage(i, batch)
            with self._cond:
                if i + 1 < len(self.stages):
                    self._stage_q[i + 1].append(batch)
                else:
                    batch.t1 = time.perf_counter()
                    self._finished.append(batch)
                self._cond.notify_all()

    def _run_stage(self, i: int, batch: _Batch) -> None:
        """Stage ``i``'s layers for every task of the batch that reaches them."""
        tasks, parts = [], []
        for t in batch.tasks:
            stack = t.state.stacks[i] if t.error is None else None
            if stack is None or t.x is None:
                continue
            try:
                pos = torch.tensor(t.job.positions[t.first : t.first + t.rows], dtype=torch.long)
                parts.append(make_part(stack, t.x, pos, t.job.parents, t.block_start[i], t.first))
                tasks.append(t)
            except Exception as exc:
                log.exception("a step could not start")
                t.error = (P.E_INTERNAL, f"step failed on the server: {exc}")
        if not parts:
            return
        outs = self._forward(parts, tasks)
        for t, y in zip(tasks, outs, strict=True):
            if y is not None:
                t.x = y
        if self.stages[i].device.type == "cuda":
            torch.cuda.synchronize(self.stages[i].device)

    def _forward(self, parts: list[Part], tasks: list[_Task]) -> list[torch.Tensor | None]:
        with torch.inference_mode():
            try:
                return list(forward_parts(parts, invariant=self.invariant))
            except Exception:
                if len(parts) == 1:
                    log.exception("step failed")
                    tasks[0].error = (P.E_INTERNAL, "step failed on the server")
                    return [None]
                log.warning("a batch of %d steps failed; running them one by one", len(parts))
            outs: list[torch.Tensor | None] = []
            for p, t in zip(parts, tasks, strict=True):
                try:  # the same slots are written again: nothing to undo
                    outs.append(forward_parts([p], invariant=self.invariant)[0])
                except Exception as exc:
                    log.exception("step failed")
                    t.error = (P.E_INTERNAL, f"step failed on the server: {exc}")
                    outs.append(None)
            return outs

    def _complete(self, batch: _Batch) -> list[Done]:
        """Book a finished batch (under the lock): answers for finished steps, requeue the rest."""
        self._in_flight -= 1
        now = time.monotonic()
        dt = batch.t1 - batch.t0
        rows_by_key: dict[str, list[int]] = {}
        for t in batch.tasks:
            rows_by_key.setdefault(t.state.owner, []).append(t.rows)
        self.counters.batch(rows_by_key, dt)
        waiting = sum(len(s.queue) for s in self._sessions.values()) - sum(
            1 for t in batch.tasks if t.done_rows + t.rows >= t.total
        )
        self.load.batch(batch.rows, len(batch.tasks), waiting, batch.t0, batch.t1)
        load = self.load.snapshot()
        out = []
        for t in batch.tasks:
            s = t.state
            s.busy = False
            t.compute_s += dt
            if t.error is None and t.job.want and t.x is not None:
                t.outputs.append(t.x.to(device="cpu", dtype=t.job.out_dtype))
            t.x = None
            if t.error is not None:
                s.queue.popleft()
                out.append(self._fail(t, t.error, batch.rows))
                continue
            if s.closed:
                s.queue.popleft()
                out.append(self._fail(t, (P.E_UNKNOWN_SESSION, "no such session"), batch.rows))
                continue
            t.done_rows += t.rows
            if t.done_rows < t.total:
                t.since = now  # the rest queues behind whatever came meanwhile
                continue
            s.queue.popleft()
            hidden = None
            if t.job.want:
                hidden = t.outputs[0] if len(t.outputs) == 1 else torch.cat(t.outputs)
            total_ms = (time.perf_counter() - t.job.accepted) * 1000.0
            server_ms = t.compute_s * 1000.0
            self.counters.add(s.owner, "steps")
            out.append(
                Done(
                    t.job, hidden, server_ms, max(total_ms - server_ms, 0.0), batch.rows, None, load
                )
            )
        return out

    def _fail(self, t: _Task, error: tuple[str, str], rows: int = 0) -> Done:
        self.counters.add(t.state.owner, "errors")
        total_ms = (time.perf_counter() - t.job.accepted) * 1000.0
        server_ms = t.compute_s * 1000.0
        return Done(t.job, None, server_ms, max(total_ms - server_ms, 0.0), rows, error)

    def _answer(self, answers: list[Done]) -> None:
        for d in answers:
            try:
                self.on_done(d)
            except Exception:  # the caller's bug must not stop the worker
                log.exception("on_done failed")


def _quantized(stages: Sequence[Stage]) -> list[QuantWeight]:
    """One quantized matrix per format the stages hold (none: float weights)."""
    seen: dict[str, QuantWeight] = {}
    for st in stages:
        for w in st.layers.values():
            for m in (w.wqkv, w.wo, w.wgu, w.wdown):
                for part in getattr(m, "parts", [m]):
                    if isinstance(part, QuantWeight):
                        seen.setdefault(part.fmt, part)
    return list(seen.values())


def _warm_kernels(quantized: Sequence[QuantWeight] = ()) -> None:
    """Compile the matrix kernels and start numba's thread pool from the constructing thread.

    Measured on our 2-core machines: when numba's first parallel launch happens on the worker
    thread (the pre-batching server did that), every later kernel call there stalls for
    milliseconds (a 4-row step of the tiny test model: ~250 ms instead of ~4); launched from the
    main thread first, it does not. Quantized weights: one row through each format's product,
    so its first-use compile happens at start, not inside a client's first step."""
    if kernels.available():
        kernels.linear(torch.zeros(4, 8), torch.zeros(8, 8))
    batched_kernel.available()
    for w in quantized:
        kernels.linear(torch.zeros(1, w.k), w)


class _StepError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
