"""Streaming detokenization: text deltas per token whose concatenation equals a one-shot decode.

Each push decodes only a short window (the tokens since the last emitted boundary plus the
ones before it), so the total cost is O(n) in the number of tokens. A delta is held back while
the window ends in an incomplete UTF-8 sequence (U+FFFD), and the window includes the previous
token so tokenizers that strip a leading space from the first token decode consistently.
"""

from __future__ import annotations

from typing import Any


class StreamingDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this index have been emitted

    def _decode(self, ids: list[int]) -> str:
        return str(
            self.tokenizer.decode(
                ids,
                skip_special_tokens=self.skip_special,
                clean_up_tokenization_spaces=False,
            )
        )

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Emit whatever is held back (e.g. an incomplete character at the very end)."""
        if self._read == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        delta = new_text[len(prefix_text) :]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta
