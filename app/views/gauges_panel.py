"""Live gauges: speed, tokens per round trip, network round trip, local memory, connection,
and a small chart of tokens/s over the last minute."""

from __future__ import annotations

from PySide6.QtCore import QPointF, QRectF, Qt, QTimer
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPaintEvent, QPen
from PySide6.QtWidgets import QFrame, QGridLayout, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.core.controller import AppController
from app.core.engine_host import CONNECTED, LOCAL, OFFLINE
from app.core.gauges import GaugeState, human_bytes, process_memory_bytes
from app.views.theme import Theme, icon


class SpeedChart(QWidget):
    """Tokens/s over the last 60 seconds."""

    def __init__(self, state: GaugeState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self.setMinimumHeight(84)
        self.setAccessibleName("Chart of tokens per second over the last minute")

    def paintEvent(self, _e: QPaintEvent) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        r = QRectF(self.rect()).adjusted(1, 16, -1, -14)
        grid = QColor(Theme.color("border"))
        p.setPen(QPen(grid, 1))
        p.drawLine(r.bottomLeft(), r.bottomRight())
        p.drawLine(QPointF(r.left(), r.top()), QPointF(r.right(), r.top()))
        pts = self.state.last_minute()
        top = max([v for _, v in pts] + [1.0]) * 1.15
        p.setPen(QColor(Theme.color("muted")))
        font = p.font()
        font.setPointSizeF(max(font.pointSizeF() - 2, 6))
        p.setFont(font)
        p.drawText(QRectF(r.left(), r.bottom() + 1, r.width(), 13), "60 s ago")
        p.drawText(
            QRectF(r.left(), r.bottom() + 1, r.width(), 13), Qt.AlignmentFlag.AlignRight, "now"
        )
        if not pts:
            p.drawText(r, Qt.AlignmentFlag.AlignCenter, "No replies in the last minute")
            return
        p.drawText(
            QRectF(r.left(), r.top() - 15, r.width(), 13),
            Qt.AlignmentFlag.AlignRight,
            f"top of chart: {top:.0f} tokens/s",
        )
        path = QPainterPath()
        for i, (ago, v) in enumerate(pts):
            x = r.right() - (ago / 60.0) * r.width()
            y = r.bottom() - (v / top) * r.height()
            if i == 0:
                path.moveTo(x, y)
            else:
                path.lineTo(x, y)
        p.setPen(QPen(QColor(Theme.color("accent")), 2))
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
        ic.setPixmap(icon("gauge", "accent", 20).pixmap(20, 20))
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
        self.speed = self._cell(grid, 0, "Speed (tokens/s)")
        self.per_rt = self._cell(grid, 1, "Tokens per round trip")
        self.rtt = self._cell(grid, 2, "Network round trip")
        self.memory_name = QLabel()
        self.memory = self._cell(grid, 3, "", self.memory_name)
        lay.addLayout(grid)
        self.chart = SpeedChart(app.gauge_state)
        lay.addWidget(self.chart)
        app.gauges_changed.connect(self.refresh)
        self._timer = QTimer(self, interval=2000)
        self._timer.timeout.connect(self._tick)
        self._timer.start()
        self._tick()

    def _cell(self, grid: QGridLayout, row: int, name: str, label: QLabel | None = None) -> QLabel:
        n = label or QLabel(name)
        n.setObjectName("Muted")
        v = QLabel("-")
        v.setObjectName("GaugeValue")
        v.setAccessibleName(name)
        v.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        grid.addWidget(n, row, 0)
        grid.addWidget(v, row, 1)
        return v

    def _tick(self) -> None:
        g = self.app.gauge_state
        if not g.generating:
            g.memory_bytes, g.memory_label = process_memory_bytes(self.app.settings.device)
        self.refresh(g)

    def refresh(self, g: GaugeState | None = None) -> None:
        g = g or self.app.gauge_state
        self.speed.setText(f"{g.tokens_per_s:.1f}" if g.tokens_per_s is not None else "-")
        self.per_rt.setText(
            f"{g.tokens_per_round_trip:.2f}" if g.tokens_per_round_trip is not None else "-"
        )
        if self.app.host.state == LOCAL:
            self.rtt.setText("no network")
        else:
            self.rtt.setText(f"{g.rtt_ms:.1f} ms" if g.rtt_ms is not None else "-")
        self.memory_name.setText(g.memory_label[:1].upper() + g.memory_label[1:])
        self.memory.setAccessibleName(g.memory_label)
        self.memory.setText(human_bytes(g.memory_bytes) if g.memory_bytes else "-")
        state = self.app.host.state
        color = {CONNECTED: "ok", LOCAL: "ok", OFFLINE: "bad"}.get(state, "warn")
        dot = f'<span style="color:{Theme.color(color)}; font-size:14pt">●</span>'
        text = self.app.connection_text()
        if g.generating:
            text += " · writing"
        self.connection.setText(f"{dot} {text}")
        self.connection.setAccessibleDescription(text)
        self.chart.update()
