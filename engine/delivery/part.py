"""Making a client part: the files a laptop needs for local layers up to ``k_max``, and nothing
else — the tokenizer and chat template, the model config, and one weights file that holds only
the embedding, the first and last ``k_max`` decoder layers, the final norm and the LM head,
stored exactly as in the source (a GGUF stays a GGUF with the same quantized blocks; a
safetensors checkpoint stays safetensors in its own dtype), so the client loads it with the
loaders it uses for a local model.

A part is made from the model the server serves (``veil-trunk serve`` does it once per model
and ``k_max``), or an admin prepares one elsewhere (``veil-trunk part``) — e.g. the client half
of an organisation-keyed model — and the server only ships the folder, never deriving it from
its trunk.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.delivery.manifest import CHUNK_SIZE, Manifest, PartError, describe_file
from engine.errors import ModelLoadError
from engine.loading import ResolvedModel, WeightReader, load_config
from engine.model import layer_tensor_names

GGUF_WEIGHTS = "model.gguf"
ST_WEIGHTS = "model.safetensors"
AUDIT_FILE = "audit.json"
HEAD_FILE = "draft_head.safetensors"
# Files of a model folder that a client needs besides the weights (config, tokenizer, template).
_KEEP_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
_SKIP = {"veil-converted.json", "model.safetensors.index.json", "veil-part.json", AUDIT_FILE}


def client_tensor_names(config: ModelConfig, k_max: int, has: Callable[[str], bool]) -> list[str]:
    """Hugging Face names of every tensor a client with up to ``k_max`` local layers reads."""
    n = config.n_layers
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if has("lm_head.weight"):
        names.append("lm_head.weight")
    layers = sorted(set(range(k_max)) | set(range(n - k_max, n)))
    for i in layers:
        names += [t for t in layer_tensor_names(config, i) if has(t)]
    return names


def display_name(resolved: ResolvedModel) -> str:
    """What clients are told the model is called: the file or folder name, never its path."""
    name = Path(str(resolved.name)).name or str(resolved.name)
    for suffix in (".gguf", ".GGUF"):
        name = name.removesuffix(suffix)
    return name[:120]


def build_part(
    resolved: ResolvedModel,
    k_max: int,
    out: Path,
    *,
    k_min: int = 1,
    audit: Path | None = None,
    draft_head: Path | None = None,
    model_fp: tuple[str, str] | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> Manifest:
    """Write the client part of ``resolved`` for local layers up to ``k_max`` into ``out``
    (replaced whole) and return its (unsigned) manifest."""
    config = load_config(resolved.folder)
    if not 1 <= k_min <= k_max or 2 * k_max >= config.n_layers:
        raise PartError(
            f"a client part needs 1 <= k_min <= k_max < {config.n_layers / 2:g} "
            f"(this model has {config.n_layers} layers); got {k_min}..{k_max}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".part-", dir=out.parent))
    try:
        reader = WeightReader(resolved.folder)
        names = client_tensor_names(config, k_max, reader.has)
        src = Path(resolved.source)
        if src.suffix.lower() == ".gguf" and src.is_file():
            from engine.quant.load import gguf_name

            gnames = [gguf_name(n) for n in names]
            if any(g is None for g in gnames):
                raise PartError("this GGUF file has tensors a client part cannot name")
            tensors = write_gguf_subset(src, [str(g) for g in gnames], tmp / GGUF_WEIGHTS)
            weights = GGUF_WEIGHTS
        else:
            tensors = write_safetensors_subset(reader, names, tmp / ST_WEIGHTS)
            weights = ST_WEIGHTS
        for f in sorted(Path(resolved.folder).iterdir()):
            keep = f.is_file() and f.suffix in _KEEP_SUFFIXES and f.name not in _SKIP
            if keep and 0 < f.stat().st_size <= 256 << 20:
                shutil.copyfile(f, tmp / f.name)
        if audit is not None:
            shutil.copyfile(audit, tmp / AUDIT_FILE)
        if draft_head is not None:
            shutil.copyfile(draft_head, tmp / HEAD_FILE)
        files = tuple(describe_file(p, chunk_size) for p in sorted(tmp.iterdir()))
        if model_fp is None:
            from engine.drafts.head import model_fingerprint

            model_fp = model_fingerprint(reader, config)
        manifest = Manifest(
            model=display_name(resolved),
            config_fp=config.fingerprint(),
            model_fp=model_fp,
            n_layers=config.n_layers,
            k_min=k_min,
            k_max=k_max,
            weights=weights,
            tensors=tuple(tensors),
            files=files,
            audit=AUDIT_FILE if audit is not None else None,
            draft_head=HEAD_FILE if draft_head is not None else None,
            chunk_size=chunk_size,
        )
        (tmp / "manifest.json").write_bytes(manifest.encode())
        if out.exists():
            shutil.rmtree(out)
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def load_manifest(folder: Path) -> Manifest:
    """The manifest a prepared part folder was made with (checked against its files' sizes)."""
    from engine.delivery.manifest import decode

    try:
        m = decode((folder / "manifest.json").read_bytes())
    except OSError as exc:
        raise PartError(f"{folder} is not a prepared client part ({exc.strerror})") from None
    for f in m.files:
        p = folder / f.name
        if not p.is_file() or p.stat().st_size != f.size:
            raise PartError(f"the client part in {folder} is incomplete ({f.name})")
    return m


# --------------------------------------------------------------------------- weights files


def write_safetensors_subset(reader: Any, names: list[str], dst: Path) -> list[str]:
    """The named tensors of a safetensors checkpoint, in their stored dtype, as one file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    where = getattr(reader, "_where", {})
    out = {}
    for n in names:
        if n not in where:
            raise ModelLoadError(f"checkpoint in {reader.folder} lacks tensor {n}")
        with safe_open(str(where[n]), framework="pt") as sf:
            out[n] = sf.get_tensor(n).contiguous()
    save_file(out, str(dst), metadata={"format": "pt"})
    return sorted(out)


def write_gguf_subset(src: Path, keep: list[str], dst: Path) -> list[str]:
    """A GGUF file with ``src``'s metadata (config, tokenizer, chat template: copied byte for
    byte) and only the tensors named in ``keep`` (their blocks copied byte for byte)."""
    from engine.quant.gguf import GGUFFile, _Cursor

    gf = GGUFFile(src)
    try:
        missing = [k for k in keep if k not in gf.tensors]
        if missing:
            raise ModelLoadError(f"{src.name} lacks tensor {missing[0]}")
        cur = _Cursor(gf._map, src)
        cur.pos = 4
        version = cur.unpack("<I")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        kv_start = cur.pos
        for _ in range(n_kv):
            cur.string()
            cur.value(cur.unpack("<I"))
        kv = bytes(gf._map[kv_start : cur.pos])
        infos: dict[str, bytes] = {}  # name -> the info's bytes up to (not incl.) its offset
        for _ in range(n_tensors):
            start = cur.pos
            name = cur.string()
            dims = cur.unpack("<I")
            cur.pos += 8 * dims + 4
            infos[name] = bytes(gf._map[start : cur.pos])
            cur.pos += 8
        align = int(gf.metadata.get("general.alignment", 32) or 32)
        wanted = [k for k in gf.tensors if k in set(keep)]  # the source's order
        offsets, off = [], 0
        for k in wanted:
            offsets.append(off)
            off += (gf.tensors[k].nbytes + align - 1) // align * align
        head = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(wanted), n_kv) + kv)
        for k, o in zip(wanted, offsets, strict=True):
            head += infos[k] + struct.pack("<Q", o)
        head += b"\0" * (-len(head) % align)
        fd, tmp = tempfile.mkstemp(dir=dst.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            for k, o in zip(wanted, offsets, strict=True):
                t = gf.tensors[k]
                f.seek(len(head) + o)
                f.write(gf._map[t.offset : t.offset + t.nbytes])
            f.truncate(len(head) + off)
        os.replace(tmp, dst)
    finally:
        gf.close()
    GGUFFile(dst).close()  # what we wrote must read back
    return wanted


def part_json(manifest: Manifest, weights_path: Path) -> dict[str, Any]:
    """What a client records next to an installed part (``veil-part.json``)."""
    return {
        "model": manifest.model,
        "part_id": manifest.part_id,
        "model_fp": list(manifest.model_fp),
        "k_min": manifest.k_min,
        "k_max": manifest.k_max,
        "weights": str(weights_path),
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
