"""What a generation request is, apart from what runs it: the request, its sampling, the events
it produces and a step's failure. Free of torch, so that a Triton model that only forwards
requests to a model process (runtimes/model_process.py) does not load it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.errors import InputError


@dataclass(frozen=True)
class Sampling:
    """How a request's next token is chosen, as the engine target's runtime takes it
    (TensorRT-LLM's runtime_top_k, runtime_top_p, temperature, seed: 0 leaves top-k and top-p
    off), refused where its C++ executor refuses it (executor/samplingConfig.cpp, the same
    checks from 0.20 to main: ENGINE_CHECKS)."""

    top_k: int = 0
    top_p: float = 0.0
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name, (ok, message) in ENGINE_CHECKS.items():
            if not ok(getattr(self, name)):
                raise InputError(message)

    @property
    def greedy(self) -> bool:
        """TensorRT-LLM's: top-k 1, or neither top-k nor top-p, or temperature 0 (its decoder
        scales the logits by 1 / (temperature + 1e-6): the largest takes all)."""
        return self.top_k == 1 or (self.top_k == 0 and self.top_p == 0.0) or self.temperature == 0


#: What the engine target's executor accepts of each sampling value, and its refusal in its own
#: words (TLLM_CHECK's "Assertion failed: <expression>"); a top-p of 0 or less never reaches it:
#: the tensorrtllm backend drops it (utils.cc, model.py), so 0 is "off" here too.
ENGINE_CHECKS = {
    "top_k": (lambda v: v >= 0, "Assertion failed: topK.value() >= 0"),
    "top_p": (lambda v: v <= 1.0, "Assertion failed: topP.value() <= 1.f"),
    "temperature": (lambda v: v >= 0.0, "Assertion failed: temperature.value() >= 0.f"),
}
#: What TensorRT-LLM's LLM API accepts of each sampling value (SamplingParams._validate, 1.2.0rc2
#: b35ac1b6 and main), in its words; 1.0's checked none of them in Python and its executor the
#: same ranges (ENGINE_CHECKS). Read by the llmapi target's reference backend.
LLMAPI_CHECKS = {
    "temperature": (lambda v: v >= 0.0, "require temperature >= 0, got temperature={}"),
    "top_k": (lambda v: v >= 0, "require top_k >= 0, got top_k={}"),
    "top_p": (lambda v: 0.0 <= v <= 1.0, "require 0 <= top_p <= 1, got top_p={}"),
}


def llmapi_sampling(temperature: float | None = None, top_k: int | None = None,
                    top_p: float | None = None, seed: int = 0) -> Sampling:  # fmt: skip
    """The Sampling of an LLM API request's values (None: not given), with SamplingParams'
    meaning: greedy when none is given, or top_k 1, or top_p 0, or temperature 0 (its
    params_imply_greedy_decoding; examples/llm-api/llm_sampling.py's `temperature=0.0  # Greedy
    decoding`); otherwise the unset ones are temperature 1, all tokens, top-p 1. ValueError
    with the LLM API's message for a value it refuses."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    for name, value in given.items():
        ok, message = LLMAPI_CHECKS[name]
        if value is not None and not ok(value):
            raise ValueError(message.format(value))
    if all(v is None for v in given.values()) or top_k == 1 or top_p == 0.0 or temperature == 0:
        return Sampling(top_k=1, seed=seed)
    return Sampling(top_k=top_k or 0, top_p=1.0 if top_p is None else top_p,
                    temperature=1.0 if temperature is None else temperature, seed=seed)  # fmt: skip


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
