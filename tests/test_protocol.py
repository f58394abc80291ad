"""The wire protocol: round trips of every message, and a decoder that rejects anything
malformed with a ProtocolError — never another exception (hypothesis property tests)."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import protocol as P

FAST = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def _step(b: int = 3, h: int = 8, dtype: str = "float16", **kw: object) -> P.Step:
    hidden = torch.randn(b, h).to(P.WIRE_DTYPES[dtype])  # [B, H]
    args: dict[str, object] = dict(
        session="s1",
        step=0,
        positions=list(range(5, 5 + b)),
        parents=[i - 1 for i in range(b)],
        keep=None,
        dtype=dtype,
        hidden=hidden,
    )
    args.update(kw)
    return P.Step(**args)  # type: ignore[arg-type]


def _frames_to_bytes(frames: list[P.Frame]) -> list[bytes]:
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_step_round_trip_is_exact(dtype: str) -> None:
    m = _step(dtype=dtype, keep=[0, 2])
    out = P.decode(_frames_to_bytes(P.encode(m)))
    assert isinstance(out, P.Step)
    assert out.positions == m.positions and out.parents == m.parents and out.keep == [0, 2]
    assert out.hidden.dtype == m.hidden.dtype and torch.equal(out.hidden, m.hidden)


def test_every_message_round_trips() -> None:
    msgs: list[P.Message] = [
        P.Open("cfg", None, 1, 5, "float16", 64, 512),
        P.Open("cfg", "w", 1, 5, "float32", 64, 512),
        P.Opened("sid", 1, 5, 512, "torch.float32"),
        P.Result("sid", 3, 1.5, torch.ones(2, 4, dtype=torch.float16)),
        P.Result("sid", 3, 1.5, None),
        P.Close("sid"),
        P.Closed("sid"),
        P.Ping(7, "sid"),
        P.Ping(7),
        P.Pong(7, True, 4, False),
        P.Error(P.E_BUSY, "server busy", "sid", 2),
    ]
    for m in msgs:
        out = P.decode(_frames_to_bytes(P.encode(m)))
        assert type(out) is type(m)
        if isinstance(m, P.Result):
            assert isinstance(out, P.Result)
            assert (out.hidden is None) == (m.hidden is None)
        else:
            assert out == m


def test_tensor_frame_is_a_view_not_a_copy() -> None:
    t = torch.randn(4, 8)  # [B, H]
    mv = P.tensor_frame(t)
    t[0, 0] = 123.0
    assert torch.frombuffer(bytearray(mv), dtype=torch.float32)[0].item() == 123.0


def _header(**kw: object) -> bytes:
    d: dict[str, object] = {"v": P.VERSION}
    d.update(kw)
    return msgpack.packb(d)


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b""], P.E_BAD_MESSAGE),
        ([b"\xc1"], P.E_BAD_MESSAGE),
        ([msgpack.packb([1, 2])], P.E_BAD_MESSAGE),
        ([msgpack.packb({"v": 99, "t": "ping", "nonce": 1})], P.E_VERSION),
        ([_header(t="nope")], P.E_BAD_MESSAGE),
        ([_header(t="ping", nonce="x")], P.E_BAD_MESSAGE),
        ([_header(t="ping", nonce=1), b"extra"], P.E_BAD_MESSAGE),
        ([b"x" * (P.MAX_HEADER_BYTES + 1)], P.E_BAD_MESSAGE),
        (
            [
                _header(
                    t="open",
                    config_fp="c",
                    start=3,
                    end=2,
                    dtype="float16",
                    hidden_size=8,
                    max_context=10,
                )
            ],
            P.E_RANGE,
        ),
        (
            [
                _header(
                    t="open",
                    config_fp="c",
                    start=1,
                    end=2,
                    dtype="int8",
                    hidden_size=8,
                    max_context=10,
                )
            ],
            P.E_SHAPE,
        ),
    ],
)
def test_decoder_rejects_malformed_headers(frames: list[bytes], code: str) -> None:
    with pytest.raises(P.ProtocolError) as ei:
        P.decode(frames)
    assert ei.value.code == code


def _step_frames(**over: object) -> list[bytes]:
    frames = _frames_to_bytes(P.encode(_step()))
    h = msgpack.unpackb(frames[0])
    h.update(over)
    return [msgpack.packb(h), frames[1]]


@pytest.mark.parametrize(
    ("over", "code"),
    [
        ({"dtype": "float64"}, P.E_SHAPE),
        ({"shape": [3, 9]}, P.E_SHAPE),
        ({"shape": [4, 8]}, P.E_SHAPE),
        ({"shape": [3]}, P.E_BAD_MESSAGE),
        ({"positions": [1, 2]}, P.E_SHAPE),  # 3 tensor rows (checked before the parents)
        ({"positions": [5, 6, -1]}, P.E_BAD_MESSAGE),
        ({"parents": [-1, 1, 0]}, P.E_BAD_MESSAGE),  # a node is its own parent
        ({"parents": [-1, 0, 5]}, P.E_BAD_MESSAGE),  # parent after its node
        ({"parents": [-1, -1, 1]}, P.E_BAD_MESSAGE),  # node 1 at 6 hangs off the prefix: ok...
        ({"keep": [2, 1]}, P.E_BAD_MESSAGE),
        ({"keep": [-1]}, P.E_BAD_MESSAGE),
        ({"step": -1}, P.E_BAD_MESSAGE),
        ({"session": ""}, P.E_BAD_MESSAGE),
        ({"want": 1}, P.E_BAD_MESSAGE),
    ],
)
def test_decoder_rejects_bad_steps(over: dict[str, object], code: str) -> None:
    frames = _step_frames(**over)
    if over == {"parents": [-1, -1, 1]}:  # node 2 (pos 7) under node 1 (pos 6): valid
        assert isinstance(P.decode(frames), P.Step)
        return
    with pytest.raises(P.ProtocolError) as ei:
        P.decode(frames)
    assert ei.value.code == code


def test_truncated_tensor_frame_is_rejected() -> None:
    frames = _step_frames()
    with pytest.raises(P.ProtocolError) as ei:
        P.decode([frames[0], frames[1][:-2]])
    assert ei.value.code == P.E_SHAPE


# ----------------------------------------------------------------------------- properties


@FAST
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=4))
def test_random_frames_only_raise_protocol_errors(frames: list[bytes]) -> None:
    try:
        P.decode(frames)
    except P.ProtocolError as exc:
        assert exc.code in P.ERROR_CODES


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
    max_leaves=20,
)


@FAST
@given(
    st.sampled_from(P.TYPES),
    st.dictionaries(
        st.sampled_from(
            [
                "session",
                "step",
                "positions",
                "parents",
                "keep",
                "dtype",
                "shape",
                "want",
                "nonce",
                "config_fp",
                "weights_fp",
                "start",
                "end",
                "hidden_size",
                "max_context",
                "code",
                "message",
                "server_ms",
                "known",
                "last_step",
                "in_flight",
            ]
        ),
        _values,
        max_size=10,
    ),
    st.lists(st.binary(max_size=200), max_size=2),
)
def test_random_headers_only_raise_protocol_errors(
    t: str, fields: dict[str, object], tail: list[bytes]
) -> None:
    header = msgpack.packb({"v": P.VERSION, "t": t, **fields}, use_bin_type=True)
    try:
        msg = P.decode([header, *tail])
    except P.ProtocolError as exc:
        assert exc.code in P.ERROR_CODES
        return
    # whatever the decoder accepted is a well-formed message
    assert type(msg).__name__.lower() == t or isinstance(msg, P.Error)
    if isinstance(msg, P.Step):
        assert msg.hidden.shape == (len(msg.positions), msg.hidden.shape[1])
        if msg.parents is not None:
            assert all(-1 <= p < i for i, p in enumerate(msg.parents))


@st.composite
def _trees(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    n = draw(st.integers(1, 12))
    base = draw(st.integers(0, 1000))
    parents: list[int] = []
    positions: list[int] = []
    for i in range(n):
        p = draw(st.integers(-1, i - 1))
        parents.append(p)
        positions.append(base if p < 0 else positions[p] + 1)
    return positions, parents


@FAST
@given(_trees(), st.sampled_from(list(P.WIRE_DTYPES)), st.integers(1, 16), st.integers(0, 99))
def test_valid_trees_round_trip(
    tree: tuple[list[int], list[int]], dtype: str, h: int, step: int
) -> None:
    positions, parents = tree
    hidden = torch.randn(len(positions), h).to(P.WIRE_DTYPES[dtype])  # [B, H]
    m = P.Step("abc", step, positions, parents, list(range(0, len(positions), 2)), dtype, hidden)
    out = P.decode(_frames_to_bytes(P.encode(m)))
    assert isinstance(out, P.Step)
    assert (out.positions, out.parents, out.keep, out.step) == (
        positions,
        parents,
        m.keep,
        step,
    )
    assert torch.equal(out.hidden, hidden)


@FAST
@given(_trees(), st.integers(0, 50), st.binary(min_size=1, max_size=4))
def test_corrupted_valid_steps_never_crash(
    tree: tuple[list[int], list[int]], cut: int, junk: bytes
) -> None:
    positions, parents = tree
    hidden = torch.randn(len(positions), 4)  # [B, H]
    frames = _frames_to_bytes(P.encode(P.Step("s", 0, positions, parents, None, "float32", hidden)))
    for bad in (
        [frames[0][: max(len(frames[0]) - cut, 0)], frames[1]],
        [frames[0] + junk, frames[1]],
        [frames[0], frames[1] + junk],
        [frames[0], frames[1][cut:]] if cut else [frames[0]],
    ):
        with contextlib.suppress(P.ProtocolError):
            P.decode(bad)


def test_invite_round_trip_and_damage() -> None:
    code = P.make_invite("tcp://10.0.0.5:5757", "x" * 40)
    assert P.parse_invite(code) == ("tcp://10.0.0.5:5757", "x" * 40)
    for bad in ("hello", "veil1:", "veil1:!!!", code[:-6]):
        with pytest.raises(ValueError):
            P.parse_invite(bad)


# ---------------------------------------------------------------- load report (issue 32)


def test_result_load_round_trips_and_is_optional() -> None:
    load = P.Load(peers=3.5, row_ms=2.25, busy=0.75, fixed_ms=30.5)
    for hidden in (torch.ones(2, 4, dtype=torch.float16), None):
        out = P.decode(_frames_to_bytes(P.encode(P.Result("sid", 3, 1.5, hidden, 0.5, load))))
        assert isinstance(out, P.Result) and out.load == load
    # a server from before the load report: no field, no load
    out = P.decode(_frames_to_bytes(P.encode(P.Result("sid", 3, 1.5, None))))
    assert isinstance(out, P.Result) and out.load is None
    # a later server's extra keys are ignored
    h = {"v": P.VERSION, "t": P.RESULT, "session": "s", "step": 1, "server_ms": 1.0}
    h["load"] = {"peers": 1, "row_ms": 2, "busy": 1, "fixed_ms": 0, "later": "x"}
    out = P.decode([msgpack.packb(h)])
    assert isinstance(out, P.Result) and out.load == P.Load(1.0, 2.0, 1.0, 0.0)


@pytest.mark.parametrize(
    "load",
    [
        "busy",
        [1, 2, 3],
        {"peers": 1.0, "row_ms": 2.0, "busy": 0.5},  # a key missing
        {"peers": -1.0, "row_ms": 2.0, "busy": 0.5, "fixed_ms": 1.0},
        {"peers": 1.0, "row_ms": float("nan"), "busy": 0.5, "fixed_ms": 1.0},
        {"peers": 1.0, "row_ms": float("inf"), "busy": 0.5, "fixed_ms": 1.0},
        {"peers": 1.0, "row_ms": 2.0, "busy": 1.5, "fixed_ms": 1.0},
        {"peers": True, "row_ms": 2.0, "busy": 0.5, "fixed_ms": 1.0},
        {"peers": "3", "row_ms": 2.0, "busy": 0.5, "fixed_ms": 1.0},
        {"peers": 1e9, "row_ms": 2.0, "busy": 0.5, "fixed_ms": 1.0},
        {"peers": 1.0, "row_ms": 2.0, "busy": 0.5, "fixed_ms": -3.0},
        {f"k{i}": 0 for i in range(20)} | {"peers": 1, "row_ms": 1, "busy": 0, "fixed_ms": 0},
    ],
)
def test_a_hostile_servers_load_is_refused_with_a_clear_error(load: object) -> None:
    h = {"v": P.VERSION, "t": P.RESULT, "session": "s", "step": 1, "server_ms": 1.0, "load": load}
    with pytest.raises(P.ProtocolError) as err:
        P.decode([msgpack.packb(h)])
    assert err.value.code == P.E_BAD_MESSAGE and "load" in err.value.message
