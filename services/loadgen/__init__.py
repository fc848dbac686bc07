"""Load testing against any OpenAI-compatible endpoint (`prfaas bench`).

Python API: ``await run_benchmark(BenchConfig(base_url=..., model=...))`` returns the result dict.
Imports are lazy so that building the `prfaas` parser stays cheap.
"""
from __future__ import annotations

__all__ = ["BenchConfig", "Slo", "WorkloadConfig", "run_benchmark"]


def __getattr__(name: str):
    if name in ("BenchConfig", "Slo", "WorkloadConfig"):
        from services.loadgen import config

        return getattr(config, name)
    if name == "run_benchmark":
        from services.loadgen.runner import run_benchmark

        return run_benchmark
    raise AttributeError(name)
