"""Repositories trt-builder packages, served by a real tritonserver (the nvidia-pytriton wheel's
2.51 with the Python backend: `trt-builder[serve]`), the tensorrt_llm model on the reference
backend. Not a stand-in: Triton's own ensemble scheduler, Python backend and protocols."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trt_builder.cli.main import main
from trt_builder.core.errors import TritonError
from trt_builder.pipeline import run
from trt_builder.runtimes.checkpoint import CheckpointRuntime
from trt_builder.spec.build import make_spec
from trt_builder.triton.runtime import TritonRuntime
from trt_builder.triton.server import Server, start

pytestmark = [pytest.mark.integration, pytest.mark.triton]

PROMPTS = [[5, 17, 42, 99], [7, 250, 3], [64, 128, 11, 300, 21, 8]]


def _ports(log: Path) -> dict[str, Any]:
    """Free ports for a server, and where its log goes (the test's own directory)."""
    found = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            found.append(s.getsockname()[1])
    return {**dict(zip(("http_port", "grpc_port", "metrics_port"), found, strict=True)), "log": log}


def _package(model: Path, root: Path, **spec: Any) -> tuple[Any, Path]:
    """Build the model up to the Triton repository: (the build result, the repository)."""
    result = run(make_spec(model=str(model), out=root / "engines", triton_root=root / "triton",
                           **{"verify.heldout_tokens": 128, **spec}))  # fmt: skip
    return result, result.layout.triton


@pytest.fixture(scope="module")
def tiny(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """tiny Llama in float32, packaged twice (plain and streaming), each repository served."""
    root = tmp_path_factory.mktemp("served")
    build, plain = _package(tiny_llama, root, dtype="float32")
    _, streaming = _package(tiny_llama, root / "s", dtype="float32", **{"triton.streaming": True})
    runtime = CheckpointRuntime.load(build.layout.checkpoint)
    with (
        start(plain, **_ports(root / "a.log")) as a,
        start(streaming, **_ports(root / "b.log")) as b,
    ):
        yield {"plain": a, "streaming": b, "runtime": runtime, "hf": build.layout.hf,
               "repository": plain}  # fmt: skip


def test_the_reference_backend_answers_as_the_checkpoint_runtime(tiny: dict[str, Any]) -> None:
    """Greedy token ids from the tensorrt_llm model, over HTTP and gRPC, and streamed: the
    checkpoint runtime's own greedy generation, token for token."""
    runtime: CheckpointRuntime = tiny["runtime"]
    want = [runtime.greedy(p, 12, {2}) for p in PROMPTS]
    plain: Server = tiny["plain"]
    for url in (plain.http_url, plain.grpc_url):
        assert TritonRuntime(url).greedy_batch(PROMPTS, 12, {2}) == want, url
    streamed = TritonRuntime(tiny["streaming"].grpc_url)
    assert streamed.decoupled and streamed.greedy_batch(PROMPTS, 12, {2}) == want


def test_verify_passes_against_the_served_repository(
    tiny: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify --runtime triton over HTTP, and over the gRPC stream of the streaming one."""
    for url in (tiny["plain"].http_url, tiny["streaming"].grpc_url):
        code = main(["verify", "--runtime", "triton", "--url", url, "--reference",
                     str(tiny["hf"]), "--dtype", "float32", "--report", str(tmp_path / "v.json"),
                     "--json"])  # fmt: skip
        report = json.loads(capsys.readouterr().out)
        assert code == 0 and report["passed"], (url, report["failures"])
        assert report["greedy_agreement"] == 1.0 and report["runtime"] == "triton"


def test_the_ensemble_answers_text_and_streams_the_same_text(
    tiny: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny["repository"] / "preprocessing" / "tokenizer")
    prompt = "The quick brown fox"
    ids = tokenizer.encode(prompt)
    want = tokenizer.decode(tiny["runtime"].greedy(ids, 6, {2}), skip_special_tokens=True)
    assert main(["infer", "--url", tiny["plain"].http_url, "--prompt", prompt, "--max-tokens",
                 "6", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["text"] == want
    assert main(["infer", "--url", tiny["streaming"].grpc_url, "--prompt", prompt, "--max-tokens",
                 "6", "--stream", "--json"]) == 0  # fmt: skip
    # each piece is decoded on its own: with a byte-level tokenizer a piece can be a partial
    # character, so compare what the pieces decode to together with the tokens' own decodes
    streamed = json.loads(capsys.readouterr().out)["text"]
    pieces = "".join(tokenizer.decode([t], skip_special_tokens=True)
                     for t in tiny["runtime"].greedy(ids, 6, {2}))  # fmt: skip
    assert streamed == pieces


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "   "], "empty prompt"),
        (["--prompt", "fox " * 1500], "the engine accepts at most 1024"),
        (["--messages", '[{"role": "wizard", "content": "hi"}]'], "has role 'wizard'"),
    ],
)
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(
    tiny: dict[str, Any], capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    url = tiny["plain"].http_url
    assert main(["infer", "--url", url, *args, "--max-tokens", "4"]) == 12
    assert message in capsys.readouterr().err
    assert main(["infer", "--url", url, "--prompt", "still there?", "--max-tokens", "2"]) == 0


def test_messages_that_are_not_json_get_the_preprocessing_models_error(
    tiny: dict[str, Any],
) -> None:
    """Sent as raw bytes (infer refuses them before sending): the server's own answer."""
    import numpy as np
    import tritonclient.http as http

    client = http.InferenceServerClient(tiny["plain"].http_url.removeprefix("http://"))
    messages = http.InferInput("messages", [1, 1], "BYTES")
    messages.set_data_from_numpy(np.array([[b"[{not json"]], dtype=object))
    tokens = http.InferInput("max_tokens", [1, 1], "INT32")
    tokens.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    with pytest.raises(Exception, match="messages is not JSON"):
        client.infer("ensemble", [messages, tokens])
    assert client.is_server_ready() and client.is_model_ready("ensemble")


def test_max_tokens_zero_is_refused_before_the_request(
    tiny: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["infer", "--url", tiny["plain"].http_url, "--prompt", "x", "--max-tokens", "0"]) == 3
    )
    assert "--max-tokens must be at least 1" in capsys.readouterr().err


def test_the_default_model_in_int8_serves_its_chat_template(
    default_build: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SmolLM2-135M-Instruct's int8 SmoothQuant repository from the README's build: a chat,
    rendered with the model's own template, answered as the checkpoint runtime answers it."""
    from transformers import AutoTokenizer

    cwd, result = default_build
    repository = Path(result["triton_repository"])
    checkpoint = Path(result["variant_dir"]) / "checkpoint"
    tokenizer = AutoTokenizer.from_pretrained(repository / "preprocessing" / "tokenizer")
    chat = [{"role": "user", "content": "What is the boiling point of water?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = CheckpointRuntime.load(checkpoint).greedy(ids, 12, {tokenizer.eos_token_id})
    with start(repository, **_ports(tmp_path / "server.log")) as server:
        assert main(["infer", "--url", server.grpc_url, "--messages", json.dumps(chat),
                     "--max-tokens", "12", "--json"]) == 0  # fmt: skip
    text = json.loads(capsys.readouterr().out)["text"]
    assert text == tokenizer.decode(want, skip_special_tokens=True) and "100" in text


def test_a_repository_that_does_not_load_names_the_model_and_triton_s_reason(
    tiny: dict[str, Any], tmp_path: Path, tiny_llama: Path
) -> None:
    """The same build packaged for NVIDIA's backend, which this tritonserver does not have."""
    _, repository = _package(
        tiny_llama, tmp_path, dtype="float32", **{"triton.backend": "tensorrtllm"}
    )
    with pytest.raises(TritonError, match=r"model tensorrt_llm failed to load: .*tensorrtllm"):
        start(repository, timeout=120, **_ports(tmp_path / "server.log"))


def test_the_reference_backend_refuses_what_it_cannot_run_before_it_joins_the_batch(
    tiny: dict[str, Any],
) -> None:
    """Straight to tensorrt_llm (no preprocessing limits): a token outside the vocabulary, and
    two prompts in one request, each refused alone while the others are served."""
    import numpy as np
    import tritonclient.http as http

    client = http.InferenceServerClient(tiny["plain"].http_url.removeprefix("http://"))

    def ask(ids: list[list[int]]) -> Any:
        batch = np.array(ids, dtype=np.int32)
        inputs = []
        for name, value in (("input_ids", batch),
                            ("input_lengths", np.full((len(ids), 1), batch.shape[1], np.int32)),
                            ("request_output_len", np.full((len(ids), 1), 3, np.int32))):  # fmt: skip
            item = http.InferInput(name, list(value.shape), "INT32")
            item.set_data_from_numpy(value)
            inputs.append(item)
        return client.infer("tensorrt_llm", inputs)

    with pytest.raises(Exception, match="token id 99999 is outside the vocabulary"):
        ask([[5, 99999]])
    with pytest.raises(Exception, match="one prompt per request"):
        ask([[5, 17], [42, 99]])
    ids = ask([[5, 17, 42]]).as_numpy("output_ids")
    assert ids.reshape(-1).tolist() == tiny["runtime"].greedy([5, 17, 42], 3, set())


def test_a_load_failure_is_named_in_one_line() -> None:
    from trt_builder.triton.server import load_failure

    log = ('E1201 model_lifecycle.cc:642] "failed to load \'tensorrt_llm\' version 1: Internal: '
           'KeyError: \\"checkpoint_dir\\"\\n\\nAt:\\n  /r/tensorrt_llm/1/model.py(9): initialize\\n"')  # fmt: skip
    assert (
        load_failure(log)
        == 'model tensorrt_llm failed to load: Internal: KeyError: "checkpoint_dir"'
    )
    assert load_failure("I1201 server.cc:1] all good") is None
