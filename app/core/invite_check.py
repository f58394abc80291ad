"""Does the server an invite names answer, and does it hold the invite's key? Settings asks
before it saves a new invite, so a wrong code never replaces a working server (issue 30).

Qt-free; runs off the GUI thread. Two probes, because CurveZMQ alone cannot tell "nothing
there" from "wrong key" (a client with the wrong server key just retries):

1. a plain TCP connect to HOST:PORT: refused = nothing listens there; no answer = the network
   or a firewall; an unknown name = DNS;
2. a CurveZMQ handshake with the invite's server key, watched through the socket monitor: it
   succeeds only when the server holds that key's secret half; "refused by authentication"
   means the key is right but the server does not let this computer's key in (yet); a
   handshake that fails or never completes while TCP works means something answers there that
   does not hold the invite's key (another Veil server, or not a Veil server at all).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from app.core.invite import advice, invite_problem

OK = "ok"
BAD_CODE = "bad-code"  # the invite itself is damaged or refused
NO_NAME = "no-name"  # the host name cannot be found
NOTHING_LISTENS = "nothing-listens"  # connection refused
UNREACHABLE = "unreachable"  # no answer at all (network, firewall)
KEY_MISMATCH = "key-mismatch"  # something answers but does not hold the invite's key
NOT_ALLOWED = "not-allowed"  # the right server, which does not accept this computer's key

TCP_TIMEOUT_S = 4.0
HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServerCheck:
    kind: str
    message: str  # one line for under the invite field
    hint: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == OK


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host.strip("[]"), int(port)


def tcp_probe(host: str, port: int, timeout_s: float = TCP_TIMEOUT_S) -> str:
    """OK when something accepts a TCP connection at host:port, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return OK
    except socket.gaierror:
        return NO_NAME
    except ConnectionRefusedError:
        return NOTHING_LISTENS
    except OSError:  # timed out, host or network unreachable
        return UNREACHABLE


def curve_probe(
    address: str,
    server_key: str,
    client_keys: tuple[str, str],
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> str:
    """OK / NOT_ALLOWED / KEY_MISMATCH from one CurveZMQ handshake with ``server_key``."""
    import zmq
    import zmq.utils.monitor

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    mon = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey = server_key.encode()
        sock.curve_publickey = client_keys[0].encode()
        sock.curve_secretkey = client_keys[1].encode()
        mon = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        sock.connect(address)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not mon.poll(int(left * 1000) + 1):
                break
            event = zmq.utils.monitor.recv_monitor_message(mon)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return OK
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return NOT_ALLOWED
            return KEY_MISMATCH  # the server could not read our hello: not its key
        return KEY_MISMATCH  # it accepted TCP but never completed a handshake
    finally:
        if mon is not None:
            sock.disable_monitor()
            mon.close(0)
        sock.close(0)
        ctx.term()


def _this_computers_keys() -> tuple[str, str]:
    """This computer's keypair; a throw-away one when the keyring cannot give it (the server's
    key is checked all the same: a server that holds it refuses a stranger by authentication)."""
    try:
        from engine.keys import client_keypair

        return client_keypair(create=True)
    except Exception:  # keyring trouble is reported where the key is shown, not here
        import zmq

        pub, sec = zmq.curve_keypair()
        return pub.decode(), sec.decode()


def check_invite_server(
    code: str,
    client_keys: tuple[str, str] | None = None,
    tcp_timeout_s: float = TCP_TIMEOUT_S,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> ServerCheck:
    """Whether the server in ``code`` answers and holds the invite's key (blocking, seconds)."""
    problem = invite_problem(code)
    if problem is not None:
        return ServerCheck(BAD_CODE, problem[:1].upper() + problem[1:] + ".", advice(problem))
    from engine.protocol import parse_invite

    address, key = parse_invite(code.strip())
    host, port = _host_port(address)
    where = address.removeprefix("tcp://")
    tcp = tcp_probe(host, port, tcp_timeout_s)
    if tcp == NO_NAME:
        return ServerCheck(
            NO_NAME,
            f"The server name {host} cannot be found.",
            "Check this computer's network (and VPN), or ask your IT department.",
        )
    if tcp == NOTHING_LISTENS:
        return ServerCheck(
            NOTHING_LISTENS,
            f"Nothing listens at {where}: no server is running there.",
            "Check that the server is running and that the invite is for this address.",
        )
    if tcp == UNREACHABLE:
        return ServerCheck(
            UNREACHABLE,
            f"No answer from {where}.",
            "The network or a firewall may block it; check the VPN, or ask your IT department.",
        )
    verdict = curve_probe(address, key, client_keys or _this_computers_keys(), handshake_timeout_s)
    if verdict == OK:
        return ServerCheck(OK, f"The server at {where} answers and holds the invite's key.")
    if verdict == NOT_ALLOWED:
        return ServerCheck(
            NOT_ALLOWED,
            f"The server at {where} answers and its key matches the invite, but it does not "
            "let this computer in yet.",
            "Send this computer's key (below) to your IT department, then press Save again.",
        )
    return ServerCheck(
        KEY_MISMATCH,
        f"Something answers at {where}, but its key does not match the invite.",
        "The invite is for another server, or this is not a Veil server: ask your IT "
        "department for a new invite.",
    )
