"""Running unmodified torchtitan 0.3.0 on CPU/gloo for parity's tests (no torchtitan file edited).

``assets.make(workdir)`` writes the data set and tokenizer torchtitan reads relative to its
working directory; ``launch.py`` applies the import-time CPU shims and runs ``torchtitan.train``.
Imports nothing from parity: it is the user's job, seen from outside.
"""
