"""Entry point of the frozen app (PyInstaller): `moeferry` with no arguments opens the GUI,
`moeferry probe`, `moeferry generate ...` etc. work as from the pip-installed console script.

It only prepares the process for being frozen, then hands over to moeferry.app.cli.main():
- a windowed Windows build (moeferry.exe) has no sys.stdout/sys.stderr; when it is given a
  command it writes to the console it was started from, if any, else nowhere. moeferry-cli.exe
  is the console build of the same program for the command line.
- Triton compiles a small C helper the first time it runs a kernel, with the machine's C
  compiler (CC, gcc or clang) and the Python headers that the spec bundles. A frozen app on a
  Linux machine without one would fail at the first fused kernel, so there Triton is hidden
  and the engine takes its plain PyTorch path (correct, slower on the GPU).
"""

from __future__ import annotations

import os
import shutil
import sys


def _frozen() -> bool:
    return bool(getattr(sys, "frozen", False))


def _give_windowed_app_streams() -> None:
    if sys.stdout is not None and sys.stderr is not None:
        return
    if sys.platform == "win32" and len(sys.argv) > 1:
        import ctypes

        if ctypes.windll.kernel32.AttachConsole(-1):  # -1: the parent process's console
            console = open("CONOUT$", "w", encoding="utf-8", errors="replace", buffering=1)
            sys.stdout = sys.stdout or console
            sys.stderr = sys.stderr or console
            return
    devnull = open(os.devnull, "w", encoding="utf-8")
    sys.stdout = sys.stdout or devnull
    sys.stderr = sys.stderr or devnull


def _c_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def _hide_triton_without_compiler() -> None:
    # Linux only: the Windows builds of Triton (triton-windows) bring their own compiler.
    if _frozen() and sys.platform.startswith("linux") and _c_compiler() is None:
        sys.modules["triton"] = None  # `import triton` now raises ImportError: reference path


def main() -> int:
    if _frozen():
        import multiprocessing

        multiprocessing.freeze_support()
        _give_windowed_app_streams()
        _hide_triton_without_compiler()
    from moeferry.app.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
