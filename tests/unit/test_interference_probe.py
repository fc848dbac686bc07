"""bench/_interference.py: from long prompts' times alone, back to back and beside a decoding batch, how much
the colocated worker's decoding slows the PrfaaS prefill (with the decode side's own extra wait taken out),
and what a prefill queued behind another loses against one alone (the layer-wise model says 0)."""
import pytest
from support.bench import bench_module

probe = bench_module("_interference")
MIB = 1 << 20


def step_s(batch):                   # a decode step: 50 ms, 5 ms more per request in the batch
    return 0.045 + 0.005 * batch


def test_the_decoding_slowdown_and_the_queued_prefills_loss_from_the_measured_times():
    # alone: a 4.55 s prefill, 0.4 s of its transfer left after it and one 50 ms step. Back to back: the
    # second's first token after two prefills, the second's loss D, the exposed transfer and a step:
    # 9.1 + D + 0.45. Beside: half a step at 4 (32.5 ms) and one at 5 (70 ms) instead of one at 1: 52.5 ms,
    # plus x of the prefill.
    alone = [5.0, 5.0, 5.0]
    behind = [9.55 + 0.5, 9.55 - 0.25, 9.55 + 1.0]
    beside = [5.0 + 0.0525 + 0.455, 5.0 + 0.0525 + 0.91, 5.0 + 0.0525]
    got = probe.fit(alone, behind, beside, exposed_s=0.4, kv_bytes=50 * MIB, step_s=step_s, background=4)
    assert got.behind_samples == pytest.approx((10.0, -5.0, 20.0))     # ms per MiB: D over 50 MiB
    assert got.behind_ms_per_mib == pytest.approx(10.0)
    assert (got.kv_mib, got.exposed_s) == (50.0, 0.4)
    assert got.extra_s == pytest.approx(0.0525)
    assert got.colocated_samples == pytest.approx((0.1, 0.2, 0.0))
    assert got.colocated == pytest.approx(0.1) and got.note == ""
    text = got.describe()
    assert "(50 MiB of KV): TTFT alone 5.000 s, of which 0.400 s the transfer left after the prefill" in text
    assert "slows the prefill by x = 0.100 (per pair +0.100, +0.200, +0.000" in text
    assert "loses +10.0 ms per MiB of the first's KV against one alone, as layer-wise streaming says 0 " \
           "(per pair +10.0, -5.0, +20.0" in text


def test_the_transfer_hidden_under_the_prefill_and_two_prefills_costing_two_alone_read_0():
    # The link carries the KV within the prefill (nothing exposed): two back to back take two prefills and a
    # step, 2 x 4.95 + 0.05.
    got = probe.fit([5.0], [9.95], [5.0525], exposed_s=0.0, kv_bytes=50 * MIB, step_s=step_s, background=4)
    assert got.behind_ms_per_mib == pytest.approx(0.0, abs=1e-9) and got.colocated == pytest.approx(0.0)


def test_a_negative_slowdown_is_noise_and_counts_as_none_a_negative_loss_is_kept():
    got = probe.fit([5.0], [9.4], [4.9], exposed_s=0.4, kv_bytes=50 * MIB, step_s=step_s, background=4)
    assert got.behind_samples[0] < 0 and got.colocated_samples[0] < 0
    assert got.behind_ms_per_mib == got.behind_samples[0] and got.colocated == 0.0
    assert got.describe().endswith("x below 0 (noise): 0")


def test_the_sender_threads_cpu_per_mib_from_two_stats_readings():
    from types import SimpleNamespace

    def stats(*links):
        return SimpleNamespace(kv_links=[SimpleNamespace(send_cpu_seconds=cpu, bytes_sent=sent) for cpu, sent in links])

    before = probe.SenderCpu.of(stats((1.0, 10 * MIB), (0.5, 0)))
    after = probe.SenderCpu.of(stats((1.2, 60 * MIB), (0.55, 50 * MIB)))   # 0.25 s over 100 MiB, both links
    assert after.ms_per_mib_since(before) == pytest.approx(2.5)
    assert before.ms_per_mib_since(before) is None                        # nothing sent
    assert probe.SenderCpu(0.1, 20 * MIB).ms_per_mib_since(before) is None  # counters went back: a restart
