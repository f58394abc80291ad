"""One Veil window per data folder (issue 30). A second start with the same folder brings the
running window to the front and exits, so two windows never share (and overwrite) the same
chats, and a second built-in server is never started.

A lock file in the data folder (``QLockFile``: a stale lock left by a crash is taken over)
says who runs; a local socket named after the folder lets the newcomer ask the running Veil to
show its window. The socket only accepts this user's connections."""

from __future__ import annotations

import getpass
import hashlib
import sys
from pathlib import Path

from PySide6.QtCore import QLockFile, QObject, Qt, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket
from PySide6.QtWidgets import QWidget

from engine.errors import VeilError

LOCK_NAME = "veil.lock"
RAISE = b"raise\n"
TIMEOUT_MS = 3000


def socket_name(folder: Path) -> str:
    """The local socket's name for a data folder (per user, per folder)."""
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    user = "".join(ch for ch in getpass.getuser() if ch.isalnum())[:16] or "user"
    return f"veil-{user}-{key}"


class SingleInstance(QObject):
    """``acquire()`` the folder's lock; the holder's ``activated`` fires when another start
    asks it to show itself (``ask_running_to_show``)."""

    activated = Signal()

    def __init__(self, folder: Path, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.folder = folder
        self.name = socket_name(folder)
        self.lock = QLockFile(str(folder / LOCK_NAME))
        self.lock.setStaleLockTime(0)  # a lock is stale only when its process is gone
        self.server: QLocalServer | None = None

    def acquire(self) -> bool:
        """True when this process now runs Veil for the folder (and listens for others)."""
        if not self.lock.tryLock(0):
            return False
        QLocalServer.removeServer(self.name)  # a socket left behind by a crash
        server = QLocalServer(self)
        server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        server.newConnection.connect(self._connection)
        if not server.listen(self.name):
            # the lock is what keeps a second Veil out; without the socket, a later start
            # cannot bring this window forward, but it still exits instead of opening
            self.server = None
            return True
        self.server = server
        return True

    def holder(self) -> str:
        """Who holds the lock, for the message when the running Veil does not answer."""
        ok, pid, host, _app = self.lock.getLockInfo()
        return f"process {pid} on {host}" if ok else "another program"

    def ask_running_to_show(self) -> bool:
        """Ask the Veil that holds the lock to bring its window forward; True when it read it."""
        sock = QLocalSocket()
        sock.connectToServer(self.name)
        if not sock.waitForConnected(TIMEOUT_MS):
            return False
        sock.write(RAISE)
        sent = sock.waitForBytesWritten(TIMEOUT_MS)
        # the running Veil closes the connection once it has read the request
        sock.waitForDisconnected(TIMEOUT_MS)
        return bool(sent)

    def _connection(self) -> None:
        assert self.server is not None
        while (sock := self.server.nextPendingConnection()) is not None:
            sock.readyRead.connect(lambda s=sock: self._read(s))
            sock.disconnected.connect(sock.deleteLater)

    def _read(self, sock: QLocalSocket) -> None:
        if bytes(sock.readAll().data()).startswith(RAISE.strip()):
            self.activated.emit()
        sock.disconnectFromServer()

    def release(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self.lock.unlock()


def claim(folder: Path) -> SingleInstance | None:
    """This start's hold on ``folder``, or None when a running Veil has it (that one was asked
    to show its window; this start should exit). VeilError when the running one does not
    answer."""
    guard = SingleInstance(folder)
    if guard.acquire():
        return guard
    if guard.ask_running_to_show():
        print(
            f"veil: Veil is already open with the data folder {folder}; its window was "
            "brought to the front.",
            file=sys.stderr,
        )
        return None
    raise VeilError(
        f"another Veil ({guard.holder()}) is using the data folder {folder}",
        hint="close it first, or start this one with another --data-dir",
    )


def bring_forward(window: QWidget) -> None:
    """Show the window on top of the others (un-minimised), as if the user clicked it."""
    if window.isMinimized():
        window.setWindowState(window.windowState() & ~Qt.WindowState.WindowMinimized)
    window.show()
    window.raise_()
    window.activateWindow()
