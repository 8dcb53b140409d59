"""Repository entry point: ``python cli.py ARGS`` runs the ``parity`` command from a checkout.

The commands live in :mod:`parity.cli` so that an install puts nothing but the ``parity`` package
into site-packages; the installed ``parity`` script and ``python -m parity`` call the same main.
"""

from parity.cli import main

if __name__ == "__main__":
    main()
