"""Prefix affinity (cache-affine prefill picks) and worker back-off."""
import pytest

from services.scheduling.affinity import PrefixAffinity
from services.scheduling.backoff import Backoff, BackoffConfig

A, B, C, D = b"a", b"b", b"c", b"d"


@pytest.mark.parametrize("recorded, prompt, expected", [
    ({}, [A, B], {"w1": 0, "w2": 0}),
    ({"w1": [A, B, C]}, [A, B, D], {"w1": 2, "w2": 0}),
    ({"w1": [A], "w2": [A, B]}, [A, B, C], {"w1": 1, "w2": 2}),
    ({"w1": [B, C]}, [A, B, C], {"w1": 0, "w2": 0}),     # chained hashes: a prefix or nothing
])
def test_affinity_counts_leading_blocks(recorded, prompt, expected):
    affinity = PrefixAffinity()
    for worker, hashes in recorded.items():
        affinity.record(worker, hashes)
    assert affinity.cached_tokens(["w1", "w2"], prompt, block_size=16) == {w: n * 16 for w, n in expected.items()}


def test_affinity_is_bounded_and_forgets():
    affinity = PrefixAffinity(max_blocks_per_worker=2)
    affinity.record("w", [A, B, C])
    assert affinity.num_cached_blocks("w", [B, C]) == 2
    assert affinity.num_cached_blocks("w", [A]) == 0     # evicted, least recently recorded
    affinity.forget("w")
    assert affinity.num_cached_blocks("w", [B]) == 0


@pytest.mark.parametrize("failures, waits", [
    (1, [1.0]),
    (4, [1.0, 2.0, 4.0, 8.0]),
    (7, [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]),     # capped
])
def test_backoff_doubles_up_to_the_cap(failures, waits):
    backoff = Backoff(BackoffConfig(base_s=1.0, max_s=10.0))
    assert [backoff.fail(100.0) for _ in range(failures)] == waits


def test_backoff_blocks_until_retry_and_resets_on_success():
    backoff = Backoff(BackoffConfig(base_s=2.0, max_s=60.0))
    assert backoff.available(0.0)
    backoff.fail(10.0)
    assert not backoff.available(11.9) and backoff.available(12.0)
    backoff.fail(12.0)
    assert not backoff.available(15.9) and backoff.available(16.0)
    backoff.succeed()
    assert backoff.available(0.0) and backoff.fail(20.0) == 2.0
    many = Backoff(BackoffConfig(base_s=1.0, max_s=5.0))
    assert [many.fail(0.0) for _ in range(2000)][-1] == 5.0
