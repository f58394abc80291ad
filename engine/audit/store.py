"""Where audit results live, and the two queries the app makes of them.

``results_dir(model)`` is ``<user data dir>/audits/<model>`` (``$VEIL_DATA_DIR`` overrides the
user data dir). The latest audit of a model is ``results.json`` there, with the schema::

    {"model": str, "date": ISO-8601 str, "results": [
        {"k": int, "attack": str, "side": "input" | "output", "top1": float,
         "top1_ci": [lo, hi], "top5": float, "top5_ci": [lo, hi], "pii_top1": float | None, ...}]}

A keyed audit (:mod:`engine.audit.keyed`) is stored under the name
``engine.keyed.audit_name(model, key_id)`` with the same schema plus ``"keyed": true``,
``"key_id"``, ``"base_model"``, ``"noise"`` (the keyed-trunk noise levels measured),
``"quality"`` (``[{"k", "noise", "greedy_agreement", "perplexity", "perplexity_plain"}]``),
``"best"`` (the best attack per k, noise and side) and a ``"noise"`` field on every result row.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

RESULTS_FILE = "results.json"
DELIVERED_FILE = "delivered.json"  # the audit that came with the organisation's model


def data_root() -> Path:
    env = os.environ.get("VEIL_DATA_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_data_dir("veil", appauthor=False))


def _safe(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", name.strip()).strip("._")
    return s[:120] or "model"


def results_dir(model_name: str) -> Path:
    """Folder of the latest audit of ``model_name`` (not created here)."""
    return data_root() / "audits" / _safe(model_name)


def _write(results: dict[str, Any], file: str) -> Path:
    out = results_dir(str(results["model"]))
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (file + ".tmp")
    tmp.write_text(json.dumps(results, indent=1), encoding="utf-8")
    tmp.replace(out / file)
    return out


def save_results(results: dict[str, Any], files: dict[str, Path] | None = None) -> Path:
    """Store ``results`` (and copies of extra files such as the plot) as the model's latest."""
    out = _write(results, RESULTS_FILE)
    for name, src in (files or {}).items():
        if src.is_file() and src.resolve() != (out / name).resolve():
            (out / name).write_bytes(src.read_bytes())
    return out


def save_delivered(results: dict[str, Any]) -> Path:
    """Store the audit that came with a model from the trunk server (measured there, for the
    served model and its split range), beside any audit of the user's own."""
    return _write(results, DELIVERED_FILE) / DELIVERED_FILE


def latest_results(model_name: str, file: str = RESULTS_FILE) -> dict[str, Any] | None:
    """The latest stored audit of ``model_name`` (``file``: the user's own, or
    :data:`DELIVERED_FILE` for the one that came with the model), or None if there is none (or
    it is unreadable)."""
    path = results_dir(model_name) / file
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        return None
    return data


def worst_case(results: dict[str, Any], k: int) -> tuple[float, str] | None:
    """Highest top-1 recovery at split depth ``k`` over all attacks and both sides.

    Returns ``(top1, "attack (side)")`` or None when the audit did not measure ``k``.
    """
    best: tuple[float, str] | None = None
    for row in results.get("results", []):
        try:
            if int(row["k"]) != k:
                continue
            top1 = float(row["top1"])
        except (KeyError, TypeError, ValueError):
            continue
        label = f"{row.get('attack', '?')} ({row.get('side', '?')})"
        if best is None or top1 > best[0]:
            best = (top1, label)
    return best
