"""bench/router_replicas.py's short check, so that it cannot rot without three engines (the suite's
e2e tests/e2e/test_router_replicas.py runs `prfaas up --routers` itself): its workload's shape, and
its verdict on recorded results: it passes only when every target holds, and it fails when no flip
happened while 3 routers served (a vacuous roles check), when a router's view of a role disagrees
with the worker's past one stats interval, when a worker held more hand-offs than its limit, when
3 routers' cached tokens fall below 0.95x one's, or (outside --quick) when TTFT moves by more than 10%."""
from __future__ import annotations

from support.bench import bench_module

bench = bench_module("router_replicas")


class _Sampler:
    def __init__(self, flips: list, views_agree: bool = True) -> None:
        self.flips = flips
        roles = {"pd-p": "prefill", "pd-d1": "decode"}
        view = roles if views_agree else {**roles, "pd-d1": "prefill"}
        self.samples = [{"at": 10.0 + i, "roles": roles, "views": [roles, view], "last_flip": {"pd-d1": 1.0}}
                        for i in range(5)]

    disagreements = bench.Sampler.disagreements


def _sent(ttft_3: float = 1.0, cached_3: int = 100) -> list:
    one = [bench.Sent(0, 1, i % 2 == 0, 1.0 + 0.01 * i, 100) for i in range(10)]
    three = [bench.Sent(1, 3, i % 2 == 0, ttft_3 + 0.01 * i, cached_3) for i in range(10)]
    return one + three


FLIPPED = [(5.0, "pd-d1", "prefill", 3)]


def test_the_verdict_passes_only_when_every_target_holds(capsys):
    assert bench.report(_sent(), {"pd-p": 2}, _Sampler(FLIPPED), gate_ttft=True) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("PASS")
    assert bench.report(_sent(), {"pd-p": 2}, _Sampler([]), gate_ttft=True) == 1  # no flip: vacuous
    assert bench.report(_sent(), {"pd-p": 2}, _Sampler([(5.0, "pd-d1", "prefill", 1)]), gate_ttft=True) == 1
    assert bench.report(_sent(), {"pd-p": 2}, _Sampler(FLIPPED, views_agree=False), gate_ttft=True) == 1
    assert bench.report(_sent(), {"pd-p": bench.MAX_HANDOFFS + 1}, _Sampler(FLIPPED), gate_ttft=True) == 1
    assert bench.report(_sent(cached_3=90), {"pd-p": 2}, _Sampler(FLIPPED), gate_ttft=True) == 1
    assert bench.report(_sent(ttft_3=1.2), {"pd-p": 2}, _Sampler(FLIPPED), gate_ttft=True) == 1
    assert bench.report(_sent(ttft_3=1.2), {"pd-p": 2}, _Sampler(FLIPPED), gate_ttft=False) == 0  # --quick


def test_every_block_has_the_same_shape_with_prefixes_of_its_own():
    first, second = bench.block_prompts(0), bench.block_prompts(1)
    assert len(first) == len(second) == bench.BURST + bench.STEADY
    assert [len(p) for p, _, _ in first] == [len(p) for p, _, _ in second]
    assert not {tuple(p[:bench.PREFIX]) for p, _, _ in first} & {tuple(p[:bench.PREFIX]) for p, _, _ in second}
