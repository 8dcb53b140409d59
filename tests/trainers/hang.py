"""A trainer that never finishes (sweep timeout tests): every rank writes its pid, starts a
grandchild in a session of its own (as torchrun does with its workers), and sleeps forever.

  --pid-dir DIR       each process writes DIR/<pid>.pid (rank and grandchild alike)
  --ignore-term       ignore SIGTERM, so only SIGKILL ends it (the launcher's second step)
"""

import argparse
import os
import signal
import subprocess
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--pid-dir", required=True)
    p.add_argument("--ignore-term", action="store_true")
    args = p.parse_args()
    os.makedirs(args.pid_dir, exist_ok=True)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import os, signal, sys, time\n"
         f"signal.signal(signal.SIGTERM, signal.SIG_IGN) if {args.ignore_term} else None\n"
         "open(os.path.join(sys.argv[1], f'{os.getpid()}.pid'), 'w').write('grandchild')\n"
         "time.sleep(3600)\n", args.pid_dir],
        start_new_session=True)
    with open(os.path.join(args.pid_dir, f"{os.getpid()}.pid"), "w") as f:
        f.write(f"rank {os.environ.get('RANK')} child {child.pid}")
    print(f"hang.py rank {os.environ.get('RANK')} pid {os.getpid()} hanging", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
