"""Drop from a pip constraints file every package that one of the given wheels pins exactly
(``name==version`` in its ``Requires-Dist``). The CUDA image installs what this machine's .venv runs,
except where vLLM's and torch's CUDA builds pin other versions than the CPU builds the .venv runs
(apache-tvm-ffi, triton, ...): there their pins win (scripts/build_image.sh cuda).
Usage: python scripts/pinned_by.py CONSTRAINTS WHEEL... (rewrites CONSTRAINTS; prints what it dropped)."""
from __future__ import annotations

import re
import sys
import zipfile


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_names(wheel: str) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    names = set()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        requirement, _, marker = line.split(":", 1)[1].partition(";")
        if "==" in requirement and "extra" not in marker:
            names.add(normalized(re.split(r"[\s=<>!~\[(]", requirement.strip())[0]))
    return names


def main() -> None:
    path, wheels = sys.argv[1], sys.argv[2:]
    pinned = set().union(*(pinned_names(wheel) for wheel in wheels))
    with open(path) as constraints:
        lines = constraints.readlines()
    kept = [line for line in lines if normalized(line.split("==")[0].strip()) not in pinned]
    with open(path, "w") as constraints:
        constraints.writelines(kept)
    print(" ".join(sorted(line.strip() for line in lines if line not in kept)))


if __name__ == "__main__":
    main()
