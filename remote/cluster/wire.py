"""The gateway <-> replica link: validated steps out, results back, over CurveZMQ.

Why not Ray actor calls for every step: measured on our 2-core VM, a Ray actor call round trip
(async or sync actor, ``ray.get`` or a future callback) took 2.6-6.5 ms p50 under load, against the
issue's +2 ms budget for the whole hop; and Ray only orders calls from one caller for synchronous
single-threaded actors, while a replica must take steps while it computes. A ZeroMQ socket pair
keeps order per connection and costs tens of microseconds, so Ray keeps what it is good at —
placing replicas on GPUs, restarting them, telling the gateway when one dies — and the steps
travel here.

Each replica binds a PULL socket (its *inbox*); the gateway connects one PUSH per replica. The
gateway binds one PULL for results; every replica connects a PUSH to it. Both bound sockets are
CURVE servers whose ZAP handler admits only the other side's public key (exchanged through Ray),
so hidden states between gateway and replicas are encrypted and authenticated like the client's.

Messages: frame 0 is one byte (the kind), frame 1 a msgpack map, and a step or a result carrying
activations has one more frame with the raw [B, H] tensor. The gateway has already validated
every field against the session, so the replica trusts the header (its peer is authenticated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from engine import protocol as P

OPEN = b"o"
CLOSE = b"c"
STEP = b"s"
DONE = b"d"
RESET = b"r"  # forget every session (the gateway dropped them while this replica lived on)
KINDS = (OPEN, CLOSE, STEP, DONE, RESET)
ZAP_DOMAIN = "veil-cluster"

Frames = list[Any]


class WireError(Exception):
    """A message on the internal link that does not parse (a bug or a version mismatch)."""


def _pack(kind: bytes, header: dict[str, Any], tensor: torch.Tensor | None = None) -> Frames:
    frames: Frames = [kind, msgpack.packb(header, use_bin_type=True)]
    if tensor is not None:
        frames.append(P.tensor_frame(tensor))
    return frames


def _unpack_tensor(frame: Any, dtype: str, shape: Any) -> torch.Tensor:
    tdt = P.WIRE_DTYPES.get(dtype)
    if tdt is None or not isinstance(shape, list) or len(shape) != 2:
        raise WireError(f"bad tensor description {dtype!r} {shape!r}")
    b, h = int(shape[0]), int(shape[1])
    buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    if buf.nbytes != b * h * torch.tensor([], dtype=tdt).element_size():
        raise WireError(f"tensor frame of {buf.nbytes} bytes for {shape} {dtype}")
    if buf.readonly:  # torch.frombuffer needs a writable buffer
        buf = memoryview(bytearray(buf))
    return torch.frombuffer(buf.cast("B"), dtype=torch.uint8).view(tdt).view(b, h)  # [B, H]


def open_msg(sid: str, start: int, end: int, capacity: int, owner: str = "") -> Frames:
    """Open a session for the client key ``owner`` (the replica's turns and counters are per
    key, as a single server's are)."""
    return _pack(OPEN, {"sid": sid, "start": start, "end": end, "cap": capacity, "own": owner})


def close_msg(sid: str) -> Frames:
    return _pack(CLOSE, {"sid": sid})


def reset_msg() -> Frames:
    return _pack(RESET, {"sid": ""})


def step_msg(
    sid: str,
    step: int,
    positions: list[int],
    parents: list[int] | None,
    keep: list[int] | None,
    hidden: torch.Tensor,
    want: bool,
    out_dtype: torch.dtype,
) -> Frames:
    header = {
        "sid": sid,
        "step": step,
        "pos": positions,
        "par": parents,
        "keep": keep,
        "want": want,
        "out": P.dtype_name(out_dtype),
        "dt": P.dtype_name(hidden.dtype),
        "shape": list(hidden.shape),
    }
    return _pack(STEP, header, hidden)


def done_msg(
    incarnation: str,
    sid: str,
    step: int,
    hidden: torch.Tensor | None,
    server_ms: float,
    batch_rows: int,
    error: tuple[str, str] | None,
    load: P.Load | None = None,
) -> Frames:
    header: dict[str, Any] = {
        "inc": incarnation,
        "sid": sid,
        "step": step,
        "ms": float(server_ms),
        "rows": int(batch_rows),
        "err": list(error) if error is not None else None,
    }
    if load is not None:  # the replica's own load: the gateway's reply carries it on
        header["load"] = [load.peers, load.row_ms, load.busy, load.fixed_ms]
    if hidden is not None:
        header["dt"] = P.dtype_name(hidden.dtype)
        header["shape"] = list(hidden.shape)
    return _pack(DONE, header, hidden)


def parse_load(v: object) -> P.Load | None:
    """A replica's load report from a ``done`` header (None when absent, or not four numbers in
    range: the client then simply hears no load)."""
    if not isinstance(v, list) or len(v) != 4:
        return None
    try:
        return P.check_load(dict(zip(("peers", "row_ms", "busy", "fixed_ms"), v, strict=True)))
    except P.ProtocolError:
        return None


@dataclass
class Message:
    kind: bytes
    header: dict[str, Any]
    tensor: torch.Tensor | None


def parse(frames: Frames) -> Message:
    """One internal message; :class:`WireError` when it is not one."""
    if len(frames) not in (2, 3):
        raise WireError(f"{len(frames)} frames")
    kind = bytes(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0])
    if kind not in KINDS:
        raise WireError(f"unknown kind {kind!r}")
    raw = frames[1].bytes if hasattr(frames[1], "bytes") else frames[1]
    try:
        header = msgpack.unpackb(raw, raw=False)
    except Exception as exc:
        raise WireError(f"header: {type(exc).__name__}") from None
    if not isinstance(header, dict) or not isinstance(header.get("sid"), str):
        raise WireError("header without a session id")
    tensor = None
    if len(frames) == 3:
        tensor = _unpack_tensor(frames[2], str(header.get("dt")), header.get("shape"))
    return Message(kind, header, tensor)
