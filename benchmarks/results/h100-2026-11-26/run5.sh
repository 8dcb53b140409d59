#!/usr/bin/env bash
# held-out FSDP2 trainer on one GPU under parity exec: two identical runs match, a between-steps
# edit is found at the right step; capture's own host time per step from meta.json
set -u; export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8; T0=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
L="python3 -m torch.distributed.run --standalone --nproc_per_node 1 .dev/heldout_gpu.py"
for r in a b; do timeout 90 python3 -m parity exec --out $OUT/ho/$r -- $L 2>&1 | tail -2; done
echo "== diff a b at $((SECONDS-T0))"
timeout 60 python3 -m parity diff $OUT/ho/a $OUT/ho/b > $OUT/ho/ab.txt 2>&1; echo "diff rc $?"; head -12 $OUT/ho/ab.txt
PERTURB=3 timeout 90 python3 -m parity exec --out $OUT/ho/c -- $L 2>&1 | tail -2
echo "== diff a c at $((SECONDS-T0))"
timeout 60 python3 -m parity diff $OUT/ho/a $OUT/ho/c > $OUT/ho/ac.txt 2>&1; echo "diff rc $?"; head -24 $OUT/ho/ac.txt
python3 - "$OUT/ho" <<'PY'
import json, sys, pathlib
for r in "abc":
    for m in sorted(pathlib.Path(sys.argv[1], r).glob("rank-*/meta.json")):
        c = json.loads(m.read_text()).get("capture", {})
        print(r, m.parent.name, {k: c.get(k) for k in ("hasher", "device_digest", "device_digest_version", "seconds", "steps")})
PY
echo "done at $((SECONDS-T0))"
