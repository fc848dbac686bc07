"""bench/layerwise_overlap.py's arithmetic, which needs no engine: what the link makes unavoidable,
the headline share beyond it, and the KV it sizes the link for (float32 KV is twice bfloat16's: a
link sized for bfloat16 on a host whose engines run float32 took twice the planned time). The short
run with engines is tests/e2e/test_layerwise_overlap_short.py."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
try:
    import layerwise_overlap
finally:
    sys.path.remove(str(ROOT / "bench"))


@pytest.mark.parametrize(("exposed_s", "after_transfer_s", "prefill_s", "unavoidable", "share"), [
    (0.0, 10.0, 16.0, 0.0, 0.0),     # hidden behind a longer prefill
    (0.5, 10.0, 16.0, 0.0, 0.05),    # nothing unavoidable: the raw share
    (4.4, 22.0, 17.25, 4.75, 0.0),   # a transfer that outlasts the prefill: all of it unavoidable
    (6.0, 22.0, 17.0, 5.0, 1 / 22),  # 1 s beyond the 5 s the link makes unavoidable
])
def test_the_headline_counts_only_what_streaming_could_have_hidden(exposed_s, after_transfer_s, prefill_s,
                                                                    unavoidable, share):
    assert layerwise_overlap.unavoidable_s(after_transfer_s, prefill_s) == pytest.approx(unavoidable)
    assert layerwise_overlap.adjusted_share(exposed_s, after_transfer_s, prefill_s) == pytest.approx(share)


def test_the_kv_it_sizes_the_link_for_is_in_the_engines_dtype(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 30, "num_key_value_heads": 3, "hidden_size": 576, '
                                          '"num_attention_heads": 9}')
    assert layerwise_overlap.kv_layer_bytes(str(tmp_path), "bfloat16", 4000) == (30, 2 * 3 * 64 * 2 * 4000)
    assert layerwise_overlap.kv_layer_bytes(str(tmp_path), "float32", 4000) == (30, 2 * 3 * 64 * 4 * 4000)
