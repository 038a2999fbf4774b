"""Generate and validate a Triton model repository: ensemble, preprocessing, tensorrt_llm,
postprocessing. Configs are built as Triton's own ModelConfig protobuf and written as text."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from ..core.errors import PackageError
from ..core.fsio import link_or_copy, replace_symlink
from ..source.portable import copy_portable
from .conformance import common_tensors, required_parameters

# (name, data type, dims, optional) — the tensors each model exposes.
Tensor = tuple[str, str, tuple[int, ...], bool]

PREPROCESSING_IN: tuple[Tensor, ...] = (
    ("QUERY", "TYPE_STRING", (1,), True),  # plain text, or
    ("MESSAGES", "TYPE_STRING", (1,), True),  # a JSON chat, rendered with the chat template
    # optional so that a request without max_tokens reaches preprocessing, which refuses it in
    # words (a required input left out makes Triton's ensemble end with no response at all)
    ("REQUEST_OUTPUT_LEN", "TYPE_INT32", (1,), True),
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
#: The tensorrt_llm model's tensors, as the backend of every pinned release reads them
#: (conformance.py, from upstream's source: the seed is "seed", input_ids optional as there).
TRTLLM_IN: tuple[Tensor, ...] = common_tensors("inputs")
TRTLLM_OUT: tuple[Tensor, ...] = common_tensors("outputs")
POSTPROCESSING_IN: tuple[Tensor, ...] = (
    ("TOKENS_BATCH", "TYPE_INT32", (-1, -1), False),
    ("SEQUENCE_LENGTH", "TYPE_INT32", (-1,), False),
)
POSTPROCESSING_OUT: tuple[Tensor, ...] = (("OUTPUT", "TYPE_STRING", (-1,), False),)
ENSEMBLE_IN: tuple[Tensor, ...] = (
    ("text_input", "TYPE_STRING", (1,), True),  # one of text_input and messages
    ("messages", "TYPE_STRING", (1,), True),
    ("max_tokens", "TYPE_INT32", (1,), True),  # required: preprocessing refuses its absence
    ("end_id", "TYPE_INT32", (1,), True),
    ("pad_id", "TYPE_INT32", (1,), True),
    ("top_k", "TYPE_INT32", (1,), True),
    ("top_p", "TYPE_FP32", (1,), True),
    ("temperature", "TYPE_FP32", (1,), True),
    ("seed", "TYPE_UINT64", (1,), True),  # the upstream ensemble's name too
    ("stream", "TYPE_BOOL", (1,), True),
    ("stop_words", "TYPE_STRING", (-1,), True),
    ("bad_words", "TYPE_STRING", (-1,), True),
)
ENSEMBLE_OUT: tuple[Tensor, ...] = (("text_output", "TYPE_STRING", (-1,), False),)

# Ensemble steps: (model, {model input: ensemble tensor}, {model output: ensemble tensor}).
ENSEMBLE_STEPS: tuple[tuple[str, dict[str, str], dict[str, str]], ...] = (
    (
        "preprocessing",
        {"QUERY": "text_input", "MESSAGES": "messages", "REQUEST_OUTPUT_LEN": "max_tokens", "END_ID": "end_id", "PAD_ID": "pad_id",
         "STOP_WORDS_DICT": "stop_words", "BAD_WORDS_DICT": "bad_words"},
        {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN",
         "OUT_END_ID": "_END_ID", "OUT_PAD_ID": "_PAD_ID", "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
         "BAD_WORDS_IDS": "_BAD_WORDS_IDS"},
    ),
    (
        "tensorrt_llm",
        {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN", "request_output_len": "_REQUEST_OUTPUT_LEN",
         "end_id": "_END_ID", "pad_id": "_PAD_ID", "runtime_top_k": "top_k", "runtime_top_p": "top_p",
         "temperature": "temperature", "seed": "seed", "streaming": "stream",
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
    """What the generated configs depend on: the engine's own build config and the spec's
    [triton] table (options_from_engine), never typed twice."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_beam_width: int
    engine_path: str  # gpt_model_path as the serving container sees it
    version: int = 1  # the Triton model version of every model in this repository
    world_size: int = 1  # tp x pp: tritonserver runs under mpirun with this many ranks
    decoupled: bool = False  # streaming responses
    kv_cache_free_gpu_mem_fraction: float = 0.9
    enable_chunked_context: bool = False  # needs paged context FMHA in the engine
    enable_kv_cache_reuse: bool = False  # likewise
    # "tensorrtllm": the engine, run by NVIDIA's backend; "reference": the checkpoint, run by
    # trt-builder's PyTorch reference backend (python_models/tensorrt_llm.py), no engine needed
    backend: str = "tensorrtllm"


def options_from_engine(
    engine_config: dict[str, Any],
    *,
    engine_path: str,
    version: int,
    decoupled: bool,
    kv_cache_free_gpu_mem_fraction: float,
) -> RepositoryOptions:
    """Repository options from an engine's config.json (or the planned one,
    engine.planned_engine_config): limits, beam width, world size, and chunked context and KV
    reuse only where the engine has paged context FMHA on a paged KV cache."""
    try:
        build = engine_config["build_config"]
        plugin = build.get("plugin_config") or {}
        mapping = engine_config["pretrained_config"].get("mapping") or {}
        paged_kv = str(build.get("kv_cache_type", "PAGED")).upper() == "PAGED" or bool(
            plugin.get("paged_kv_cache")
        )
        paged_context = paged_kv and bool(plugin.get("use_paged_context_fmha"))
        return RepositoryOptions(
            max_batch_size=int(build["max_batch_size"]),
            max_input_len=int(build["max_input_len"]),
            max_seq_len=int(build["max_seq_len"]),
            max_beam_width=int(build.get("max_beam_width", 1)),
            engine_path=engine_path,
            version=version,
            world_size=int(mapping.get("world_size", 1)),
            decoupled=decoupled,
            kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction,
            enable_chunked_context=paged_context,
            enable_kv_cache_reuse=paged_context,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PackageError(
            f"the engine's config.json lacks what the repository needs ({exc!r}): rebuild the "
            "engine with trt-builder engine --force"
        ) from None


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


#: The backends the tensorrt_llm model can have.
BACKENDS = ("tensorrtllm", "reference")
#: What the reference backend says it is, in its config and wherever it is named.
REFERENCE = "trt-builder reference backend: a PyTorch reference, not TensorRT-LLM"


def model_configs(opts: RepositoryOptions) -> dict[str, mc.ModelConfig]:
    """The four model configs as ModelConfig messages."""
    if opts.backend not in BACKENDS:
        raise PackageError(f"unknown backend {opts.backend!r}: use one of {', '.join(BACKENDS)}")
    reference = opts.backend == "reference"
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
            "max_seq_len": str(opts.max_seq_len),
        },
    )
    scalars = tuple(n for n, _, dims, _ in TRTLLM_IN if dims == (1,))
    llm = mc.ModelConfig(
        name="tensorrt_llm",
        backend="python" if reference else "tensorrtllm",
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
            **required_parameters(),  # what a pinned release reads unguarded (conformance.py)
            "gpt_model_type": "inflight_fused_batching",
            "gpt_model_path": opts.engine_path,
            "max_beam_width": str(opts.max_beam_width),
            "batch_scheduler_policy": "guaranteed_no_evict",
            "kv_cache_free_gpu_mem_fraction": str(opts.kv_cache_free_gpu_mem_fraction),
            "enable_chunked_context": str(opts.enable_chunked_context).lower(),
            "enable_kv_cache_reuse": str(opts.enable_kv_cache_reuse).lower(),
            "exclude_input_in_output": "true",
            "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        },
    )
    if reference:  # the checkpoint beside model.py, where torch finds a GPU or on the CPU
        _params(llm, {"checkpoint_dir": "checkpoint", "device": "auto",
                      "implementation": REFERENCE, "max_seq_len": str(opts.max_seq_len)})  # fmt: skip
        del llm.parameters["gpt_model_path"]
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
    # the ensemble is the BLS model, not Triton's ensemble scheduler, which tells a running
    # step neither that its client left nor (through a stream) how its text joins up
    configs = {"ensemble": bls_config(opts.max_batch_size, opts.decoupled, "ensemble"),
               "preprocessing": pre, "tensorrt_llm": llm, "postprocessing": post}  # fmt: skip
    if opts.decoupled:  # under upstream's name too, where clients of its BLS look for it
        configs[BLS] = bls_config(opts.max_batch_size, opts.decoupled)
    return configs


#: The BLS model's name in tensorrtllm_backend, which a streaming repository serves it as too.
BLS = "tensorrt_llm_bls"
#: model.py of each python model whose source is another model's (name -> that model's name).
SOURCES = {"ensemble": BLS}


def bls_config(max_batch_size: int, decoupled: bool, name: str = BLS) -> mc.ModelConfig:
    """The BLS model (tensorrt_llm_bls's model.py) as `name`: the ensemble's inputs and output;
    it runs the ensemble's first two steps (given as data in `steps`) by BLS and detokenizes
    the answer itself, streamed where `decoupled` (as tensorrt_llm is)."""
    bls = mc.ModelConfig(
        name=name,
        backend="python",
        max_batch_size=max_batch_size,
        input=_io(mc.ModelInput, ENSEMBLE_IN),
        output=_io(mc.ModelOutput, ENSEMBLE_OUT),
        instance_group=[mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)],
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=decoupled),
    )
    _params(bls, {
        "tokenizer_dir": "../preprocessing/tokenizer",
        "skip_special_tokens": "true",  # as postprocessing decodes
        "accumulate_tokens": "false",  # upstream's parameter: true sends all the text so far
        "tensorrt_llm_model_name": "tensorrt_llm",
        "steps": json.dumps([list(step) for step in ENSEMBLE_STEPS[:2]]),
    })  # fmt: skip
    return bls


#: Written at the repository's root: what serve-command and package --check read.
INFO = "trt-builder-repository.json"


def write_repository(
    work: Path,
    opts: RepositoryOptions,
    tokenizer_files: list[Path],
    engine_dir: Path | None,
    checkpoint_dir: Path | None = None,
) -> None:
    """Write the repository into `work` (the caller makes it appear atomically), every model
    at version `opts.version`, then validate it. The reference backend ships `checkpoint_dir`
    beside its model.py (hard links where the file system allows)."""
    if opts.backend == "reference" and checkpoint_dir is None:
        raise PackageError("internal: the reference backend needs the checkpoint to ship")
    models = resources.files("trt_builder.triton") / "python_models"
    version = str(opts.version)
    for name, config in model_configs(opts).items():
        (work / name / version).mkdir(parents=True)
        (work / name / "config.pbtxt").write_text(text_format.MessageToString(config))
        if config.backend == "python":  # preprocessing, postprocessing, the reference backend
            source = models / f"{SOURCES.get(name, name)}.py"
            (work / name / version / "model.py").write_text(source.read_text())
    tokenizer_dir = work / "preprocessing" / "tokenizer"
    tokenizer_dir.mkdir()
    for path in tokenizer_files:  # read by transformers 4.57 in TensorRT-LLM 1.x's containers
        copy_portable(path, tokenizer_dir / path.name)
    shipped = (
        [(engine_dir, "engine")] if engine_dir is not None and opts.backend != "reference" else []
    )
    if opts.backend == "reference":
        assert checkpoint_dir is not None
        shipped = [(checkpoint_dir, "checkpoint")]
    for source, where in shipped:
        for path in sorted(source.iterdir()):
            if path.is_file() and path.name != "stage.json":
                link_or_copy(path, work / "tensorrt_llm" / version / where / path.name)
    info = {
        **asdict(opts),
        "engine_included": engine_dir is not None and opts.backend != "reference",
    }
    (work / INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    check_repository(
        work, {p.parent.name: load_config(p) for p in sorted(work.glob("*/config.pbtxt"))}
    )


def load_config(path: Path) -> mc.ModelConfig:
    config = mc.ModelConfig()
    try:
        text_format.Parse(path.read_text(), config)
    except text_format.ParseError as exc:
        raise PackageError(
            f"{path.parent.name}/config.pbtxt does not parse as Triton's ModelConfig: {exc}"
        ) from None
    return config


def model_versions(model_dir: Path) -> list[int]:
    """A Triton model directory's version numbers, oldest first."""
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


#: Loaded explicitly on the first rank (and tensorrt_llm_bls where the repository has it); the
#: other ranks load only the engine.
MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble")


def served_models(configs: dict[str, mc.ModelConfig]) -> tuple[str, ...]:
    """The models serve loads from a repository whose configs are `configs`."""
    return MODELS + ((BLS,) if BLS in configs else ())


def check_repository(root: Path, configs: dict[str, mc.ModelConfig]) -> dict[str, mc.ModelConfig]:
    """The engine target's repository at `root`, whose parsed configs are `configs`: each
    model's version directories, the python models' model.py, the engine the tensorrt_llm model
    points to (where it lies in this repository) and the ensemble's wiring (each input produced
    upstream, data types and dims agreeing). Raises PackageError naming the model and tensor."""
    for name, config in configs.items():
        if config.name and config.name != name:
            raise PackageError(
                f"model {name}: config.pbtxt says name {config.name!r}; it must match its directory"
            )
        versions = model_versions(root / name)
        if not versions:
            raise PackageError(f"model {name}: no version directory (e.g. {name}/1/)")
        latest = root / name / str(versions[-1])
        if config.backend == "python" and not (latest / "model.py").is_file():
            raise PackageError(f"model {name}: python backend without {latest.name}/model.py")
        if config.backend == "tensorrtllm":
            _check_engine_path(root, name, config)
        if name == "tensorrt_llm" and config.backend == "python":
            _check_checkpoint(name, latest, config)
    for name, config in configs.items():
        if config.platform == "ensemble":
            _check_ensemble(name, config, configs)
        if config.backend == "python" and "steps" in config.parameters:  # a BLS model
            _check_bls(name, config, configs)
    return configs


def _check_bls(name: str, bls: mc.ModelConfig, configs: dict[str, mc.ModelConfig]) -> None:
    """The BLS model's steps are wired as an ensemble's would be, to a tensorrt_llm that
    streams where it streams (its transaction policy is the one it calls with)."""
    try:
        steps = json.loads(bls.parameters["steps"].string_value)
        as_ensemble = mc.ModelConfig(name=name, input=bls.input, ensemble_scheduling=mc.ModelEnsembling(step=[
            mc.ModelEnsembling.Step(model_name=m, model_version=-1, input_map=i, output_map=o)
            for m, i, o in steps]))  # fmt: skip
    except (KeyError, ValueError, TypeError):
        raise PackageError(
            f"model {name}: parameter steps is not the JSON list of its steps"
        ) from None
    _check_ensemble(name, as_ensemble, configs)
    llm = configs.get(steps[-1][0]) if steps else None
    decoupled = bls.model_transaction_policy.decoupled
    if llm is None or llm.model_transaction_policy.decoupled != decoupled:
        how = "a decoupled" if decoupled else "a non-decoupled"
        raise PackageError(f"model {name}: its last step must be {how} tensorrt_llm model, as "
                           "it is (model_transaction_policy)")  # fmt: skip


def _check_engine_path(root: Path, name: str, config: mc.ModelConfig) -> None:
    """gpt_model_path must be absolute; inside this repository it must hold the engine (a
    repository packaged before its engine was built says so in its INFO file)."""
    path = (
        config.parameters["gpt_model_path"].string_value
        if "gpt_model_path" in config.parameters
        else ""
    )
    if not path.startswith("/"):
        raise PackageError(
            f"model {name}: parameter gpt_model_path {path!r} must be the engine directory's "
            "absolute path in the serving container"
        )
    try:
        info = json.loads((root / INFO).read_text())
    except (OSError, ValueError):
        info = {}
    inside = Path(path).resolve().is_relative_to(root.resolve())
    if inside and info.get("engine_included", True):
        engine = Path(path)
        ranks = int(info.get("world_size", 1))
        missing = [
            f"rank{r}.engine" for r in range(ranks) if not (engine / f"rank{r}.engine").is_file()
        ]
        if missing or not (engine / "config.json").is_file():
            raise PackageError(
                f"model {name}: gpt_model_path {path} lacks {(missing or ['config.json'])[0]}: "
                "rerun trt-builder package once the engine is built"
            )


def _check_checkpoint(name: str, version: Path, config: mc.ModelConfig) -> None:
    """The reference backend's checkpoint: config.json and a rank file per rank."""
    where = version / config.parameters["checkpoint_dir"].string_value
    try:
        world = json.loads((where / "config.json").read_text())["mapping"]["world_size"]
    except (OSError, ValueError, KeyError, TypeError):
        raise PackageError(
            f"model {name}: {where} holds no TensorRT-LLM checkpoint config.json: repackage it "
            "with trt-builder package --backend reference"
        ) from None
    missing = [r for r in range(int(world)) if not (where / f"rank{r}.safetensors").is_file()]
    if missing:
        raise PackageError(f"model {name}: {where} lacks rank{missing[0]}.safetensors")


def _dims_agree(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b, strict=True))


def _check_ensemble(name: str, ens: mc.ModelConfig, configs: dict[str, mc.ModelConfig]) -> None:
    available = {t.name: (t.data_type, list(t.dims)) for t in ens.input}
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
            dtype, dims = available[tensor]
            want = inputs[model_in]
            if dtype != want.data_type:
                raise PackageError(
                    f"ensemble {name}: {tensor!r} is {mc.DataType.Name(dtype)} but {step.model_name}.{model_in} takes {mc.DataType.Name(want.data_type)}"
                )
            if not _dims_agree(dims, list(want.dims)):
                raise PackageError(
                    f"ensemble {name}: {tensor!r} has dims {dims} but {step.model_name}.{model_in} takes {list(want.dims)}"
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
            available[tensor] = (outputs[model_out].data_type, list(outputs[model_out].dims))
    for out in ens.output:
        if out.name not in available:
            raise PackageError(f"ensemble {name}: output {out.name!r} is produced by no step")
        dtype, dims = available[out.name]
        if dtype != out.data_type or not _dims_agree(dims, list(out.dims)):
            raise PackageError(
                f"ensemble {name}: output {out.name!r} is declared {mc.DataType.Name(out.data_type)} {list(out.dims)} but its step gives {mc.DataType.Name(dtype)} {dims}"
            )


#: Published versions of a repository live in <triton_root>/.versions/<name>/<N>/;
#: <triton_root>/<name> is a symlink to the current one (what tritonserver is given).
VERSIONS = ".versions"


def versions_dir(link: Path) -> Path:
    return link.parent / VERSIONS / link.name


def published_versions(link: Path) -> list[int]:
    where = versions_dir(link)
    return model_versions(where) if where.is_dir() else []


def current_version(link: Path) -> int | None:
    """The version `link` points to, or None (nothing published yet)."""
    if not link.is_symlink():
        return None
    name = Path(os.readlink(link)).name
    return int(name) if name.isdigit() else None


def next_version(link: Path) -> int:
    return max([0, *published_versions(link)]) + 1


def publish(work: Path, link: Path, *, keep: int) -> list[int]:
    """Make the finished repository `work` version N (from its INFO file) and switch `link`
    to it atomically; keep the newest `keep` versions (never the current one). Returns the
    versions removed. A running server keeps what it loaded: its files are not rewritten."""
    version = int(json.loads((work / INFO).read_text())["version"])
    where = versions_dir(link)
    where.mkdir(parents=True, exist_ok=True)
    final = where / str(version)
    if final.exists():
        raise PackageError(f"{final} already exists: another build published version {version}")
    os.replace(work, final)
    if link.exists() and not link.is_symlink():  # a repository written before versions
        os.replace(link, where / "0")
    replace_symlink(link, final)
    removed = []
    for old in published_versions(link)[:-keep]:
        if old != version:
            shutil.rmtree(where / str(old), ignore_errors=True)
            removed.append(old)
    return removed
