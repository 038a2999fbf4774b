"""Triton python model `preprocessing`: text -> token ids for the tensorrt_llm model.

Written for trt-builder. Triton's python backend imports triton_python_backend_utils; the text
handling is in plain functions so it can be tested where no Triton server exists.
"""

import json
from pathlib import Path

import numpy as np

TRUE = ("true", "1", "yes", "y", "t", "on")


def encode_query(tokenizer, text, *, add_special_tokens, max_input_len):
    """Token ids of one prompt; empty or over-long prompts raise ValueError with the reason."""
    if not text.strip():
        raise ValueError("empty prompt: send some text in text_input")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if max_input_len and len(ids) > max_input_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens, the engine accepts at most {max_input_len}"
        )
    return ids


def words_to_ids(tokenizer, words):
    """stop/bad word strings -> TensorRT-LLM's [2, L] list: flat ids, then end offsets (-1 padded)."""
    flat, offsets = [], []
    for word in words:
        if not word:
            continue
        flat.extend(tokenizer.encode(word, add_special_tokens=False))
        offsets.append(len(flat))
    if not flat:
        return np.array([[0], [-1]], dtype=np.int32)
    offsets += [-1] * (len(flat) - len(offsets))
    return np.array([flat, offsets], dtype=np.int32)


def _params(args):
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def _tokenizer_dir(args, value):
    path = Path(value)
    return path if path.is_absolute() else Path(args["model_repository"]) / path


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        params = _params(args)
        self.tokenizer = AutoTokenizer.from_pretrained(
            _tokenizer_dir(args, params["tokenizer_dir"])
        )
        self.add_special_tokens = params.get("add_special_tokens", "true").lower() in TRUE
        self.max_input_len = int(params.get("max_input_len", "0") or 0)
        eos = self.tokenizer.eos_token_id
        self.end_id = int(eos if eos is not None else 0)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.end_id)

    def _one(self, pb_utils, request):
        def opt(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        query = opt("QUERY").reshape(-1)[0]
        text = query.decode("utf-8") if isinstance(query, bytes) else str(query)
        ids = encode_query(
            self.tokenizer,
            text,
            add_special_tokens=self.add_special_tokens,
            max_input_len=self.max_input_len,
        )
        out_len = opt("REQUEST_OUTPUT_LEN").reshape(1, 1).astype(np.int32)
        end_id = opt("END_ID")
        pad_id = opt("PAD_ID")

        def words(name):
            value = opt(name)
            items = (
                []
                if value is None
                else [
                    w.decode("utf-8") if isinstance(w, bytes) else str(w) for w in value.reshape(-1)
                ]
            )
            return words_to_ids(self.tokenizer, items)[None]

        tensors = {
            "INPUT_ID": np.array([ids], dtype=np.int32),
            "REQUEST_INPUT_LEN": np.array([[len(ids)]], dtype=np.int32),
            "REQUEST_OUTPUT_LEN": out_len,
            "OUT_END_ID": np.array(
                [[self.end_id if end_id is None else int(end_id.reshape(-1)[0])]], dtype=np.int32
            ),
            "OUT_PAD_ID": np.array(
                [[self.pad_id if pad_id is None else int(pad_id.reshape(-1)[0])]], dtype=np.int32
            ),
            "STOP_WORDS_IDS": words("STOP_WORDS_DICT"),
            "BAD_WORDS_IDS": words("BAD_WORDS_DICT"),
        }
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()]
        )

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            try:
                responses.append(self._one(pb_utils, request))
            except ValueError as exc:
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[], error=pb_utils.TritonError(str(exc))
                    )
                )
        return responses
