"""``python -m benchmarks``, from the repository root: see :mod:`benchmarks.cli`."""

import sys

from benchmarks.cli import main

sys.exit(main())
