"""A client for a live deployment of a trt-builder repository (`trt-builder infer`): the
ensemble over HTTP or gRPC through tritonclient, with readiness checks and timeouts, and
streaming (gRPC) for a decoupled (streaming) repository."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.errors import InputError, TritonError


@dataclass(frozen=True)
class Request:
    """One generation request to the ensemble: text_input or messages (a chat), and how much."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int = 64
    sampling: dict[str, float | int] = field(default_factory=dict)  # temperature, top_k, ...
    image: str | None = None  # an image URL: the llmapi model's image_url (vision-language)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InputError("give one of --prompt and --messages")
        if self.max_tokens < 1:
            raise InputError("--max-tokens must be at least 1")


#: Optional ensemble inputs: name -> Triton data type.
_SAMPLING = {"temperature": "FP32", "top_p": "FP32", "top_k": "INT32", "seed": "UINT64"}
_NUMPY = {"FP32": np.float32, "INT32": np.int32, "UINT64": np.uint64, "BOOL": np.bool_}


def connect(url: str, *, timeout: float = 60.0) -> tuple[Any, Any, bool]:
    """(tritonclient module, client, grpc?) for a live server; InputError naming the fix
    otherwise. http(s):// URLs speak HTTP, anything else gRPC. The model's readiness is not
    asked first: while a new version loads Triton reports the ensemble not ready, yet serves it
    (the old version answers); a model Triton does not serve gets Triton's own refusal."""
    grpc = not url.startswith(("http://", "https://"))
    try:
        if grpc:
            import tritonclient.grpc as module
        else:
            import tritonclient.http as module
    except (ImportError, RuntimeError):  # RuntimeError: installed without that protocol
        raise InputError("tritonclient is missing: pip install 'tritonclient[grpc,http]'") from None
    target = url.split("://", 1)[-1]
    try:
        if grpc:
            client = module.InferenceServerClient(url=target)
        else:
            client = module.InferenceServerClient(
                url=target, connection_timeout=timeout, network_timeout=timeout,
                ssl=url.startswith("https://"),
            )  # fmt: skip
        live = client.is_server_live()
    except Exception as exc:  # tritonclient's own errors and transport errors
        raise InputError(
            f"cannot reach Triton at {url} ({exc}): start the server or fix --url"
        ) from None
    if not live:
        raise InputError(f"Triton at {url} is not live: look at its log")
    return module, client, grpc


def _tensor(module: Any, name: str, value: Any, dtype: str, *, batch: bool = True) -> Any:
    """One input holding `value`: [1, 1] for the ensemble (a batch dimension), [1] without."""
    array: np.ndarray = np.array([value], dtype=object if dtype == "BYTES" else _NUMPY[dtype])
    array = array.reshape(1, 1) if batch else array
    item = module.InferInput(name, list(array.shape), dtype)
    item.set_data_from_numpy(array)
    return item


def _inputs(module: Any, request: Request, stream: bool) -> list[Any]:
    def tensor(name: str, value: Any, dtype: str) -> Any:
        return _tensor(module, name, value, dtype)

    if request.image is not None:
        raise InputError(
            "--image: the engine target's ensemble takes text only (TensorRT-LLM <= 1.2 builds "
            "no engine for a vision tower); an llmapi repository of a vision-language model "
            "takes images"
        )
    text = (
        ("text_input", request.prompt.encode())
        if request.prompt is not None
        else ("messages", json.dumps(request.messages, ensure_ascii=False).encode())
    )
    items = [tensor(*text, "BYTES"), tensor("max_tokens", request.max_tokens, "INT32")]
    for name, value in request.sampling.items():
        items.append(tensor(name, value, _SAMPLING[name]))
    if stream:
        items.append(tensor("stream", True, "BOOL"))
    return items


#: The llmapi model (targets/llmapi/triton.py) and its sampling inputs, by the ensemble's names.
LLMAPI_MODEL = "tensorrt_llm"
_LLMAPI_SAMPLING = {"temperature": "sampling_param_temperature", "top_p": "sampling_param_top_p",
                    "top_k": "sampling_param_top_k", "seed": "sampling_param_seed"}  # fmt: skip


def takes_text(client: Any) -> bool:
    """Whether the deployment speaks the llmapi model's contract (TensorRT-LLM's llmapi
    template, which any server may serve, ours or not): no ensemble, and a tensorrt_llm model
    that takes text (text_input)."""
    try:
        if client.is_model_ready("ensemble"):
            return False
        return "text_input" in _input_names(client, LLMAPI_MODEL)
    except Exception:  # tritonclient raises for a model it does not know
        return False


def _input_names(client: Any, model: str) -> set[str]:
    """The inputs `model` declares (gRPC's metadata message or HTTP's JSON)."""
    metadata = client.get_model_metadata(model)
    inputs = metadata.inputs if hasattr(metadata, "inputs") else metadata.get("inputs", [])
    return {i.name if hasattr(i, "name") else i.get("name") for i in inputs}


def _llmapi_inputs(module: Any, request: Request, stream: bool) -> list[Any]:
    """The llmapi model's inputs: 1-D (no batch dimension), the prompt alone in the answer."""
    if request.prompt is None:
        raise InputError(
            "the llmapi model takes text_input only (no chat template on the server): give "
            "--prompt with the chat already rendered"
        )

    def tensor(name: str, value: Any, dtype: str) -> Any:
        return _tensor(module, name, value, dtype, batch=False)

    items = [
        tensor("text_input", request.prompt.encode(), "BYTES"),
        tensor("sampling_param_max_tokens", request.max_tokens, "INT32"),
        tensor("sampling_param_exclude_input_from_output", True, "BOOL"),
    ]
    for name, value in request.sampling.items():
        items.append(tensor(_LLMAPI_SAMPLING[name], value, _SAMPLING[name]))
    if request.image is not None:
        items.append(tensor("image_url", request.image.encode(), "BYTES"))
    if stream:
        items.append(tensor("streaming", True, "BOOL"))
    return items


def _check_image(client: Any, model: str, request: Request) -> None:
    """An image goes only to a model that declares image_url (InputError otherwise)."""
    if request.image is None or model != LLMAPI_MODEL:
        return
    if "image_url" not in _input_names(client, model):
        raise InputError(
            f"--image: {model} declares no image_url input: this repository is a text model's"
        )


def _text(result: Any) -> str:
    out = result.as_numpy("text_output")
    if out is None:
        raise TritonError("the response has no text_output: is this a trt-builder repository?")
    value = out.reshape(-1)[0]
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def generate(url: str, request: Request, *, model: str | None = None, timeout: float = 60.0) -> str:
    """The answer to one request (a non-decoupled repository): from the ensemble, or from the
    llmapi model of an llmapi repository (`model` None: whichever the server has)."""
    module, client, grpc = connect(url, timeout=timeout)
    outputs = [
        module.InferRequestedOutput("text_output", **({} if grpc else {"binary_data": False}))
    ]
    llmapi = model == LLMAPI_MODEL if model is not None else takes_text(client)
    model = model or (LLMAPI_MODEL if llmapi else "ensemble")
    _check_image(client, model, request)
    inputs = (_llmapi_inputs if llmapi else _inputs)(module, request, False)
    try:
        extra = {"client_timeout": timeout} if grpc else {}
        result = client.infer(model, inputs, outputs=outputs, **extra)
    except Exception as exc:  # InferenceServerException and transport errors
        raise TritonError(
            f"Triton refused or timed out on the request ({exc}); a streaming (decoupled) "
            "repository needs --stream over gRPC"
        ) from None
    return _text(result)


#: The model that streams whole text (a streaming repository has it; repository.BLS).
STREAM_MODEL = "tensorrt_llm_bls"


def stream_model(client: Any) -> str:
    """What a stream goes to when no model is named: the llmapi model of an llmapi repository;
    tensorrt_llm_bls where the server serves it (its pieces are whole characters), else the
    ensemble (the same model in a repository trt-builder writes now; in an older one, Triton's
    ensemble, which decodes each piece alone)."""
    if takes_text(client):
        return LLMAPI_MODEL
    try:
        return STREAM_MODEL if client.is_model_ready(STREAM_MODEL) else "ensemble"
    except Exception:  # tritonclient raises for a model it does not know
        return "ensemble"


def stream(
    url: str, request: Request, *, model: str | None = None, timeout: float = 60.0
) -> Iterator[str]:
    """The answer of a decoupled (streaming) repository, piece by piece, over gRPC, from
    `model` (stream_model() when None)."""
    if url.startswith(("http://", "https://")):
        raise InputError(
            "--stream needs a gRPC URL (grpc://HOST:8001): tritonclient streams over gRPC"
        )
    module, client, _ = connect(url, timeout=timeout)
    model = model or stream_model(client)
    llmapi = model == LLMAPI_MODEL
    _check_image(client, model, request)
    inputs = (_llmapi_inputs if llmapi else _inputs)(module, request, True)
    sent = ""
    for result in stream_results(client, model, inputs, timeout=timeout):
        if result.as_numpy("text_output") is not None:
            text = _text(result)
            if llmapi:  # each response holds the whole text so far: yield what is new
                text, sent = text[len(sent) :], text
            yield text


def stream_results(client: Any, model: str, inputs: list[Any], *, timeout: float) -> Iterator[Any]:
    """Every response of one request to a decoupled model over a gRPC stream, up to the
    server's (empty) final response; TritonError on a refusal or after `timeout` of silence."""
    pieces: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: pieces.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            try:
                result, error = pieces.get(timeout=timeout)
            except queue.Empty:
                raise TritonError(f"no response from {model} within {timeout:g} s") from None
            if error is not None:
                status = str(getattr(error, "status", lambda: "")() or "")
                if status.endswith(("UNAVAILABLE", "CANCELLED")):  # the server went away
                    raise TritonError(
                        f"the stream from {model} broke off: the server stopped or restarted "
                        f"({error}); send the request again once it serves"
                    )
                raise TritonError(f"Triton refused the request to {model}: {error}")
            yield result
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return
    finally:
        client.stop_stream()
