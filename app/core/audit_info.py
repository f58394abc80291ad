"""The privacy-audit figure shown beside the slider, read from the latest stored audit."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import VeilError

log = logging.getLogger("veil.app")

NOT_AUDITED = "not audited yet"


@dataclass(frozen=True)
class AuditFigure:
    k: int
    top1: float | None  # worst-case top-1 token recovery at this k (0..1)
    attack: str
    date: str  # the audit's date, "" when there is none

    @property
    def value(self) -> str:
        """The big figure beside the slider."""
        return NOT_AUDITED if self.top1 is None else f"{self.top1 * 100:.0f}%"

    @property
    def caption(self) -> str:
        if self.top1 is None:
            return f"This setting was not measured (audit of {self.date})" if self.date else ""
        return f"of words, worst case of all attacks (audit of {self.date})"

    @property
    def text(self) -> str:
        if self.top1 is None:
            return NOT_AUDITED if not self.date else f"k={self.k} not measured ({self.date})"
        return f"{self.top1 * 100:.0f}% of words recoverable at worst (audit of {self.date})"


def _store() -> Any:
    if importlib.util.find_spec("engine.audit") is None:
        return None
    try:
        from engine.audit import store
    except ImportError as exc:
        log.info("audit store unavailable: %s", exc)
        return None
    return store


def shipped_audit_path(model_name: str) -> Path:
    """Audit results shipped with Veil (measured by the team with `veil audit`), used until the
    user runs an audit of their own."""
    base = Path(getattr(sys, "_MEIPASS", Path(__file__).resolve().parents[2]))
    return base / "resources" / "audits" / f"{model_name}.json"


def _shipped(model_name: str) -> dict[str, Any] | None:
    path = shipped_audit_path(model_name)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("model") != model_name:
        return None
    return data


def latest(model_name: str) -> dict[str, Any] | None:
    """The user's latest audit of this model, else the one that came with the organisation's
    model from its server, else the one shipped with Veil, else None."""
    store = _store()
    if store is None:
        return None
    for file in (store.RESULTS_FILE, getattr(store, "DELIVERED_FILE", None)):
        try:
            found = store.latest_results(model_name, file) if file else None
        except Exception as exc:  # a broken audit file never breaks the app
            log.warning("reading the audit of %s: %s", model_name, exc)
            found = None
        if found is not None:
            return found  # type: ignore[no-any-return]
    return _shipped(model_name)


def figure(model_name: str, k: int) -> AuditFigure:
    data = latest(model_name)
    if data is None:
        return AuditFigure(k, None, "", "")
    date = str(data.get("date", ""))[:10]
    store = _store()
    worst = store.worst_case(data, k) if store is not None else None
    if worst is None:
        return AuditFigure(k, None, "", date or "unknown date")
    return AuditFigure(k, float(worst[0]), str(worst[1]), date)


def reply_share(model_name: str, k: int) -> float | None:
    """The share of the model's own reply words the server recovered at split ``k`` (the
    audit's best output-side attack on generated tokens), or None when not measured."""
    data = latest(model_name)
    best: float | None = None
    for r in (data or {}).get("results", []):
        try:
            if int(r["k"]) != k or r.get("side") != "output":
                continue
            share = float(r["top1_generated"])
        except (KeyError, TypeError, ValueError):
            continue
        best = share if best is None else max(best, share)
    return best


def rows(model_name: str, n_layers: int | None = None) -> list[dict[str, Any]]:
    """The audit's result rows, sorted by k, for the details dialog. Rows at a fully local
    depth (an older audit may hold them) are left out: nothing is sent there."""
    data = latest(model_name)
    if data is None:
        return []
    n = n_layers or _int(data.get("n_layers"))
    out = [
        r
        for r in data.get("results", [])
        if isinstance(r, dict) and not (n and 2 * _int(r.get("k")) >= n)
    ]
    return sorted(out, key=lambda r: (int(r.get("k", 0)), str(r.get("attack")), str(r.get("side"))))


def _int(x: Any) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return 0


def is_shipped(data: dict[str, Any] | None, model_name: str) -> bool:
    """True when ``data`` is the audit that ships with Veil (not one run on this computer)."""
    return data is not None and data == _shipped(model_name)


def audit_runner_available() -> bool:
    """True when the audit module can be run from the app."""
    pkg = _audit_pkg()
    return pkg is not None and hasattr(pkg, "run_audit")


def _audit_pkg() -> Any:
    if importlib.util.find_spec("engine.audit") is None:
        return None
    try:
        import engine.audit as pkg
    except ImportError:
        return None
    return pkg


def audit_depths(n_layers: int, current: int) -> list[int]:
    """The split depths a quick audit from the app measures (the slider's current one too).

    Never a fully local depth (k >= L/2): nothing is sent there, so there is nothing to
    measure."""
    top = (n_layers - 1) // 2
    return sorted({k for k in (1, 2, 3, 4, 6, 8, current) if 1 <= k <= top})


# Seconds a quick audit takes, from one measured on the 2-core AMD EPYC (Zen 3) helper machine
# (2026-12-03, 2 torch threads, under the CPU lock; docs/app.md): the default 135M-parameter
# model at the app's depths 1, 2, 3, 4, 6, 8 took 779 s, of which 343 s were text, replies,
# states and the noise sweep, and each depth k took about 52 + 5 k seconds.
QUICK_BASE_S = 343.0
QUICK_PER_DEPTH_S = 52.0
QUICK_PER_LAYER_S = 5.0
REFERENCE_PARAMS = 135e6


def _work_s(ks: list[int]) -> float:
    return QUICK_BASE_S + sum(QUICK_PER_DEPTH_S + QUICK_PER_LAYER_S * k for k in ks)


def estimate_seconds(
    ks: list[int], n_params: float | None, last: tuple[float, list[int]] | None = None
) -> float:
    """About how long a quick audit of ``ks`` takes here: from this computer's last quick audit
    of the model when there is one (``last`` = (seconds, its depths), scaled to these depths),
    else from the reference measurement scaled by model size."""
    if last is not None and last[0] > 0 and last[1]:
        return last[0] * _work_s(ks) / _work_s(list(last[1]))
    scale = (n_params or REFERENCE_PARAMS) / REFERENCE_PARAMS
    return _work_s(ks) * max(scale, 0.05)


def human_duration(seconds: float) -> str:
    """Like "about 4 minutes", "about 40 seconds" or "about 1 hour 10 minutes"."""
    s = max(1, round(seconds))
    if s < 90:
        return f"about {max(10, round(s, -1))} seconds"
    m = round(s / 60)
    if m < 60:
        return f"about {m} minutes"
    h, m = divmod(m, 60)
    return f"about {h} hour{'s' if h > 1 else ''}" + (f" {m} minutes" if m else "")


def elapsed_text(seconds: float) -> str:
    """Like "3 min 42 s" or "48 s"."""
    s = max(0, round(seconds))
    return f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"


def run_blocking(
    model: str,
    ks: list[int],
    progress: Callable[[str, float], None] | None,
    cancelled: Callable[[], bool],
) -> dict[str, Any]:
    """Run a quick audit and store it as the model's latest (worker thread)."""
    pkg = _audit_pkg()
    if pkg is None or not hasattr(pkg, "run_audit"):
        raise VeilError("the privacy audit is not part of this installation")
    return pkg.run_audit(  # type: ignore[no-any-return]
        model, ks, None, quick=True, progress=progress, cancel=cancelled, save=True
    )
