"""Privacy audit: what the trunk server can recover from the activations it sees.

Light to import (the GUI reads :mod:`engine.audit.store`); :func:`run_audit` pulls in torch.
"""

from __future__ import annotations

from typing import Any

from engine.audit.store import latest_results, results_dir, worst_case

__all__ = ["latest_results", "results_dir", "run_audit", "worst_case"]


def run_audit(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """See :func:`engine.audit.runner.run_audit`."""
    from engine.audit.runner import run_audit as _run

    return _run(*args, **kwargs)
