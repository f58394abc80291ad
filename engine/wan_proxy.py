"""A WAN emulator: an asyncio TCP proxy that delays every byte by RTT/2 in each direction and can
cap bandwidth, so tests and benchmarks can run at 20, 80 or 150 ms RTT on loopback (``tc netem``
is not available everywhere).

    with WanProxy("127.0.0.1", 5757, rtt_ms=80) as proxy:
        connect to proxy.address ...

The proxy runs its event loop in a background thread; :meth:`start` returns once it listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any


class WanProxy:
    def __init__(
        self,
        target_host: str,
        target_port: int,
        rtt_ms: float,
        bandwidth_mbit: float | None = None,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        if rtt_ms < 0:
            raise ValueError("rtt_ms must be >= 0")
        if bandwidth_mbit is not None and bandwidth_mbit <= 0:
            raise ValueError("bandwidth_mbit must be > 0")
        self.target_host = target_host
        self.target_port = target_port
        self.rtt_ms = float(rtt_ms)
        self.bandwidth_mbit = bandwidth_mbit
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.port = 0
        self.bytes_forwarded = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        return f"tcp://{self.listen_host}:{self.port}"

    def set_rtt(self, ms: float) -> None:
        """Change the delay for bytes read from now on."""
        if ms < 0:
            raise ValueError("rtt_ms must be >= 0")
        self.rtt_ms = float(ms)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> WanProxy:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="wan-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise OSError(f"WAN proxy cannot listen: {self._error}")
        if not self.port:
            raise OSError("WAN proxy did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return
        if loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            with contextlib.suppress(Exception):
                fut.result(timeout=5)
            loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=5)
        self._thread = None
        self._loop = None

    def drop_connections(self) -> int:
        """Close every connection through the proxy now (as a network drop does), and keep
        listening for new ones. Returns how many connections were open."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return 0

        async def drop() -> int:
            writers = list(self._writers)
            for w in writers:
                w.close()
            await asyncio.sleep(0)
            return len(writers) // 2  # each connection has a client side and a server side

        return int(asyncio.run_coroutine_threadsafe(drop(), loop).result(timeout=5))

    def __enter__(self) -> WanProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._accept, self.listen_host, self.listen_port)
            )
            sock = self._server.sockets[0]
            self.port = int(sock.getsockname()[1])
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.sleep(0)

    # ------------------------------------------------------------------ forwarding

    def _spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_w))
        self._spawn(self._pipe(reader, up_w))
        self._spawn(self._pipe(up_r, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read chunks, stamp each with its delivery time, deliver them in order."""
        q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        link_free = 0.0  # when the emulated link finishes sending what it already has

        async def deliver() -> None:
            try:
                while True:
                    at, data = await q.get()
                    if not data:
                        break
                    wait = at - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    writer.write(data)
                    await writer.drain()
                    self.bytes_forwarded += len(data)
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                writer.close()
                self._writers.discard(writer)

        sender = asyncio.ensure_future(deliver())
        self._tasks.add(sender)
        sender.add_done_callback(self._tasks.discard)
        try:
            while True:
                data = await reader.read(1 << 16)
                now = loop.time()
                if not data:
                    q.put_nowait((now, b""))
                    break
                start = max(now, link_free)
                if self.bandwidth_mbit:
                    link_free = start + len(data) * 8 / (self.bandwidth_mbit * 1e6)
                else:
                    link_free = start
                q.put_nowait((link_free + self.rtt_ms / 2000.0, data))
        except (OSError, asyncio.CancelledError):
            q.put_nowait((0.0, b""))


def wait_port(host: str, port: int, timeout: float = 5.0) -> None:
    """Block until something listens at host:port (helper for tests)."""
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
