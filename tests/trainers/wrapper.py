"""A launcher-style wrapper: runs the real trainer as a child process and passes its exit code
on, without importing torch itself (what a site's `train.py -> subprocess` launcher does).
Imports nothing from parity.

    python tests/trainers/wrapper.py TRAINER [ARGS...]
"""

import subprocess
import sys

sys.exit(subprocess.call([sys.executable, *sys.argv[1:]]))
