"""Invite codes as the app checks them: on paste and on Save, before any connection is tried."""

from __future__ import annotations


def invite_problem(code: str) -> str | None:
    """None when ``code`` is a well-formed invite, else the one line to show under the field."""
    code = code.strip()
    if not code:
        return "paste the invite code your IT department gave you"
    from engine.protocol import parse_invite

    try:
        parse_invite(code)
    except ValueError as exc:
        return str(exc).split(" (")[0]  # the app adds its own advice
    return None


def invite_address(code: str) -> str:
    """The server address an invite points to ("" when the code is not valid)."""
    from engine.protocol import parse_invite

    try:
        return parse_invite(code.strip())[0]
    except ValueError:
        return ""
