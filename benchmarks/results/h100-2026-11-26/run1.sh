#!/usr/bin/env bash
# device run 1: install, gpu_check, then (time permitting) a host profile of capture at 540M
set -u
export PYTHONUNBUFFERED=1
T0=$SECONDS
nvidia-smi -L; python3 -c 'import torch,triton,xxhash,click,rich;print("torch",torch.__version__,"triton",triton.__version__,"xxhash",xxhash.VERSION)'
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
python3 -c 'import parity,sys;print("parity at",parity.__file__)' || export PYTHONPATH=$PWD
echo "install done at $((SECONDS-T0))s"
PYTHON=python3 bash benchmarks/gpu_check.sh /tmp/gc 2>&1 | tee $OUT/gpu_check.log
for f in tests.log bench.log bench.json sweep.log; do cp /tmp/gc/$f $OUT/ 2>/dev/null; done
tar czf $OUT/sweep.tgz -C /tmp/gc --exclude='*.pt' sweep 2>/dev/null
echo "gpu_check done at $((SECONDS-T0))s"
if [ $((SECONDS-T0)) -lt 370 ]; then
  rm -rf /tmp/prof
  timeout 70 python3 -m parity exec --out /tmp/prof -- torchrun --standalone --nproc_per_node 1 --no-python python3 -m cProfile -o /tmp/p.out -m parity.workloads.train --mode eager --device cuda --backend nccl --steps 12 --dim 2048 --layers 8 --heads 16 --vocab-size 32768 --seq-len 1024 --batch-size 8 2>&1 | tail -8
  python3 - <<'PY' > $OUT/prof.txt 2>&1
import pstats, json
p = pstats.Stats("/tmp/p.out"); p.sort_stats("cumulative").print_stats(45)
p.sort_stats("tottime").print_stats(30)
try: print(json.load(open("/tmp/prof/rank-00000/meta.json"))["capture"])
except Exception as e: print("meta", e)
PY
  head -c 2500 $OUT/prof.txt | tail -c 1200
fi
echo "all done at $((SECONDS-T0))s"
