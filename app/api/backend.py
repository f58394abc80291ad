"""What the API runs requests on: the engine (a runner of its own for ``veil api``, or the
app's :class:`~app.core.engine_host.EngineHost`, at the app's privacy setting), and the queue
that runs them one at a time in arrival order."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from app.api.errors import ApiError
from engine.generate import CancelToken, GenerationResult, generate
from engine.sampling import SamplingParams

log = logging.getLogger("veil.api")

MAX_WAITING = 16  # requests waiting for the engine; more get 429


class Backend(ABC):
    """Runs on the queue's thread, except :meth:`model_id`."""

    @abstractmethod
    def model_id(self) -> str:
        """The name /v1/models lists and requests must use."""

    @abstractmethod
    def ready(self) -> Any:
        """Load and connect as needed; returns the tokenizer."""

    @abstractmethod
    def context_length(self) -> int: ...

    @abstractmethod
    def defaults(self) -> SamplingParams:
        """Decoding settings for what a request leaves out (max_new_tokens: the default
        length of a chat reply)."""

    @abstractmethod
    def generate(
        self,
        ids: list[int],
        params: SamplingParams,
        on_text: Callable[[str], None],
        cancel: CancelToken,
    ) -> GenerationResult: ...

    def close(self) -> None:  # noqa: B027 - optional
        """Release what the backend holds."""


class RunnerBackend(Backend):
    """``veil api``: a runner of its own (the trunk on a server, in this process, or none)."""

    def __init__(
        self, runner: Any, decoder: str = "sequential", defaults: SamplingParams | None = None
    ) -> None:
        self.runner, self.decoder = runner, decoder
        self._defaults = defaults or SamplingParams(max_new_tokens=512)

    def model_id(self) -> str:
        return str(self.runner.client.name)

    def ready(self) -> Any:
        return self.runner.client.tokenizer

    def context_length(self) -> int:
        return int(self.runner.client.config.max_position_embeddings)

    def defaults(self) -> SamplingParams:
        return self._defaults

    def generate(
        self,
        ids: list[int],
        params: SamplingParams,
        on_text: Callable[[str], None],
        cancel: CancelToken,
    ) -> GenerationResult:
        return generate(
            self.runner, ids, params, decoder=self.decoder, on_text=on_text, cancel=cancel
        )

    def close(self) -> None:
        if self.runner.trunk is not None:
            self.runner.trunk.close()


class HostBackend(Backend):
    """The app's engine: the same model, server and privacy setting as the window (the app's
    replies and the API's take turns at the engine)."""

    def __init__(self, host: Any, settings: Any) -> None:
        self.host, self.settings = host, settings

    def model_id(self) -> str:
        if self.host.runner is not None:
            return str(self.host.runner.client.name)
        spec = str(self.settings.model).strip()
        return spec if "/" in spec else spec.lower()

    def ready(self) -> Any:
        return self.host.ensure_ready_blocking().client.tokenizer

    def context_length(self) -> int:
        return int(self.host.ensure_ready_blocking().client.config.max_position_embeddings)

    def defaults(self) -> SamplingParams:
        return self.settings.sampling()  # type: ignore[no-any-return]

    def generate(
        self,
        ids: list[int],
        params: SamplingParams,
        on_text: Callable[[str], None],
        cancel: CancelToken,
    ) -> GenerationResult:
        return self.host.generate_blocking(  # type: ignore[no-any-return]
            ids, params, on_text=on_text, cancel=cancel
        )


class JobQueue:
    """One thread runs the jobs, first come first served; at most ``max_waiting`` wait."""

    def __init__(self, max_waiting: int = MAX_WAITING) -> None:
        self.max_waiting = max_waiting
        self._jobs: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.Queue()
        )
        self._lock = threading.Lock()
        self._waiting = 0
        self.started = 0  # jobs begun (tests check the order through it)
        self._thread = threading.Thread(target=self._run, name="veil-api-engine", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        with self._lock:
            if self._waiting >= self.max_waiting:
                raise ApiError(
                    429,
                    f"{self._waiting} requests are already waiting for the model; try again "
                    "in a moment",
                    "rate_limit_error",
                    "queue_full",
                )
            self._waiting += 1
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fn, fut = item
            with self._lock:
                self._waiting -= 1
            if not fut.set_running_or_notify_cancel():
                continue  # the client went away while waiting
            self.started += 1
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)
