"""Framework adapters for attention-core, one subpackage per framework.

``backends`` is a top-level package name: ``from backends.torch import MultiHeadAttention``.
Importing ``backends`` itself imports no framework; each subpackage imports only its own.
"""
