"""Generate and validate a Triton model repository: ensemble, preprocessing, tensorrt_llm,
postprocessing. Configs are built as Triton's own ModelConfig protobuf and written as text."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from ..errors import PackageError
from ..fsio import link_or_copy

# (name, data type, dims, optional) — the tensors each model exposes.
Tensor = tuple[str, str, tuple[int, ...], bool]

PREPROCESSING_IN: tuple[Tensor, ...] = (
    ("QUERY", "TYPE_STRING", (1,), False),
    ("REQUEST_OUTPUT_LEN", "TYPE_INT32", (1,), False),
    ("END_ID", "TYPE_INT32", (1,), True),
    ("PAD_ID", "TYPE_INT32", (1,), True),
    ("STOP_WORDS_DICT", "TYPE_STRING", (-1,), True),
    ("BAD_WORDS_DICT", "TYPE_STRING", (-1,), True),
)
PREPROCESSING_OUT: tuple[Tensor, ...] = (
    ("INPUT_ID", "TYPE_INT32", (-1,), False),
    ("REQUEST_INPUT_LEN", "TYPE_INT32", (1,), False),
    ("REQUEST_OUTPUT_LEN", "TYPE_INT32", (-1,), False),
    ("OUT_END_ID", "TYPE_INT32", (1,), False),
    ("OUT_PAD_ID", "TYPE_INT32", (1,), False),
    ("STOP_WORDS_IDS", "TYPE_INT32", (2, -1), False),
    ("BAD_WORDS_IDS", "TYPE_INT32", (2, -1), False),
)
TRTLLM_IN: tuple[Tensor, ...] = (
    ("input_ids", "TYPE_INT32", (-1,), False),
    ("input_lengths", "TYPE_INT32", (1,), False),
    ("request_output_len", "TYPE_INT32", (1,), False),
    ("end_id", "TYPE_INT32", (1,), True),
    ("pad_id", "TYPE_INT32", (1,), True),
    ("runtime_top_k", "TYPE_INT32", (1,), True),
    ("runtime_top_p", "TYPE_FP32", (1,), True),
    ("temperature", "TYPE_FP32", (1,), True),
    ("random_seed", "TYPE_UINT64", (1,), True),
    ("streaming", "TYPE_BOOL", (1,), True),
    ("stop_words_list", "TYPE_INT32", (2, -1), True),
    ("bad_words_list", "TYPE_INT32", (2, -1), True),
)
TRTLLM_OUT: tuple[Tensor, ...] = (
    ("output_ids", "TYPE_INT32", (-1, -1), False),
    ("sequence_length", "TYPE_INT32", (-1,), False),
)
POSTPROCESSING_IN: tuple[Tensor, ...] = (
    ("TOKENS_BATCH", "TYPE_INT32", (-1, -1), False),
    ("SEQUENCE_LENGTH", "TYPE_INT32", (-1,), False),
)
POSTPROCESSING_OUT: tuple[Tensor, ...] = (("OUTPUT", "TYPE_STRING", (-1,), False),)
ENSEMBLE_IN: tuple[Tensor, ...] = (
    ("text_input", "TYPE_STRING", (1,), False),
    ("max_tokens", "TYPE_INT32", (1,), False),
    ("end_id", "TYPE_INT32", (1,), True),
    ("pad_id", "TYPE_INT32", (1,), True),
    ("top_k", "TYPE_INT32", (1,), True),
    ("top_p", "TYPE_FP32", (1,), True),
    ("temperature", "TYPE_FP32", (1,), True),
    ("random_seed", "TYPE_UINT64", (1,), True),
    ("stream", "TYPE_BOOL", (1,), True),
    ("stop_words", "TYPE_STRING", (-1,), True),
    ("bad_words", "TYPE_STRING", (-1,), True),
)
ENSEMBLE_OUT: tuple[Tensor, ...] = (("text_output", "TYPE_STRING", (-1,), False),)

# Ensemble steps: (model, {model input: ensemble tensor}, {model output: ensemble tensor}).
ENSEMBLE_STEPS: tuple[tuple[str, dict[str, str], dict[str, str]], ...] = (
    (
        "preprocessing",
        {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "END_ID": "end_id", "PAD_ID": "pad_id",
         "STOP_WORDS_DICT": "stop_words", "BAD_WORDS_DICT": "bad_words"},
        {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN",
         "OUT_END_ID": "_END_ID", "OUT_PAD_ID": "_PAD_ID", "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
         "BAD_WORDS_IDS": "_BAD_WORDS_IDS"},
    ),
    (
        "tensorrt_llm",
        {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN", "request_output_len": "_REQUEST_OUTPUT_LEN",
         "end_id": "_END_ID", "pad_id": "_PAD_ID", "runtime_top_k": "top_k", "runtime_top_p": "top_p",
         "temperature": "temperature", "random_seed": "random_seed", "streaming": "stream",
         "stop_words_list": "_STOP_WORDS_IDS", "bad_words_list": "_BAD_WORDS_IDS"},
        {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"},
    ),
    (
        "postprocessing",
        {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
        {"OUTPUT": "text_output"},
    ),
)  # fmt: skip


@dataclass(frozen=True)
class RepositoryOptions:
    """What the generated configs depend on."""

    max_batch_size: int
    max_input_len: int
    max_beam_width: int
    engine_path: str  # gpt_model_path as the serving container sees it
    decoupled: bool = False
    kv_cache_free_gpu_mem_fraction: float = 0.9


def _io(
    message: type,
    tensors: tuple[Tensor, ...],
    *,
    ragged: tuple[str, ...] = (),
    reshape: tuple[str, ...] = (),
) -> list:
    out = []
    for name, dtype, dims, optional in tensors:
        item = message(name=name, data_type=mc.DataType.Value(dtype), dims=list(dims))
        if message is mc.ModelInput:
            item.optional = optional
            item.allow_ragged_batch = name in ragged
            if name in reshape:
                item.reshape.SetInParent()  # reshape: { shape: [ ] } — the backend takes scalars
        out.append(item)
    return out


def _params(config: mc.ModelConfig, values: dict[str, str]) -> None:
    for key, value in values.items():
        config.parameters[key].string_value = value


def model_configs(opts: RepositoryOptions) -> dict[str, mc.ModelConfig]:
    """The four model configs as ModelConfig messages."""
    cpu = [mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)]
    pre = mc.ModelConfig(
        name="preprocessing",
        backend="python",
        max_batch_size=opts.max_batch_size,
        input=_io(mc.ModelInput, PREPROCESSING_IN),
        output=_io(mc.ModelOutput, PREPROCESSING_OUT),
        instance_group=cpu,
        dynamic_batching=mc.ModelDynamicBatching(),
    )
    _params(
        pre,
        {
            "tokenizer_dir": "tokenizer",
            "add_special_tokens": "true",
            "max_input_len": str(opts.max_input_len),
        },
    )
    scalars = tuple(n for n, _, dims, _ in TRTLLM_IN if dims == (1,))
    llm = mc.ModelConfig(
        name="tensorrt_llm",
        backend="tensorrtllm",
        max_batch_size=opts.max_batch_size,
        input=_io(
            mc.ModelInput,
            TRTLLM_IN,
            ragged=("input_ids", "stop_words_list", "bad_words_list"),
            reshape=scalars,
        ),
        output=_io(mc.ModelOutput, TRTLLM_OUT),
        instance_group=cpu,
        dynamic_batching=mc.ModelDynamicBatching(),
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=opts.decoupled),
    )
    _params(
        llm,
        {
            "gpt_model_type": "inflight_fused_batching",
            "gpt_model_path": opts.engine_path,
            "max_beam_width": str(opts.max_beam_width),
            "batch_scheduler_policy": "guaranteed_no_evict",
            "kv_cache_free_gpu_mem_fraction": str(opts.kv_cache_free_gpu_mem_fraction),
            "exclude_input_in_output": "true",
            "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        },
    )
    post = mc.ModelConfig(
        name="postprocessing",
        backend="python",
        max_batch_size=opts.max_batch_size,
        input=_io(mc.ModelInput, POSTPROCESSING_IN),
        output=_io(mc.ModelOutput, POSTPROCESSING_OUT),
        instance_group=cpu,
        dynamic_batching=mc.ModelDynamicBatching(),
    )
    _params(post, {"tokenizer_dir": "../preprocessing/tokenizer", "skip_special_tokens": "true"})
    steps = [
        mc.ModelEnsembling.Step(
            model_name=model, model_version=-1, input_map=inputs, output_map=outputs
        )
        for model, inputs, outputs in ENSEMBLE_STEPS
    ]
    ens = mc.ModelConfig(
        name="ensemble",
        platform="ensemble",
        max_batch_size=opts.max_batch_size,
        input=_io(mc.ModelInput, ENSEMBLE_IN),
        output=_io(mc.ModelOutput, ENSEMBLE_OUT),
        ensemble_scheduling=mc.ModelEnsembling(step=steps),
    )
    return {"ensemble": ens, "preprocessing": pre, "tensorrt_llm": llm, "postprocessing": post}  # fmt: skip


def write_repository(
    work: Path, opts: RepositoryOptions, tokenizer_files: list[Path], engine_dir: Path | None
) -> None:
    """Write the repository into `work` (the caller makes it appear atomically)."""
    models = resources.files("trt_builder.triton") / "python_models"
    for name, config in model_configs(opts).items():
        (work / name / "1").mkdir(parents=True)
        (work / name / "config.pbtxt").write_text(text_format.MessageToString(config))
        if config.backend == "python":
            (work / name / "1" / "model.py").write_text((models / f"{name}.py").read_text())
    tokenizer_dir = work / "preprocessing" / "tokenizer"
    tokenizer_dir.mkdir()
    for path in tokenizer_files:
        shutil.copy2(path, tokenizer_dir / path.name)
    if engine_dir is not None:
        for path in sorted(engine_dir.iterdir()):
            if path.is_file():
                link_or_copy(path, work / "tensorrt_llm" / "1" / "engine" / path.name)
    validate_repository(work)


def _load(path: Path) -> mc.ModelConfig:
    config = mc.ModelConfig()
    try:
        text_format.Parse(path.read_text(), config)
    except text_format.ParseError as exc:
        raise PackageError(
            f"{path.parent.name}/config.pbtxt does not parse as Triton's ModelConfig: {exc}"
        ) from None
    return config


def validate_repository(root: Path) -> dict[str, mc.ModelConfig]:
    """Parse every config.pbtxt with Triton's schema and check the ensemble's wiring."""
    configs = {p.parent.name: _load(p) for p in sorted(root.glob("*/config.pbtxt"))}
    if not configs:
        raise PackageError(f"{root} holds no model (no */config.pbtxt)")
    for name, config in configs.items():
        if config.name and config.name != name:
            raise PackageError(
                f"model {name}: config.pbtxt says name {config.name!r}; it must match its directory"
            )
        if not (root / name / "1").is_dir():
            raise PackageError(f"model {name}: version directory 1/ is missing")
        if config.backend == "python" and not (root / name / "1" / "model.py").is_file():
            raise PackageError(f"model {name}: python backend without 1/model.py")
    for name, config in configs.items():
        if config.platform == "ensemble":
            _check_ensemble(name, config, configs)
    return configs


def _check_ensemble(name: str, ens: mc.ModelConfig, configs: dict[str, mc.ModelConfig]) -> None:
    available = {t.name: t.data_type for t in ens.input}
    for step in ens.ensemble_scheduling.step:
        target = configs.get(step.model_name)
        if target is None:
            raise PackageError(
                f"ensemble {name}: step model {step.model_name!r} is not in the repository"
            )
        inputs = {t.name: t for t in target.input}
        outputs = {t.name: t for t in target.output}
        for model_in, tensor in step.input_map.items():
            if model_in not in inputs:
                raise PackageError(f"ensemble {name}: {step.model_name} has no input {model_in!r}")
            if tensor not in available:
                raise PackageError(
                    f"ensemble {name}: tensor {tensor!r} feeding {step.model_name}.{model_in} is produced by no earlier step or ensemble input"
                )
            if available[tensor] != inputs[model_in].data_type:
                raise PackageError(
                    f"ensemble {name}: {tensor!r} is {mc.DataType.Name(available[tensor])} but {step.model_name}.{model_in} takes {mc.DataType.Name(inputs[model_in].data_type)}"
                )
        missing = [t for t, spec in inputs.items() if not spec.optional and t not in step.input_map]
        if missing:
            raise PackageError(
                f"ensemble {name}: required input {missing[0]!r} of {step.model_name} is not mapped"
            )
        for model_out, tensor in step.output_map.items():
            if model_out not in outputs:
                raise PackageError(
                    f"ensemble {name}: {step.model_name} has no output {model_out!r}"
                )
            available[tensor] = outputs[model_out].data_type
    for out in ens.output:
        if out.name not in available:
            raise PackageError(f"ensemble {name}: output {out.name!r} is produced by no step")
