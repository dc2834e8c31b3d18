"""Benchmarks: `hybridlm bench kernels` (Triton GDN vs fla and SDPA); room for `layers` and `mqar`."""
