"""The architecture registry (registry.py): one module per family, each registered under its
HF `architectures` names with every fact trt-builder needs about it (docs/adding-a-model.md)."""
