"""Writing generated tables into a Markdown file, between two marker comments."""

from __future__ import annotations

from pathlib import Path


def write_between_markers(path: str | Path, body: str, start: str, end: str) -> None:
    """Replaces what lies between the markers ``start`` and ``end`` in a file.

    Args:
        path: The file (e.g. README.md).
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
    file.write_text(f"{text[: i + len(start)]}\n{body}\n{text[j:]}")
