"""Per-instance dispatch (the router's choose_route over one view per instance) and admission control
(the router's admit over its snapshot) in the simulator, and their flags."""
import json
import math
import subprocess
import sys
from array import array

import pytest

from services.simulator import instances
from services.simulator.admission import SimAdmission
from services.simulator.decode import DecodeInstances
from services.simulator.engine import simulate
from services.simulator.instances import InstanceRouter, PrefillInstances
from services.simulator.runtime import RuntimeInputError, RuntimeModel, parse_runtime
from services.scheduling.placement import PromptCache
from test_simulator import spec_for

THRESHOLD = 1_000


def small_router(num_decode=3, num_prfaas=2, num_local=2):
    heap, n = [], 16
    arrival_t = array("d", bytes(8 * n))
    prfaas = PrefillInstances("prfaas", num_prfaas, None, 0, (0, 1), heap, arrival_t, n)
    local = PrefillInstances("local", num_local, None, 0, (2, 3), heap, arrival_t, n)
    decode = DecodeInstances(num_decode, 4, 1.0, 4, heap, array("i", bytes(4 * n)), n, lambda now, rid: None)
    return InstanceRouter(prfaas, local, decode, None)


@pytest.mark.parametrize("lengths, expected", [
    ([2_000, 2_000, 500, 2_000],                       # least-loaded decode first, ties by name
     [("prfaas", "decode-0", "prfaas-prefill-0"), ("prfaas", "decode-1", "prfaas-prefill-1"),
      ("pd", "decode-2", "local-prefill-0"), ("prfaas", "decode-0", "prfaas-prefill-0")]),
    ([500, 500, 500],
     [("pd", "decode-0", "local-prefill-0"), ("pd", "decode-1", "local-prefill-1"),
      ("pd", "decode-2", "local-prefill-0")]),
])
def test_the_router_picks_one_instance_by_load(lengths, expected):
    router = small_router()
    got = []
    for rid, length in enumerate(lengths):
        route = router.route(rid, length, THRESHOLD, PromptCache(length), scarce=False)
        router.admitted(rid)
        group = router.prfaas if route.path == "prfaas" else router.local
        group.submit(0.0, rid, 1.0)
        got.append((route.path, route.decode, route.prefill))
    assert got == expected


def test_a_rejected_request_adds_no_load():
    router = small_router(num_decode=2)
    router.route(0, 500, THRESHOLD, PromptCache(500), scarce=False)       # not admitted: no admitted() call
    assert router.route(1, 500, THRESHOLD, PromptCache(500), scarce=False).decode == "decode-0"


def test_choose_route_sees_one_view_per_instance(case, monkeypatch):
    calls = []
    real = instances.choose_route

    def recording(views, *args, **kwargs):
        calls.append(len(views))
        return real(views, *args, **kwargs)

    monkeypatch.setattr(instances, "choose_route", recording)
    inputs, plan = case
    result = simulate(spec_for(case, "static", 0.5, 500, runtime=RuntimeModel(per_instance=True)))
    topo = result.servers
    assert calls == [topo["prfaas_prefill"] + topo["local_prefill"] + topo["decode"] // 20] * 500


@pytest.mark.parametrize("runtime", [RuntimeModel(per_instance=True), RuntimeModel(local_both=8),
                                     RuntimeModel(per_instance=True, chunk_tokens=8192)])
def test_per_instance_runs_agree_with_the_shared_queues_at_light_load(case, runtime):
    shared = simulate(spec_for(case, "static", 0.5, 4_000, seed=3)).summary()
    per_instance = simulate(spec_for(case, "static", 0.5, 4_000, seed=3, runtime=runtime)).summary()
    assert per_instance["throughput"] == pytest.approx(shared["throughput"], rel=0.03)
    assert per_instance["offloaded_fraction"] == pytest.approx(shared["offloaded_fraction"], rel=0.03)
    assert per_instance["ttft_s"]["p50"] == pytest.approx(shared["ttft_s"]["p50"], rel=0.25)


@pytest.mark.parametrize("steps, expected", [
    # (time, rid, path, prompt tokens, event) with event admit / first / done; expected: admitted or a reason
    ([(0, 0, "local", 100, "admit"), (0, 1, "local", 100, "admit"), (0, 2, "prfaas", 100, "admit")],
     [True, True, "capacity"]),
    ([(0, 0, "local", 100, "admit"), (0, 1, "local", 100, "admit"), (1, 0, "", 0, "done"),
      (1, 2, "pd", 100, "admit")], [True, True, True]),
    # 1,000 tokens prefilled in 1 s: 1,000 tokens/s on 'local'; a 1 s SLO admits 500 more, not 600 on top
    ([(0, 0, "local", 1_000, "admit"), (1, 0, "", 0, "first"), (1, 1, "local", 500, "admit"),
      (1, 2, "local", 600, "admit"), (1, 3, "prfaas", 5_000, "admit")], [True, True, "ttft_slo", True]),
])
def test_admission_table(steps, expected):
    admission = SimAdmission(RuntimeModel(admission=True, max_in_flight=2 if "capacity" in expected else 10,
                                          admission_ttft_slo_s=1.0), 99, 8)
    got = []
    for now, rid, path, tokens, event in steps:
        if event == "admit":
            before = admission.num_rejected
            ok = admission.admitted(now, rid, path, tokens)
            got.append(True if ok else next(r for r, c in admission.rejected.items() if c and before < c))
        elif event == "first":
            admission.first_token(now, rid)
        else:
            admission.finished()
    assert got == expected


def test_rejected_requests_enter_no_queue(case):
    runtime = RuntimeModel(per_instance=True, admission=True, max_in_flight=40)
    result = simulate(spec_for(case, "static", 1.2, 3_000, runtime=runtime))
    summary = result.summary()
    served = [t for t in result.ttfts if not math.isnan(t)]
    assert summary["rejected"] == result.num_rejected == sum(summary["rejected_by_reason"].values()) > 0
    assert len(served) == 3_000 - summary["rejected"]
    assert max(sum(s[1:]) for s in result.samples) <= 40
    assert summary["ttft_s"]["mean"] == pytest.approx(sum(served) / len(served))


@pytest.mark.parametrize("raw, message", [
    ({"local_both": -1}, "simulation.local_both: must be 0"),
    ({"per_instance": 1}, "simulation.per_instance: expected true or false"),
    ({"max_in_flight": 2.5}, "simulation.max_in_flight: expected an integer"),
    ({"admission_ttft_slo_s": -1}, "simulation.admission_ttft_slo_s: must be 0"),
])
def test_bad_inputs_name_the_key(raw, message):
    with pytest.raises(RuntimeInputError, match=message):
        parse_runtime(raw)


def simulate_cli(*args):
    return subprocess.run([sys.executable, "-m", "services.cli", "simulate", "--policy", "static", "--requests", "600",
                           *args], capture_output=True, text=True, timeout=120)


def test_flags_reach_the_run_and_the_output():
    out = simulate_cli("--local-both", "4", "--admission", "--max-in-flight", "6", "--load-factor", "1.2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["runtime"] | {"local_both": 4, "admission": True, "max_in_flight": 6} == data["runtime"]
    assert data["policies"]["static"]["rejected"] > 0
    text = simulate_cli("--local-both", "4", "--admission", "--max-in-flight", "6", "--load-factor", "1.2")
    assert "rejected" in text.stdout and "4 colocated 'both' workers" in text.stdout
    help_text = simulate_cli("--help").stdout
    for flag in ("--per-instance", "--local-both", "--admission", "--max-in-flight", "--admission-ttft-slo"):
        assert flag in help_text
    bad = simulate_cli("--local-both", "-1")
    assert bad.returncode == 2 and "--local-both: must be 0 or positive" in bad.stderr
