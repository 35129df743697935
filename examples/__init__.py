"""Worked examples, run from the repository root (not installed with the package).

``python -m examples`` lists them; each script takes ``--help``.

Each framework script trains for real with that framework's autodiff and optimiser:

* ``python -m examples.nadaraya_watson_<framework>`` (torch, tensorflow, jax, mxnet): the
  Nadaraya-Watson kernel width, fitted on the leave-one-out loss; shared part
  :mod:`examples.nadaraya_watson`.
* ``python -m examples.seq2seq_<framework>`` (torch, tensorflow, jax): a GRU encoder-decoder with
  Bahdanau (additive) attention, trained to reverse token sequences; shared part
  :mod:`examples.seq2seq`.

``tests/test_examples.py`` trains each of them on the backend under test.
"""
