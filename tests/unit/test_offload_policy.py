"""Selective offloading on the incremental prefill length: scarce vs abundant bandwidth."""
import math

import pytest

from services.scheduling.offload import CacheTransfer, bandwidth_scarce, decide_offload

T = 1000


@pytest.mark.parametrize("threshold, base, scarce", [
    (1000, 1000, False),
    (1500, 1000, True),        # raised by the congestion controller
    (math.inf, 1000, True),    # offloading stopped: the link is down
    (800, 1000, False),
])
def test_bandwidth_scarce(threshold, base, scarce):
    assert bandwidth_scarce(threshold, base) is scarce


@pytest.mark.parametrize("length, cached, available, scarce, site, incremental, reused, transfer", [
    # no pools: the plain length rule
    (1000, {}, True, False, "local", 1000, 0, None),
    (1001, {}, True, False, "prfaas", 1001, 0, None),
    (5000, {}, False, False, "local", 5000, 0, None),
    # abundant: the longest prefix anywhere counts
    (5000, {"local": 4500}, True, False, "local", 500, 4500, None),
    (5000, {"prfaas": 4500}, True, False, "local", 500, 4500, CacheTransfer("prfaas", "local", 4500)),
    (5000, {"local": 1000}, True, False, "prfaas", 4000, 1000, CacheTransfer("local", "prfaas", 1000)),
    (5000, {"local": 1000, "prfaas": 2000}, True, False, "prfaas", 3000, 2000, None),
    (5000, {"local": 2000, "prfaas": 2000}, True, False, "prfaas", 3000, 2000, None),
    (5000, {"local": 2000, "prfaas": 4800}, False, False, "local", 200, 4800,
     CacheTransfer("prfaas", "local", 4800)),
    # scarce: each cluster alone; the decision reads the local cluster's prefix
    (5000, {"prfaas": 4500}, True, True, "prfaas", 500, 4500, None),
    (5000, {"local": 4500}, True, True, "local", 500, 4500, None),
    (5000, {"local": 3000, "prfaas": 4900}, True, True, "prfaas", 100, 4900, None),
    (5000, {"local": 1000}, True, True, "prfaas", 5000, 0, None),
    (5000, {"prfaas": 4500}, False, True, "local", 5000, 0, None),
    # a report longer than the prompt is clipped
    (100, {"local": 400}, True, False, "local", 0, 100, None),
])
def test_decide_offload(length, cached, available, scarce, site, incremental, reused, transfer):
    decision = decide_offload(length, cached, T, available, scarce)
    assert (decision.site, decision.num_incremental_tokens, decision.num_cached_tokens, decision.transfer) == \
        (site, incremental, reused, transfer)
    assert decision.scarce is scarce
