#!/usr/bin/env bash
# Remove MoE Ferry as installed by install.sh (this script lives in PREFIX/lib/moeferry).
#
#   PREFIX/lib/moeferry/uninstall.sh                      keep your chats, settings and models
#   PREFIX/lib/moeferry/uninstall.sh --delete-user-data   delete them too
#
# The data folder is $MOEFERRY_DATA_DIR if set, else ${XDG_DATA_HOME:-~/.local/share}/moeferry
# (platformdirs' user data dir, the one the app uses). --delete-user-data deletes only that
# default folder: a $MOEFERRY_DATA_DIR elsewhere, or a default folder that is a symbolic link,
# is refused with a sentence before anything is removed (delete such a folder yourself).
set -euo pipefail

APPDIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PREFIX=$(cd "$APPDIR/../.." && pwd)
SHARE="$PREFIX/share"
DELETE_DATA=0
while [ $# -gt 0 ]; do
    case "$1" in
        --delete-user-data) DELETE_DATA=1; shift ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) echo "uninstall.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
DEFAULT_DATA="${XDG_DATA_HOME:-$HOME/.local/share}/moeferry"
DATA="${MOEFERRY_DATA_DIR:-$DEFAULT_DATA}"
if [ "$DELETE_DATA" = 1 ] && [ -e "$DATA" ]; then
    if [ "$(realpath -m "$DATA")" != "$(realpath -m "$DEFAULT_DATA")" ]; then
        echo "uninstall.sh: MOEFERRY_DATA_DIR points at $DATA, not at MoE Ferry's own data folder" \
            "$DEFAULT_DATA; --delete-user-data deletes only that one, so nothing was removed (unset" \
            "MOEFERRY_DATA_DIR, or delete that folder yourself)" >&2
        exit 2
    fi
    if [ -L "$DEFAULT_DATA" ] || [ ! -d "$DEFAULT_DATA" ]; then
        echo "uninstall.sh: $DEFAULT_DATA is a link or not a folder, so --delete-user-data will not" \
            "delete it and nothing was removed; delete what it points at yourself" >&2
        exit 2
    fi
fi

[ "$(basename "$APPDIR")" = moeferry ] && [ -x "$APPDIR/moeferry" ] \
    || { echo "uninstall.sh: $APPDIR does not look like an installed MoE Ferry; nothing removed" >&2; exit 1; }

if [ -L "$PREFIX/bin/moeferry" ] && [ "$(readlink "$PREFIX/bin/moeferry")" = "$APPDIR/moeferry" ]; then
    rm -f "$PREFIX/bin/moeferry"
fi
rm -f "$SHARE/applications/moeferry.desktop" \
    "$SHARE/metainfo/io.github.moeferry.MoeFerry.metainfo.xml" \
    "$SHARE/icons/hicolor/scalable/apps/moeferry.svg" \
    "$SHARE/icons/hicolor/256x256/apps/moeferry.png"
rm -rf "$APPDIR"
command -v update-desktop-database >/dev/null && update-desktop-database -q "$SHARE/applications" || true
command -v gtk-update-icon-cache >/dev/null && gtk-update-icon-cache -q -t "$SHARE/icons/hicolor" || true
echo "MoE Ferry removed from $APPDIR."

if [ -d "$DATA" ]; then
    if [ "$DELETE_DATA" = 1 ]; then
        rm -rf "$DATA"
        echo "Deleted your chats, settings and models in $DATA."
    else
        echo "Kept your chats, settings and models in $DATA (delete them with --delete-user-data)."
    fi
fi
