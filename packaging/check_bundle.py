"""Check a built app folder (dist/moeferry) for what a user's machine will meet.

    python packaging/check_bundle.py build/linux/dist/moeferry [--leak PATH ...] [--max-glibc 2.36]

It prints, and exits 1 when a limit is broken:
- the deepest file, and its length once installed under a typical Windows per-user folder
  (WINDOWS_PREFIX, a 20-character user name): Windows stops at 260 characters (MAX_PATH)
  unless long paths are enabled. The Linux folder stands in for the Windows one (the same
  Python packages; .dll instead of .so).
- the newest glibc symbol version any ELF file of the folder needs: the oldest glibc, and
  so the oldest Linux distribution, the app runs on.
- libraries whose RPATH/RUNPATH names a folder other than $ORIGIN-relative ones (a path of the
  build machine; build_tarball.sh removes them), through binutils' readelf;
- files that contain a build-machine path given with --leak (the build or venv folder).
- the folder's size, and the largest top-level parts.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

WINDOWS_PREFIX = r"C:\Users\abcdefghijklmnopqrst\AppData\Local\Programs\MoEFerry" + "\\"
MAX_PATH = 260
GLIBC = re.compile(rb"GLIBC_(2\.[0-9]+)(?:\.[0-9]+)?\x00")


def deepest(folder: Path) -> tuple[str, int]:
    """(relative path of the longest file path, its length installed under WINDOWS_PREFIX)."""
    longest = max((str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()), key=len, default="")
    return longest, len(WINDOWS_PREFIX) + len(longest)


def is_elf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def glibc_needed(folder: Path) -> tuple[str | None, str | None]:
    """(newest GLIBC_x.y any ELF file references, one file that references it)."""
    best, where = None, None
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink() and is_elf(p):
            for m in GLIBC.finditer(p.read_bytes()):
                v = m.group(1).decode()
                if best is None or version_key(v) > version_key(best):
                    best, where = v, str(p.relative_to(folder))
    return best, where


def absolute_rpaths(folder: Path) -> list[str]:
    """'file: entry' for each RPATH/RUNPATH entry of an ELF file that is not $ORIGIN-relative."""
    if shutil.which("readelf") is None:
        return []
    out = []
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink() and is_elf(p):
            dyn = subprocess.run(["readelf", "-d", str(p)], capture_output=True, text=True).stdout
            for paths in re.findall(r"\((?:RPATH|RUNPATH)\).*\[(.*)\]", dyn):
                out += [f"{p.relative_to(folder)}: {e}" for e in paths.split(":")
                        if e and not e.startswith("$ORIGIN")]
    return out


def files_containing(folder: Path, needles: list[str]) -> list[str]:
    if not needles:
        return []
    raw = [n.encode() for n in needles]
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and not p.is_symlink() and any(n in p.read_bytes() for n in raw))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check a built MoE Ferry app folder.")
    ap.add_argument("folder", type=Path, help="the app folder, e.g. build/linux/dist/moeferry")
    ap.add_argument("--leak", action="append", default=[], help="a build-machine path that must not appear")
    ap.add_argument("--max-glibc", help="fail if the folder needs a newer glibc than this, e.g. 2.35")
    a = ap.parse_args(argv)
    if not a.folder.is_dir():
        print(f"check_bundle: {a.folder} is not a folder; build the app first.", file=sys.stderr)
        return 2
    failed = False
    path, length = deepest(a.folder)
    print(f"deepest file  {path} ({len(path)} characters; {length} under {WINDOWS_PREFIX})")
    if length > MAX_PATH:
        print(f"check_bundle: {length} characters is over Windows' {MAX_PATH}.", file=sys.stderr)
        failed = True
    glibc, where = glibc_needed(a.folder)
    print(f"glibc needed  {glibc} (for example by {where})")
    if a.max_glibc and glibc and version_key(glibc) > version_key(a.max_glibc):
        print(f"check_bundle: the folder needs glibc {glibc}, newer than {a.max_glibc}; build it on an "
              f"older distribution (packaging/README.md).", file=sys.stderr)
        failed = True
    rpaths = absolute_rpaths(a.folder)
    print(f"rpaths        {len(rpaths)} absolute RPATH/RUNPATH entries" + "".join(f"\n              {x}" for x in rpaths[:5]))
    failed |= bool(rpaths)
    leaks = files_containing(a.folder, a.leak)
    print(f"build paths   {len(leaks)} file(s) contain {', '.join(a.leak) or '(none given)'}"
          + "".join(f"\n              {x}" for x in leaks[:10]))
    failed |= bool(leaks)
    inner = a.folder / "_internal" if (a.folder / "_internal").is_dir() else a.folder
    parts = sorted(((folder_bytes(p) if p.is_dir() else p.stat().st_size, p.name)
                    for p in inner.iterdir()), reverse=True)[:6]
    print(f"size          {folder_bytes(a.folder) / 1e6:.0f} MB; largest: "
          + ", ".join(f"{name} {n / 1e6:.0f} MB" for n, name in parts))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
