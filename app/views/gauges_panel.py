"""Live performance: speed, tokens per round trip, network round trip, this app's memory,
connection, and a small chart of tokens/s over the last minute. Only what applies is shown:
with the whole model on this computer there is no server, so no round trips and no network."""

from __future__ import annotations

import html

from PySide6.QtCore import QPointF, QRectF, Qt, QTimer
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPaintEvent, QPen
from PySide6.QtWidgets import QFrame, QGridLayout, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.core.controller import AppController
from app.core.engine_host import CONNECTED, LOCAL, NEEDS_SETUP, OFFLINE
from app.core.gauges import MEMORY_NOTE, MEMORY_NOTES, GaugeState, human_bytes, process_memory_bytes
from app.core.trunk_sources import RESTARTING
from app.views.theme import Theme, set_icon


class SpeedChart(QWidget):
    """Tokens/s over the last 60 seconds: one line per reply, nothing across idle gaps."""

    def __init__(self, state: GaugeState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.setMinimumHeight(84)
        self.setAccessibleName("Chart of tokens per second over the last minute")

    def paintEvent(self, _e: QPaintEvent) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        font = p.font()
        font.setPointSizeF(max(font.pointSizeF() - 2, 6))
        p.setFont(font)
        line_h = p.fontMetrics().height() + 1
        r = QRectF(self.rect()).adjusted(1, line_h + 2, -1, -line_h)
        grid = QColor(Theme.color("border"))
        p.setPen(QPen(grid, 1))
        p.drawLine(r.bottomLeft(), r.bottomRight())
        p.drawLine(QPointF(r.left(), r.top()), QPointF(r.right(), r.top()))
        runs = self.state.last_minute_runs()
        top = max([v for run in runs for _, v in run] + [1.0]) * 1.15
        p.setPen(QColor(Theme.color("muted")))
        below = QRectF(r.left(), r.bottom() + 1, r.width(), line_h)
        p.drawText(below, "60 s ago")
        p.drawText(below, Qt.AlignmentFlag.AlignRight, "now")
        if not runs:
            p.drawText(
                r,
                Qt.AlignmentFlag.AlignCenter | Qt.TextFlag.TextWordWrap,
                "No replies in the last minute",
            )
            return
        p.drawText(
            QRectF(r.left(), r.top() - line_h - 1, r.width(), line_h),
            Qt.AlignmentFlag.AlignRight,
            f"top of chart: {top:.0f} tokens/s",
        )
        accent = QColor(Theme.color("accent"))
        for run in runs:
            pts = [
                QPointF(r.right() - (ago / 60.0) * r.width(), r.bottom() - (v / top) * r.height())
                for ago, v in run
            ]
            if len(pts) == 1:  # a single measurement: a dot, not a line to anywhere
                p.setPen(Qt.PenStyle.NoPen)
                p.setBrush(accent)
                p.drawEllipse(pts[0], 2.5, 2.5)
                continue
            path = QPainterPath(pts[0])
            for pt in pts[1:]:
                path.lineTo(pt)
            p.setBrush(Qt.BrushStyle.NoBrush)
            p.setPen(QPen(accent, 2))
            p.drawPath(path)


class GaugesPanel(QFrame):
    def __init__(self, app: AppController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.app = app
        self.setObjectName("Card")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 14, 16, 14)
        lay.setSpacing(8)
        head = QHBoxLayout()
        ic = QLabel()
        set_icon(ic, "gauge", "accent", 20)
        head.addWidget(ic)
        title = QLabel("Live performance")
        title.setObjectName("CardTitle")
        head.addWidget(title, 1)
        lay.addLayout(head)

        self.connection = QLabel()
        self.connection.setWordWrap(True)
        self.connection.setAccessibleName("Connection state")
        lay.addWidget(self.connection)
        grid = QGridLayout()
        grid.setHorizontalSpacing(10)
        grid.setVerticalSpacing(8)
        grid.setColumnStretch(0, 1)
        self.speed_name, self.speed = self._cell(grid, 0, "Speed (tokens/s)")
        self.per_rt_name, self.per_rt = self._cell(grid, 1, "Tokens per round trip")
        self.per_rt_name.setToolTip(
            "How many word pieces (tokens) each exchange with the server produced (more is faster)"
        )
        self.rtt_name, self.rtt = self._cell(grid, 2, "Network round trip")
        self.memory_name, self.memory = self._cell(grid, 3, "")
        lay.addLayout(grid)
        self.memory_note = QLabel(MEMORY_NOTE)
        self.memory_note.setObjectName("Small")
        self.memory_note.setWordWrap(True)
        lay.addWidget(self.memory_note)
        self.chart = SpeedChart(app.gauge_state)
        lay.addWidget(self.chart)
        app.gauges_changed.connect(self.refresh)
        self._timer = QTimer(self, interval=2000)
        self._timer.timeout.connect(self._tick)
        self._timer.start()
        self._tick()

    def _cell(self, grid: QGridLayout, row: int, name: str) -> tuple[QLabel, QLabel]:
        n = QLabel(name)
        n.setObjectName("Muted")
        n.setWordWrap(True)
        v = QLabel("-")
        v.setObjectName("GaugeValue")
        v.setAccessibleName(name)
        v.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        grid.addWidget(n, row, 0)
        grid.addWidget(v, row, 1)
        return n, v

    def _tick(self) -> None:
        g = self.app.gauge_state
        if not g.generating:
            g.memory_bytes, g.memory_label = process_memory_bytes(
                self.app.settings.device, self.app.host.helper_pids()
            )
        self.refresh(g)

    def refresh(self, g: GaugeState | None = None) -> None:
        g = g or self.app.gauge_state
        local = self.app.runs_fully_local()
        self.speed.setText(f"{g.tokens_per_s:.1f}" if g.tokens_per_s is not None else "-")
        for w in (self.per_rt_name, self.per_rt, self.rtt_name, self.rtt):
            w.setVisible(not local)  # no server: no round trips and no network
        self.per_rt.setText(
            f"{g.tokens_per_round_trip:.2f}" if g.tokens_per_round_trip is not None else "-"
        )
        self.rtt.setText(f"{g.rtt_ms:.1f} ms" if g.rtt_ms is not None and not local else "-")
        self.memory_name.setText(g.memory_label)
        self.memory_note.setText(MEMORY_NOTES.get(g.memory_label, MEMORY_NOTE))
        self.memory.setAccessibleName(g.memory_label)
        self.memory.setText(human_bytes(g.memory_bytes) if g.memory_bytes else "-")
        state = self.app.host.state
        color = {CONNECTED: "ok", LOCAL: "ok", OFFLINE: "bad", NEEDS_SETUP: "bad"}.get(
            state, "warn"
        )
        if self.app.host.server_notice() == RESTARTING:
            color = "warn"
        dot = f'<span style="color:{Theme.color(color)}">●</span>'
        text = self.app.connection_text()
        if g.generating:
            text += " · writing"
        self.connection.setText(f"{dot} {html.escape(text)}")  # rich text: the dot only
        self.connection.setAccessibleDescription(text)
        self.chart.update()
