"""Benchmarks: `hybridlm bench kernels` / `layers` / `train` (against fla and SDPA) and `mqar` (recall)."""
