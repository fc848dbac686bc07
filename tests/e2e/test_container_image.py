"""The CPU container image (`make image-cpu`, scripts/build_image.sh) runs the embedded default as an
operator would run it: `podman run` with a published port and an API key, the model prepared into
the image's volume at start, the official openai client answered, a long prompt prefilled on the
PrfaaS path, the image's HEALTHCHECK passing, and SIGTERM (`podman stop`) ending everything cleanly
within the grace period.

Run by `make test-image`, not by `make test`: on a fresh machine the build alone takes longer than
the suite may (debootstrap, wheel download, install: ~7-15 min). It is skipped when its inputs did
not change (the image's build tag holds a hash of them), so only the first run on a machine pays
for it. `make test` checks the image's inputs instead (tests/unit/test_container_inputs.py, and
tests/unit/test_kubernetes_manifests.py against the manifests; `make lint` runs hadolint). Skipped
only where podman is not installed; scripts/bootstrap.sh installs it as root on Debian."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PODMAN = ["podman", "--runtime", "runc"]
IMAGE = "localhost/prfaas:0.1.0-cpu"
API_KEY = "container-test-key"
BUILD_TIMEOUT_S = 2700
START_TIMEOUT_S = 900
GRACE_S = 60            # podman stop's grace period, as deploy/kubernetes gives the pods
SHM_SIZE = "1g"          # as docs/deployment.md runs the image
LONG_PROMPT_TOKENS = 256  # the image config's scheduler.offload_threshold_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.image,
              pytest.mark.timeout(BUILD_TIMEOUT_S + START_TIMEOUT_S + 600),
              pytest.mark.skipif(shutil.which("podman") is None,
                                 reason="podman is not installed (scripts/podman_setup.sh installs it)")]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def image() -> str:
    """The CPU image, built now or found already built for these exact inputs."""
    started = time.monotonic()
    build = subprocess.run(["scripts/build_image.sh", "cpu"], cwd=ROOT, capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S)
    assert build.returncode == 0, f"image build failed:\n{build.stdout[-4000:]}\n{build.stderr[-4000:]}"
    print(f"image build step: {time.monotonic() - started:.0f} s\n{build.stderr.strip()}")
    return IMAGE


@pytest.fixture
def container(image):
    name = f"prfaas-e2e-{os.getpid()}"
    port = free_port()
    podman("rm", "--force", "--volumes", name, check=False)
    # vLLM's engines need more than podman's default 64 MiB of /dev/shm (160 MiB each here).
    podman("run", "--detach", "--name", name, "--shm-size", SHM_SIZE, "--publish", f"127.0.0.1:{port}:8000",
           "--env", f"PRFAAS_API_KEYS={API_KEY}", image)
    try:
        yield name, f"http://127.0.0.1:{port}"
    finally:
        print(podman("logs", "--tail", "60", name, check=False).stdout)
        podman("rm", "--force", "--volumes", name, check=False, timeout=GRACE_S + 60)


def _state(name: str) -> str:
    return podman("inspect", "--format", "{{.State.Status}}", name, check=False).stdout.strip()


def _wait_healthy(name: str, base: str) -> None:
    """Until the router sees every worker healthy and their KV layouts agree: its /health answers 200
    as soon as one worker can serve, and a long prompt sent before the prefill worker is up (or its
    layout known) is rightly prefilled locally."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if _state(name) not in ("running", "created"):
            logs = podman("logs", name, check=False)
            pytest.fail(f"the container stopped during start-up:\n{logs.stdout[-4000:]}{logs.stderr[-4000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=3) as reply:
                health = json.loads(reply.read())
            if health["workers"] and all(health["workers"].values()) and health["layouts"] and \
                    all(pair["verdict"] == "mappable" for pair in health["layouts"]):
                return
        except OSError:
            pass
        time.sleep(3)
    pytest.fail(f"the router in the container did not see every worker healthy after {START_TIMEOUT_S} s")


def _metric(base: str, sample: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_the_cpu_image_serves_the_embedded_default_and_stops_on_sigterm(container):
    name, base = container
    _wait_healthy(name, base)

    # Runs as the image's non-root user, with the model prepared into the volume, not the image.
    assert podman("exec", name, "id", "-u").stdout.strip() == "10001"
    prepared = podman("exec", name, "ls", "/var/cache/prfaas/models").stdout.split()
    assert any("smollm2" in entry for entry in prepared), prepared

    client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content.strip()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()

    offloaded = _metric(base, 'prfaas_router_routed_requests_total{path="prfaas"}')
    long_prompt = " ".join(f"item {i} is a number;" for i in range(LONG_PROMPT_TOKENS // 4))  # ~2 tokens a word
    reply = client.completions.create(model="smollm2-135m-instruct", prompt=long_prompt, max_tokens=8,
                                      temperature=0)
    assert reply.usage.prompt_tokens > LONG_PROMPT_TOKENS
    assert reply.choices[0].text
    assert _metric(base, 'prfaas_router_routed_requests_total{path="prfaas"}') == offloaded + 1

    assert podman("healthcheck", "run", name, check=False).returncode == 0

    started = time.monotonic()
    podman("stop", "--time", str(GRACE_S), name, timeout=GRACE_S + 60)
    took = time.monotonic() - started
    code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
    logs = podman("logs", name).stdout
    print(f"podman stop took {took:.1f} s, exit code {code}")
    assert took < GRACE_S, f"SIGTERM did not stop the container within {GRACE_S} s (it was killed)"
    assert code == "0", logs[-3000:]
    assert "stopping all services" in logs and logs.rstrip().endswith("stopped"), logs[-3000:]
