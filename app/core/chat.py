"""Chat: conversations, sending, streaming, stop, regenerate, edit-and-resend, export.

Qt-free. Every change is written to the store as it happens; streamed text is saved at most
every half second and when the reply ends, so a crash loses almost nothing.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from app.core.engine_host import CONNECTED, LOCAL, OFFLINE, EngineHost
from app.core.long_message import (
    READ_CHUNK,
    LengthCheck,
    ReadingClock,
    check_length,
    prompt_room,
    shows_reading,
)
from app.core.settings import Settings
from app.core.storage import Message, StorageError, Store
from app.core.summarise import fit_final, plan_parts, summarise_parts
from app.core.tasks import Event, Executor, Task, TaskContext
from engine.chat import prompt_ids
from engine.errors import GenerationError, VeilError
from engine.generate import GenerationResult, Prefill
from engine.sampling import SamplingParams

SAVE_EVERY_S = 0.5
NEW_CHAT_TITLE = "New chat"
# Regenerate writes a different reply, as in LM Studio and Jan: it always samples, with a fresh
# seed; when the chat's creativity is 0 (always the most likely words, the default) it samples
# at this creativity and word-choice range instead, since greedy would repeat the reply.
REGENERATE_TEMPERATURE = 0.7
REGENERATE_TOP_P = 0.9
REGENERATE_NOTE = (
    "At 0 the same message always gets the same reply. ↻ Regenerate always writes a different "
    f"one: it picks words at random (creativity {REGENERATE_TEMPERATURE} when this is 0), like "
    "regenerating in LM Studio or Jan."
)


def regenerate_params(base: SamplingParams, seed: int) -> SamplingParams:
    """The decoding settings of a regenerated reply (see REGENERATE_TEMPERATURE)."""
    if base.greedy:
        return replace(
            base,
            temperature=REGENERATE_TEMPERATURE,
            top_p=min(base.top_p, REGENERATE_TOP_P),
            seed=seed,
        )
    return replace(base, seed=seed)


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**63)


def title_from(text: str, limit: int = 40) -> str:
    """A chat's title from its first message: one line, cut after a whole word with "…"."""
    line = " ".join(text.split())
    if len(line) <= limit:
        return line
    cut = line[: limit - 1]
    if " " in cut and line[limit - 1] != " ":
        cut = cut.rsplit(" ", 1)[0]  # never half a word
    return cut.rstrip(" ,;:.-") + "…"


def fit_history(tokenizer: Any, messages: list[dict[str, str]], limit: int) -> list[int]:
    """Prompt ids for ``messages``, dropping the oldest turns (never the system prompt or the
    last message) until the prompt fits in ``limit`` tokens."""
    msgs = list(messages)
    while True:
        ids = prompt_ids(tokenizer, msgs)
        if len(ids) <= limit:
            return ids
        first = 1 if msgs and msgs[0]["role"] == "system" else 0
        if len(msgs) - first <= 1:
            raise GenerationError(
                "the message is too long for this model",
                hint="shorten the message or start a new chat",
            )
        del msgs[first]


class ChatController:
    def __init__(self, store: Store, host: EngineHost, executor: Executor, settings: Settings):
        self.store, self.host, self.executor, self.settings = store, host, executor, settings
        self.current: int | None = None
        self.busy = False  # a reply is being written (the Send button is "Stop")
        self.probing = False  # a background reconnect attempt runs (Send still works: queued)
        self._task: Task | None = None
        self._streaming: Message | None = None
        self._last_save = 0.0
        # documents (app/core/documents): (conv_id, messages, tokenizer, prompt limit, progress)
        # -> (messages with the passages put in, the sources used); None: chats have no files
        self.sources_for: Callable[..., tuple[list[dict[str, str]], list[dict[str, Any]]]] | None
        self.sources_for = None
        # events (called on the GUI thread)
        self.conversations_changed = Event()  # ()
        self.conversation_opened = Event()  # (conv_id | None)
        self.before_switch = Event()  # () another chat is about to be shown
        self.message_added = Event()  # (Message)
        self.message_updated = Event()  # (Message) streamed text so far
        self.message_removed = Event()  # (msg_id)
        self.busy_changed = Event()  # (bool)
        self.failed = Event()  # (VeilError, text to put back in the composer)
        self.gauges = Event()  # (dict)
        self.progress = Event()  # (stage, fraction)
        self.state_changed = Event()  # (state)
        self.finished = Event()  # (GenerationResult)
        # (rows read, rows in the prompt, seconds left or None) while a long prompt is read
        self.reading = Event()
        self.summarising = Event()  # (part, parts) while a too-long message is summarised
        self.restored = Event()  # (text) a message that was not sent, back to the composer
        self.read_chunk = READ_CHUNK  # prompt rows per block (tests make it small)
        self.new_seed: Callable[[], int] = fresh_seed  # Regenerate's seeds (tests fix them)

    # --- conversations ------------------------------------------------------------------------

    def is_empty(self, conv_id: int) -> bool:
        """A "New chat" with no message, no unsent text and no name given: nothing would be
        lost by removing it."""
        conv = self.store.conversation(conv_id)
        return (
            conv is not None
            and conv.title == NEW_CHAT_TITLE
            and not self.store.messages(conv_id)
            and not self.store.get(f"draft:{conv_id}")
        )

    def new_conversation(self) -> int:
        """A new chat; the open chat is reused when it is still empty (so pressing "New chat"
        twice never piles up empty chats)."""
        self.before_switch.emit()
        cur = self.current
        if cur is not None and not self.busy and self.is_empty(cur):
            self.open(cur)
            return cur
        conv_id = self.store.create_conversation(system_prompt=self.settings.system_prompt)
        self.conversations_changed.emit()
        self.open(conv_id)
        return conv_id

    def open(self, conv_id: int | None) -> None:
        if conv_id is not None and self.store.conversation(conv_id) is None:
            conv_id = None
        self.before_switch.emit()  # the view saves the unsent text of the chat it shows
        left = self.current
        self.current = conv_id
        self.store.set("last_conversation", conv_id)
        if left is not None and left != conv_id and self._remove_if_empty(left):
            self.conversations_changed.emit()
        self.conversation_opened.emit(conv_id)

    def _remove_if_empty(self, conv_id: int) -> bool:
        """Remove a chat that was left empty (never one with a message or unsent text)."""
        if not self.is_empty(conv_id):
            return False
        with contextlib.suppress(StorageError):  # (reported on store.failed)
            self.store.delete_conversation(conv_id)
            return True
        return False

    def remove_empty_chats(self) -> int:
        """At start: remove the empty "New chat" entries an older version left behind."""
        gone = 0
        for conv in self.store.conversations():
            if conv.id != self.current:
                gone += self._remove_if_empty(conv.id)
        if gone:
            self.conversations_changed.emit()
        return gone

    def restore_last(self) -> None:
        self.open(self.store.get("last_conversation"))
        self.remove_empty_chats()

    def messages(self) -> list[Message]:
        return self.store.messages(self.current) if self.current is not None else []

    def rename(self, conv_id: int, title: str) -> None:
        title = title.strip()
        if not title:
            raise VeilError("a chat needs a name")
        self.store.rename_conversation(conv_id, title)
        self.conversations_changed.emit()

    def delete(self, conv_id: int) -> None:
        if self.busy and conv_id == self.current:
            self.stop()
        self.store.delete_conversation(conv_id)
        if conv_id == self.current:
            self.open(None)
        self.conversations_changed.emit()

    def system_prompt(self) -> str:
        conv = self.store.conversation(self.current) if self.current is not None else None
        return conv.system_prompt if conv else self.settings.system_prompt

    def set_system_prompt(self, text: str) -> None:
        self.settings.system_prompt = text
        self.settings.save(self.store)
        if self.current is not None:
            self.store.set_system_prompt(self.current, text)

    def draft(self) -> str:
        return str(self.store.get(f"draft:{self.current}", "") or "")

    def save_draft(self, text: str) -> None:
        key = f"draft:{self.current}"
        if text:
            self.store.set(key, text)
        else:
            self.store.delete_key(key)

    # --- generation ---------------------------------------------------------------------------

    def _can_send(self, text: str) -> bool:
        """Not busy, ``text`` not empty, and a conversation to send it in (one is started
        when none is open; a storage error is reported on store.failed and the text stays in
        the composer)."""
        if self.busy or not text:
            return False
        if self.current is None:
            try:
                self.new_conversation()
            except StorageError:
                return False
        return True

    def send(self, text: str) -> bool:
        """Send a user message; False (and nothing changes) when busy or empty."""
        text = text.strip()
        if not self._can_send(text):
            return False
        assert self.current is not None
        if not self.store.messages(self.current):
            self.store.rename_conversation(self.current, title_from(text))
            self.conversations_changed.emit()
        try:
            user = self.store.add_message(self.current, "user", text)
        except StorageError:  # reported on store.failed; the text stays in the composer
            return False
        self.message_added.emit(user)
        self.save_draft("")
        try:
            self._start(restore=text, user_id=user.id)
        except StorageError:  # the reply could not be created: undo the turn
            with contextlib.suppress(StorageError):
                self.store.delete_messages_from(user.conversation_id, user.id)
            self.message_removed.emit(user.id)
            self.save_draft(text)
            return False
        return True

    def regenerate(self) -> bool:
        """Drop the last reply and answer the last user message again."""
        msgs = self.messages()
        if self.busy or not msgs:
            return False
        if msgs[-1].role == "assistant":
            self.store.delete_messages_from(msgs[-1].conversation_id, msgs[-1].id)
            self.message_removed.emit(msgs[-1].id)
        if not any(m.role == "user" for m in self.messages()):
            return False
        self._start(restore="", user_id=None, regenerate=True)
        return True

    def edit_last(self, text: str, in_parts: bool = False) -> bool:
        """Replace the last user message (and its reply) with ``text`` and send it
        (``in_parts``: summarised in parts first, see :meth:`send_in_parts`)."""
        msgs = self.messages()
        users = [m for m in msgs if m.role == "user"]
        if self.busy or not users or not text.strip():
            return False
        last = users[-1]
        for m in msgs:
            if m.id >= last.id:
                self.message_removed.emit(m.id)
        self.store.delete_messages_from(last.conversation_id, last.id)
        return self.send_in_parts(text) if in_parts else self.send(text)

    def send_in_parts(self, text: str) -> bool:
        """Send a message too long for the model: it is split into parts that fit, the model
        summarises each in turn (``summarising`` says which; Stop ends it and nothing is sent),
        then the request with the joined summaries is sent in place of the full text, and the
        reply's stats say how many parts it rests on. False when busy or empty."""
        text = text.strip()
        if not self._can_send(text):
            return False
        assert self.current is not None
        conv_id = self.current
        if not self.store.messages(conv_id):
            self.store.rename_conversation(conv_id, title_from(text))
            self.conversations_changed.emit()
        system = self.system_prompt()
        try:
            user = self.store.add_message(conv_id, "user", text)  # shown while it is summarised
            self.message_added.emit(user)
            waiting = self.store.add_message(conv_id, "assistant", "")
        except StorageError:
            return False
        self.message_added.emit(waiting)
        self.save_draft("")
        params = self.settings.sampling()
        host = self.host

        def work(ctx: TaskContext) -> tuple[int, str | None]:
            runner = host.ensure_ready_blocking(ctx.progress)
            tok, cfg = runner.client.tokenizer, runner.client.config
            plan = plan_parts(
                text,
                lambda t: len(tok(t, add_special_tokens=False)["input_ids"]),
                lambda msgs: len(prompt_ids(tok, msgs)),
                cfg.max_position_embeddings,
                params.max_new_tokens,
                system,
            )

            def generate(msgs: list[dict[str, str]], n_tokens: int) -> str:
                result = host.generate_blocking(
                    prompt_ids(tok, msgs),
                    replace(params, max_new_tokens=n_tokens),
                    on_text=lambda _: None,
                    cancel=ctx.cancel,
                )
                return result.text

            summaries = summarise_parts(
                plan,
                generate,
                lambda i, n: ctx.report({"summary_part": i, "summary_parts": n}),
                lambda: ctx.cancel.cancelled,
            )
            if summaries is None:
                return plan.n, None
            room = prompt_room(cfg.max_position_embeddings, params.max_new_tokens)
            plen = lambda msgs: len(prompt_ids(tok, msgs))  # noqa: E731
            return plan.n, fit_final(plan.request, summaries, plen, room, system)

        def undo() -> None:
            with contextlib.suppress(StorageError):  # (reported on store.failed)
                self.store.delete_messages_from(conv_id, user.id)
            self.message_removed.emit(waiting.id)
            self.message_removed.emit(user.id)
            if self.current == conv_id:
                self.save_draft(text)

        def on_done(out: tuple[int, str | None]) -> None:
            n, message = out
            if message is None:  # stopped: nothing was sent, the text goes back
                undo()
                self._end()
                self.restored.emit(text)
                return
            user.content = message
            try:
                self.store.update_message(user.id, user.content)
                self.store.delete_messages_from(conv_id, waiting.id)
            except StorageError:
                undo()
                self._end()
                self.restored.emit(text)
                return
            self.message_removed.emit(waiting.id)
            self.message_updated.emit(user)
            self._end()
            if self.current != conv_id:
                return
            try:
                self._start(restore=text, user_id=user.id, parts=n)
            except StorageError:
                undo()
                self.restored.emit(text)

        def on_error(err: VeilError) -> None:
            undo()
            self._end()
            self.failed.emit(err, text)

        def on_report(values: dict[str, Any]) -> None:
            if "summary_part" in values:
                i, n = int(values["summary_part"]), int(values["summary_parts"])
                self.progress.emit(f"summarising part {i} of {n}", (i - 1) / n)
                self.summarising.emit(i, n)
            else:
                self.gauges.emit(values)

        self._streaming = waiting
        self._task = Task(
            "summarise",
            work,
            on_done=on_done,
            on_error=on_error,
            on_progress=lambda s, f: self.progress.emit(s, f),
            on_report=on_report,
        )
        self._set_busy(True)
        self.executor.submit(self._task)
        return True

    def last_user_text(self) -> str:
        users = [m for m in self.messages() if m.role == "user"]
        return users[-1].content if users else ""

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel.cancel()

    def _history(self) -> list[dict[str, str]]:
        out = []
        system = self.system_prompt()
        if system.strip():
            out.append({"role": "system", "content": system})
        for m in self.messages():
            if m.role in ("user", "assistant") and (m.content or m.role == "user"):
                out.append({"role": m.role, "content": m.content})
        return out

    def can_continue(self) -> bool:
        """True when the last reply stopped at the length limit and may be extended."""
        msgs = self.messages()
        return (
            not self.busy
            and bool(msgs)
            and msgs[-1].role == "assistant"
            and msgs[-1].finish_reason == "length"
        )

    def continue_reply(self) -> bool:
        """Extend the last reply, which hit the length limit, by up to "Longest reply" tokens
        more: the model goes on from exactly where it stopped (the reply so far is the start of
        its answer), and the new text is added to the same message."""
        if not self.can_continue():
            return False
        self._start(restore="", user_id=None, extend=self.messages()[-1])
        return True

    def length_check(self, text: str) -> LengthCheck | None:
        """``text`` measured as the next message of the open chat (None while no model is
        loaded, or for an empty text)."""
        tok, cfg = self.host.tokenizer, self.host.config
        if tok is None or cfg is None or not text.strip():
            return None
        return check_length(
            tok,
            self._history(),
            text.strip(),
            cfg.max_position_embeddings,
            self.settings.max_tokens,
        )

    def _start(
        self,
        restore: str,
        user_id: int | None,
        extend: Message | None = None,
        regenerate: bool = False,
        parts: int = 0,
    ) -> None:
        assert self.current is not None
        conv_id = self.current
        history = self._history()
        if extend is not None:  # the reply being continued is the answer's start, not history
            history = history[:-1] if history and history[-1]["role"] == "assistant" else history
            reply = extend
            before = reply.content
        else:
            reply = self.store.add_message(conv_id, "assistant", "")
            before = ""
            self.message_added.emit(reply)
        self._streaming = reply
        params = self.settings.sampling()
        if regenerate:
            params = regenerate_params(params, self.new_seed())
        host = self.host
        sources_for = self.sources_for
        used: list[dict[str, Any]] = []
        chunk = self.read_chunk

        def work(ctx: TaskContext) -> tuple[GenerationResult, str]:
            runner = host.ensure_ready_blocking(ctx.progress)
            cfg = runner.client.config
            tok = runner.client.tokenizer
            start = [int(i) for i in tok.encode(before, add_special_tokens=False)] if before else []
            limit = prompt_room(cfg.max_position_embeddings, params.max_new_tokens, len(start))
            msgs = history
            if sources_for is not None:
                msgs, found = sources_for(conv_id, history, tok, limit, ctx.progress)
                used.extend(found)
            ids = fit_history(tok, msgs, limit) + start
            clock = ReadingClock()
            shown = shows_reading(len(ids), chunk)
            if shown:
                ctx.reading(0, len(ids), None)

            def read(done: int, total: int) -> None:
                if shown:
                    ctx.reading(done, total, clock.seconds_left(done, total))

            result = host.generate_blocking(
                ids,
                params,
                on_text=ctx.text,
                cancel=ctx.cancel,
                report=ctx.report,
                prefill=Prefill(chunk=chunk, on_progress=read),
            )
            if not start:
                return result, result.text
            joined = str(tok.decode(start + result.token_ids, skip_special_tokens=True))
            return result, joined if joined.startswith(before) else before + result.text

        def on_text(delta: str) -> None:
            reply.content += delta
            now = time.monotonic()
            if now - self._last_save >= SAVE_EVERY_S:
                self._last_save = now
                self.store.update_message(reply.id, reply.content)
            self.message_updated.emit(reply)

        def on_done(out: tuple[GenerationResult, str]) -> None:
            result, text = out
            reply.finish_reason = result.finish_reason
            kept = reply.stats.get("sources") if extend is not None else None
            summarised = parts or (reply.stats.get("summary_parts") if extend else None)
            reply.stats = result.stats.to_dict()
            if used or kept:
                reply.stats["sources"] = used or kept
            if summarised:  # the answer rests on summaries of a too-long message
                reply.stats["summary_parts"] = summarised
            reply.content = text
            self.store.update_message(reply.id, reply.content, result.finish_reason, reply.stats)
            self.message_updated.emit(reply)
            self._end()
            self.finished.emit(result)

        def on_error(err: VeilError) -> None:
            if extend is not None:  # keep the reply; it can be continued again
                grew = reply.content != before
                reply.finish_reason = "error" if grew else "length"
                self.store.update_message(reply.id, reply.content, reply.finish_reason)
                self.message_updated.emit(reply)
                put_back = ""
            elif reply.content:
                reply.finish_reason = "error"
                self.store.update_message(reply.id, reply.content, "error")
                self.message_updated.emit(reply)
                put_back = ""
            else:  # nothing came back: undo the turn, give the text back to the composer
                with contextlib.suppress(StorageError):  # (reported on store.failed)
                    self.store.delete_messages_from(conv_id, user_id or reply.id)
                self.message_removed.emit(reply.id)
                if user_id is not None:
                    self.message_removed.emit(user_id)
                put_back = restore
                if put_back and self.current == conv_id:
                    self.save_draft(put_back)
            self._end()
            self.failed.emit(err, put_back)

        def on_report(values: dict[str, Any]) -> None:
            self.gauges.emit(values)

        self._task = Task(
            "chat",
            work,
            on_done=on_done,
            on_error=on_error,
            on_text=on_text,
            on_progress=lambda s, f: self.progress.emit(s, f),
            on_report=on_report,
            on_reading=lambda d, n, left: self.reading.emit(d, n, left),
        )
        self._set_busy(True)
        if extend is not None:
            reply.finish_reason = ""
            self.message_updated.emit(reply)
        self.executor.submit(self._task)

    def _end(self) -> None:
        self._task = None
        self._streaming = None
        if self.current is not None:
            self.store.touch(self.current)
        self._set_busy(False)
        self.state_changed.emit(self.host.state)

    def _set_busy(self, busy: bool) -> None:
        if busy != self.busy:
            self.busy = busy
            self.busy_changed.emit(busy)

    # --- connection -----------------------------------------------------------------------

    def needs_reconnect(self) -> bool:
        return self.host.state == OFFLINE and not self.busy and not self.probing

    def reconnect(self) -> None:
        """Try the server again in the background (the GUI calls this on a timer). This does
        not make the chat busy: a message sent meanwhile waits for the attempt (tasks run in
        order) and then connects or fails by itself."""
        if not self.needs_reconnect():
            return

        def done(_: object) -> None:
            self.probing = False
            self.state_changed.emit(self.host.state)

        self.probing = True
        self.executor.submit(
            Task(
                "reconnect",
                lambda ctx: self.host.probe_blocking(ctx.progress),
                on_done=done,
                on_error=done,
                on_progress=lambda s, f: self.progress.emit(s, f),
            )
        )

    def connected(self) -> bool:
        return self.host.state in (CONNECTED, LOCAL)

    # --- export -------------------------------------------------------------------------------

    def export_markdown(self, conv_id: int) -> str:
        conv = self.store.conversation(conv_id)
        if conv is None:
            raise VeilError("that chat no longer exists")
        lines = [f"# {conv.title}", ""]
        if conv.system_prompt:
            lines += [f"> Assistant style: {conv.system_prompt}", ""]
        names = {"user": "You", "assistant": "Veil"}
        for m in self.store.messages(conv_id):
            lines += [f"**{names.get(m.role, m.role)}:**", "", m.content, ""]
        return "\n".join(lines).rstrip() + "\n"

    def export_json(self, conv_id: int) -> str:
        conv = self.store.conversation(conv_id)
        if conv is None:
            raise VeilError("that chat no longer exists")
        data = {
            "title": conv.title,
            "system_prompt": conv.system_prompt,
            "created": conv.created,
            "messages": [
                {
                    "role": m.role,
                    "content": m.content,
                    "created": m.created,
                    "finish_reason": m.finish_reason,
                }
                for m in self.store.messages(conv_id)
            ],
        }
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
