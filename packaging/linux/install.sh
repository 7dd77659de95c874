#!/usr/bin/env bash
# Install MoE Ferry from its unpacked Linux tarball.
#
#   ./install.sh                          for you: ~/.local/{lib/moeferry,bin,share}
#   sudo ./install.sh --prefix /usr/local for everyone
#
# Puts the app folder in PREFIX/lib/moeferry, a `moeferry` link in PREFIX/bin, the menu entry
# (moeferry.desktop), the AppStream metadata and the icons in PREFIX/share, and
# PREFIX/lib/moeferry/uninstall.sh to remove them again. Installing over an earlier version
# replaces it. Your data (chats, settings, models) lives elsewhere and is never touched.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PREFIX="$HOME/.local"
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX=$2; shift 2 ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ -x "$HERE/moeferry/moeferry" ] || { echo "install.sh: run it from the unpacked tarball (no moeferry/moeferry next to it)" >&2; exit 1; }
mkdir -p "$PREFIX"
PREFIX=$(cd "$PREFIX" && pwd)
APPDIR="$PREFIX/lib/moeferry"
SHARE="$PREFIX/share"

if [ -e "$APPDIR" ]; then
    [ -x "$APPDIR/moeferry" ] || { echo "install.sh: $APPDIR exists and is not a MoE Ferry installation; move it away first" >&2; exit 1; }
    rm -rf "$APPDIR"
fi
mkdir -p "$PREFIX/lib" "$PREFIX/bin" "$SHARE/applications" "$SHARE/metainfo" \
    "$SHARE/icons/hicolor/scalable/apps" "$SHARE/icons/hicolor/256x256/apps"
cp -a "$HERE/moeferry" "$APPDIR"
install -m 755 "$HERE/uninstall.sh" "$APPDIR/uninstall.sh"
ln -sfn "$APPDIR/moeferry" "$PREFIX/bin/moeferry"

# The menu entry runs the installed executable by its full path (~/.local/bin is not on every
# desktop session's PATH); a path with spaces is quoted as the Desktop Entry spec asks.
exec_path="$APPDIR/moeferry"
case "$exec_path" in *[[:space:]]*) exec_path="\"$exec_path\"" ;; esac
sed -e "s|^Exec=moeferry\$|Exec=$exec_path|" -e "s|^TryExec=moeferry\$|TryExec=$APPDIR/moeferry|" \
    "$HERE/share/applications/moeferry.desktop" > "$SHARE/applications/moeferry.desktop"
chmod 644 "$SHARE/applications/moeferry.desktop"
install -m 644 "$HERE/share/metainfo/io.github.moeferry.MoeFerry.metainfo.xml" "$SHARE/metainfo/"
install -m 644 "$HERE/share/icons/hicolor/scalable/apps/moeferry.svg" "$SHARE/icons/hicolor/scalable/apps/"
install -m 644 "$HERE/share/icons/hicolor/256x256/apps/moeferry.png" "$SHARE/icons/hicolor/256x256/apps/"

command -v update-desktop-database >/dev/null && update-desktop-database -q "$SHARE/applications" || true
command -v gtk-update-icon-cache >/dev/null && gtk-update-icon-cache -q -t "$SHARE/icons/hicolor" || true

echo "MoE Ferry installed in $APPDIR."
echo "Start it from the application menu or with: $PREFIX/bin/moeferry"
case ":$PATH:" in *":$PREFIX/bin:"*) ;; *) echo "($PREFIX/bin is not on your PATH.)" ;; esac
echo "Remove it with: $APPDIR/uninstall.sh"
