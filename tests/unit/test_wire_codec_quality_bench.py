"""bench/wire_codec_quality.py's figures from replies (no engines): the KL on the top 20 with a tail
bucket, the first divergence, and the comparison at the same positions for every variant, with the
raw control. The deployments it drives are the e2e tests' (tests/e2e/test_wire_codec.py)."""
import math

import pytest

from support.bench import bench_module

quality = bench_module("wire_codec_quality")


def reply(tokens, tops=None):
    tops = tops or [{t: math.log(0.9), t + 1: math.log(0.05)} for t in tokens]
    return quality.Reply(tuple(tokens), tuple(tops))


def test_kl_is_zero_for_the_same_distribution_and_grows_with_the_difference():
    same = {1: math.log(0.7), 2: math.log(0.2)}
    assert quality.kl_on_top(same, same) == pytest.approx(0.0, abs=1e-12)
    near = {1: math.log(0.6), 2: math.log(0.3)}
    far = {1: math.log(0.2), 2: math.log(0.7)}
    assert 0 < quality.kl_on_top(same, near) < quality.kl_on_top(same, far)
    # a token of the reference's top the other does not list gets the other's smallest probability;
    # the tails (0.1 and what is left of the other's 0.1 + 0.7) are one bucket each
    assert quality.kl_on_top(same, {2: math.log(0.7), 3: math.log(0.1)}) == pytest.approx(
        0.7 * math.log(0.7 / 0.1) + 0.2 * math.log(0.2 / 0.7) + 0.1 * math.log(0.1 / 0.2))


def test_every_variant_is_judged_at_the_same_positions():
    n = quality.OUTPUT_TOKENS
    base = [5] * n
    late = [5] * 20 + [6] * (n - 20)
    early = [5] * 3 + [6] * (n - 3)
    runs = {"fp8": {"none": [reply(base), reply(base)], "fp8": [reply(early), reply(base)],
                    "anchor": [reply(late), reply(base)]},
            "int8": {"none": [reply(base), reply(base)], "int8": [reply(base), reply(base)]}}
    figures = quality.compare(runs)
    assert set(figures) == {"fp8", "anchor", "int8", "none (int8 run) vs none"}
    # prompt 0 up to the earliest divergence (position 3, included), prompt 1 all 32 positions
    assert {f.positions for f in figures.values()} == {4 + n}
    assert figures["fp8"].first_divergence == (3 + n) / 2 and figures["anchor"].first_divergence == (20 + n) / 2
    assert figures["int8"].identical == 1.0 and figures["fp8"].identical == 0.5
    assert figures["none (int8 run) vs none"].kl_mean == 0.0
    assert figures["fp8"].kl_mean > 0  # the divergent token's distribution differs
