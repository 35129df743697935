"""``python -m examples``: lists the worked examples, one line each, and how to run them.

Run from the repository root. The list is read from the scripts' docstrings, so no framework
is imported: it works on a NumPy-only install.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent

def summary(path: Path) -> str:
    """The first line of a module's docstring (without reading anything else of it)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0].replace("``", "") if doc.strip() else ""


def runnable(path: Path) -> bool:
    """Whether a module is a script (it has ``if __name__ == "__main__"``)."""
    return 'if __name__ == "__main__":' in path.read_text()


def scripts() -> list[str]:
    """The example scripts' module names, ``examples.<name>``."""
    return sorted(p.stem for p in HERE.glob("*.py")
                  if not p.stem.startswith("_") and runnable(p) and not shared(p.stem))


def shared(name: str) -> bool:
    """Whether ``name`` is the framework-free part that a family of scripts shares."""
    return any(p.stem.startswith(f"{name}_") for p in HERE.glob("*.py"))


def listing() -> str:
    """The lines ``python -m examples`` prints."""
    names = scripts()
    width = max(len(n) for n in names)
    lines = ["Worked examples; run one from the repository root with `python -m examples.NAME`",
             "(`--help` for its options). The framework a script needs ends its name.", ""]
    for name in names:
        lines.append(f"  {name:<{width}}  {summary(HERE / f'{name}.py')}")
    parts = sorted(p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_")
                   and shared(p.stem))
    lines += ["", "Shared, framework-free parts (not scripts): "
              + ", ".join(f"examples.{p}" for p in parts)]
    return "\n".join(lines)


def shared_main(name: str, argv: Sequence[str] | None = None) -> int:
    """What ``python -m examples.<name>`` does for a shared part: says which scripts to run."""
    family = [n for n in scripts() if n.startswith(f"{name}_")]
    parser = argparse.ArgumentParser(
        prog=f"python -m examples.{name}",
        description=f"{summary(HERE / f'{name}.py')} This module is the part its scripts share; "
        f"run one of them: {', '.join(f'python -m examples.{n}' for n in family)}.")
    parser.parse_args(argv)
    print(parser.description)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the list of examples."""
    argparse.ArgumentParser(prog="python -m examples", description=__doc__.splitlines()[0]
                            ).parse_args(argv)
    print(listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
