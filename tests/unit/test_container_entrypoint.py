"""Both container images run `prfaas` as their entrypoint, as vLLM's image runs `vllm`: the arguments
of `podman run IMAGE ...` are a role and its flags, parsed by the same CLI, and no arguments run the
embedded deployment."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _instruction(containerfile: Path, name: str) -> list[str]:
    [line] = [line for line in containerfile.read_text().splitlines() if line.startswith(name + " ")]
    return json.loads(line[len(name) + 1:])


@pytest.mark.parametrize("containerfile", ["Containerfile", "Containerfile.cuda"])
def test_the_image_runs_prfaas_with_the_arguments_it_is_given(containerfile):
    path = ROOT / "deploy" / "container" / containerfile
    assert _instruction(path, "ENTRYPOINT") == ["prfaas"]
    default = _instruction(path, "CMD")
    assert build_parser().parse_args(default).command == "up"
    router = build_parser().parse_args(["router", "--config", "/etc/prfaas/config.yaml"])
    assert router.command == "router" and router.config == "/etc/prfaas/config.yaml"
