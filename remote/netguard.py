"""The trunk server's TCP connections, watched where ZeroMQ does not (socket thread only).

libzmq hides connections from the application, and two of its limits are not enough against
whoever can reach the port:

* **Handshakes.** A connection that never finishes its handshake holds a file descriptor until
  ``ZMQ_HANDSHAKE_IVL`` (set to :data:`HANDSHAKE_S` by the server). :class:`ConnectionGuard`
  also caps how many connections may be in their handshake at once, per source address (fewer
  once they have stalled for :data:`STALLED_S`, so a burst of honest clients behind one address
  gets in) and in all, and shuts a new one beyond the cap at once. It learns of each connection
  from the socket monitor (``ACCEPTED`` carries the file descriptor) and knows a handshake is
  over when the server has written more than a handshake's worth to it (the READY command,
  sent only to a client whose key was accepted) or a message came from it.
* **Unfinished messages.** ``ZMQ_MAXMSGSIZE`` bounds each frame, and a message is handed over
  only when its last frame arrives: libzmq keeps the frames of an unfinished multipart message
  in memory, however many come. The guard learns which connection each message came from
  (``ZMQ_SRCFD``) and reads the kernel's count of bytes libzmq has taken from that connection
  (``TCP_INFO`` bytes received less the bytes still queued): a connection that has sent more
  than the largest valid message since its last complete one is shut. It looks at a
  connection when data arrives on it (edge-triggered ``epoll``) and then as often as the
  remaining headroom needs, so what one connection can make the server hold stays near the
  largest valid message whatever the sender's speed. A message with more frames than any Veil
  message has is refused and its connection shut.

Before shutting, the guard checks the descriptor still has the peer it recorded (the numbers
are reused). The byte bound needs Linux (``TCP_INFO``, ``epoll``); elsewhere only the frame
count and the handshake caps hold. See docs/protocol.md.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import heapq
import logging
import os
import select
import socket
import struct
import sys
import termios
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.utils.monitor

from remote.loglimit import LogLimiter

log = logging.getLogger("veil.trunk")

HANDSHAKE_S = 5.0  # ZMQ_HANDSHAKE_IVL: a connection must finish its handshake within this
STALLED_S = 0.5  # a handshake older than this has stalled (a client's takes milliseconds)
PENDING_PER_ADDRESS = 32  # stalled handshakes from one source address
BURST_PER_ADDRESS = 128  # handshakes in progress from one address, stalled or not
PENDING_MAX = 512  # ... and in all (less where the open-file limit is low)
DROP_FRAMES = 64  # a message of more frames than this is no client's mistake
SLACK_BYTES = 256 << 10  # framing, CURVE boxes, heartbeats and the handshake itself
CONFIRM_S = 0.002  # a connection over the bound is shut if it still is this much later
INGEST_BYTES_PER_S = 4 << 30  # what libzmq may read from one connection, at most, for pacing
GAP_MIN_S, GAP_MAX_S = 0.001, 0.05  # between two looks at a connection that is sending
CHECK_STALE_S = 0.05  # how old a connection's "still in its handshake" may be
# What a server writes before a handshake is over: its greeting (64 bytes), and for CURVE its
# WELCOME (170) and at most an ERROR (12). More means it sent READY: the handshake is done.
PRE_READY_BYTES = {"CURVE": 64 + 170 + 12, "NULL": 64}
_TCP_INFO_BYTES = 136  # struct tcp_info up to tcpi_bytes_received (Linux 4.1+)
_WATCH = select.EPOLLIN | select.EPOLLONESHOT if hasattr(select, "EPOLLIN") else 0


def raise_open_file_limit() -> int | None:
    """Raise this process's soft open-file limit to its hard limit where the OS allows it (each
    client connection holds a descriptor); log the limit and return it (None: no such limit)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    if soft == inf or (hard != inf and soft >= hard):
        log.info("open-file limit: %s (the hard limit)", "unlimited" if soft == inf else soft)
        return None if soft == inf else soft
    for want in (hard, 1 << 20, 1 << 16):  # macOS refuses more than kern.maxfilesperproc
        if want == inf or want <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            continue
        log.info("open-file limit: %d (raised from %d)", want, soft)
        return int(want)
    log.warning("open-file limit: %d (could not raise it toward the hard limit)", soft)
    return int(soft)


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


@dataclass
class _Tcp:
    read: int  # bytes the peer sent that libzmq has taken from the kernel
    queued: int  # bytes the peer sent still in the kernel's queue
    written: int  # bytes the server wrote to the connection


def _borrow(fd: int) -> socket.socket | None:
    """A socket object over libzmq's descriptor ``fd`` (None: closed meanwhile, or not a
    socket). The caller must ``detach()`` it: it never closes what it borrows."""
    try:
        return socket.socket(fileno=fd)
    except OSError:
        return None


def _tcp(fd: int) -> _Tcp | None:
    """The kernel's byte counts of the TCP connection on ``fd`` (None: gone, or not Linux)."""
    s = _borrow(fd)
    if s is None:
        return None
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        inq, outq = array.array("i", [0]), array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, inq)
        fcntl.ioctl(fd, termios.TIOCOUTQ, outq)
    except OSError:
        return None
    finally:
        s.detach()
    if len(info) < _TCP_INFO_BYTES:
        return None
    acked, received = struct.unpack_from("=QQ", info, 120)
    return _Tcp(received - inq[0], inq[0], acked + outq[0])


def _peer(fd: int) -> tuple[Any, ...] | None:
    """The remote address of the socket on ``fd`` (None: gone, or not a connected socket)."""
    s = _borrow(fd)
    if s is None:
        return None
    try:
        peer = s.getpeername()
    except OSError:
        return None
    finally:
        s.detach()
    return peer if isinstance(peer, tuple) else None


def _shutdown(fd: int) -> None:
    s = _borrow(fd)
    if s is None:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)  # libzmq sees the end, closes the descriptor, frees all
    except OSError:
        pass
    finally:
        s.detach()


@dataclass
class _Conn:
    fd: int
    peer: tuple[Any, ...]
    accepted_at: float
    base: int = 0  # bytes read when its last complete message reached the server
    last_read: int = 0
    in_handshake: bool = True
    looked_at: float = 0.0  # when in_handshake was last checked
    suspect_at: float | None = None  # over the bound since
    due: float | None = None  # next look (None: waiting for data, in epoll)

    @property
    def address(self) -> str:
        return str(self.peer[0])


class ConnectionGuard:
    """Watches the ROUTER's TCP connections (see the module docstring). The server polls
    :attr:`monitor` and :attr:`fileno` (when not None) with its socket, receives every message
    through :meth:`receive` and calls :meth:`run` after every poll."""

    def __init__(
        self,
        ctx: zmq.Context,
        sock: zmq.Socket,
        max_message_bytes: int,
        max_frames: int,
        mechanism: str,
        *,
        per_address: int = PENDING_PER_ADDRESS,
        pending_max: int | None = None,
    ) -> None:
        self.limit = max_message_bytes + SLACK_BYTES
        self.max_frames = max_frames
        self.pre_ready = PRE_READY_BYTES[mechanism]
        self.conns: dict[int, _Conn] = {}
        self.young: OrderedDict[int, _Conn] = OrderedDict()  # maybe still in their handshake
        self._due: list[tuple[float, int, int]] = []  # (when, seq, fd)
        self._seq = 0
        self.suspects: set[int] = set()  # over the bound, to be confirmed after a drain
        self.drained_at = float("-inf")
        self._scratch = bytearray(1)  # frames received only to be discarded
        self.dropped = LogLimiter(log, "dropped connections")
        self.linux = sys.platform.startswith("linux") and hasattr(select, "epoll")
        self._ep = select.epoll() if self.linux else None
        self.fileno = self._ep.fileno() if self._ep is not None else None
        if pending_max is None:
            limit = raise_open_file_limit()
            room = (limit - _open_fds()) // 4 if limit is not None else PENDING_MAX
            pending_max = max(8, min(PENDING_MAX, room))
        self.pending_max = pending_max
        self.per_address = min(per_address, pending_max)
        self.burst = min(4 * per_address, pending_max)
        addr = f"inproc://veil-connections-{id(self)}"
        sock.monitor(addr, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.monitor = ctx.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)  # never makes libzmq's I/O thread wait
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.connect(addr)
        self._sock = sock
        log.info(
            "at most %d handshakes in progress (%d per address, %d of them stalled), each "
            "within %g s%s",
            self.pending_max,
            self.burst,
            self.per_address,
            HANDSHAKE_S,
            "" if self.linux else "; messages are bounded per frame only (this needs Linux)",
        )

    # ------------------------------------------------------------------ server hooks

    def receive(self, sock: zmq.Socket, now: float) -> tuple[list[zmq.Frame], int] | None:
        """The next message from ``sock`` (None: nothing waiting): its first ``max_frames``
        frames, and how many more it had, discarded unread. A message of more than
        :data:`DROP_FRAMES` frames also ends its connection."""
        try:
            first = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.drained_at = now  # whatever libzmq had finished has been read
            return None
        frames, extra, more = [first], 0, first.more
        while more:
            if len(frames) < self.max_frames:
                frames.append(sock.recv(copy=False))
                more = frames[-1].more
            else:
                sock.recv_into(self._scratch)
                extra += 1
                more = bool(sock.getsockopt(zmq.RCVMORE))
        c = self.conns.get(first.get(zmq.SRCFD))
        if c is not None:
            self._settled(c)
            t = _tcp(c.fd) if self.linux else None
            if t is not None:
                c.base = c.last_read = t.read
            c.suspect_at = None
            self.suspects.discard(c.fd)
            if len(frames) + extra > DROP_FRAMES:
                self._drop(c, "a message of %d frames", len(frames) + extra)
        return frames, extra

    @property
    def wants_drain(self) -> bool:
        """Should the server try its socket even without an event (a check awaits a drain)?"""
        return bool(self.suspects)

    def timeout_ms(self, now: float, longest: int) -> int:
        if not self._due:
            return longest
        return max(0, min(longest, int((self._due[0][0] - now) * 1000) + 1))

    def run(self, now: float) -> None:
        """Monitor events, connections with new data, due looks; once a minute the log."""
        try:
            self._run(now)
        except Exception:  # a bug here must not take the server down
            log.exception("connection guard failure")

    def _run(self, now: float) -> None:
        self._events(now)
        if self._ep is not None:
            for fd, _ in self._ep.poll(0):
                c = self.conns.get(fd)
                if c is not None and c.due is None:
                    self._look(c, now)
        while self._due and self._due[0][0] <= now:
            when, _, fd = heapq.heappop(self._due)
            c = self.conns.get(fd)
            if c is not None and c.due == when:
                c.due = None
                self._look(c, now)
        self.dropped.flush()

    def close(self) -> None:
        self.dropped.flush(everything=True)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self.monitor.close(0)
        if self._ep is not None:
            self._ep.close()

    # ------------------------------------------------------------------ connections

    def _events(self, now: float) -> None:
        while True:
            try:
                msg = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ev = zmq.utils.monitor.parse_monitor_message(msg)
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd, now)
            else:
                self._forget(fd)

    def _forget(self, fd: int) -> None:
        self.young.pop(fd, None)
        self.conns.pop(fd, None)
        self.suspects.discard(fd)

    def _accepted(self, fd: int, now: float) -> None:
        self._forget(fd)
        peer = _peer(fd)
        if peer is None:
            return  # gone already
        c = _Conn(fd, peer, now)
        stalled, mine, total = self._handshakes(c.address, now)
        if stalled >= self.per_address or mine >= self.burst or total >= self.pending_max:
            self.conns[fd] = c
            if total >= self.pending_max:
                self._drop(c, "%d handshakes already in progress in all", total)
            else:
                self._drop(c, "%d handshakes already in progress from it", mine)
            return
        t = _tcp(fd) if self.linux else None
        if t is not None:
            c.base = c.last_read = t.read
        self.conns[fd] = self.young[fd] = c
        self._watch(c)

    def _handshakes(self, address: str, now: float) -> tuple[int, int, int]:
        """Connections still in their handshake: (stalled from ``address``, from it, in all)."""
        while self.young:
            c = next(iter(self.young.values()))
            if now - c.accepted_at <= HANDSHAKE_S:
                break
            self._settled(c)  # libzmq ends a handshake at HANDSHAKE_S: this one is done
        stalled = mine = total = 0
        for c in list(self.young.values()):
            if now - c.looked_at > CHECK_STALE_S and self.linux:
                c.looked_at = now
                t = _tcp(c.fd)
                if t is not None and t.written > self.pre_ready:
                    self._settled(c)
                    continue
            total += 1
            if c.address == address:
                mine += 1
                stalled += now - c.accepted_at > STALLED_S
        return stalled, mine, total

    def _settled(self, c: _Conn) -> None:
        c.in_handshake = False
        self.young.pop(c.fd, None)

    def _watch(self, c: _Conn) -> None:
        """Wait for new data on ``c`` (one event, then it must be re-armed)."""
        if self._ep is None:
            return
        try:
            self._ep.modify(c.fd, _WATCH)
        except FileNotFoundError:  # not registered (or a new connection on a reused number)
            with contextlib.suppress(OSError):
                self._ep.register(c.fd, _WATCH)
        except OSError:
            pass  # gone: the monitor will say so

    def _later(self, c: _Conn, when: float) -> None:
        c.due = when
        self._seq += 1
        heapq.heappush(self._due, (when, self._seq, c.fd))

    def _look(self, c: _Conn, now: float) -> None:
        """Compare what ``c`` sent since its last message with the bound; decide the next look."""
        t = _tcp(c.fd)
        if t is None:
            return  # gone: the monitor will say so
        if c.in_handshake and t.written > self.pre_ready:
            self._settled(c)
        used = t.read - c.base
        if used > self.limit:
            # Over, unless complete messages are still on their way to the socket: shut it
            # only if it is still over after the server found nothing more to read.
            if c.suspect_at is None:
                c.suspect_at = now
                self.suspects.add(c.fd)
            elif self.drained_at >= c.suspect_at + CONFIRM_S:
                self._drop(c, "an unfinished message of %d bytes (limit %d)", used, self.limit)
                return
            self._later(c, now + CONFIRM_S)
            return
        c.suspect_at = None
        self.suspects.discard(c.fd)
        growing, c.last_read = t.read != c.last_read, t.read
        if growing or t.queued:  # sending (or libzmq is behind): look again before it could
            gap = (self.limit - used) / INGEST_BYTES_PER_S  # pass the bound
            self._later(c, now + min(max(gap, GAP_MIN_S), GAP_MAX_S))
        else:
            self._watch(c)

    def _drop(self, c: _Conn, why: str, *args: object) -> None:
        """Shut ``c`` (if its descriptor still is that connection) and log it, rate-limited."""
        self._forget(c.fd)
        if _peer(c.fd) != c.peer:
            return
        _shutdown(c.fd)
        self.dropped.event(c.address, "dropped a connection from %s: " + why, c.address, *args)
