"""The Triton repository of `--target llmapi`: one Python model, `tensorrt_llm`, in the layout of
TensorRT-LLM's `triton_backend/all_models/llmapi/` template (docs/llmapi.md): `config.pbtxt`,
`1/model.py`, `1/model.yaml` (its keys are `LLM()` arguments, and `triton_config`), and the
Hugging Face checkpoint it names (`1/checkpoint/`). Text in, text out: no tokenizer models, no
ensemble; a vision-language checkpoint's repository also declares main's optional `image_url`
input and sets `triton_config.multimodal` (TensorRT-LLM's model.py on main reads both; 1.2.1's
declares no image input and reads neither), which the reference backend refuses.

The configs are written complete (upstream's launch_triton_server.py starts tritonserver with
--disable-auto-complete-config, so config.pbtxt cannot rely on model.py's auto-completion):
no max_batch_size (upstream's model.py takes one prompt per request, batching in flight), the
transaction policy in both files, agreeing. model.py is TensorRT-LLM's own ([triton] backend
tensorrtllm, or auto where TensorRT-LLM is installed): model.py and helpers.py are links to
the template where the NGC container keeps it (TEMPLATE), so the repository runs the release
the container ships; or trt-builder's reference backend (python_models/llmapi.py), which
answers the template's contract with the checkpoint runtime where TensorRT-LLM is not
installed, and says it is a PyTorch reference.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from ...core.errors import PackageError, UnsupportedModelError
from ...core.fsio import link_or_copy
from ...core.stage import BuildContext
from ...models.registry import family_for
from ...triton.kinds import Packager, RepositoryKind, packager, register_kind
from ...triton.repository import INFO, model_versions, next_version
from .spec import LlmApiTarget

#: (name, data type, dims, optional): the template's tensors as TensorRT-LLM 1.2.1 ships them
#: (triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt@c8c6df08; issue
#: triton-inference-server/server#8945 lists the same inputs for v1.2.1). main added lora_* and
#: image_url inputs after 1.2.1 (PRs #14079, #18381): lora_* are not written here, image_url
#: only for a vision-language checkpoint (IMAGE_IN).
LLMAPI_IN: tuple[tuple[str, str, tuple[int, ...], bool], ...] = (
    ("text_input", "TYPE_STRING", (-1,), False),
    ("streaming", "TYPE_BOOL", (1,), True),
    ("sampling_param_best_of", "TYPE_INT32", (1,), True),
    ("sampling_param_temperature", "TYPE_FP32", (1,), True),
    ("sampling_param_top_k", "TYPE_INT32", (1,), True),
    ("sampling_param_top_p", "TYPE_FP32", (1,), True),
    ("sampling_param_frequency_penalty", "TYPE_FP32", (1,), True),
    ("sampling_param_presence_penalty", "TYPE_FP32", (1,), True),
    ("sampling_param_max_tokens", "TYPE_INT32", (1,), True),
    ("sampling_param_stop", "TYPE_STRING", (-1,), True),
    ("sampling_param_seed", "TYPE_UINT64", (1,), True),
    ("sampling_param_exclude_input_from_output", "TYPE_BOOL", (1,), True),
    ("sampling_param_return_perf_metrics", "TYPE_BOOL", (1,), True),
    ("return_finish_reason", "TYPE_BOOL", (1,), True),
    ("return_stop_reason", "TYPE_BOOL", (1,), True),
    ("return_cumulative_logprob", "TYPE_BOOL", (1,), True),
    ("stop", "TYPE_BOOL", (1,), True),
)
#: main's image input (config.pbtxt@0a71057313ec, PR #18381): one URL (http(s) or data:) per
#: image, read by its model.py where model.yaml sets triton_config.multimodal.
IMAGE_IN = ("image_url", "TYPE_STRING", (-1,), True)
LLMAPI_OUT: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("text_output", "TYPE_STRING", (-1,)),
    ("finish_reason", "TYPE_STRING", (-1,)),
    ("stop_reason", "TYPE_STRING", (-1,)),
    ("cumulative_logprob", "TYPE_FP32", (-1,)),
    ("kv_cache_reused_block", "TYPE_INT32", (-1,)),
    ("kv_cache_missed_block", "TYPE_INT32", (-1,)),
    ("kv_cache_alloc_new_blocks", "TYPE_INT32", (-1,)),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32", (-1,)),
    ("kv_cache_hit_rate", "TYPE_FP32", (-1,)),
    ("arrival_time_ns", "TYPE_INT64", (1,)),
    ("first_scheduled_time_ns", "TYPE_INT64", (1,)),
    ("first_token_time_ns", "TYPE_INT64", (1,)),
    ("last_token_time_ns", "TYPE_INT64", (1,)),
    ("acceptance_rate", "TYPE_FP32", (1,)),
    ("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
    ("total_draft_tokens", "TYPE_INT32", (1,)),
)
#: model.yaml's keys: the template's (model, backend, tensor_parallel_size,
#: pipeline_parallel_size, triton_config) and the `LLM()` arguments the memory plan sets.
YAML_KEYS = ("model", "backend", "tensor_parallel_size", "pipeline_parallel_size",
             "max_batch_size", "max_num_tokens", "max_seq_len", "kv_cache_config",
             "triton_config")  # fmt: skip
MODEL = "tensorrt_llm"
#: What the reference backend says it is, in its config and wherever it is named.
REFERENCE = "trt-builder reference backend (llmapi contract): a PyTorch reference, not TensorRT-LLM"
CHECKPOINT = "checkpoint"
#: Where the NGC container (nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3) keeps the
#: template's model (Triton's own tutorials copy the repository from /app/all_models/llmapi/):
#: a repository for TensorRT-LLM's own model links its model.py and helpers.py there.
TEMPLATE = "/app/all_models/llmapi/tensorrt_llm/1"
TEMPLATE_FILES = ("model.py", "helpers.py")


@dataclass(frozen=True)
class LlmapiOptions:
    """What the llmapi repository depends on: the memory plan's limits, parallelism, the
    [triton] table, and where the serving host sees the checkpoint."""

    model_path: str  # the checkpoint as the serving host sees it (model.yaml `model`)
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    version: int = 1
    tp: int = 1
    pp: int = 1
    decoupled: bool = False
    kv_cache_free_gpu_mem_fraction: float = 0.9
    backend: str = "reference"
    images: bool = False  # a vision-language checkpoint: image_url and triton_config.multimodal


def llmapi_config(opts: LlmapiOptions) -> mc.ModelConfig:
    """tensorrt_llm's config.pbtxt: the template's, with the transaction policy set here (the
    launcher skips auto-completion) and the reference backend's parameters."""
    config = mc.ModelConfig(
        name=MODEL,
        backend="python",
        instance_group=[mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)],
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=opts.decoupled),
    )
    for name, dtype, dims, optional in LLMAPI_IN + ((IMAGE_IN,) if opts.images else ()):
        config.input.append(mc.ModelInput(name=name, data_type=mc.DataType.Value(dtype),
                                          dims=list(dims), optional=optional))  # fmt: skip
    for name, dtype, dims in LLMAPI_OUT:
        config.output.append(
            mc.ModelOutput(name=name, data_type=mc.DataType.Value(dtype), dims=list(dims))
        )
    if opts.backend == "reference":
        for key, value in {"implementation": REFERENCE, "device": "auto"}.items():
            config.parameters[key].string_value = value
    return config


def model_yaml(opts: LlmapiOptions) -> dict[str, Any]:
    """model.yaml: `LLM()` arguments, and the template's triton_config."""
    return {
        "model": opts.model_path,
        "backend": "pytorch",
        "tensor_parallel_size": opts.tp,
        "pipeline_parallel_size": opts.pp,
        "max_batch_size": opts.max_batch_size,
        "max_num_tokens": opts.max_num_tokens,
        "max_seq_len": opts.max_seq_len,
        "kv_cache_config": {"free_gpu_memory_fraction": opts.kv_cache_free_gpu_mem_fraction},
        "triton_config": {
            "max_batch_size": 0,
            "decoupled": opts.decoupled,
            **({"multimodal": True} if opts.images else {}),
        },
    }


#: The trtllm-serve options file written beside the checkpoint.
SERVE_OPTIONS = "trtllm-serve.yaml"


def serve_options(opts: LlmapiOptions) -> dict[str, Any]:
    """`trtllm-serve --extra_llm_api_options`'s YAML: the memory plan's limits and the KV
    cache's share, all in the file. Which wins where a flag and the file set the same key
    changed across releases (1.0-1.1: the file, and its kv_cache_config replaced the flag's
    whole; main since mid-2026: the flag), so the command sets none of them (docs/llmapi.md)."""
    return {
        "max_batch_size": opts.max_batch_size,
        "max_num_tokens": opts.max_num_tokens,
        "max_seq_len": opts.max_seq_len,
        "kv_cache_config": {"free_gpu_memory_fraction": opts.kv_cache_free_gpu_mem_fraction},
    }


def trtllm_serve_command(opts: LlmapiOptions, port: int = 8000) -> list[str]:
    """trtllm-serve's argv for the checkpoint, outside Triton: flags every release from 1.0 to
    main takes (`--extra_llm_api_options`, not 1.2's `--config` alias; the short parallelism
    names), on all interfaces (its default host is localhost)."""
    where = opts.model_path.rsplit("/", 1)[0]
    return ["trtllm-serve", opts.model_path, "--backend", "pytorch", "--host", "0.0.0.0",
            "--port", str(port), "--tp_size", str(opts.tp), "--pp_size", str(opts.pp),
            "--extra_llm_api_options", f"{where}/{SERVE_OPTIONS}"]  # fmt: skip


def write_llmapi_repository(work: Path, opts: LlmapiOptions, checkpoint: Path, info: str) -> None:
    """Write the repository into `work` (the caller publishes it): the model at version
    `opts.version`, the checkpoint beside model.py (hard links where it can), the INFO file
    (`info`: its name), then validate it."""
    opts = replace(opts, images=takes_images(checkpoint))
    version = work / MODEL / str(opts.version)
    version.mkdir(parents=True)
    (work / MODEL / "config.pbtxt").write_text(text_format.MessageToString(llmapi_config(opts)))
    if opts.backend == "tensorrtllm":  # TensorRT-LLM's own model, where the container has it
        for name in TEMPLATE_FILES:
            (version / name).symlink_to(f"{TEMPLATE}/{name}")
    else:
        models = resources.files("trt_builder.triton") / "python_models"
        (version / "model.py").write_text((models / "llmapi.py").read_text())
    (version / "model.yaml").write_text(yaml.safe_dump(model_yaml(opts), sort_keys=False))
    (version / SERVE_OPTIONS).write_text(yaml.safe_dump(serve_options(opts), sort_keys=False))
    for path in sorted(checkpoint.iterdir()):
        if path.is_file() and path.name != "stage.json":
            link_or_copy(path, version / CHECKPOINT / path.name)
    data = {**asdict(opts), "target": "llmapi", "engine_included": False}
    (work / info).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    validate_llmapi(work)


def takes_images(checkpoint: Path) -> bool:
    """Whether the Hugging Face checkpoint in `checkpoint` is a vision-language model's (its
    family has a vision tower, which the llmapi target writes)."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
        return bool(family_for(config).vision_tower)
    except (OSError, ValueError, UnsupportedModelError):
        return False


def latest_version(root: Path) -> Path | None:
    """The llmapi repository `root`'s newest tensorrt_llm version directory (None: none)."""
    versions = model_versions(root / MODEL) if (root / MODEL).is_dir() else []
    return root / MODEL / str(versions[-1]) if versions else None


def uses_template(version: Path) -> bool:
    """Whether the repository version `version` runs TensorRT-LLM's own llmapi model (its
    model.py a link to the container's template), not the reference backend."""
    return (version / "model.py").is_symlink()


def template_here() -> bool:
    """Whether this host has the template where the container keeps it."""
    return all(Path(TEMPLATE, name).is_file() for name in TEMPLATE_FILES)


def validate_llmapi(root: Path) -> mc.ModelConfig:
    """The llmapi repository against the template's contract: config.pbtxt parses with Triton's
    schema and declares the template's tensors (and main's optional image_url, with
    model.yaml's triton_config.multimodal, for a vision-language checkpoint); model.yaml holds
    only known keys and agrees with it on the transaction policy; no batch dimension (model.py
    takes 1-D text_input); the checkpoint it names is whole where it lies in this repository."""
    path = root / MODEL / "config.pbtxt"
    config = mc.ModelConfig()
    try:
        text_format.Parse(path.read_text(), config)
    except (OSError, text_format.ParseError) as exc:
        raise PackageError(
            f"{MODEL}/config.pbtxt does not parse as Triton's ModelConfig: {exc}"
        ) from None
    if config.backend != "python" or config.max_batch_size != 0:
        raise PackageError(
            f"{MODEL}: the llmapi model is a python model without max_batch_size (one prompt a "
            "request): repackage it"
        )
    have = {t.name: (mc.DataType.Name(t.data_type), tuple(t.dims)) for t in config.input}
    latest = latest_version(root)
    if latest is None:
        raise PackageError(f"model {MODEL}: no version directory (e.g. {MODEL}/1/)")
    images = takes_images(latest / CHECKPOINT) or IMAGE_IN[0] in have
    for name, dtype, dims, _ in LLMAPI_IN + ((IMAGE_IN,) if images else ()):
        if have.get(name) != (dtype, dims):
            raise PackageError(
                f"{MODEL}: input {name} is {have.get(name)}, the template's is {(dtype, dims)}"
            )
    if uses_template(latest):
        for name in TEMPLATE_FILES:
            if (
                not (latest / name).is_symlink()
                or os.readlink(latest / name) != f"{TEMPLATE}/{name}"
            ):
                raise PackageError(
                    f"model {MODEL}: {latest.name}/{name} must link to {TEMPLATE}/{name} (the "
                    "NGC container's template): repackage it"
                )
        if "implementation" in config.parameters:
            raise PackageError(f"model {MODEL}: the reference backend's parameters on "
                               "TensorRT-LLM's own model: repackage it")  # fmt: skip
    for name in ("model.py", "model.yaml"):
        if not (latest / name).is_file() and not (latest / name).is_symlink():
            raise PackageError(f"model {MODEL}: {latest.name}/{name} is missing: repackage it")
    try:
        found = yaml.safe_load((latest / "model.yaml").read_text())
    except yaml.YAMLError as exc:
        raise PackageError(f"{MODEL}/{latest.name}/model.yaml is not YAML: {exc}") from None
    unknown = sorted(set(found or {}) - set(YAML_KEYS))
    if not isinstance(found, dict) or unknown or "model" not in found:
        raise PackageError(f"{MODEL}/{latest.name}/model.yaml: unknown keys {unknown} or no model")
    if images and not (
        next(t for t in config.input if t.name == IMAGE_IN[0]).optional
        and (found.get("triton_config") or {}).get("multimodal")
    ):
        raise PackageError(
            f"{MODEL}: image_url must be optional (text-only requests omit it) and model.yaml's "
            "triton_config must set multimodal: true (main's model.py ignores images without "
            "it): repackage it"
        )
    decoupled = bool((found.get("triton_config") or {}).get("decoupled"))
    if decoupled != config.model_transaction_policy.decoupled:
        raise PackageError(
            f"{MODEL}: model.yaml says decoupled {decoupled}, config.pbtxt "
            f"{config.model_transaction_policy.decoupled}: they must agree (model.py checks one, "
            "Triton the other)"
        )
    where = latest / CHECKPOINT
    if where.is_dir() and not all(
        (where / n).is_file() for n in ("config.json", "model.safetensors")
    ):
        raise PackageError(f"model {MODEL}: {where} lacks config.json or model.safetensors")
    return config


def needs_template(repository: Path) -> None:
    """Refuse an llmapi repository that runs TensorRT-LLM's own model.py on a host without the
    template it links to (anywhere but the NGC container), before a server starts."""
    latest = latest_version(repository)
    if latest is not None and uses_template(latest) and not template_here():
        raise PackageError(
            f"{repository} runs TensorRT-LLM's own llmapi model.py, linked from {TEMPLATE}, "
            "which this host lacks: serve it in the NGC container "
            "(nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3), or package with "
            "--backend reference"
        )


def llmapi_backend(chosen: str) -> str:
    """The llmapi model's backend for [triton] backend `chosen`: "auto" is "tensorrtllm" (the
    template's model.py, TensorRT-LLM's own) where TensorRT-LLM is installed, as the engine
    target's auto is its backend where the engine was built; else "reference"."""
    if chosen != "auto":
        return chosen
    return "tensorrtllm" if importlib.util.find_spec("tensorrt_llm") is not None else "reference"


def llmapi_options(ctx: BuildContext, version: int) -> LlmapiOptions:
    """The llmapi repository's options for published version `version`: the memory plan's
    limits (as `LLM()` arguments), tp and pp, the [triton] table, and the checkpoint's path
    where the serving host sees the repository. [triton] backend auto is TensorRT-LLM's own
    model where TensorRT-LLM is installed (the NGC container), else the reference backend."""
    triton, limits = ctx.spec.triton, ctx.spec.limits
    root = triton.serve_root or str(ctx.layout.triton_root.resolve())
    if limits.max_batch_size is None or limits.max_num_tokens is None:
        raise PackageError("internal: the llmapi repository needs the memory plan's limits")
    return LlmapiOptions(
        model_path=f"{root}/{ctx.layout.triton_name}/{MODEL}/{version}/{CHECKPOINT}",
        max_batch_size=limits.max_batch_size,
        max_num_tokens=limits.max_num_tokens,
        max_seq_len=limits.max_seq_len,
        version=version,
        tp=ctx.spec.tp,
        pp=ctx.spec.pp,
        decoupled=triton.streaming,
        kv_cache_free_gpu_mem_fraction=triton.kv_cache_free_gpu_mem_fraction,
        backend=llmapi_backend(triton.backend),
    )


def is_llmapi(configs: dict[str, mc.ModelConfig]) -> bool:
    """An llmapi repository: its tensorrt_llm model takes text (the template's text_input)."""
    llm = configs.get(MODEL)
    return llm is not None and any(t.name == "text_input" for t in llm.input)


def tokenizer(root: Path) -> Path | None:
    """The llmapi checkpoint holds its tokenizer."""
    latest = latest_version(root)
    return None if latest is None else latest / CHECKPOINT


register_kind(RepositoryKind(
    target=LlmApiTarget,
    claims=is_llmapi,
    validate=lambda root, configs: {MODEL: validate_llmapi(root)},
    models=lambda configs: (MODEL,),
    tokenizer=tokenizer,
    check_host=needs_template,
))  # fmt: skip


class LlmapiPackager(Packager):
    """The llmapi model, its model.yaml and the checkpoint it serves."""

    def inputs(self, ctx: BuildContext) -> dict[str, Path]:
        return {"checkpoint": ctx.layout.checkpoint}  # the checkpoint holds its tokenizer

    def params(self, ctx: BuildContext) -> dict[str, Any]:
        # Version 0 stands for whichever version is published next: not part of the key.
        return {"llmapi": asdict(llmapi_options(ctx, 0))}

    def run(self, ctx: BuildContext, work: Path) -> dict[str, Any]:
        options = llmapi_options(ctx, next_version(ctx.layout.triton))
        write_llmapi_repository(work, options, ctx.layout.checkpoint, INFO)
        return {
            "command": shlex.join(trtllm_serve_command(options)),
            "models": [MODEL],
            "version": options.version,
            "backend": options.backend,
            "target": "llmapi",
            "engine_included": False,
            "note": f"tensorrt_llm (llmapi) runs on the {REFERENCE}: serve it anywhere "
            "(trt-builder serve)"
            if options.backend == "reference"
            else "tensorrt_llm (llmapi) "
            f"runs TensorRT-LLM's own model.py, linked from {TEMPLATE} (the NGC container's "
            "template): serve it in that container",
        }


packager.register(LlmApiTarget)(lambda target: LlmapiPackager())
