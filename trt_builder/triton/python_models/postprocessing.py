"""Triton python model `postprocessing`: output token ids -> text. Written for trt-builder."""

import json
from pathlib import Path

import numpy as np

TRUE = ("true", "1", "yes", "y", "t", "on")


def decode_batch(tokenizer, tokens, lengths, *, skip_special_tokens):
    """Decode output_ids [beams, max_len] cut at each beam's sequence_length."""
    return [
        tokenizer.decode(
            tokens[beam, : int(lengths[beam])], skip_special_tokens=skip_special_tokens
        )
        for beam in range(tokens.shape[0])
    ]


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = Path(params["tokenizer_dir"])
        path = path if path.is_absolute() else Path(args["model_repository"]) / path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.skip_special_tokens = params.get("skip_special_tokens", "true").lower() in TRUE

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            texts = decode_batch(
                self.tokenizer,
                tokens.reshape(-1, tokens.shape[-1]),
                lengths.reshape(-1),
                skip_special_tokens=self.skip_special_tokens,
            )
            out = np.array([t.encode("utf-8") for t in texts], dtype=object).reshape(1, -1)
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)])
            )
        return responses
