"""The signed manifest of a client part: what the part's files are, chunk by chunk.

A manifest is canonical JSON (sorted keys, no spaces). Its *part id* is the first 24 hex
digits of its SHA-256, so the same part always has the same id and any change to a file, the
model or the audit gives a new one. The server signs ``SIGN_CONTEXT + manifest bytes`` with its
Ed25519 signing key (made by ``veil-trunk keygen``; its public half travels in the invite), and
the client checks the signature before it trusts a single byte, then checks every chunk against
the manifest's SHA-256 of that chunk.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import protocol as P
from engine.errors import VeilError

FORMAT = "veil-part/1"
SIGN_CONTEXT = b"veil-part-manifest/1\n"
CHUNK_SIZE = P.MAX_CHUNK  # the default; a manifest names its own (4 KiB to MAX_CHUNK)
MIN_CHUNK = 4096
MAX_PART_BYTES = 256 << 30
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class PartError(VeilError):
    """A client part or its manifest is unusable (damaged, tampered with, or not this model's)."""


@dataclass(frozen=True)
class PartFile:
    name: str
    size: int
    sha256: str
    chunks: tuple[str, ...]  # SHA-256 (hex) of each chunk_size piece, in order
    chunk_size: int = CHUNK_SIZE

    def chunk_range(self, i: int) -> tuple[int, int]:
        start = i * self.chunk_size
        return start, min(start + self.chunk_size, self.size)


@dataclass(frozen=True)
class Manifest:
    """What a server ships: ``files`` plus what the client needs to know about them."""

    model: str  # a display name (never a server path)
    config_fp: str
    model_fp: tuple[str, str]  # the whole model's fingerprint (draft heads belong to it)
    n_layers: int
    k_min: int  # the fewest local layers the server allows
    k_max: int  # the most local layers the part holds
    weights: str  # the file that holds the tensors: "model.gguf" or "model.safetensors"
    tensors: tuple[str, ...]  # the tensors in it, as named there
    files: tuple[PartFile, ...]
    audit: str | None = None  # audit results file, when the server has them
    draft_head: str | None = None  # learned draft head file, when the server has one
    chunk_size: int = CHUNK_SIZE
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, name: str) -> PartFile:
        for f in self.files:
            if f.name == name:
                return f
        raise PartError(f"the model part has no file {name}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            "config_fp": self.config_fp,
            "model_fp": list(self.model_fp),
            "n_layers": self.n_layers,
            "k_min": self.k_min,
            "k_max": self.k_max,
            "weights": self.weights,
            "tensors": list(self.tensors),
            "files": [
                {"name": f.name, "size": f.size, "sha256": f.sha256, "chunks": list(f.chunks)}
                for f in self.files
            ],
            "audit": self.audit,
            "draft_head": self.draft_head,
            "chunk_size": self.chunk_size,
            "extra": self.extra,
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @property
    def part_id(self) -> str:
        return part_id(self.encode())


def part_id(manifest: bytes) -> str:
    return hashlib.sha256(manifest).hexdigest()[: P.PART_ID_LEN]


def _bad(why: str) -> PartError:
    return PartError(f"the server's model manifest is invalid ({why})")


def decode(raw: bytes) -> Manifest:
    """Parse and check a manifest (types, names, sizes, chunk counts); PartError if bad."""
    try:
        d = json.loads(raw)
    except ValueError:
        raise _bad("not JSON") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise _bad(f"not a {FORMAT} manifest")
    try:
        cs = int(d["chunk_size"])
        if not MIN_CHUNK <= cs <= P.MAX_CHUNK:
            raise _bad(f"chunk size {cs}")
        files = []
        for f in d["files"]:
            name, size, digest = str(f["name"]), int(f["size"]), str(f["sha256"])
            chunks = tuple(str(c) for c in f["chunks"])
            if not _NAME.match(name):
                raise _bad(f"file name {name[:40]!r}")
            if not 0 <= size <= MAX_PART_BYTES or len(chunks) != max(1, -(-size // cs)):
                raise _bad(f"size of {name}")
            if not all(re.fullmatch(r"[0-9a-f]{64}", c) for c in (digest, *chunks)):
                raise _bad(f"hashes of {name}")
            files.append(PartFile(name, size, digest, chunks, cs))
        names = [f.name for f in files]
        m = Manifest(
            model=str(d["model"])[:200],
            config_fp=str(d["config_fp"]),
            model_fp=(str(d["model_fp"][0]), str(d["model_fp"][1])),
            n_layers=int(d["n_layers"]),
            k_min=int(d["k_min"]),
            k_max=int(d["k_max"]),
            weights=str(d["weights"]),
            tensors=tuple(str(t) for t in d["tensors"]),
            files=tuple(files),
            audit=None if d.get("audit") is None else str(d["audit"]),
            draft_head=None if d.get("draft_head") is None else str(d["draft_head"]),
            chunk_size=cs,
            extra=dict(d.get("extra") or {}),
        )
    except PartError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise _bad(f"{type(exc).__name__}: {exc}") from None
    if len(set(names)) != len(names) or not 0 < len(names) <= P.MAX_FILES:
        raise _bad("file list")
    for ref in (m.weights, m.audit, m.draft_head, "config.json"):
        if ref is not None and ref not in names:
            raise _bad(f"{ref} is not among its files")
    if not 1 <= m.k_min <= m.k_max or 2 * m.k_max > m.n_layers + 1:
        raise _bad(f"local layers {m.k_min}..{m.k_max} for {m.n_layers} layers")
    return m


# --------------------------------------------------------------------------- hashing


def hash_file(path: Path, chunk_size: int = CHUNK_SIZE) -> tuple[str, list[str]]:
    """(SHA-256 of the file, SHA-256 of each ``chunk_size`` piece), in one read."""
    whole = hashlib.sha256()
    chunks: list[str] = []
    with path.open("rb") as f:
        while True:
            block = f.read(chunk_size)
            if not block and chunks:
                break
            whole.update(block)
            chunks.append(hashlib.sha256(block).hexdigest())
            if len(block) < chunk_size:
                break
    return whole.hexdigest(), chunks


def describe_file(path: Path, chunk_size: int = CHUNK_SIZE) -> PartFile:
    digest, chunks = hash_file(path, chunk_size)
    return PartFile(path.name, path.stat().st_size, digest, tuple(chunks), chunk_size)


# --------------------------------------------------------------------------- signatures


def new_signing_key() -> bytes:
    """32 random bytes: an Ed25519 signing key's seed."""
    from nacl.signing import SigningKey

    return bytes(SigningKey.generate())


def public_key_text(seed: bytes) -> str:
    """The public half of a signing key, as the invite carries it (unpadded base64url)."""
    from nacl.signing import SigningKey

    vk = bytes(SigningKey(seed).verify_key)
    return base64.urlsafe_b64encode(vk).decode().rstrip("=")


def sign(manifest: bytes, seed: bytes) -> bytes:
    from nacl.signing import SigningKey

    return bytes(SigningKey(seed).sign(SIGN_CONTEXT + manifest).signature)


def verify(manifest: bytes, signature: bytes, public_key: str) -> None:
    """Raise PartError unless ``signature`` is the signing key's over ``manifest``."""
    from nacl.exceptions import BadSignatureError
    from nacl.signing import VerifyKey

    try:
        raw = base64.urlsafe_b64decode(public_key + "=" * (-len(public_key) % 4))
        key = VerifyKey(raw)
    except Exception:
        raise PartError(
            "the model-signing key saved for this server is damaged",
            hint="connect once with a new invite code",
        ) from None
    try:
        key.verify(SIGN_CONTEXT + manifest, signature)
    except BadSignatureError:
        raise PartError(
            "the server's model manifest is not signed by this server's key: refused",
            hint="the part may have been tampered with; tell your IT department",
        ) from None
