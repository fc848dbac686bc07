"""The container image's own inputs, checked without building it (the build and a run of the image
are `make test-image`, tests/e2e/test_container_image.py): what the Containerfiles run exists in the
tree, the config the image starts loads and opens only what its EXPOSE lines publish, it refuses to
start without an API key on its public router port and starts with one, and the HEALTHCHECK script
tells a healthy router from a dead one. tests/unit/test_kubernetes_manifests.py holds the manifests
against the Containerfiles; `make lint` runs hadolint on them."""
from __future__ import annotations

import http.server
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from services.config.errors import ConfigError
from services.config.load import load_config
from services.security.exposure import check_listeners, deployment_listeners
from support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILES = [ROOT / "deploy/container/Containerfile", ROOT / "deploy/container/Containerfile.cuda"]
IMAGE_CONFIG = ROOT / "deploy/container/config.yaml"
APP = "/opt/prfaas/app/"


def _exposed(text: str) -> set[int]:
    ports = set()
    for item in " ".join(re.findall(r"^EXPOSE (.+)$", text, re.M)).split():
        first, _, last = item.partition("-")
        ports.update(range(int(first), int(last or first) + 1))
    return ports


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: p.name)
def test_every_file_the_image_runs_from_the_source_tree_exists(path):
    named = set(re.findall(re.escape(APP) + r"([\w./-]+)", path.read_text()))
    assert {"deploy/container/config.yaml", "deploy/container/healthcheck.py"} <= named
    for relative in named:
        assert (ROOT / relative).exists(), f"{path.name} names {APP}{relative}, which is not in the tree"


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: p.name)
def test_the_image_config_listens_only_on_exposed_ports(path):
    config = load_config(IMAGE_CONFIG)
    ports = {config.router.port} | {w.port for w in config.workers} | {w.kv_port for w in config.workers if w.kv_port}
    assert ports <= _exposed(path.read_text())


def test_the_image_config_needs_an_api_key_on_its_public_port(monkeypatch):
    monkeypatch.delenv("PRFAAS_API_KEYS", raising=False)
    config = load_config(IMAGE_CONFIG)
    with pytest.raises(ConfigError, match="router.host: 0.0.0.0 is reachable from other hosts"):
        check_listeners(config, deployment_listeners(config))
    monkeypatch.setenv("PRFAAS_API_KEYS", "a-key")
    config = load_config(IMAGE_CONFIG)
    check_listeners(config, deployment_listeners(config))  # the workers stay on loopback


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_healthcheck_script_tells_a_serving_router_from_a_dead_one():
    script = ROOT / "deploy/container/healthcheck.py"
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        def probe(target: str) -> int:
            return subprocess.run([sys.executable, str(script)], env={"PRFAAS_HEALTH": target},
                                  capture_output=True, timeout=30).returncode

        assert probe(f"http://127.0.0.1:{server.server_port}/health") == 0
        assert probe(f"http://127.0.0.1:{server.server_port}/missing") != 0
        assert probe(f"http://127.0.0.1:{free_port()}/health") != 0
    finally:
        server.shutdown()
        server.server_close()
