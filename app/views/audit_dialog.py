"""Privacy audit details: every measured attack at every split depth, from the latest audit."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
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

COLUMNS = (
    ("k", "Setting"),
    ("attack", "Attack"),
    ("side", "Side"),
    ("top1", "Words"),
    ("top1_ci", "95% range"),
    ("top5", "Top 5"),
    ("pii_top1", "Personal data"),
)


ACRONYMS = {"mlp", "pii", "sipit", "knn", "lm"}


def _pct(x: Any) -> str:
    try:
        return f"{float(x) * 100:.1f}%"
    except (TypeError, ValueError):
        return "-"


def _cell(key: str, row: dict[str, Any]) -> str:
    v = row.get(key)
    if key in ("top1", "top5", "pii_top1"):
        return _pct(v)
    if key == "top1_ci":
        if isinstance(v, list | tuple) and len(v) == 2:
            return f"{_pct(v[0])} – {_pct(v[1])}"
        return "-"
    if key == "attack" and isinstance(v, str):
        words = [w.upper() if w in ACRONYMS else w for w in v.split("_")]
        text = " ".join(words)
        return text[:1].upper() + text[1:]
    return "-" if v is None else str(v)


class AuditDialog(QDialog):
    def __init__(
        self,
        model: str,
        date: str,
        rows: list[dict[str, Any]],
        current_k: int,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Privacy audit details")
        self.resize(860, 520)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(20, 18, 20, 16)
        lay.setSpacing(10)
        title = QLabel("Privacy audit details")
        title.setObjectName("PaneTitle")
        lay.addWidget(title)
        if rows:
            text = (
                f"Model {model}, audited {date}. Each row is one attack by someone who controls "
                "the server and sees the numbers this computer sends. Setting = layers kept on "
                "this computer at each end. Words = share of words guessed exactly; Top 5 = "
                "the right word among 5 guesses; Personal data = names, phone numbers and the "
                f"like guessed exactly. Rows for your current setting ({current_k}) are in bold."
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
        self.table.setHorizontalHeaderLabels([c[1] for c in COLUMNS])
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.setAlternatingRowColors(True)
        for r, row in enumerate(rows):
            bold = str(row.get("k")) == str(current_k)
            for c, (key, _) in enumerate(COLUMNS):
                item = QTableWidgetItem(_cell(key, row))
                if c != 1:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                if bold:
                    f = item.font()
                    f.setBold(True)
                    item.setFont(f)
                self.table.setItem(r, c, item)
        head = self.table.horizontalHeader()
        head.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        head.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        self.table.setVisible(bool(rows))
        lay.addWidget(self.table, 1)
        if not rows:
            lay.addStretch(1)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)
