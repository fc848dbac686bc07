"""`prfaas profile` without an engine: the batch search, KV groups, the point cache (an interrupted run
resumes), the profile file read by plan and simulate, and clear errors."""
import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import yaml

from services.planner.measured_profile import decode_step_curve, load_profile
from services.profiler.cache import PointCache
from services.profiler.engine import EngineInfo
from services.profiler.grid import Grid, largest_passing, next_search_batch
from services.profiler.kv import kv_bytes, kv_groups
from services.profiler.measure import Profiler
from services.profiler.report import non_decreasing, profile_document, profile_yaml

TARGET = 0.05


@pytest.mark.parametrize("times, limit, expected", [
    ({}, 64, 1),                                   # nothing measured: start at 1
    ({1: 0.09}, 64, None),                         # batch 1 already misses
    ({1: 0.01, 4: 0.02, 16: 0.04}, 64, 32),        # all pass: double
    ({1: 0.01, 4: 0.02, 16: 0.04}, 20, 20),        # ... up to the engine's limit
    ({1: 0.01, 4: 0.02, 16: 0.04, 20: 0.045}, 20, None),
    ({1: 0.01, 16: 0.04, 32: 0.07}, 64, 24),       # bisect between pass and fail
    ({1: 0.01, 16: 0.04, 17: 0.07}, 64, None),     # adjacent: done
])
def test_next_search_batch(times, limit, expected):
    assert next_search_batch(times, TARGET, limit) == expected


def test_largest_passing():
    assert largest_passing({1: 0.01, 16: 0.04, 24: 0.06}, TARGET) == 16
    assert largest_passing({1: 0.06}, TARGET) is None


def test_non_decreasing_pools_violators():
    assert non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert non_decreasing([1.0, 2.0]) == [1.0, 2.0]


@dataclass
class Spec:
    block_size: int
    page_size_bytes: int
    sliding_window: int | None = None


@dataclass
class MambaLike(Spec):
    shapes: tuple = ((3, 512), (4, 64, 64))


@dataclass
class Group:
    kv_cache_spec: object
    layer_names: list


@dataclass
class KvConfig:
    kv_cache_groups: list


def test_kv_groups_of_a_hybrid_model():
    """Qwen3-Next-like: one full-attention layer (128-token pages of 64 KiB) and three GDN layers."""
    config = KvConfig([Group(MambaLike(128, 65536), ["l0"]), Group(MambaLike(128, 65536), ["l1", "l2"]),
                       Group(Spec(128, 65536), ["l3"])])
    groups = kv_groups(config)
    assert [g.kind for g in groups] == ["linear_attention", "linear_attention", "full_attention"]
    assert groups[2].bytes_per_token == 512
    assert groups[1].state_bytes_per_request == 2 * 65536
    assert kv_bytes(groups, 129) == 3 * 65536 + 2 * 65536  # two attention pages, three states


def test_sliding_window_stops_growing():
    (group,) = kv_groups(KvConfig([Group(Spec(16, 1024, sliding_window=64), ["a", "b"])]))
    assert group.kind == "sliding_window"
    assert group.bytes_for(10_000) == group.bytes_for(80) == 5 * 1024 * 2


GROUPS = tuple(kv_groups(KvConfig([Group(Spec(128, 98304), [f"l{i}" for i in range(30)])])))
INFO = EngineInfo(vllm_version="test", dtype="bfloat16", max_model_len=2048, chunk_tokens=2048, max_num_seqs=64,
                  block_size=128, num_blocks=364, enable_prefix_caching=True, vocab_size=49152, groups=GROUPS)
GRID = Grid(input_tokens=(128, 512, 1024), hit_ratios=(0.0, 0.5), batch_sizes=(1, 4, 16), context_tokens=(256,),
            repeats=1, decode_steps=4, search_steps=2)


class FakeEngine:
    """Latency linear in computed tokens; decode step 10 ms + 2 ms per request. ``interrupt_at``: raise
    KeyboardInterrupt on that call, as Ctrl-C would."""

    def __init__(self, calls, interrupt_at=None):
        self.calls, self.interrupt_at = calls, interrupt_at
        self.cached: set[tuple[int, ...]] = set()

    def start(self):
        self.calls.append("start")
        return INFO

    def prefill(self, prompt):
        self._call(("prefill", len(prompt)))
        hit = max((n for n in range(0, len(prompt), 128) if tuple(prompt[:n]) in self.cached), default=0)
        self.cached.update(tuple(prompt[:n]) for n in range(128, len(prompt) + 1, 128))
        return (len(prompt) - hit) * 1e-4 + 1e-3, hit

    def decode_steps(self, prompts, num_steps):
        self._call(("decode", len(prompts)))
        return [0.01 + 0.002 * len(prompts)] * num_steps

    def shutdown(self):
        self.calls.append("shutdown")

    def _call(self, what):
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        self.calls.append(what)


def profile(tmp_path, calls, interrupt_at=None):
    cache = PointCache(tmp_path / "cache", {"model": "fake"})
    return Profiler(GRID, cache, lambda: FakeEngine(calls, interrupt_at), TARGET).run()


def test_hit_points_without_a_whole_cached_block_are_left_out():
    points = GRID.prefill_points(block_size=512)
    assert [(p.input_tokens, p.hit_ratio) for p in points] == [(128, 0.0), (512, 0.0), (1024, 0.0), (1024, 0.5)]


def test_profile_measures_grid_and_searches_the_batch(tmp_path):
    calls = []
    results = profile(tmp_path, calls)
    assert calls[0] == "start" and calls[-1] == "shutdown"
    assert [r["latency_s"] for r in results.prefill if r["hit_ratio"] == 0] == pytest.approx([0.0138, 0.0522, 0.1034])
    half = next(r for r in results.prefill if r["input_tokens"] == 1024 and r["hit_ratio"] == 0.5)
    assert half["cached_tokens"] == 512
    # steps: 12, 18, 42 ms for 1, 4, 16; then 32 (74 ms, fails) and 24 (58 ms, fails): 20 ms needs batch <= 20
    assert [r["batch_size"] for r in results.decode] == [1, 4, 16, 32, 24]
    assert results.max_batch_size == 16 and results.limited_by == "tpot" and results.meets_target


def test_interrupted_profile_resumes_without_measuring_done_points(tmp_path):
    first = []
    with pytest.raises(KeyboardInterrupt):  # start, 128 (1 call), 512 (1), 512 at 50% hit (2), then Ctrl-C
        profile(tmp_path, first, interrupt_at=5)
    assert first.count("shutdown") == 1
    second = []
    results = profile(tmp_path, second)
    measured = [c for c in second if c not in ("start", "shutdown")]
    assert measured[0] == ("prefill", 1024)  # resumes at the first point not measured
    assert len(measured) == 1 + 2 + 3 + 2  # the rest: 1024 at 0 and 50% hit (3 calls), 3 decode, 2 searched
    assert results.num_cached == 3 and results.num_measured == 7
    third = []
    again = profile(tmp_path, third)
    assert third == [] and again.num_measured == 0  # everything cached: the engine never starts
    assert again.prefill == results.prefill and again.max_batch_size == results.max_batch_size


def test_cache_key_covers_engine_settings(tmp_path):
    a = PointCache(tmp_path, {"engine": {"max_num_batched_tokens": 2048}, "vllm": "0.32.0"})
    b = PointCache(tmp_path, {"engine": {"max_num_batched_tokens": 512}, "vllm": "0.32.0"})
    a.put("prefill-128-hit0", {"latency_s": 1.0})
    assert a.get("prefill-128-hit0") == {"latency_s": 1.0}
    assert b.get("prefill-128-hit0") is None


def write_profile(tmp_path):
    results = profile(tmp_path, [])
    document = profile_document(results, "fake-model", {"vllm_version": "test"})
    path = tmp_path / "profile.yaml"
    path.write_text(profile_yaml(document))
    return path, document


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True)


def test_profile_yaml_round_trips_into_plan_and_simulate(tmp_path):
    path, document = write_profile(tmp_path)
    measured = load_profile(path)
    assert list(measured.prefill.latency_s) == document["profiles"]["prefill"]["latency_s"]
    assert measured.prefill.kv_size_mib == pytest.approx([30 * 98304 * n / 2**20 for n in (1, 4, 8)])
    assert (measured.decode.max_batch_size, measured.decode.step_time_s) == (16, 0.042)
    plan = json.loads(run_cli("plan", "--profile", str(path), "--json").stdout)
    (replaced,) = plan["measured_profiles"]
    assert sorted(replaced["replaced"]) == ["h200_prefill", "h20_decode", "h20_prefill"]
    assert plan["extrapolation"].endswith("the measured prefill profile stops at 1,024 (extrapolated linearly)")
    kv = plan["phi_kv"]["h200_prefill"][0]
    assert kv["length_tokens"] == 128
    assert kv["latency_s"] == pytest.approx(document["profiles"]["prefill"]["latency_s"][0])
    assert plan["prfaas_pd"]["theta_pd_d"] == pytest.approx(plan["prfaas_pd"]["n_d"] * 16 / (0.042 * 1024))
    assert "paper_comparison" not in plan  # the paper's Table 6 is for its own inputs, not measured ones
    assert "Table 6" not in run_cli("plan", "--profile", str(path)).stdout
    assert "Table 6" in run_cli("plan").stdout
    sim = json.loads(run_cli("simulate", "--profile", str(path), "--requests", "200", "--policy", "static",
                             "--json").stdout)
    assert sim["runtime"]["chunk_tokens"] == 2048  # the engine's max_num_batched_tokens
    # decode steps by batch at the reference context (256): 10 ms + 2 ms per request, the searched batches too
    assert sim["runtime"]["decode_step_s_by_batch"] == [[1, 0.012], [4, 0.018], [16, 0.042], [24, 0.058], [32, 0.074]]
    assert sim["planner"]["lambda_max"] == pytest.approx(plan["prfaas_pd"]["lambda_max"])


def test_named_profile_replaces_only_that_one(tmp_path):
    path, _ = write_profile(tmp_path)
    plan = json.loads(run_cli("plan", "--profile", f"h20_decode={path}", "--json").stdout)
    assert plan["measured_profiles"][0]["replaced"] == ["h20_decode"]
    assert plan["phi_kv"]["h200_prefill"][0]["length_tokens"] == 1024  # the case study's own table
    bad = run_cli("plan", "--profile", f"nope={path}")
    assert bad.returncode == 2 and "no profile 'nope'" in bad.stderr


def test_not_a_profile_is_refused(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"profiles": {}}))
    result = run_cli("plan", "--profile", str(path))
    assert result.returncode == 2 and "prfaas_profile: required key is missing" in result.stderr


@pytest.mark.parametrize("config, message", [
    ("model: {path: /nonexistent/model}\n", "model.path: /nonexistent/model is not a directory"),
    ("model: {path: 'builtin:nope'}\n", "unknown builtin model 'nope'"),
    ("engine: {max_num_seqs: many}\n", "engine.max_num_seqs"),
])
def test_profile_bad_config_exits_2(tmp_path, config, message):
    path = tmp_path / "deploy.yaml"
    path.write_text(config + "workers: [{name: pd-0, port: 50071}]\n")
    result = run_cli("profile", "--config", str(path), "--quick", "--output", str(tmp_path / "p.yaml"))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_profile_unknown_worker_exits_2(tmp_path):
    result = run_cli("profile", "--worker", "nope", "--output", str(tmp_path / "p.yaml"))
    assert result.returncode == 2 and "no worker named 'nope'" in result.stderr


def test_model_directory_without_config_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    path = tmp_path / "deploy.yaml"
    path.write_text(f"model: {{path: {tmp_path / 'empty'}}}\nworkers: [{{name: pd-0, port: 50071}}]\n")
    result = run_cli("profile", "--config", str(path), "--output", str(tmp_path / "p.yaml"))
    assert result.returncode == 2 and "has no config.json" in result.stderr


def test_engine_that_fails_to_start_is_one_error(tmp_path):
    from services.profiler.engine import EngineStartError

    class Broken(FakeEngine):
        def start(self):
            raise RuntimeError("Engine core initialization failed.\n  See root cause above.")

    profiler = Profiler(GRID, PointCache(None, {}), lambda: Broken([]), TARGET)
    with pytest.raises(EngineStartError, match="^Engine core initialization failed. See root cause above.$"):
        profiler.run()


@pytest.mark.parametrize("bind, allowed, expected", [
    ("0", {0, 1}, [0]),
    ("1-3,6", set(range(8)), [1, 2, 3, 6]),
    ("0,1|2,3", set(range(4)), [0, 1]),   # the first rank's list
    ("auto", {0, 1}, [0]),                # vLLM reserves the last CPU for its scheduler process
    (None, {0}, [0]),
    ("nobind", {0, 1}, None),
])
def test_engine_cpus_follow_vllm_binding(bind, allowed, expected):
    from services.engine.cpus import engine_cpus

    assert engine_cpus(bind, allowed) == expected


@pytest.mark.parametrize("bind, expected", [
    ("0", {0}), ("0|1", {0, 1}), ("0-1,3|4", {0, 1, 3, 4}), ("auto", None), (None, None), ("nobind", None),
])
def test_a_worker_is_kept_on_every_cpu_its_engine_binding_lists(bind, expected):
    from services.engine.cpus import all_rank_cpus

    assert all_rank_cpus(bind) == expected


def test_confining_a_worker_sets_this_process_affinity_and_its_children_inherit_it():
    import os
    import subprocess
    import sys

    from services.engine.cpus import confine_worker

    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    code = ("import os; from services.engine.cpus import confine_worker; "
            f"print(sorted(confine_worker({{'VLLM_CPU_OMP_THREADS_BIND': '{first}'}}) or []), "
            "sorted(os.sched_getaffinity(0)), os.popen('grep Cpus_allowed_list /proc/self/status').read().split()[-1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == out[1] == f"[{first}]" and out[2] == str(first)  # the grep child runs there too
    assert confine_worker({"VLLM_CPU_OMP_THREADS_BIND": "auto"}) is None and os.sched_getaffinity(0) == allowed


def test_decode_step_curve_interpolates_between_measured_contexts():
    points = [{"batch_size": b, "context_tokens": c, "step_time_s": 0.01 * b + c / 10_000}
              for c in (256, 1024) for b in (1, 4)] + [{"batch_size": 8, "context_tokens": 1024, "step_time_s": 0.2},
                                                     {"batch_size": 2, "context_tokens": 256, "skipped": "too big"}]
    def flat(curve):
        return [x for point in curve for x in point]

    assert flat(decode_step_curve(points, 640)) == pytest.approx([1, 0.074, 4, 0.104])  # halfway: 0.0256 .. 0.1024
    assert flat(decode_step_curve(points, 100)) == pytest.approx([1, 0.0356, 4, 0.0656])  # the nearest context
    assert flat(decode_step_curve(points, 1024)) == pytest.approx([1, 0.1124, 4, 0.1424, 8, 0.2])
    assert decode_step_curve(points[:1], 256) == ()  # one batch is no curve


@pytest.mark.parametrize("tp, env, expected", [
    (1, {"VLLM_CPU_OMP_THREADS_BIND": "1"}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}),
    (1, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2"}),
    (1, {"VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "3"},
     {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "3"}),       # an operator's thread count stays
    (2, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, None),                          # TP ranks need vLLM's processes
    (1, {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, None),  # the operator's choice
    (1, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, None),
    (1, {"VLLM_CPU_OMP_THREADS_BIND": "zero"}, None),
])
def test_a_tp1_cpu_engine_runs_its_model_in_the_engine_core_process(tp, env, expected):
    from services.engine.cpus import model_in_engine_core

    before = dict(env)
    moved = model_in_engine_core(tp, env)
    assert moved == (expected is not None)
    assert env == ({**before, **expected} if expected else before)


def test_an_unbound_tp1_engine_gets_the_cpus_vllm_would_give_its_worker():
    import os

    from services.engine.cpus import model_in_engine_core, vllm_auto_cpus

    allowed = os.sched_getaffinity(0)
    cpus = vllm_auto_cpus()
    assert cpus and set(cpus) <= allowed
    cores = {open(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id").read() for cpu in allowed}
    if len(cores) <= 2:  # vLLM keeps none back for other processes: one CPU per core
        assert len(cpus) == len(cores)
    env: dict[str, str] = {}
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    assert model_in_engine_core(1, env) and os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == before
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(len(cpus)),
                   "OMP_PLACES": "{" + ",".join(map(str, cpus)) + "}", "OMP_PROC_BIND": "true"}


def test_a_worker_is_profiled_in_its_own_dtype_and_the_cache_keys_on_the_dtype_it_runs(tmp_path, monkeypatch):
    from services.config import parse_config
    from services.engine import args
    from services.profiler.grid import QUICK
    from services.profiler.setup import identity, target_of

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    config = parse_config({"model": {"name": "m", "path": str(tmp_path)},
                           "workers": [{"name": "d0", "port": 50071},
                                       {"name": "p0", "port": 50072, "dtype": "float32"}]})
    assert target_of(config, "p0").model.dtype == "float32"
    assert target_of(config, "d0").model.dtype == "auto"
    monkeypatch.setattr(args, "_has_gpu", lambda: False)
    keys = {}
    for flags in (frozenset({"avx2"}), frozenset({"avx2", "avx512_bf16"})):
        monkeypatch.setattr(args, "_cpu_flags", lambda flags=flags: flags)
        keys[flags] = identity(target_of(config, "d0"), QUICK, 0)["dtype"]
    assert sorted(keys.values()) == ["bfloat16", "float32"]
