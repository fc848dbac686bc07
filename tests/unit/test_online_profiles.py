"""Profiles measured online for the long-timescale re-optimisation of the offload threshold."""
import pytest

from services.scheduling.profiles import LengthSample, OnlineProfiles

LENGTHS = (100, 200, 300, 400)


def profiles_of(requests, start_s=0.0, **kwargs):
    profiles = OnlineProfiles(start_s, **kwargs)
    for now_s, num_tokens in requests:
        profiles.record_request(now_s, num_tokens)
    return profiles


@pytest.mark.parametrize("requests, kwargs, now_s, lengths, rate", [
    # Every request of the window, over the time since the start.
    ([(1, 100), (2, 200), (3, 300), (4, 400), (5, 500)], {"window_s": 10}, 5, (100, 200, 300, 400, 500), 1.0),
    # Requests older than the window are forgotten; the rate is over the window.
    ([(1, 100), (2, 200), (3, 300), (4, 400), (5, 500)], {"window_s": 10}, 12, (200, 300, 400, 500), 0.4),
    # A full sample drops its oldest; the rate is over the time the kept ones cover.
    ([(1, 400), (2, 300), (3, 200), (4, 100)], {"window_s": 10, "max_samples": 3}, 4, (100, 200, 300), 1.0),
    # Nothing seen.
    ([], {"window_s": 10}, 5, (), 0.0),
    # All forgotten.
    ([(1, 100)], {"window_s": 10}, 30, (), 0.0),
])
def test_length_sample_and_arrival_rate(requests, kwargs, now_s, lengths, rate):
    profiles = profiles_of(requests, **kwargs)
    assert profiles.lengths(now_s).lengths == lengths
    assert profiles.arrival_rate(now_s) == pytest.approx(rate)


@pytest.mark.parametrize("periods, bytes_per_token", [
    ([], None),
    ([(1000, 10)], 100.0),
    ([(1000, 10), (3000, 10)], 200.0),          # EWMA, smoothing 0.5
    ([(0, 0), (1000, 10)], 100.0),              # a period without offloads teaches nothing
    ([(500, 0), (1000, 10)], 100.0),            # late bytes of an earlier period are dropped
    ([(0, 10), (1000, 10)], 50.0),              # tokens wait for their late bytes
    ([(0, 10)], None),
])
def test_kv_bytes_per_token(periods, bytes_per_token):
    profiles = OnlineProfiles(0.0)
    for num_bytes, num_tokens in periods:
        profiles.record_kv_transfer(num_bytes, num_tokens)
    assert profiles.kv_bytes_per_token == (None if bytes_per_token is None else pytest.approx(bytes_per_token))


@pytest.mark.parametrize("t, above, up_to", [
    (0, 250.0, 0.0),
    (100, 225.0, 25.0),
    (250, 175.0, 75.0),
    (400, 0.0, 250.0),
    (1e9, 0.0, 250.0),
])
def test_partial_means_of_the_length_sample(t, above, up_to):
    sample = LengthSample.of((400, 100, 300, 200))
    assert sample.mean_above(t) == pytest.approx(above)
    assert sample.mean_up_to(t) == pytest.approx(up_to)
    assert sample.mean == pytest.approx(250.0)


def ready_profiles(min_samples=4):
    profiles = profiles_of([(i * 0.1, LENGTHS[i % 4]) for i in range(40)], window_s=60, min_samples=min_samples)
    profiles.record_kv_transfer(10_000 * 1000, 1000)
    return profiles


@pytest.mark.parametrize("t, kv_bytes, local_s", [
    (0, 2.5e6, 0.0),
    (150, 2.25e6, 0.025),
    (250, 1.75e6, 0.075),
    (350, 1.0e6, 0.15),
    (400, 0.0, 0.25),
])
def test_model_matches_hand_computed_expectations(t, kv_bytes, local_s):
    """Lengths 100..400 evenly, 10 kB of KV per token, local prefill at 1000 tokens/s:
    E[S_kv(L); L > t] = 1e4 * E[L; L > t] and E[T_local(L); L <= t] = E[L; L <= t] / 1000."""
    model = ready_profiles().offload_model(4.0, 0, 1000, local_tokens_per_s=1000)
    assert model.offloaded_kv_bytes(t) == pytest.approx(kv_bytes)
    assert model.local_prefill_s(t) == pytest.approx(local_s)
    assert (model.min_tokens, model.max_tokens) == (0, 1000)


def test_model_bounds_from_the_measured_profiles():
    """10 requests/s on 0.2 Gbit/s (75% headroom: 1.875 MB per request) fits from t = 200; local
    prefill stays under 90% (0.09 s per request) below t = 300."""
    model = ready_profiles().offload_model(4.0, 0, 1000, local_tokens_per_s=1000)
    base, ceiling = model.bounds(0.2, 10.0)
    assert 200 <= base < 216
    assert 300 <= ceiling < 316


def test_without_a_local_rate_the_model_has_no_local_load():
    model = ready_profiles().offload_model(4.0, 0, 1000, local_tokens_per_s=None)
    assert model.local_prefill_s is None
    assert model.bounds(0.2, 10.0)[1] == 1000


@pytest.mark.parametrize("requests, kv_periods, reason", [
    ([(0.1 * i, 100) for i in range(3)], [(1000, 10)], "3 requests"),
    ([(0.1 * i, 100) for i in range(8)], [], "no KV bytes per token"),
    ([(0.1 * i, 100) for i in range(8)], [(0, 0)], "no KV bytes per token"),
])
def test_too_little_data_builds_no_model(requests, kv_periods, reason):
    profiles = profiles_of(requests, window_s=60, min_samples=4)
    for num_bytes, num_tokens in kv_periods:
        profiles.record_kv_transfer(num_bytes, num_tokens)
    assert profiles.offload_model(1.0, 0, 1000, 1000) is None
    assert reason in profiles.missing(1.0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        OnlineProfiles(0.0, window_s=0)
