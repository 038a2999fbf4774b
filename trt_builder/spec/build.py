"""The build spec: one typed, validated description of what to build, from flags and/or TOML."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import SpecError
from ..modes import (
    DTYPE_CHOICES,
    Mode,
    ModeOptions,
    check_alpha,
    check_group_size,
    gate_for,
    mode_for,
)
from ..modes.kvcache.spec import KV_NEEDS
from ..targets import VERIFY_RUNTIMES, Target, target_for, verify_refusal
from .gates import Gate
from .gpus import FEATURES, GPUS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SPEC_VERSION = 1


@dataclass(frozen=True)
class BuildLimits:
    """Engine build limits (trtllm-build --max_*). None: from the memory plan once the model's
    config is known (memplan.resolve_limits): the sequences of max_seq_len that the target GPU's
    KV cache holds at once, and TensorRT-LLM's 8192 tokens a step at most."""

    max_batch_size: int | None = None
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_num_tokens: int | None = None
    max_beam_width: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"limits.{f.name} must be a positive integer, got {value!r}")
        if self.max_input_len > self.max_seq_len:
            raise SpecError(
                f"limits.max_input_len ({self.max_input_len}) exceeds max_seq_len "
                f"({self.max_seq_len}): raise max_seq_len or lower max_input_len"
            )

    @property
    def resolved(self) -> bool:
        return self.max_batch_size is not None and self.max_num_tokens is not None


#: --gemm-plugin choices: auto is the checkpoint's activation dtype.
GEMM_PLUGINS = ("auto", "float16", "bfloat16")


@dataclass(frozen=True)
class EngineOptions:
    """How trtllm-build runs: the GEMM plugin's dtype, and how long the build may take."""

    gemm_plugin: str = "auto"
    timeout_s: int = 4 * 3600

    def __post_init__(self) -> None:
        if self.gemm_plugin not in GEMM_PLUGINS:
            raise SpecError(
                f"engine.gemm_plugin {self.gemm_plugin!r} is not one of {', '.join(GEMM_PLUGINS)}"
            )
        value = self.timeout_s
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"engine.timeout_s must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True)
class VerifyOptions:
    """What verify runs and the gates it applies (None = the dtype's default gate)."""

    max_new_tokens: int = 16
    device: str = "auto"
    min_top1: float | None = None
    max_kl: float | None = None
    max_ppl_delta_pct: float | None = None  # held-out perplexity increase, percent
    min_greedy: float | None = None
    heldout_tokens: int = 2048
    #: What runs the checkpoint: trt-builder's checkpoint runtime ("reference"), or vLLM's
    #: LLM() on the llmapi target's checkpoint ("vllm": .venv-vllm, docs/llmapi.md).
    runtime: str = "reference"

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens <= 512:
            raise SpecError("verify.max_new_tokens must be between 1 and 512")
        if self.device not in ("auto", "cpu", "cuda"):
            raise SpecError(f"verify.device must be auto, cpu or cuda, not {self.device!r}")
        if self.min_top1 is not None and not 0.0 <= self.min_top1 <= 1.0:
            raise SpecError("verify.min_top1 is a fraction: give a value between 0 and 1")
        if self.max_kl is not None and self.max_kl < 0:
            raise SpecError("verify.max_kl must be >= 0")
        if self.max_ppl_delta_pct is not None and self.max_ppl_delta_pct < 0:
            raise SpecError("verify.max_ppl_delta_pct is a percent increase: give a value >= 0")
        if self.min_greedy is not None and not 0.0 <= self.min_greedy <= 1.0:
            raise SpecError("verify.min_greedy is a fraction: give a value between 0 and 1")
        if self.runtime not in VERIFY_RUNTIMES:
            raise SpecError(
                f"verify.runtime must be one of {', '.join(VERIFY_RUNTIMES)}, not {self.runtime!r}"
            )
        if not 0 <= self.heldout_tokens <= 65536:
            raise SpecError(
                "verify.heldout_tokens must be between 0 and 65536 (0 skips perplexity)"
            )

    @property
    def reports_dir(self) -> str:
        """The variant's directory of this runtime's verify reports: a build verified both ways
        keeps both (reports/, reports-vllm/)."""
        return "reports" if self.runtime == "reference" else f"reports-{self.runtime}"

    def gate(self, mode: str) -> Gate:
        """The mode's default gate with this spec's overrides."""
        return gate_for(
            mode,
            min_top1=self.min_top1,
            max_kl=self.max_kl,
            max_ppl_delta_pct=self.max_ppl_delta_pct,
            min_greedy=self.min_greedy,
        )


@dataclass(frozen=True)
class Int8Options:
    """The INT8 recipes: SmoothQuant's smoothing strength and activation granularity (--dtype
    int8), weight-only's calibrated clipping (--dtype int8-wo)."""

    alpha: float | str = (
        "auto"  # "auto": searched on the corpus's search split (modes/smoothquant/recipe/search.py)
    )
    granularity: str = "per-token"  # or "per-tensor" (static activation scales)
    wo_clip: bool = True  # false: the builder's plain rounding, no calibration

    def __post_init__(self) -> None:
        alpha = check_alpha(self.alpha)  # SmoothQuant's room validates it
        object.__setattr__(self, "alpha", "auto" if alpha is None else alpha)
        if self.granularity not in ("per-token", "per-tensor"):
            raise SpecError("int8.granularity must be per-token or per-tensor")
        if not isinstance(self.wo_clip, bool):
            raise SpecError("int8.wo_clip must be true or false")


@dataclass(frozen=True)
class Fp8Options:
    """The FP8 recipe (--dtype fp8): whether the recipe stage searches each weight's rounding."""

    search: bool = True  # false: round to nearest at the amax scales, as modelopt; no recipe

    def __post_init__(self) -> None:
        if not isinstance(self.search, bool):
            raise SpecError("fp8.search must be true or false")


@dataclass(frozen=True)
class Int4Options:
    """INT4 weights (--dtype int4-awq): the group size, 0 for 128 where the model takes it, else
    64 (modes/int4_awq/spec.py)."""

    group_size: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool):
            raise SpecError(f"int4.group_size must be 64 or 128, got {self.group_size!r}")
        check_group_size(self.group_size)


@dataclass(frozen=True)
class TritonOptions:
    """The Triton deployment: streaming (decoupled) or not, the KV cache's share of free GPU
    memory, how many published versions to keep, and where the serving container sees the
    Triton root (None: this host's path)."""

    streaming: bool = False
    kv_cache_free_gpu_mem_fraction: float = 0.9
    keep: int = 3
    serve_root: str | None = None
    # the tensorrt_llm model: "auto" (the engine when one was built from this checkpoint, else
    # the reference backend), "tensorrtllm" (NVIDIA's backend; the engine added when built) or
    # "reference" (the checkpoint on trt-builder's PyTorch reference backend)
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "tensorrtllm", "reference"):
            raise SpecError(
                f"triton.backend {self.backend!r} is not one of auto, tensorrtllm, reference"
            )
        if not isinstance(self.streaming, bool):
            raise SpecError("triton.streaming is true or false")
        if not 0.05 <= self.kv_cache_free_gpu_mem_fraction <= 0.99:
            raise SpecError("triton.kv_cache_free_gpu_mem_fraction must be between 0.05 and 0.99")
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise SpecError(f"triton.keep must be at least 1 (versions kept), got {self.keep!r}")
        if self.serve_root is not None and not str(self.serve_root).startswith("/"):
            raise SpecError(
                f"triton.serve_root {self.serve_root!r} must be an absolute path in the serving "
                "container, e.g. /models"
            )


#: The default calibration set: `calibrate/data/calibration.jsonl` (its README says what it is).
BUNDLED = "bundled"


@dataclass(frozen=True)
class CalibrationOptions:
    """What is calibrated on. `batch_size` and `device` change how, not what: they are not part
    of the artifact's key."""

    dataset: str = BUNDLED  # "bundled", a .txt or .jsonl file, or "hf:NAME[:SPLIT[:FIELD]]"
    samples: int = 64
    seq_len: int = 256  # the bundled set holds about 32k SmolLM2 tokens: 64 x 256 fits
    seed: int = 0
    batch_size: int = 8
    device: str = "auto"

    def __post_init__(self) -> None:
        if not 1 <= self.samples <= 65536:
            raise SpecError("calibrate.samples must be between 1 and 65536")
        if not 8 <= self.seq_len <= 32768:
            raise SpecError("calibrate.seq_len must be between 8 and 32768")
        if not 1 <= self.batch_size <= 4096:
            raise SpecError("calibrate.batch_size must be between 1 and 4096")
        if self.device not in ("auto", "cpu", "cuda"):
            raise SpecError(f"calibrate.device must be auto, cpu or cuda, not {self.device!r}")

    def key_fields(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "samples": self.samples,
            "seq_len": self.seq_len,
            "seed": self.seed,
        }

    def slug(self) -> str:
        """A directory name for these settings (several can sit side by side)."""
        name = (
            self.dataset
            if self.dataset == BUNDLED
            else hashlib.sha256(self.dataset.encode()).hexdigest()[:8]
        )
        return f"{name}-{self.samples}x{self.seq_len}-seed{self.seed}"


@dataclass(frozen=True)
class BuildSpec:
    """Everything a build depends on besides the input files and tool versions."""

    model: str | None = None  # None: the embedded default model
    revision: str | None = None
    dtype: str = "float16"
    target: str = "engine"
    tp: int = 1
    pp: int = 1
    limits: BuildLimits = field(default_factory=BuildLimits)
    engine: EngineOptions = field(default_factory=EngineOptions)
    triton: TritonOptions = field(default_factory=TritonOptions)
    target_gpu: str = "H100-80GB"
    out: Path = Path("engines")
    triton_root: Path = Path("triton_repo")
    allow_pickle: bool = False
    require_engine: bool = False
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    calibrate: CalibrationOptions = field(default_factory=CalibrationOptions)
    kv_cache: str = "model"  # int8 or fp8: a quantized KV cache (calibrated)
    int8: Int8Options = field(default_factory=lambda: Int8Options())
    fp8: Fp8Options = field(default_factory=lambda: Fp8Options())
    int4: Int4Options = field(default_factory=lambda: Int4Options())

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise SpecError(
                f"dtype {self.dtype!r} is not supported: use one of {', '.join(DTYPE_CHOICES)}"
            )
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"{name} must be a positive integer, got {value!r}")
        target = self.build_target  # refuses a target that does not exist
        if self.target_gpu not in GPUS:
            raise SpecError(f"unknown target GPU {self.target_gpu!r}: use one of {', '.join(GPUS)}")
        if self.revision is not None and not re.fullmatch(r"[\w.\-/]+", self.revision):
            raise SpecError(f"revision {self.revision!r} is not a branch, tag or commit sha")
        mode = self.mode  # refuses a --kv-cache / --dtype combination that does not exist
        sm = GPUS[self.target_gpu].sm
        lacking = [need for need in target.gpu_needs(mode) if FEATURES[need].lacks(sm)]
        if "int8" in lacking:
            raise SpecError(
                f"--target-gpu {self.target_gpu} is SM {sm}, where TensorRT-LLM builds no INT8 "
                f"(weight-only, SmoothQuant or the INT8 KV cache; --dtype {self.dtype}, "
                f"--kv-cache {self.kv_cache}): use --dtype fp8, float16 or bfloat16 with "
                "--kv-cache model or fp8 there, or target an SM 80-90 GPU (A100, H100, H200)"
            )
        if "fp8" in lacking:
            fp8 = [flag for flag, on in ((f"--dtype {self.dtype}", "fp8" in mode.gemm_needs),
                                         ("--kv-cache fp8", KV_NEEDS.get(self.kv_cache) == "fp8"))
                   if on]  # fmt: skip
            raise SpecError(
                f"--target-gpu {self.target_gpu} is SM {sm}, which has no FP8 ({' and '.join(fp8)} "
                "need SM 89 or newer: L4, L40S, H100, H200, B200): use --dtype int8 or "
                "float16 there, with --kv-cache int8 or model"
            )
        if lacking:  # a feature without its own message above
            raise SpecError(
                f"--target-gpu {self.target_gpu}: {FEATURES[lacking[0]].why.format(sm=sm)} "
                f"(--dtype {self.dtype}): {FEATURES[lacking[0]].instead}"
            )
        refusal = (mode.kv_refusal() or target.refusal(mode, self.dtype)
                   or verify_refusal(target, self.verify.runtime, mode))  # fmt: skip
        if refusal:
            raise SpecError(refusal)
        gemm = self.engine.gemm_plugin
        if gemm != "auto" and mode.dtype != "auto" and gemm != mode.dtype:
            raise SpecError(
                f"--gemm-plugin {gemm} does not match the {mode.dtype} activations of "
                f"--dtype {self.dtype}: use --gemm-plugin auto (or {mode.dtype})"
            )

    @property
    def mode(self) -> Mode:
        alpha = None if self.int8.alpha == "auto" else float(self.int8.alpha)
        options = ModeOptions(alpha=alpha, granularity=self.int8.granularity,
                              wo_clip=self.int8.wo_clip, fp8_search=self.fp8.search,
                              group_size=self.int4.group_size)  # fmt: skip
        return mode_for(self.dtype, kv_cache=self.kv_cache, options=options)

    @property
    def build_target(self) -> Target:
        """What --target names: the stages ask it what to do (targets/)."""
        return target_for(self.target)

    @property
    def variant(self) -> str:
        """Directory name of this precision/parallelism variant, e.g. ``int8-wo-tp1-pp1``."""
        return f"{self.mode.name}{self.build_target.variant_suffix}-tp{self.tp}-pp{self.pp}"

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["out"] = str(self.out)
        data["triton_root"] = str(self.triton_root)
        data["mode"] = self.mode.to_json()
        data["spec_version"] = SPEC_VERSION
        return data


_SECTIONS = {
    "limits": BuildLimits,
    "engine": EngineOptions,
    "triton": TritonOptions,
    "verify": VerifyOptions,
    "calibrate": CalibrationOptions,
    "int8": Int8Options,
    "fp8": Fp8Options,
    "int4": Int4Options,
}
_PATH_FIELDS = ("out", "triton_root")


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    unknown = sorted(set(values) - set(_field_names(cls)))
    if unknown:
        raise SpecError(
            f"unknown key(s) {', '.join(unknown)} in {where}: valid keys are "
            f"{', '.join(_field_names(cls))}"
        )
    try:
        return cls(**values)
    except TypeError as exc:  # wrong value types the dataclass cannot take
        raise SpecError(f"invalid value in {where}: {exc}") from exc


def load_toml(path: Path) -> dict[str, Any]:
    """Read a spec TOML file into a plain dict (validated later by `make_spec`)."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise SpecError(f"config file {path} does not exist: check the --config path") from None
    except OSError as exc:
        raise SpecError(f"config file {path} cannot be read ({exc}): pass a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"config file {path} is not valid TOML: {exc}") from None


def make_spec(toml: dict[str, Any] | None = None, **flags: Any) -> BuildSpec:
    """Merge a TOML table (top-level keys plus [limits] and [verify]) with CLI flags.

    Flags that are None are unset and leave the TOML value (or the default) in place.
    """
    data = dict(toml or {})
    sections = {name: dict(data.pop(name, {}) or {}) for name in _SECTIONS}
    for key, value in flags.items():
        if value is None:
            continue
        section, _, sub = key.partition(".")
        if sub:
            sections[section][sub] = value
        else:
            data[key] = value
    for name in _PATH_FIELDS:
        if name in data:
            data[name] = Path(data[name])
    for name, cls in _SECTIONS.items():
        data[name] = _build(cls, sections[name], f"[{name}]")
    return _build(BuildSpec, data, "the build spec")
