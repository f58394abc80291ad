#!/bin/sh
# Uninstall Veil from this Mac (double-click in Finder). Keeps your data unless you say yes.
set -eu
app="/Applications/Veil.app"
[ -d "$HOME/Applications/Veil.app" ] && app="$HOME/Applications/Veil.app"
printf 'Remove %s? [y/N] ' "$app"; read -r a
case "$a" in y|Y|yes) rm -rf "$app"; echo "Veil removed." ;; *) echo "Nothing removed."; exit 0 ;; esac
printf 'Also delete your Veil data (chats, settings, model cache)? [y/N] '; read -r b
case "$b" in
    y|Y|yes)
        rm -rf "$HOME/Library/Application Support/veil" "$HOME/Library/Caches/veil" \
               "$HOME/Library/Logs/veil"
        echo "Your Veil data is deleted. (Keys in the Keychain are named 'veil'; remove them in Keychain Access if you wish.)" ;;
    *) echo "Your data is kept in ~/Library/Application Support/veil." ;;
esac
