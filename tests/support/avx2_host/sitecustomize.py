"""Loaded by every Python process under scripts/as_avx2_host.sh (it puts this directory first on
PYTHONPATH): once torch is imported, torch reports the CPU without AVX-512 and AMX, so vLLM's CPU
platform loads its AVX2 kernels (``vllm._C_AVX2``) and picks what it picks on an AVX2-only host.
torch reads the CPU with CPUID, which /proc/cpuinfo's bind mount does not reach.

Patched after torch's own import, not by importing torch here: processes that never import torch
(the router, the load generator) start as fast as without it."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

HIDDEN = ("avx512", "amx")


def _mask(torch) -> None:
    real = torch._C._cpu._get_cpu_capability
    capabilities = {key: (False if key.startswith(HIDDEN) else value) for key, value in real().items()}
    torch._C._cpu._get_cpu_capability = lambda: dict(capabilities)


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Wraps torch's loader so that ``_mask`` runs once torch's own import is done. Stays in place until
    then: a ``find_spec("torch")`` that only asks whether torch is installed (vLLM does) loads nothing."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _mask(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterTorch())
