"""verify --runtime llmapi: the llmapi target's checkpoint run by TensorRT-LLM's own LLM().

TensorRT-LLM cannot be installed here. The runtime's calls are checked against a stand-in
`tensorrt_llm` module that is not TensorRT-LLM and computes nothing: it has TensorRT-LLM's
signatures, read in its source (LLM and LLM.generate: llmapi/llm.py at 4c05a748, 1.1/1.2 line;
SamplingParams: the fields sampling_params.py has both at 000a01de, 1.0.0rc4, and at b35ac1b6,
1.2.0rc2, with their defaults; KvCacheConfig: a strict model in llmapi/llm_args.py; the outputs:
executor/result.py at 005bc848), so a keyword TensorRT-LLM does not take fails here as it would
there. It records what it was given and answers what each test scripts. The refusals run here
for real, through the CLI; the real run is the `trtllm` test at the end (a GPU host).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from trt_builder.core.errors import EngineError, InputError
from trt_builder.pipeline.standalone import open_runtime
from trt_builder.targets.llmapi.engine import KV_CACHE_FRACTION, LlmApiRuntime

# -- the stand-in ------------------------------------------------------------------------------

#: SamplingParams' init fields in TensorRT-LLM 1.0.0rc4 (all of them are in 1.2.0rc2 too, which
#: adds prompt_ignore_length), with their defaults there.
SAMPLING_FIELDS: dict[str, Any] = {
    "end_id": None, "pad_id": None, "max_tokens": 32, "bad": None, "bad_token_ids": None,
    "stop": None, "stop_token_ids": None, "include_stop_str_in_output": False,
    "embedding_bias": None, "logits_processor": None, "apply_batched_logits_processor": False,
    "n": 1, "best_of": None, "use_beam_search": False, "top_k": None, "top_p": None,
    "top_p_min": None, "top_p_reset_ids": None, "top_p_decay": None, "seed": None,
    "temperature": None, "min_tokens": None, "beam_search_diversity_rate": None,
    "repetition_penalty": None, "presence_penalty": None, "frequency_penalty": None,
    "length_penalty": None, "early_stopping": None, "no_repeat_ngram_size": None, "min_p": None,
    "beam_width_array": None, "logprobs": None, "prompt_logprobs": None,
    "return_context_logits": False, "return_generation_logits": False,
    "exclude_input_from_output": True, "return_encoder_output": False,
    "return_perf_metrics": False, "additional_model_outputs": None, "lookahead_config": None,
    "guided_decoding": None, "ignore_eos": False, "detokenize": True, "add_special_tokens": True,
    "truncate_prompt_tokens": None, "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}  # fmt: skip
#: KvCacheConfig fields (a StrictBaseModel: any other keyword is refused).
KV_CACHE_FIELDS: dict[str, Any] = {
    "enable_block_reuse": True, "max_tokens": None, "max_attention_window": None,
    "sink_token_length": None, "free_gpu_memory_fraction": None,
}  # fmt: skip
#: Keyword arguments LLM() takes beyond its named ones that this runtime may pass: fields of
#: TorchLlmArgs (BaseLLM refuses any other with "got invalid argument").
TORCH_LLM_ARGS = {"kv_cache_config", "backend", "max_batch_size", "max_num_tokens", "max_seq_len"}


def _kw_only(name: str, defaults: dict[str, Any]) -> type:
    return dataclasses.make_dataclass(
        name, [(k, Any, dataclasses.field(default=v)) for k, v in defaults.items()], kw_only=True
    )


SamplingParams = _kw_only("SamplingParams", SAMPLING_FIELDS)
KvCacheConfig = _kw_only("KvCacheConfig", KV_CACHE_FIELDS)


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    """executor/result.py's fields (slots: reading another attribute fails)."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[Any] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generation_logits: torch.Tensor | None = None
    disaggregated_params: Any = None


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    context_logits: torch.Tensor | None
    finished: bool = True


#: What the stand-in answers a prompt: (new tokens, finish reason, context logits).
Script = Callable[[list[int], Any], tuple[list[int], str, torch.Tensor | None]]


class StandIn:
    """A module named tensorrt_llm with TensorRT-LLM's LLM API signatures; not TensorRT-LLM."""

    def __init__(self, version: str, script: Script | None = None) -> None:
        self.script = script or (lambda prompt, params: ([], "length", None))
        self.llms: list[Any] = []
        self.module = types.ModuleType("tensorrt_llm")
        self.module.__version__ = version  # type: ignore[attr-defined]
        self.llmapi = types.ModuleType("tensorrt_llm.llmapi")
        self.llmapi.SamplingParams = SamplingParams  # type: ignore[attr-defined]
        self.llmapi.KvCacheConfig = KvCacheConfig  # type: ignore[attr-defined]
        self.llmapi.LLM = self._llm_class()  # type: ignore[attr-defined]
        self.module.llmapi = self.llmapi  # type: ignore[attr-defined]

    def _llm_class(self) -> type:
        stand_in = self

        class LLM:
            def __init__(self, model: str | Path, tokenizer: Any = None,
                         tokenizer_mode: str = "auto", skip_tokenizer_init: bool = False,
                         trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                         dtype: str = "auto", revision: str | None = None,
                         tokenizer_revision: str | None = None, **kwargs: Any) -> None:  # fmt: skip
                invalid = set(kwargs) - TORCH_LLM_ARGS
                if invalid:
                    raise ValueError(f"LLM got invalid argument: {sorted(invalid)}")
                self.model, self.tokenizer = model, tokenizer
                self.skip_tokenizer_init, self.dtype = skip_tokenizer_init, dtype
                self.tensor_parallel_size, self.kwargs = tensor_parallel_size, kwargs
                self.calls: list[tuple[Any, Any, bool]] = []
                stand_in.llms.append(self)

            def generate(self, inputs: Any, sampling_params: Any = None, use_tqdm: bool = True,
                         lora_request: Any = None, prompt_adapter_request: Any = None,
                         kv_cache_retention_config: Any = None,
                         disaggregated_params: Any = None) -> list[RequestOutput]:  # fmt: skip
                self.calls.append((inputs, sampling_params, use_tqdm))
                assert isinstance(sampling_params, SamplingParams)
                out = []
                for i, prompt in enumerate(inputs):
                    tokens, reason, logits = stand_in.script(list(prompt), sampling_params)
                    done = CompletionOutput(0, token_ids=tokens, finish_reason=reason)
                    out.append(RequestOutput(i, None, list(prompt), [done], logits))
                return out

        return LLM


def _install(monkeypatch: pytest.MonkeyPatch, stand_in: StandIn) -> StandIn:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", stand_in.module)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", stand_in.llmapi)
    return stand_in


def _llmapi_dir(path: Path) -> Path:
    """The files that make a directory an llmapi checkpoint (a float16 one has no others)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "dtype": "float16"}')
    save_file(
        {"lm_head.weight": torch.zeros(4, 2, dtype=torch.float16)}, str(path / "model.safetensors")
    )
    return path


# -- the calls ---------------------------------------------------------------------------------


def test_the_checkpoint_opens_in_llm_with_token_ids_in_and_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in = _install(monkeypatch, StandIn("1.2.0rc2"))
    ck = _llmapi_dir(tmp_path / "checkpoint")
    runtime = LlmApiRuntime(ck, eos_token_id=2)
    (llm,) = stand_in.llms
    assert llm.model == str(ck) and llm.tokenizer is None and llm.skip_tokenizer_init is True
    assert llm.tensor_parallel_size == 1 and llm.dtype == "auto"  # the checkpoint's dtype
    kv = llm.kwargs["kv_cache_config"]
    assert set(llm.kwargs) == {"kv_cache_config"}
    assert kv.enable_block_reuse is False and kv.free_gpu_memory_fraction == KV_CACHE_FRACTION
    assert runtime.name == "llmapi" and runtime.teacher_forced and runtime.version == "1.2.0rc2"


def test_greedy_batch_is_one_greedy_batch_trimmed_at_the_first_end_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = {
        (1, 5): ([7, 3, 9, 2], "stop"),  # another end id first: cut after it
        (1, 6, 6): ([8, 9, 10], "length"),  # no end id: all of it
        (1,): ([4], "stop"),  # stopped on the end id, left out of the tokens: put back
        (1, 7): ([11, 2], "stop"),  # stopped on the end id, kept
    }  # fmt: skip
    stand_in = _install(
        monkeypatch, StandIn("1.0.0", lambda prompt, params: (*answers[tuple(prompt)], None))
    )
    runtime = LlmApiRuntime(_llmapi_dir(tmp_path / "ck"), eos_token_id=2)
    prompts = [list(p) for p in answers]
    got = runtime.greedy_batch(prompts, 4, {2, 3}, pad_id=0)
    assert got == [[7, 3], [8, 9, 10], [4, 2], [11, 2]]
    ((inputs, params, use_tqdm),) = stand_in.llms[0].calls  # the whole batch in one call
    assert inputs == prompts and use_tqdm is False
    assert (params.max_tokens, params.end_id, params.pad_id, params.top_k) == (4, 2, 0, 1)
    assert params.temperature is None and params.top_p is None  # top_k=1: greedy in 1.0-1.2
    assert params.detokenize is False and params.return_context_logits is False


def test_the_end_id_sent_is_the_tokenizers_else_the_smallest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in = _install(monkeypatch, StandIn("1.1.0"))
    LlmApiRuntime(_llmapi_dir(tmp_path / "a"), eos_token_id=None).greedy_batch([[1]], 2, {9, 4})
    LlmApiRuntime(_llmapi_dir(tmp_path / "b"), eos_token_id=9).greedy_batch([[1]], 2, {9, 4})
    assert [llm.calls[0][1].end_id for llm in stand_in.llms] == [4, 9]


def test_forward_is_the_context_logits_of_each_sequence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def logits(prompt: list[int], params: Any) -> tuple[list[int], str, torch.Tensor]:
        # [prompt, vocab] in the model dtype: row t is the logits after token t
        rows = torch.tensor(prompt, dtype=torch.float16)[:, None] * torch.arange(5)
        return [0], "length", rows

    stand_in = _install(monkeypatch, StandIn("1.2.0", logits))
    runtime = LlmApiRuntime(_llmapi_dir(tmp_path / "ck"), eos_token_id=2)
    one = runtime.forward(torch.tensor([3, 1, 2]), hidden=[])
    assert one.dtype == torch.float32 and one.shape == (3, 5)
    assert one[:, 1].tolist() == [3.0, 1.0, 2.0] and one[0, 4] == 12.0
    batch = runtime.forward(torch.tensor([[3, 1, 2], [5, 6, 7]]))  # the held-out windows
    assert batch.shape == (2, 3, 5) and batch[1, :, 1].tolist() == [5.0, 6.0, 7.0]
    for _, params, _ in stand_in.llms[0].calls:
        assert params.return_context_logits is True and params.max_tokens == 1
        assert params.end_id == 2 and params.top_k == 1
    assert [c[0] for c in stand_in.llms[0].calls] == [[[3, 1, 2]], [[3, 1, 2], [5, 6, 7]]]


def test_no_context_logits_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(monkeypatch, StandIn("1.0.0", lambda prompt, params: ([0], "length", None)))
    runtime = LlmApiRuntime(_llmapi_dir(tmp_path / "ck"))
    with pytest.raises(
        EngineError, match=r"^TensorRT-LLM 1\.0\.0 returned no context logits"
    ) as exc:
        runtime.forward(torch.tensor([1, 2]))
    assert "\n" not in str(exc.value) and "--runtime reference" in str(exc.value)


# -- the refusals ------------------------------------------------------------------------------


def test_without_tensorrt_llm_it_says_where_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import tensorrt_llm: ImportError
    ck = _llmapi_dir(tmp_path / "ck")
    for opening in (lambda: LlmApiRuntime(ck),
                    lambda: open_runtime("llmapi", engine_dir=None, url=None, checkpoint=ck)):  # fmt: skip
        with pytest.raises(
            EngineError, match="needs TensorRT-LLM >= 1.0 on an NVIDIA GPU host"
        ) as exc:
            opening()
        assert "\n" not in str(exc.value) and "checkpoint runtime" in str(exc.value)


@pytest.mark.parametrize(("version", "refused"), [
    ("0.21.0", True), ("0.20.0rc3", True), ("nightly", True),
    ("1.0.0rc4", False), ("1.0.0", False), ("1.2.1", False), ("1.3.0rc1", False),
])  # fmt: skip
def test_a_tensorrt_llm_before_1_0_is_refused(
    version: str, refused: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in = _install(monkeypatch, StandIn(version))
    ck = _llmapi_dir(tmp_path / "ck")
    if refused:
        with pytest.raises(
            EngineError, match=f"needs TensorRT-LLM >= 1.0 .* this host has {version}"
        ):
            open_runtime("llmapi", engine_dir=None, url=None, checkpoint=ck)
        assert not stand_in.llms
    else:
        opener = open_runtime("llmapi", engine_dir=None, url=None, checkpoint=ck)
        assert opener is not None and not stand_in.llms  # nothing loaded before verify opens it
        runtime = opener(types.SimpleNamespace(eos_token_id=7))
        assert runtime.eos_token_id == 7 and stand_in.llms[0].model == str(ck)


def test_a_directory_that_is_not_an_llmapi_checkpoint_is_refused_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in = _install(monkeypatch, StandIn("1.2.0"))
    engine_ck = tmp_path / "trtllm-checkpoint"  # the engine target's checkpoint
    engine_ck.mkdir()
    (engine_ck / "config.json").write_text(
        '{"architecture": "LlamaForCausalLM", "dtype": "float16"}'
    )
    save_file({"x": torch.zeros(1)}, str(engine_ck / "rank0.safetensors"))
    engine = tmp_path / "engine"  # an engine directory
    engine.mkdir()
    (engine / "config.json").write_text('{"version": "1.2.0", "pretrained_config": {}}')
    pickled = tmp_path / "bin"  # a Hugging Face model without safetensors
    pickled.mkdir()
    (pickled / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (pickled / "pytorch_model.bin").write_bytes(b"")
    for directory in (engine_ck, engine, pickled, tmp_path / "missing"):
        with pytest.raises(
            InputError, match=r"is not an llmapi checkpoint .*--target llmapi build"
        ):
            open_runtime("llmapi", engine_dir=None, url=None, checkpoint=directory)
        with pytest.raises(InputError, match="is not an llmapi checkpoint"):
            LlmApiRuntime(directory)
    with pytest.raises(InputError, match="--runtime llmapi needs --checkpoint DIR"):
        open_runtime("llmapi", engine_dir=tmp_path, url=None, checkpoint=None)
    assert not stand_in.llms


# -- the CLI, here -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llmapi_checkpoint(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's float16 llmapi checkpoint, as convert writes it."""
    from trt_builder.modes import FloatMode
    from trt_builder.targets.llmapi.convert import convert_llmapi

    out = tmp_path_factory.mktemp("llmapi") / "checkpoint"
    out.mkdir()
    convert_llmapi(FloatMode("float16"), tiny_llama, out, calibration=None, recipe=None)
    return out


@pytest.mark.integration
def test_the_cli_refuses_here_in_one_line_writing_nothing(
    llmapi_checkpoint: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("TensorRT-LLM is installed here")
    exe = Path(sys.executable).with_name("trt-builder")
    report = tmp_path / "reports" / "verify.json"
    proc = subprocess.run(
        [str(exe), "verify", "--runtime", "llmapi", "--checkpoint", str(llmapi_checkpoint),
         "--reference", str(tiny_llama), "--report", str(report)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 7, proc.stderr  # EngineError: TensorRT-LLM missing
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: --runtime llmapi needs TensorRT-LLM >= 1.0 on an NVIDIA GPU")
    assert "--runtime reference" in line
    assert not report.parent.exists()


@pytest.mark.integration
def test_the_cli_asks_for_the_checkpoint(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trt_builder.cli.main import main

    code = main(["verify", "--runtime", "llmapi", "--reference", str(tiny_llama)])
    err = capsys.readouterr().err
    assert code == 2 and "--runtime llmapi needs --checkpoint DIR" in err
    assert not (tmp_path / "verify.json").exists()


# -- the real thing, on a GPU host -------------------------------------------------------------


@pytest.mark.trtllm
@pytest.mark.gpu
def test_verify_the_llmapi_checkpoint_in_tensorrt_llm(smollm2_hf: Path, tmp_path: Path) -> None:
    """On a GPU host with TensorRT-LLM >= 1.0: SmolLM2's float16 llmapi checkpoint through its
    LLM() (PyTorch backend) against transformers, under the float16 gate, teacher-forced."""
    from trt_builder.modes import FloatMode, gate_for
    from trt_builder.targets.llmapi.convert import convert_llmapi
    from trt_builder.verify.compare import verify_checkpoint

    ck = tmp_path / "checkpoint"
    ck.mkdir()
    convert_llmapi(FloatMode("float16"), smollm2_hf, ck, calibration=None, recipe=None)
    report = verify_checkpoint(
        ck, smollm2_hf, gate=gate_for("float16"), runtime="llmapi",
        open_runtime=open_runtime("llmapi", engine_dir=None, url=None, checkpoint=ck),
    )  # fmt: skip
    assert report["passed"], report["failures"]
    assert report["runtime"] == "llmapi" and report["teacher_forced"]
    assert report["top1"] >= 0.99 and report["greedy_agreement"] >= 0.9
