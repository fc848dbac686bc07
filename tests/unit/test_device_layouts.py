"""vLLM 0.32's KV cache views, built as CPU tensors with the shapes and strides a CUDA engine
registers (``as_strided`` over one flat buffer, as ``create_kv_cache_views`` does): the physical
layout each one is named, and the fingerprint that keeps two differently laid-out engines from
copying pages as they are."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.kv_connector.layouts.pages import KVLayout
from services.kv_connector.layouts.physical import MLA, STATE, detect
from services.kv_connector.layouts.reblock import ReblockPlans, announcement

BLOCKS, HEADS, TOKENS, HEAD = 6, 4, 16, 8
CONTENT = 2 * HEAD  # K and V of one (block, head, token) side by side


def view(order: str, blocks: int = BLOCKS, heads: int = HEADS, layers: int = 2, layer: int = 0,
         dtype=torch.bfloat16) -> torch.Tensor:
    """Layer ``layer``'s logical [B, H, N, C] view of a buffer laid out in ``order`` (a permutation of
    LBHNC), as vLLM strides it."""
    sizes = {"L": layers, "B": blocks, "H": heads, "N": TOKENS, "C": CONTENT}
    strides, step = {}, 1
    for dim in reversed(order):
        strides[dim], step = step, step * sizes[dim]
    flat = torch.arange(step, dtype=torch.float32).to(dtype)
    return torch.as_strided(flat, (blocks, heads, TOKENS, CONTENT),
                            tuple(strides[d] for d in "BHNC"), layer * strides["L"])


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
def test_each_layout_is_named_from_its_strides(order):
    assert detect(view(order), BLOCKS).name == order


@pytest.mark.parametrize("declared", ["LBNHC", "NHD"])
def test_a_declared_layout_the_strides_contradict_is_refused_with_the_reason(declared):
    assert detect(view("LBNHC"), BLOCKS, declared=declared).name == "LBNHC"
    with pytest.raises(ValueError, match="strides .* are LBHNC"):
        detect(view("LBHNC"), BLOCKS, declared=declared)


def test_one_head_takes_the_declared_name_since_both_orders_are_the_same_bytes():
    assert detect(view("LBNHC", heads=1), BLOCKS, declared="HND").name == "LBHNC"


def test_kernel_block_splitting_is_a_ratio_of_the_manager_blocks():
    physical = detect(view("LBNHC", blocks=2 * BLOCKS), BLOCKS)
    assert (physical.name, physical.kernel_ratio) == ("LBNHC", 2)
    with pytest.raises(ValueError, match="not a multiple"):
        detect(view("LBNHC", blocks=BLOCKS + 1), BLOCKS)


def test_mla_and_state_pages():
    latent = torch.zeros(BLOCKS, 1, TOKENS, 576, dtype=torch.bfloat16)
    assert detect(latent, BLOCKS, "mla").name == MLA
    page = torch.zeros(BLOCKS, 1, 1, 4096, dtype=torch.int8)
    assert detect(page, BLOCKS).name == STATE


def _layout(order: str, blocks: int = BLOCKS, declared: str | None = None) -> KVLayout:
    spec = SimpleNamespace(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    config = SimpleNamespace(num_blocks=BLOCKS, kv_cache_layout=declared,
                             kv_cache_groups=[SimpleNamespace(layer_names=["a", "b"], kv_cache_spec=spec)])
    return KVLayout(config, {"a": view(order, blocks, layer=0), "b": view(order, blocks, layer=1)})


def test_the_fingerprint_names_the_layout_and_strides_and_a_mismatch_is_refused_in_words():
    token_major, head_major = _layout("LBNHC"), _layout("LBHNC")
    assert token_major.fingerprint == _layout("LBNHC").fingerprint
    assert "LBNHC[" in token_major.fingerprint and "LBHNC[" in head_major.fingerprint
    refusal = ReblockPlans(head_major, None).plan(announcement(token_major.fingerprint, None))
    assert isinstance(refusal, str)
    assert "laid out as LBNHC" in refusal and "this engine's as LBHNC" in refusal


def test_a_kernel_split_cache_is_copied_by_manager_block():
    layout = _layout("LBNHC", blocks=2 * BLOCKS)
    info = layout.layers["a"]
    assert layout.caches["a"].shape[:2] == (BLOCKS, 2)
    raw = view("LBNHC", 2 * BLOCKS)
    assert torch.equal(layout.extract(info, [3]), raw[6:8].unsqueeze(0))


def test_a_gpu_engine_announces_token_rows_only_where_every_attention_view_is_a_plain_strided_one():
    """What a GPU engine's spec says of its attention caches (``from_vllm.token_rows``): head slicing
    and re-blocking then read them through a strided view (tests/unit/test_kv_connector_tp.py)."""
    from services.kv_connector.layouts.from_vllm import token_rows
    from services.kv_connector.layouts.spec import AttentionLayer, LayoutSpec, Sharded

    def spec(*names: str) -> LayoutSpec:
        layers = tuple(AttentionLayer(name, 0, Sharded("kv_heads", HEADS, HEAD, HEADS)) for name in names)
        return LayoutSpec("tiny", "bfloat16", 0, 1, (TOKENS,), layers)

    plain = {f"l{i}": detect(view(order, layer=i), BLOCKS) for i, order in enumerate(["LBNHC", "BLHNC"])}
    assert token_rows(spec("l0", "l1"), plain)
    assert not token_rows(spec("l0", "l1"), {"l0": plain["l0"]})  # a layer not seen: unknown
    split = {"l0": detect(view("LBNHC", blocks=2 * BLOCKS), BLOCKS)}  # kernel blocks half the manager's
    assert split["l0"].kernel_ratio == 2 and not token_rows(spec("l0"), split)
    mla = {"l0": detect(view("LBNHC", heads=1), BLOCKS, kind="mla")}
    assert not token_rows(spec("l0"), mla) and not token_rows(spec("l0"), None)
