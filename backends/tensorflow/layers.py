"""Keras 3 layers on TensorFlow: :mod:`backends.keras`' classes, Keras set to TensorFlow.

The same classes as ``backends.keras`` (so ``.keras`` files name them alike); importing this
module under another Keras backend raises ImportError (use ``backends.keras`` there).
"""

# isort: skip_file
# The backend's check first: under another Keras backend, nothing else of it is imported.
from backends.tensorflow.ops import OPS as _OPS  # noqa: F401 - ImportError unless on TensorFlow
from backends.keras.layers import *  # noqa: F403 - the declared layers (its __all__)
from backends.keras.layers import KerasArguments as KerasArguments
from backends.keras.layers import Layer as Layer
from backends.keras.layers import __all__ as __all__
