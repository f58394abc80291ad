"""Privacy audit details: every measured attack at every split depth, from the latest audit,
in plain words (the technical name of each attack is in its tooltip)."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.core.privacy import setting_words

# (key in the results, column title, column tooltip)
COLUMNS = (
    ("k", "Layers on this computer", "Of all the model's layers (the slider's setting)"),
    ("attack", "How the server tries", "The attack; its technical name is in its tooltip"),
    ("side", "What it reads", "What the server works on"),
    ("top1", "Words recovered", "Share of words guessed exactly (top-1 token recovery)"),
    ("top1_ci", "Likely range", "95% bootstrap confidence interval of the share above"),
    ("top5", "In 5 guesses", "The right word was among the attack's 5 guesses (top-5)"),
    ("pii_top1", "Personal data", "Names, phone numbers, addresses and the like guessed exactly"),
)

# attack -> (plain name, technical description for the tooltip)
ATTACKS = {
    "prior": (
        "Guessing common words",
        "Frequency prior: the 5 most common training tokens everywhere (the floor)",
    ),
    "nearest_embedding": (
        "Closest dictionary word",
        "Nearest embedding: cosine similarity of the state to the embedding rows",
    ),
    "ridge": (
        "Decoder trained on sample text",
        "Learned per-position decoder: one-vs-all ridge regression over the training vocabulary",
    ),
    "ridge_embedding": (
        "Decoder for unseen words",
        "Ridge regression to the input embedding, then nearest embedding over the vocabulary",
    ),
    "mlp": (
        "Neural-network decoder",
        "Learned per-position decoder: a one-hidden-layer MLP",
    ),
    "known_weights": (
        "Re-running the public model",
        "Known-weights inversion (SipIt-style): candidates are run through the public head and "
        "compared with the state this computer sent",
    ),
    "logit_lens": (
        "Reading the next word early",
        "Logit lens: final norm and LM head applied to the trunk output",
    ),
    "public_tail": (
        "Finishing the model itself",
        "Public tail layers and LM head run on the server's own output (reads the reply)",
    ),
}
SIDES = {
    "input": ("Your text", "What this computer sends: the state after the first layers"),
    "output": ("The reply", "What the server returns: the trunk output, the reply's next word"),
}


def _pct(x: Any) -> str:
    try:
        return f"{float(x) * 100:.1f}%"
    except (TypeError, ValueError):
        return "-"


def attack_name(key: str) -> tuple[str, str]:
    """(plain name, tooltip) of an attack; unknown ones keep a tidied technical name."""
    if key in ATTACKS:
        plain, tech = ATTACKS[key]
        return plain, f"{tech} [{key}]"
    text = key.replace("_", " ")
    return text[:1].upper() + text[1:], key


REPLY_NOTE = (
    "Measured on Veil's own replies. On other text it guesses the next word {top1} of the "
    "time: that is how often the model itself guesses right, not what the server reads of a "
    "reply."
)


def _range(v: Any) -> str:
    if isinstance(v, list | tuple) and len(v) == 2:
        return f"{_pct(v[0])} – {_pct(v[1])}"
    return "-"


def _cell(key: str, row: dict[str, Any], n_layers: int | None = None) -> tuple[str, str]:
    """(text, tooltip) of one cell. A reply row ("output" side) shows the share of the reply's
    own words the server reads (what a user needs to know), not the next-word guesses on other
    text beside it."""
    v = row.get(key)
    reply = row.get("side") == "output" and "top1_generated" in row
    if reply and key in ("top1", "top1_ci"):
        note = REPLY_NOTE.format(top1=_pct(row.get("top1")))
        if key == "top1":
            return _pct(row.get("top1_generated")), note
        return _range(row.get("top1_generated_ci")), note
    if reply and key in ("top5", "pii_top1"):
        return "-", f"Measured on other text only: {_pct(v)}"
    if key in ("top1", "top5", "pii_top1"):
        return _pct(v), ""
    if key == "top1_ci":
        return _range(v), ""
    if key == "k":
        try:
            k = int(v)
        except (TypeError, ValueError):
            return ("-" if v is None else str(v)), ""
        words = setting_words(n_layers, k)
        return words.removesuffix(" on this computer").replace(" layers on this computer", ""), ""
    if key == "attack" and isinstance(v, str):
        return attack_name(v)
    if key == "side" and isinstance(v, str):
        return SIDES.get(v, (v, ""))
    return ("-" if v is None else str(v)), ""


class AuditDialog(QDialog):
    def __init__(
        self,
        model: str,
        date: str,
        rows: list[dict[str, Any]],
        current_k: int,
        parent: QWidget | None = None,
        fully_local: bool = False,
        shipped: bool = False,
        n_layers: int | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Privacy audit details")
        self.resize(1060, 560)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(20, 18, 20, 16)
        lay.setSpacing(10)
        title = QLabel("Privacy audit details")
        title.setObjectName("PaneTitle")
        lay.addWidget(title)
        who = "by the Veil team" if shipped else "on this computer"
        setting = setting_words(n_layers, current_k)
        if fully_local:
            now = (
                f"At your current setting ({setting}) nothing is sent, so there is nothing to "
                "audit; the rows show the settings that use a server."
            )
        else:
            now = f"Rows for your current setting ({setting}) are in bold."
        if rows:
            text = (
                f"Model {model}, audited {who} on {date}. Each row is one way someone who runs "
                "the server could try to read your text from the numbers this computer sends "
                "(“Your text”), or Veil's reply from the numbers it sends back (“The reply”: "
                "with the public weights it can finish the model's work itself, so it reads "
                "every word). Hover over a name for the technical details. " + now
            )
        else:
            text = (
                f"{model} has not been audited yet. Use “Run privacy audit” beside the slider to "
                "measure how many words a server could recover at each setting."
            )
        intro = QLabel(text)
        intro.setWordWrap(True)
        intro.setObjectName("Muted")
        lay.addWidget(intro)
        self.table = QTableWidget(len(rows), len(COLUMNS))
        self.table.setAccessibleName("Audit results")
        for c, (_key, name, tip) in enumerate(COLUMNS):
            head = QTableWidgetItem(name)
            head.setToolTip(tip)
            self.table.setHorizontalHeaderItem(c, head)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.setAlternatingRowColors(True)
        self.bold_rows: list[int] = []
        bold = QFont(self.table.font())  # the table's own font (size from the theme), bold
        bold.setBold(True)
        for r, row in enumerate(rows):
            current = not fully_local and str(row.get("k")) == str(current_k)
            if current:
                self.bold_rows.append(r)
            for c, (key, _name, _tip) in enumerate(COLUMNS):
                text, tip = _cell(key, row, n_layers)
                item = QTableWidgetItem(text)
                if tip:
                    item.setToolTip(tip)
                if c not in (1, 2):
                    item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                if current:
                    item.setFont(bold)
                self.table.setItem(r, c, item)
        head = self.table.horizontalHeader()
        head.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        head.setStretchLastSection(True)
        if self.bold_rows:  # open at the current setting's rows, so the bold is in sight
            first = self.table.item(self.bold_rows[0], 0)
            self.table.scrollToItem(first, QTableWidget.ScrollHint.PositionAtTop)
        self.table.setVisible(bool(rows))
        lay.addWidget(self.table, 1)
        if not rows:
            lay.addStretch(1)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)
