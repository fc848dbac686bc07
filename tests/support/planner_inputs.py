"""Small synthetic planner inputs whose model values can be worked out by hand.

Both prefill profiles are linear through the origin: T_fast(l) = l / 2000 s, T_slow(l) = l / 1000 s,
S_kv(l) = 0.1 * l MiB; a decode instance finishes 10 / (0.01 s * 100 tokens) = 10 req/s.
"""
import copy
import math
from pathlib import Path

import yaml

CASE_STUDY = Path(__file__).resolve().parents[1] / "data" / "case_study.yaml"  # the paper's case study

SYNTHETIC = {
    "workload": {
        "input_length": {"distribution": "truncated_lognormal", "mu": math.log(1000.0), "sigma": 0.5,
                         "min_tokens": 100, "max_tokens": 5000},
        "output_tokens": 100,
    },
    "profiles": {
        "fast": {"lengths": [1000, 2000], "latency_s": [0.5, 1.0], "kv_size_mib": [100.0, 200.0]},
        "slow": {"lengths": [1000, 2000], "latency_s": [1.0, 2.0]},
        "dec": {"max_batch_size": 10, "step_time_s": 0.01},
    },
    "interpolation": "piecewise_linear",
    "deployments": {
        "prfaas_pd": {"prfaas_instances": {"profile": "fast", "count": 2},
                      "local_pd_instances": {"prefill_profile": "slow", "decode_profile": "dec", "count": 6},
                      "cross_cluster_gbps": 100},
        "homogeneous_pd": {"local_pd_instances": {"prefill_profile": "slow", "decode_profile": "dec", "count": 8}},
        "naive_heterogeneous": {"prefill_instances": {"profile": "fast", "count": 2},
                                "decode_instances": {"profile": "dec", "count": 6},
                                "cross_cluster_gbps": 100},
    },
}


def synthetic_raw(**changes) -> dict:
    """A deep copy of SYNTHETIC with ``changes`` applied; keys are dotted paths, None deletes."""
    raw = copy.deepcopy(SYNTHETIC)
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    return raw


def write_yaml(path, raw) -> str:
    path.write_text(yaml.safe_dump(raw) if not isinstance(raw, str) else raw)
    return str(path)
