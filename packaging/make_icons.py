"""Render resources/icons/moeferry.svg into the raster icons the installers need.

    python packaging/make_icons.py OUT_DIR

writes OUT_DIR/moeferry.ico (16..256 px, PNG-compressed entries, Windows Vista and later) and
OUT_DIR/moeferry-<N>.png for N in SIZES. It uses only PySide6 (already in the build venv), so
the build needs no image library. The spec calls render_icons() itself; the script form is for
looking at the result.
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

SIZES = (16, 24, 32, 48, 64, 128, 256)
SVG = Path(__file__).resolve().parents[1] / "resources" / "icons" / "moeferry.svg"


def _png_bytes(svg: Path, size: int) -> bytes:
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"make_icons: {svg} is not a valid SVG file.")
    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter)
    painter.end()
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    buffer.close()
    return bytes(data.data())


def ico_bytes(pngs: dict[int, bytes]) -> bytes:
    """An .ico container holding one PNG per size (the format Windows reads since Vista)."""
    sizes = sorted(pngs)
    header = struct.pack("<HHH", 0, 1, len(sizes))  # reserved, type 1 = icon, count
    offset = len(header) + 16 * len(sizes)
    entries, blobs = b"", b""
    for size in sizes:
        png = pngs[size]
        dim = 0 if size >= 256 else size  # 0 means 256 in an ICONDIRENTRY
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(png), offset)
        blobs += png
        offset += len(png)
    return header + entries + blobs


def render_icons(out_dir: str | os.PathLike, svg: Path = SVG) -> Path:
    """Write moeferry.ico and moeferry-<N>.png into out_dir; returns the .ico's path."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QGuiApplication

    _app = QGuiApplication.instance() or QGuiApplication([])  # noqa: F841 - painting wants one
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = {size: _png_bytes(svg, size) for size in SIZES}
    for size, png in pngs.items():
        (out / f"moeferry-{size}.png").write_bytes(png)
    ico = out / "moeferry.ico"
    ico.write_bytes(ico_bytes(pngs))
    return ico


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python packaging/make_icons.py OUT_DIR")
    print(render_icons(sys.argv[1]))
