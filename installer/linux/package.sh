#!/usr/bin/env bash
# Package a frozen Veil bundle (dist/veil, made by PyInstaller from installer/veil.spec) for Linux.
#
#   installer/linux/package.sh BUNDLE_DIR VERSION OUT_DIR [deb|tar|all]
#
# deb: OUT_DIR/veil_VERSION_ARCH.deb — installs to /opt/veil, /usr/bin/veil (+ veil-trunk,
#      veil-uninstall), a desktop entry and hicolor icons. Built with dpkg-deb, no root needed.
# tar: OUT_DIR/veil-VERSION-linux-ARCH.tar.gz — per-user install with ./install.sh.
# Compression: VEIL_DEB_COMPRESS (gzip|xz|zstd|none, default gzip: fast to build, installs
# everywhere; xz is ~25% smaller but takes 10+ minutes) and VEIL_DEB_LEVEL (default 6).
set -euo pipefail

if [ $# -lt 3 ]; then
    echo "usage: $0 BUNDLE_DIR VERSION OUT_DIR [deb|tar|all]" >&2
    exit 2
fi
bundle="$(cd "$1" && pwd)"
version="$2"
out="$(mkdir -p "$3" && cd "$3" && pwd)"
what="${4:-all}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
icons="$root/resources/icons"
arch="$(dpkg --print-architecture 2>/dev/null || uname -m)"

[ -x "$bundle/veil" ] || { echo "package.sh: error: $bundle/veil is not a frozen Veil bundle" >&2; exit 1; }
for s in 16 32 48 64 128 256 512; do
    [ -f "$icons/veil-$s.png" ] || { echo "package.sh: error: missing $icons/veil-$s.png (run installer/render_icons.py)" >&2; exit 1; }
done

# staging next to the output, so the bundle can be hard-linked rather than copied
stage="$(mktemp -d "$out/.veil-pkg.XXXXXX")"
trap 'rm -rf "$stage"' EXIT

# the bundle as it is installed: the frozen app, the veil-trunk link and the uninstaller
install_tree() {  # $1 = destination folder
    mkdir -p "$1"
    cp -al "$bundle/." "$1/" 2>/dev/null || cp -a "$bundle/." "$1/"
    ln -sfn veil "$1/veil-trunk"
    install -m 0755 "$here/veil-uninstall" "$1/veil-uninstall"
    mkdir -p "$1/server"
    install -m 0644 "$root/installer/server/veil-trunk.service" "$1/server/veil-trunk.service"
}

build_deb() {
    local pkg="$stage/deb"
    install_tree "$pkg/opt/veil"
    mkdir -p "$pkg/usr/bin" "$pkg/usr/share/applications" "$pkg/DEBIAN" \
             "$pkg/usr/share/doc/veil"
    # wrappers rather than links, so the programs always see their real location
    printf '#!/bin/sh\nexec /opt/veil/veil "$@"\n' > "$pkg/usr/bin/veil"
    printf '#!/bin/sh\nexec /opt/veil/veil --trunk-child "$@"\n' > "$pkg/usr/bin/veil-trunk"
    printf '#!/bin/sh\nexec /opt/veil/veil-uninstall "$@"\n' > "$pkg/usr/bin/veil-uninstall"
    chmod 0755 "$pkg/usr/bin/veil" "$pkg/usr/bin/veil-trunk" "$pkg/usr/bin/veil-uninstall"
    install -m 0644 "$here/veil.desktop" "$pkg/usr/share/applications/veil.desktop"
    for s in 16 32 48 64 128 256 512; do
        install -D -m 0644 "$icons/veil-$s.png" "$pkg/usr/share/icons/hicolor/${s}x${s}/apps/veil.png"
    done
    install -D -m 0644 "$icons/veil.svg" "$pkg/usr/share/icons/hicolor/scalable/apps/veil.svg"
    cat > "$pkg/usr/share/doc/veil/copyright" <<'TXT'
Veil — privacy-aware split LLM client. License: Apache-2.0.
Bundles Python, PyTorch (BSD-3-Clause), Hugging Face transformers and tokenizers (Apache-2.0),
Qt 6 / PySide6 (LGPL-3.0), pyzmq/libzmq (BSD/MPL-2.0) and the SmolLM2-135M-Instruct model
(Apache-2.0); their license files are inside /opt/veil/_internal.
TXT
    local size_kb
    size_kb="$(du -sk --apparent-size "$pkg" | cut -f1)"
    cat > "$pkg/DEBIAN/control" <<TXT
Package: veil
Version: $version
Section: utils
Priority: optional
Architecture: $arch
Maintainer: Veil team <veil@localhost>
Installed-Size: $size_kb
Depends: libc6 (>= 2.28), libgl1, libegl1, libfontconfig1, libfreetype6, libx11-6, libx11-xcb1, libxkbcommon0, libdbus-1-3, libglib2.0-0 | libglib2.0-0t64
Recommends: libxkbcommon-x11-0, libxcb-cursor0, libxcb-icccm4, libxcb-image0, libxcb-keysyms1, libxcb-randr0, libxcb-render-util0, libxcb-shape0, libxcb-xinerama0, libxcb-xkb1, libwayland-client0
Homepage: https://localhost/veil
Description: Veil - private AI assistant (split language model client)
 Veil runs the beginning and the end of a language model on this computer and
 only the middle on your organisation's trunk server; your text never leaves
 this computer. Includes a small built-in model to try it without a server.
 Remove with: veil-uninstall (keeps your data) or
 veil-uninstall --purge-user-data.
TXT
    cat > "$pkg/DEBIAN/postinst" <<'TXT'
#!/bin/sh
set -e
if [ "$1" = "configure" ]; then
    command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q /usr/share/applications || true
    command -v gtk-update-icon-cache >/dev/null 2>&1 && gtk-update-icon-cache -q -t /usr/share/icons/hicolor || true
fi
exit 0
TXT
    cat > "$pkg/DEBIAN/postrm" <<'TXT'
#!/bin/sh
# dpkg never touches users' home folders: chats, keys and settings stay after remove and purge.
set -e
if [ "$1" = "remove" ] || [ "$1" = "purge" ]; then
    command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q /usr/share/applications || true
    command -v gtk-update-icon-cache >/dev/null 2>&1 && gtk-update-icon-cache -q -t /usr/share/icons/hicolor || true
    # caches Python may have written next to the bundle
    [ -d /opt/veil ] && find /opt/veil -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null || true
    rmdir /opt/veil 2>/dev/null || true
fi
exit 0
TXT
    chmod 0755 "$pkg/DEBIAN/postinst" "$pkg/DEBIAN/postrm"
    local deb="$out/veil_${version}_${arch}.deb"
    local comp="${VEIL_DEB_COMPRESS:-gzip}" level="${VEIL_DEB_LEVEL:-6}"
    local zopts=("-Z$comp")
    [ "$comp" = none ] || zopts+=("-z$level")
    dpkg-deb --root-owner-group "${zopts[@]}" --build "$pkg" "$deb" >/dev/null
    echo "$deb"
}

build_tar() {
    local name="veil-$version-linux-$(uname -m)"
    local top="$stage/tar/$name"
    install_tree "$top/veil"
    install -m 0755 "$here/install.sh" "$top/install.sh"
    install -m 0644 "$here/veil.desktop" "$top/veil.desktop"
    mkdir -p "$top/icons"
    cp "$icons"/veil-*.png "$icons/veil.svg" "$top/icons/"
    local tgz="$out/$name.tar.gz"
    tar -C "$stage/tar" -czf "$tgz" "$name"
    echo "$tgz"
}

case "$what" in
    deb) build_deb ;;
    tar) build_tar ;;
    all) build_deb; build_tar ;;
    *) echo "package.sh: error: unknown target '$what' (deb, tar or all)" >&2; exit 2 ;;
esac
