"""Qt widgets: one module per window, pane or dialog; they wrap ``app.core``."""
