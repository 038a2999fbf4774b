"""Verify on its own (`trt-builder verify --checkpoint/--engine/--url`): a checkpoint, an engine,
an llmapi checkpoint in TensorRT-LLM's or vLLM's LLM() or a live deployment against the HF model, with its
reports written beside the JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.allocator import reuse_freed_memory
from ..core.errors import InputError
from ..core.fsio import write_json
from ..engine.runtime import EngineRuntime
from ..modes import checkpoint_mode
from ..runtimes.vllm import opener as vllm_opener
from ..spec.build import BuildSpec
from ..targets.llmapi.engine import LlmApiRuntime, check_llmapi_checkpoint, import_llmapi
from ..triton.runtime import TritonRuntime
from ..verify.compare import RuntimeOpener, verify_checkpoint
from ..verify.reports import write_reports


def open_runtime(
    kind: str, *, engine_dir: Path | None, url: str | None, checkpoint: Path | None = None
) -> RuntimeOpener | None:
    """How to open the runtime `kind` names: None for the checkpoint runtime ("reference"),
    which verify opens itself. The llmapi runtime's refusals come now, before verify loads
    the reference model."""
    if kind == "tensorrt-llm":
        if engine_dir is None:
            raise InputError("--runtime tensorrt-llm needs --engine DIR")
        engine = engine_dir
        return lambda tokenizer: EngineRuntime(engine, eos_token_id=tokenizer.eos_token_id)
    if kind == "triton":
        if not url:
            raise InputError("--runtime triton needs --url (grpc://host:8001 or http://host:8000)")
        target = url
        return lambda tokenizer: TritonRuntime(target)
    if kind in ("llmapi", "vllm"):  # TensorRT-LLM's LLM() or vLLM's, on the llmapi checkpoint
        if checkpoint is None:
            raise InputError(f"--runtime {kind} needs --checkpoint DIR (the llmapi checkpoint)")
        directory = checkpoint
        check_llmapi_checkpoint(directory)
        if kind == "vllm":
            return vllm_opener(directory)
        import_llmapi()
        return lambda tokenizer: LlmApiRuntime(directory, eos_token_id=tokenizer.eos_token_id)
    return None


def verify_standalone(
    checkpoint: Path | None,
    reference: Path,
    spec: BuildSpec,
    *,
    runtime: str = "reference",
    engine_dir: Path | None = None,
    url: str | None = None,
    tokenizer: Path | None = None,
    report_path: Path = Path("verify.json"),
) -> dict[str, Any]:
    """Verify with the gate of the checkpoint's mode (else the spec's), write the JSON report
    to `report_path` and its JUnit XML and HTML beside it; return the report (`passed`)."""
    reuse_freed_memory()  # as the pipeline's stages (core/allocator.py)
    mode = checkpoint_mode(checkpoint) if checkpoint is not None else spec.mode.name
    report = verify_checkpoint(
        checkpoint,
        reference,
        gate=spec.verify.gate(mode),
        max_new_tokens=spec.verify.max_new_tokens,
        heldout_tokens=spec.verify.heldout_tokens,
        device=spec.verify.device,
        tokenizer_dir=tokenizer,
        runtime=runtime,
        open_runtime=open_runtime(runtime, engine_dir=engine_dir, url=url, checkpoint=checkpoint),
        engine_dir=engine_dir,
        url=url,
    )
    write_json(report_path, report)
    write_reports(report, report_path.parent, stem=report_path.stem)
    return report
