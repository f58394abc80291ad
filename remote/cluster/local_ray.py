"""The private Ray runtime of ``veil-trunk serve --ray`` (no address): this machine, loopback only.

Left to its defaults, a local ``ray.init()`` listens on every interface (its GCS, raylet, object
manager, agents and every worker's port), writes its token to ``~/.ray/auth_token`` readable by
all, and keeps its session files in a folder anyone may enter — and whoever reaches one of those
ports with the token runs code as the server's user. The gateway and its replicas all run here, so
none of that needs the network. :class:`PrivateRay` starts Ray so that:

* **loopback only** — Ray's node address is ``127.0.0.1`` (Ray's own setting for a single-machine
  runtime, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), so its servers bind there and the replicas'
  inboxes and the gateway's result socket, which bind Ray's node address, too;
* **its own folder** — a fresh ``veil-ray-*`` folder in the temp directory (``/tmp`` when that
  path is too long for Ray's unix sockets), mode 0700, holds the session files and the token;
  the runtime starts under umask 077 (files 0600) and its folders are closed to others once it
  is up; the folder is removed at shutdown;
* **a token of its own** — token authentication on, with a random token in that folder (0600,
  ``RAY_AUTH_TOKEN_PATH``); nothing is written in the home folder;
* **checked** — once up, every listening socket of Ray's processes must be on a loopback address,
  else the runtime is shut down and the gateway refuses to start (a Ray version that binds
  elsewhere cannot slip through).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import psutil
import ray

log = logging.getLogger("veil.trunk.gateway")

LOOPBACK = "127.0.0.1"
MAX_BASE = 20  # longest temp directory path the runtime's folder goes in (else /tmp)
# Ray's switch for a runtime that stays on this machine (its node address becomes loopback)
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# how the gateway joins or starts any runtime: no dashboard, replicas' logs in the gateway's log
INIT_OPTIONS: dict[str, Any] = {
    "include_dashboard": False,
    "log_to_driver": True,
    "configure_logging": False,
}


class PrivateRayError(Exception):
    """The private runtime could not be started as required (one line for the user)."""


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1 and IPv4-mapped loopback (``::ffff:127.0.0.1``)."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return bool(addr.is_loopback or (mapped is not None and mapped.is_loopback))


def listening(pid: int, *, children: bool = True) -> list[tuple[int, str, str, int]]:
    """(pid, process name, ip, port) of every listening TCP socket of ``pid`` and, with
    ``children``, of all its descendants. Processes that exit meanwhile are skipped."""
    root = psutil.Process(pid)
    procs = [root, *(root.children(recursive=True) if children else [])]
    out = []
    for p in procs:
        try:
            name = p.name()
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and c.laddr:
                out.append((p.pid, name, str(c.laddr.ip), int(c.laddr.port)))
    return out


class PrivateRay:
    """A Ray runtime for this process alone (see the module docstring)."""

    def __init__(self, namespace: str, num_cpus: int) -> None:
        self.namespace = namespace
        self.num_cpus = num_cpus
        self.root: Path | None = None
        self._saved_env: dict[str, str | None] = {}
        self._saved_cluster_flag: Any = None

    def start(self) -> None:
        """Start the runtime (blocks until Ray is up); PrivateRayError when it cannot be."""
        from ray._private import ray_constants

        base = tempfile.gettempdir()
        if len(base) > MAX_BASE and os.path.isdir("/tmp"):
            base = "/tmp"  # Ray's unix sockets go ~80 bytes deeper; a socket path has ~104
        self.root = Path(tempfile.mkdtemp(prefix="veil-ray-", dir=base))  # mode 0700, ours
        token = self.root / "auth_token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        for name in (SINGLE_MACHINE_ENV, *AUTH_ENV):
            self._saved_env[name] = os.environ.get(name)
        os.environ[SINGLE_MACHINE_ENV] = "0"  # Ray's processes started from here
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
        os.environ.pop("RAY_AUTH_TOKEN", None)  # it would win over the file
        # unset: a new local runtime then turns token authentication on (Ray >= 2.52)
        os.environ.pop("RAY_AUTH_MODE", None)
        # this process imported Ray already: the same switch, read where Ray reads it
        self._saved_cluster_flag = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = False
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        old_umask = os.umask(0o077)  # Ray's files 0600; its processes inherit it
        try:
            ray.init(
                namespace=self.namespace,
                num_cpus=self.num_cpus,
                _node_ip_address=LOOPBACK,
                _temp_dir=str(self.root),
                **INIT_OPTIONS,
            )
        except Exception as exc:  # ConnectionError, ValueError...: one line for the user
            self.stop()
            raise PrivateRayError(f"cannot start a private Ray runtime: {exc}") from None
        finally:
            os.umask(old_umask)
        try:
            self._check(before)
        except PrivateRayError:
            self.stop()
            raise
        self._close_folders()
        log.info("private Ray runtime on %s, files in %s (mode 0700)", LOOPBACK, self.root)

    def _check(self, before: set[int]) -> None:
        """Token authentication on and every listener of the processes Ray started (this
        process's children that were not there ``before``) on loopback."""
        if os.environ.get("RAY_AUTH_MODE") != "token":
            raise PrivateRayError(
                f"Ray {ray.__version__} did not turn on token authentication for the private "
                "runtime (Ray 2.52 or newer does)"
            )
        node = ray.util.get_node_ip_address()
        if not is_loopback(node):
            raise PrivateRayError(f"the private Ray runtime took the address {node}, not loopback")
        me = os.getpid()
        ray_procs = [x for x in listening(me) if x[0] != me and x[0] not in before]
        exposed = [x for x in ray_procs if not is_loopback(x[2])]
        if exposed:
            pid, name, ip, port = exposed[0]
            raise PrivateRayError(
                f"Ray {ray.__version__} listens on {ip}:{port} ({name}, pid {pid}), not only on "
                "loopback; the private runtime is not started"
            )

    def _close_folders(self) -> None:
        """Ray opens the folders it makes to everyone (0777); ours stay ours. The 0700 root
        already keeps others out; this makes each folder say so too."""
        assert self.root is not None
        for folder, _, _ in os.walk(self.root):
            with contextlib.suppress(OSError):
                os.chmod(folder, 0o700)

    def stop(self) -> None:
        """Shut Ray down, remove its folder and put the environment back as it was."""
        if ray.is_initialized():
            ray.shutdown()
        if self._saved_cluster_flag is not None:
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = self._saved_cluster_flag
            self._saved_cluster_flag = None
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env = {}
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
