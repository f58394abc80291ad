"""The built-in demonstration model, and the one line that says what it is good for.

SmolLM2-135M ships with Veil so it can be tried without a server or a download; its answers
are often wrong (it invents facts and misreads instructions). Wherever it writes — the first
start, the chat, the drafting pane — the app shows :data:`DEMO_LINE`; with any other model it
shows nothing.
"""

from __future__ import annotations

from engine.loading import DEFAULT_MODEL

DEMO_LINE = (
    "Demo model: for trying Veil only, not for real work — its answers are often wrong. "
    "For your organisation's model, ask IT for an invite code."
)
DEMO_TOOLTIP = (
    f"Veil's built-in model ({DEFAULT_MODEL}) is small enough to run anywhere, so it makes up "
    "facts and misreads instructions. Your IT department's invite code connects Veil to your "
    "organisation's server; Settings → Server takes the code, and Settings → Model and replies "
    "the model file they give you."
)


def is_demo_model(spec: str, loaded_name: str | None = None) -> bool:
    """True when ``spec`` (the settings' model) names the built-in model, or the model loaded
    from it is the built-in one (``loaded_name``)."""
    names = {spec.strip().lower()}
    if loaded_name:
        names.add(loaded_name.strip().lower())
    return DEFAULT_MODEL.lower() in names
