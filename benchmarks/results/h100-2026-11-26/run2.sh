#!/usr/bin/env bash
set -u; export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8; T0=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
echo "== variants"; timeout 80 python3 benchmarks/digest_variants.py --mib 2048 --reps 5 2>&1 | tee $OUT/variants.log
echo "== hostprof at $((SECONDS-T0))"; timeout 30 python3 .dev/hostprof.py > $OUT/hostprof.txt 2>&1; head -12 $OUT/hostprof.txt
echo "== sweep at $((SECONDS-T0))"; timeout 100 python3 -m parity sweep --only flash=true --out /tmp/sw --jobs 4 > $OUT/sweep2.log 2>&1; echo "sweep rc $?"; grep -E "\] \[[0-9]/|PARITY" $OUT/sweep2.log | cut -c1-420
if [ $((SECONDS-T0)) -lt 190 ]; then timeout 35 python3 -m pytest -q -p no:cacheprovider tests/test_capture_hashing_triton.py -k "capture_on_one_gpu" 2>&1 | tail -3; fi
echo "done at $((SECONDS-T0))"
