"""Maintenance tools run from the repository root, not installed with the package.

* ``python -m tools.matrix``: the test matrix's measurements as the table of ``docs/test-matrix.md``.
* :mod:`tools.markdown`: reading the per-backend JSON results, writing Markdown between markers
  (shared with ``benchmarks``).
* ``python tools/mask_conventions.py``: how each framework treats a fully masked row.
"""
