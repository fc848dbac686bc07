"""N routers' threshold controllers in front of the same PrfaaS prefill workers act as one: both
timescales read the link from the workers' own telemetry (bytes sent, retransmits, RTT: every
router's transfers), never from a router's own share, so no router plans the link as if it were
its only user.

- Short timescale: every router's ``CongestionAwareThreshold`` sees the same utilization and steps
  its threshold the same way; each applies it to its own requests, so together they offload what
  one router would (docs/deployment.md gives the lag: one stats interval).
- Long timescale: a router with 1/N of the requests measures 1/N of the arrival rate but the
  workers' bytes over its own offloaded tokens, N times the KV per token; their product, the KV
  bytes per second it plans the link for, is the whole deployment's, and its base and ceiling are
  one router's."""
from __future__ import annotations

import pytest

from test_threshold_reoptimize import KV_BYTES_PER_TOKEN, LENGTHS, Rig, prfaas_stats


def replicas(num_routers: int, **scheduler) -> list[Rig]:
    """``num_routers`` routers in front of one PrfaaS prefill worker, whose stats they all read."""
    rigs = [Rig(**scheduler) for _ in range(num_routers)]
    shared = rigs[0].prefill
    for rig in rigs[1:]:
        rig.prefill = shared
        rig.control._pool.handles = (shared,)
    return rigs


def serve_round_robin(rigs: list[Rig], from_s: float, to_s: float, rate: float = 10.0) -> None:
    """Rig.serve's requests, spread round-robin over the routers (with 2 routers one gets the 100- and
    300-token prompts, the other the 200- and 400-token ones); the worker's bytes count them all."""
    for i in range(int((to_s - from_s) * rate)):
        rig, num_tokens = rigs[i % len(rigs)], LENGTHS[i % len(LENGTHS)]
        for each in rigs:
            each.clock.now_s = from_s + i / rate
        rig.control.reoptimizer.record_request(num_tokens)
        path = "prfaas" if num_tokens > 250 else "local"
        rig.queues.enqueue(path, num_tokens)
        if path == "local":
            rig.clock.now_s += num_tokens / 1000
        rig.queues.dequeue(path, num_tokens, prefilled=True)
        if path == "prfaas":
            rig.prefill.stats = prfaas_stats(rig.prefill.stats.kv_links[0].bytes_sent + num_tokens * KV_BYTES_PER_TOKEN)


def poll_all(rigs: list[Rig], now_s: float) -> None:
    for rig in rigs:
        rig.poll_at(now_s)


def offloaded_gbps(rigs: list[Rig], seconds: float, rate: float = 10.0) -> float:
    """The KV the routers would send at their re-optimised bases, all together, for the served mix."""
    num_bytes = 0
    for i in range(int(seconds * rate)):
        rig, num_tokens = rigs[i % len(rigs)], LENGTHS[i % len(LENGTHS)]
        if num_tokens > rig.control.controller.base_tokens:
            num_bytes += num_tokens * KV_BYTES_PER_TOKEN
    return num_bytes * 8 / seconds / 1e9


@pytest.mark.parametrize("num_routers", [1, 2, 3, 5])
def test_n_routers_together_plan_no_more_than_the_link(num_routers):
    rigs = replicas(num_routers, reoptimize_interval_s=60)
    poll_all(rigs, 0.0)
    serve_round_robin(rigs, 0.0, 59.0)
    poll_all(rigs, 60.0)
    # each router's share of the link: its offloaded tokens over all of them (the KV per token it
    # measures is the workers' bytes over its own tokens); the shares add up to the whole link
    shares = [KV_BYTES_PER_TOKEN / rig.control.reoptimizer.profiles.kv_bytes_per_token for rig in rigs]
    assert sum(shares) == pytest.approx(1.0, rel=0.02)
    capacity_gbps = rigs[0].config.scheduler.link_capacity_gbps
    assert offloaded_gbps(rigs, 59.0) <= capacity_gbps, [rig.control.controller.base_tokens for rig in rigs]
    assert offloaded_gbps(rigs, 59.0) >= 0.6 * capacity_gbps  # and they use it (not: offload nothing)


def test_the_short_timescale_steps_every_router_alike():
    """The link is busy (the workers' bytes): every router raises its threshold, as one router does,
    and lowers it again together once the link is idle."""
    one, many = replicas(1), replicas(3)
    steps = {1: [], 3: []}
    for rigs in (one, many):
        poll_all(rigs, 0.0)
        for second in range(1, 30):
            if second < 15:  # 0.4 Gbit/s of KV for 15 s on a 0.2 Gbit/s link
                rigs[0].prefill.stats = prfaas_stats(rigs[0].prefill.stats.kv_links[0].bytes_sent + 50_000_000)
            poll_all(rigs, float(second))
            thresholds = {rig.control.controller.threshold_tokens for rig in rigs}
            assert len(thresholds) == 1, f"routers disagree at {second} s: {thresholds}"
            steps[len(rigs)].append(thresholds.pop())
    assert steps[1] == steps[3]
    assert max(steps[3]) > 64 and steps[3][-1] < max(steps[3])  # it rose under load and came down after
