"""Triton python model `preprocessing`: text -> token ids for the tensorrt_llm model.

Written for trt-builder. Triton's python backend imports triton_python_backend_utils; the text
handling is in plain functions so it can be tested where no Triton server exists.
"""

import json
import re
from pathlib import Path

import numpy as np

TRUE = ("true", "1", "yes", "y", "t", "on")


def _check_length(ids, max_input_len):
    if max_input_len and len(ids) > max_input_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens, the engine accepts at most {max_input_len}: "
            "shorten it, or rebuild with a larger --max-input-len"
        )
    return ids


def encode_query(tokenizer, text, *, add_special_tokens, max_input_len):
    """Token ids of one prompt; empty or over-long prompts raise ValueError with the reason."""
    if not text.strip():
        raise ValueError("empty prompt: send some text in text_input")
    return _check_length(
        tokenizer.encode(text, add_special_tokens=add_special_tokens), max_input_len
    )


_GENERATION_TAG = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def chat_environment():
    """The sandboxed Jinja environment chat templates run in (templates come from the hub:
    untrusted code). The same options and helpers as transformers' apply_chat_template:
    trim_blocks, lstrip_blocks, loop controls, raise_exception, strftime_now and a tojson
    that does not escape HTML."""
    from datetime import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)  # fmt: skip

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


#: The roles a chat may have (the OpenAI chat roles chat templates are written for).
ROLES = ("system", "user", "assistant", "tool")


def parse_messages(text):
    """A chat as JSON: [{"role": ..., "content": ...}, ...]; ValueError says what is wrong."""
    try:
        messages = json.loads(text)
    except ValueError:
        raise ValueError(
            'messages is not JSON: send [{"role": "user", "content": "..."}]'
        ) from None
    if not isinstance(messages, list) or not messages:
        raise ValueError('messages must be a non-empty JSON list of {"role", "content"} objects')
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or "content" not in message
        ):
            raise ValueError(f'messages[{i}] needs a "role" string and a "content"')
        if message["role"] not in ROLES:
            raise ValueError(
                f"messages[{i}] has role {message['role']!r}: use one of {', '.join(ROLES)}"
            )
    return messages


def render_chat(tokenizer, messages, *, environment=None):
    """The prompt text of a chat, ready for the assistant's answer, as the tokenizer's own
    chat template renders it (with the tokenizer's special tokens in scope)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not template:
        raise ValueError("this model's tokenizer has no chat template: send text_input instead")
    env = environment or chat_environment()
    compiled = env.from_string(_GENERATION_TAG.sub("", template))
    return compiled.render(
        messages=messages, add_generation_prompt=True, tools=None, documents=None,
        **tokenizer.special_tokens_map,
    )  # fmt: skip


def encode_chat(tokenizer, messages, *, max_input_len, environment=None):
    """Token ids of a chat: the rendered template, encoded without adding special tokens
    again (the template has them), as apply_chat_template(tokenize=True) does."""
    text = render_chat(tokenizer, messages, environment=environment)
    return _check_length(tokenizer.encode(text, add_special_tokens=False), max_input_len)


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


def _texts(array):
    if array is None:
        return None
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]


def _pad_stack(rows, fill):
    width = max(row.shape[-1] for row in rows)
    return np.stack(
        [
            np.pad(r, [(0, 0)] * (r.ndim - 1) + [(0, width - r.shape[-1])], constant_values=fill)
            for r in rows
        ]
    ).astype(np.int32)


def preprocess(
    tokenizer, inputs, *, add_special_tokens, max_input_len, end_id, pad_id, max_seq_len=0,
    environment=None,
):  # fmt: skip
    """One request's output tensors, for every row of its batch.

    inputs: name -> numpy array (QUERY or MESSAGES; REQUEST_OUTPUT_LEN; END_ID, PAD_ID,
    STOP_WORDS_DICT, BAD_WORDS_DICT optional), each with the batch as its first dimension.
    """
    query, chat = inputs.get("QUERY"), inputs.get("MESSAGES")
    if (query is None) == (chat is None):
        raise ValueError("send one of text_input (plain text) and messages (a JSON chat)")
    source = query if query is not None else chat
    rows = source.reshape(source.shape[0], -1)
    batch = rows.shape[0]
    if query is not None:
        ids = [
            encode_query(tokenizer, _texts(row)[0], add_special_tokens=add_special_tokens,
                         max_input_len=max_input_len)
            for row in rows
        ]  # fmt: skip
    else:
        ids = [
            encode_chat(tokenizer, parse_messages(_texts(row)[0]), max_input_len=max_input_len,
                        environment=environment)
            for row in rows
        ]  # fmt: skip
    if inputs.get("REQUEST_OUTPUT_LEN") is None:
        raise ValueError("max_tokens is missing: send max_tokens, the most tokens to generate")
    output_len = inputs["REQUEST_OUTPUT_LEN"].reshape(batch, -1)[:, :1].astype(np.int32)
    for row, length in zip(ids, output_len[:, 0], strict=True):
        if int(length) < 1:
            raise ValueError(f"max_tokens is {int(length)}: ask for at least 1 token")
        if max_seq_len and len(row) + int(length) > max_seq_len:
            raise ValueError(
                f"prompt ({len(row)} tokens) + max_tokens ({int(length)}) exceeds the engine's "
                f"max_seq_len {max_seq_len}: lower max_tokens"
            )

    def per_row(name, default):
        value = inputs.get(name)
        if value is None:
            return np.full((batch, 1), default, dtype=np.int32)
        return value.reshape(batch, -1)[:, :1].astype(np.int32)

    def words(name):
        value = inputs.get(name)
        rows = (
            [[] for _ in range(batch)]
            if value is None
            else [_texts(r) for r in value.reshape(batch, -1)]
        )
        return _pad_stack([words_to_ids(tokenizer, r) for r in rows], -1)

    return {
        "INPUT_ID": _pad_stack([np.array(r) for r in ids], pad_id),
        "REQUEST_INPUT_LEN": np.array([[len(r)] for r in ids], dtype=np.int32),
        "REQUEST_OUTPUT_LEN": output_len,
        "OUT_END_ID": per_row("END_ID", end_id),
        "OUT_PAD_ID": per_row("PAD_ID", pad_id),
        "STOP_WORDS_IDS": words("STOP_WORDS_DICT"),
        "BAD_WORDS_IDS": words("BAD_WORDS_DICT"),
    }


def default_end_id(tokenizer, tokenizer_dir):
    """The end id: generation_config.json's (first) eos_token_id, else the tokenizer's EOS."""
    gen = Path(tokenizer_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, list) and eos:
            return int(eos[0])
        if isinstance(eos, int):
            return eos
    return int(tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0)


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = Path(params["tokenizer_dir"])
        path = path if path.is_absolute() else Path(args["model_repository"]) / path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.add_special_tokens = params.get("add_special_tokens", "true").lower() in TRUE
        self.max_input_len = int(params.get("max_input_len", "0") or 0)
        self.max_seq_len = int(params.get("max_seq_len", "0") or 0)
        self.environment = chat_environment()
        self.end_id = default_end_id(self.tokenizer, path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.end_id)

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        names = (
            "QUERY",
            "MESSAGES",
            "REQUEST_OUTPUT_LEN",
            "END_ID",
            "PAD_ID",
            "STOP_WORDS_DICT",
            "BAD_WORDS_DICT",
        )
        responses = []
        for request in requests:
            inputs = {}
            for name in names:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            try:
                outputs = preprocess(
                    self.tokenizer,
                    inputs,
                    add_special_tokens=self.add_special_tokens,
                    max_input_len=self.max_input_len,
                    end_id=self.end_id,
                    pad_id=self.pad_id,
                    max_seq_len=self.max_seq_len,
                    environment=self.environment,
                )
            except Exception as exc:  # ValueError, or a chat template's own TemplateError
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[], error=pb_utils.TritonError(str(exc))
                    )
                )
                continue
            tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
