from dataclasses import replace

import pytest

from services.scheduling.offload import CacheTransfer
from services.scheduling.placement import PromptCache, Route, WorkerView, choose_route, pick_least_loaded


def view(name, healthy=True, generate=True, in_flight=0, active=0, running=0, waiting=0, kv=0.0):
    return WorkerView(name, healthy, generates=generate, num_in_flight=in_flight, num_active=active,
                      num_running=running, num_waiting=waiting, kv_cache_usage=kv)


@pytest.mark.parametrize(
    "workers, exclude, expected",
    [
        ((), frozenset(), None),
        ((view("a"), view("b")), frozenset(), "a"),
        ((view("a", in_flight=2), view("b", in_flight=1)), frozenset(), "b"),
        ((view("a", running=3), view("b", active=1)), frozenset(), "b"),
        ((view("a", waiting=1), view("b", waiting=1, kv=0.5)), frozenset(), "a"),
        ((view("a", healthy=False), view("b", in_flight=9)), frozenset(), "b"),
        ((view("a", generate=False), view("b", in_flight=9)), frozenset(), "b"),
        ((view("a"), view("b", in_flight=9)), frozenset({"a"}), "b"),
        ((view("a", healthy=False),), frozenset(), None),
    ],
)
def test_pick_least_loaded(workers, exclude, expected):
    assert pick_least_loaded(workers, exclude) == expected


DECODE = WorkerView("d", True, role="both", receives_kv=True)
PD_D = WorkerView("pd-d", True, role="decode", receives_kv=True)
PD_P = WorkerView("pd-p", True, role="prefill", generates=False, prefills=True)
PRFAAS = WorkerView("p", True, cluster="prfaas", generates=False, prefills=True)
PRFAAS_BUSY = WorkerView("p2", True, cluster="prfaas", generates=False, prefills=True, num_in_flight=3)
NO_KV = WorkerView("d", True, role="both")


@pytest.mark.parametrize(
    "workers, length, expected",
    [
        ((DECODE, PRFAAS), 100, Route("local", "d")),
        ((DECODE, PRFAAS), 1000, Route("local", "d")),
        ((DECODE, PRFAAS), 1001, Route("prfaas", "d", "p")),
        ((DECODE, PRFAAS_BUSY, PRFAAS), 5000, Route("prfaas", "d", "p")),
        ((DECODE, WorkerView("p", False, cluster="prfaas", generates=False, prefills=True)), 5000,
         Route("local", "d")),
        ((NO_KV, PRFAAS), 5000, Route("local", "d")),
        ((PD_D, PD_P, PRFAAS), 100, Route("pd", "pd-d", "pd-p")),
        ((PD_D, PD_P, PRFAAS), 5000, Route("prfaas", "pd-d", "p")),
        ((PD_D,), 100, Route("local", "pd-d")),
        ((PD_P, PRFAAS), 100, None),
    ],
)
def test_choose_route(workers, length, expected):
    assert choose_route(workers, length, threshold_tokens=1000) == expected


@pytest.mark.parametrize("workers, expected", [
    ((view("a", kv=0.95), view("b", in_flight=5, kv=0.2)), "b"),      # near-full KV only as a last resort
    ((view("a", kv=0.95), view("b", kv=0.99)), "a"),
    ((view("a", kv=0.89, running=1), view("b", kv=0.1, running=1)), "b"),
    ((view("a", kv=0.95, healthy=False), view("b", kv=0.97)), "b"),
])
def test_decode_pick_avoids_nearly_full_kv(workers, expected):
    assert pick_least_loaded(workers) == expected


P1 = WorkerView("p1", True, cluster="prfaas", generates=False, prefills=True)
P2_BUSY = WorkerView("p2", True, cluster="prfaas", generates=False, prefills=True, num_in_flight=2)
P3_DOWN = WorkerView("p3", False, cluster="prfaas", generates=False, prefills=True)


@pytest.mark.parametrize("cluster_tokens, worker_tokens, scarce, expected", [
    # cache-affine prefill pick, load as the tie-break
    ({}, {}, False, Route("prfaas", "d", "p1")),
    ({}, {"p2": 512}, False, Route("prfaas", "d", "p2")),
    ({}, {"p1": 512, "p2": 512}, False, Route("prfaas", "d", "p1")),
    ({}, {"p3": 4096}, False, Route("prfaas", "d", "p1")),          # unhealthy: skipped
    # the cache pools decide the path
    ({"local": 4500}, {}, False, Route("local", "d", None, 4500)),
    ({"prfaas": 4500}, {}, False, Route("local", "d", None, 4500, CacheTransfer("prfaas", "local", 4500))),
    ({"prfaas": 4500}, {}, True, Route("prfaas", "d", "p1", 4500)),
    ({"local": 4500, "prfaas": 4900}, {}, True, Route("local", "d", None, 4500)),
])
def test_choose_route_with_cached_prefixes(cluster_tokens, worker_tokens, scarce, expected):
    cache = PromptCache(5000, cluster_tokens, worker_tokens)
    route = choose_route((DECODE, P1, P2_BUSY, P3_DOWN), 5000, threshold_tokens=1000, cache=cache, scarce=scarce)
    assert route == expected


def test_pd_prefill_pick_is_cache_affine():
    other = WorkerView("pd-p2", True, role="prefill", generates=False, prefills=True)
    cache = PromptCache(100, {}, {"pd-p2": 64})
    assert choose_route((PD_D, PD_P, other), 100, 1000, cache=cache) == Route("pd", "pd-d", "pd-p2")


def refusing(worker: WorkerView, *decode: str) -> WorkerView:
    return replace(worker, cannot_feed=frozenset(decode))


D2 = WorkerView("d2", True, role="both", receives_kv=True, num_in_flight=1)


@pytest.mark.parametrize("workers, length, worker_tokens, expected", [
    # a prefill worker whose layout cannot map to the decode worker's takes none of its prompts
    ((DECODE, refusing(P1, "d"), P2_BUSY), 5000, {"p1": 4096}, Route("prfaas", "d", "p2")),
    ((DECODE, refusing(P1, "d"), refusing(P2_BUSY, "d")), 5000, {}, Route("local", "d")),
    ((DECODE, refusing(PRFAAS, "d")), 5000, {}, Route("local", "d")),
    # it still feeds the decode workers it maps to
    ((DECODE, refusing(PRFAAS, "d2")), 5000, {}, Route("prfaas", "d", "p")),
    ((refusing(PRFAAS, "d"), D2, replace(DECODE, num_in_flight=2)), 5000, {}, Route("prfaas", "d2", "p")),
    # the PD path too: with no local prefill worker left the decode worker prefills itself
    ((PD_D, refusing(PD_P, "pd-d")), 100, {}, Route("local", "pd-d")),
    ((PD_D, refusing(PD_P, "pd-d"), WorkerView("pd-p2", True, role="prefill", generates=False, prefills=True)), 100,
     {"pd-p": 64}, Route("pd", "pd-d", "pd-p2")),
])
def test_choose_route_skips_prefill_workers_that_cannot_feed_the_decode_worker(workers, length, worker_tokens,
                                                                             expected):
    cache = PromptCache(length, {}, worker_tokens)
    assert choose_route(workers, length, threshold_tokens=1000, cache=cache) == expected


@pytest.mark.parametrize("own_in_flight, reported_active, started_since_poll, load", [
    (2, 0, 2, 2),    # only this router's requests, none reported yet
    (1, 5, 0, 5),    # other routers' requests, as the worker reported them
    (3, 5, 2, 7),    # reported (all routers' at the poll) plus this router's since
])
def test_a_workers_load_is_what_it_reported_plus_this_routers_requests_since(own_in_flight, reported_active,
                                                                             started_since_poll, load):
    view = WorkerView("w", True, num_in_flight=own_in_flight, num_active=reported_active,
                      num_started_since_poll=started_since_poll)
    assert view.load == load
