"""The planner's results as a JSON-ready dict and as console text."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.planner.inputs import PlanInputs
from services.planner.model import PrfaasModel, gbps_to_bytes_per_s
from services.planner.profiles import MIB, PrefillCurves
from services.planner.search import HomogeneousPlan, NaivePlan, PrfaasPlan, homogeneous_plan, naive_plan, search_prfaas

PAPER_KEYS = {"prfaas_pd": ("threshold_tokens", "n_p", "n_d", "lambda_max", "theta_prfaas", "theta_pd_p",
                            "theta_pd_d", "offloaded_fraction", "egress_gbps"),
              "homogeneous_pd": ("n_p", "n_d", "lambda_max"),
              "naive_heterogeneous": ("lambda_max",)}


@dataclass(frozen=True)
class PlanResult:
    inputs: PlanInputs
    exact: bool
    prfaas: PrfaasPlan
    homogeneous: HomogeneousPlan | None
    naive: NaivePlan | None


def run_plan(inputs: PlanInputs, exact: bool = False) -> PlanResult:
    return PlanResult(inputs, exact, search_prfaas(PrfaasModel(inputs, exact=exact)),
                      homogeneous_plan(inputs, exact), naive_plan(inputs, exact))


def plan_to_dict(result: PlanResult) -> dict[str, Any]:
    plan, bounds, stats = result.prfaas, result.prfaas.bounds, result.prfaas.stats
    compute_bound = plan.num_prfaas / stats.long_prefill_s
    link_bound = gbps_to_bytes_per_s(result.inputs.prfaas_pd.cross_cluster_gbps) / stats.long_kv_bytes
    out: dict[str, Any] = {
        "mode": "exact" if result.exact else "mean-length",
        "prfaas_pd": {
            "threshold_tokens": round(plan.threshold_tokens, 1),
            "n_prfaas": plan.num_prfaas, "n_p": plan.num_prefill, "n_d": plan.num_decode,
            "lambda_max": bounds.lambda_max, "theta_prfaas": bounds.theta_prfaas,
            "theta_pd_p": bounds.theta_pd_p, "theta_pd_d": bounds.theta_pd_d,
            "prfaas_limit": bounds.prfaas_limit, "local_prefill_limit": bounds.local_prefill_limit,
            "theta_prfaas_compute": compute_bound, "theta_prfaas_link": link_bound,
            "binding": _binding(bounds.prfaas_limit, bounds.local_prefill_limit, bounds.theta_pd_d,
                                link_bound < compute_bound),
            "offloaded_fraction": stats.offloaded_fraction, "egress_gbps": plan.egress_gbps,
            "mean_long_tokens": stats.mean_long_tokens, "mean_short_tokens": stats.mean_short_tokens,
            "long_prefill_s": stats.long_prefill_s, "short_prefill_s": stats.short_prefill_s,
            "long_kv_mib": stats.long_kv_bytes / MIB,
            "cross_cluster_gbps": result.inputs.prfaas_pd.cross_cluster_gbps,
        },
        "homogeneous_pd": None, "naive_heterogeneous": None,
        "phi_kv": phi_kv_table(result.inputs),
    }
    if result.homogeneous is not None:
        h = result.homogeneous
        out["homogeneous_pd"] = {"n_p": h.num_prefill, "n_d": h.num_decode, "lambda_max": h.lambda_max,
                                 "theta_pd_p": h.theta_prefill, "theta_pd_d": h.theta_decode,
                                 "mean_tokens": h.mean_tokens}
        out["throughput_ratio_vs_homogeneous"] = bounds.lambda_max / h.lambda_max
    if result.naive is not None:
        n = result.naive
        out["naive_heterogeneous"] = {"lambda_max": n.lambda_max, "theta_prefill": n.theta_prefill,
                                      "theta_link": n.theta_link, "theta_decode": n.theta_decode,
                                      "mean_tokens": n.mean_tokens}
        out["throughput_ratio_vs_naive"] = bounds.lambda_max / n.lambda_max
    if result.inputs.paper_results:
        out["paper_comparison"] = paper_comparison(out, result.inputs.paper_results)
    return out


def phi_kv_table(inputs: PlanInputs) -> dict[str, list[dict[str, float]]]:
    """Phi_kv(l) = S_kv(l) / T_prefill(l) at each table length, for profiles with KV sizes."""
    table = {}
    for name, profile in inputs.prefill_profiles.items():
        if profile.kv_size_mib is None:
            continue
        curves = PrefillCurves.from_profile(profile)
        table[name] = [{"length_tokens": length, "latency_s": latency, "kv_size_mib": kv,
                        "phi_kv_gbps": curves.phi_kv_gbps(length)}
                       for length, latency, kv in zip(profile.lengths, profile.latency_s, profile.kv_size_mib)]
    return table


def paper_comparison(out: dict[str, Any], paper: dict[str, Any]) -> dict[str, dict[str, float]]:
    rows = {}
    for section, keys in PAPER_KEYS.items():
        ours, theirs = out.get(section) or {}, paper.get(section) or {}
        for key in keys:
            if key in ours and isinstance(theirs.get(key), (int, float)) and theirs[key]:
                rows[f"{section}.{key}"] = {"planner": ours[key], "paper": theirs[key],
                                            "deviation": ours[key] / theirs[key] - 1.0}
    return rows


def format_plan(out: dict[str, Any]) -> str:
    p = out["prfaas_pd"]
    lines = [
        f"PrfaaS throughput plan ({out['mode']} model)",
        "",
        f"PrfaaS-PD: threshold t = {p['threshold_tokens']:,.0f} tokens, N_prfaas = {p['n_prfaas']}, "
        f"N_p = {p['n_p']}, N_d = {p['n_d']}",
        f"  Lambda_max          {p['lambda_max']:8.3f} req/s   (bound by {p['binding']})",
        f"  Theta_prfaas        {p['theta_prfaas']:8.3f} req/s   -> Theta_prfaas/p     = {p['prfaas_limit']:.3f}"
        f"  (compute {p['theta_prfaas_compute']:.3f}, link {p['theta_prfaas_link']:.3f})",
        f"  Theta_pd_p          {p['theta_pd_p']:8.3f} req/s   -> Theta_pd_p/(1-p)   = {p['local_prefill_limit']:.3f}",
        f"  Theta_pd_d          {p['theta_pd_d']:8.3f} req/s",
        f"  offloaded fraction  {p['offloaded_fraction']:8.3f}         p = P(L > t)",
        f"  E[L | L > t]        {p['mean_long_tokens']:8,.0f} tokens  prefill {p['long_prefill_s']:.2f} s, "
        f"KV {p['long_kv_mib']:,.0f} MiB",
        f"  E[L | L <= t]       {p['mean_short_tokens']:8,.0f} tokens  prefill {p['short_prefill_s']:.2f} s",
        f"  egress at Lambda_max {p['egress_gbps']:7.2f} Gbps of {p['cross_cluster_gbps']:g} Gbps",
    ]
    if out["homogeneous_pd"]:
        h = out["homogeneous_pd"]
        lines += ["", f"Homogeneous PD: N_p = {h['n_p']}, N_d = {h['n_d']}, Lambda_max = {h['lambda_max']:.3f} req/s "
                      f"(x{out['throughput_ratio_vs_homogeneous']:.2f} for PrfaaS-PD)"]
    if out["naive_heterogeneous"]:
        n = out["naive_heterogeneous"]
        lines += [f"Naive heterogeneous: Lambda_max = {n['lambda_max']:.3f} req/s "
                  f"(prefill {n['theta_prefill']:.3f}, link {n['theta_link']:.3f}, decode {n['theta_decode']:.3f}; "
                  f"x{out['throughput_ratio_vs_naive']:.2f} for PrfaaS-PD)"]
    lines += ["", "Phi_kv = S_kv / T_prefill (Gbps) at the profiled lengths:"]
    for name, rows in out["phi_kv"].items():
        cells = ", ".join(f"{r['length_tokens']:,.0f}: {r['phi_kv_gbps']:.2f}" for r in rows)
        lines.append(f"  {name:14s} {cells}")
    if out.get("paper_comparison"):
        lines += ["", "vs. the paper's Table 6:"]
        for key, row in out["paper_comparison"].items():
            lines.append(f"  {key:34s} {row['planner']:10.3f}  paper {row['paper']:9.3f}  ({row['deviation']:+.1%})")
    return "\n".join(lines)


def _binding(prfaas_limit: float, local_limit: float, decode_limit: float, link_binds: bool) -> str:
    prfaas = "the cross-cluster link" if link_binds else "PrfaaS prefill"
    limits = {prfaas: prfaas_limit, "local prefill": local_limit, "decode": decode_limit}
    return min(limits, key=limits.__getitem__)
