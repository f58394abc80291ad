"""The panel on the right (privacy slider and live performance) and the rail beside it.

The conversation never lies under the panel: when the window is too narrow for the chat list,
a comfortable conversation and the panel side by side, the panel folds away and the rail's
button shows it again. Shown in a window too narrow for all three, the panel takes the chat
list's place (the conversation keeps at least its minimum width); hiding it brings the list
back. :func:`arrange` is the rule, without Qt.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QScrollArea, QToolButton, QVBoxLayout, QWidget

from app.core.controller import AppController
from app.core.privacy import PrivacyView
from app.views.gauges_panel import GaugesPanel
from app.views.privacy_panel import PrivacyPanel
from app.views.theme import Theme, set_icon

SIDE_PANEL_PX = 330  # at 10 pt; wider (up to SIDE_PANEL_MAX_PX) for larger text, and it wraps
SIDE_PANEL_MAX_PX = 430
# narrower than this many pixels per point of text (460 at 10 pt: about 50 characters a line),
# the conversation is cramped: the panel folds away
CHAT_COMFORT_PX_PER_PT = 46


def side_panel_width(font_pt: int) -> int:
    return max(SIDE_PANEL_PX, min(SIDE_PANEL_MAX_PX, SIDE_PANEL_PX + (font_pt - 10) * 10))


def arrange(
    total: int,
    chat_list: int,
    panel: int,
    rail: int,
    chat_min: int,
    font_pt: int,
    wanted: bool | None,
) -> tuple[bool, bool]:
    """(show the chat list, show the panel) in a window ``total`` pixels wide.

    ``wanted`` is the user's choice (None: decide by the width and the text size). The
    conversation gets what is left and never less than ``chat_min``: the panel, when shown
    where there is no room for all three, takes the chat list's place."""
    room = total - chat_list - rail - panel
    comfort = max(CHAT_COMFORT_PX_PER_PT * font_pt, chat_min)
    show_panel = room >= comfort if wanted is None else wanted
    show_list = not show_panel or room >= chat_min
    return show_list, show_panel


class PanelRail(QFrame):
    """A narrow strip at the window's right edge with the button that shows or hides the panel
    (its shield takes the privacy level's colour)."""

    toggled = Signal(bool)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("PanelRail")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 14, 4, 14)
        self.button = QToolButton()
        self.button.setCheckable(True)
        self.button.setAutoRaise(True)
        self.button.setAccessibleName("Show the privacy and performance panel")
        self.button.toggled.connect(self._toggled)
        lay.addWidget(self.button, 0, Qt.AlignmentFlag.AlignHCenter)
        lay.addStretch(1)
        self._level, self._color = "", "accent"
        self._draw()

    def set_privacy(self, view: PrivacyView) -> None:
        self._level, self._color = view.level, view.color
        self._draw()

    def set_shown(self, shown: bool) -> None:
        self.button.blockSignals(True)
        self.button.setChecked(shown)
        self.button.blockSignals(False)
        self._draw()

    def _toggled(self, on: bool) -> None:
        self._draw()
        self.toggled.emit(on)

    def _draw(self) -> None:
        set_icon(self.button, "shield", self._color, 22)
        verb = "Hide" if self.button.isChecked() else "Show"
        self.button.setAccessibleName(f"{verb} the privacy and performance panel")
        level = f"Privacy risk: {self._level}. " if self._level else ""
        self.button.setToolTip(f"{level}{verb} the privacy and performance panel")


class SidePanel(QScrollArea):
    """The privacy and performance cards in a scroll area of a width that suits the text size."""

    def __init__(self, app: AppController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        right = QWidget()
        right.setObjectName("RightPanel")
        right.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        rl = QVBoxLayout(right)
        rl.setContentsMargins(14, 16, 14, 16)
        rl.setSpacing(14)
        self.privacy = PrivacyPanel(app)
        self.gauges = GaugesPanel(app)
        rl.addWidget(self.privacy)
        rl.addWidget(self.gauges)
        rl.addStretch(1)
        self.setWidget(right)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.panel = right
        self.set_font_size(app.settings.font_size)

    def set_font_size(self, pt: int) -> None:
        self.setFixedWidth(side_panel_width(pt))


class PanelLayout:
    """Shows or hides the chat list and the panel as :func:`arrange` says, for the window's
    width and the user's choice on the rail."""

    def __init__(self, chat_list: QWidget, content: QWidget, panel: SidePanel, rail: PanelRail):
        self.chat_list, self.content, self.panel, self.rail = chat_list, content, panel, rail
        self.wanted: bool | None = None  # the user's choice (None: by the width)
        rail.toggled.connect(self._toggled)

    def apply(self) -> None:
        show_list, show_panel = arrange(
            self.content.window().width(),
            self.chat_list.width(),
            self.panel.width(),
            self.rail.sizeHint().width(),
            self.content.minimumSizeHint().width(),
            Theme.font_pt,
            self.wanted,
        )
        self.chat_list.setVisible(show_list)
        self.panel.setVisible(show_panel)
        self.rail.set_shown(show_panel)

    def _toggled(self, on: bool) -> None:
        self.wanted = on
        self.apply()
