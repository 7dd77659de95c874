"""The expert map: which experts each layer used for the last reply, and which were already on the GPU.

Top: a heat grid, experts (rows) x layers (columns), shaded by how often each expert was chosen,
with a green bar for the share of tokens it stayed cached and each layer's hit rate below.
Bottom: one layer over the reply's tokens, like Figure 1 of Eliseev & Mazur (2023): green cells
were chosen and already cached (hits), orange ones were copied over PCIe (misses), faint ones
sat in the cache unused. Click a column of the heat grid to pick the layer.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QMouseEvent, QPainter, QPaintEvent, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from app.expert_trace import Cell, TraceSummary, summarize_trace

MARGIN = 10
LABEL_W = 34
ROW_H = 14
TITLE_H = 22
BAR_H = 18
HIT = QColor("#22a06b")
MISS = QColor("#e8772e")
HEAT = QColor("#e8772e")


def _mix(a: QColor, b: QColor, t: float) -> QColor:
    t = max(0.0, min(1.0, t))
    return QColor(int(a.red() + (b.red() - a.red()) * t), int(a.green() + (b.green() - a.green()) * t),
                  int(a.blue() + (b.blue() - a.blue()) * t))


class ExpertMap(QWidget):
    layer_changed = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.summary: TraceSummary | None = None
        self.layer = 0
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.setMinimumWidth(300)

    def set_trace(self, trace) -> None:
        self.summary = summarize_trace(trace)
        if self.summary:
            self.layer = min(self.layer, self.summary.num_layers - 1)
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

    def _height(self) -> int:
        grid = self._experts() * ROW_H
        return MARGIN * 2 + TITLE_H * 3 + grid * 2 + BAR_H + 12 + 60

    def _heat_rect(self) -> QRectF:
        top = MARGIN + TITLE_H * 2
        return QRectF(MARGIN + LABEL_W, top, self.width() - 2 * MARGIN - LABEL_W, self._experts() * ROW_H)

    def _tokens_rect(self) -> QRectF:
        heat = self._heat_rect()
        top = heat.bottom() + BAR_H + 8 + TITLE_H
        return QRectF(heat.left(), top, heat.width(), self._experts() * ROW_H)

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
        small = QFont(self.font())
        small.setPointSizeF(max(7.0, self.font().pointSizeF() * 0.85))
        bold = QFont(self.font())
        bold.setBold(True)

        heat = self._heat_rect()
        rate = s.hit_rate()
        p.setFont(bold)
        p.setPen(text)
        p.drawText(QRectF(MARGIN, MARGIN, self.width() - 2 * MARGIN, TITLE_H), Qt.AlignmentFlag.AlignVCenter,
                   f"Last reply: {s.num_tokens} tokens, {s.num_layers} layers, cache hits "
                   + (f"{rate:.0%}" if rate is not None else "–"))
        p.setFont(small)
        p.setPen(muted)
        p.drawText(QRectF(MARGIN, MARGIN + TITLE_H, self.width() - 2 * MARGIN, TITLE_H),
                   Qt.AlignmentFlag.AlignVCenter, "How often each expert was chosen, per layer (click a layer)")

        cw = self._col_w()
        top_count = max(1, s.max_count)
        for layer in range(s.num_layers):
            x = heat.left() + layer * cw
            for e in range(s.num_experts):
                cell = QRectF(x, heat.top() + e * ROW_H, cw, ROW_H)
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
            p.drawText(QRectF(MARGIN, heat.top() + e * ROW_H, LABEL_W - 4, ROW_H),
                       Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, f"E{e}")
        p.drawText(QRectF(MARGIN, heat.bottom() + 2, LABEL_W - 4, BAR_H),
                   Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, "hits")

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
            y = tokens.top() + e * ROW_H
            p.fillRect(QRectF(tokens.left(), y + 0.5, tokens.width(), ROW_H - 1), _mix(base, text, 0.04))
            for t in range(first, s.num_tokens):
                color = colors.get(row[t])
                if color is not None:
                    p.fillRect(QRectF(tokens.left() + (t - first) * w, y + 1, max(1.0, w - (w > 3)), ROW_H - 2),
                               color)
            p.setPen(muted)
            p.drawText(QRectF(MARGIN, y, LABEL_W - 4, ROW_H),
                       Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, f"E{e}")
        p.drawText(QRectF(tokens.left(), tokens.bottom() + 2, tokens.width(), 16), Qt.AlignmentFlag.AlignLeft,
                   f"token {first + 1}")
        p.drawText(QRectF(tokens.left(), tokens.bottom() + 2, tokens.width(), 16), Qt.AlignmentFlag.AlignRight,
                   f"token {s.num_tokens}")

        y = tokens.bottom() + 22
        x = MARGIN
        for color, label in ((HIT, "chosen, already cached"), (MISS, "chosen, copied in"),
                             (resident, "cached, not chosen")):
            p.fillRect(QRectF(x, y + 3, 12, 10), color)
            p.setPen(text)
            width = p.fontMetrics().horizontalAdvance(label)
            if x + 16 + width > self.width() - MARGIN:
                x, y = MARGIN, y + 18
                p.fillRect(QRectF(x, y + 3, 12, 10), color)
            p.drawText(QRectF(x + 16, y, width + 4, 16), Qt.AlignmentFlag.AlignVCenter, label)
            x += 16 + width + 14

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
        e = int((pos.y() - heat.top()) // ROW_H)
        s = self.summary
        if 0 <= e < s.num_experts:
            tip = (f"Layer {layer}, expert {e}: chosen for {s.counts[layer][e]} of {s.num_tokens} tokens, "
                   f"{s.hits[layer][e]} of them cache hits; cached {s.resident[layer][e]:.0%} of the time")
        else:
            rate = s.layer_hit_rate(layer)
            tip = f"Layer {layer}: cache hit rate " + (f"{rate:.0%}" if rate is not None else "–")
        QToolTip.showText(event.globalPosition().toPoint(), tip, self)
