"""mkdocs hook: the benchmark plots join the site where the pages link them.

``python -m benchmarks --merge`` and ``complexity --replot`` write their plots beside the JSON
files in ``benchmarks/results/``. ``docs/speed.md`` links them as
``benchmarks/results/<name>.png``; this hook adds those files to the site under the same path,
so the generators keep one output directory and the pages need no copies.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

#: The repository's directories whose PNG files the site serves under the same relative path.
PLOT_DIRS = ("benchmarks/results",)


def on_files(files: Any, config: Any) -> Any:
    """Adds the plots of :data:`PLOT_DIRS` to the site's files (mkdocs' ``on_files`` event).

    Args:
        files: The site's ``mkdocs.structure.files.Files``.
        config: The mkdocs configuration (``config_file_path`` locates the repository).

    Returns:
        The same ``files``, with one entry per plot.
    """
    file_class = importlib.import_module("mkdocs.structure.files").File
    root = Path(config["config_file_path"]).resolve().parent
    for directory in PLOT_DIRS:
        for png in sorted((root / directory).glob("*.png")):
            uri = png.relative_to(root).as_posix()
            files.append(file_class(uri, str(root), config["site_dir"], config["use_directory_urls"]))
    return files
