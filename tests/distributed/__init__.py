"""Worker scripts that ``tests/test_distributed.py`` and ``tests/test_concurrency.py`` run in fresh
interpreters (``python -m tests.distributed.<name>``), so that environment variables, device counts
and first imports take effect before a framework initialises. Each prints one line
``RESULT <json>`` with what it measured; the tests make the assertions."""
