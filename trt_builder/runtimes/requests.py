"""What a generation request is, apart from what runs it: the request, its sampling, the events
it produces and a step's failure. Free of torch, so that a Triton model that only forwards
requests to a model process (runtimes/model_process.py) does not load it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.errors import InputError


@dataclass(frozen=True)
class Sampling:
    """How a request's next token is chosen (TensorRT-LLM's runtime_top_k, runtime_top_p,
    temperature, seed)."""

    top_k: int = 0
    top_p: float = 0.0
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, not {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise InputError(f"top_p must be between 0 and 1, not {self.top_p}")
        if self.temperature <= 0.0:
            raise InputError(f"temperature must be > 0, not {self.temperature}")

    @property
    def greedy(self) -> bool:
        """TensorRT-LLM's: top-k 1, or neither top-k nor top-p."""
        return self.top_k == 1 or (self.top_k == 0 and self.top_p == 0.0)


@dataclass(frozen=True)
class Request:
    """One generation request: the prompt's ids and when to stop."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    end_id: int | None = None
    stop_words: tuple[tuple[int, ...], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    sampling: Sampling = field(default_factory=Sampling)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise InputError("the prompt has no tokens: send some text")
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, not {self.max_new_tokens}")


@dataclass(frozen=True)
class Event:
    """A token a request produced; `finished` with its last one (and why)."""

    request: int  # the id submit() returned
    token: int
    finished: bool
    reason: str | None = None  # "end_id" | "stop_word" | "length"


class StepFailed(Exception):
    """A step's forward raised: the requests it held (`requests`, ids) are dropped from the
    batch; the others go on at the next step. `cause`: the exception, or the message."""

    #: Triton's error code for the requests' clients (None: Triton's default, INTERNAL)
    code: str | None = None

    def __init__(self, requests: list[int], cause: BaseException | str) -> None:
        text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(text)
        self.requests = requests


class ProcessDied(StepFailed):
    """The model process died (killed, out of memory): every request it held is cut off, and
    the client may send it again (Triton's UNAVAILABLE)."""

    code = "UNAVAILABLE"
