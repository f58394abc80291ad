"""Themes (light/dark/system), the stylesheet and tinted SVG icons from ``resources/``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from PySide6.QtCore import QByteArray, QObject, QSize, Qt, QTimer
from PySide6.QtGui import QAction, QColor, QGuiApplication, QIcon, QPainter, QPalette, QPixmap
from PySide6.QtSvg import QSvgRenderer
from PySide6.QtWidgets import QAbstractButton, QApplication, QLabel


def resources_dir() -> Path:
    base = Path(getattr(sys, "_MEIPASS", Path(__file__).resolve().parents[2]))
    return base / "resources"


@lru_cache(maxsize=4)
def colors(theme: str) -> dict[str, str]:
    out: dict[str, str] = {}
    path = resources_dir() / "styles" / f"{theme}.colors"
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def resolve_theme(theme: str) -> str:
    """'system' becomes light or dark from the OS colour scheme."""
    if theme in ("light", "dark"):
        return theme
    hints = QGuiApplication.styleHints()
    scheme = hints.colorScheme() if hints is not None else Qt.ColorScheme.Unknown
    return "dark" if scheme == Qt.ColorScheme.Dark else "light"


class Theme:
    """The active theme; widgets ask it for colours and icons."""

    name = "light"
    font_pt = 10

    @classmethod
    def color(cls, key: str) -> str:
        return colors(cls.name)[key]

    @classmethod
    def apply(cls, app: QApplication, theme: str, font_pt: int) -> None:
        cls.name = resolve_theme(theme)
        cls.font_pt = font_pt
        c = colors(cls.name)
        template = (resources_dir() / "styles" / "base.qss").read_text(encoding="utf-8")
        sizes = {
            "font": font_pt,
            "font_s": max(font_pt - 1, 6),
            "font_l": font_pt + 3,
            "font_xl": font_pt + 6,
            "font_doc": font_pt + 1,
            "font_m": font_pt + 1,
        }
        chevron = tinted_file("chevron-down", c["muted"])
        chevron_up = tinted_file("chevron-up", c["muted"])
        app.setStyle("Fusion")
        pal = QPalette()
        for role, key in (
            (QPalette.ColorRole.Window, "window"),
            (QPalette.ColorRole.Base, "input"),
            (QPalette.ColorRole.AlternateBase, "sidebar"),
            (QPalette.ColorRole.Button, "surface"),
            (QPalette.ColorRole.Text, "text"),
            (QPalette.ColorRole.WindowText, "text"),
            (QPalette.ColorRole.ButtonText, "text"),
            (QPalette.ColorRole.ToolTipBase, "surface"),
            (QPalette.ColorRole.ToolTipText, "text"),
            (QPalette.ColorRole.PlaceholderText, "muted"),
            (QPalette.ColorRole.Highlight, "selection"),
            (QPalette.ColorRole.HighlightedText, "text"),
            (QPalette.ColorRole.Link, "accent"),
        ):
            pal.setColor(role, QColor(c[key]))
        app.setPalette(pal)
        font = app.font()
        font.setPointSize(font_pt)
        app.setFont(font)
        app.setStyleSheet(template.format(**c, **sizes, chevron=chevron, chevron_up=chevron_up))
        icon.cache_clear()
        retint_all(app)


def tinted_file(name: str, color: str) -> str:
    """Path of a copy of icon NAME drawn in ``color`` (stylesheets need files)."""
    import tempfile

    folder = Path(tempfile.gettempdir()) / "veil-icons"
    folder.mkdir(exist_ok=True)
    out = folder / f"{name}-{color.lstrip('#')}.svg"
    if not out.is_file():
        svg = (resources_dir() / "icons" / f"{name}.svg").read_text(encoding="utf-8")
        out.write_text(svg.replace("currentColor", color), encoding="utf-8")
    return out.as_posix()


@lru_cache(maxsize=256)
def icon(name: str, color_key: str = "text", size: int = 20) -> QIcon:
    """An icon from resources/icons/NAME.svg drawn in the theme colour ``color_key``."""
    path = resources_dir() / "icons" / f"{name}.svg"
    if not path.is_file():
        return QIcon()
    svg = path.read_text(encoding="utf-8").replace("currentColor", Theme.color(color_key))
    renderer = QSvgRenderer(QByteArray(svg.encode()))
    out = QIcon()
    for scale in (1, 2):
        pm = QPixmap(QSize(size * scale, size * scale))
        pm.fill(Qt.GlobalColor.transparent)
        p = QPainter(pm)
        renderer.render(p)
        p.end()
        pm.setDevicePixelRatio(scale)
        out.addPixmap(pm)
    return out


def later(ms: int, widget: QObject, fn: Callable[[], object]) -> None:
    """Run ``fn`` in ``ms`` milliseconds unless ``widget`` is gone by then (a "Copied" label
    whose message was closed must not be touched)."""
    import shiboken6

    def run() -> None:
        if shiboken6.isValid(widget):
            fn()

    QTimer.singleShot(ms, run)


ICON_PROPERTY = "veilIcon"


def set_icon(target: QObject, name: str, color_key: str = "text", size: int = 20) -> None:
    """Give a button, action or label the theme-tinted icon NAME and remember it, so that
    :meth:`Theme.apply` draws it again in the new theme's colours (an icon drawn once would keep
    the old theme's colour and vanish against the new background)."""
    target.setProperty(ICON_PROPERTY, f"{name}|{color_key}|{size}")
    _draw_icon(target)


def _icon_spec(target: QObject) -> str:
    """The icon remembered on ``target`` ("" when none). Asks ``dynamicPropertyNames`` first:
    PySide6 6.12's ``property()`` drops a reference to None for a missing property, and
    enough of those crash the interpreter ("deallocating None")."""
    if ICON_PROPERTY.encode() not in [bytes(n.data()) for n in target.dynamicPropertyNames()]:
        return ""
    return str(target.property(ICON_PROPERTY) or "")


def _draw_icon(target: QObject) -> None:
    spec = _icon_spec(target)
    if not spec:
        return
    name, key, size_s = str(spec).split("|")
    size = int(size_s)
    ic = icon(name, key, size)
    if isinstance(target, QLabel):
        target.setPixmap(ic.pixmap(size, size))
    elif isinstance(target, QAbstractButton | QAction):
        target.setIcon(ic)


def retint_all(app: QApplication) -> None:
    """Redraw every icon set with :func:`set_icon` in the current theme."""
    for w in app.allWidgets():
        _draw_icon(w)
        for a in w.actions():
            _draw_icon(a)


def app_icon() -> QIcon:
    """The Veil app icon (drawn by the installer; resources/icons/veil.svg)."""
    folder = resources_dir() / "icons"
    ic = QIcon()
    for size in (16, 32, 48, 64, 128, 256):
        png = folder / f"veil-{size}.png"
        if png.is_file():
            ic.addFile(str(png), QSize(size, size))
    if ic.isNull() and (folder / "veil.svg").is_file():
        ic = QIcon(str(folder / "veil.svg"))
    if ic.isNull():
        ic = icon("shield", "accent", 64)
    return ic
