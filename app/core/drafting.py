"""Document drafting: instructions on a selection, streamed suggestions, accept/reject, documents.

Qt-free. A :class:`Suggestion` remembers exactly which span of the document it replaces (or
where it is inserted); :func:`apply_suggestion` is the pure text operation the editor mirrors
with an undoable cursor edit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from app.core.engine_host import EngineHost
from app.core.settings import Settings
from app.core.storage import Document, Store, write_private_file
from app.core.tasks import Event, Executor, Task, TaskContext
from engine.chat import prompt_ids
from engine.errors import VeilError
from engine.generate import GenerationResult

DEFAULT_TITLE = "Untitled document"  # shown as the title field's placeholder, never as its text

SYSTEM = (
    "You are a careful writing assistant for office staff. Reply with the requested text only: "
    "no introduction, no explanation, no quotation marks around it."
)


@dataclass(frozen=True)
class Action:
    key: str
    label: str
    instruction: str
    mode: str  # replace: the selection (or the whole text) | append: after it | insert: at cursor
    needs_text: bool = True
    short: str = ""  # button text where space is tight
    # None: the settings' repetition penalty; 1.0 where the text must be kept word for word
    repetition_penalty: float | None = None


ACTIONS: dict[str, Action] = {
    a.key: a
    for a in (
        Action(
            "outline",
            "Draft from this outline",
            "Write a complete, well-structured draft from this outline.",
            "replace",
            short="Draft from outline",
        ),
        Action(
            "formal",
            "Rewrite more formally",
            "Rewrite this text in a more formal, professional tone. Keep its meaning.",
            "replace",
            short="More formal",
        ),
        Action(
            "grammar",
            "Fix grammar and spelling",
            "Correct the grammar, spelling and punctuation of this text. Change nothing else.",
            "replace",
            short="Fix grammar",
            repetition_penalty=1.0,  # a fix keeps the words: a penalty made it change more
        ),
        Action("summarize", "Summarize", "Summarize this text in a few sentences.", "append"),
        Action(
            "continue",
            "Continue writing",
            "Continue this text with the next few sentences, in the same style.",
            "insert",
            needs_text=False,
            short="Continue writing",
        ),
        Action("custom", "Apply my instruction", "", "replace"),
    )
}


@dataclass
class Suggestion:
    action: str
    start: int  # span of the document the suggestion replaces: [start, end)
    end: int
    source: str  # the text the instruction was applied to
    instruction: str
    text: str = ""
    done: bool = False
    finish_reason: str = ""
    error: str = ""
    stats: dict[str, float] = field(default_factory=dict)


def plan_suggestion(
    action_key: str, doc: str, sel_start: int, sel_end: int, cursor: int, custom: str = ""
) -> Suggestion:
    """Work out the span and source text an action applies to (no model call)."""
    action = ACTIONS.get(action_key)
    if action is None:
        raise VeilError(f"unknown drafting action '{action_key}'")
    lo, hi = sorted((max(0, sel_start), max(0, sel_end)))
    lo, hi = min(lo, len(doc)), min(hi, len(doc))
    instruction = custom.strip() if action.key == "custom" else action.instruction
    if not instruction:
        raise VeilError("type an instruction first", hint="for example: make this shorter")
    if action.mode == "insert":
        at = hi if hi > lo else min(max(cursor, 0), len(doc))
        return Suggestion(action.key, at, at, doc[:at][-2000:], instruction)
    if hi == lo:  # no selection: the whole document
        lo, hi = 0, len(doc)
    source = doc[lo:hi]
    if action.needs_text and not source.strip():
        raise VeilError(
            "there is no text to work on", hint="write or paste some text, then select it"
        )
    if action.mode == "append":
        return Suggestion(action.key, hi, hi, source, instruction)
    return Suggestion(action.key, lo, hi, source, instruction)


def suggestion_insert_text(s: Suggestion, doc: str) -> str:
    """The exact text that accepting ``s`` puts into the document."""
    text = s.text.strip()
    if s.action == "summarize":
        return "\n\nSummary: " + text
    if s.start == s.end:  # inserted: keep one space between the words
        before = doc[: s.start]
        if before and not before[-1].isspace() and text:
            text = " " + text
        return text
    # replacing: keep the selection's own leading/trailing whitespace
    src = doc[s.start : s.end]
    lead = src[: len(src) - len(src.lstrip())]
    trail = src[len(src.rstrip()) :]
    return lead + text + trail


def apply_suggestion(doc: str, s: Suggestion) -> str:
    return doc[: s.start] + suggestion_insert_text(s, doc) + doc[s.end :]


def messages_for(s: Suggestion) -> list[dict[str, str]]:
    if s.action == "continue":
        body = f"{s.instruction}\n\nText so far:\n{s.source}"
    else:
        body = f"{s.instruction}\n\n{s.source}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": body}]


class DraftingController:
    def __init__(self, store: Store, host: EngineHost, executor: Executor, settings: Settings):
        self.store, self.host, self.executor, self.settings = store, host, executor, settings
        self.current: int | None = None
        self.suggestion: Suggestion | None = None
        self._task: Task | None = None
        self.busy = False
        self.documents_changed = Event()  # ()
        self.document_opened = Event()  # (Document | None)
        self.suggestion_started = Event()  # (Suggestion)
        self.suggestion_updated = Event()  # (Suggestion)
        self.suggestion_finished = Event()  # (Suggestion)
        self.suggestion_cleared = Event()  # ()
        self.failed = Event()  # (VeilError)
        self.busy_changed = Event()  # (bool)
        self.gauges = Event()  # (dict)
        self.progress = Event()  # (stage, fraction)

    # --- documents ----------------------------------------------------------------------------

    def new_document(self, title: str = DEFAULT_TITLE, body: str = "") -> int:
        doc_id = self.store.create_document(title, body)
        self.documents_changed.emit()
        self.open(doc_id)
        return doc_id

    def open(self, doc_id: int | None) -> Document | None:
        doc = self.store.document(doc_id) if doc_id is not None else None
        self.current = doc.id if doc else None
        self.store.set("last_document", self.current)
        self.clear_suggestion()
        self.document_opened.emit(doc)
        return doc

    def restore_last(self) -> None:
        self.open(self.store.get("last_document"))

    def save(self, body: str) -> None:
        if self.current is not None:
            self.store.save_document(self.current, body)

    def rename(self, doc_id: int, title: str) -> None:
        if not title.strip():
            raise VeilError("a document needs a name")
        self.store.rename_document(doc_id, title.strip())
        self.documents_changed.emit()

    def delete(self, doc_id: int) -> None:
        self.store.delete_document(doc_id)
        if doc_id == self.current:
            self.open(None)
        self.documents_changed.emit()

    def export(self, doc_id: int, path: Path) -> None:
        doc = self.store.document(doc_id)
        if doc is None:
            raise VeilError("that document no longer exists")
        suffix = path.suffix.lower()
        if suffix not in (".md", ".txt"):
            raise VeilError(f"cannot export as '{suffix or path.name}'", hint="use .md or .txt")
        body = doc.body if doc.body.endswith("\n") else doc.body + "\n"
        if suffix == ".md" and not body.lstrip().startswith("#"):
            body = f"# {doc.title}\n\n{body}"
        try:
            write_private_file(path, body)
        except OSError as exc:
            raise VeilError(f"cannot write {path}: {exc.strerror}") from None

    # --- suggestions ----------------------------------------------------------------------------

    def request(
        self,
        action_key: str,
        doc: str,
        sel_start: int,
        sel_end: int,
        cursor: int,
        custom: str = "",
    ) -> Suggestion | None:
        if self.busy:
            return None
        s = plan_suggestion(action_key, doc, sel_start, sel_end, cursor, custom)
        self.suggestion = s
        self.suggestion_started.emit(s)
        rp = ACTIONS[s.action].repetition_penalty
        host, params = self.host, self.settings.sampling(repetition_penalty=rp)
        msgs = messages_for(s)

        def work(ctx: TaskContext) -> GenerationResult:
            runner = host.ensure_ready_blocking(ctx.progress)
            ids = prompt_ids(runner.client.tokenizer, msgs)
            return host.generate_blocking(
                ids, params, on_text=ctx.text, cancel=ctx.cancel, report=ctx.report
            )

        def on_text(delta: str) -> None:
            s.text += delta
            self.suggestion_updated.emit(s)

        def on_done(result: GenerationResult) -> None:
            s.text, s.done, s.finish_reason = result.text, True, result.finish_reason
            s.stats = {"tokens_per_s": result.stats.decode_tok_s}
            self._end()
            self.suggestion_finished.emit(s)

        def on_error(err: VeilError) -> None:
            s.done, s.error = True, str(err)
            self._end()
            self.failed.emit(err)
            self.suggestion_finished.emit(s)

        self._task = Task(
            "draft",
            work,
            on_done=on_done,
            on_error=on_error,
            on_text=on_text,
            on_progress=lambda st, f: self.progress.emit(st, f),
            on_report=lambda v: self.gauges.emit(v),
        )
        self._set_busy(True)
        self.executor.submit(self._task)
        return s

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel.cancel()

    def accept(self, doc: str) -> str:
        """The document with the finished suggestion applied (the editor mirrors this)."""
        s = self.suggestion
        if s is None or not s.done or s.error or not s.text.strip():
            raise VeilError("there is no finished suggestion to accept")
        if s.end > len(doc):
            raise VeilError("the document changed; ask for a new suggestion")
        new = apply_suggestion(doc, s)
        self.clear_suggestion()
        return new

    def reject(self) -> None:
        self.stop()
        self.clear_suggestion()

    def clear_suggestion(self) -> None:
        if self.suggestion is not None:
            self.suggestion = None
            self.suggestion_cleared.emit()

    def _end(self) -> None:
        self._task = None
        self._set_busy(False)

    def _set_busy(self, busy: bool) -> None:
        if busy != self.busy:
            self.busy = busy
            self.busy_changed.emit(busy)
