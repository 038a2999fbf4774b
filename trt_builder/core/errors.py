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


#: Errors of the libraries trt-builder drives that are bad input, not a fault of trt-builder:
#: their class (module and name, so no library is imported to name it) -> the error it is
#: reported as, and the one line that names the fix ({0}: the library's own message).
LIBRARY_ERRORS: dict[str, tuple[type[TrtBuilderError], str]] = {
    # transformers renders chat templates in jinja's ImmutableSandboxedEnvironment
    "jinja2.exceptions.SecurityError": (
        InputError,
        "the model's chat template tried to leave jinja's sandbox ({0}): it is not run; "
        "replace the template (tokenizer_config.json's chat_template, or chat_template.jinja)",
    ),
    "jinja2.exceptions.TemplateError": (
        InputError,
        "the model's chat template does not render ({0}): fix or replace it "
        "(tokenizer_config.json's chat_template, or chat_template.jinja)",
    ),
}


def library_error(exc: BaseException) -> TrtBuilderError | None:
    """The trt-builder error a library's exception stands for (LIBRARY_ERRORS, matched on the
    exception's class or the nearest base class listed), or None: an internal error."""
    for cls in type(exc).__mro__:
        found = LIBRARY_ERRORS.get(f"{cls.__module__}.{cls.__qualname__}")
        if found is not None:
            kind, words = found
            return kind(words.format(f"{type(exc).__name__}: {exc}"))
    return None
