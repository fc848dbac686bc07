"""What a wire codec (`transport.codec`, docs/wire-codecs.md) does to the planner's inputs: the PrfaaS
cluster's KV crosses the link in ``wire_ratio`` of its bytes, so the link carries ``1 / wire_ratio``
times the tokens of KV per second. Applied to the inputs (the PrfaaS prefill profile's KV sizes), so
the model, its search and the simulator all see the same effective link."""
from __future__ import annotations

import dataclasses

from services.planner.inputs import PlanInputError, PlanInputs

# Bytes on the link per byte of a 16-bit (bfloat16 / float16) cache: fp8 and int8 keep one byte per
# value, plus a 4-byte scale per row of 128 values (a GPU backend's head size; the CPU block):
# (128 + 4) / 256.
WIRE_RATIOS = {"none": 1.0, "fp8": 132 / 256, "int8": 132 / 256}


def wire_ratio(codec: str) -> float:
    if codec not in WIRE_RATIOS:
        raise PlanInputError(f"codec: {codec!r} is not one of {', '.join(WIRE_RATIOS)}")
    return WIRE_RATIOS[codec]


def with_codec(inputs: PlanInputs, codec: str) -> PlanInputs:
    """``inputs`` with the PrfaaS prefill profile's KV sizes as the link carries them with ``codec``
    (a copy of the profile, so a local profile of the same name keeps its sizes). The whole KV is
    scaled, linear-attention state pages included, though they travel raw: they are a fixed few MiB
    per request, small against the attention KV of the long prompts that cross the link."""
    ratio = wire_ratio(codec)
    if ratio == 1.0:
        return inputs
    name = inputs.prfaas_pd.prfaas_profile
    profile = inputs.prefill_profiles[name]
    if profile.kv_size_mib is None:
        raise PlanInputError(f"prefill profile {name!r} has no KV sizes for the codec to scale")
    coded = dataclasses.replace(profile, name=f"{name}+{codec}",
                                kv_size_mib=tuple(size * ratio for size in profile.kv_size_mib))
    return dataclasses.replace(inputs, prefill_profiles={**inputs.prefill_profiles, coded.name: coded},
                               prfaas_pd=dataclasses.replace(inputs.prfaas_pd, prfaas_profile=coded.name),
                               paper_results=None)  # the published results are for raw KV
