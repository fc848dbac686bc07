"""docs/configuration.md must be what scripts/gen_config_reference.py generates from the schema today."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_config_reference  # noqa: E402


def test_configuration_reference_is_current():
    current = gen_config_reference.OUTPUT.read_text()
    assert current == gen_config_reference.render(), (
        "docs/configuration.md is stale: run `.venv/bin/python scripts/gen_config_reference.py`")


def test_reference_lists_every_transport_key():
    from services.kv_transport.settings import TransportSettings

    text = gen_config_reference.render()
    assert all(f"`transport.{key}`" in text for key in TransportSettings().to_dict())
