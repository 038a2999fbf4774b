"""Triton python model `tensorrt_llm` of an llmapi repository: the reference backend for the
llmapi contract. A PyTorch reference, not TensorRT-LLM: it runs the Hugging Face checkpoint
that model.yaml names (or the one beside this file) with trt-builder's checkpoint runtime,
behind the inputs and outputs of TensorRT-LLM's `all_models/llmapi` template (text in, text
out, `sampling_param_*`, `streaming` in decoupled repositories), with in-flight batching (the
same machinery as the engine target's reference backend, python_models/tensorrt_llm.py).
Written for trt-builder, for hosts where TensorRT-LLM is not installed.

As the template's model.py (TensorRT-LLM 1.2.1): one prompt per request (the first element of
text_input); the prompt is part of text_output unless sampling_param_exclude_input_from_output
is true; max_tokens defaults to 32; "Streaming is only supported in decoupled mode."; a
streamed response carries the whole text so far (main's behaviour; 1.2.x sends one response);
an error is text_output "N/A" with the error set. The sampling values mean what SamplingParams
makes of them (runtimes/requests.py: llmapi_sampling): greedy without temperature, top_k or
top_p, or with temperature 0, top_k 1 or top_p 0; a value it refuses is refused in its words. finish_reason and stop_reason are
sent when asked for; cumulative_logprob and the perf metrics are not (the reference computes
neither). It runs the language model only: a request with `image_url` (main's image input,
declared for a vision-language checkpoint) is refused on the error path, saying so.
"""

import json
import queue
from pathlib import Path

import numpy as np
import yaml

from trt_builder.triton.python_models.tensorrt_llm import TritonPythonModel as _Batching
from trt_builder.triton.python_models.tensorrt_llm import scalar

INPUTS = ("text_input", "streaming", "sampling_param_temperature", "sampling_param_top_k",
          "sampling_param_top_p", "sampling_param_max_tokens", "sampling_param_stop",
          "sampling_param_seed", "sampling_param_exclude_input_from_output",
          "return_finish_reason", "return_stop_reason", "stop", "image_url")  # fmt: skip
#: The answer to a request with images: what this backend runs, and what serves images.
NO_IMAGES = ("image_url: this reference backend runs the language model only; images need "
             "TensorRT-LLM's own llmapi model.py (TensorRT-LLM main, after 1.2.1)")  # fmt: skip
#: SamplingParams' default, which the template leaves in place.
MAX_TOKENS = 32
#: The batcher's reasons in the LLM API's words (RequestOutput.finish_reason).
FINISH = {"end_id": "stop", "stop_word": "stop", "length": "length"}


def _texts(value):
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
            for v in np.asarray(value).reshape(-1)]  # fmt: skip


def make_request(inputs, tokenizer, end_id, max_seq_len=0):
    """(batching.Request, stream, exclude_input, asked outputs) from one request's arrays."""
    from trt_builder.runtimes.requests import Request, llmapi_sampling

    texts = _texts(inputs["text_input"])
    if np.asarray(inputs["text_input"]).ndim > 1:
        raise ValueError("text_input is one prompt per request (1-D): send several requests")
    if not texts:
        raise ValueError("text_input is empty: send one prompt")
    prompt = tokenizer(texts[0]).input_ids
    stops = tuple(
        tuple(tokenizer(s, add_special_tokens=False).input_ids)
        for s in _texts(inputs.get("sampling_param_stop", []))
        if s
    )
    max_tokens = scalar(inputs, "sampling_param_max_tokens", int, MAX_TOKENS)
    if max_seq_len and len(prompt) + max_tokens > max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len "
            f"{max_seq_len}: lower sampling_param_max_tokens or shorten the prompt"
        )
    sampling = llmapi_sampling(  # SamplingParams' ranges and meanings (requests.py)
        temperature=scalar(inputs, "sampling_param_temperature", float, None),
        top_k=scalar(inputs, "sampling_param_top_k", int, None),
        top_p=scalar(inputs, "sampling_param_top_p", float, None),
        seed=scalar(inputs, "sampling_param_seed", int, 0),
    )
    request = Request(prompt=tuple(prompt), max_new_tokens=max_tokens, end_id=end_id,
                      stop_words=stops, sampling=sampling)  # fmt: skip
    asked = {name for name in ("return_finish_reason", "return_stop_reason")
             if scalar(inputs, name, bool, False)}  # fmt: skip
    return (request, scalar(inputs, "streaming", bool, False),
            scalar(inputs, "sampling_param_exclude_input_from_output", bool, False), asked)  # fmt: skip


class TritonPythonModel(_Batching):
    INPUTS: tuple[str, ...] = INPUTS

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils
        from transformers import AutoTokenizer

        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        here = Path(args["model_repository"]) / args["model_version"]
        settings = yaml.safe_load((here / "model.yaml").read_text())
        checkpoint = Path(settings["model"])
        if not (checkpoint / "config.json").is_file():  # served from another path than packaged
            checkpoint = here / "checkpoint"
        batch = int(settings.get("max_batch_size") or 8)
        batcher = self._model_process(args, checkpoint, params, batch)
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        end = self.tokenizer.eos_token_id
        try:
            found = json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"]
            end = found[0] if isinstance(found, list) else found
        except (OSError, ValueError, KeyError, IndexError):
            pass
        self.end_id = end
        pb_utils.Logger.log_info(
            "tensorrt_llm (llmapi): trt-builder's reference backend (PyTorch, not TensorRT-LLM) "
            f"on {batcher.device}, {checkpoint}, in model process {batcher.pid}"
        )
        self.max_seq_len = int(settings.get("max_seq_len") or 0)
        self.shape = {}  # request id -> (prompt ids or (), asked outputs, stop words)
        self._start(config, batcher)

    def _submit(self, request, sender):
        inputs = self._inputs(request)
        if scalar(inputs, "stop", bool, False):
            if not request.request_id():
                raise ValueError("A request id must be provided for request cancellation")
            self.inbox.put((None, sender, False, request))
            self.wake.set()
            return
        if np.asarray(inputs.get("image_url", [])).size:
            raise ValueError(NO_IMAGES)
        parsed, stream, exclude, asked = make_request(inputs, self.tokenizer, self.end_id,
                                                      self.max_seq_len)  # fmt: skip
        if stream and not self.decoupled:  # the template's refusal, in its words
            raise ValueError("Streaming is only supported in decoupled mode.")
        self.inbox.put(((parsed, () if exclude else parsed.prompt, asked), sender, stream, request))
        self.wake.set()

    def _admit(self):
        while True:
            try:
                item, sender, stream, request = self.inbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._stop(request.request_id(), sender)
                continue
            parsed, prefix, asked = item
            rid = self._join(parsed, sender)
            if rid is None:
                continue
            self.active[rid] = (sender, stream, [], request)
            self.shape[rid] = (prefix, asked, parsed.stop_words)

    @staticmethod
    def _refusal(message):
        """As the template answers an error: text_output "N/A" and the error."""
        import triton_python_backend_utils as pb_utils

        text = pb_utils.Tensor("text_output", np.asarray(["N/A"], dtype=object))
        return pb_utils.InferenceResponse(output_tensors=[text],
                                          error=pb_utils.TritonError(message))  # fmt: skip

    def _text_response(self, rid, tokens, reason):
        import triton_python_backend_utils as pb_utils

        prefix, asked, stops = self.shape[rid]
        if reason == "stop_word":  # the LLM API leaves the stop string out of the text
            cut = max((len(s) for s in stops if tuple(tokens[-len(s) :]) == s), default=0)
            tokens = tokens[: len(tokens) - cut]
        text = self.tokenizer.decode(list(prefix) + list(tokens), skip_special_tokens=True)
        outputs = [pb_utils.Tensor("text_output", np.asarray([text], dtype=object))]
        if "return_finish_reason" in asked:
            finish = FINISH.get(reason, "") if reason else ""
            outputs.append(pb_utils.Tensor("finish_reason", np.asarray([finish], dtype=object)))
        if "return_stop_reason" in asked:
            stop = "None"
            outputs.append(pb_utils.Tensor("stop_reason", np.asarray([stop], dtype=object)))
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def _send(self, event, sender, stream, tokens):
        import triton_python_backend_utils as pb_utils

        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        reason = event.reason if event.finished else None
        if stream or event.finished:
            response = self._text_response(event.request, tokens, reason)
            sender.send(response, flags=final if event.finished else 0)
        if event.finished:
            self.shape.pop(event.request, None)
