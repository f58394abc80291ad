"""The client's side of model delivery: fetch the server's client part over the CURVE
connection, check it against the signed manifest, and keep it in the user cache.

* The manifest comes first; its Ed25519 signature is checked with the server's model-signing
  key (from the invite, pinned in the keyring once it verified), then every chunk's SHA-256
  against the manifest before the chunk is written. One bad byte refuses the part in one line.
* A part lives in ``<user cache>/parts/<part id>/``; the part id is the hash of the manifest,
  so a changed model (or audit) on the server is a new part and is fetched, and a known part
  is used again without a byte of traffic.
* An interrupted fetch resumes: the chunks already on disk are checked against the manifest
  and only the missing or wrong ones are asked for. Files of an earlier part that are the same
  (by hash) are copied, not fetched.
* ``confirm(manifest, bytes to fetch)`` is asked before the first chunk (the CLI prompts, the
  app shows a dialog); ``progress(stage, fraction)`` follows the download.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engine import protocol as P
from engine.delivery import manifest as M
from engine.delivery.part import GGUF_WEIGHTS, part_json, write_json
from engine.errors import Cancelled, TransportError, VeilError
from engine.loading import Progress, ResolvedModel, cache_root

log = logging.getLogger("veil.delivery")

WINDOW = 8  # chunk requests in flight (the server runs at most this many per key)
STAGE = "downloading the model from the server"
COMPLETE = "complete"

Confirm = Callable[[M.Manifest, int], bool]


def parts_root() -> Path:
    return cache_root() / "parts"


@dataclass
class InstalledPart:
    folder: Path
    manifest: M.Manifest
    fetched_bytes: int  # bytes of chunks received this time (0: the cache was used)
    reused_bytes: int  # bytes already on disk (a resumed fetch, or files of an earlier part)

    @property
    def resolved(self) -> ResolvedModel:
        """The part as a model the loaders read (weights in their stored format)."""
        src = self.folder / self.manifest.weights
        return ResolvedModel(
            self.manifest.model, self.folder, src if src.suffix == ".gguf" else self.folder
        )


def installed(folder: Path) -> M.Manifest | None:
    """The manifest of a complete part in ``folder`` (None when it is not one)."""
    try:
        if not (folder / COMPLETE).is_file():
            return None
        m = M.decode((folder / "manifest.json").read_bytes())
    except (OSError, VeilError):
        return None
    if any(
        not (folder / f.name).is_file() or (folder / f.name).stat().st_size != f.size
        for f in m.files
    ):
        return None
    return m


def part_info(folder: Path) -> dict[str, object] | None:
    """``veil-part.json`` of an installed part (None for any other model folder)."""
    import json

    try:
        d = json.loads((Path(folder) / "veil-part.json").read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


class PartFetcher:
    """One fetch over its own DEALER socket (same address, keys and CURVE as the trunk's)."""

    def __init__(
        self,
        address: str,
        *,
        server_key: str | None,
        client_keys: tuple[str, str] | None,
        sign_key: str | None,
        timeout_s: float = 10.0,
        stall_s: float = 60.0,
    ) -> None:
        from engine.transport.link import Link

        self.address = address
        self.sign_key = sign_key
        self.timeout_s = timeout_s
        self.stall_s = stall_s
        self.link = Link(address, server_key, client_keys, P.MAX_MANIFEST + P.MAX_HEADER_BYTES)

    # ------------------------------------------------------------------ manifest

    def manifest(self) -> tuple[M.Manifest, bytes, bytes]:
        """(manifest, its bytes, signature) — signature checked before anything is parsed."""
        link = self.link
        link._connect()
        deadline = time.monotonic() + self.timeout_s
        next_try = 0.0
        while True:
            now = time.monotonic()
            if now >= next_try:
                next_try = now + (2.0 if link._send(P.PartGet()) else 0.05)
            if link._auth_failed:
                raise link._auth_error()
            if now > deadline:
                raise TransportError(
                    f"no answer from the trunk server at {self.address}",
                    hint="is it running and reachable, and is its key right?",
                )
            r = link._recv(0.1)
            if isinstance(r, P.Part):
                break
            if isinstance(r, P.Error):
                raise self._refusal(r)
        if M.part_id(r.manifest) != r.part_id:
            raise M.PartError("the server's model manifest does not match its id: refused")
        if self.sign_key is None:
            raise M.PartError(
                "this server's invite code has no model-signing key, so its model cannot be "
                "checked",
                hint="ask your IT department for a new invite code (veil-trunk invite)",
            )
        M.verify(r.manifest, r.signature, self.sign_key)
        return M.decode(r.manifest), r.manifest, r.signature

    def _refusal(self, e: P.Error) -> VeilError:
        if e.code == P.E_PART:
            return M.PartError(
                f"the trunk server at {self.address} does not ship its model ({e.message})",
                hint="ask your IT department, or choose a model file in Settings",
            )
        if e.code == P.E_BAD_MESSAGE and "part_get" in e.message:
            return M.PartError(
                f"the trunk server at {self.address} is too old to ship its model",
                hint="choose the model file in Settings, or ask IT to update veil-trunk",
            )
        if e.code == P.E_DENIED:
            return self.link._auth_error()
        return TransportError(f"the trunk server answered: {e.message} [{e.code}]")

    # ------------------------------------------------------------------ chunks

    def fetch(
        self,
        man: M.Manifest,
        folder: Path,
        todo: list[tuple[int, int]],
        progress: Progress | None,
        done_bytes: int,
    ) -> int:
        """Fetch chunks ``todo`` ((file index, chunk index)) into ``folder``; bytes fetched."""
        link, pid = self.link, man.part_id
        total = man.total_bytes
        fhs: dict[int, BinaryIO] = {}  # (seek + write: os.pwrite does not exist on Windows)
        for i, f in enumerate(man.files):
            if any(fi == i for fi, _ in todo):
                fhs[i] = (folder / f.name).open("r+b")
        pending = list(reversed(todo))
        waiting: dict[tuple[int, int], float] = {}
        fetched = 0
        last_progress = time.monotonic()
        try:
            while pending or waiting:
                now = time.monotonic()
                while pending and len(waiting) < WINDOW:
                    key = pending[-1]
                    if not link._send(P.ChunkGet(pid, *key)):
                        break
                    pending.pop()
                    waiting[key] = now
                if link._auth_failed:
                    raise link._auth_error()
                if now - last_progress > self.stall_s:
                    raise TransportError(
                        f"the model download from {self.address} stalled",
                        hint="check the network; run again to resume where it stopped",
                    )
                r = link._recv(0.25)
                if r is None:
                    for key, sent in list(waiting.items()):  # lost on the way: ask again
                        if time.monotonic() - sent > self.timeout_s:
                            del waiting[key]
                            pending.append(key)
                    continue
                if isinstance(r, P.Error):
                    if r.code == P.E_BUSY:  # over this key's share: wait, ask again
                        time.sleep(0.2)
                        pending.extend(waiting)
                        waiting.clear()
                        continue
                    if r.code == P.E_PART:
                        raise M.PartError(
                            "the server's model changed during the download",
                            hint="connect again to fetch the new one",
                        )
                    raise self._refusal(r)
                if not isinstance(r, P.Chunk) or r.part_id != pid:
                    continue
                key = (r.file, r.chunk)
                if key not in waiting:
                    continue
                f = man.files[r.file]
                lo, hi = f.chunk_range(r.chunk)
                data = bytes(r.data)
                if len(data) != hi - lo or hashlib.sha256(data).hexdigest() != f.chunks[r.chunk]:
                    raise M.PartError(
                        f"a piece of {f.name} from the server does not match its signed "
                        "manifest: the model part is refused",
                        hint="it was changed on the way or on the server; tell your IT department",
                    )
                fh = fhs[r.file]
                fh.seek(lo)
                fh.write(data)
                del waiting[key]
                fetched += len(data)
                last_progress = time.monotonic()
                if progress is not None:
                    progress(STAGE, min((done_bytes + fetched) / max(total, 1), 1.0))
        finally:
            for fh in fhs.values():
                fh.close()
        return fetched

    def close(self) -> None:
        self.link._destroy()


def _verified_chunks(path: Path, f: M.PartFile) -> list[int]:
    """Indices of the chunks of ``f`` that ``path`` already holds correctly."""
    ok: list[int] = []
    try:
        with path.open("rb") as fh:
            for i, want in enumerate(f.chunks):
                lo, hi = f.chunk_range(i)
                fh.seek(lo)
                if hashlib.sha256(fh.read(hi - lo)).hexdigest() == want:
                    ok.append(i)
    except OSError:
        return []
    return ok


def _copy_known(f: M.PartFile, dst: Path, skip: Path) -> bool:
    """Copy ``f`` from another complete part that has the same file (by hash)."""
    root = parts_root()
    if not root.is_dir():
        return False
    for d in root.iterdir():
        if d == skip:
            continue
        m = installed(d)
        if m is None:
            continue
        for g in m.files:
            if g.sha256 == f.sha256 and g.size == f.size:
                shutil.copyfile(d / g.name, dst)
                return True
    return False


def ensure_part(
    address: str,
    *,
    server_key: str | None,
    client_keys: tuple[str, str] | None,
    sign_key: str | None,
    confirm: Confirm | None = None,
    progress: Progress | None = None,
    timeout_s: float = 10.0,
) -> InstalledPart:
    """The server's client part, from the cache or fetched (resuming a partial fetch)."""
    fetcher = PartFetcher(
        address,
        server_key=server_key,
        client_keys=client_keys,
        sign_key=sign_key,
        timeout_s=timeout_s,
    )
    try:
        if progress is not None:
            progress("asking the server for its model", 0.0)
        man, raw, sig = fetcher.manifest()
        folder = parts_root() / man.part_id
        if installed(folder) is not None:
            return InstalledPart(folder, man, 0, man.total_bytes)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / COMPLETE).unlink(missing_ok=True)
        todo: list[tuple[int, int]] = []
        have = 0
        for i, f in enumerate(man.files):
            path = folder / f.name
            if not path.exists() and _copy_known(f, path, folder):
                log.info("%s: the same file as in an earlier part, copied", f.name)
            ok = set(_verified_chunks(path, f)) if path.exists() else set()
            with path.open("ab") as fh:
                fh.truncate(f.size)
            for c in range(len(f.chunks)):
                if c in ok:
                    have += f.chunk_range(c)[1] - f.chunk_range(c)[0]
                else:
                    todo.append((i, c))
        need = man.total_bytes - have
        if need and confirm is not None and not confirm(man, need):
            raise Cancelled("the model download was declined; nothing was fetched")
        fetched = fetcher.fetch(man, folder, todo, progress, have) if todo else 0
        (folder / "manifest.json").write_bytes(raw)
        (folder / "manifest.sig").write_bytes(sig)
        weights = folder / man.weights
        if man.weights == GGUF_WEIGHTS:
            write_json(
                folder / "veil-converted.json",
                {"weights": "gguf", "source": str(weights.resolve()), "part": man.part_id},
            )
        write_json(folder / "veil-part.json", part_json(man, weights))
        (folder / COMPLETE).write_text(man.part_id)
        if progress is not None:
            progress(STAGE, 1.0)
        log.info("model part %s: %d bytes fetched, %d on disk", man.part_id, fetched, have)
        return InstalledPart(folder, man, fetched, have)
    finally:
        fetcher.close()
