"""CurveZMQ keys on the client: this computer's keypair and each saved server's public key,
kept in the OS keyring (``keyring``) unless the user opts in to one of the stores below.

Backends, chosen by the environment variable ``VEIL_KEYRING``:

* unset — the OS keyring (macOS Keychain, Windows Credential Locker, Secret Service/KWallet).
  If the OS has none (headless Linux, CI), every call raises :class:`KeyStoreError` with one
  line that names the opt-in fallbacks below. File backends that ``keyring`` would pick on its
  own (keyrings.alt) are *not* used silently.
* ``VEIL_KEYRING=file`` — keyrings.alt's plaintext file (``keyring_pass.cfg`` in the user data
  dir, mode 0600). Not encrypted: only for machines where the disk itself is protected.
* ``VEIL_KEYRING=encrypted`` — keyrings.alt's encrypted file; asks for a password on the
  terminal. Needs ``pycryptodome`` (``pip install 'veil[encrypted-keys]'``); without it every
  call says so in one line.
* ``VEIL_KEYRING=memory`` — an in-process store that forgets everything at exit (tests, demos).

Command line: ``python -m engine.keys show`` (or ``veil --client-key``) prints this computer's
public key (creating the keypair on first use) — the line a server admin passes to
``veil-trunk allow``. :func:`storage_description` says, for the store in use, where the keys
really are (the settings dialog shows it).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from engine.errors import KeyStoreError

SERVICE = "veil"
CLIENT_PUBLIC = "client-public-key"
CLIENT_SECRET = "client-secret-key"
SERVER_PREFIX = "server-key:"
SIGN_PREFIX = "server-sign-key:"  # the key that signs the model parts a server ships
ORG_KEY = "org-key"  # the imported organisation key, as its text (app/core/org_key.py)

FALLBACK_HINT = (
    "no OS keyring is available on this computer; set VEIL_KEYRING=file to keep keys in a "
    "private file (not encrypted), VEIL_KEYRING=encrypted for a password-protected file, or "
    "VEIL_KEYRING=memory to forget them at exit"
)


ENCRYPTED_NEEDS = (
    "VEIL_KEYRING=encrypted needs the pycryptodome package, which is not installed "
    "(pip install 'veil[encrypted-keys]' or pip install pycryptodome)"
)


def _has_crypto() -> bool:
    """Can keyrings.alt's encrypted file work here (pycryptodome or pycryptodomex)?"""
    import importlib

    for name in ("Cryptodome.Cipher.AES", "Crypto.Cipher.AES"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        return True
    return False


def _memory_backend() -> Any:
    import keyring.backend

    class MemoryKeyring(keyring.backend.KeyringBackend):
        """Keys held in this process only."""

        priority = 1  # type: ignore[assignment]

        def __init__(self) -> None:
            super().__init__()
            self.store: dict[tuple[str, str], str] = {}

        def get_password(self, service: str, username: str) -> str | None:
            return self.store.get((service, username))

        def set_password(self, service: str, username: str, password: str) -> None:
            self.store[(service, username)] = password

        def delete_password(self, service: str, username: str) -> None:
            self.store.pop((service, username), None)

    return MemoryKeyring()


_backend: Any = None
_backend_kind: str | None = None


def backend() -> Any:
    """The keyring backend Veil uses (see the module docstring)."""
    global _backend, _backend_kind
    kind = os.environ.get("VEIL_KEYRING", "").strip().lower() or "os"
    if _backend is not None and _backend_kind == kind:
        return _backend
    if kind == "memory":
        be = _memory_backend()
    elif kind == "file":
        from keyrings.alt.file import PlaintextKeyring

        be = PlaintextKeyring()
    elif kind == "encrypted":
        if not _has_crypto():
            raise KeyStoreError(
                ENCRYPTED_NEEDS, hint="or choose VEIL_KEYRING=file or memory, or an OS keyring"
            )
        from keyrings.alt.file import EncryptedKeyring

        be = EncryptedKeyring()
    elif kind == "os":
        import keyring
        from keyring.backends import fail

        try:
            be = keyring.get_keyring()
        except Exception as exc:
            raise KeyStoreError(f"cannot open the OS keyring: {exc}", hint=FALLBACK_HINT) from None
        mod = type(be).__module__

        def ours_or_alt(m: str) -> bool:  # keyrings.alt's files, or the memory store above
            return m.startswith("keyrings.alt") or m == __name__

        chained = getattr(be, "backends", None)
        if chained is not None:
            real = [b for b in chained if not ours_or_alt(type(b).__module__)]
            if not real:
                raise KeyStoreError("no OS keyring", hint=FALLBACK_HINT)
        if isinstance(be, fail.Keyring) or ours_or_alt(mod) or "null" in mod:
            raise KeyStoreError("no OS keyring", hint=FALLBACK_HINT)
    else:
        raise KeyStoreError(
            f"VEIL_KEYRING={kind} is not a known key store",
            hint="use file, encrypted or memory, or unset it for the OS keyring",
        )
    _backend, _backend_kind = be, kind
    return be


def _get(name: str) -> str | None:
    try:
        v = backend().get_password(SERVICE, name)
    except KeyStoreError:
        raise
    except Exception as exc:
        raise KeyStoreError(f"cannot read from the keyring: {exc}", hint=FALLBACK_HINT) from None
    return v if isinstance(v, str) else None


def _set(name: str, value: str) -> None:
    try:
        backend().set_password(SERVICE, name, value)
    except KeyStoreError:
        raise
    except Exception as exc:
        raise KeyStoreError(f"cannot write to the keyring: {exc}", hint=FALLBACK_HINT) from None


def _delete(name: str) -> None:
    from keyring.errors import PasswordDeleteError

    try:
        backend().delete_password(SERVICE, name)
    except KeyStoreError:
        raise
    except PasswordDeleteError:  # some stores say so when there is nothing to delete
        if _get(name) is not None:
            raise KeyStoreError("the keyring did not delete the key", hint=FALLBACK_HINT) from None
    except Exception as exc:
        raise KeyStoreError(f"cannot delete from the keyring: {exc}", hint=FALLBACK_HINT) from None


def org_key_text() -> str | None:
    """The organisation key kept with this computer's keys (its text form), or None."""
    return _get(ORG_KEY)


def save_org_key_text(text: str) -> None:
    _set(ORG_KEY, text)


def delete_org_key_text() -> None:
    """Remove the organisation key from the store (nothing to do when there is none)."""
    _delete(ORG_KEY)


def client_keypair(create: bool = True) -> tuple[str, str]:
    """This computer's CURVE keypair (public, secret) as z85 strings; made on first use."""
    pub, sec = _get(CLIENT_PUBLIC), _get(CLIENT_SECRET)
    if pub and sec and len(pub) == 40 and len(sec) == 40:
        return pub, sec
    if not create:
        raise KeyStoreError("this computer has no Veil keypair yet")
    import zmq

    p, s = zmq.curve_keypair()
    _set(CLIENT_SECRET, s.decode())
    _set(CLIENT_PUBLIC, p.decode())
    return p.decode(), s.decode()


def save_server_key(address: str, public_key: str) -> None:
    from engine.protocol import curve_key_problem

    problem = curve_key_problem(public_key)
    if problem is not None:
        raise KeyStoreError(f"not a server public key: {problem}")
    _set(SERVER_PREFIX + address, public_key)


def server_key(address: str) -> str | None:
    """The saved public key of the server at ``address`` (None when unknown)."""
    return _get(SERVER_PREFIX + address)


def save_sign_key(address: str, public_key: str) -> None:
    """Pin the model-signing key of the server at ``address`` (after a manifest verified)."""
    _set(SIGN_PREFIX + address, public_key)


def sign_key(address: str) -> str | None:
    """The saved model-signing key of the server at ``address`` (None when unknown)."""
    return _get(SIGN_PREFIX + address)


def storage_description() -> str:
    """Where this computer's keys are kept, true for the store in use (one or two sentences)."""
    kind = os.environ.get("VEIL_KEYRING", "").strip().lower() or "os"
    if kind == "memory":
        return "Keys are kept in memory only (VEIL_KEYRING=memory) and forgotten when Veil exits."
    if kind == "file":
        try:
            where = str(backend().file_path)
        except Exception:
            where = "a file in your user data folder"
        return (
            f"Keys are kept in a plain, unencrypted file readable by your user account "
            f"(VEIL_KEYRING=file): {where}."
        )
    if kind == "encrypted":
        return (
            "Keys are kept in a password-protected file (VEIL_KEYRING=encrypted); Veil asks "
            "for the password on the terminal."
        )
    if kind != "os":
        return f"VEIL_KEYRING={kind} is not a known key store; keys cannot be kept."
    # (the OS keyring is not probed here: that may ask the desktop for it)
    name = type(_backend).__name__ if _backend is not None and _backend_kind == "os" else ""
    where = f"the system keyring ({name})" if name else "the system keyring"
    return f"Keys are kept in {where}, not in a plain file."


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in (["show"], []):
        print("usage: python -m engine.keys [show]", file=sys.stderr)
        return 2
    try:
        pub, _ = client_keypair()
    except KeyStoreError as exc:
        print(f"veil: error: {exc}", file=sys.stderr)
        return 2
    print(pub)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
