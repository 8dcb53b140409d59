"""Injection: activating capture inside processes that never imported parity.

``parity exec`` (launch.py) prepends ``parity/capture/bootstrap`` to ``PYTHONPATH`` and sets the
``PARITY_CAPTURE_*`` variables below. Every Python process of the job then imports the bootstrap
``sitecustomize``, which first runs the user's own ``sitecustomize`` (the next one on the path),
then decides with ``os``/``sys`` alone whether this process is a rank (``rank_skip_reason``), and
only then imports this module and calls :func:`boot`.

:func:`boot` does not import torch: it waits for the trainer to import it (a one-shot
``sys.meta_path`` finder that wraps the loader of ``torch``), so a trainer that sets thread or
allocator variables before ``import torch`` sees no difference, and a process that never imports
torch pays nothing beyond this module. When torch has finished importing, the session
(session.py) installs its hooks.

This module stays import-light (``os``, ``sys``, env.py, post_import.py): it is imported in every
rank at startup. It is the top of the activation path: it imports the session (lazily), nothing
in capture imports it.
"""

from __future__ import annotations

import os

from parity.capture.env import ENV_DIR, INTERRUPTED_FILE, rank_skip_reason
from parity.capture.post_import import when_imported


def _activate(_torch_module) -> None:
    from parity.capture import activation

    s = activation.activate_from_env()
    if os.environ.get("PARITY_OPS_STEP"):  # only `parity bisect` reruns set it (ops.py)
        from parity.capture import ops

        ops.activate_from_env(s)


def quiet_when_interrupted() -> None:
    """Chain a ``sys.excepthook`` that prints nothing for the exception a signal forwarded by
    `parity exec` raises (torchrun's ``SignalException``, a rank's ``KeyboardInterrupt``) once
    `parity exec` has marked the run interrupted (``INTERRUPTED_FILE``): parity says it in one
    line and exits 130. Any other exception, and these before parity forwarded anything, print
    as ever."""
    out = os.environ.get(ENV_DIR)
    if not out:
        return
    import sys

    marker = os.path.join(out, INTERRUPTED_FILE)
    previous = sys.excepthook

    def excepthook(tp, value, tb):
        if (issubclass(tp, KeyboardInterrupt) or tp.__name__ == "SignalException") \
                and os.path.exists(marker):
            return None
        return previous(tp, value, tb)

    sys.excepthook = excepthook


def boot() -> None:
    """Called by the bootstrap sitecustomize in a process that may be a rank."""
    why = rank_skip_reason()
    if why is None or why == "torchrun agent":
        quiet_when_interrupted()
    if why is not None:
        return
    # PARITY_CAPTURE_ACTIVE (children of a capturing rank stay out) is set by the session when
    # it starts recording, after ``import torch``: a wrapper that starts the real trainer as a
    # child without importing torch itself leaves the child free to be the captured rank.
    when_imported("torch", _activate)
