"""bench/chaos.py's expected answers are kept per host: answers computed where the engines run
bfloat16 must not be read where they run float32 (the same prompt's greedy text differs)."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_expected_answers_are_kept_per_dtype_the_engines_run(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import chaos
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from services.engine import args

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setenv("PRFAAS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(args, "_has_gpu", lambda: False)
    work = [(0, [1, 2, 3], chaos.BUDGET)]
    paths = set()
    for flags in ({"avx2"}, {"avx2", "avx512_bf16"}):
        monkeypatch.setattr(args, "_cpu_flags", lambda flags=flags: flags)
        paths.add(chaos.answers_path(str(tmp_path), work))
    assert len(paths) == 2
    assert all(path.parent == tmp_path / "cache" / "chaos" for path in paths)
