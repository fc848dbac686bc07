"""The committed gRPC stubs must be what `make proto` generates from proto/ today."""
import filecmp
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_proto  # noqa: E402


def test_committed_stubs_are_current(tmp_path):
    gen_proto.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    stale = [str(p) for p in generated if not filecmp.cmp(tmp_path / p, ROOT / "proto" / p, shallow=False)]
    assert not stale, f"stale stubs (run `make proto`): {stale}"
