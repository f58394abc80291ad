"""What the privacy panel says at a split setting: one word, one plain sentence, the audit
figure behind them, and the welcome text that must agree with all three.

Qt-free. The rule the panel never breaks: when the model runs fully on this computer nothing is
sent, so there is no recovery figure, no audit to run and nothing for an old audit to say.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from app.core.audit_info import AuditFigure
from engine.split import SplitPlan

# (lowest worst-case top-1 recovery, level word, colour key, what the server could read); the
# words follow the figure: "all" from 95%, "most" from 50%, "some" from 10%
LEVELS = (
    (0.95, "High", "bad", "Someone who runs the server could read all of what you type."),
    (0.5, "High", "bad", "Someone who runs the server could read most of what you type."),
    (0.1, "Medium", "warn", "Someone who runs the server could read some of what you type."),
    (0.0, "Low", "ok", "Someone who runs the server could make out only a few of your words."),
)
NONE_SENTENCE = "Nothing you type leaves this computer."
UNKNOWN_SENTENCE = (
    "This setting has not been audited: assume someone who runs the server could read what "
    "you type."
)


def share_word(top1: float) -> str:
    """How much of a text a recovery share means, in the panel's words."""
    return "all" if top1 >= 0.95 else "most" if top1 >= 0.5 else "some" if top1 >= 0.1 else "few"


def setting_words(n_layers: int | None, k: int) -> str:
    """The slider's setting in the one vocabulary the app uses everywhere (the panel, the audit
    details, the audit's question): "2 of 30 layers on this computer (1 at each end)"."""
    if n_layers is None:
        return f"{k} layer{'s' if k != 1 else ''} at each end on this computer"
    local = min(2 * k, n_layers)
    if local >= n_layers:
        return f"all {n_layers} layers on this computer"
    return f"{local} of {n_layers} layers on this computer ({k} at each end)"


def reply_sentence(reply_top1: float | None, date: str) -> str:
    """What the server reads of the replies. In the app the last layers and the LM head are
    the public model's, so a server that has the weights finishes the model itself and reads
    every word of a reply (docs/privacy.md); the audit measures it when it has the figure."""
    if reply_top1 is None:
        return (
            "It could also read every word of Veil's replies: with the model's public weights "
            "it can finish the model's work itself."
        )
    word = share_word(reply_top1)
    how = "a few" if word == "few" else word
    return (
        f"It could also read {how} of Veil's replies: with the model's public weights it can "
        f"finish the model's work itself (the audit of {date} recovered "
        f"{reply_top1 * 100:.0f}% of reply words)."
    )


def level_for(top1: float) -> tuple[str, str, str]:
    """(level word, colour key, sentence) for a worst-case top-1 recovery share."""
    for floor, word, color, sentence in LEVELS:
        if top1 >= floor:
            return word, color, sentence
    return LEVELS[-1][1:]


def fully_local(n_layers: int, k: int) -> bool:
    """True when ``k`` layers at each end are the whole model: no server, nothing sent."""
    top = (n_layers + 1) // 2
    return SplitPlan.symmetric(n_layers, max(1, min(k, top))).fully_local


@dataclass(frozen=True)
class PrivacyView:
    """Everything the panel shows about privacy at one setting."""

    level: str  # one word: None | Low | Medium | High | Unknown
    color: str  # theme colour key
    sentence: str  # one plain sentence
    figure: str  # the audit figure ("99%"), or what stands in for it
    caption: str  # where the figure comes from ("" when there is nothing to cite)
    tooltip: str  # the attack behind the worst case (technical, for the curious)
    local: bool  # fully on this computer
    audited: bool  # the figure comes from an audit
    reply: str = ""  # what the server reads of the replies ("" when nothing is sent)
    keyed: bool = False  # an organisation key is in use (the server runs a keyed model)
    key_measured: bool = False  # the figures are a keyed audit's, measured with that key

    @property
    def accessible(self) -> str:
        return f"Privacy risk {self.level}. {self.sentence} {self.reply} {self.caption}".strip()


KEYED = "with your organisation's key"
# what the panel says under a key when only the plain audit measured the setting (docs/privacy.md,
# "Verdict on the keyed split": the server recovers the key from its weights, then reads as much)
KEY_NOT_LOWER = (
    "Measured without your organisation's key: Veil's tests found the key does not lower what "
    "the server can read (docs/privacy.md)."
)


def describe(
    n_layers: int | None,
    k: int,
    fig: AuditFigure | None,
    reply_top1: float | None = None,
    keyed: bool = False,
    key_measured: bool = False,
) -> PrivacyView:
    """The panel's words for split ``k``; ``fig`` is the audit figure (ignored when local),
    ``reply_top1`` the audit's share of reply words read (None: not measured). ``keyed``: the
    server runs a model keyed to the organisation's key; ``key_measured``: ``fig`` is that keyed
    audit's, else the plain audit's, which the caption says was measured without the key (the
    key does not lower it, so the plain figure stands for the keyed split)."""
    view = _describe(n_layers, k, fig, reply_top1)
    if not keyed or view.local:
        return view
    if key_measured:
        sep = ", " if view.audited else " "  # "... (worst case of all attacks), with your ..."
        caption = f"{view.caption[:-1]}{sep}{KEYED}."
        return replace(view, caption=caption, keyed=True, key_measured=True)
    caption = f"{view.caption} {KEY_NOT_LOWER}" if view.audited else view.caption
    return replace(view, caption=caption, keyed=True)


def _describe(
    n_layers: int | None, k: int, fig: AuditFigure | None, reply_top1: float | None = None
) -> PrivacyView:
    if n_layers is not None and fully_local(n_layers, k):
        return PrivacyView(
            "None", "ok", NONE_SENTENCE, "nothing is sent",
            "No server is used at this setting, so there is nothing to audit.", "", True, False,
        )  # fmt: skip
    date = fig.date if fig is not None else ""
    reply = reply_sentence(reply_top1 if date else None, date)
    if fig is None or fig.top1 is None:
        if fig is not None and fig.date:
            caption = f"This setting was not measured in the privacy audit of {fig.date}."
        else:
            caption = "This model has not been audited yet."
        value = "not measured" if fig is not None and fig.date else "not audited yet"
        return PrivacyView(
            "Unknown", "warn", UNKNOWN_SENTENCE, value, caption, "", False, False, reply
        )
    word, color, sentence = level_for(fig.top1)
    caption = (
        f"The privacy audit of {fig.date} recovered {fig.value} of words at this setting "
        "(worst case of all attacks)."
    )
    tip = f"Worst case over all attacks: {fig.attack}" if fig.attack else ""
    return PrivacyView(word, color, sentence, fig.value, caption, tip, False, True, reply)


def welcome_text(view: PrivacyView) -> str:
    """The empty chat's explanation, in the same words as the panel beside it."""
    if view.local:
        return (
            "Everything runs on this computer at the current setting: nothing you type is sent "
            "anywhere. Move the slider to the left to use the server and answer faster."
        )
    how = (
        "Veil keeps the start and the end of the model on this computer and sends the server "
        "numbers instead of your text."
    )
    if view.level == "Unknown":
        return f"{how} Those numbers can still reveal your words. {UNKNOWN_SENTENCE} {view.reply}"
    return (
        f"{how} Those numbers can be turned back into words: at the current setting "
        f"{view.sentence[0].lower()}{view.sentence[1:]} {view.reply} Use a server you trust, "
        "or move the slider all the way to the right to keep everything here."
    )
