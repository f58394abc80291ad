"""Model delivery on the trunk server: the client part it ships, and a thread that serves it.

* :func:`prepare_part` finds or makes the part for the served model: a folder the admin
  prepared (``--client-part``: e.g. the client half of an organisation-keyed model, which the
  server never derives from its trunk), or one made from the served model once per model and
  ``k_max`` under the parts folder (``<parts>/<model fingerprint>/k<k_max>``), with the audit
  results ``veil-trunk audit`` stored beside it and the model's draft head, when there is one.
* :class:`DeliveryService` answers ``part_get`` at once (the signed manifest) and queues
  ``chunk_get``s for its own thread, which reads each chunk and hands the reply to the socket
  thread over an inproc PAIR: chunk reads never hold up the socket thread or the trunk worker,
  so other sessions' steps go on while a laptop downloads. Each client key may have at most
  ``MAX_PER_KEY`` chunk requests queued (more are answered ``busy``, the client waits and asks
  again) and keys are served in turn, so one download cannot starve another.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from engine import protocol as P
from engine.config import ModelConfig
from engine.delivery import manifest as M
from engine.delivery.part import AUDIT_FILE, build_part, load_manifest
from engine.loading import ResolvedModel, WeightReader

log = logging.getLogger("veil.trunk.delivery")

MAX_PER_KEY = 8  # chunk requests one key may have queued
MAX_QUEUED = 256  # chunk requests of all keys together


def default_parts_dir() -> Path:
    env = os.environ.get("VEIL_TRUNK_PARTS")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("veil-trunk", appauthor=False)) / "parts"


def model_key(reader: WeightReader, config: ModelConfig) -> str:
    """The served model's fingerprint as a folder name (the same one a draft head records)."""
    from engine.drafts.head import model_fingerprint

    cfg, w = model_fingerprint(reader, config)
    return f"{cfg}-{w}"


def audit_path(parts_dir: Path, key: str) -> Path:
    """Where ``veil-trunk audit`` stores the served model's audit results."""
    return parts_dir / key / AUDIT_FILE


@dataclass
class PartSpec:
    resolved: ResolvedModel
    config: ModelConfig
    reader: WeightReader
    k_min: int
    k_max: int
    parts_dir: Path
    client_part: Path | None = None
    draft_head: Path | None = None
    chunk_size: int = M.CHUNK_SIZE


def _same_file(manifest: M.Manifest, name: str | None, path: Path | None) -> bool:
    if (name is None) != (path is None):
        return False
    if name is None or path is None:
        return True
    return manifest.file(name).sha256 == M.hash_file(path)[0]


def _find_head(spec: PartSpec, fp: tuple[str, str]) -> Path | None:
    from engine.drafts.head import DraftHeadError, find_shipped_head, load_head

    path = spec.draft_head or find_shipped_head(spec.config.fingerprint())
    if path is None:
        return None
    try:
        load_head(path, fp)
    except DraftHeadError as exc:
        if spec.draft_head is not None:
            raise ValueError(str(exc)) from None
        log.info("not shipping the draft head %s: %s", path.name, exc)
        return None
    return path


def prepare_part(spec: PartSpec) -> tuple[Path, M.Manifest]:
    """The folder and manifest of the part to ship (made once per model, audit and head)."""
    if spec.client_part is not None:
        m = load_manifest(spec.client_part)
        if m.config_fp != spec.config.fingerprint():
            raise ValueError(
                f"the client part in {spec.client_part} is for another model (config "
                f"{m.config_fp}, this server's is {spec.config.fingerprint()})"
            )
        if m.k_max < spec.k_min:
            raise ValueError(
                f"the client part in {spec.client_part} holds {m.k_max} local layers per side; "
                f"this server needs clients to keep at least {spec.k_min}"
            )
        return spec.client_part, m
    from engine.drafts.head import model_fingerprint

    fp = model_fingerprint(spec.reader, spec.config)
    key = f"{fp[0]}-{fp[1]}"
    audit = audit_path(spec.parts_dir, key)
    audit_file = audit if audit.is_file() else None
    head = _find_head(spec, fp)
    folder = spec.parts_dir / key / f"k{spec.k_min}-{spec.k_max}"
    try:
        m = load_manifest(folder)
        same = _same_file(m, m.audit, audit_file) and _same_file(m, m.draft_head, head)
        if same and m.chunk_size == spec.chunk_size:
            return folder, m
    except M.PartError:
        pass
    log.info("preparing the client part (layers up to k=%d; one-time)", spec.k_max)
    m = build_part(
        spec.resolved,
        spec.k_max,
        folder,
        k_min=spec.k_min,
        audit=audit_file,
        draft_head=head,
        model_fp=fp,
        chunk_size=spec.chunk_size,
    )
    log.info("client part ready: %d files, %.1f MB", len(m.files), m.total_bytes / 1e6)
    return folder, m


class DeliveryService:
    """Serves one part: the manifest from memory, chunks from a thread of its own."""

    def __init__(self, folder: Path, manifest: M.Manifest, signing_key: bytes) -> None:
        self.folder = folder
        self.manifest = manifest
        self.raw = manifest.encode()
        self.part_id = M.part_id(self.raw)
        self.signature = M.sign(self.raw, signing_key)
        # read by the delivery thread alone: seek + read (os.pread does not exist on Windows)
        self._files = [(folder / f.name).open("rb") for f in manifest.files]
        self._queues: dict[str, collections.deque[tuple[bytes, P.ChunkGet]]] = {}
        self._turn: collections.deque[str] = collections.deque()  # keys with queued requests
        self._queued = 0
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context | None = None
        self._address = f"inproc://veil-delivery-{id(self)}"
        self.stats = {"chunks": 0, "bytes": 0, "manifests": 0}

    def bind(self, ctx: zmq.Context) -> zmq.Socket:
        """The socket-thread end of the reply PAIR (poll it; see :meth:`forward`)."""
        self._ctx = ctx
        back = ctx.socket(zmq.PAIR)
        back.bind(self._address)
        self._thread = threading.Thread(target=self._run, name="veil-delivery", daemon=True)
        self._thread.start()
        return back

    def handle(self, ident: bytes, user: str, msg: P.PartGet | P.ChunkGet) -> P.Message | None:
        """Socket thread: the reply to send now, or None when a chunk request was queued."""
        if isinstance(msg, P.PartGet):
            self.stats["manifests"] += 1
            return P.Part(self.part_id, self.raw, self.signature)
        if msg.part_id != self.part_id:
            return P.Error(P.E_PART, "this server ships another model part now")
        files = self.manifest.files
        if msg.file >= len(files) or msg.chunk >= len(files[msg.file].chunks):
            return P.Error(P.E_BAD_MESSAGE, "no such chunk in the model part")
        with self._cond:
            q = self._queues.setdefault(user, collections.deque())
            if len(q) >= MAX_PER_KEY or self._queued >= MAX_QUEUED:
                return P.Error(P.E_BUSY, "server busy: too many model chunks asked for at once")
            if not q:
                self._turn.append(user)
            q.append((ident, msg))
            self._queued += 1
            self._cond.notify()
        return None

    def _next(self) -> tuple[str, bytes, P.ChunkGet] | None:
        with self._cond:
            while not self._stop and not self._turn:
                self._cond.wait()
            if self._stop:
                return None
            user = self._turn.popleft()
            q = self._queues[user]
            ident, msg = q.popleft()
            self._queued -= 1
            if q:
                self._turn.append(user)  # its next request waits for the other keys' turn
            else:
                del self._queues[user]
            return user, ident, msg

    def _run(self) -> None:
        assert self._ctx is not None
        out = self._ctx.socket(zmq.PAIR)
        out.connect(self._address)
        try:
            while (item := self._next()) is not None:
                user, ident, msg = item
                f = self.manifest.files[msg.file]
                lo, hi = f.chunk_range(msg.chunk)
                try:
                    fh = self._files[msg.file]
                    fh.seek(lo)
                    data = fh.read(hi - lo)
                    if len(data) != hi - lo:
                        raise OSError(f"{f.name} is shorter than its manifest says")
                except OSError as exc:
                    log.error("reading %s: %s", f.name, exc)
                    reply: P.Message = P.Error(P.E_INTERNAL, "cannot read the model part")
                else:
                    reply = P.Chunk(self.part_id, msg.file, msg.chunk, data)
                    self.stats["chunks"] += 1
                    self.stats["bytes"] += len(data)
                out.send_multipart([user.encode(), ident, *P.encode(reply)], copy=False)
        finally:
            out.close(0)

    @staticmethod
    def forward(frames: list[Any]) -> tuple[str, list[Any]]:
        """(key, [routing id, *message]) of a reply from the delivery thread."""
        user = bytes(frames[0].bytes if isinstance(frames[0], zmq.Frame) else frames[0])
        return user.decode(), list(frames[1:])

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5)
        for fh in self._files:
            fh.close()
        self._files = []


def make_delivery(server: Any, signing_key: bytes | None) -> DeliveryService:
    """The client part a :class:`remote.server.TrunkServer` ships, and the service that
    ships it (made when the server starts with ``delivery``)."""
    opts = server.opts
    if signing_key is None:
        raise ValueError("shipping the model needs the server's signing key (veil-trunk keygen)")
    n = server.config.n_layers
    k_max = opts.client_layers or max(server.lo, min(2, (n - 1) // 2))
    if not server.lo <= k_max < n / 2:
        raise ValueError(
            f"--client-layers must be between --min-local-layers ({server.lo}) and "
            f"{(n - 1) // 2} for this model"
        )
    spec = PartSpec(
        server.resolved,
        server.config,
        server.reader,
        server.lo,
        k_max,
        Path(opts.parts_dir) if opts.parts_dir else default_parts_dir(),
        Path(opts.client_part) if opts.client_part else None,
        Path(opts.draft_head) if opts.draft_head else None,
        opts.part_chunk,
    )
    folder, manifest = prepare_part(spec)
    return DeliveryService(folder, manifest, signing_key)
