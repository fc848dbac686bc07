"""What a worker's engine is started with, beyond vLLM's own arguments."""
import os

import pytest

from services.config import parse_config
from services.engine.args import ONEDNN_PRIMITIVE_CACHE_CAPACITY, engine_args

CONFIG = parse_config({"workers": [{"name": "d0", "port": 50071}]})
WORKER = CONFIG.workers[0]
VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def test_the_onednn_primitive_cache_is_bounded_for_the_engine(monkeypatch):
    # Unbounded (oneDNN's 1024), a CPU engine's memory grows for hours as the load brings new batch
    # sizes: the chaos soak's RSS slope (docs/reliability.md).
    monkeypatch.delenv(VARIABLE, raising=False)
    engine_args(CONFIG.model_for(WORKER), CONFIG.engine_for(WORKER))
    assert os.environ[VARIABLE] == str(ONEDNN_PRIMITIVE_CACHE_CAPACITY)
    assert ONEDNN_PRIMITIVE_CACHE_CAPACITY < 1024


@pytest.mark.parametrize("value", ["0", "256"])
def test_an_operator_setting_is_kept(monkeypatch, value):
    monkeypatch.setenv(VARIABLE, value)
    engine_args(CONFIG.model_for(WORKER), CONFIG.engine_for(WORKER))
    assert os.environ[VARIABLE] == value
