"""User settings: a dataclass stored as one JSON value in the app database."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from app.core.invite import invite_problem
from app.core.storage import Store
from engine.errors import VeilError
from engine.loading import DEFAULT_MODEL
from engine.sampling import SamplingParams

# How the app gets its trunk.
MODE_DEMO = "demo"  # a veil-trunk child process on this computer ("Try it on this computer")
MODE_SERVER = "server"  # the organization's server, from an invite code
MODE_IN_PROCESS = "in-process"  # trunk layers in this process (tests, no remote module)
# The model setting that means "the organisation's model, downloaded from its server"
SERVER_MODEL = "@server"

THEMES = ("system", "light", "dark")
FONT_SIZES = (8, 20)  # the text sizes Settings offers (points); the layout is tested at both ends

# The assistant styles offered above the chat (name shown -> instructions given to the model).
PRESETS: dict[str, str] = {
    "Helpful assistant": "You are a helpful, concise assistant.",
    "Office writer": "You help office staff write clear, friendly and professional text.",
    "Explain simply": "Explain things simply, in short sentences, without jargon.",
    "No special style": "",
}

# Reply defaults for the small built-in model, measured with bench/demo_defaults.py (greedy,
# 10 office chat prompts, docs/app.md): with no penalty 7 of 10 replies looped; with 1.1, 2 of 10
# looped and 9 of 10 ended by themselves within 512 tokens (6 of 10 within 256). 1.2 stopped
# all loops but drifted off topic and rewrote text it should keep. "Fix grammar" keeps 1.0.
DEFAULT_MAX_TOKENS = 512
DEFAULT_REPETITION_PENALTY = 1.1


@dataclass
class Settings:
    first_run_done: bool = False
    mode: str = MODE_DEMO
    invite: str = ""
    model: str = DEFAULT_MODEL
    local_layers: int = 2
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY
    theme: str = "system"
    font_size: int = 10
    system_prompt: str = PRESETS["Helpful assistant"]
    device: str = "cpu"
    dtype: str = "float32"
    # "Let other programs use Veil" (app/core/api_host.py): off until switched on in Settings
    api_enabled: bool = False
    api_port: int = 8000
    api_token: str = ""

    def validate(self, check_invite: bool = True) -> None:
        """Raise :class:`VeilError` for the first bad value. ``check_invite=False`` only checks
        that an invite is present (a stored damaged code is reported when connecting, so it
        does not reset every other setting)."""
        if self.mode not in (MODE_DEMO, MODE_SERVER, MODE_IN_PROCESS):
            raise VeilError(f"unknown connection mode '{self.mode}'")
        if self.mode == MODE_SERVER and not self.invite.strip():
            raise VeilError(
                "no invite code", hint="paste the invite code your IT department gave you"
            )
        if self.model == SERVER_MODEL and self.mode != MODE_SERVER:
            raise VeilError(
                "the server's model needs your organization's server",
                hint="choose the built-in model or a model file for the demo",
            )
        if self.mode == MODE_SERVER and check_invite:
            problem = invite_problem(self.invite)
            if problem:
                raise VeilError(problem, hint="copy the whole code from your IT department again")
        if self.theme not in THEMES:
            raise VeilError(f"unknown theme '{self.theme}'", hint="light, dark or system")
        if not 6 <= self.font_size <= 32:
            raise VeilError("font size must be between 6 and 32 points")
        if self.local_layers < 1:
            raise VeilError("at least one layer must run on this computer")
        if not 1 <= int(self.api_port) <= 65535:
            raise VeilError(f"the API port {self.api_port} is not a port number (1 to 65535)")
        self.sampling().validate()

    def sampling(
        self, max_tokens: int | None = None, repetition_penalty: float | None = None
    ) -> SamplingParams:
        """Decoding settings for a chat reply (drafting passes ``repetition_penalty=1.0``)."""
        rp = self.repetition_penalty if repetition_penalty is None else repetition_penalty
        return SamplingParams(
            max_new_tokens=max_tokens or self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            repetition_penalty=rp,
        )

    @classmethod
    def load(cls, store: Store) -> Settings:
        raw: dict[str, Any] = store.get("settings", {}) or {}
        known = {f.name for f in fields(cls)}
        s = cls(**{k: v for k, v in raw.items() if k in known})
        try:
            s.validate(check_invite=False)
        except (VeilError, TypeError, ValueError):
            return cls()  # a damaged settings value never blocks the app
        return s

    def save(self, store: Store) -> None:
        store.set("settings", asdict(self))
