"""Code blocks of a rendered reply: shaded, syntax-highlighted, each with a "Copy code" link.

Qt's Markdown reader marks every line of a fenced or indented code block with the
BlockCodeLanguage property (the fence's language, "" for indented code). Consecutive such
blocks form one code block; it gets the code background, its text is colored by Pygments'
tokens for that language (none when the language is unknown), and a header line above it
holds the language and a link `moeferry:copycode/<key>` whose key maps to the code's text.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtGui import (
    QColor,
    QFont,
    QTextBlock,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
)

CODE_LANGUAGE = QTextFormat.Property.BlockCodeLanguage


@dataclass
class CodeBlock:
    first: QTextBlock
    last: QTextBlock
    language: str

    def text(self) -> str:
        lines, block = [], self.first
        while True:
            lines.append(block.text())
            if block == self.last:
                return "\n".join(lines)
            block = block.next()


def find_code_blocks(doc: QTextDocument, start: int, end: int) -> list[CodeBlock]:
    found: list[CodeBlock] = []
    block = doc.findBlock(start)
    while block.isValid() and block.position() <= end:
        fmt = block.blockFormat()
        if fmt.hasProperty(CODE_LANGUAGE):
            if found and found[-1].last.next() == block:
                found[-1].last = block
            else:
                found.append(CodeBlock(block, block, str(fmt.property(CODE_LANGUAGE) or "")))
        block = block.next()
    return found


def highlight_spans(code: str, language: str) -> list[tuple[int, int, str]]:
    """(offset, length, color name of moeferry.app.theme.colors) of the tokens worth coloring; [] for an
    unknown language."""
    try:
        from pygments import lex
        from pygments.lexers import get_lexer_by_name
        from pygments.token import Comment, Keyword, Name, Number, String
        from pygments.util import ClassNotFound
    except ImportError:
        return []
    try:
        lexer = get_lexer_by_name(language, stripnl=False, ensurenl=False) if language else None
    except ClassNotFound:
        lexer = None
    if lexer is None:
        return []
    kinds = [(Comment, "comment"), (Keyword, "keyword"), (String, "string"), (Number, "number"),
             (Name.Builtin, "name"), (Name.Function, "name"), (Name.Class, "name"), (Name.Decorator, "name")]
    spans, offset = [], 0
    for token, value in lex(code, lexer):
        color = next((name for kind, name in kinds if token in kind), None)
        if color is not None and value.strip():
            spans.append((offset, len(value), color))
        offset += len(value)
    return spans


def style_code_block(doc: QTextDocument, code: CodeBlock, key: str, palette: dict[str, str], font: QFont) -> str:
    """Shade and highlight `code`, put its header above it; returns the code's text."""
    text = code.text()
    background = QColor(palette["code_bg"])
    mono = QFont(font)
    mono.setFamilies(["monospace"])
    mono.setStyleHint(QFont.StyleHint.Monospace)
    start = code.first.position()
    block = code.first
    while True:
        fmt = block.blockFormat()
        fmt.setBackground(background)
        fmt.setLeftMargin(8)
        fmt.setRightMargin(8)
        fmt.setTopMargin(0)
        fmt.setBottomMargin(0)
        fmt.setNonBreakableLines(True)
        QTextCursor(block).setBlockFormat(fmt)
        if block == code.last:
            break
        block = block.next()
    end = code.last.position() + code.last.length() - 1
    cursor = QTextCursor(doc)
    cursor.setPosition(start)
    cursor.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
    plain = QTextCharFormat()
    plain.setFont(mono)
    cursor.mergeCharFormat(plain)
    for offset, length, color in highlight_spans(text, code.language):
        cursor.setPosition(start + offset)
        cursor.setPosition(start + offset + length, QTextCursor.MoveMode.KeepAnchor)
        fmt = QTextCharFormat()
        fmt.setForeground(QColor(palette[color]))
        cursor.mergeCharFormat(fmt)
    _insert_header(doc, start, code.language, key, palette, background)
    return text


def _insert_header(doc: QTextDocument, position: int, language: str, key: str, palette: dict[str, str],
                   background: QColor) -> None:
    cursor = QTextCursor(doc)
    cursor.setPosition(position)
    first_fmt = cursor.blockFormat()
    cursor.insertBlock(first_fmt, cursor.charFormat())  # the code moves down one block
    cursor.setPosition(position)
    header = QTextBlockFormat()
    header.setBackground(background)
    header.setLeftMargin(8)
    header.setRightMargin(8)
    header.setTopMargin(6)
    cursor.setBlockFormat(header)
    cursor.setBlockCharFormat(QTextCharFormat())
    label = f"<span style='color:{palette['comment']}'>{language or 'code'}</span>&nbsp;&nbsp;&nbsp;"
    cursor.insertHtml(f"<small>{label}<a href='moeferry:copycode/{key}' style='color:{palette['you']}'>"
                      "Copy code</a></small>")
