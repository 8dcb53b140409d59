#!/usr/bin/env bash
# final check of the committed code on the GPU: CUDA digest tests, host time, held-out trainer
set -u; export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8; T0=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
git log --oneline -1 2>/dev/null || true
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_capture_hashing_triton.py tests/test_capture_async.py -k "not interpreter and not positions_restart and not sm90" 2>&1 | tail -4
echo "== host time at $((SECONDS-T0))"
timeout 60 python3 -c "
import sys; sys.path.insert(0, '.')
from benchmarks.run import _cuda_host_time
_cuda_host_time(False, lambda k, v: print(k, v, flush=True))
"
echo "== held-out trainer at $((SECONDS-T0))"
L="python3 -m torch.distributed.run --standalone --nproc_per_node 1 .dev/heldout_gpu.py"
for r in a b; do timeout 90 python3 -m parity exec --out $OUT/ho/$r -- $L 2>&1 | tail -1; done
PERTURB=3 timeout 90 python3 -m parity exec --out $OUT/ho/c -- $L 2>&1 | tail -1
timeout 60 python3 -m parity diff $OUT/ho/a $OUT/ho/b 2>&1 | head -1; echo "diff a b rc ${PIPESTATUS[0]}"
timeout 60 python3 -m parity diff $OUT/ho/a $OUT/ho/c 2>&1 | head -1; echo "diff a c rc ${PIPESTATUS[0]}"
echo "done at $((SECONDS-T0))"
