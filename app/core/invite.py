"""Invite codes as the app checks them: on paste and on Save, before any connection is tried.

An invite's address is shown to the user ("the server at HOST:PORT"), so it must be a plain
``tcp://HOST:PORT``: HTML, terminal escape codes and invisible direction-changing characters
are refused here, whatever the code's maker put in it (issue 29).
"""

from __future__ import annotations

import re
import unicodedata

DAMAGED_ADVICE = "Copy the whole code again."
NEW_CODE_ADVICE = "Ask your IT department for a new code."
# a host name (letters, digits, dots, dashes), an IPv4 address, or an IPv6 one in brackets
_ADDRESS = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(?P<port>[0-9]{1,5})")
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def address_problem(address: str) -> str | None:
    """Why ``address`` is not a plain ``tcp://HOST:PORT`` (None when it is one)."""
    where = "the invite code's server address"
    if "\x1b" in address:
        return f"{where} holds a terminal escape code"
    kinds = {unicodedata.category(ch) for ch in address}
    if "Cc" in kinds:
        return f"{where} holds hidden control characters"
    if "Cf" in kinds:
        return (
            f"{where} holds invisible characters that change how text reads (such as a "
            "right-to-left override)"
        )
    if any(ch in address for ch in "<>&\"'`"):
        return f"{where} holds HTML or other characters an address never has"
    m = _ADDRESS.fullmatch(address)
    if m is None:
        return (
            f"{where} is not of the form tcp://HOST:PORT (a host name in plain letters, "
            "digits, dots and dashes, or an IP address)"
        )
    host, port = m["host"], int(m["port"])
    if not 1 <= port <= 65535:
        return f"{where} has no valid port (1 to 65535)"
    if not host.startswith("[") and (
        len(host) > 253 or not all(_LABEL.fullmatch(part) for part in host.split("."))
    ):
        return f"{where} has a host name that cannot exist ({host[:40]})"
    return None


def invite_problem(code: str) -> str | None:
    """None when ``code`` is a well-formed invite, else the one line to show under the field."""
    code = code.strip()
    if not code:
        return "paste the invite code your IT department gave you"
    from engine.protocol import parse_invite

    try:
        address, _key = parse_invite(code)
    except ValueError as exc:
        return str(exc).split(" (")[0]  # the app adds its own advice
    return address_problem(address)


def advice(problem: str) -> str:
    """What to do about ``problem``: copy a damaged code again, or ask for a new one when the
    code is whole but holds what no invite may."""
    if problem.startswith("the invite code's server address"):
        return NEW_CODE_ADVICE
    return DAMAGED_ADVICE


def invite_address(code: str) -> str:
    """The server address an invite points to ("" when the code is not valid)."""
    from engine.protocol import parse_invite

    if invite_problem(code) is not None:
        return ""
    return parse_invite(code.strip())[0]
