"""The `moeferry` console script: no arguments open the desktop app, anything else is the
engine's command line (engine/cli.py), which never imports the app."""

from __future__ import annotations

import sys

from moeferry.engine.runtime import vram


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        vram.use_expandable_segments()  # the engine's command line asks for it itself
        from moeferry.app.main import run_gui
        return run_gui()
    from moeferry.engine.cli import main as engine_main
    return engine_main(argv)


if __name__ == "__main__":
    sys.exit(main())
