"""mkdocs hooks (``hooks:`` in mkdocs.yml): plots from outside ``docs/``, details, Sphinx roles.

``python -m benchmarks --merge`` and ``complexity --replot`` write their plots beside the JSON
files in ``benchmarks/results/``, outside ``docs/``. A page links them by their path in the
repository (``docs/speed.md``: ``../benchmarks/results/bench.png``), which is right on a source
browser. These hooks add the plots to the site under ``benchmarks/results/`` and point such
links there, so the generators keep one output directory and the pages need no copies.

``python -m tools.matrix`` folds its largest table into ``<details>``, which a source browser
renders with the Markdown inside; Python-Markdown does so only for blocks marked
``markdown="1"`` (the ``md_in_html`` extension), which the page hook adds.

The docstrings cross-reference in Sphinx's way (``:func:`name```), which ``help()`` and IDEs
show as is; mkdocstrings renders the role's name as text before the code, so the content hook
drops it.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

#: The repository's directories (outside ``docs/``) whose PNG files the site serves.
PLOT_DIRS = ("benchmarks/results",)

#: The API pages for extenders; the other API pages are for users of the layers.
EXTENDING = ("api/declarations.md", "api/kernels.md", "api/ops.md")
#: The machinery of a declared layer, which a user's page does not document or link.
INTERNALS = ("Declaration", "Run", "Binding")
_INTERNAL = re.compile(r"attention_core\.declarations\.(" + "|".join(INTERNALS) + r")\b")

#: A Sphinx role left before inline code in rendered HTML, e.g. ``:func:<code>``.
_ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj):(?=<code>)")


def on_files(files: Any, config: Any) -> Any:
    """Adds the plots of :data:`PLOT_DIRS` to the site's files (mkdocs' ``on_files`` event).

    Args:
        files: The site's ``mkdocs.structure.files.Files``.
        config: The mkdocs configuration (``config_file_path`` locates the repository).

    Returns:
        The same ``files``, with one entry per plot, at its path in the repository.
    """
    file_class = importlib.import_module("mkdocs.structure.files").File
    root = Path(config["config_file_path"]).resolve().parent
    for directory in PLOT_DIRS:
        for png in sorted((root / directory).glob("*.png")):
            uri = png.relative_to(root).as_posix()
            files.append(file_class(uri, str(root), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Points a page's links into :data:`PLOT_DIRS` at the plots' place in the site.

    Args:
        markdown: The page's Markdown source.
        page: The page (``page.file.src_uri`` is its path under ``docs/``).

    Returns:
        The Markdown with ``../`` (one more than the page's depth) taken off those links, and
        each bare ``<details>`` marked for its Markdown to be rendered.
    """
    markdown = markdown.replace("<details>", '<details markdown="1">')
    depth = page.file.src_uri.count("/")
    for directory in PLOT_DIRS:
        up = "../" * depth
        link = rf"\]\({re.escape(up)}\.\./{re.escape(directory)}/"
        markdown = re.sub(link, f"]({up}{directory}/", markdown)
    return markdown


def on_page_content(html: str, page: Any = None, **_: Any) -> str:
    """Drops the Sphinx role names before inline code; refuses internals on a user's page.

    The docstrings put role names before inline code (``:func:``). A user's API page (not one
    of :data:`EXTENDING`) that documents or links a class of :data:`INTERNALS` fails the build.

    Args:
        html: The page's rendered HTML.
        page: The page (``page.file.src_uri`` is its path under ``docs/``).

    Returns:
        The HTML without those role names.

    Raises:
        mkdocs.exceptions.PluginError: An API page outside :data:`EXTENDING` names a class of
            :data:`INTERNALS`.
    """
    uri = page.file.src_uri if page is not None else ""
    if uri.startswith("api/") and uri not in EXTENDING:
        found = sorted(set(_INTERNAL.findall(html)))
        if found:
            error = importlib.import_module("mkdocs.exceptions").PluginError
            raise error(f"{uri} documents internals ({', '.join(found)}): they belong on the "
                        f"Extending pages ({', '.join(EXTENDING)})")
    return _ROLE.sub("", html)
