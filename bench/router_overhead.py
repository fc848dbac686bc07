"""Router overhead: the PrfaaS router (+ one decode worker) vs vLLM's own OpenAI server.

Same model (the embedded SmolLM2), same engine settings, same prompts, measured with
`prfaas bench serve`: median TTFT and output tokens/s, sequentially and at concurrency 8. The two
servers run one after the other so they never share the CPU, and their engines compute on the same
cores: a worker's embedded engine binds its OpenMP threads to every CPU it may use (vLLM's ``auto``
reserves none there), where vLLM's own server under ``auto`` keeps one back for its front end and
computes on the rest (on 2 cores, half the compute), so the baseline is given the worker's binding.
Its model also runs where a worker's does, in vLLM's engine-core process rather than a process of its
own (``services.engine.cpus.model_in_engine_core``), so that the figures differ by the router alone.
The servers take turns over ``--rounds`` rounds (vLLM then PrfaaS, then PrfaaS then vLLM, ...), and
each figure pools every round's requests. It also prints the router process's CPU time (user +
system, from /proc, over its measurements, warm-up requests included) per output token it streamed:
what the router itself costs, with no baseline to compare it with but an older commit's run.

    python bench/router_overhead.py [--num-prompts 32] [--input-len 256] [--output-len 64] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import _common
from _common import free_port

from services.engine.args import resolve_dtype

MODEL = "smollm2-135m-instruct"
LABELS = {"vllm": "vLLM's OpenAI server", "prfaas": "the PrfaaS router"}


def wait_http(url: str, process: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} not up after {timeout_s:.0f} s")


def bench(base_url: str, concurrency: int, args, out: Path) -> dict:
    result = out / f"c{concurrency}-{int(time.time() * 1000)}.json"
    subprocess.run([sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", base_url,
                    "--model", MODEL, "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--ignore-eos", "--temperature", "0", "--seed", "0",
                    "--warmup", "2", "--max-concurrency", str(concurrency), "--no-progress",
                    "--result-file", str(result), "--fail-on-error"],
                   check=True, cwd=_common.ROOT, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


def run_prfaas(args, out: Path) -> dict:
    import yaml

    config = {"model": {"name": MODEL, "path": f"builtin:{MODEL}", "max_model_len": 2048},
              "engine": {"enforce_eager": True, "cpu_kvcache_space_gib": 1},
              "router": {"host": "127.0.0.1", "port": free_port()},
              "workers": [{"name": "decode-0", "service": "decode_worker", "role": "both", "port": free_port()}],
              "logging": {"level": "warning", "dir": str(out / "logs")}}
    path = out / "prfaas.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--config", str(path)],
                               cwd=_common.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return measure(process, f"http://127.0.0.1:{config['router']['port']}", args, out, router_of(process))


def router_of(up: subprocess.Popen):
    """A function that gives the CPU seconds so far of `prfaas up`'s router process (found once it runs)."""
    import psutil

    def cpu_s() -> float:
        router = next(p for p in psutil.Process(up.pid).children(recursive=True)
                      if p.cmdline()[3:4] == ["router"])
        times = router.cpu_times()
        return times.user + times.system
    return cpu_s


def engine_binding() -> str:
    """The CPUs a worker's engine computes on here (every CPU this process may use), as vLLM lists them."""
    return ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))


def run_vllm(args, out: Path) -> dict:
    from services.models import smollm2

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(smollm2.prepare()),
         "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
         "--dtype", resolve_dtype("auto", smollm2.prepare()), "--enforce-eager", "--max-num-seqs", "64", "--seed", "0"],
        cwd=_common.ROOT, stdout=open(out / "vllm.log", "wb"), stderr=subprocess.STDOUT,
        env=vllm_env())
    return measure(process, f"http://127.0.0.1:{port}", args, out)


def vllm_env() -> dict[str, str]:
    """vLLM's own server's environment: the worker's CPUs, and its model where a worker runs it."""
    from services.engine.cpus import model_in_engine_core

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": engine_binding()}
    model_in_engine_core(1, env)
    return env


def measure(process: subprocess.Popen, base_url: str, args, out: Path, router_cpu_s=None) -> dict:
    try:
        wait_http(base_url + "/health", process)  # both answer 200 only once they can serve
        before = router_cpu_s() if router_cpu_s else 0.0
        measured = {c: bench(base_url, c, args, out) for c in (1, 8)}
        if router_cpu_s:
            num_tokens = sum(m["total_output_tokens"] for m in measured.values()) + 4 * args.output_len  # + warm-ups
            measured["router_cpu_s"], measured["streamed_tokens"] = router_cpu_s() - before, num_tokens
        return measured
    finally:
        process.terminate()
        process.wait(120)


def pooled(runs: list[dict]) -> dict:
    """One concurrency's measurements of several rounds as one: the median TTFT over every request
    of every round, and output tokens over the rounds' summed durations."""
    ttfts = [t for run in runs for t in run["ttfts"] if t > 0]  # a failed request has 0 (and fails the run)
    return {"median_ttft_ms": statistics.median(ttfts) * 1000, "requests": len(ttfts),
            "output_throughput": sum(r["total_output_tokens"] for r in runs) / sum(r["duration"] for r in runs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32,
                        help="requests per measurement (default 32: at concurrency 8, four waves; 16 swung the "
                        "median TTFT by 2x from run to run)")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens (default 256)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens (default 64)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds, each measuring both servers, in the order vLLM, PrfaaS, then PrfaaS, vLLM, and "
                        "so on, so that a drift of the host falls on both alike; figures pool every round's "
                        "requests (default 2)")
    args = parser.parse_args()
    if args.rounds < 1 or args.num_prompts < 1:
        parser.error("--rounds and --num-prompts must be positive")
    runs: dict[str, dict[int, list[dict]]] = {"vllm": {1: [], 8: []}, "prfaas": {1: [], 8: []}}
    router_cpu_s = streamed_tokens = 0.0
    with tempfile.TemporaryDirectory(prefix="prfaas-bench-") as tmp:
        out = Path(tmp)
        for number in range(args.rounds):
            for server in ("vllm", "prfaas") if number % 2 == 0 else ("prfaas", "vllm"):
                print(f"round {number + 1} of {args.rounds}: measuring {LABELS[server]} ...", file=sys.stderr)
                measured = (run_vllm if server == "vllm" else run_prfaas)(args, out)
                router_cpu_s += measured.get("router_cpu_s", 0.0)
                streamed_tokens += measured.get("streamed_tokens", 0)
                for c in (1, 8):
                    runs[server][c].append(measured[c])
                    print(f"  concurrency {c}: median TTFT {measured[c]['median_ttft_ms']:.1f} ms, output "
                          f"{measured[c]['output_throughput']:.1f} tok/s", file=sys.stderr)
    ok = True
    worst_ttft, worst_tput = 0.0, float("inf")
    for c in (1, 8):
        routed, direct = pooled(runs["prfaas"][c]), pooled(runs["vllm"][c])
        ttft = routed["median_ttft_ms"] / direct["median_ttft_ms"]
        tput = routed["output_throughput"] / direct["output_throughput"]
        worst_ttft, worst_tput = max(worst_ttft, ttft), min(worst_tput, tput)
        ok &= ttft <= 1.10 and tput >= 0.90
        print(f"concurrency {c}: median TTFT {routed['median_ttft_ms']:.1f} vs {direct['median_ttft_ms']:.1f} ms "
              f"({ttft:.3f}x), output {routed['output_throughput']:.1f} vs {direct['output_throughput']:.1f} tok/s "
              f"({tput:.3f}x); {routed['requests']} and {direct['requests']} requests over {args.rounds} rounds")
    print(f"router CPU per streamed token: {router_cpu_s / streamed_tokens * 1e6:.0f} us ({router_cpu_s:.2f} CPU s "
          f"over {streamed_tokens:.0f} output tokens, user + system, all rounds)")
    print(f"router vs vLLM server, worst median-TTFT ratio: {worst_ttft:.3f} (worst output throughput ratio "
          f"{worst_tput:.3f}, concurrency 1 and 8, {args.rounds} rounds); baseline vLLM's own OpenAI server; "
          f"target <= 1.10 and throughput >= 0.90: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
