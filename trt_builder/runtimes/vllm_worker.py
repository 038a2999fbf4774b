"""The vLLM side of runtimes/vllm.py: run as a script by the Python of vLLM's own environment
(scripts/setup.sh --bench makes .venv-vllm), never imported by trt-builder, so it imports the
standard library, numpy and vLLM alone.

    python vllm_worker.py CHECKPOINT DTYPE MAX_MODEL_LEN MAX_LOGPROBS

Loads the checkpoint in vLLM's `LLM(...)` (eager, no prefix caching: a prompt's log-probabilities
are computed for every token), then answers one JSON request per line on stdin with one JSON
line on stdout (vLLM's own output goes to stderr):

- {"op": "generate", "prompts": [[ids]], "max_tokens": N, "stop_ids": [ids]}: greedy decoding
  (temperature 0); {"tokens": [[ids]], "finish": [reason]}.
- {"op": "logprobs", "rows": [[ids]], "k": K, "path": FILE}: each row's next-token log-probabilities
  at every position, the K most likely tokens' and the row's next token's (vLLM's prompt
  log-probabilities; the last position's, the first generated token's), written to FILE (.npz:
  `ids` and `logprobs`, [rows, tokens, K + 1], unused slots -inf); {"ok": true}.
- {"op": "quit"}.

The first line out is {"ready": true, "vllm": VERSION, "device": ...}, or {"error": MESSAGE}.
"""

from __future__ import annotations

import json
import os
import sys


def _reply(out, message):
    out.write(json.dumps(message) + "\n")
    out.flush()


def _prompts(rows):
    return [{"prompt_token_ids": list(row)} for row in rows]


def _generate(llm, sampling_params, request):
    params = sampling_params(
        temperature=0.0,
        max_tokens=int(request["max_tokens"]),
        stop_token_ids=list(request.get("stop_ids") or []),
        detokenize=False,
    )
    outputs = llm.generate(_prompts(request["prompts"]), params, use_tqdm=False)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "finish": [o.outputs[0].finish_reason for o in outputs],
    }


def _top(entries, k, keep=None):
    """The k most likely (token, log-probability) of one position's {token: Logprob}, and
    token `keep` (the prompt's next token, which vLLM reports beside them) wherever it ranks."""
    pairs = sorted(((t, float(lp.logprob)) for t, lp in entries.items()), key=lambda p: -p[1])
    top = pairs[:k]
    return top + [p for p in pairs[k:] if p[0] == keep]


def _logprobs(llm, sampling_params, request):
    import numpy as np

    k = int(request["k"])
    rows = request["rows"]
    params = sampling_params(
        temperature=0.0, max_tokens=1, prompt_logprobs=k, logprobs=k, detokenize=False
    )
    outputs = llm.generate(_prompts(rows), params, use_tqdm=False)
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width, k + 1), dtype=np.int64)
    logprobs = np.full((len(rows), width, k + 1), -np.inf, dtype=np.float32)
    for r, (row, out) in enumerate(zip(rows, outputs, strict=True)):
        # prompt_logprobs[t] is token t's given those before it (None at t = 0): position t's
        # next-token distribution is entry t + 1, the last position's the generated token's
        positions = list(out.prompt_logprobs[1:]) + [out.outputs[0].logprobs[0]]
        for t, entries in enumerate(positions):
            keep = row[t + 1] if t + 1 < len(row) else None
            for j, (token, lp) in enumerate(_top(entries, k, keep)):
                ids[r, t, j], logprobs[r, t, j] = token, lp
    np.savez(request["path"], ids=ids, logprobs=logprobs)
    return {"ok": True}


def main(argv):
    checkpoint, dtype, max_model_len, max_logprobs = argv[1], argv[2], int(argv[3]), int(argv[4])
    # run as a script, this folder leads sys.path: its requests.py would shadow the library
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM's prints go to stderr
    try:
        import vllm
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=checkpoint,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=max_model_len,
            max_logprobs=max_logprobs,
            enable_prefix_caching=False,
            seed=0,
        )
    except Exception as exc:  # noqa: BLE001 - the parent says it in one line
        _reply(out, {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
        return 1
    try:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type)
    except Exception:  # noqa: BLE001 - said as unknown
        device = "unknown"
    _reply(out, {"ready": True, "vllm": vllm.__version__, "device": device})
    ops = {"generate": _generate, "logprobs": _logprobs}
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "quit":
            break
        try:
            _reply(out, ops[request["op"]](llm, SamplingParams, request))
        except Exception as exc:  # noqa: BLE001
            _reply(out, {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
