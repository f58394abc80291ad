"""``veil-trunk status``: what a running trunk server (or Ray gateway) says about itself.

It asks with the protocol's ``stats`` ping — the statistics the load test reads — so it needs
an allowed client key like any client, and nothing on the server's machine. A client key sees
its own sessions and batches only; the server's own keypair (its ``--keys`` folder, so on the
server's machine, as its user) sees everyone's. A gateway adds one entry per replica: state,
sessions, booked KV cache, steps, batches and their mean size, and how often the replica was
lost.
"""

from __future__ import annotations

from typing import Any


def _mean_rows(hist: dict[str, Any]) -> float:
    n = sum(int(v) for v in hist.values())
    return sum(int(k) * int(v) for k, v in hist.items()) / n if n else 0.0


def format_status(st: dict[str, Any], address: str) -> str:
    own = st.get("scope") == "own"
    lines = [
        f"veil-trunk at {address}: {st.get('model', '?')}, layers {st.get('layers')}, "
        f"{st.get('sessions', 0)} session(s) open"
        + (" by this key" if own else "")
        + (f", keyed to organisation key {st['key_id']}" if st.get("key_id") else ""),
        f"batching {'on' if st.get('batching') else 'off'} (up to {st.get('max_batch_rows')} rows,"
        f" {st.get('kernel', '?')}): {st.get('steps', 0)} steps in {st.get('batches', 0)} batches"
        f" (mean {_mean_rows(st.get('batch_rows_hist', {})):.2f} rows), "
        f"{st.get('errors', 0)} error(s)",
    ]
    if own:
        lines.append(
            "(this key's own work only; every user's: --client-keys with the server's --keys "
            "folder, on the server)"
        )
    states = st.get("replica_state")
    if not states:
        return "\n".join(lines)
    lines.append(
        f"replicas: {st.get('replicas_up', 0)} of {st.get('replicas', len(states))} up; limits "
        f"per replica: {st.get('max_sessions_per_replica', '?')} sessions, "
        f"{st.get('max_cache_mb_per_replica', '?')} MB of KV cache"
    )
    head = ("replica", "state", "node", "sessions", "cache MB", "steps", "batches", "mean rows")
    rows = [head]
    for i, state in enumerate(states):

        def at(key: str, default: Any = "", i: int = i) -> Any:
            v = st.get(key) or []
            return v[i] if i < len(v) else default

        rows.append(
            (
                f"#{i}",
                str(state) + (f" (lost {at('replica_lost')}x)" if at("replica_lost", 0) else ""),
                str(at("replica_node")),
                str(at("replica_sessions", 0)),
                f"{float(at('replica_cache_mb', 0.0)):.1f}",
                str(at("replica_steps", 0)),
                str(at("replica_batches", 0)),
                f"{float(at('replica_mean_batch_rows', 0.0)):.2f}",
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    for r in rows:
        lines.append("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)
