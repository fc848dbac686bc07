"""A profile measured by ``prfaas profile``, in place of the typed profiles of the planner's inputs.

The profile file's ``profiles`` section is a planner ``profiles`` fragment: one prefill profile
(latency and KV size by prompt length, no prefix hit) and one decode profile (the largest batch
that meets the TPOT target, and its step time). Its other sections (the engine's settings, the KV
cache groups, every measured grid point) are kept for reports and the simulator.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


from services.planner.inputs import DecodeProfile, PlanInputError, PlanInputs, PrefillProfile, parse_profiles, read_yaml

FORMAT_VERSION = 1
TOP_LEVEL_KEYS = ("prfaas_profile", "model", "measured", "engine", "kv_cache", "simulation", "profiles", "prefill",
                  "decode")


@dataclass(frozen=True, slots=True)
class MeasuredProfile:
    source: str
    model: str
    prefill: PrefillProfile
    decode: DecodeProfile
    engine: dict[str, Any] = field(default_factory=dict)
    kv_cache: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)
    simulation: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "model": self.model,
                "prefill": {"lengths": list(self.prefill.lengths), "latency_s": list(self.prefill.latency_s),
                            "kv_size_mib": list(self.prefill.kv_size_mib or ())},
                "decode": {"max_batch_size": self.decode.max_batch_size, "step_time_s": self.decode.step_time_s},
                "chunk_tokens": self.engine.get("chunk_tokens"),
                "kv_bytes_per_token": self.kv_cache.get("bytes_per_token")}


def load_profile(path: str | Path) -> MeasuredProfile:
    path = Path(path)
    raw = read_yaml(path)
    try:
        return parse_profile(raw, str(path))
    except PlanInputError as exc:
        raise PlanInputError(f"{path}: {exc}") from None


def parse_profile(raw: Any, source: str) -> MeasuredProfile:
    if not isinstance(raw, dict) or raw.get("prfaas_profile") is None:
        raise PlanInputError("prfaas_profile: required key is missing (not a file written by `prfaas profile`)")
    unknown = sorted(str(key) for key in raw if key not in TOP_LEVEL_KEYS)
    if unknown:
        raise PlanInputError(f"{unknown[0]}: unknown key (allowed: {', '.join(TOP_LEVEL_KEYS)})")
    if raw["prfaas_profile"] != FORMAT_VERSION:
        raise PlanInputError(f"prfaas_profile: format {raw['prfaas_profile']!r} is not supported "
                             f"(this version reads {FORMAT_VERSION})")
    prefill, decode = parse_profiles(raw.get("profiles"))
    if len(prefill) != 1 or len(decode) != 1:
        raise PlanInputError(f"profiles: expected one prefill and one decode profile, got {len(prefill)} and "
                             f"{len(decode)}")
    (prefill_profile,), (decode_profile,) = prefill.values(), decode.values()
    if prefill_profile.kv_size_mib is None:
        raise PlanInputError(f"profiles.{prefill_profile.name}.kv_size_mib: required key is missing")
    return MeasuredProfile(source, str(raw.get("model", "")), prefill_profile, decode_profile,
                           _section(raw, "engine"), _section(raw, "kv_cache"), _section(raw, "measured"),
                           _section(raw, "simulation"))


def split_profile_arg(arg: str) -> tuple[str | None, str]:
    """``FILE`` or ``NAME=FILE`` (``NAME`` a profile of the planner's inputs)."""
    name, sep, path = arg.partition("=")
    if not sep or Path(arg).exists() or "/" in name:
        return None, arg
    return name, path


def apply_profiles(inputs: PlanInputs, targets: Sequence[tuple[str | None, MeasuredProfile]]
                   ) -> tuple[PlanInputs, list[dict[str, Any]]]:
    """Replace profiles with measured ones: a named profile by the measured profile of its kind,
    without a name every prefill and every decode profile. A profile that replaces a prefill profile
    also sets the simulator's inputs it measured (its ``simulation`` section: the engine's chunk size).
    Returns the inputs and what was replaced."""
    prefill, decode = dict(inputs.prefill_profiles), dict(inputs.decode_profiles)
    simulation = dict(inputs.simulation or {})
    report = []
    for name, measured in targets:
        names = [name] if name is not None else [*prefill, *decode]
        for target in names:
            if target in prefill:
                prefill[target] = replace(measured.prefill, name=target)
            elif target in decode:
                decode[target] = replace(measured.decode, name=target)
            else:
                known = ", ".join(sorted([*prefill, *decode]))
                raise PlanInputError(f"--profile {target}=...: the inputs have no profile {target!r} (known: {known})")
        if any(target in prefill for target in names):
            simulation.update(measured.simulation)
        report.append({**measured.as_dict(), "replaced": names})
    inputs = replace(inputs, prefill_profiles=prefill, decode_profiles=decode, simulation=simulation or None)
    return inputs, report


def profiles_text(report: Sequence[dict[str, Any]]) -> list[str]:
    """Console lines: which profiles were replaced by which measurement."""
    lines = []
    for entry in report:
        decode = entry["decode"]
        lines.append(f"profiles {', '.join(entry['replaced'])}: measured by prfaas profile ({entry['source']}, "
                     f"{entry['model']}): prefill {entry['prefill']['latency_s'][0]:.3f} .. "
                     f"{entry['prefill']['latency_s'][-1]:.3f} s for {entry['prefill']['lengths'][0]:,.0f} .. "
                     f"{entry['prefill']['lengths'][-1]:,.0f} tokens; decode batch {decode['max_batch_size']} "
                     f"at {decode['step_time_s'] * 1000:.1f} ms per step")
    return lines


def _section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise PlanInputError(f"{key}: expected a mapping, got {type(value).__name__}")
    return value


def decode_step_curve(decode_points: Sequence[dict[str, Any]], context_tokens: float
                      ) -> tuple[tuple[float, float], ...]:
    """The decode step time by batch size at ``context_tokens`` of context, from a profile's measured
    decode points (``decode.points``: batch_size, context_tokens, step_time_s): for each batch measured
    at both, linear in the context between the two measured contexts around it (the nearest one
    outside them). The simulator's ``decode_step_s_by_batch``; empty if fewer than two batches."""
    by_context: dict[float, dict[float, float]] = {}
    for point in decode_points:
        if "step_time_s" in point:
            by_context.setdefault(float(point["context_tokens"]), {})[float(point["batch_size"])] = \
                float(point["step_time_s"])
    if not by_context:
        return ()
    contexts = sorted(by_context)
    below = [c for c in contexts if c <= context_tokens]
    above = [c for c in contexts if c >= context_tokens]
    lo, hi = (below[-1] if below else contexts[0]), (above[0] if above else contexts[-1])
    batches = sorted(set(by_context[lo]) & set(by_context[hi]))
    share = 0.0 if hi == lo else (context_tokens - lo) / (hi - lo)
    curve = tuple((batch, by_context[lo][batch] + share * (by_context[hi][batch] - by_context[lo][batch]))
                  for batch in batches)
    return curve if len(curve) >= 2 else ()
