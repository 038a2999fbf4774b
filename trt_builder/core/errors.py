"""Typed errors: each carries the exit code the CLI returns and a message that names the fix."""

from __future__ import annotations


class TrtBuilderError(Exception):
    """Base of every error trt-builder raises on purpose."""

    exit_code = 1


class SpecError(TrtBuilderError):
    """The build spec (flags or TOML) is invalid."""

    exit_code = 2


class InputError(TrtBuilderError):
    """A model, checkpoint or file given as input is missing, malformed or refused."""

    exit_code = 3


class UnsupportedModelError(InputError):
    """The architecture is not in the registry."""

    exit_code = 4


class ConversionError(TrtBuilderError):
    """Conversion found a tensor it cannot map, or a shape or value it refuses."""

    exit_code = 5


class VerifyFailed(TrtBuilderError):
    """A verify gate failed: the converted model does not answer like the reference."""

    exit_code = 6


class EngineError(TrtBuilderError):
    """trtllm-build is missing (with --require-engine) or failed; TensorRT-LLM is missing (or
    too old) for verify's tensorrt-llm and llmapi runtimes."""

    exit_code = 7


class PackageError(TrtBuilderError):
    """The Triton repository failed validation."""

    exit_code = 8


class OutputError(TrtBuilderError):
    """An output cannot be written (disk full, no permission)."""

    exit_code = 10


class LockBusy(TrtBuilderError):
    """Another build holds the lock of the same target."""

    exit_code = 9


class HubUnreachable(InputError):
    """The hub could not be reached (network), as opposed to answering no."""


class TritonError(TrtBuilderError):
    """A live Triton deployment refused a request, timed out, or answered what a trt-builder
    repository does not (infer, verify --runtime triton)."""

    exit_code = 12


class NightlyFailed(TrtBuilderError):
    """A nightly run had an entry that failed its gates, errored, or regressed."""

    exit_code = 11


EXIT_CODES: dict[int, str] = {
    0: "success (a skipped engine stage without --require-engine is success)",
    1: "unexpected internal error (rerun with --debug and report it)",
    2: "invalid build spec or command-line usage",
    3: "bad input: model, checkpoint, file or network access",
    4: "unsupported model architecture",
    5: "conversion error (unmapped tensor, wrong shape, NaN/Inf)",
    6: "verify gate failed",
    7: "engine build failed, or TensorRT-LLM missing (--require-engine; verify --runtime "
    "tensorrt-llm or llmapi)",
    8: "Triton repository failed validation",
    9: "another build of the same target holds the lock",
    10: "an output cannot be written (disk full, no permission)",
    11: "nightly: a fleet entry failed its gates, errored, or regressed from the last good run",
    12: "a Triton request failed: refused, timed out, or not a trt-builder deployment",
    130: "interrupted (Ctrl-C)",
}
