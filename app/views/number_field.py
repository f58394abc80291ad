"""Number fields that say so when a typed value is out of range, instead of silently changing
it (Qt's spin boxes refuse the extra digits or snap to the limit without a word)."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtGui import QValidator
from PySide6.QtWidgets import QDoubleSpinBox, QLabel, QSpinBox, QVBoxLayout, QWidget


def _number(text: str) -> float | None:
    try:
        return float(text.strip().replace(",", "."))
    except ValueError:
        return None


class _RangeNote:
    """Shared by both field types: accept any number while typing, then bring it into range
    on Enter / leaving the field and emit ``adjusted(message)``."""

    adjusted: Signal

    def _core(self, text: str) -> str:
        t = text
        prefix, suffix = self.prefix(), self.suffix()  # type: ignore[attr-defined]
        if prefix and t.startswith(prefix):
            t = t[len(prefix) :]
        if suffix and t.endswith(suffix):
            t = t[: -len(suffix)]
        return t.strip()

    def _range_validate(self, state: QValidator.State, text: str) -> QValidator.State:
        if state == QValidator.State.Invalid and _number(self._core(text)) is not None:
            return QValidator.State.Intermediate  # keep what was typed; fixup explains
        return state

    def _range_fixup(self, text: str) -> str | None:
        x = _number(self._core(text))
        if x is None:
            return None
        lo, hi = self.minimum(), self.maximum()  # type: ignore[attr-defined]
        if lo <= x <= hi:
            return None
        limit = hi if x > hi else lo
        shown = self.textFromValue(limit)  # type: ignore[attr-defined]
        typed = self._core(text)
        which = "largest" if x > hi else "smallest"
        self.adjusted.emit(f"{typed} is out of range: the {which} value is {shown}, used instead.")
        return self.prefix() + shown + self.suffix()  # type: ignore[attr-defined,no-any-return]

    # Qt's virtual overrides, shared: the MRO puts the spin box class right after this mixin.
    def validate(self, text: str, pos: int) -> object:
        res = super().validate(text, pos)  # type: ignore[misc]
        state = res[0] if isinstance(res, tuple) else res
        new = self._range_validate(QValidator.State(state), text)
        return (new, text, pos)

    def fixup(self, text: str) -> str:
        fixed = self._range_fixup(text)
        return fixed if fixed is not None else str(super().fixup(text) or text)  # type: ignore[misc]


class NumberField(_RangeNote, QSpinBox):
    adjusted = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setCorrectionMode(QSpinBox.CorrectionMode.CorrectToNearestValue)


class DecimalField(_RangeNote, QDoubleSpinBox):
    adjusted = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setCorrectionMode(QDoubleSpinBox.CorrectionMode.CorrectToNearestValue)


def with_note(field: NumberField | DecimalField) -> tuple[QWidget, QLabel]:
    """``field`` with a line under it that shows what was adjusted (hidden until then)."""
    box = QWidget()
    lay = QVBoxLayout(box)
    lay.setContentsMargins(0, 0, 0, 0)
    lay.setSpacing(2)
    lay.addWidget(field)
    note = QLabel()
    note.setObjectName("FieldNote")
    note.setWordWrap(True)
    note.hide()
    lay.addWidget(note)

    def show(msg: str) -> None:
        note.setText(msg)
        note.show()

    field.adjusted.connect(show)
    return box, note
