"""docs/architecture.md's layer diagram must be what scripts/gen_architecture.py makes of .importlinter."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_architecture  # noqa: E402


def test_the_layer_diagram_is_current():
    page = gen_architecture.OUTPUT.read_text()
    assert page == gen_architecture.render(page), "docs/architecture.md is stale: run `make docs`"


def test_every_package_under_services_has_a_layer():
    layered = {name.strip() for row in gen_architecture.render_layers().split("```")[1].splitlines()[2:]
               for name in row.split("|") if name.strip()}
    packages = {p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists()}
    assert packages <= layered, f"packages in no layer of .importlinter: {sorted(packages - layered)}"
