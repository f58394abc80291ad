"""The privacy audit as the window runs it: the details dialog, the question asked before a run
(which settings, how long, what it replaces), the run with a Cancel button, and the line that
says how it ended."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from app.core import audit_info, problems
from app.core.tasks import Task, TaskContext
from app.views.audit_dialog import AuditDialog
from engine.errors import Cancelled, VeilError

if TYPE_CHECKING:
    from app.main_window import MainWindow
    from app.views.error_banner import ErrorBanner

WAITING = "audit-wait"  # the banner's cause while a reply waits for the audit


class AuditFlow:
    def __init__(self, window: MainWindow) -> None:
        self.w = window
        self.app = window.app
        self.task: Task | None = None  # the running audit (the button reads "Cancel audit")
        # a reply or suggestion asked for meanwhile waits for the audit: say so where it waits
        self.app.chat.busy_changed.connect(lambda b: self._waits(b, window.chat_view.error))
        self.app.drafting.busy_changed.connect(lambda b: self._waits(b, window.drafting_pane.error))

    def _waits(self, busy: bool, banner: ErrorBanner) -> None:
        if busy and self.task is not None:
            banner.show_notice(
                "Waiting for the privacy audit to finish",
                "This computer runs one of them at a time: the reply starts when the audit "
                "ends. Cancel the audit to start it now.",
                "Cancel audit",
                self.run,
                cause=WAITING,
            )
        elif not busy:
            banner.clear(WAITING)

    @property
    def running(self) -> bool:
        return self.task is not None

    def details(self) -> None:
        from app.main_window import run_modal

        k = self.app.settings.local_layers
        name = self.app.audit_model_name()  # the keyed audit's, with a keyed server in use
        data = audit_info.latest(name)
        rows = audit_info.rows(name, self.app.n_layers)
        date = str(data.get("date", ""))[:10] if data else ""
        dlg = AuditDialog(
            name,
            date,
            rows,
            k,
            self.w,
            fully_local=self.app.is_fully_local(k),
            shipped=audit_info.is_shipped(data, name),
            n_layers=self.app.n_layers,
        )
        run_modal(dlg)

    def question(self, ks: list[int], seconds: float) -> str:
        """What "Run privacy audit" asks before it starts."""
        from app.core.privacy import setting_words

        name = self.app.model_name()
        data = audit_info.latest(name)
        date = str(data.get("date", ""))[:10] if data else ""
        if data is None:
            replaces = "The results will appear beside the slider."
        elif audit_info.is_shipped(data, name):
            replaces = (
                f"Its results replace the figures shown now, measured by the Veil team on {date}."
            )
        else:
            replaces = f"Its results replace the figures from your audit of {date}."
        replaces += self._key_note()
        k, n = self.app.settings.local_layers, self.app.n_layers
        local = (
            f" At your current setting ({setting_words(n, k)}) nothing is sent, so it measures "
            "the settings that use a server."
            if self.app.is_fully_local(k)
            else ""
        )
        names = [str(x) for x in ks]
        depths = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        return (
            "The privacy audit measures how many words someone who runs the server could "
            f"recover from what this computer sends, at {len(ks)} settings ({depths} layers at "
            f"each end).{local} It uses sample text that comes with Veil, not your chats or "
            f"documents.\n\nIt takes {audit_info.human_duration(seconds)} on this computer, "
            "which is busy meanwhile: replies wait until it ends. You can cancel it at any "
            f"time.\n\n{replaces}"
        )

    def _key_note(self) -> str:
        """What the question adds while an organisation key is in use: the audit measures the
        model without the key (the app runs the plain audit, not the keyed one: see
        :meth:`finished_text`)."""
        keyed = self.app.keyed_audit_name()
        if keyed is None:
            return ""
        data = audit_info.latest(keyed)
        if data is not None:
            date = str(data.get("date", ""))[:10]
            return (
                " It measures the model without your organisation's key: where the audit made "
                f"with your key ({date}) measured a setting, its figures stay."
            )
        return (
            " It measures the model without your organisation's key: Veil's tests found the key "
            "does not lower what the server can read."
        )

    def finished_text(self, took: float) -> str:
        """The line under the panel when an audit ends. The app runs the plain audit even while
        an organisation key is in use: the keyed audit (``veil audit --org-key``) needs the
        whole public model, cannot know the noise level the server's keyed model was made with,
        and adds weight alignment and vocabulary matching per depth and noise level (about 5
        minutes each on two cores, docs/privacy.md: 1,271 s for two depths at two levels), so
        the app's six depths would take well over half an hour; and it measured what the plain
        audit measures (98-100% of prompt words). So under a key the line says whose figures the
        panel now shows (:meth:`AppController.shown_audit`), never that the plain result is the
        keyed figure."""
        head = f"Audit finished in {audit_info.elapsed_text(took)}."
        if self.app.keyed_audit_name() is None:
            return f"{head} The figures above now come from it."
        _, fig, with_key = self.app.shown_audit(self.app.settings.local_layers)
        if with_key:
            return (
                f"{head} It measured the model without your organisation's key; the figures "
                f"above still come from the audit made with your key ({fig.date})."
            )
        return (
            f"{head} The figures above now come from it, measured without your organisation's "
            "key, which Veil's tests found does not lower what the server can read."
        )

    def run(self) -> None:
        """Ask first (with a time estimate), run with a Cancel button, say when it is done."""
        w, app = self.w, self.app
        if self.task is not None:  # the button reads "Cancel audit"
            self.task.cancel.cancel()
            w.privacy.run_button.setEnabled(False)
            w.privacy.set_audit_status("Cancelling the audit…")
            return
        if not audit_info.audit_runner_available():
            w.chat_view.error.show_error(
                VeilError("the privacy audit is not part of this installation"),
                cause=problems.AUDIT,
            )
            return
        n = app.n_layers
        if n is None:
            return
        ks = audit_info.audit_depths(n, app.settings.local_layers)
        if not ks:
            w.chat_view.error.show_error(
                VeilError(f"this model has too few layers ({n}) to split, so nothing to audit"),
                cause=problems.AUDIT,
            )
            return
        name = app.model_name()
        last = app.store.get(f"audit.last:{name}")
        last_t = (float(last[0]), [int(x) for x in last[1]]) if last else None
        est = audit_info.estimate_seconds(ks, app.model_params(), last_t)
        if not w.ask_yes("Run the privacy audit?", w.audit_question(ks, est), "Run audit"):
            return
        model = app.settings.model
        t0 = time.monotonic()

        def work(ctx: TaskContext) -> object:
            return audit_info.run_blocking(model, ks, ctx.progress, lambda: ctx.cancel.cancelled)

        def end(status: str, color: str) -> None:
            self.task = None
            w.chat_view.error.clear(WAITING)
            w.drafting_pane.error.clear(WAITING)
            w.privacy.run_button.setText("Run privacy audit…")
            w.privacy.run_button.setEnabled(True)
            w.privacy.set_audit_status(status, color)
            w.privacy.refresh()
            w._idle_status()

        def done(_: object) -> None:
            took = time.monotonic() - t0
            app.store.set(f"audit.last:{name}", [round(took, 1), ks])
            app.resolved.emit(problems.AUDIT)
            end(self.finished_text(took), "ok")

        def failed(err: VeilError) -> None:
            if isinstance(err, Cancelled):
                end("Audit cancelled; the figures above are unchanged.", "muted")
                return
            end("The audit did not finish; the figures above are unchanged.", "bad")
            w.chat_view.error.show_error(err, cause=problems.AUDIT)

        task = Task("audit", work, on_done=done, on_error=failed, on_progress=w.show_progress)
        self.task = task
        w.privacy.run_button.setText("Cancel audit")
        w.privacy.set_audit_status(f"Running the privacy audit ({audit_info.human_duration(est)})…")
        app.executor.submit(task)
