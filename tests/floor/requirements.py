"""Print the oldest release of every requirement setup.py admits, pinned (``name==floor``), for
the floor environment ``make test`` checks the code against (Makefile: floor-test).

Read from setup.py itself, so that the floors tested are exactly the floors promised: a
requirement without a lower bound is an error (nothing would say what is tested), as is one
whose bound is not inclusive.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from packaging.requirements import Requirement

SETUP = Path(__file__).resolve().parents[2] / "setup.py"


def install_requires(setup: Path = SETUP) -> list[str]:
    """The ``install_requires`` list of ``setup(...)`` in ``setup``, as written."""
    for node in ast.walk(ast.parse(setup.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for kw in node.keywords:
                if kw.arg == "install_requires":
                    return [ast.literal_eval(e) for e in kw.value.elts]
    raise SystemExit(f"{setup}: no install_requires in setup(...)")


def floors(requirements: list[str]) -> dict[str, str]:
    """Requirement name -> the version of its ``>=`` bound."""
    out = {}
    for text in requirements:
        req = Requirement(text)
        lower = [s.version for s in req.specifier if s.operator == ">="]
        if len(lower) != 1:
            raise SystemExit(f"setup.py: {text!r} needs exactly one '>=' floor (the floor is tested)")
        out[req.name] = lower[0]
    return out


if __name__ == "__main__":
    for name, version in floors(install_requires()).items():
        sys.stdout.write(f"{name}=={version}\n")
