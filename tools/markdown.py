"""Generated tables: reading the per-backend JSON results, writing Markdown between markers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attention_core import files, registry


def load_backend_documents(
    directory: str | Path, pattern: str, accept: Callable[[Any], bool], missing: str
) -> list[dict[str, Any]]:
    """Reads the JSON documents of a directory that ``accept`` takes, in the registry's order.

    Args:
        directory: Where the runs wrote their files (a missing directory holds none).
        pattern: Glob of the file names, e.g. ``bench-*.json``.
        accept: Whether a parsed document is one of those wanted (schema, fields).
        missing: The error message when none is found.

    Returns:
        The documents, sorted by their ``backend`` in :data:`registry.BACKENDS` order.

    Raises:
        ValueError: ``missing``, when no document is accepted.
    """
    folder = Path(directory)
    docs = [doc for path in (sorted(folder.glob(pattern)) if folder.is_dir() else [])
            if accept(doc := json.loads(path.read_text()))]
    if not docs:
        raise ValueError(missing)
    order = {name: i for i, name in enumerate(registry.BACKENDS)}
    return sorted(docs, key=lambda d: (order.get(d["backend"], len(order)), d["backend"]))


def write_between_markers(path: str | Path, body: str, start: str, end: str) -> None:
    """Replaces what lies between the markers ``start`` and ``end`` in a file.

    Args:
        path: The file (e.g. docs/speed.md).
        body: The new text; it gets a line of its own after ``start`` and before ``end``.
        start: The opening marker, e.g. ``<!-- bench:start -->``.
        end: The closing marker.

    Raises:
        ValueError: The file lacks the markers, or they are out of order.
    """
    file = Path(path)
    text = file.read_text()
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{file} has no {start} ... {end} markers to write between")
    files.write_text(file, f"{text[: i + len(start)]}\n{body}\n{text[j:]}")
