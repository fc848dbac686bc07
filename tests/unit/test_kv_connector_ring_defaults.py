"""The host rings' defaults per device (docs/gpu.md, "Defaults on CUDA and why"): the saver's ring holds
a whole 8B-class 8K-token prefill on CUDA, the receiver's and the CPU's stay 256 MiB, a configured
``host_ring_bytes`` sets both directions on every device."""
import pytest

from services.kv_connector.device import receive_ring_bytes, save_ring_bytes
from services.kv_connector.settings import ConnectorSettings


@pytest.mark.parametrize("configured, is_cuda, save, receive", [
    (None, True, 1 << 30, 256 << 20),
    (None, False, 256 << 20, 256 << 20),
    (64 << 20, True, 64 << 20, 64 << 20),
    (64 << 20, False, 64 << 20, 64 << 20),
])
def test_ring_sizes(configured, is_cuda, save, receive):
    assert (save_ring_bytes(configured, is_cuda), receive_ring_bytes(configured)) == (save, receive)


def test_unset_settings_leave_the_choice_to_the_device():
    assert ConnectorSettings().host_ring_bytes is None
    assert ConnectorSettings.of({"host_ring_bytes": 1 << 20}).host_ring_bytes == 1 << 20
