"""The engine's layering: it never imports the app or Qt, the types the app shares with it load
without torch, and no two engine modules import each other, directly or through others
(imports inside functions count too: a lazy import hides a cycle, it does not remove it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"
def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_no_engine_module_imports_the_app_or_qt():
    code = ("import importlib, pkgutil, sys, moeferry.engine as e\n"
            "names = [m.name for m in pkgutil.walk_packages(e.__path__, 'moeferry.engine.')]\n"
            "for n in names: importlib.import_module(n)\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('moeferry.app', 'PySide6')))\n"
            "assert len(names) > 30 and not bad, (len(names), bad)")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_engine_cli_imports_no_app():
    proc = run_python("import moeferry.engine.cli, sys; assert not any(m.startswith(('moeferry.app', 'PySide6')) "
                      "for m in sys.modules)")
    assert proc.returncode == 0, proc.stderr[-2000:]


def engine_modules() -> set[str]:
    """Every engine module by its name under moeferry.engine: "cli", "runtime.model", ..."""
    return {".".join(p.relative_to(ENGINE).with_suffix("").parts) for p in ENGINE.rglob("*.py")
            if p.name != "__init__.py"}


def imports_of(path: Path, names: set[str], package: str) -> set[str]:
    """The engine modules (of `names`) a module imports anywhere in its source; package: the
    module's own folder under moeferry.engine ("" or "runtime"), for relative imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:
                base = ".".join(p for p in (package, module) if p)
            elif module == "moeferry.engine" or module.startswith("moeferry.engine."):
                base = module.removeprefix("moeferry.engine").lstrip(".")
            else:
                continue
            found.add(base)
            found |= {".".join(p for p in (base, a.name) if p) for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("moeferry.engine.") for a in node.names if a.name.startswith("moeferry.engine.")}
    own = ".".join(p for p in (package, path.stem) if p)
    return (found & names) - {own}


def import_graph() -> dict[str, set[str]]:
    names = engine_modules()
    return {n: imports_of(ENGINE / (n.replace(".", "/") + ".py"), names, n.rpartition(".")[0]) for n in names}


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Every pair (a, b), a < b, where a reaches b and b reaches a."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen
    reached = {m: reach(m) for m in graph}
    return {(a, b) for a in graph for b in reached[a] if a < b and a in reached[b]}


def test_the_cycle_finder_finds_direct_and_indirect_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b"), ("a", "c"), ("b", "c")}
    assert cycles({"a": {"b"}, "b": set()}) == set()


def test_the_import_graph_sees_lazy_and_relative_imports(tmp_path):
    (tmp_path / "x.py").write_text("from . import y\ndef f():\n    from moeferry.engine.setup.z import q\n"
                                   "    import moeferry.engine.w\n    from moeferry.engine.setup import u\n")
    names = {"a.x", "a.y", "setup.z", "w", "setup.u", "v"}
    assert imports_of(tmp_path / "x.py", names, "a") == {"a.y", "setup.z", "w", "setup.u"}


def test_engine_has_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 30 and graph["runtime.decode_graphs"] >= {"runtime.model"}  # the graph sees the tree
    assert not cycles(graph), sorted(cycles(graph))


def test_what_the_app_shares_with_the_engine_loads_without_torch():
    code = ("import sys\n"
            "import moeferry.engine.contract, moeferry.engine.setup.catalog, moeferry.engine.paths\n"
            "import moeferry.engine.setup.download, moeferry.app.engine_backend, moeferry.app.stats_format\n"
            "import moeferry.app.expert_trace, moeferry.app.catalog, moeferry.app.install\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
