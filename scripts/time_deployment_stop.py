"""Time how long a test deployment takes to start and to stop: a PrfaaS prefill worker, a decode
worker (the tiny hybrid model, one CPU each) and the router are started as the e2e tests start them
(until the router sees both workers serving), then stopped (SIGTERM to every service's process
group, each waited for until no live process is left in it). Every e2e module pays both once per
deployment.

    .venv/bin/python scripts/time_deployment_stop.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support.deployment import Deployment, deployment_config  # noqa: E402
from support.ports import free_port  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="deployments started and stopped (default 3)")
    args = parser.parse_args()
    engine = {"max_num_batched_tokens": 256, "enable_prefix_caching": False, "max_num_seqs": 4}
    workers = [{"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas", "engine": engine,
                "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
               {"name": "pd-d", "service": "decode_worker", "role": "decode", "kv_port": free_port(),
                "engine": engine, "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}]
    config = deployment_config(workers, model_path="builtin:tiny-qwen3-next", model_name="tiny-qwen3-next",
                               scheduler={"offload_threshold_tokens": 200}, transport={"secret": "stop-time"})
    starts, stops = [], []
    for round_id in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="prfaas-stop-") as directory:
            print(f"round {round_id + 1}/{args.rounds}: starting ...", file=sys.stderr, flush=True)
            start = time.monotonic()
            deployment = Deployment(config, Path(directory)).start()
            starts.append(time.monotonic() - start)
            start = time.monotonic()
            deployment.stop()
            stops.append(time.monotonic() - start)
            print(f"round {round_id + 1}/{args.rounds}: started in {starts[-1]:.2f} s, stopped in {stops[-1]:.2f} s",
                  file=sys.stderr, flush=True)
    print(f"deployment start, seconds: {' '.join(f'{s:.2f}' for s in starts)}")
    print(f"deployment stop, seconds: {' '.join(f'{s:.2f}' for s in stops)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
