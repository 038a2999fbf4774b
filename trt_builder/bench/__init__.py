"""bench: load tests of a Triton deployment (time to first token, inter-token latency,
throughput against concurrency or request rate), driven by NVIDIA's aiperf; comparisons of
two results; the figures the nightly gates on."""
