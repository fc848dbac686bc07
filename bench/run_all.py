"""Run the benchmarks that finish within minutes, one after another, and table their headlines.

Each benchmark runs as ``python bench/<name>.py`` with no arguments; its last line (figure, target,
baseline, PASS or FAIL) and exit status make one row, a benchmark that fails or times out included.
Writes ``bench/results/<run>.json`` and ``bench/results/<run>.md`` (``<run>`` is the local start time,
``YYYYmmdd-HHMMSS``), each benchmark's whole output in ``bench/results/<run>-logs/``, and beside every
figure the same benchmark's in the latest earlier run in bench/results that ran it (an ``--only`` run
leaves the others' figures standing). Exit status 0 only when every row passed.
The long benchmarks (``LONG``) run only when named with ``--only``.

    python bench/run_all.py                              # what `make bench` runs
    python bench/run_all.py --only cache_lookup,simulator_speed
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _common  # noqa: F401  (SIGTERM unwinds like Ctrl-C: the running benchmark is stopped too)
from _headlines import Result, as_json, last_line, parse, previous_figures, table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# Each a few minutes at most on a 2-core host (router_overhead about 9), in this order (the quick ones first).
QUICK = ("simulator_speed", "cache_lookup", "cache_bandwidth", "transport_loopback", "transport_scaling",
         "hetero_layouts",
         "transport_wan", "wire_codec_wan", "layerwise_overlap", "router_overhead", "cache_load_ttft")
# Run by name only: cancellation (~7 min), chaos (~10), sim_vs_real (17-30), wire_codec_quality (~20),
# gpu_kv_path (a CUDA host), router_replicas and router_replicas_wan (~4-5 each), api_parity (minutes).
LONG = ("cancellation", "chaos", "sim_vs_real", "wire_codec_quality", "gpu_kv_path", "router_replicas",
        "router_replicas_wan", "api_parity")


def run_one(name: str, logs: Path, timeout_s: float) -> Result:
    """One benchmark in its own process group; a timeout sends SIGTERM (its services stop), then SIGKILL."""
    log = logs / f"{name}.log"
    started = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, str(ROOT / "bench" / f"{name}.py")], cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=out, text=True, start_new_session=True)
        try:
            stdout, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stdout = stop(process) + f"\n{name}: timed out after {timeout_s:.0f} s: FAIL\n"
        except BaseException:
            stop(process)
            raise
        out.write(f"\n--- stdout ---\n{stdout}")
    code = process.returncode if process.returncode is not None else -1
    return parse(name, code, time.monotonic() - started, last_line(stdout))


def stop(process: subprocess.Popen) -> str:
    """SIGTERM to the benchmark's group (it stops its services), SIGKILL a minute later; what it printed."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        return process.communicate(timeout=60)[0] or ""
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.communicate()[0] or ""


def commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return (found.stdout.strip() or "unknown") + ("+changes" if dirty else "")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="",
                        help="comma-separated benchmark names to run instead of the quick ones: any of "
                        f"{', '.join(QUICK + LONG)}")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one benchmark may run before it is stopped and counted FAIL (default: 900)")
    args = parser.parse_args(argv)
    args.names = [n.strip() for n in args.only.split(",") if n.strip()] or list(QUICK)
    unknown = [n for n in args.names if n not in QUICK + LONG]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)} (known: {', '.join(QUICK + LONG)})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    run = time.strftime("%Y%m%d-%H%M%S")
    logs = RESULTS / f"{run}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    for index, name in enumerate(args.names, 1):
        print(f"[{index}/{len(args.names)}] {name} ...", flush=True)
        result = run_one(name, logs, args.timeout)
        results.append(result)
        print(f"[{index}/{len(args.names)}] {name}: {'PASS' if result.passed else 'FAIL'} in {result.seconds:.0f} s: "
              f"{result.last_line or '(no output; see ' + str(logs / (name + '.log')) + ')'}", flush=True)
    earlier = previous_figures(RESULTS, run)
    revision = commit()
    (RESULTS / f"{run}.json").write_text(as_json(run, revision, results, earlier))
    markdown = table(run, revision, results, earlier)
    (RESULTS / f"{run}.md").write_text(markdown)
    print(f"\n{markdown}\nwritten: {RESULTS / (run + '.json')}, {RESULTS / (run + '.md')}, logs in {logs}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
