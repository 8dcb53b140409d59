#!/usr/bin/env bash
set -u; export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8; T0=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
echo "== hostprof"; timeout 60 python3 .dev/hostprof2.py 2>&1 | tee $OUT/run4-hostprof.txt | head -30
echo "== new tests at $((SECONDS-T0))"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_capture_hashing_triton.py -k "replayed or host_sync or on_cuda_equals" 2>&1 | tail -15
echo "== gpu_check at $((SECONDS-T0))"
timeout 450 bash benchmarks/gpu_check.sh $OUT/gc > $OUT/run4-gpu_check.log 2>&1
echo "gpu_check rc $?"
grep -E "cuda_|MISS|^sweep:|exit|gpu_check|passed|failed|FAILED|Error" $OUT/run4-gpu_check.log | head -70
echo "done at $((SECONDS-T0))"
