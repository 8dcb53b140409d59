"""parity's capture bootstrap, put first on PYTHONPATH by `parity exec` (never installed).

Python imports ``sitecustomize`` at startup. This one
1. runs the user's own ``sitecustomize`` - the next one on ``sys.path`` - under that name, so it
   behaves exactly as without parity (``import sitecustomize`` then returns the user's module);
2. if ``PARITY_CAPTURE_DIR`` is set and no parent process is already a capturing rank
   (``PARITY_CAPTURE_ACTIVE``), hands over to ``parity.capture.inject.boot``, which decides
   whether this process is a rank and waits for ``import torch``.
Processes outside a captured job (no ``PARITY_CAPTURE_DIR``) and the helpers of a rank pay only
step 1 and two environment lookups. Nothing here may raise.
"""

import os
import sys


def _parity_chain():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        import importlib.machinery
        import importlib.util

        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
        if spec is None or spec.loader is None:
            return
        ours = sys.modules.get("sitecustomize")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            if ours is not None:
                sys.modules["sitecustomize"] = ours
            raise
    except Exception as e:  # what site.py does with a failing sitecustomize
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())
        else:
            sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                             f"{e.__class__.__name__}: {e}\n")


def _parity_boot():
    if not os.environ.get("PARITY_CAPTURE_DIR"):
        return
    active = os.environ.get("PARITY_CAPTURE_ACTIVE")
    if active and active != str(os.getpid()):
        return  # a child of a capturing rank (compile worker, data-loader worker, ...)
    try:
        try:
            from parity.capture import inject
        except ImportError:
            # This interpreter does not have parity installed: use the tree we ship from.
            root = os.path.dirname(os.path.dirname(os.path.dirname(
                os.path.dirname(os.path.abspath(__file__)))))
            if root not in sys.path:
                sys.path.append(root)
            from parity.capture import inject
        inject.boot()
    except Exception as e:
        msg = str(e).strip().splitlines()
        sys.stderr.write(f"parity: capture disabled: {e.__class__.__name__}"
                         f"{': ' + msg[0] if msg else ''}\n")


_parity_chain()
_parity_boot()
