#!/usr/bin/env bash
set -u; export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8; T0=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
echo "== bench"; timeout 100 python3 benchmarks/run.py --only cuda_digest --json $OUT/bench3.json 2>&1 | tee $OUT/bench3.log
echo "== tests at $((SECONDS-T0))"
timeout 125 python3 -m pytest -v -p no:cacheprovider --durations=12 \
    tests/test_capture_hashing_triton.py tests/test_capture_hashing.py \
    tests/test_capture_async.py tests/test_diff_env.py \
    "tests/test_workload.py::test_workload_runs_on_cuda_single_rank" \
    "tests/test_workload.py::test_capture_on_cuda_eager_vs_compiled_two_ranks_sharing_a_gpu" \
    -k "not interpreter and not positions_restart and not sm90" > $OUT/tests3.log 2>&1; echo "tests rc $?"
grep -E "FAILED|ERROR|passed|failed" $OUT/tests3.log | tail -8; grep -A14 "slowest" $OUT/tests3.log
echo "done at $((SECONDS-T0))"
