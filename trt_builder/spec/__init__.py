"""What to build: the build spec (flags and TOML), one frozen dataclass per quantization mode, verify gates, and the GPUs a build can target."""
