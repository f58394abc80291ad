#!/bin/sh
# Install Veil for this user only (no administrator rights): unpack the tarball, then run
#   ./install.sh
# Veil goes to ~/.local/opt/veil, the `veil` command to ~/.local/bin, and a "Veil" entry appears
# in the applications menu. Remove it again with: veil-uninstall
set -eu
src="$(cd "$(dirname "$0")" && pwd)"
data_home="${XDG_DATA_HOME:-$HOME/.local/share}"
dest="$HOME/.local/opt/veil"
bin="$HOME/.local/bin"

if [ ! -x "$src/veil/veil" ]; then
    echo "install.sh: error: $src/veil/veil is missing; unpack the whole tarball first" >&2
    exit 1
fi
mkdir -p "$HOME/.local/opt" "$bin" "$data_home/applications"
rm -rf "$dest.new"
cp -a "$src/veil" "$dest.new"
rm -rf "$dest"
mv "$dest.new" "$dest"
ln -sf "$dest/veil" "$bin/veil"
ln -sf "$dest/veil-trunk" "$bin/veil-trunk"
ln -sf "$dest/veil-uninstall" "$bin/veil-uninstall"
for s in 16 32 48 64 128 256 512; do
    mkdir -p "$data_home/icons/hicolor/${s}x${s}/apps"
    cp "$src/icons/veil-$s.png" "$data_home/icons/hicolor/${s}x${s}/apps/veil.png"
done
mkdir -p "$data_home/icons/hicolor/scalable/apps"
cp "$src/icons/veil.svg" "$data_home/icons/hicolor/scalable/apps/veil.svg"
sed -e "s|/opt/veil/veil|$dest/veil|g" "$src/veil.desktop" > "$data_home/applications/veil.desktop"
command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q "$data_home/applications" || true
echo "Veil is installed. Open it from the applications menu, or run: $bin/veil"
case ":$PATH:" in *":$bin:"*) ;; *) echo "(add $bin to your PATH to type 'veil' in a terminal)" ;; esac
