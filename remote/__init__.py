"""veil-trunk: the remote trunk service."""
