"""Render resources/icons/veil.svg to the PNG sizes the installers need.

Usage: python installer/render_icons.py   (run again after editing the SVG; the PNG, ICO and
ICNS files are committed so a build needs no SVG renderer). Needs PySide6 (QtSvg) and Pillow.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SIZES = (16, 32, 48, 64, 128, 256, 512)
ICONS = Path(__file__).resolve().parent.parent / "resources" / "icons"


def render(svg: Path = ICONS / "veil.svg", out: Path = ICONS) -> list[Path]:
    """Write veil-<size>.png for every size in SIZES and return their paths."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    _app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"render_icons: cannot parse {svg}")
    written = []
    for size in SIZES:
        img = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
        img.fill(Qt.GlobalColor.transparent)
        painter = QPainter(img)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
        renderer.render(painter)
        painter.end()
        path = out / f"veil-{size}.png"
        if not img.save(str(path)):
            raise SystemExit(f"render_icons: cannot write {path}")
        written.append(path)
    written += _platform_icons(out)
    return written


def _platform_icons(out: Path) -> list[Path]:
    """veil.ico (Windows, 16-256 px) and veil.icns (macOS, 16-512 px) from the PNG renders."""
    from PIL import Image

    big = Image.open(out / "veil-512.png").convert("RGBA")
    ico, icns = out / "veil.ico", out / "veil.icns"
    big.save(ico, format="ICO", sizes=[(s, s) for s in SIZES if s <= 256])
    big.save(icns, format="ICNS")
    return [ico, icns]


if __name__ == "__main__":
    for p in render():
        print(p)
