"""Checks shared by the ``veil-trunk`` commands' flags: numbers and ``tcp://HOST:PORT`` addresses.

Each gives one line for the user (``veil-trunk: error: ...``), never a traceback from deeper
down (``nan`` seconds, an infinite cache, a port past 65535, a host zmq cannot parse).
"""

from __future__ import annotations

import argparse
import math
import re

LARGEST = 1e9  # no flag of veil-trunk means anything beyond this (seconds, GB, ms, CPUs)

# host: a name or IPv4 address (no spaces, colons, slashes or brackets), [IPv6], or * (a bind's
# every interface); port: a number or * (a bind's free port)
_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+|\*):(\*|[0-9]{1,5})")


def finite_float(text: str) -> float:
    """argparse type: a number, not nan/inf and not beyond :data:`LARGEST` either way."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or abs(value) > LARGEST:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number between -1e9 and 1e9")
    return value


def tcp_address_problem(address: str, *, bind: bool = False) -> str | None:
    """Why ``address`` is not ``tcp://HOST:PORT`` (None when it is). ``bind``: an address to
    listen on, whose host or port may be ``*`` (every interface, a free port)."""
    m = _TCP.fullmatch(address)
    if m is None:
        return f"{address!r} is not a tcp://HOST:PORT address"
    host, port = m.groups()
    if "*" in (host, port) and not bind:
        return f"{address!r} is not an address to connect to (it has a *)"
    if port == "*":
        return None
    if not 1 <= int(port) <= 65535:
        return f"{address!r}: the port must be between 1 and 65535"
    return None
