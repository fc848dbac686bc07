"""The router's long-timescale loop: re-optimising the threshold's base and ceiling on schedule."""
import asyncio
from types import SimpleNamespace

import pytest
from services.worker_api.types import LinkStats, WorkerStats

from services.config import parse_config
from services.router.admission import PrefillQueues
from services.router.dispatch import Dispatcher, NoWorkerAvailable
from services.router.metrics import RouterMetrics
from services.router.placement import Placement
from services.router.threshold_control import ThresholdControl
from services.worker_api.types import GenerateInput, Sampling

LENGTHS = (100, 200, 300, 400)
KV_BYTES_PER_TOKEN = 10_000


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def deployment(**scheduler):
    return parse_config({
        "workers": [{"name": "p0", "service": "prefill_worker", "cluster": "prfaas", "port": 1},
                    {"name": "d0", "port": 2, "kv_port": 3}],
        "scheduler": {"adaptive_threshold": True, "threshold_hold_s": 0, "offload_threshold_tokens": 64,
                      "max_offload_threshold_tokens": 1000, "link_capacity_gbps": 0.2, **scheduler}})


def prfaas_stats(bytes_sent):
    return WorkerStats(kv_links=(LinkStats(peer="127.0.0.1:3", bytes_sent=bytes_sent, rtt_ms=1.0),))


class Rig:
    """ThresholdControl over a fake pool: one PrfaaS prefill worker whose sent bytes the test sets."""

    def __init__(self, **scheduler) -> None:
        self.config = deployment(**scheduler)
        self.clock = FakeClock()
        self.metrics = RouterMetrics()
        self.queues = PrefillQueues({}, self.metrics, clock=self.clock)
        self.prefill = SimpleNamespace(name="p0", healthy=True, prefill=object(), config=self.config.workers[0],
                                       stats=prfaas_stats(0), num_handoffs_waiting=0)
        pool = SimpleNamespace(handles=(self.prefill,))
        self.control = ThresholdControl(self.config, pool, self.metrics, clock=self.clock, queues=self.queues)
        self.placement = Placement(self.config, pool, self.metrics, threshold=self.control.controller)

    def poll_at(self, now_s):
        self.clock.now_s = now_s
        self.control.on_poll()

    def serve(self, from_s, to_s, rate=10.0):
        """Requests 100..400 tokens at ``rate``; those above 250 offloaded (10 kB of KV per token), the
        others prefilled locally at 1000 tokens/s."""
        num_requests = int((to_s - from_s) * rate)
        for i in range(num_requests):
            self.clock.now_s = from_s + i / rate
            num_tokens = LENGTHS[i % len(LENGTHS)]
            self.control.reoptimizer.record_request(num_tokens)
            path = "prfaas" if num_tokens > 250 else "local"
            self.queues.enqueue(path, num_tokens)
            if path == "local":
                self.clock.now_s += num_tokens / 1000
            self.queues.dequeue(path, num_tokens, prefilled=True)
            if path == "prfaas":
                sent = self.prefill.stats.kv_links[0].bytes_sent + num_tokens * KV_BYTES_PER_TOKEN
                self.prefill.stats = prfaas_stats(sent)


def value(metric):
    return metric._value.get()


def test_reoptimises_on_schedule_from_the_measured_profiles(caplog):
    caplog.set_level("DEBUG", logger="services.router.reoptimize")
    rig = Rig(reoptimize_interval_s=60)
    assert value(rig.metrics.threshold_base) == 64 and value(rig.metrics.threshold_ceiling) == 1000
    rig.poll_at(0.0)
    rig.serve(0.0, 59.0)
    rig.poll_at(59.0)
    assert value(rig.metrics.reoptimizations) == 0
    rig.poll_at(60.0)
    controller = rig.control.controller
    assert value(rig.metrics.reoptimizations) == 1
    assert rig.control.reoptimizer.profiles.kv_bytes_per_token == pytest.approx(KV_BYTES_PER_TOKEN)
    # 590 requests in 60 s on 0.2 Gbit/s: the link fits from t = 200 on, local prefill below t = 300.
    assert 200 <= controller.base_tokens < 216
    assert 300 <= controller.ceiling_tokens < 316
    # The short timescale saw the link busy and had raised t: it stays, now within [base, ceiling].
    assert rig.placement.threshold_tokens == controller.threshold_tokens
    assert controller.base_tokens <= controller.threshold_tokens <= controller.ceiling_tokens
    assert value(rig.metrics.threshold_base) == controller.base_tokens
    assert value(rig.metrics.threshold_ceiling) == controller.ceiling_tokens
    assert value(rig.metrics.kv_bytes_per_token) == pytest.approx(KV_BYTES_PER_TOKEN)
    # the link in prompt tokens of KV per second: a codec's fewer bytes per token raise it
    assert value(rig.metrics.link_kv_tokens_per_second) == pytest.approx(
        rig.config.scheduler.link_capacity_gbps * 1e9 / 8 / KV_BYTES_PER_TOKEN)
    rig.poll_at(90.0)
    assert value(rig.metrics.reoptimizations) == 1
    rig.poll_at(125.0)  # due again, but the window holds no request since 65 s: skipped
    assert value(rig.metrics.reoptimizations) == 1
    messages = [r.getMessage() for r in caplog.records]
    assert sum("offload threshold re-optimised" in m for m in messages) == 1
    assert any("re-optimisation skipped: 0 requests" in m for m in messages)
    assert 200 <= controller.base_tokens < 216


def test_too_little_data_skips_and_retries_an_interval_later():
    rig = Rig(reoptimize_interval_s=60)
    rig.poll_at(0.0)
    rig.serve(0.0, 2.0)  # 20 requests: fewer than the sample needs
    rig.poll_at(60.0)
    assert value(rig.metrics.reoptimizations) == 0
    assert rig.control.controller.base_tokens == 64
    rig.serve(60.0, 110.0)
    rig.poll_at(110.0)
    assert value(rig.metrics.reoptimizations) == 0
    rig.poll_at(120.0)
    assert value(rig.metrics.reoptimizations) == 1


@pytest.mark.parametrize("scheduler", [{"reoptimize_interval_s": 0}, {}])
def test_interval_zero_disables_and_no_queues_means_no_long_timescale(scheduler):
    rig = Rig(**scheduler)
    assert (rig.control.reoptimizer is None) == ("reoptimize_interval_s" in scheduler)
    no_queues = ThresholdControl(rig.config, SimpleNamespace(handles=()), RouterMetrics(), clock=rig.clock)
    assert no_queues.reoptimizer is None


def test_dispatcher_reports_each_request_once():
    config = deployment()
    pool = SimpleNamespace(route=lambda *args, **kwargs: None, handles=())
    metrics = RouterMetrics()
    dispatcher = Dispatcher(pool, config.router, metrics, Placement(config, pool, metrics))
    lengths = []
    dispatcher.on_request.append(lengths.append)

    async def run():
        request = GenerateInput("r1", [1, 2, 3], Sampling(max_tokens=4))
        with pytest.raises(NoWorkerAvailable):
            async for _ in dispatcher.generate(request):
                pass

    asyncio.run(run())
    assert lengths == [3]


def test_negative_interval_is_refused():
    from services.config.errors import ConfigError

    with pytest.raises(ConfigError, match="scheduler.reoptimize_interval_s"):
        deployment(reoptimize_interval_s=-1)
