"""Veil desktop app and the `veil` command line."""
