"""``python -m parity ARGS``: the same command line as the ``parity`` script."""

from parity.cli import main

if __name__ == "__main__":
    main()
