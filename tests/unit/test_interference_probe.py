"""bench/_interference.py: what slows the PrfaaS prefill beyond its profile, from long prompts' times alone,
back to back and beside a decoding batch: its KV sender's CPU per MiB, and the colocated worker's decoding
(with the decode side's own extra wait taken out)."""
import pytest
from support.bench import bench_module

probe = bench_module("_interference")
MIB = 1 << 20


def step_s(batch):                   # a decode step: 50 ms, 5 ms more per request in the batch
    return 0.045 + 0.005 * batch


def test_the_sender_cpu_and_the_decoding_slowdown_from_the_measured_times():
    # alone: 0.4 s of transfer and one 50 ms step around a 4.55 s prefill. Back to back: the second's first
    # token after two prefills, the sender's D, a transfer and a step: 5.0 + 4.55 + D.
    # Beside: half a step at 4 (32.5 ms) and one at 5 (70 ms) instead of one at 1: 52.5 ms, plus x of the prefill.
    alone = [5.0, 5.0, 5.0]
    behind = [9.55 + 0.5, 9.55 + 0.25, 9.55 + 1.0]
    beside = [5.0 + 0.0525 + 0.455, 5.0 + 0.0525 + 0.91, 5.0 + 0.0525]
    got = probe.fit(alone, behind, beside, transfer_s=0.4, kv_bytes=50 * MIB, step_s=step_s, background=4)
    assert got.send_samples == pytest.approx((10.0, 5.0, 20.0))      # ms per MiB: D over 50 MiB
    assert got.send_cpu_ms_per_mib == pytest.approx(10.0)
    assert got.extra_s == pytest.approx(0.0525)
    assert got.colocated_samples == pytest.approx((0.1, 0.2, 0.0))
    assert got.colocated == pytest.approx(0.1) and got.note == ""
    text = got.describe()
    assert "loses 10.0 ms per MiB of it (per pair 10.0, 5.0, 20.0" in text
    assert "slows it by x = 0.100 (per pair +0.100, +0.200, +0.000" in text


def test_negative_medians_are_noise_and_count_as_none():
    got = probe.fit([5.0], [9.4], [4.9], transfer_s=0.4, kv_bytes=50 * MIB, step_s=step_s, background=4)
    assert got.send_samples[0] < 0 and got.colocated_samples[0] < 0
    assert (got.send_cpu_ms_per_mib, got.colocated) == (0.0, 0.0)
    assert got.describe().endswith("the sender's CPU below 0 (noise): 0; x below 0 (noise): 0")


def test_the_sender_threads_cpu_per_mib_from_two_stats_readings():
    from types import SimpleNamespace

    def stats(*links):
        return SimpleNamespace(kv_links=[SimpleNamespace(send_cpu_seconds=cpu, bytes_sent=sent) for cpu, sent in links])

    before = probe.SenderCpu.of(stats((1.0, 10 * MIB), (0.5, 0)))
    after = probe.SenderCpu.of(stats((1.2, 60 * MIB), (0.55, 50 * MIB)))   # 0.25 s over 100 MiB, both links
    assert after.ms_per_mib_since(before) == pytest.approx(2.5)
    assert before.ms_per_mib_since(before) is None                        # nothing sent
    assert probe.SenderCpu(0.1, 20 * MIB).ms_per_mib_since(before) is None  # counters went back: a restart
