"""The tritonserver command line for a repository trt-builder wrote (launched under mpirun
with one rank per GPU when the engine has several, as tensorrtllm_backend's leader mode needs)."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.errors import PackageError
from .repositories import read_repository
from .repository import INFO

#: Seconds tritonserver gives in-flight requests after SIGTERM before it unloads the models
#: (whose requests then end with an error): a bounded drain, not Triton's default 30 s.
EXIT_TIMEOUT_S = 10


def serve_command(
    repository: Path,
    *,
    tritonserver: str = "tritonserver",
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    model_repository: Path | None = None,
    shm_prefix: str = "prefix",
) -> list[str]:
    """argv that serves `repository`: explicit model control, strict readiness, exit on error;
    `mpirun` with world_size ranks (tp x pp) when there are several. The repository path is
    the one the serving container sees (the spec's [triton] serve_root). Rank i's Python
    backend names its shared-memory regions `<shm_prefix><i>_...`."""
    kind, configs = read_repository(repository)
    models = kind.models(configs)
    try:
        info = json.loads((repository / INFO).read_text())
        # the reference backend merges the ranks into one process; the engine needs one each
        world = 1 if info.get("backend") == "reference" else int(info["world_size"])
        # as the serving container sees it (<root>/<name>/tensorrt_llm/<N>/engine, or the
        # llmapi checkpoint there), unless given
        where = info["engine_path"] if "engine_path" in info else info["model_path"]
        served = model_repository or Path(where).parents[2]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        raise PackageError(
            f"{repository} has no readable {INFO}: repackage it with trt-builder package"
        ) from None

    def rank(i: int) -> list[str]:
        argv = [tritonserver, f"--model-repository={served}", "--model-control-mode=explicit"]
        argv += [f"--load-model={m}" for m in (models if i == 0 else ("tensorrt_llm",))]
        argv += [
            f"--http-port={http_port}", f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics_port}", "--strict-readiness=true", "--exit-on-error=true",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name={shm_prefix}{i}_",
        ]  # fmt: skip
        return argv

    if world == 1:
        return rank(0)
    argv = ["mpirun", "--allow-run-as-root"]
    for i in range(world):
        argv += ["-n", "1", *rank(i)] + ([":"] if i < world - 1 else [])
    return argv
