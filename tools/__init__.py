"""Maintenance tools run from the repository root, not installed with the package.

* ``python -m tools.matrix``: the test matrix's measurements as the table of ``docs/test-matrix.md``.
* :mod:`tools.markdown`: reading the per-backend JSON results, writing Markdown between markers
  (shared with ``benchmarks``).
* ``python -m tools.doc_fences``: the code fences of README.md and docs/, listed, checked against
  the docs convention and run (``tests/test_docs.py`` runs them per backend env).
* ``python tools/mask_conventions.py``: how each framework treats a fully masked row.
"""
