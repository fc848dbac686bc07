"""Render the Kubernetes overlays in deploy/kubernetes/ with `kubectl kustomize`."""
from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ROOT / "deploy" / "kubernetes" / "overlays"
CLUSTER_ROLES = ("prfaas-cluster", "local-cluster")


@dataclass(frozen=True, slots=True)
class Rendered:
    """One cluster role of one overlay, rendered: ``overlays/<deployment>/<role>``."""
    deployment: str
    role: str
    manifests: tuple[dict, ...]

    def of_kind(self, kind: str) -> list[dict]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name: str) -> dict:
        (manifest,) = [m for m in self.of_kind(kind) if m["metadata"]["name"] == name]
        return manifest


def deployments() -> list[str]:
    return sorted(p.name for p in OVERLAYS.iterdir() if all((p / r).is_dir() for r in CLUSTER_ROLES))


def kubectl() -> str:
    """kubectl from PATH, or the one scripts/bootstrap.sh puts into the virtual environment."""
    found = shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.prefix) / "bin"))
    if found is None:
        raise RuntimeError("kubectl not found: run scripts/bootstrap.sh")
    return found


@functools.cache
def render(deployment: str, role: str) -> Rendered:
    result = subprocess.run([kubectl(), "kustomize", str(OVERLAYS / deployment / role)],
                            capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {deployment}/{role} failed: {result.stderr}")
    return Rendered(deployment, role, tuple(m for m in yaml.safe_load_all(result.stdout) if m))
