#!/usr/bin/env bash
# Make a drag-to-install disk image from the frozen Veil.app (macOS only).
#
#   installer/macos/make-dmg.sh dist/Veil.app VERSION dist      (python installer/build.py runs it)
#
# Output: dist/Veil-VERSION.dmg with Veil.app, a link to /Applications and "Uninstall Veil.command".
# Signing: set CODESIGN_IDENTITY="Developer ID Application: ..." to sign with hardened runtime;
# without it the app is signed ad hoc (runs on the build Mac; other Macs need right-click > Open).
# Notarize a signed image with: xcrun notarytool submit dist/Veil-VERSION.dmg --wait ...
set -euo pipefail
if [ "$(uname -s)" != Darwin ]; then
    echo "make-dmg.sh: error: needs macOS (hdiutil); build the Linux packages with installer/build.py" >&2
    exit 1
fi
if [ $# -lt 3 ]; then
    echo "usage: $0 APP VERSION OUT_DIR" >&2
    exit 2
fi
app="$1"; version="$2"; out="$3"
here="$(cd "$(dirname "$0")" && pwd)"
[ -d "$app/Contents/MacOS" ] || { echo "make-dmg.sh: error: $app is not an .app bundle" >&2; exit 1; }

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
ditto "$app" "$stage/Veil.app"
ln -s /Applications "$stage/Applications"
install -m 0755 "$here/uninstall.command" "$stage/Uninstall Veil.command"

if [ -n "${CODESIGN_IDENTITY:-}" ]; then
    codesign --force --deep --options runtime --timestamp \
        --entitlements "$here/entitlements.plist" --sign "$CODESIGN_IDENTITY" "$stage/Veil.app"
else
    codesign --force --deep --sign - "$stage/Veil.app"
fi

mkdir -p "$out"
dmg="$out/Veil-$version.dmg"
rm -f "$dmg"
hdiutil create -volname "Veil $version" -srcfolder "$stage" -fs HFS+ -format UDZO \
    -imagekey zlib-level=9 -ov "$dmg" >/dev/null
echo "$dmg"
