"""Turn the Python 3.11 documentation (Debian package python3.11-doc) into the demo corpus.

The package ships the reStructuredText sources of every page as
/usr/share/doc/python3.11/html/_sources/**/*.rst.txt. This script converts them to plain
text (Markdown-ish: headings with '#', code in backticks and indented blocks), cuts every
page into sections, holds out about 5% of the sections (chosen by a hash of their name, so
the split never changes), and builds chat samples from the same text:
section title -> section text, API entry (function, class, ...) -> its description,
glossary term -> its definition, FAQ question -> its answer.

Usage (see docs/DEMO.md):
    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb pydoc
    python training/build_corpus.py pydoc/usr/share/doc/python3.11/html/_sources OUT_DIR

OUT_DIR receives train.jsonl and heldout.jsonl; each line is a JSON object, either
{"kind": "text", "text": ...} or {"kind": "chat", "messages": [...]}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

HELDOUT_PERCENT = 5
HEADING_CHARS = set("=-~^*#\"'+`:.")

# Directives whose whole block is dropped.
SKIP = {
    "index", "toctree", "highlight", "sectionauthor", "moduleauthor", "include", "literalinclude",
    "tabularcolumns", "testsetup", "testcleanup", "only", "image", "contents", "audit-event",
    "raw", "productionlist", "list-table", "program", "currentmodule", "module", "rubric",
    "csv-table", "table", "figure", "auditevent", "c:namespace", "c:namespace-push",
    "c:namespace-pop", "default-role", "role", "sidebar", "maxdepth", "availability",
}
# Directives whose body is code.
CODE = {"code-block", "doctest", "testcode", "testoutput", "parsed-literal", "code", "sourcecode"}
# Admonitions: the body becomes a paragraph with this prefix.
ADMONITION = {
    "note": "Note:", "warning": "Warning:", "seealso": "See also:", "important": "Important:",
    "caution": "Caution:", "impl-detail": "CPython implementation detail:", "hint": "Hint:",
    "tip": "Tip:", "attention": "Attention:", "danger": "Danger:", "topic": "", "admonition": "",
}
VERSIONED = {
    "versionadded": "New in version {}.", "versionchanged": "Changed in version {}:",
    "deprecated": "Deprecated since version {}:",
    "deprecated-removed": "Deprecated since version {}, will be removed in version {}:",
}
# Roles rendered as inline code (`x`); any other role keeps its text plain.
CODE_ROLES = {
    "func", "meth", "class", "mod", "attr", "data", "exc", "const", "obj", "keyword", "envvar",
    "option", "program", "file", "samp", "c:func", "c:type", "c:macro", "c:data", "c:member",
    "c:var", "c:expr", "c:struct", "opcode", "makevar", "token", "source", "kbd", "command",
}
DIRECTIVE = re.compile(r"^\.\.\s+([\w:-]+)::\s*(.*)$")
ROLE = re.compile(r":((?:[\w-]+:)?[\w-]+):`([^`]+?)`", re.S)
BULLET = re.compile(r"^([*+-]|#\.|\d+\.|\(\d+\))\s")


@dataclass
class Section:
    page: str  # path of the page, e.g. library/json
    title: str  # plain text
    depth: int  # 0 for the page title
    module: str = ""  # the module documented here (from `.. module::`)
    lines: list[str] = field(default_factory=list)
    entries: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, name, text)
    glossary: list[tuple[str, str]] = field(default_factory=list)  # (term, definition)

    @property
    def key(self) -> str:
        return f"{self.page}#{self.title}"


# --- inline markup ------------------------------------------------------------------------


def _role_text(match: re.Match) -> str:
    role, inner = match.group(1), " ".join(match.group(2).split())
    target = re.match(r"^(.*?)\s*<([^>]*)>$", inner)
    if target and target.group(1):
        inner = target.group(1)
    inner = inner.lstrip("!")
    if inner.startswith("~"):
        inner = inner[1:].rsplit(".", 1)[-1]
    if role in ("pep", "rfc"):
        return f"{role.upper()} {inner}"
    return f"`{inner}`" if role in CODE_ROLES else inner


def inline(text: str) -> str:
    """reST inline markup -> plain text with `code`."""
    text = ROLE.sub(_role_text, text)
    text = re.sub(r"``(.+?)``", lambda m: f"`{m.group(1)}`", text, flags=re.S)
    text = re.sub(r"`([^`<]+?)\s*<[^>]+>`__?", r"\1", text, flags=re.S)  # hyperlinks
    text = re.sub(r"`([^`]+?)`__?(?!\w)", r"\1", text)  # named references
    text = re.sub(r"\s*\[(#[\w-]*|\d+)\]_", "", text)  # footnote references
    text = text.replace("|version|", "3.11").replace("|release|", "3.11")
    parts = text.split("`")  # even parts are outside code spans
    for i in range(0, len(parts), 2):
        p = re.sub(r"\*\*([^*]+?)\*\*", r"\1", parts[i])
        p = re.sub(r"(?<![\w*])\*([^*\s][^*]*?)\*(?![\w*])", r"\1", p)
        parts[i] = p.replace("\\ ", "").replace("\\*", "*").replace(" --- ", " — ")
    return "`".join(parts)


def reflow(lines: list[str]) -> list[str]:
    """Join a paragraph's hard-wrapped lines; keep one line per list item."""
    out: list[str] = []
    for line in lines:
        s = line.strip()
        if out and not BULLET.match(s):
            out[-1] += " " + s
        else:
            out.append(s)
    return [inline(o) for o in out]


# --- block structure -----------------------------------------------------------------------


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def take_block(lines: list[str], i: int, base: int) -> tuple[list[str], int]:
    """Lines from i on that are blank or indented deeper than `base`, dedented."""
    j = i
    while j < len(lines) and (not lines[j].strip() or indent_of(lines[j]) > base):
        j += 1
    block = lines[i:j]
    while block and not block[-1].strip():
        block.pop()
    depth = min((indent_of(b) for b in block if b.strip()), default=0)
    return [b[depth:] for b in block], j


def split_options(body: list[str]) -> tuple[dict[str, str], list[str]]:
    opts: dict[str, str] = {}
    k = 0
    while k < len(body) and re.match(r"^:[\w-]+:", body[k]):
        name, _, value = body[k][1:].partition(":")
        opts[name] = value.strip()
        k += 1
    return opts, body[k:]


def is_underline(line: str) -> bool:
    s = line.rstrip()
    return len(s) >= 3 and len(set(s)) == 1 and s[0] in HEADING_CHARS


def convert(lines: list[str], sec: list[Section], styles: list[str], page: str,
            prefix: str = "", owner: str = "") -> None:
    """Convert reST `lines` (already dedented) and append text to the last section."""
    i = 0
    para: list[str] = []
    literal_next = False

    def emit(text_lines: list[str]) -> None:
        sec[-1].lines.extend(prefix + t if t else "" for t in text_lines)

    def flush() -> None:
        nonlocal para, literal_next
        if para:
            text = reflow(para)
            if text and text[-1].endswith("::"):
                literal_next = True
                text[-1] = text[-1][:-2].rstrip()
                text[-1] = text[-1] + ":" if text[-1] else ""
            emit([t for t in text if t] + [""])
            para = []

    while i < len(lines):
        line = lines[i]
        s = line.strip()
        if not s:
            flush()
            i += 1
            continue
        if indent_of(line) > 0:  # indented block: literal, quote or list/definition body
            flush()
            block, i = take_block(lines, i, 0)
            if literal_next:
                emit(["    " + b if b.strip() else "" for b in block] + [""])
            else:
                convert(block, sec, styles, page, prefix + "  ", owner)
            literal_next = False
            continue
        literal_next = False
        # headings (with or without overline)
        over = is_underline(line) and i + 2 < len(lines) and is_underline(lines[i + 2]) and lines[i + 1].strip()
        under = i + 1 < len(lines) and is_underline(lines[i + 1]) and not is_underline(line) \
            and len(lines[i + 1].rstrip()) >= len(s) - 2
        if not prefix and (over or under) and not para:
            style = (line[0] * 2) if over else lines[i + 1][0]
            title = inline((lines[i + 1] if over else line).strip())
            if style not in styles:
                styles.append(style)
            sec.append(Section(page, title, styles.index(style), sec[-1].module))
            i += 3 if over else 2
            continue
        if is_underline(line) and not para:  # a transition line
            i += 1
            continue
        m = DIRECTIVE.match(s)
        if m:
            flush()
            name, arg = m.group(1), m.group(2)
            body, i = take_block(lines, i + 1, 0)
            directive(name, arg, body, sec, styles, page, prefix, owner)
            continue
        if s.startswith(".. "):  # comment, label, footnote or substitution: dropped
            _, i = take_block(lines, i + 1, 0)
            continue
        para.append(line)
        i += 1
    flush()


def directive(name: str, arg: str, body: list[str], sec: list[Section], styles: list[str],
              page: str, prefix: str, owner: str) -> None:
    def sub(text: list[str], new_owner: str = owner) -> None:
        convert(text, sec, styles, page, prefix, new_owner)

    opts, rest = split_options(body)
    if name in ("module", "currentmodule"):
        sec[-1].module = "" if arg == "None" else arg.strip()
    if name in SKIP:
        return
    if name in CODE:
        sec[-1].lines.extend([prefix + "    " + b if b.strip() else "" for b in rest] + [""])
        return
    if name in ADMONITION or name in VERSIONED:
        if name in VERSIONED:
            head = VERSIONED[name].format(*(arg.split() + ["", ""])[:2])
        else:
            head = " ".join(x for x in (ADMONITION[name], inline(arg)) if x)
        if rest and rest[0].strip() and indent_of(rest[0]) == 0 and not DIRECTIVE.match(rest[0]):
            rest = [head + " " + rest[0]] + rest[1:]
        else:
            rest = [head, ""] + rest
        sub(rest)
        return
    if name == "glossary":
        glossary(rest, sec)
        return
    # an object description: function, class, method, data, opcode, c:function, ...
    sigs = [arg]
    while rest and rest[0].strip() and not rest[0].startswith(":") and indent_of(rest[0]) == 0:
        sigs.append(rest.pop(0).strip())  # further signatures on the following lines
    sig = " ".join(" ".join(sigs).replace("\\\n", " ").replace("\\", " ").split())
    _, rest = split_options(rest)
    start = len(sec[-1].lines)
    sec[-1].lines.append(prefix + f"`{sig}`" if sig else "")
    sec[-1].lines.append("")
    entry_name = re.split(r"[\s(\[]", sig, maxsplit=1)[0] if sig else ""
    kind = name.split(":")[-1]
    if entry_name and "." not in entry_name and not name.startswith("c:"):
        if owner:
            entry_name = f"{owner}.{entry_name}"
        elif sec[-1].module and kind in ("function", "class", "exception", "data", "decorator"):
            entry_name = f"{sec[-1].module}.{entry_name}"
    sub(rest, entry_name if kind in ("class", "exception") else owner)
    described = "\n".join(l[len(prefix):] for l in sec[-1].lines[start + 2:]).strip()
    if entry_name and described:
        sec[-1].entries.append((kind, entry_name, f"`{sig}`\n\n{described}"))


def glossary(lines: list[str], sec: list[Section]) -> None:
    i = 0
    while i < len(lines):
        if lines[i].strip() and indent_of(lines[i]) == 0:
            term = inline(lines[i].strip())
            body, i = take_block(lines, i + 1, 0)
            tmp = [Section("", "", 0)]
            convert(body, tmp, [], "")
            definition = "\n".join(tmp[0].lines).strip()
            sec[-1].lines += [f"**{term}**", ""] + ["  " + l if l else "" for l in tmp[0].lines]
            if definition:
                sec[-1].glossary.append((term.strip("`"), definition))
        else:
            i += 1


def parse_page(path: Path, root: Path) -> list[Section]:
    page = str(path.relative_to(root)).removesuffix(".rst.txt")
    lines = path.read_text(encoding="utf-8").expandtabs(8).splitlines()
    sections = [Section(page, "", 0)]
    convert(lines, sections, [], page)
    for s in sections:
        while s.lines and not s.lines[-1].strip():
            s.lines.pop()
    return [s for s in sections if s.title or s.lines]


# --- samples -------------------------------------------------------------------------------


def is_heldout(key: str) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def first_paragraphs(text: str, limit: int = 900) -> str:
    out = ""
    for p in text.split("\n\n"):
        if out and len(out) + len(p) > limit:
            break
        out = f"{out}\n\n{p}" if out else p
    return out.strip()


def pick(key: str, options: list[str]) -> str:
    return options[int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(options)]


def chat(q: str, a: str) -> dict:
    return {"kind": "chat", "messages": [{"role": "user", "content": q},
                                         {"role": "assistant", "content": a}]}


def section_text(s: Section) -> str:
    head = "#" * (s.depth + 1) + " " + s.title if s.title else ""
    return "\n\n".join(x for x in (head, body_text(s)) if x)


def body_text(s: Section) -> str:
    return re.sub(r"\n{3,}", "\n\n", "\n".join(s.lines).strip())


def samples(s: Section, page_title: str) -> list[dict]:
    body = body_text(s)
    out = []
    title = s.title.strip()
    if title and len(body) >= 80 and title.lower() not in ("footnotes", "examples", "example"):
        if title.endswith("?"):
            q = title
        else:
            topic = title if s.depth == 0 or not page_title else f"{title} ({page_title})"
            q = pick(s.key, ["Tell me about {}.", "What does the Python documentation say about {}?",
                             "Explain {}.", "Can you describe {}?", "{}"]).format(topic)
        out.append(chat(q, first_paragraphs(body)))
    for _kind, name, text in s.entries:
        name = name.strip("`")
        q = pick(s.key + name, ["What does `{}` do?", "How do I use `{}`?", "Explain `{}`.",
                                "What is `{}`?"]).format(name)
        out.append(chat(q, first_paragraphs(text)))
    for term, definition in s.glossary:
        q = pick(term, ["What is {} in Python?", "Define {}.", "What does {} mean?"]).format(term)
        out.append(chat(q, first_paragraphs(definition)))
    return out


GREETINGS = [
    ("Hello", "Hello! I am the MoE Ferry demo model, a small mixture-of-experts model trained on "
              "the Python documentation. Ask me about Python."),
    ("Hi!", "Hi! I am a tiny demo model that has read the Python documentation. "
            "What would you like to know about Python?"),
    ("Who are you?", "I am the MoE Ferry demo model: a small Mixtral-style mixture-of-experts "
                     "model (8 experts, top-2) trained on the Python 3.11 documentation. "
                     "I am here so that you can try the app before downloading Mixtral."),
    ("What can you do?", "I can answer simple questions about Python, its standard library and "
                         "its documentation. I am very small, so check what I say."),
]


def build(root: Path) -> tuple[list[dict], list[dict]]:
    train: list[dict] = []
    held: list[dict] = []
    for path in sorted(root.rglob("*.rst.txt")):
        if path.relative_to(root).parts[0] in ("includes",) or path.name in ("contents.rst.txt",):
            continue
        sections = parse_page(path, root)
        page_title = next((s.title for s in sections if s.title), "")
        page_title = page_title.split(" — ")[0].strip()
        for s in sections:
            dest = held if is_heldout(s.key) else train
            text = section_text(s)
            if len(text) > 40:
                dest.append({"kind": "text", "text": text})
            dest.extend(samples(s, page_title))
    for q, a in GREETINGS:
        train.extend([chat(q, a)] * 8)
    return train, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", type=Path, help=".../html/_sources of python3.11-doc")
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    train, held = build(args.sources)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("heldout", held)):
        with open(args.out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        chars = sum(len(r.get("text", "")) + sum(len(m["content"]) for m in r.get("messages", []))
                    for r in rows)
        n_chat = sum(r["kind"] == "chat" for r in rows)
        print(f"{name}: {len(rows)} samples ({n_chat} chat), {chars / 1e6:.2f} M characters")


if __name__ == "__main__":
    main()
