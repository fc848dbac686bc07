"""The profile file: a planner ``profiles`` fragment (prefill curve, decode batch) plus every measured
point, the engine's settings and KV-cache groups (see services/planner/measured_profile.py)."""
from __future__ import annotations

from typing import Any

import yaml

from services.planner.measured_profile import FORMAT_VERSION, decode_step_curve
from services.profiler.kv import MIB, kv_bytes
from services.profiler.measure import ProfileResults

HEADER = """\
# Written by `prfaas profile`: measured on a real engine. Use it with
#   prfaas plan --profile FILE        prfaas simulate --profile FILE
# profiles: the planner's inputs (prefill latency at no prefix hit, made non-decreasing; KV bytes per prompt
# from the engine's KV-cache groups; the largest decode batch that meets the TPOT target). prefill/decode:
# every measured point. simulation: the simulator's runtime inputs this engine fixes.
"""


def profile_document(results: ProfileResults, model: str, measured: dict[str, Any]) -> dict[str, Any]:
    info = results.info
    curve = [r for r in results.prefill if r["hit_ratio"] == 0.0]
    lengths = [r["input_tokens"] for r in curve]
    full = [g for g in info.groups if g.kind != "linear_attention"]
    return {
        "prfaas_profile": FORMAT_VERSION,
        "model": model,
        "measured": measured,
        "engine": {"chunk_tokens": info.chunk_tokens, "max_num_seqs": info.max_num_seqs,
                   "block_size_tokens": info.block_size, "kv_cache_blocks": info.num_blocks,
                   "kv_cache_tokens": info.kv_capacity_tokens, "max_model_len": info.max_model_len,
                   "dtype": info.dtype, "enable_prefix_caching": info.enable_prefix_caching},
        "kv_cache": {"bytes_per_token": sum(g.bytes_per_token for g in full),
                     "state_bytes_per_request": sum(g.state_bytes_per_request for g in info.groups),
                     "groups": [g.as_dict() for g in info.groups]},
        "simulation": {"chunk_tokens": info.chunk_tokens,
                       "decode_step_s_by_batch": [[b, round(t, 6)] for b, t in decode_step_curve(
                           results.decode, results.grid.reference_context)]},
        "profiles": {
            "prefill": {"lengths": lengths,
                        "latency_s": _rounded(non_decreasing([r["latency_s"] for r in curve])),
                        "kv_size_mib": _rounded([kv_bytes(list(info.groups), n) / MIB for n in lengths])},
            "decode": {"max_batch_size": results.max_batch_size,
                       "step_time_s": round(results.max_batch_step_s, 6)},
        },
        "prefill": {"points": [_point(r, "latency_s") for r in results.prefill]},
        "decode": {"tpot_target_s": results.tpot_target_s, "reference_context_tokens": results.grid.reference_context,
                   "max_batch_size": results.max_batch_size, "step_time_s": round(results.max_batch_step_s, 6),
                   "meets_target": results.meets_target, "limited_by": results.limited_by,
                   "points": [_point(r, "step_time_s") for r in
                              sorted(results.decode, key=lambda r: (r["context_tokens"], r["batch_size"]))]},
    }


def profile_yaml(document: dict[str, Any]) -> str:
    return HEADER + yaml.safe_dump(document, sort_keys=False, default_flow_style=None, width=120)


def non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): measurement
    noise must not make a longer prompt look faster to the planner."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            previous = blocks[-1]
            previous[0] = (previous[0] * previous[1] + mean * count) / (previous[1] + count)
            previous[1] += count
    return [mean for mean, count in blocks for _ in range(int(count))]


def summary_text(document: dict[str, Any], path: str) -> str:
    prefill, decode = document["profiles"]["prefill"], document["decode"]
    kv = document["kv_cache"]
    verdict = "meets" if decode["meets_target"] else "does NOT meet"
    return "\n".join([
        f"profile written to {path} ({document['model']}, vLLM {document['measured']['vllm_version']})",
        "prefill: " + ", ".join(f"{n:,} tokens {t * 1000:,.0f} ms" for n, t in
                                zip(prefill["lengths"], prefill["latency_s"])),
        f"KV: {kv['bytes_per_token']:,.0f} bytes per token"
        + (f" + {kv['state_bytes_per_request']:,} bytes of state per request" if kv["state_bytes_per_request"] else "")
        + f" ({len(kv['groups'])} groups)",
        f"decode: batch {decode['max_batch_size']} at {decode['step_time_s'] * 1000:.1f} ms per step "
        f"{verdict} the TPOT target of {decode['tpot_target_s'] * 1000:.0f} ms at "
        f"{decode['reference_context_tokens']:,} tokens of context (limited by {decode['limited_by']})",
    ])


def _point(result: dict[str, Any], key: str) -> dict[str, Any]:
    point = {k: v for k, v in result.items() if k != "samples_s"}
    if key in point:
        point[key] = round(point[key], 6)
    return point


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 6) for v in values]
