"""The planner's input file (see deploy/planner/case_study.yaml), loaded into frozen dataclasses.

Every problem raises :class:`PlanInputError` with one line that starts with the dotted key, e.g.
``profiles.h20_prefill.latency_s: must be non-decreasing``. Unknown keys are errors: a typo must
not silently fall back to a default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DISTRIBUTIONS = ("truncated_lognormal",)
INTERPOLATIONS = ("piecewise_linear",)
TOP_LEVEL_KEYS = ("model", "gpus_per_instance", "workload", "profiles", "interpolation", "deployments",
                  "paper_results", "simulation")


Node = dict[str, object]  # a YAML mapping


class PlanInputError(ValueError):
    """A planner input that cannot be used; the message is one line naming the key."""


@dataclass(frozen=True, slots=True)
class LengthDistributionSpec:
    distribution: str
    mu: float
    sigma: float
    min_tokens: float
    max_tokens: float


@dataclass(frozen=True, slots=True)
class PrefixHitSpec:
    """With ``probability`` a request finds a cached prefix covering a uniform fraction of its prompt."""

    probability: float
    min_fraction: float
    max_fraction: float


@dataclass(frozen=True, slots=True)
class Workload:
    input_length: LengthDistributionSpec
    output_tokens: int
    slo_tokens_per_second: float | None = None
    prefix_hit: PrefixHitSpec | None = None


@dataclass(frozen=True, slots=True)
class PrefillProfile:
    name: str
    lengths: tuple[float, ...]
    latency_s: tuple[float, ...]
    kv_size_mib: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class DecodeProfile:
    name: str
    max_batch_size: int
    step_time_s: float


@dataclass(frozen=True, slots=True)
class PrfaasDeployment:
    prfaas_profile: str
    num_prfaas: int
    prefill_profile: str
    decode_profile: str
    num_local: int
    cross_cluster_gbps: float


@dataclass(frozen=True, slots=True)
class HomogeneousDeployment:
    prefill_profile: str
    decode_profile: str
    num_instances: int


@dataclass(frozen=True, slots=True)
class NaiveDeployment:
    prefill_profile: str
    num_prefill: int
    decode_profile: str
    num_decode: int
    cross_cluster_gbps: float


@dataclass(frozen=True, slots=True)
class PlanInputs:
    workload: Workload
    prefill_profiles: dict[str, PrefillProfile]
    decode_profiles: dict[str, DecodeProfile]
    interpolation: str
    prfaas_pd: PrfaasDeployment
    homogeneous_pd: HomogeneousDeployment | None = None
    naive_heterogeneous: NaiveDeployment | None = None
    paper_results: dict[str, Any] | None = None
    simulation: dict[str, Any] | None = None  # the simulator's runtime inputs, checked by services.simulator.runtime


def load_plan_inputs(path: str | Path) -> PlanInputs:
    return parse_plan_inputs(read_yaml(path))


def read_yaml(path: str | Path) -> Any:
    """A YAML file's content; errors name the file."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise PlanInputError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise PlanInputError(f"{path}: invalid YAML: {' '.join(str(exc).split())}") from None


def parse_plan_inputs(raw: Any) -> PlanInputs:
    root = _mapping(raw, "", TOP_LEVEL_KEYS)
    interpolation = _choice(root, "interpolation", "", INTERPOLATIONS, default="piecewise_linear")
    prefill_profiles, decode_profiles = _profiles(_required(root, "profiles", ""))
    deployments = _mapping(_required(root, "deployments", ""), "deployments",
                           ("prfaas_pd", "homogeneous_pd", "naive_heterogeneous"))
    refs = _ProfileRefs(prefill_profiles, decode_profiles)
    paper = root.get("paper_results")
    return PlanInputs(
        workload=_workload(_required(root, "workload", "")),
        prefill_profiles=prefill_profiles,
        decode_profiles=decode_profiles,
        interpolation=interpolation,
        prfaas_pd=_prfaas(_required(deployments, "prfaas_pd", "deployments"), refs),
        homogeneous_pd=_homogeneous(deployments.get("homogeneous_pd"), refs),
        naive_heterogeneous=_naive(deployments.get("naive_heterogeneous"), refs),
        paper_results=_mapping(paper, "paper_results") if paper is not None else None,
        simulation=_mapping(root["simulation"], "simulation") if root.get("simulation") is not None else None,
    )


def _workload(raw: Any) -> Workload:
    node = _mapping(raw, "workload", ("input_length", "output_tokens", "slo_tokens_per_second", "prefix_hit"))
    slo = node.get("slo_tokens_per_second")
    return Workload(
        input_length=_length_distribution(_required(node, "input_length", "workload")),
        output_tokens=_count(node, "output_tokens", "workload"),
        slo_tokens_per_second=(_number(node, "slo_tokens_per_second", "workload", positive=True)
                               if slo is not None else None),
        prefix_hit=_prefix_hit(node["prefix_hit"]) if node.get("prefix_hit") is not None else None,
    )


def _length_distribution(raw: Any) -> LengthDistributionSpec:
    path = "workload.input_length"
    node = _mapping(raw, path, ("distribution", "mu", "sigma", "min_tokens", "max_tokens"))
    spec = LengthDistributionSpec(
        distribution=_choice(node, "distribution", path, DISTRIBUTIONS),
        mu=_number(node, "mu", path),
        sigma=_number(node, "sigma", path, positive=True),
        min_tokens=_number(node, "min_tokens", path, positive=True),
        max_tokens=_number(node, "max_tokens", path, positive=True),
    )
    if spec.max_tokens <= spec.min_tokens:
        raise PlanInputError(f"{path}.max_tokens: must be greater than min_tokens ({spec.min_tokens:g}), "
                             f"got {spec.max_tokens:g}")
    return spec


def _prefix_hit(raw: Any) -> PrefixHitSpec:
    path = "workload.prefix_hit"
    node = _mapping(raw, path, ("probability", "min_fraction", "max_fraction"))
    values = {key: _number(node, key, path) for key in ("probability", "min_fraction", "max_fraction")}
    for key, value in values.items():
        if not 0.0 <= value <= 1.0:
            raise PlanInputError(f"{path}.{key}: must be within [0, 1], got {value:g}")
    if values["max_fraction"] < values["min_fraction"]:
        raise PlanInputError(f"{path}.max_fraction: must not be below min_fraction")
    return PrefixHitSpec(**values)


def parse_profiles(raw: Any) -> tuple[dict[str, PrefillProfile], dict[str, DecodeProfile]]:
    """A ``profiles`` mapping (as in the input file, or a measured profile's) into prefill and decode profiles."""
    return _profiles(raw)


def _profiles(raw: Any) -> tuple[dict[str, PrefillProfile], dict[str, DecodeProfile]]:
    node = _mapping(raw, "profiles")
    if not node:
        raise PlanInputError("profiles: must name at least one profile")
    prefill, decode = {}, {}
    for name, body in node.items():
        path = f"profiles.{name}"
        body = _mapping(body, path)
        if "max_batch_size" in body or "step_time_s" in body:
            body = _mapping(body, path, ("max_batch_size", "step_time_s"))
            decode[name] = DecodeProfile(name, _count(body, "max_batch_size", path),
                                         _number(body, "step_time_s", path, positive=True))
        else:
            prefill[name] = _prefill_profile(name, _mapping(body, path, ("lengths", "latency_s", "kv_size_mib")))
    return prefill, decode


def _prefill_profile(name: str, node: Node) -> PrefillProfile:
    path = f"profiles.{name}"
    lengths = _table(node, "lengths", path, positive=True)
    if len(lengths) < 2:
        raise PlanInputError(f"{path}.lengths: needs at least 2 points, got {len(lengths)}")
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise PlanInputError(f"{path}.lengths: must be strictly increasing")
    latency_s = _column(node, "latency_s", path, len(lengths), positive=True)
    kv_size_mib = _column(node, "kv_size_mib", path, len(lengths), positive=False) if "kv_size_mib" in node else None
    return PrefillProfile(name, lengths, latency_s, kv_size_mib)


def _column(node: Node, key: str, path: str, num_lengths: int, positive: bool) -> tuple[float, ...]:
    """A profile's non-decreasing column, one entry per length."""
    column = _table(node, key, path, positive)
    if len(column) != num_lengths:
        raise PlanInputError(f"{path}.{key}: must have {num_lengths} entries like lengths, got {len(column)}")
    if any(b < a for a, b in zip(column, column[1:])):
        raise PlanInputError(f"{path}.{key}: must be non-decreasing")
    return column


@dataclass(frozen=True, slots=True)
class _ProfileRefs:
    prefill: dict[str, PrefillProfile]
    decode: dict[str, DecodeProfile]

    def get(self, node: Node, key: str, path: str, kind: str, needs_kv: bool = False) -> str:
        known: dict[str, PrefillProfile] | dict[str, DecodeProfile] = self.prefill if kind == "prefill" else self.decode
        name = _required(node, key, path)
        if not isinstance(name, str) or name not in known:
            raise PlanInputError(f"{path}.{key}: unknown {kind} profile {name!r} "
                                 f"(known: {', '.join(sorted(known)) or 'none'})")
        if needs_kv and self.prefill[name].kv_size_mib is None:
            raise PlanInputError(f"{path}.{key}: profile {name!r} has no kv_size_mib, needed for cross-cluster KV")
        return name


def _prfaas(raw: Any, refs: _ProfileRefs) -> PrfaasDeployment:
    path = "deployments.prfaas_pd"
    node = _mapping(raw, path, ("prfaas_instances", "local_pd_instances", "cross_cluster_gbps"))
    remote = _mapping(_required(node, "prfaas_instances", path), f"{path}.prfaas_instances", ("profile", "count"))
    local_path = f"{path}.local_pd_instances"
    local = _mapping(_required(node, "local_pd_instances", path), local_path,
                     ("prefill_profile", "decode_profile", "count"))
    return PrfaasDeployment(
        prfaas_profile=refs.get(remote, "profile", f"{path}.prfaas_instances", "prefill", needs_kv=True),
        num_prfaas=_count(remote, "count", f"{path}.prfaas_instances"),
        prefill_profile=refs.get(local, "prefill_profile", local_path, "prefill"),
        decode_profile=refs.get(local, "decode_profile", local_path, "decode"),
        num_local=_count(local, "count", local_path, minimum=2),
        cross_cluster_gbps=_number(node, "cross_cluster_gbps", path, positive=True),
    )


def _homogeneous(raw: Any, refs: _ProfileRefs) -> HomogeneousDeployment | None:
    if raw is None:
        return None
    path = "deployments.homogeneous_pd"
    node = _mapping(raw, path, ("local_pd_instances",))
    local_path = f"{path}.local_pd_instances"
    local = _mapping(_required(node, "local_pd_instances", path), local_path,
                     ("prefill_profile", "decode_profile", "count"))
    return HomogeneousDeployment(refs.get(local, "prefill_profile", local_path, "prefill"),
                                 refs.get(local, "decode_profile", local_path, "decode"),
                                 _count(local, "count", local_path, minimum=2))


def _naive(raw: Any, refs: _ProfileRefs) -> NaiveDeployment | None:
    if raw is None:
        return None
    path = "deployments.naive_heterogeneous"
    node = _mapping(raw, path, ("prefill_instances", "decode_instances", "cross_cluster_gbps"))
    pre = _mapping(_required(node, "prefill_instances", path), f"{path}.prefill_instances", ("profile", "count"))
    dec = _mapping(_required(node, "decode_instances", path), f"{path}.decode_instances", ("profile", "count"))
    return NaiveDeployment(
        prefill_profile=refs.get(pre, "profile", f"{path}.prefill_instances", "prefill", needs_kv=True),
        num_prefill=_count(pre, "count", f"{path}.prefill_instances"),
        decode_profile=refs.get(dec, "profile", f"{path}.decode_instances", "decode"),
        num_decode=_count(dec, "count", f"{path}.decode_instances"),
        cross_cluster_gbps=_number(node, "cross_cluster_gbps", path, positive=True),
    )


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _mapping(raw: Any, path: str, allowed: tuple[str, ...] | None = None) -> Node:
    if not isinstance(raw, dict):
        raise PlanInputError(f"{path or 'config'}: expected a mapping, got {_kind(raw)}")
    if allowed is not None:
        unknown = sorted(str(key) for key in raw if key not in allowed)
        if unknown:
            raise PlanInputError(f"{_join(path, unknown[0])}: unknown key (allowed: {', '.join(allowed)})")
    return raw


def _required(node: Node, key: str, path: str) -> object:
    if node.get(key) is None:
        raise PlanInputError(f"{_join(path, key)}: required key is missing")
    return node[key]


def _number(node: Node, key: str, path: str, positive: bool = False) -> float:
    value = _required(node, key, path)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlanInputError(f"{_join(path, key)}: expected a number, got {value!r}")
    if positive and value <= 0:
        raise PlanInputError(f"{_join(path, key)}: must be positive, got {value:g}")
    return float(value)


def _count(node: Node, key: str, path: str, minimum: int = 1) -> int:
    value = _required(node, key, path)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanInputError(f"{_join(path, key)}: expected an integer, got {value!r}")
    if value < minimum:
        what = "positive" if minimum == 1 else f"at least {minimum}"
        raise PlanInputError(f"{_join(path, key)}: must be {what}, got {value}")
    return value


def _table(node: Node, key: str, path: str, positive: bool) -> tuple[float, ...]:
    values = _required(node, key, path)
    if not isinstance(values, list) or not values:
        raise PlanInputError(f"{_join(path, key)}: expected a non-empty list of numbers, got {values!r}")
    column = tuple(_number({key: v}, key, path) for v in values)
    if any(v < 0 or (positive and v == 0) for v in column):
        raise PlanInputError(f"{_join(path, key)}: entries must be {'positive' if positive else 'non-negative'}")
    return column


def _choice(node: Node, key: str, path: str, allowed: tuple[str, ...], default: str | None = None) -> str:
    value = node.get(key, default)
    if value is None:
        raise PlanInputError(f"{_join(path, key)}: required key is missing")
    if not isinstance(value, str) or value not in allowed:
        raise PlanInputError(f"{_join(path, key)}: {value!r} is not supported (allowed: {', '.join(allowed)})")
    return value


def _kind(raw: Any) -> str:
    return "nothing" if raw is None else type(raw).__name__
