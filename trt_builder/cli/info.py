"""What a build would take and what this host can do: plan, doctor, models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from . import options
from .app import EPILOG_EXIT, cli, spec_from


@cli.command("plan", epilog=EPILOG_EXIT)
@options.apply(options.SPEC_OPTIONS, options.OUTPUT_OPTIONS)
def plan_command(**kwargs: Any) -> None:
    """Print the memory plan of the engine on the target GPU: weights, KV cache per token,
    activations, and how many sequences fit (from the model's config.json alone: no weights).

    \b
    Example:
      trt-builder plan --model meta-llama/Llama-2-7b-hf --dtype int8 --target-gpu A100-80GB
    """
    from ..engine.memplan import GIB, proposed_batch
    from ..pipeline.plan import plan_memory
    from ..targets import TARGET_MAKES

    as_json = kwargs["as_json"]
    spec = spec_from(dict(kwargs))
    memory = plan_memory(spec)
    source = {True: "from the plan", False: "given"}
    makes = f"{spec.target}: {TARGET_MAKES[spec.target]}"
    if as_json:
        data = {"ok": True, "target": spec.target, "makes": TARGET_MAKES[spec.target],
                **memory.to_json()}  # fmt: skip
        click.echo(json.dumps(data, indent=2))
        return
    lim = memory.limits
    rows = [
        ("builds", makes),
        ("target", f"{memory.gpu} ({memory.gpu_bytes / GIB:g} GiB), tp={memory.tp} pp={memory.pp}"),
        ("weights per rank", f"{memory.weight_bytes / GIB:.2f} GiB ({memory.weight_dtype} linears)"),
        ("activations (estimate)", f"{memory.activation_bytes / GIB:.2f} GiB for {lim.max_num_tokens} tokens"),
        ("runtime overhead", f"{memory.overhead_bytes / GIB:.2f} GiB"),
        ("KV cache per token", f"{memory.kv_bytes_per_token / 1024:.1f} KiB ({memory.kv_dtype})"),
        (f"KV cache ({memory.kv_fraction:g} of the rest)", f"{memory.kv_budget_bytes / GIB:.2f} GiB = {memory.kv_tokens} tokens"),
        (f"sequences of {lim.max_seq_len} tokens at once", str(memory.max_sequences(lim.max_seq_len))),
        ("max_batch_size", f"{lim.max_batch_size} ({source[spec.limits.max_batch_size is None]}; "
                           f"{proposed_batch(memory)} fit)"),
        ("max_num_tokens", f"{lim.max_num_tokens} ({source[spec.limits.max_num_tokens is None]})"),
    ]  # fmt: skip
    for label, value in rows:
        click.echo(f"{label:<34} {value}")


@cli.command("doctor")
@click.option("--out", type=click.Path(path_type=Path), default=Path("engines"), show_default=True,
              help="Engines root whose disk is checked.")  # fmt: skip
@options.apply(options.OUTPUT_OPTIONS)
def doctor_command(out: Path, as_json: bool) -> None:
    """What this host has (GPUs, driver, CUDA, TensorRT, TensorRT-LLM, tritonserver, memory,
    disk) and, per mode, what it can do here: build (checkpoint, verify, repository), build the
    engine, serve.

    \b
    Example:
      trt-builder doctor
    """
    from ..pipeline.doctor import inspect

    report = inspect(out)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    gpus = "; ".join(f"{g['name']} (SM {g['sm']}, {g['memory_mib'] / 1024:.0f} GiB)"
                     for g in report["gpus"]) or "none visible"  # fmt: skip
    driver = report["gpus"][0]["driver"] if report["gpus"] else "n/a"
    rows = [
        ("GPUs", gpus),
        ("driver / CUDA (driver)", f"{driver} / {report['cuda_driver'] or 'n/a'}"),
        ("TensorRT", report["tensorrt"]),
        ("TensorRT-LLM", f"{report['tensorrt_llm']} ({report['trtllm_build'] or 'no trtllm-build'})"),
        ("torch", report["torch"]),
        ("tritonserver", report["tritonserver"] or "absent"),
        ("host memory", f"{report['host_memory_gib']} GiB"),
        ("free disk", f"{report['free_disk_gib']} GiB at {report['disk_path']}"),
    ]  # fmt: skip
    for label, value in rows:
        click.echo(f"{label:<24} {value}")
    for mode, can in report["modes"].items():
        for what in ("build", "engine", "serve"):
            click.echo(f"{mode + ' ' + what:<24} {can[what]}")
    for target, can in report["targets"].items():
        click.echo(f"{'--target ' + target:<24} {can['makes']}")
        click.echo(f"{'  runs here':<24} {can['here']}")


@cli.command("models")
def models_command() -> None:
    """List the supported architectures.

    \b
    Example:
      trt-builder models
    """
    from ..models.registry import load_all

    for arch, family in sorted(load_all().items()):
        notes = f"  ({'; '.join(family.notes)})" if family.notes else ""
        click.echo(f"{arch:<36} family={family.name}{notes}")
