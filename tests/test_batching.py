"""The batching trunk worker: batch invariance, chunked prefill, device stages, failure isolation
and the scheduling policy. The worker is socket-free, so most tests drive it directly with tiny
random-weight models; ``tests/test_remote.py`` and ``tests/test_loadtest.py`` go through sockets.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import protocol as P
from engine.config import ModelConfig
from engine.loading import WeightReader, load_config
from engine.model import LayerStack
from engine.split import read_layers
from remote.scheduler import Ready, Shares, chunk_rows, plan_batch, short_rows
from remote.stages import Stage, load_stages, split_layers
from remote.worker import Done, Job, TrunkWorker, WorkerOptions
from tests.tiny import make_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 layers, sliding window 8 (so window masks are batched too), long context."""
    f = tmp_path_factory.mktemp("batching") / "mistral6"
    make_model(f, "mistral", seed=5, n_layers=6, max_position_embeddings=4096)
    return f


def stages_of(
    folder: Path, counts: list[int] | None = None, reader: object = None
) -> tuple[ModelConfig, list[Stage]]:
    cfg = load_config(folder)
    devices = [CPU] * (len(counts) if counts else 1)
    plan = split_layers(1, cfg.n_layers - 1, devices, counts)
    return cfg, load_stages(reader or WeightReader(folder), cfg, plan, torch.float32)  # type: ignore[arg-type]


class Harness:
    """A started worker and the answers it gave, keyed by (session, step); ``reader``: where
    the weights come from (default: the folder's float checkpoint)."""

    def __init__(
        self,
        folder: Path,
        counts: list[int] | None = None,
        reader: object = None,
        **opts: object,
    ) -> None:
        self.cfg, stages = stages_of(folder, counts, reader)
        self.stages = stages
        self.answers: dict[tuple[str, int], Done] = {}
        self.cv = threading.Condition()
        self.worker = TrunkWorker(
            self.cfg,
            stages,
            torch.float32,
            WorkerOptions(**opts),
            self._on_done,  # type: ignore[arg-type]
        )
        self.worker.start()

    def _on_done(self, d: Done) -> None:
        with self.cv:
            self.answers[(d.job.sid, d.job.step)] = d
            self.cv.notify_all()

    def wait(self, keys: list[tuple[str, int]], timeout: float = 120.0) -> list[Done]:
        deadline = time.monotonic() + timeout
        with self.cv:
            while not all(k in self.answers for k in keys):
                left = deadline - time.monotonic()
                assert left > 0, f"no answer for {[k for k in keys if k not in self.answers]}"
                self.cv.wait(left)
            return [self.answers[k] for k in keys]

    def forget(self, sids: list[str]) -> None:
        """Close these sessions and drop their answers (to run the same sessions again)."""
        for sid in sids:
            self.worker.close(sid)
        with self.cv:
            self.answers = {k: v for k, v in self.answers.items() if k[0] not in sids}

    def close(self) -> None:
        self.worker.stop()


@dataclass
class Step:
    positions: list[int]
    parents: list[int] | None
    keep: list[int] | None
    hidden: torch.Tensor  # [B, H]


def script(seed: int, hidden: int, prefill: int, blocks: list[int]) -> list[Step]:
    """A session's steps: a chain prefill, then random trees, each keeping one root-to-node path
    of the previous tree (as speculative decoding does)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    steps = [Step(list(range(prefill)), None, None, torch.randn(prefill, hidden, generator=g))]
    base, keep = prefill, None
    for b in blocks:
        parents = [-1] + [rng.randint(-1, i - 1) for i in range(1, b)]
        depth: list[int] = []
        for p in parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        positions = [base + d for d in depth]
        steps.append(Step(positions, parents, keep, torch.randn(b, hidden, generator=g)))
        node = rng.randrange(b)
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        keep = sorted(path)
        base += len(keep)
    return steps


SESSIONS = {  # sid -> (layer range, prefill rows, tree sizes)
    "a": ((1, 5), 7, [1, 4, 16, 3]),
    "b": ((2, 4), 12, [5, 1, 9, 2]),
    "c": ((1, 4), 70, [8, 8, 1]),  # a prefill over 64 rows
    "d": ((2, 5), 3, [2, 13, 4, 6, 1]),
    "e": ((1, 5), 33, [64, 1]),
}


Plan = dict[str, tuple[tuple[int, int], int, list[int]]]


def open_all(h: Harness, sids: list[str], plan: Plan | None = None) -> dict[str, list[Step]]:
    out = {}
    for i, sid in enumerate(sids):
        (start, end), prefill, blocks = (plan or SESSIONS)[sid]
        h.worker.open(sid, start, end, 64)
        out[sid] = script(100 + i, h.cfg.hidden_size, prefill, blocks)
    return out


def job(sid: str, k: int, s: Step) -> Job:
    return Job(sid, k, s.positions, s.parents, s.keep, s.hidden)


def run_alone(h: Harness, scripts: dict[str, list[Step]]) -> dict[str, list[torch.Tensor]]:
    """Each session on its own: one step at a time, nobody else queued."""
    out: dict[str, list[torch.Tensor]] = {}
    for sid, steps in scripts.items():
        out[sid] = []
        for k, s in enumerate(steps):
            h.worker.submit(job(sid, k, s))
            (d,) = h.wait([(sid, k)])
            assert d.error is None and d.hidden is not None, d.error
            out[sid].append(d.hidden)
    return out


def run_together(h: Harness, scripts: dict[str, list[Step]]) -> dict[str, list[torch.Tensor]]:
    """Round k: every session's step k queued at once, so they share batches."""
    out: dict[str, list[torch.Tensor]] = {sid: [] for sid in scripts}
    for k in range(max(len(s) for s in scripts.values())):
        jobs = [job(sid, k, s[k]) for sid, s in scripts.items() if k < len(s)]
        h.worker.submit_many(jobs)
        for d in h.wait([(j.sid, j.step) for j in jobs]):
            assert d.error is None and d.hidden is not None, d.error
            out[d.job.sid].append(d.hidden)
    return out


def run_streaming(h: Harness, scripts: dict[str, list[Step]]) -> dict[str, list[torch.Tensor]]:
    """Each session in its own thread, sending its next step as soon as the last one is back:
    batches form however the timing falls."""
    out: dict[str, list[torch.Tensor]] = {sid: [] for sid in scripts}

    def client(sid: str) -> None:
        for k, s in enumerate(scripts[sid]):
            h.worker.submit(job(sid, k, s))
            (d,) = h.wait([(sid, k)])
            assert d.error is None and d.hidden is not None
            out[sid].append(d.hidden)

    threads = [threading.Thread(target=client, args=(sid,)) for sid in scripts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(len(out[sid]) == len(scripts[sid]) for sid in scripts)
    return out


def same(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> None:
    for sid in a:
        assert len(a[sid]) == len(b[sid])
        for k, (x, y) in enumerate(zip(a[sid], b[sid], strict=True)):
            assert torch.equal(x, y), f"session {sid} step {k} differs by {(x - y).abs().max()}"


# ----------------------------------------------------------------------------- invariance


@pytest.mark.parametrize(("max_rows", "chunk"), [(256, 256), (40, 16)])
def test_batched_steps_are_bit_identical_to_single_steps(
    mistral: Path, max_rows: int, chunk: int
) -> None:
    sids = list(SESSIONS)
    h = Harness(mistral, max_batch_rows=max_rows, prefill_chunk=chunk)
    try:
        assert h.worker.bit_identical
        alone = run_alone(h, open_all(h, sids))
        hist_alone = dict(h.worker.stats()["batch_rows_hist"])
        h.forget(sids)
        together = run_together(h, open_all(h, sids))
        h.forget(sids)
        streaming = run_streaming(h, open_all(h, sids))
        st = h.worker.stats()
    finally:
        h.close()
    same(alone, together)
    same(alone, streaming)
    # not vacuous: rows of several sessions did share batches, bigger than any step alone
    biggest_alone = max(int(r) for r in hist_alone)
    assert max(int(r) for r in st["batch_rows_hist"]) > min(biggest_alone, max_rows - 1)
    assert st["errors"] == 0 and st["steps"] == 3 * sum(len(v[2]) + 1 for v in SESSIONS.values())


def test_batched_outputs_match_the_engine_within_rounding(mistral: Path) -> None:
    """The batched math is the engine's math: the same steps through LayerStack.forward (the
    client's path, other kernels) agree to rounding."""
    cfg = load_config(mistral)
    layers = read_layers(WeightReader(mistral), cfg, range(1, 5), torch.float32, CPU)
    h = Harness(mistral, max_batch_rows=40, prefill_chunk=16)
    try:
        scripts = open_all(h, list(SESSIONS))
        got = run_together(h, scripts)
    finally:
        h.close()
    for sid, steps in scripts.items():
        (start, end), _, _ = SESSIONS[sid]
        ref = LayerStack(cfg, start, [layers[i] for i in range(start, end)], capacity=8)
        for k, s in enumerate(steps):
            want = ref.forward(s.hidden, torch.tensor(s.positions), s.parents, s.keep)
            assert torch.allclose(got[sid][k], want, atol=1e-4, rtol=1e-4), (sid, k)


def test_device_stages_give_the_same_bits(mistral: Path) -> None:
    """Layers split over two (CPU) stages, with the stages pipelined, equal one device."""
    sids = list(SESSIONS)
    one = Harness(mistral, max_batch_rows=40, prefill_chunk=16)
    two = Harness(mistral, [1, 3], max_batch_rows=40, prefill_chunk=16, pipeline=True)
    try:
        assert two.worker.pipelined and two.worker.stats()["stages"] == ["cpu:1-2", "cpu:2-5"]
        a = run_together(one, open_all(one, sids))
        b = run_streaming(two, open_all(two, sids))
    finally:
        one.close()
        two.close()
    same(a, b)


# ----------------------------------------------------------------------------- chunked prefill


def test_long_prefill_runs_in_chunks_between_other_sessions_steps(mistral: Path) -> None:
    h = Harness(mistral, max_batch_rows=256, prefill_chunk=256)
    hid = h.cfg.hidden_size
    g = torch.Generator().manual_seed(9)
    long = torch.randn(2000, hid, generator=g)  # [2000, H]
    try:
        h.worker.open("long", 1, 5, 64)
        h.worker.submit(Job("long", 0, list(range(2000)), None, None, long))
        alone = h.wait([("long", 0)])[0]
        h.forget(["long"])
        h.worker.open("long", 1, 5, 64)
        h.worker.open("chat", 1, 5, 64)
        h.worker.submit(Job("chat", 0, list(range(4)), None, None, long[:4]))
        h.wait([("chat", 0)])
        h.worker.submit(Job("long", 0, list(range(2000)), None, None, long))
        decodes = []
        k = 1
        while ("long", 0) not in h.answers:  # the chat session keeps decoding meanwhile
            h.worker.submit(Job("chat", k, [3 + k], None, None, long[k : k + 1]))
            decodes.append(h.wait([("chat", k)])[0])
            k += 1
        mixed = h.wait([("long", 0)])[0]
        st = h.worker.stats()
    finally:
        h.close()
    assert mixed.hidden is not None and alone.hidden is not None
    assert torch.equal(mixed.hidden, alone.hidden)  # the long session's output is unchanged
    # 2000 rows = 8 chunks; the chat steps ran between them instead of after all of them
    assert len(decodes) >= 3, len(decodes)
    # two runs of 7 full chunks (+ a 208), some with a chat step beside them (short steps may
    # go a quarter over the batch budget)
    hist = {int(k): v for k, v in st["batch_rows_hist"].items()}
    assert sum(v for k, v in hist.items() if 256 <= k <= 256 + 64) >= 14, hist
    # each chat step waited for at most about one chunk, never for the whole prompt
    chunk_ms = mixed.server_ms / 8
    for d in decodes:
        assert d.error is None
        assert d.queue_ms < 0.5 * mixed.server_ms, (d.queue_ms, mixed.server_ms)
    assert sorted(d.queue_ms for d in decodes)[len(decodes) // 2] < 2 * chunk_ms


def test_a_lone_prefill_takes_several_chunks_at_once_with_the_same_bits(mistral: Path) -> None:
    """With no other session's work queued and no other client key present, a prefill runs in
    batches of whole runs of its chunks (the CPU kernels give each row its bits alone); beside
    another session's queued work, or another key's open session, it goes back to one chunk a
    batch. Every output equals one-chunk-a-batch's bits."""
    hid = load_config(mistral).hidden_size
    g = torch.Generator().manual_seed(11)
    long = torch.randn(200, hid, generator=g)  # [200, H]
    other = torch.randn(100, hid, generator=g)  # [100, H]

    def prefill(h: Harness, steps: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Open these sessions and queue their prompts at once; their outputs, in order."""
        for sid in steps:
            h.worker.open(sid, 1, 5, 64)
        h.worker.submit_many(
            [Job(sid, 0, list(range(len(x))), None, None, x) for sid, x in steps.items()]
        )
        outs = [d.hidden for d in h.wait([(sid, 0) for sid in steps])]
        assert all(o is not None for o in outs)
        return [o for o in outs if o is not None]

    def batches(h: Harness, before: dict[int, int]) -> dict[int, int]:
        """Batches by row count since ``before`` was taken."""
        now = {int(k): v for k, v in h.worker.stats()["batch_rows_hist"].items()}
        return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}

    one_chunk = Harness(mistral, max_batch_rows=16, prefill_chunk=16)
    merged = Harness(mistral, max_batch_rows=64, prefill_chunk=16)
    try:
        assert one_chunk.worker.lone_rows == 16 and merged.worker.lone_rows == 64
        (want,) = prefill(one_chunk, {"a": long})
        (want_other,) = prefill(one_chunk, {"b": other})
        (alone,) = prefill(merged, {"a": long})
        hist_alone = batches(merged, {})
        merged.forget(["a"])
        both = prefill(merged, {"a": long, "b": other})
        hist_both = batches(merged, hist_alone)
        merged.forget(["a", "b"])
        seen = batches(merged, {})
        merged.worker.open("idle", 1, 5, 64, owner="another key")  # open, nothing queued
        (beside_idle,) = prefill(merged, {"a": long})
        hist_idle = batches(merged, seen)
    finally:
        one_chunk.close()
        merged.close()
    assert torch.equal(alone, want) and torch.equal(beside_idle, want)
    assert torch.equal(both[0], want) and torch.equal(both[1], want_other)
    # alone: 200 rows = three batches of 64 and one of 8
    assert hist_alone == {64: 3, 8: 1}
    # together: one 16-row chunk of each a batch while both have work queued (6 of 32 rows,
    # then b's last 4 beside a's 16), then a alone, merged again: its last 88 rows as 64 + 24
    assert hist_both == {32: 6, 20: 1, 64: 1, 24: 1}, hist_both
    # another client key's open session keeps the chunks at 16 rows, though it queues nothing:
    # its next step must not wait for a whole merged batch
    assert hist_idle == {16: 12, 8: 1}, hist_idle


# ----------------------------------------------------------------------------- failures


def test_a_failing_session_leaves_the_others_correct(
    mistral: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sids = ["a", "b", "c", "d"]
    h = Harness(mistral)
    try:
        want = run_alone(h, open_all(h, sids))
        h.forget(sids)
        scripts = open_all(h, sids)
        # round 0 together; then in round 1: "b" overflows its cache memory (its block cannot
        # start), "d" sends a keep that does not fit its previous block, "c" is closed while its
        # step is queued; "a" must still get exactly its solo results
        r0 = [job(sid, 0, s[0]) for sid, s in scripts.items()]
        h.worker.submit_many(r0)
        h.wait([(j.sid, j.step) for j in r0])
        stack_b = h.worker._sessions["b"].stacks[0]
        assert stack_b is not None

        def no_memory(extra: int) -> None:
            raise MemoryError("no memory for the cache")

        monkeypatch.setattr(stack_b.cache, "reserve", no_memory)
        bad_keep = Step(
            scripts["d"][1].positions, scripts["d"][1].parents, [0, 99], scripts["d"][1].hidden
        )
        r1 = [
            job("a", 1, scripts["a"][1]),
            job("b", 1, scripts["b"][1]),
            job("c", 1, scripts["c"][1]),
            job("d", 1, bad_keep),
        ]
        h.worker.submit_many(r1)
        h.worker.close("c")
        a1, b1, c1, d1 = h.wait([(j.sid, j.step) for j in r1])
        rest = [job("a", k, s) for k, s in enumerate(scripts["a"]) if k >= 2]
        for j in rest:
            h.worker.submit(j)
        later = h.wait([(j.sid, j.step) for j in rest])
    finally:
        h.close()
    assert b1.error is not None and b1.error[0] == P.E_INTERNAL and "memory" in b1.error[1]
    assert d1.error is not None and d1.error[0] == P.E_BAD_MESSAGE
    assert c1.error == (P.E_UNKNOWN_SESSION, "no such session")
    assert a1.error is None and a1.hidden is not None
    got = [h.answers[("a", 0)].hidden, a1.hidden, *[d.hidden for d in later]]
    for k, (x, y) in enumerate(zip(got, want["a"], strict=True)):
        assert x is not None and torch.equal(x, y), k


def test_a_batch_that_raises_is_rerun_one_by_one(
    mistral: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error inside the batched math (here: one session's attention) is retried per session;
    only the session that fails again gets an error."""
    import engine.ragged as ragged

    sids = ["a", "b", "d"]
    h = Harness(mistral)
    try:
        want = run_alone(h, open_all(h, sids))
        h.forget(sids)
        scripts = open_all(h, sids)
        poisoned = h.worker._sessions["b"].stacks[0]
        assert poisoned is not None
        real = ragged.attend

        def attend(q, k, v, cache, *rest):  # type: ignore[no-untyped-def]
            if cache is poisoned.cache:
                raise RuntimeError("attention blew up")
            return real(q, k, v, cache, *rest)

        monkeypatch.setattr(ragged, "attend", attend)
        jobs = [job(sid, 0, s[0]) for sid, s in scripts.items()]
        h.worker.submit_many(jobs)
        a0, b0, d0 = h.wait([(j.sid, j.step) for j in jobs])
    finally:
        h.close()
    assert b0.error is not None and b0.error[0] == P.E_INTERNAL
    assert a0.hidden is not None and torch.equal(a0.hidden, want["a"][0])
    assert d0.hidden is not None and torch.equal(d0.hidden, want["d"][0])


def test_unknown_and_closed_sessions_are_answered(mistral: Path) -> None:
    h = Harness(mistral)
    try:
        x = torch.zeros(1, h.cfg.hidden_size)
        h.worker.submit(Job("nobody", 0, [0], None, None, x))
        (d,) = h.wait([("nobody", 0)])
        assert d.error == (P.E_UNKNOWN_SESSION, "no such session")
        h.worker.open("s", 1, 5, 64)
        h.worker.submit_many([Job("s", k, [k], None, None, x) for k in range(3)])
        h.worker.close("s")
        answers = h.wait([("s", k) for k in range(3)])
    finally:
        h.close()
    # the first may have started before the close; every one of them is answered exactly once
    assert all(a.error is None or a.error[0] == P.E_UNKNOWN_SESSION for a in answers)
    assert answers[-1].error is not None


# ----------------------------------------------------------------------------- scheduling


def test_plan_takes_the_oldest_first_one_per_session_within_the_budget() -> None:
    ready = [Ready("a", 256, 3.0), Ready("b", 4, 1.0), Ready("c", 4, 2.0), Ready("d", 200, 0.5)]
    assert [r.key for r in plan_batch(ready, 256, 99)] == ["d", "b", "c"]
    assert [r.key for r in plan_batch(ready, 8, 99)] == ["d"]  # the oldest always goes
    assert [r.key for r in plan_batch(ready[:3], 8, 99)] == ["b", "c"]
    assert [r.key for r in plan_batch(ready, 10_000, 1)] == ["d"]  # --no-batching
    twice = [Ready("a", 1, 1.0), Ready("a", 1, 0.0)]
    assert len(plan_batch(twice, 10, 10)) == 1
    assert [chunk_rows(2000, d, 256) for d in (0, 1792)] == [256, 208]


def test_plan_lets_keys_take_turns_and_short_steps_join_a_full_chunk() -> None:
    """Issue 29 (3): a key with two sessions of prefill chunks against a key's one short step."""
    attack = [Ready("a1", 256, 0.0, "A", False), Ready("a2", 256, 1.0, "A", False)]
    victim = Ready("v", 8, 5.0, "V")  # the youngest of all
    both = [*attack, victim]
    # A has had more: V leads, and A's prefill chunks wait for A's turn
    assert [r.key for r in plan_batch(both, 256, 99, 256, {"A": 512.0, "V": 0.0})] == ["v"]
    assert [r.key for r in plan_batch(both, 1024, 99, 256, {"A": 512.0, "V": 0.0})] == ["v"]
    # A's turn: one chunk (not both), and the short step rides along over the budget
    usage = {"A": 0.0, "V": 100.0}
    assert [r.key for r in plan_batch(both, 256, 99, 256, usage)] == ["a1", "v"]
    # short: a whole step of at most a quarter of the budget; a bigger one waits
    assert short_rows(256) == 64
    big = Ready("v", 65, 5.0, "V")
    assert [r.key for r in plan_batch([attack[0], big], 256, 99, 256, usage)] == ["a1"]
    # while another key waits, or has a session open, a key adds at most one chunk's worth
    small = [Ready(f"s{i}", 16, float(i), "A") for i in range(8)]
    got = plan_batch([*small, Ready("v", 4, 9.0, "V")], 256, 99, 64, {"A": 0.0, "V": 1.0})
    assert [r.key for r in got] == ["s0", "s1", "s2", "s3", "v"]
    assert len(plan_batch(small, 256, 99, 64, {}, others=True)) == 4
    assert len(plan_batch(small, 256, 99, 64, {})) == 8  # alone on the server: the whole batch


def test_shares_start_a_returning_key_no_lower_than_the_leader() -> None:
    sh = Shares()
    sh.track(["A"])
    sh.book([Ready("a1", 256, 0.0, "A")])
    sh.book([Ready("a1", 256, 0.0, "A")])
    assert sh.usage == {"A": 512.0} and sh.clock == 256.0
    sh.track(["A", "V"])  # V arrives: level with the last leader, below A
    assert sh.usage["V"] == 256.0 < sh.usage["A"]
    sh.book([Ready("v", 8, 0.0, "V")])
    sh.track(["A"])  # V pauses between steps: still ahead of the clock, so remembered
    assert sh.usage["V"] == 264.0
    sh.book([Ready("a1", 256, 0.0, "A")])  # A leads at 512: the clock passes V
    sh.track(["A"])
    assert "V" not in sh.usage  # it would come back at the clock: nothing to remember
    sh.track(["A", "V"])
    assert sh.usage["V"] == sh.clock == 512.0


def test_split_layers_by_counts_and_equal_shares() -> None:
    assert split_layers(1, 29, [CPU, CPU]) == [(CPU, 1, 15), (CPU, 15, 29)]
    assert split_layers(2, 28, [CPU, CPU, CPU], [10, 10, 6])[2] == (CPU, 22, 28)
    for bad in ([10, 10], [0, 26], [27, -1]):
        with pytest.raises(ValueError, match="stage-layers"):
            split_layers(2, 28, [CPU, CPU], bad)
    with pytest.raises(ValueError, match="devices but only"):
        split_layers(1, 3, [CPU, CPU, CPU])


# ----------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 64, 65, 130, 300])
@pytest.mark.parametrize("shape", [(576, 960), (37, 11), (1536, 576), (64, 33)])
def test_batch_kernel_matches_torch(rows: int, shape: tuple[int, int]) -> None:
    from engine.kernels import batched

    assert batched.available(), batched.status()
    k_in, n_out = shape
    g = torch.Generator().manual_seed(rows * 1000 + k_in)
    x = torch.randn(rows, k_in, generator=g)
    w = torch.randn(n_out, k_in, generator=g)
    y = batched.linear(x, w)
    ref = torch.nn.functional.linear(x.double(), w.double()).float()
    assert y.shape == (rows, n_out)
    assert torch.allclose(y, ref, atol=2e-4 * k_in**0.5, rtol=1e-4)


def test_batch_kernel_gives_a_row_the_same_bits_at_every_row_count() -> None:
    """Alone, or anywhere inside calls of up to 300 rows (the batching worker's sizes)."""
    from engine.kernels import batched

    g = torch.Generator().manual_seed(11)
    w = torch.randn(97, 576, generator=g)  # an odd number of weight rows: one pairs with itself
    x = torch.randn(300, 576, generator=g)
    alone = torch.cat([batched.linear(x[i : i + 1], w) for i in range(300)])  # [300, 97]
    for size in (2, 3, 4, 5, 7, 8, 9, 31, 64, 65, 128, 255, 256, 300):
        for start in sorted({0, 1, 2, 3, 300 - size}):
            if start + size <= 300:
                got = batched.linear(x[start : start + size], w)
                assert torch.equal(got, alone[start : start + size]), (size, start)


def test_batch_kernel_falls_back_to_torch_off_cpu_float32() -> None:
    from engine.kernels import batched

    x = torch.randn(3, 8, dtype=torch.float64)
    w = torch.randn(5, 8, dtype=torch.float64)
    assert not batched.invariant(x, w)
    assert torch.equal(batched.linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.slow
def test_default_model_batches_are_bit_identical(default_model_folder: Path) -> None:
    """The real model's shapes (576 / 1536 wide, 26 trunk layers): four sessions with different
    splits and tree sizes, alone and batched, including a 300-row prompt in chunks."""
    plan: Plan = {
        "a": ((2, 28), 300, [4, 16]),
        "b": ((1, 29), 5, [8, 1, 4]),
        "c": ((3, 27), 40, [16, 3]),
        "d": ((2, 28), 12, [64, 2]),
    }
    sids = list(plan)
    h = Harness(default_model_folder, max_batch_rows=256, prefill_chunk=128)
    try:
        alone = run_alone(h, open_all(h, sids, plan))
        h.forget(sids)
        together = run_together(h, open_all(h, sids, plan))
        assert h.worker.stats()["shared_batches"] > 0
    finally:
        h.close()
    same(alone, together)
