"""What the tensorrtllm backend requires of the `tensorrt_llm` model, per pinned release, read
from its upstream source (2026-12; not run: no release installs here).

Every entry names the file it was read in. BE is triton-inference-server/tensorrtllm_backend;
TL is NVIDIA/TensorRT-LLM, whose `triton_backend/` holds the backend from 0.20 on. No stored
source sits at a release commit, so each release says how its evidence is dated:
- "read": a snapshot whose `tensorrt_llm/version.py` names the release;
- "probable": files dated by their content to the release's window;
- "inferred": the last BE sync before the code moved into TL, which the release carries.

repository.py generates the `tensorrt_llm` config from this table: every parameter some pinned
release reads unguarded is written, and every input is named as the backend looks it up
(tests/test_triton.py checks the generated configs against every release).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.sources import Source


@dataclass(frozen=True)
class Parameter:
    """A `tensorrt_llm` parameter the backend reads with GetParameter and no guard: a config
    without it fails to load ("Cannot find parameter with name: ..."). `value` is what
    trt-builder writes when it has nothing else to say."""

    name: str
    value: str
    why: str
    source: Source


@dataclass(frozen=True)
class TensorSpec:
    """An input or output of the upstream `tensorrt_llm` template, as the backend reads it."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool
    source: Source


@dataclass(frozen=True)
class Contract:
    """What one release line's backend requires of the `tensorrt_llm` model."""

    release: str
    evidence: str  # "read" | "probable" | "inferred"
    dated_by: str
    parameters: tuple[Parameter, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)


BE = "triton-inference-server/tensorrtllm_backend"
TL = "NVIDIA/TensorRT-LLM"
_STATE = "inflight_batcher_llm/src/model_instance_state.cc"
_UTILS = "inflight_batcher_llm/src/utils.h"
_TEMPLATE = "all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt"


def _parameters(repo: str, prefix: str, version: str) -> tuple[Parameter, ...]:
    """The four unguarded reads: the same lines in every version read (BE v0.19.0 on)."""

    def at(line: int) -> Source:
        return Source(repo, prefix + _STATE, version, line)

    off = "empty: no guided decoding (read only to configure it)"
    return (
        Parameter("gpt_model_type", "inflight_fused_batching",
                  "the batching type; also one of V1, inflight_batching", at(62)),
        Parameter("tokenizer_dir", "", off, at(413)),
        Parameter("xgrammar_tokenizer_info_path", "", off, at(414)),
        Parameter("guided_decoding_backend", "", off + "; otherwise only xgrammar", at(415)),
    )  # fmt: skip


#: The template tensors trt-builder's repository uses, with their types and dims (the same in
#: every version read: BE c2e65b8, TL 2a9abd95, TL 0c8de69).
_INPUTS = (
    ("input_ids", "TYPE_INT32", (-1,), True),  # optional: encoder_input_features is the other
    ("input_lengths", "TYPE_INT32", (1,), False),
    ("request_output_len", "TYPE_INT32", (1,), False),
    ("end_id", "TYPE_INT32", (1,), True),
    ("pad_id", "TYPE_INT32", (1,), True),
    ("runtime_top_k", "TYPE_INT32", (1,), True),
    ("runtime_top_p", "TYPE_FP32", (1,), True),
    ("temperature", "TYPE_FP32", (1,), True),
    ("seed", "TYPE_UINT64", (1,), True),  # utils.h InputFieldsNames::seed; 0.19 read random_seed
    ("streaming", "TYPE_BOOL", (1,), True),
    ("stop_words_list", "TYPE_INT32", (2, -1), True),
    ("bad_words_list", "TYPE_INT32", (2, -1), True),
    # true: cancel the requests that carry this request's id (ModelInstanceState::
    # handleStopRequest, BE c2e65b8 model_instance_state.cc:871; template line 293 there and at
    # TL 2a9abd95): how upstream's BLS stops its child request
    ("stop", "TYPE_BOOL", (1,), True),
)
_OUTPUTS = (
    ("output_ids", "TYPE_INT32", (-1, -1), False),
    ("sequence_length", "TYPE_INT32", (-1,), False),
)


def _contract(release: str, evidence: str, dated_by: str, repo: str, prefix: str,
              version: str, template_version: str, seed_at: Source) -> Contract:  # fmt: skip
    template = Source(repo, prefix + _TEMPLATE, template_version)
    inputs = tuple(
        TensorSpec(n, t, d, o, seed_at if n == "seed" else template) for n, t, d, o in _INPUTS
    )
    outputs = tuple(TensorSpec(n, t, d, o, template) for n, t, d, o in _OUTPUTS)
    return Contract(release, evidence, dated_by, _parameters(repo, prefix, version), inputs,
                    outputs)  # fmt: skip


#: Where the backend names the seed input (InputFieldsNames::seed).
_SEED_BE = Source(BE, _UTILS, "c2e65b8", 97)
_SEED_TL = Source(TL, "triton_backend/" + _UTILS, "89fd9b74", 99)
_PRE_MOVE = (
    "c2e65b8 (2025-05-13): the last BE sync before the backend moved into TL triton_backend/"
)
#: 1.0 and 1.1 were read at the same snapshots (the 1.0-1.1 window).
_TL_10 = _contract(
    "1.0",
    "probable",
    "c8c6df08 / 2a9abd95: num_input_tokens present (TL #5445, 2025-06), enable_trt_overlap "
    "still deprecated (before TL #10018, 2025-12)",
    TL,
    "triton_backend/",
    "c8c6df08",
    "2a9abd95",
    _SEED_TL,
)
CONTRACTS: dict[str, Contract] = {
    c.release: c
    for c in (
        _contract("0.20", "inferred", _PRE_MOVE, BE, "", "c2e65b8", "c2e65b8", _SEED_BE),
        _contract("0.21", "inferred", _PRE_MOVE, BE, "", "c2e65b8", "c2e65b8", _SEED_BE),
        _TL_10,
        replace(_TL_10, release="1.1", dated_by="the same versions as 1.0 (the 1.0-1.1 window)"),
        _contract(
            "1.2",
            "read",
            "0c8de69: tensorrt_llm/version.py = 1.2.0rc8 (utils.h is not "
            "stored there: the seed's name is the latest read)",
            TL,
            "triton_backend/",
            "0c8de69",
            "0c8de69",
            _SEED_TL,
        ),
    )  # fmt: skip
}


def required_parameters() -> dict[str, str]:
    """Every parameter some pinned release reads unguarded, with the value trt-builder writes
    when the repository has nothing else to say (a config that loads in every release)."""
    out: dict[str, str] = {}
    for contract in CONTRACTS.values():
        for p in contract.parameters:
            out.setdefault(p.name, p.value)
    return out


Tensor = tuple[str, str, tuple[int, ...], bool]  # (name, data type, dims, optional)


def common_tensors(kind: str) -> tuple[Tensor, ...]:
    """The `tensorrt_llm` model's inputs or outputs (`kind`) as every pinned release reads
    them (the same name, type, dims and optionality in each): what the repository declares."""
    per_release = [getattr(c, kind) for c in CONTRACTS.values()]
    first = per_release[0]
    shared = [s for s in first if all(s.name in {o.name for o in other} for other in per_release)]
    out = []
    for spec in shared:
        same = [next(o for o in other if o.name == spec.name) for other in per_release]
        if all((o.data_type, o.dims, o.optional) == (spec.data_type, spec.dims, spec.optional)
               for o in same):  # fmt: skip
            out.append((spec.name, spec.data_type, spec.dims, spec.optional))
    return tuple(out)
