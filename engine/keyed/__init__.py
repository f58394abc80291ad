"""The organisation-keyed split (see :mod:`engine.keyed.transform` and docs/privacy.md)."""


def audit_name(model_name: str, key_id: str) -> str:
    """The name a keyed model's audit results are stored under (``engine.audit.store``)."""
    return f"{model_name} keyed {key_id}"
