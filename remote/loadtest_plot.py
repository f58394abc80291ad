"""The load test's outputs for people: a text table and a PNG (rows/s and p50 latency vs N)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _entries(report: dict[str, Any]) -> list[dict[str, Any]]:
    return list(report.get("servers", [report]))


def _name(server: dict[str, Any]) -> str:
    if server.get("label"):
        return str(server["label"])
    if server.get("replicas"):
        return f"ray x{server['replicas']}"
    return "batching" if server.get("batching") else "no batching"


def table(report: dict[str, Any]) -> str:
    """One line per run, then the batched/unbatched ratios when both were measured."""
    lines = [
        f"{'server':<14}{'B':>4}{'N':>5}{'steps/s':>10}{'rows/s':>10}"
        f"{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'queue p50':>11}{'errors':>8}"
    ]
    for e in _entries(report):
        for r in e["runs"]:
            lat = r["latency_ms"]
            lines.append(
                f"{_name(e['server']):<14}{r['block_rows']:>4}{r['clients']:>5}"
                f"{r['steps_per_s']:>10.2f}{r['rows_per_s']:>10.1f}{lat['p50']:>9.1f}"
                f"{lat['p95']:>9.1f}{lat['p99']:>9.1f}{r['queue_ms_p50']:>11.1f}{r['errors']:>8}"
                + (f"  per replica {r['replica_sessions']}" if r.get("replica_sessions") else "")
            )
    for q in report.get("ratios", []):
        lines.append(
            f"pair {q['pair']} B={q['block_rows']:<3} N={q['clients']:<3} batched/unbatched: "
            f"rows/s {q['rows_per_s']:.2f}x, p50 latency {q['latency_p50']:.2f}x"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path, title: str = "") -> None:
    """Aggregate rows/s (left) and p50 step latency (right) against the number of clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = ["-o", "--s", "-^", "--v", "-d", "--x"]
    colours = ["C0", "C1", "C2", "C3", "C4", "C5"]
    style_of: dict[str, int] = {}
    for e in _entries(report):
        for b in sorted({r["block_rows"] for r in e["runs"]}):
            runs = [r for r in e["runs"] if r["block_rows"] == b]
            runs.sort(key=lambda r: r["clients"])
            ns = [r["clients"] for r in runs]
            label = f"{_name(e['server'])}, {b}-row steps"
            first = label not in style_of
            k = style_of.setdefault(label, len(style_of))
            kw: dict[str, Any] = {"color": colours[k % 6], "label": label if first else None}
            if not first:  # a repeat of the same server: same colour, lighter
                kw["alpha"] = 0.5
            ax1.plot(ns, [r["rows_per_s"] for r in runs], styles[k % 6], **kw)
            ax2.plot(ns, [r["latency_ms"]["p50"] for r in runs], styles[k % 6], **kw)
    ticks = sorted({r["clients"] for e in _entries(report) for r in e["runs"]})
    for ax, ylabel in ((ax1, "aggregate rows/s"), (ax2, "p50 step latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("clients (N)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
