"""Request bodies, checked with pydantic: what Veil supports of OpenAI's parameters, and a clear
400 for the rest (several choices, log probabilities, tools, pictures)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.api.errors import ApiError, bad_request
from engine.sampling import SamplingParams


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields (user, metadata ...) are ignored

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logprobs: Any = None
    # accepted as llama.cpp's and vLLM's servers do
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0)

    def check(self) -> None:
        """The checks pydantic cannot express (each request type adds its own)."""
        self.check_common()

    def check_common(self) -> None:
        if self.n != 1:
            raise bad_request("only n=1 is supported", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported (use repetition_penalty instead)", name)
        if self.logprobs not in (None, False):
            raise bad_request("logprobs are not supported", "logprobs")
        stops = self.stops()
        if len(stops) > 4:
            raise bad_request("at most 4 stop sequences", "stop")

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        items = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in items if s)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling(self, defaults: SamplingParams, max_new: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            repetition_penalty=(
                defaults.repetition_penalty
                if self.repetition_penalty is None
                else self.repetition_penalty
            ),
            seed=self.seed,
            stop=self.stops(),
        )


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None

    def text(self, index: int) -> str:
        if self.role in ("tool", "function"):
            raise bad_request("tool and function messages are not supported", f"messages[{index}]")
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"only text content is supported (got '{part.type}')",
                    f"messages[{index}].content",
                )
            parts.append(part.text)
        return "".join(parts)


class ChatRequest(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        self.check_common()
        if self.tools or self.functions:
            raise bad_request("tools and function calling are not supported", "tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise bad_request("only the text response format is supported", "response_format")

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        out = []
        for i, m in enumerate(self.messages):
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text(i)})
        return out


class CompletionRequest(_Base):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request("only best_of=1 is supported", "best_of")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str) and len(p) != 1:
            raise bad_request("send one prompt per request", "prompt")

    def wanted_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default

    def prompt_ids(self, tokenizer: Any) -> list[int]:
        p = self.prompt
        if isinstance(p, list) and (not p or isinstance(p[0], int)):
            vocab = len(tokenizer)
            if any(not 0 <= int(t) < vocab for t in p):
                raise bad_request(f"token ids must be in [0, {vocab})", "prompt")
            return [int(t) for t in p]
        text = p[0] if isinstance(p, list) else p
        return [int(i) for i in tokenizer(str(text))["input_ids"]]


def parse(model: type[_Base], raw: Any) -> Any:
    """The request, or a 400 naming the first bad field."""
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        req = model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise ApiError(
            400, f"{loc}: {err.get('msg', 'invalid value')}", param=loc or None
        ) from None
    req.check()
    return req
