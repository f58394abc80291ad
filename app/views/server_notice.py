"""What the window says while the built-in server is restarted by its watchdog, and after."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.core.trunk_sources import RESTARTED, RESTARTING

if TYPE_CHECKING:
    from app.main_window import MainWindow


def show_server_notice(w: MainWindow) -> None:
    """Tell the user while the built-in server is being restarted, and when it is back
    (the window calls this every second)."""
    notice = w.app.host.server_notice()
    banner = w.chat_view.error
    if notice == RESTARTING and (banner.isHidden() or banner.cause == "restart"):
        banner.show_notice(
            "The built-in server on this computer stopped",
            "Veil is restarting it; a reply being written continues when it is back.",
            cause="restart",
        )
        w._idle_status()
        w.gauges.refresh()
    elif notice == RESTARTED:
        w.app.host.clear_server_notice()
        banner.clear("restart")
        w.gauges.refresh()
        w.status.setText("Veil restarted the built-in server.  ·  " + w.app.connection_text())
