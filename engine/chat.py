"""Chat prompts: messages → token ids with the tokenizer's own chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.errors import GenerationError

Message = dict[str, str]


def messages_for(prompt: str, system: str | None = None) -> list[Message]:
    msgs: list[Message] = []
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": prompt})
    return msgs


def prompt_ids(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Same ids as ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``."""
    if not messages:
        raise GenerationError("no messages to send")
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(i) for i in out]
    # No template: plain concatenation (base models).
    text = "\n\n".join(m["content"] for m in messages)
    return [int(i) for i in tokenizer(text)["input_ids"]]
