"""Documents in the app: files attached to a chat, matters, and the passages a reply uses.

Qt-free. Reading files runs as tasks on their own executor (so attaching does not wait for a
reply being written); finding passages runs inside the reply's task, on the engine thread,
after re-indexing any file that changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from app.core.chat import ChatController
from app.core.documents.context import Source, with_sources
from app.core.documents.extract import Extracted, Progress, extract
from app.core.documents.index import KIND_CHAT, DocIndex, FileInfo, Matter, SyncReport
from app.core.tasks import Event, Executor, Task, TaskContext
from engine.errors import VeilError


class DocumentsController:
    def __init__(self, index: DocIndex, chat: ChatController, executor: Executor) -> None:
        self.index, self.chat, self.executor = index, chat, executor
        self.busy = 0  # indexing tasks queued or running
        self.matters_changed = Event()  # ()
        self.files_changed = Event()  # (matter_id)
        self.indexed = Event()  # (matter_id, SyncReport)
        self.failed = Event()  # (VeilError)
        self.progress = Event()  # (stage, fraction)
        self.opened = Event()  # (Extracted) a file read for the drafting pane
        chat.sources_for = self.sources_for
        chat.conversations_changed.connect(self._forget_deleted_chats)

    # --- matters ----------------------------------------------------------------------------

    def matters(self) -> list[Matter]:
        return self.index.matters()

    def create_matter(self, name: str, paths: Iterable[str | Path] = ()) -> int:
        matter_id = self.index.create_matter(name)
        paths = list(paths)
        if paths:
            self.index.add_paths(matter_id, paths)
        self.matters_changed.emit()
        if paths:
            self.reindex(matter_id)
        return matter_id

    def rename_matter(self, matter_id: int, name: str) -> None:
        self.index.rename_matter(matter_id, name)
        self.matters_changed.emit()

    def delete_matter(self, matter_id: int) -> None:
        self.index.delete_matter(matter_id)
        self.matters_changed.emit()

    def add_to_matter(self, matter_id: int, paths: Iterable[str | Path]) -> None:
        self.index.add_paths(matter_id, paths)
        self.files_changed.emit(matter_id)
        self.reindex(matter_id)

    def remove_from_matter(self, matter_id: int, path: str) -> None:
        self.index.remove_path(matter_id, path)
        self.reindex(matter_id)

    def files(self, matter_id: int) -> list[FileInfo]:
        return self.index.files(matter_id)

    def reindex(self, matter_id: int, force: bool = False) -> None:
        """Read new and changed files (all of them with ``force``) in the background."""

        def work(ctx: TaskContext) -> SyncReport:
            return self.index.sync(
                matter_id, ctx.progress, lambda: ctx.cancel.cancelled, force=force
            )

        def done(report: SyncReport) -> None:
            self.busy -= 1
            self.files_changed.emit(matter_id)
            self.indexed.emit(matter_id, report)
            if report.failed:
                _name, why = report.failed[0]
                more = len(report.failed) - 1
                self.failed.emit(
                    VeilError(why + (f" (and {more} more file{'s' * (more > 1)})" if more else ""))
                )

        def failed(err: VeilError) -> None:
            self.busy -= 1
            self.files_changed.emit(matter_id)
            self.failed.emit(err)

        self.busy += 1
        self.executor.submit(
            Task(
                "index",
                work,
                on_done=done,
                on_error=failed,
                on_progress=lambda s, f: self.progress.emit(s, f),
            )
        )

    # --- chats ------------------------------------------------------------------------------

    def matter_of_chat(self, conv_id: int | None) -> Matter | None:
        if conv_id is None:
            return None
        matter_id = self.index.matter_of_chat(conv_id)
        return self.index.matter(matter_id) if matter_id is not None else None

    def chat_files(self, conv_id: int | None) -> list[FileInfo]:
        m = self.matter_of_chat(conv_id)
        return self.index.files(m.id) if m else []

    def attach(self, paths: Iterable[str | Path], conv_id: int | None = None) -> int:
        """Attach files to a chat (the current one, or a new one); in a matter's chat they are
        added to the matter. Returns the matter they went to."""
        paths = list(paths)
        if not paths:
            raise VeilError("no files to attach")
        if conv_id is None:
            conv_id = self.chat.current if self.chat.current is not None else None
        if conv_id is None:
            conv_id = self.chat.new_conversation()
        matter_id = self.index.chat_matter(conv_id)
        self.add_to_matter(matter_id, paths)
        return matter_id

    def detach(self, conv_id: int, path: str) -> None:
        m = self.matter_of_chat(conv_id)
        if m is not None:
            self.remove_from_matter(m.id, path)

    def set_chat_matter(self, conv_id: int, matter_id: int | None) -> None:
        """Put a chat in a named matter (None: none). Files attached to the chat alone are
        dropped from the index then."""
        self.index.link_chat(conv_id, matter_id)
        self.files_changed.emit(matter_id)

    def new_chat_in(self, matter_id: int) -> int:
        conv_id = self.chat.new_conversation()
        self.index.link_chat(conv_id, matter_id)
        m = self.index.matter(matter_id)
        if m is not None:
            self.chat.rename(conv_id, f"{m.name}: new question")
        self.chat.open(conv_id)  # views refresh with the matter now known
        return conv_id

    def sources_for(
        self,
        conv_id: int,
        messages: list[dict[str, str]],
        tokenizer: Any,
        limit: int,
        progress: Progress | None = None,
    ) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
        """For a reply (engine thread): re-index what changed, then the messages with the
        passages put into the last one, and the sources used (as stored with the reply)."""
        matter_id = self.index.matter_of_chat(conv_id)
        if matter_id is None:
            return messages, []
        self.index.sync(matter_id, progress)
        out, sources = with_sources(self.index, matter_id, messages, tokenizer, limit)
        return out, [s.to_dict() for s in sources]

    def _forget_deleted_chats(self) -> None:
        store = self.chat.store
        self.index.forget_chats(lambda conv: store.conversation(conv) is not None)

    # --- the drafting pane ------------------------------------------------------------------

    def open_file(self, path: str | Path, done: Callable[[Extracted], None]) -> None:
        """Read a file for the drafting pane (in the background); ``done`` gets its text."""

        def finished(doc: Extracted) -> None:
            self.busy -= 1
            done(doc)

        def failed(err: VeilError) -> None:
            self.busy -= 1
            self.failed.emit(err)

        self.busy += 1
        self.executor.submit(
            Task(
                "open file",
                lambda ctx: extract(path, ctx.progress),
                on_done=finished,
                on_error=failed,
                on_progress=lambda s, f: self.progress.emit(s, f),
            )
        )


def is_chat_matter(m: Matter | None) -> bool:
    return m is not None and m.kind == KIND_CHAT


def sources_of(stats: dict[str, Any]) -> list[Source]:
    """The sources stored with a reply."""
    raw = stats.get("sources") if isinstance(stats, dict) else None
    return [Source.from_dict(d) for d in raw or [] if isinstance(d, dict)]
