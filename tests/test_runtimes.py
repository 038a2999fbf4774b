"""verify's other runtimes: a TensorRT-LLM engine and a Triton deployment.

Neither TensorRT-LLM nor a Triton server can be installed here: the logic around them (end
ids, trimming, the requests sent) is tested on its own, and the tests that need the real thing
are marked `trtllm` and run where it exists (a GPU host); a real tritonserver: tests/test_serve.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from trt_builder.core.errors import EngineError, InputError
from trt_builder.engine.runtime import EngineRuntime
from trt_builder.modes import gate_for
from trt_builder.pipeline.standalone import open_runtime
from trt_builder.runtimes.generation import primary_end_id, trim
from trt_builder.triton.repository import TRTLLM_IN
from trt_builder.triton.runtime import TritonRuntime
from trt_builder.verify.compare import verify_checkpoint


def test_continuations_stop_after_the_first_end_id() -> None:
    assert trim([5, 6, 2, 0, 0], {2}) == [5, 6, 2]
    assert trim([5, 7, 9], {2, 3}) == [5, 7, 9]
    assert trim([3, 2], {2, 3}) == [3]  # any of the model's end ids, not only the one sent


def test_one_end_id_per_request() -> None:
    assert primary_end_id({2, 49152}, 2) == 2  # the tokenizer's eos, when it is an end id
    assert primary_end_id({7, 3}, None) == 3
    with pytest.raises(InputError, match="set eos_token_id in generation_config.json"):
        primary_end_id(set(), None)


def test_the_triton_request_matches_the_tensorrt_llm_model_inputs() -> None:
    import tritonclient.grpc as client

    runtime = TritonRuntime.__new__(TritonRuntime)  # no server here: only the request
    runtime.client_module = client
    inputs = runtime.request([1, 2, 3], 16, end_id=2, pad_id=0)
    sent = {i.name(): (i.shape(), i.datatype()) for i in inputs}
    # every input the repository's tensorrt_llm model requires is sent, and each one sent is
    # declared there with that type and, past the batch dimension, those dims
    declared = {name: (dtype.removeprefix("TYPE_"), dims, optional)
                for name, dtype, dims, optional in TRTLLM_IN}  # fmt: skip
    assert {n for n, (_, _, optional) in declared.items() if not optional} <= set(sent)
    for name, (shape, dtype) in sent.items():
        want_type, dims, _ = declared[name]
        assert dtype == want_type, name
        assert len(shape) == 1 + len(dims) and shape[0] == 1, name
        assert all(d == -1 or d == s for d, s in zip(dims, shape[1:], strict=True)), name
    assert sent["input_ids"][0] == [1, 3]


def test_without_tensorrt_llm_the_engine_runtime_says_where_it_runs(tmp_path: Path) -> None:
    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("TensorRT-LLM is installed here")
    with pytest.raises(EngineError, match="needs TensorRT-LLM on an NVIDIA GPU host"):
        EngineRuntime(tmp_path)


def test_an_unreachable_triton_server_is_a_one_line_error() -> None:
    with pytest.raises(
        InputError, match="cannot reach Triton at grpc://127.0.0.1:9 .*start the server"
    ):
        TritonRuntime("grpc://127.0.0.1:9", timeout=1.0)


@pytest.mark.trtllm
@pytest.mark.gpu
def test_verify_a_real_engine(smollm2_hf: Path, tmp_path: Path) -> None:
    """On a GPU host with TensorRT-LLM: build a float16 engine of SmolLM2 with context logits
    and verify it through TensorRT-LLM's runtime against transformers."""
    import subprocess

    from trt_builder.convert.floats import convert_checkpoint
    from trt_builder.modes import FloatMode

    ck, engine = tmp_path / "ck", tmp_path / "engine"
    ck.mkdir()
    convert_checkpoint(smollm2_hf, ck, FloatMode("float16"))
    subprocess.run(
        ["trtllm-build", "--checkpoint_dir", str(ck), "--output_dir", str(engine),
         "--gemm_plugin", "auto", "--gather_context_logits", "--max_batch_size", "16"],
        check=True,
    )  # fmt: skip
    report = verify_checkpoint(
        ck, smollm2_hf, gate=gate_for("float16"), runtime="tensorrt-llm", engine_dir=engine,
        open_runtime=open_runtime("tensorrt-llm", engine_dir=engine, url=None),
    )  # fmt: skip
    assert report["passed"], report["failures"]
    assert report["teacher_forced"] and report["top1"] >= 0.99


def test_verify_compares_a_greedy_only_runtime_on_generation(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in for the engine runtime, named as such: the checkpoint runtime's generation
    behind EngineRuntime's interface, without teacher-forced logits (an engine built without
    --gather_context_logits). Verify then gates on greedy agreement alone."""
    from trt_builder.convert.floats import convert_checkpoint
    from trt_builder.modes import FloatMode
    from trt_builder.runtimes.checkpoint import CheckpointRuntime

    ck = tmp_path / "ck"
    ck.mkdir()
    convert_checkpoint(tiny_llama, ck, FloatMode("float32"))

    class StandInEngineRuntime:
        teacher_forced = False

        def __init__(self, engine_dir: Path, *, eos_token_id: int | None = None) -> None:
            self.model = CheckpointRuntime.load(ck)

        def greedy_batch(self, *args: object) -> list[list[int]]:
            return self.model.greedy_batch(*args)  # type: ignore[arg-type]

    report = verify_checkpoint(
        ck, tiny_llama, gate=gate_for("float32"), device="cpu", max_new_tokens=6,
        runtime="tensorrt-llm", engine_dir=tmp_path,
        open_runtime=lambda tokenizer: StandInEngineRuntime(tmp_path),
    )  # fmt: skip
    assert report["passed"], report["failures"]
    assert report["runtime"] == "tensorrt-llm" and report["engine"] == str(tmp_path)
    assert report["teacher_forced"] is False and report["top1"] is None
    assert report["perplexity"] == {} and report["greedy_agreement"] == 1.0
