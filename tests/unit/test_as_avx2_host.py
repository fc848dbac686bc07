"""scripts/as_avx2_host.sh: a command under it sees an x86-64 CPU without AVX-512 or AMX, through
/proc/cpuinfo and through torch, and chooses what an AVX2-only host chooses; the host is unchanged
after it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "as_avx2_host.sh"
PROBE = """
import importlib.util, json, sys
sys.path[:0] = [{root!r}]
assert importlib.util.find_spec("torch")        # asking first, as vLLM does, must not spend the patch
import torch
from services.engine.args import _cpu_flags, resolve_dtype
print(json.dumps({{"flags": sorted(f for f in _cpu_flags() if f.startswith(("avx", "amx"))),
                  "torch_avx512": torch.cpu._is_avx512_supported(),
                  "torch_avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
                  "torch_avx2": torch.cpu._is_avx2_supported(),
                  "aten": torch.backends.cpu.get_cpu_capability(),
                  "dtype": resolve_dtype("auto", {model!r})}}))
"""


def probe(tmp_path: Path, wrapped: bool) -> dict:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    command = [sys.executable, "-c", PROBE.format(root=str(ROOT), model=str(model))]
    run = subprocess.run([str(SCRIPT), *command] if wrapped else command, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def host_flags() -> set[str]:
    return set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags")).split(":", 1)[1].split())


@pytest.mark.skipif(os.geteuid() != 0, reason="as_avx2_host.sh needs root (a mount namespace)")
@pytest.mark.skipif("avx2" not in host_flags(), reason="an x86-64 CPU with AVX2")
def test_a_command_under_it_sees_avx2_and_no_avx512(tmp_path):
    before = host_flags()
    seen = probe(tmp_path, wrapped=True)
    assert seen["flags"] and not [f for f in seen["flags"] if f.startswith(("avx512", "amx"))], seen
    assert "avx2" in seen["flags"] and seen["torch_avx2"], seen
    assert not seen["torch_avx512"] and not seen["torch_avx512_bf16"], seen
    assert seen["aten"] == "AVX2" and seen["dtype"] == "float32", seen
    assert host_flags() == before          # the bind mount stayed in the command's own namespace
    if {"avx512_bf16", "amx_bf16"} & before:
        assert probe(tmp_path, wrapped=False)["dtype"] == "bfloat16"    # the wrapper made the difference


def test_it_says_how_to_use_it():
    run = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=10)
    assert run.returncode == 0 and "as_avx2_host.sh" in run.stdout and "ATEN_CPU_CAPABILITY" in run.stdout
    assert subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=10).returncode == 2
