"""The Veil trunk wire protocol, shared by the client (``engine.transport``) and the server
(``remote.server``). Documented in ``docs/protocol.md``.

Every message is a ZeroMQ multipart message: frame 0 is a msgpack map (the *header*), and a
message that carries activations has exactly one more frame: the raw bytes of a C-contiguous
[B, H] tensor in the dtype the header names. Tensor frames are sent and received without
copies (``copy=False`` + buffer views).

Header keys common to every message: ``v`` (protocol version, int) and ``t`` (type, str).

:func:`decode` validates everything that can be checked without server state — version, type,
field types, sizes, dtype, shape vs. frame length, positions, parents (topological order) and
keep (strictly ascending, non-negative) — and raises :class:`ProtocolError` with an error code
otherwise. Checks that need session state (hidden size, keep vs. the previous block, step order,
ownership) are done by the server with the same codes.
"""

from __future__ import annotations

import base64
import itertools
import json
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

VERSION = 1

# message types
OPEN = "open"
OPENED = "opened"
STEP = "step"
RESULT = "result"
CLOSE = "close"
CLOSED = "closed"
PING = "ping"
PONG = "pong"
ERROR = "error"
# model delivery (delivery version DELIVERY_VERSION, field `dv`; see docs/protocol.md)
PART_GET = "part_get"
PART = "part"
CHUNK_GET = "chunk_get"
CHUNK = "chunk"
TYPES: tuple[str, ...] = (OPEN, OPENED, STEP, RESULT, CLOSE, CLOSED, PING, PONG, ERROR)
TYPES += (PART_GET, PART, CHUNK_GET, CHUNK)

# error codes
E_BAD_MESSAGE = "bad_message"  # malformed header / frames / fields
E_VERSION = "version"  # unknown protocol version
E_UNKNOWN_SESSION = "unknown_session"  # no such session for this connection (or it expired)
E_BAD_STEP = "bad_step"  # step id out of order
E_SHAPE = "shape"  # tensor shape/dtype/size does not match the session
E_BUSY = "busy"  # session or memory cap reached
E_FINGERPRINT = "fingerprint"  # server serves a different model
E_RANGE = "range"  # requested layer range not served
E_CONTEXT = "context"  # position beyond the session's max context
E_INTERNAL = "internal"  # unexpected server failure (the session is dropped)
E_DENIED = "denied"  # this key is not (or no longer) allowed, or the id belongs to another key
E_PART = "part"  # no such client part: the server ships none, or its model changed since
E_KEY = "key"  # the organisation key of the session and of the server's keyed model differ
ERROR_CODES = (
    E_BAD_MESSAGE,
    E_VERSION,
    E_UNKNOWN_SESSION,
    E_BAD_STEP,
    E_SHAPE,
    E_BUSY,
    E_FINGERPRINT,
    E_RANGE,
    E_CONTEXT,
    E_INTERNAL,
    E_DENIED,
    E_PART,
    E_KEY,
)

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
WIRE_ALIASES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}

MAX_HEADER_BYTES = 64 * 1024
MAX_BLOCK = 4096  # tokens in one step
MAX_HIDDEN = 65536
MAX_POSITION = 1 << 24
MAX_FRAMES = 2
MAX_ID_LEN = 64

INVITE_PREFIX = "veil1:"

DELIVERY_VERSION = 1  # the model-delivery messages' own version (`dv`)
MAX_CHUNK = 1 << 20  # bytes of one chunk of a client part file
MAX_MANIFEST = 8 << 20  # bytes of a client part's manifest
MAX_FILES = 64  # files in one client part
SIGNATURE_LEN = 64  # an Ed25519 signature
PART_ID_LEN = 24

# CurveZMQ keys travel and are shown as Z85 text: 40 characters for 32 bytes.
Z85_ALPHABET = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" + ".-:+=^!/*?&<>()[]{}@%$#"
)
CURVE_KEY_LEN = 40


class ProtocolError(Exception):
    """A message that breaks the protocol; ``code`` is one of :data:`ERROR_CODES`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def wire_dtype_name(name: str) -> str:
    n = WIRE_ALIASES.get(name.lower(), name.lower())
    if n not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype '{name}' (use float16, bfloat16 or float32)")
    return n


# --------------------------------------------------------------------------- messages


@dataclass
class Open:
    config_fp: str
    weights_fp: str | None  # None: the client cannot hash the trunk weights (it lacks them)
    start: int
    end: int
    dtype: str
    hidden_size: int
    max_context: int
    # the whole model's weights fingerprint, from a client part the server shipped (None: a
    # model the client loaded itself); a server shipping another model refuses the session
    model_fp: str | None = None
    # the public id of the organisation key the client holds (None: none): a server running a
    # keyed model opens a session only for its own key id, a plain server only for None
    key_id: str | None = None


@dataclass
class Opened:
    session: str
    start: int
    end: int
    max_context: int
    server_dtype: str
    # the organisation key id of the keyed model the session runs (None: the public model). A
    # client that sent a key id checks it here too (a server older than keyed models ignores
    # the Open's key_id and answers without one)
    key_id: str | None = None


@dataclass
class Step:
    session: str
    step: int
    positions: list[int]
    parents: list[int] | None
    keep: list[int] | None
    dtype: str
    hidden: torch.Tensor  # [B, H] in ``dtype``
    want: bool = True  # False: replay step, the reply carries no tensor


MAX_LOAD_PEERS = 1_000_000.0  # bounds of a Result's load report (a hostile server's is refused)
MAX_LOAD_ROW_MS = 60_000.0


@dataclass
class Load:
    """The trunk's current load, as one reply reports it (aggregates over every key's work,
    smoothed over recent batches; see docs/protocol.md)."""

    peers: float  # other steps sharing a batch with, or queued behind, a step (average)
    row_ms: float  # marginal compute of one more row in a batch, ms (fitted over recent batches)
    busy: float  # fraction of recent wall time the trunk was computing, in [0, 1]
    fixed_ms: float = 0.0  # a batch's compute at zero rows, ms (the same fit's intercept)


@dataclass
class Result:
    session: str
    step: int
    server_ms: float
    hidden: torch.Tensor | None  # [B, H] in the request's dtype; None for want=False
    queue_ms: float = 0.0  # time the step waited on the server before its compute began
    load: Load | None = None  # the server's load (None: a server that does not report it)


@dataclass
class Close:
    session: str


@dataclass
class Closed:
    session: str


@dataclass
class Ping:
    nonce: int
    session: str | None = None
    stats: bool = False  # ask for the server's public statistics (`veil-trunk loadtest`)


@dataclass
class Pong:
    nonce: int
    known: bool = False  # the ping's session exists for this connection
    last_step: int = -1  # last step accepted for it
    in_flight: bool = False  # a step of it is being computed
    stats: dict[str, Any] | None = None  # answer to Ping(stats=True): see check_stats


@dataclass
class Error:
    code: str
    message: str
    session: str | None = None
    step: int | None = None


@dataclass
class PartGet:
    """Ask for the manifest of the client part this server ships."""

    dv: int = DELIVERY_VERSION


@dataclass
class Part:
    """The signed manifest (JSON bytes, in the second frame) of the client part."""

    part_id: str
    manifest: bytes
    signature: bytes  # Ed25519 over manifest_message(manifest)


@dataclass
class ChunkGet:
    part_id: str
    file: int  # index into the manifest's files
    chunk: int  # index of the chunk in that file


@dataclass
class Chunk:
    part_id: str
    file: int
    chunk: int
    data: bytes | memoryview  # at most MAX_CHUNK bytes (second frame)


Message = (
    Open | Opened | Step | Result | Close | Closed | Ping | Pong | Error | PartGet | Part | ChunkGet
) | Chunk

# --------------------------------------------------------------------------- encoding

Frame = bytes | memoryview


def _header(t: str, **fields: Any) -> bytes:
    d = {"v": VERSION, "t": t}
    d.update({k: v for k, v in fields.items() if v is not None})
    return msgpack.packb(d, use_bin_type=True)


def tensor_frame(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, as a view (no copy when already contiguous)."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    # bf16 has no numpy dtype: reinterpret as bytes first.
    arr: Any = t.view(torch.uint8).reshape(-1).numpy()
    return memoryview(arr)


def encode(msg: Message) -> list[Frame]:
    """Frames for one message."""
    if isinstance(msg, Open):
        return [
            _header(
                OPEN,
                config_fp=msg.config_fp,
                weights_fp=msg.weights_fp,
                start=msg.start,
                end=msg.end,
                dtype=msg.dtype,
                hidden_size=msg.hidden_size,
                max_context=msg.max_context,
                model_fp=msg.model_fp,
                key_id=msg.key_id,
            )
        ]
    if isinstance(msg, Opened):
        return [
            _header(
                OPENED,
                session=msg.session,
                start=msg.start,
                end=msg.end,
                max_context=msg.max_context,
                server_dtype=msg.server_dtype,
                key_id=msg.key_id,
            )
        ]
    if isinstance(msg, Step):
        b, h = msg.hidden.shape
        return [
            _header(
                STEP,
                session=msg.session,
                step=msg.step,
                positions=list(msg.positions),
                parents=None if msg.parents is None else list(msg.parents),
                keep=None if msg.keep is None else list(msg.keep),
                dtype=msg.dtype,
                shape=[b, h],
                want=msg.want,
            ),
            tensor_frame(msg.hidden),
        ]
    if isinstance(msg, Result):
        load = None
        if msg.load is not None:
            ld = msg.load
            load = {
                "peers": float(ld.peers),
                "row_ms": float(ld.row_ms),
                "busy": float(ld.busy),
                "fixed_ms": float(ld.fixed_ms),
            }
        if msg.hidden is None:
            return [
                _header(
                    RESULT,
                    session=msg.session,
                    step=msg.step,
                    server_ms=float(msg.server_ms),
                    queue_ms=float(msg.queue_ms),
                    load=load,
                )
            ]
        b, h = msg.hidden.shape
        return [
            _header(
                RESULT,
                session=msg.session,
                step=msg.step,
                server_ms=float(msg.server_ms),
                queue_ms=float(msg.queue_ms),
                load=load,
                dtype=dtype_name(msg.hidden.dtype),
                shape=[b, h],
            ),
            tensor_frame(msg.hidden),
        ]
    if isinstance(msg, Close):
        return [_header(CLOSE, session=msg.session)]
    if isinstance(msg, Closed):
        return [_header(CLOSED, session=msg.session)]
    if isinstance(msg, Ping):
        return [_header(PING, nonce=msg.nonce, session=msg.session, stats=msg.stats or None)]
    if isinstance(msg, Pong):
        return [
            _header(
                PONG,
                nonce=msg.nonce,
                known=msg.known,
                last_step=msg.last_step,
                in_flight=msg.in_flight,
                stats=msg.stats,
            )
        ]
    if isinstance(msg, Error):
        return [
            _header(ERROR, code=msg.code, message=msg.message, session=msg.session, step=msg.step)
        ]
    if isinstance(msg, PartGet):
        return [_header(PART_GET, dv=msg.dv)]
    if isinstance(msg, Part):
        head = _header(PART, dv=DELIVERY_VERSION, part_id=msg.part_id, sig=bytes(msg.signature))
        return [head, msg.manifest]
    if isinstance(msg, ChunkGet):
        return [_header(CHUNK_GET, part_id=msg.part_id, file=msg.file, chunk=msg.chunk)]
    if isinstance(msg, Chunk):
        return [_header(CHUNK, part_id=msg.part_id, file=msg.file, chunk=msg.chunk), msg.data]
    raise TypeError(f"not a protocol message: {type(msg).__name__}")


def dtype_name(dtype: torch.dtype) -> str:
    for k, v in WIRE_DTYPES.items():
        if v == dtype:
            return k
    raise ValueError(f"dtype {dtype} cannot travel on the wire")


# --------------------------------------------------------------------------- decoding


def _bad(msg: str) -> ProtocolError:
    return ProtocolError(E_BAD_MESSAGE, msg)


def _int(h: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = h.get(key)
    if type(v) is not int:
        raise _bad(f"field '{key}' must be an integer")
    if not lo <= v <= hi:
        raise _bad(f"field '{key}' = {v} is out of range [{lo}, {hi}]")
    return v


def _str(h: dict[str, Any], key: str, max_len: int = 256, optional: bool = False) -> str | None:
    v = h.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or len(v) > max_len:
        raise _bad(f"field '{key}' must be a non-empty string of at most {max_len} characters")
    return v


def _float(h: dict[str, Any], key: str) -> float:
    v: Any = h.get(key)
    if type(v) not in (int, float) or v != v or v < 0:
        raise _bad(f"field '{key}' must be a non-negative number")
    return float(v)


def _bool(h: dict[str, Any], key: str, default: bool) -> bool:
    v = h.get(key, default)
    if type(v) is not bool:
        raise _bad(f"field '{key}' must be a boolean")
    return v


def _list(h: dict[str, Any], key: str, optional: bool) -> list[Any] | None:
    """A list field, its length checked (not its entries: see :func:`check_ints`)."""
    v = h.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, list) or len(v) > MAX_BLOCK:
        raise _bad(f"field '{key}' must be a list of at most {MAX_BLOCK} integers")
    return v


def check_ints(key: str, v: Sequence[Any]) -> None:
    """Every entry of list field ``key`` an integer (not a bool, not a float)."""
    if not set(map(type, v)) <= {int}:
        raise _bad(f"field '{key}' must hold integers only")


def check_block(positions: Sequence[int], parents: Sequence[int] | None) -> None:
    """Positions in range and parents a topological tree over the block."""
    n = len(positions)
    if n == 0:
        raise _bad("a step needs at least one token")
    if min(positions) < 0 or max(positions) >= MAX_POSITION:
        raise _bad(f"positions must lie in [0, {MAX_POSITION})")
    if parents is not None:
        if len(parents) != n:
            raise _bad(f"parents has {len(parents)} entries for a block of {n}")
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise _bad(f"parents[{i}] = {p}: a parent must precede its node (or be -1)")
            if p >= 0 and positions[i] != positions[p] + 1:
                raise _bad(
                    f"node {i} is at position {positions[i]} but its parent at {positions[p]}"
                )


def check_keep(keep: Sequence[int] | None) -> None:
    if not keep:
        return
    if keep[0] < 0 or not all(map(operator.lt, keep, itertools.islice(keep, 1, None))):
        raise _bad("keep must be strictly ascending, non-negative node indices")


def check_stats(v: Any, depth: int = 0) -> dict[str, Any]:
    """A server's statistics map: string keys; numbers, booleans, short strings, lists of those,
    and maps of the same (two levels deep at most)."""
    if not isinstance(v, dict) or len(v) > 4096:
        raise _bad("field 'stats' must be a map of at most 4096 entries")
    for k, x in v.items():
        if not isinstance(k, str) or len(k) > 64:
            raise _bad("stats keys must be short strings")
        if isinstance(x, dict):
            if depth >= 1:
                raise _bad("stats nest two levels at most")
            check_stats(x, depth + 1)
        elif isinstance(x, list):
            if len(x) > 64 or not all(_stat_scalar(e) for e in x):
                raise _bad("stats lists hold at most 64 numbers or strings")
        elif not _stat_scalar(x):
            raise _bad(f"stats value for {k!r} is not a number, boolean or short string")
    return v


def check_load(v: Any) -> Load:
    """A Result's ``load`` map: ``peers`` (0 to MAX_LOAD_PEERS), ``row_ms`` and ``fixed_ms`` (0
    to MAX_LOAD_ROW_MS) and ``busy`` (0 to 1), finite numbers all. Other keys (a later server's)
    are ignored, up to 16 entries in all."""
    keys = ("peers", "row_ms", "busy", "fixed_ms")
    if not isinstance(v, dict) or len(v) > 16 or not set(keys) <= set(v):
        raise _bad("field 'load' must be a map holding 'peers', 'row_ms', 'busy' and 'fixed_ms'")
    limits = (MAX_LOAD_PEERS, MAX_LOAD_ROW_MS, 1.0, MAX_LOAD_ROW_MS)
    for k, hi in zip(keys, limits, strict=True):
        x = v[k]
        if type(x) not in (int, float) or not 0.0 <= x <= hi:  # (NaN fails the comparison)
            raise _bad(f"load '{k}' must be a number in [0, {hi:g}]")
    return Load(*(float(v[k]) for k in keys))


def _stat_scalar(x: Any) -> bool:
    if isinstance(x, str):
        return len(x) <= 256
    return type(x) in (int, float, bool) and x == x


def _tensor(frame: Any, dtype: str, shape: list[int] | None) -> torch.Tensor:
    if not isinstance(shape, list) or len(shape) != 2 or any(type(x) is not int for x in shape):
        raise _bad("field 'shape' must be [tokens, hidden]")
    b, h = shape
    if not 1 <= b <= MAX_BLOCK or not 1 <= h <= MAX_HIDDEN:
        raise ProtocolError(E_SHAPE, f"tensor shape {shape} is out of range")
    tdt = WIRE_DTYPES.get(dtype)
    if tdt is None:
        raise ProtocolError(E_SHAPE, f"unknown tensor dtype '{dtype}'")
    buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    size = b * h * torch.tensor([], dtype=tdt).element_size()
    if buf.nbytes != size:
        raise ProtocolError(
            E_SHAPE, f"tensor frame has {buf.nbytes} bytes, shape {shape} {dtype} needs {size}"
        )
    if buf.readonly:  # torch.frombuffer wants a writable buffer; a read-only one is copied once
        buf = memoryview(bytearray(buf))
    return torch.frombuffer(buf.cast("B"), dtype=torch.uint8).view(tdt).view(b, h)  # [B, H]


def _frame_bytes(frame: Any) -> bytes:
    if isinstance(frame, bytes):
        return frame
    if hasattr(frame, "bytes"):
        return bytes(frame.bytes)
    return bytes(frame)


def decode(frames: Sequence[Any]) -> Message:
    """Parse and validate one message (frames: bytes, memoryviews or ``zmq.Frame``)."""
    if not 1 <= len(frames) <= MAX_FRAMES:
        raise _bad(f"a message has 1 or 2 frames, got {len(frames)}")
    raw = _frame_bytes(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise _bad(f"header is {len(raw)} bytes, the limit is {MAX_HEADER_BYTES}")
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:
        raise _bad(f"header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(h, dict):
        raise _bad("header must be a map")
    v = h.get("v")
    if type(v) is not int:
        raise _bad("header lacks the protocol version 'v'")
    if v != VERSION:
        raise ProtocolError(E_VERSION, f"protocol version {v} is not supported (this is {VERSION})")
    t = h.get("t")
    if t not in TYPES:
        raise _bad(f"unknown message type {t!r}")
    has_tensor = t in (STEP, RESULT) and (t == STEP or "shape" in h)
    want_frames = 2 if has_tensor or t in (PART, CHUNK) else 1
    if len(frames) != want_frames:
        raise _bad(f"a '{t}' message has {want_frames} frame(s), got {len(frames)}")
    if t == OPEN:
        dt = _str(h, "dtype", 16)
        if dt not in WIRE_DTYPES:
            raise ProtocolError(E_SHAPE, f"unknown wire dtype {dt!r}")
        start = _int(h, "start", 0, 100_000)
        end = _int(h, "end", 0, 100_000)
        if end <= start:
            raise ProtocolError(E_RANGE, f"empty layer range [{start}, {end})")
        return Open(
            config_fp=str(_str(h, "config_fp", 128)),
            weights_fp=_str(h, "weights_fp", 128, optional=True),
            start=start,
            end=end,
            dtype=str(dt),
            hidden_size=_int(h, "hidden_size", 1, MAX_HIDDEN),
            max_context=_int(h, "max_context", 1, MAX_POSITION),
            model_fp=_str(h, "model_fp", 128, optional=True),
            key_id=_str(h, "key_id", MAX_ID_LEN, optional=True),
        )
    if t == OPENED:
        return Opened(
            session=str(_str(h, "session", MAX_ID_LEN)),
            start=_int(h, "start", 0, 100_000),
            end=_int(h, "end", 0, 100_000),
            max_context=_int(h, "max_context", 1, MAX_POSITION),
            server_dtype=str(_str(h, "server_dtype", 16)),
            key_id=_str(h, "key_id", MAX_ID_LEN, optional=True),
        )
    if t == STEP:
        # Sizes first, entries last: a message whose lists disagree with its tensor is refused
        # before any list is walked (cheap to send must not mean costly to check).
        positions = _list(h, "positions", optional=False)
        assert positions is not None
        parents = _list(h, "parents", optional=True)
        keep = _list(h, "keep", optional=True)
        dt = str(_str(h, "dtype", 16))
        hidden = _tensor(frames[1], dt, h.get("shape"))
        n = hidden.shape[0]
        if n != len(positions):
            raise ProtocolError(E_SHAPE, f"{n} hidden rows for {len(positions)} positions")
        if parents is not None and len(parents) != n:
            raise _bad(f"parents has {len(parents)} entries for a block of {n}")
        for key, v in (("positions", positions), ("parents", parents), ("keep", keep)):
            if v is not None:
                check_ints(key, v)
        check_block(positions, parents)
        check_keep(keep)
        return Step(
            session=str(_str(h, "session", MAX_ID_LEN)),
            step=_int(h, "step", 0, 1 << 62),
            positions=positions,
            parents=parents,
            keep=keep,
            dtype=dt,
            hidden=hidden,
            want=_bool(h, "want", True),
        )
    if t == RESULT:
        out: torch.Tensor | None = None
        if has_tensor:
            out = _tensor(frames[1], str(_str(h, "dtype", 16)), h.get("shape"))
        return Result(
            session=str(_str(h, "session", MAX_ID_LEN)),
            step=_int(h, "step", 0, 1 << 62),
            server_ms=_float(h, "server_ms"),
            queue_ms=_float(h, "queue_ms") if "queue_ms" in h else 0.0,
            hidden=out,
            load=check_load(h["load"]) if "load" in h else None,
        )
    if t == CLOSE:
        return Close(session=str(_str(h, "session", MAX_ID_LEN)))
    if t == CLOSED:
        return Closed(session=str(_str(h, "session", MAX_ID_LEN)))
    if t == PING:
        return Ping(
            nonce=_int(h, "nonce", 0, 1 << 62),
            session=_str(h, "session", MAX_ID_LEN, optional=True),
            stats=_bool(h, "stats", False),
        )
    if t == PONG:
        return Pong(
            nonce=_int(h, "nonce", 0, 1 << 62),
            known=_bool(h, "known", False),
            last_step=_int(h, "last_step", -1, 1 << 62),
            in_flight=_bool(h, "in_flight", False),
            stats=check_stats(h["stats"]) if "stats" in h else None,
        )
    if t in (PART_GET, PART, CHUNK_GET, CHUNK):
        return _decode_delivery(t, h, frames)
    # ERROR
    code = _str(h, "code", 64)
    step = h.get("step")
    return Error(
        code=str(code),
        message=str(_str(h, "message", 4096)),
        session=_str(h, "session", MAX_ID_LEN, optional=True),
        step=step if type(step) is int else None,
    )


def _decode_delivery(t: str, h: dict[str, Any], frames: Sequence[Any]) -> Message:
    if t == PART_GET:
        dv = _int(h, "dv", 0, 1 << 16)
        if dv != DELIVERY_VERSION:
            raise ProtocolError(
                E_VERSION,
                f"model delivery version {dv} is not supported (this is {DELIVERY_VERSION})",
            )
        return PartGet(dv)
    part_id = str(_str(h, "part_id", PART_ID_LEN))
    if t == PART:
        sig = h.get("sig")
        if not isinstance(sig, bytes) or len(sig) != SIGNATURE_LEN:
            raise _bad(f"field 'sig' must be {SIGNATURE_LEN} bytes")
        manifest = _frame_bytes(frames[1])
        if not 0 < len(manifest) <= MAX_MANIFEST:
            raise _bad(f"a manifest has 1 to {MAX_MANIFEST} bytes, got {len(manifest)}")
        return Part(part_id, manifest, sig)
    file = _int(h, "file", 0, MAX_FILES - 1)
    chunk = _int(h, "chunk", 0, 1 << 40)
    if t == CHUNK_GET:
        return ChunkGet(part_id, file, chunk)
    data = _frame_bytes(frames[1])
    if not 0 < len(data) <= MAX_CHUNK:
        raise _bad(f"a chunk has 1 to {MAX_CHUNK} bytes, got {len(data)}")
    return Chunk(part_id, file, chunk, data)


# --------------------------------------------------------------------------- invites


def make_invite(address: str, server_public_key: str, sign_key: str | None = None) -> str:
    """One pasteable string holding a server's address and CURVE public key (and the public
    key that signs the model parts it ships, base64url, when it has one)."""
    d = {"a": address, "k": server_public_key}
    if sign_key:
        d["s"] = sign_key
    blob = json.dumps(d, separators=(",", ":")).encode()
    return INVITE_PREFIX + base64.urlsafe_b64encode(blob).decode().rstrip("=")


def invite_sign_key(code: str) -> str | None:
    """The model-signing public key an invite carries (None: an invite made before model
    delivery, or a damaged code — :func:`parse_invite` reports that)."""
    code = code.strip()
    if not code.startswith(INVITE_PREFIX):
        return None
    body = code[len(INVITE_PREFIX) :]
    try:
        d = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        s = d.get("s")
    except Exception:
        return None
    return s if isinstance(s, str) and 40 <= len(s) <= 64 else None


def curve_key_problem(key: object) -> str | None:
    """Why ``key`` is not a Z85 CurveZMQ key (None when it is one).

    Checked fully here, not left to libzmq: a 40-character string that is not Z85 makes
    ``curve_serverkey`` fail deep inside socket set-up (and once left a client hung)."""
    if not isinstance(key, str) or len(key) != CURVE_KEY_LEN:
        return f"a key is {CURVE_KEY_LEN} characters (Z85)"
    for i in range(0, CURVE_KEY_LEN, 5):
        value = 0
        for ch in key[i : i + 5]:
            digit = Z85_ALPHABET.find(ch)
            if digit < 0:
                return f"the character {ch!r} cannot appear in a Z85 key"
            value = value * 85 + digit
        if value >= 1 << 32:
            return "the key is not valid Z85 (a group of 5 characters is out of range)"
    return None


def parse_invite(code: str) -> tuple[str, str]:
    """(address, server public key) from an invite; ValueError with a clear message if bad."""
    code = code.strip()
    if not code.startswith(INVITE_PREFIX):
        raise ValueError("an invite code starts with 'veil1:'")
    body = code[len(INVITE_PREFIX) :]
    try:
        d = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        address, key = d["a"], d["k"]
    except Exception:
        raise ValueError("the invite code is damaged (copy it again, whole)") from None
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise ValueError("the invite code holds no tcp:// address")
    problem = curve_key_problem(key)
    if problem is not None:
        raise ValueError(f"the invite code's server key is damaged ({problem}); ask for a new one")
    return address, key
