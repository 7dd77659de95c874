"""The expert map: which experts each layer used for the last reply, and which were already on the GPU.

Top: a heat grid, experts (rows) x layers (columns), shaded indigo by how often each expert was chosen,
with a green bar for the share of tokens it stayed cached and each layer's hit rate below.
Bottom: one layer over the reply's tokens, like Figure 1 of Eliseev & Mazur (2023): green cells
were chosen and already cached (hits), orange ones were copied over PCIe (misses), faint ones
sat in the cache unused. Click a column of the heat grid to pick the layer.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontMetrics, QMouseEvent, QPainter, QPaintEvent, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from moeferry.app.expert_trace import Cell, TraceSummary, summarize_trace

MARGIN = 10
LABEL_W = 34
ROW_H = 14       # the smallest row; rows grow with the widget's height up to MAX_ROW_H
MAX_ROW_H = 22
TITLE_H = 22
BAR_H = 18
TICKS_H = 14
LEGEND_H = 60
HIT = QColor("#22a06b")
MISS = QColor("#e8772e")
HEAT = QColor("#4a5fd0")  # indigo: orange means only "copied in" (a miss), green only "cached" (a hit)


def _mix(a: QColor, b: QColor, t: float) -> QColor:
    t = max(0.0, min(1.0, t))
    return QColor(int(a.red() + (b.red() - a.red()) * t), int(a.green() + (b.green() - a.green()) * t),
                  int(a.blue() + (b.blue() - a.blue()) * t))


class ExpertMap(QWidget):
    layer_changed = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.summary: TraceSummary | None = None
        self.previous: tuple[float | None, str] | None = None  # hit rate and setup of the reply before
        self.setup = ""
        self.layer = 0
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.setMinimumWidth(300)

    def set_trace(self, trace, setup: str = "") -> None:
        """Show `trace`; `setup` names the settings it ran with (e.g. "3 cached per layer, prefetch 1")."""
        if self.summary is not None:
            self.previous = (self.summary.hit_rate(), self.setup)
        self.summary = summarize_trace(trace)
        self.setup = setup
        if self.summary:
            self.layer = min(self.layer, self.summary.num_layers - 1)
        self.setMinimumHeight(self._height())
        self.updateGeometry()
        self.update()

    def set_layer(self, layer: int) -> None:
        if self.summary and 0 <= layer < self.summary.num_layers and layer != self.layer:
            self.layer = layer
            self.layer_changed.emit(layer)
            self.update()

    # Geometry
    def _experts(self) -> int:
        return self.summary.num_experts if self.summary else 8

    def sizeHint(self) -> QSize:
        return QSize(380, self._height())

    def minimumSizeHint(self) -> QSize:
        return QSize(300, self._height())

    def _fonts(self) -> tuple[QFont, QFont]:
        small = QFont(self.font())
        small.setPointSizeF(max(7.0, self.font().pointSizeF() * 0.85))
        bold = QFont(self.font())
        bold.setBold(True)
        return small, bold

    def _header(self) -> list[tuple[QFont, bool, str, int]]:
        """The wrapped lines above the heat grid: (font, muted, text, height in px)."""
        s = self.summary
        if s is None:
            return []
        small, bold = self._fonts()
        pct = lambda r: f"{r:.0%}" if r is not None else "–"  # noqa: E731
        lines = [(bold, False, f"Last reply: {s.num_tokens} tokens, cache hits {pct(s.hit_rate())}")]
        setup = f"Ran with {self.setup}." if self.setup else ""
        if self.previous is not None:
            prev_rate, prev_setup = self.previous
            setup += f" The reply before: {pct(prev_rate)}" + (f" with {prev_setup}." if prev_setup else ".")
        if setup:
            lines.append((small, True, setup.strip()))
        lines.append((small, True, "Experts x layers: deeper blue = chosen more often, green line = share of "
                                   "the reply it stayed cached, bars = hit rate per layer. Click a layer."))
        width = max(100, self.width() - 2 * MARGIN)
        out = []
        for font, muted, text in lines:
            rect = QFontMetrics(font).boundingRect(0, 0, width, 1000, Qt.TextFlag.TextWordWrap, text)
            out.append((font, muted, text, rect.height() + 4))
        return out

    def _header_height(self) -> int:
        return sum(h for *_, h in self._header()) if self.summary else TITLE_H * 3

    def _fixed_height(self) -> int:
        return MARGIN * 2 + self._header_height() + TITLE_H + BAR_H + TICKS_H + 8 + LEGEND_H

    def _height(self) -> int:
        return int(self._fixed_height() + 2 * self._experts() * ROW_H)

    def _row_h(self) -> float:
        room = (self.height() - self._fixed_height()) / (2 * self._experts())
        return max(ROW_H, min(MAX_ROW_H, room))

    def _heat_rect(self) -> QRectF:
        top = MARGIN + self._header_height() + 4
        return QRectF(MARGIN + LABEL_W, top, self.width() - 2 * MARGIN - LABEL_W, self._experts() * self._row_h())

    def _tokens_rect(self) -> QRectF:
        heat = self._heat_rect()
        top = heat.bottom() + BAR_H + TICKS_H + 8 + TITLE_H
        return QRectF(heat.left(), top, heat.width(), self._experts() * self._row_h())

    def _col_w(self) -> float:
        return self._heat_rect().width() / self.summary.num_layers

    def _token_window(self) -> tuple[int, float]:
        """First token shown and cell width: the last tokens that fit at 2 px or more each."""
        rect, n = self._tokens_rect(), self.summary.num_tokens
        width = min(10.0, rect.width() / n)
        if width >= 2:
            return 0, width
        return n - int(rect.width() // 2), 2.0

    # Painting
    def paintEvent(self, _event: QPaintEvent) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing, False)
        pal = self.palette()
        text = pal.color(QPalette.ColorRole.WindowText)
        muted = pal.color(QPalette.ColorRole.PlaceholderText)
        base = pal.color(QPalette.ColorRole.Base)
        p.fillRect(self.rect(), pal.color(QPalette.ColorRole.Window))
        if self.summary is None:
            p.setPen(muted)
            p.drawText(self.rect().adjusted(MARGIN, MARGIN, -MARGIN, -MARGIN),
                       Qt.AlignmentFlag.AlignCenter | Qt.TextFlag.TextWordWrap,
                       "Send a message: the experts each layer used for the reply will appear here.")
            return
        s = self.summary
        small, bold = self._fonts()
        heat = self._heat_rect()
        y = MARGIN
        for font, is_muted, line, height in self._header():
            p.setFont(font)
            p.setPen(muted if is_muted else text)
            p.drawText(QRectF(MARGIN, y, self.width() - 2 * MARGIN, height),
                       Qt.TextFlag.TextWordWrap | Qt.AlignmentFlag.AlignTop, line)
            y += height
        p.setFont(small)

        cw = self._col_w()
        rh = self._row_h()
        top_count = max(1, s.max_count)
        for layer in range(s.num_layers):
            x = heat.left() + layer * cw
            for e in range(s.num_experts):
                cell = QRectF(x, heat.top() + e * rh, cw, rh)
                p.fillRect(cell.adjusted(0.5, 0.5, -0.5, -0.5), _mix(base, HEAT, s.counts[layer][e] / top_count))
                share = s.resident[layer][e]
                if share > 0:
                    p.fillRect(QRectF(cell.left() + 1, cell.bottom() - 3, (cell.width() - 2) * share, 2.5), HIT)
            lr = s.layer_hit_rate(layer) or 0.0
            bar = QRectF(x + 1, heat.bottom() + 4, cw - 2, BAR_H - 6)
            p.fillRect(bar, pal.color(QPalette.ColorRole.Mid))
            p.fillRect(QRectF(bar.left(), bar.bottom() - bar.height() * lr, bar.width(), bar.height() * lr), HIT)
        p.setPen(QPen(pal.color(QPalette.ColorRole.Highlight), 2))
        p.drawRect(QRectF(heat.left() + self.layer * cw, heat.top() - 1, cw, heat.height() + BAR_H + 2))
        p.setPen(muted)
        for e in range(s.num_experts):
            p.drawText(QRectF(MARGIN, heat.top() + e * rh, LABEL_W - 4, rh),
                       Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, f"E{e}")
        p.drawText(QRectF(MARGIN, heat.bottom() + 2, LABEL_W - 4, BAR_H),
                   Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, "hits")
        step = max(1, round(s.num_layers / 8))
        ticks = sorted(set(range(0, s.num_layers, step)) | {s.num_layers - 1})
        for layer in ticks:
            p.drawText(QRectF(heat.left() + layer * cw - 10, heat.bottom() + BAR_H + 1, cw + 20, TICKS_H),
                       Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop, str(layer))
        p.drawText(QRectF(MARGIN, heat.bottom() + BAR_H + 1, LABEL_W - 4, TICKS_H),
                   Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignTop, "layer")

        tokens = self._tokens_rect()
        lr = s.layer_hit_rate(self.layer)
        p.setFont(bold)
        p.setPen(text)
        p.drawText(QRectF(MARGIN, tokens.top() - TITLE_H, self.width() - 2 * MARGIN, TITLE_H),
                   Qt.AlignmentFlag.AlignVCenter,
                   f"Layer {self.layer} over the reply's tokens: hits " + (f"{lr:.0%}" if lr is not None else "–"))
        p.setFont(small)
        first, w = self._token_window()
        resident = _mix(base, HIT, 0.25)
        colors = {Cell.HIT: HIT, Cell.MISS: MISS, Cell.RESIDENT: resident}
        for e in range(s.num_experts):
            row = s.cells[self.layer][e]
            y = tokens.top() + e * rh
            p.fillRect(QRectF(tokens.left(), y + 0.5, tokens.width(), rh - 1), _mix(base, text, 0.04))
            for t in range(first, s.num_tokens):
                color = colors.get(row[t])
                if color is not None:
                    p.fillRect(QRectF(tokens.left() + (t - first) * w, y + 1, max(1.0, w - (w > 3)), rh - 2),
                               color)
            p.setPen(muted)
            p.drawText(QRectF(MARGIN, y, LABEL_W - 4, rh),
                       Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, f"E{e}")
        p.drawText(QRectF(tokens.left(), tokens.bottom() + 2, tokens.width(), 16), Qt.AlignmentFlag.AlignLeft,
                   f"token {first + 1}")
        p.drawText(QRectF(tokens.left(), tokens.bottom() + 2, tokens.width(), 16), Qt.AlignmentFlag.AlignRight,
                   f"token {s.num_tokens}")

        y = tokens.bottom() + 22
        x = MARGIN
        for color, label in ((HIT, "chosen, already cached"), (MISS, "chosen, copied in"),
                             (resident, "cached, not chosen")):
            width = p.fontMetrics().horizontalAdvance(label)
            if x > MARGIN and x + 16 + width > self.width() - MARGIN:  # wrap before drawing the swatch
                x, y = MARGIN, y + 18
            p.fillRect(QRectF(x, y + 3, 12, 10), color)
            p.setPen(text)
            p.drawText(QRectF(x + 16, y, width + 4, 16), Qt.AlignmentFlag.AlignVCenter, label)
            x += 16 + width + 14

    def resizeEvent(self, event) -> None:
        self.setMinimumHeight(self._height())  # the wrapped header grows as the widget narrows
        super().resizeEvent(event)

    # Mouse
    def _layer_at(self, pos) -> int | None:
        heat = self._heat_rect()
        if self.summary and heat.left() <= pos.x() < heat.right() and heat.top() <= pos.y() < heat.bottom() + BAR_H:
            return int((pos.x() - heat.left()) // self._col_w())
        return None

    def mousePressEvent(self, event: QMouseEvent) -> None:
        layer = self._layer_at(event.position())
        if layer is not None:
            self.set_layer(layer)

    def mouseMoveEvent(self, event: QMouseEvent) -> None:
        pos = event.position()
        layer = self._layer_at(pos)
        if layer is None or self.summary is None:
            QToolTip.hideText()
            return
        heat = self._heat_rect()
        e = int((pos.y() - heat.top()) // self._row_h())
        s = self.summary
        if 0 <= e < s.num_experts:
            tip = (f"Layer {layer}, expert {e}: chosen for {s.counts[layer][e]} of {s.num_tokens} tokens, "
                   f"{s.hits[layer][e]} of them cache hits; cached {s.resident[layer][e]:.0%} of the time")
        else:
            rate = s.layer_hit_rate(layer)
            tip = f"Layer {layer}: cache hit rate " + (f"{rate:.0%}" if rate is not None else "–")
        QToolTip.showText(event.globalPosition().toPoint(), tip, self)
