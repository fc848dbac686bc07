"""The embedded default as the tests in tests/e2e/embedded/ run it (their conftest.py starts it)."""
from __future__ import annotations

import yaml

from services.launcher.cli import DEFAULT_CONFIG
from support.ports import free_port

API_KEY = "test-key-1"
MODEL = "smollm2-135m-instruct"


def embedded_default_on_free_ports() -> dict:
    """deploy/local.yaml, unchanged but for its ports (a test must not take 8000) and JSON logs."""
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["router"]["port"] = free_port()
    for worker in config["workers"]:
        worker["port"] = free_port()
        if "kv_port" in worker:
            worker["kv_port"] = free_port()
    config["logging"] = {**config["logging"], "level": "debug", "json": True}
    return config
