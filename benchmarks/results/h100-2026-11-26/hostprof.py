import cProfile, pstats, statistics, time, sys
import torch
sys.path.insert(0, ".")
from benchmarks.run import _small_cuda_tensors
from parity.capture.hashing import digest_tensors_async
params = _small_cuda_tensors(1500)
grads = [torch.empty_like(p) for p in params]
entry = [None if i % 100 == 99 else p for i, p in enumerate(params)]
parts = {"entry": [], "grads": [], "params": [], "results": []}
def step(prev, prev_entry, rec):
    t0 = time.perf_counter()
    d_entry = digest_tensors_async(entry, "auto", stable=True)
    t1 = time.perf_counter()
    d_grads = digest_tensors_async(grads, "auto", owners=params, figures=True)
    t2 = time.perf_counter()
    d_params = digest_tensors_async(params, "auto", stable=True, figures=True)
    t3 = time.perf_counter()
    if prev is not None:
        prev_entry.result()
        for d in prev:
            d.result(); d.figures()
    t4 = time.perf_counter()
    if rec:
        for k, a, b in (("entry", t0, t1), ("grads", t1, t2), ("params", t2, t3), ("results", t3, t4)):
            parts[k].append((b - a) * 1e3)
    return (d_params, d_grads), d_entry
prev = pe = None
for k in range(60):
    torch.cuda.synchronize()
    prev, pe = step(prev, pe, k >= 5)
for k, v in parts.items():
    print(f"host ms {k:8s} median {statistics.median(v):.3f}")
# alone: launch pieces
from parity.capture import hashing_triton as ht
plan = ht._stable[next(iter(ht._stable))][1]
for name, fn in (("launch(figures)", lambda: ht._launch(plan, ht.BLOCK, ht.ITERS, True)),
                 ("launch(digest)", lambda: ht._launch(plan, ht.BLOCK, ht.ITERS, False)),
                 ("data_ptr x1500", lambda: list(map(ht._DATA_PTR, params))),
                 ("ids x1500", lambda: tuple(map(id, params))),
                 ("zeros", lambda: torch.zeros(1500, 4, dtype=torch.int64, device="cuda")),
                 ("pinned empty", lambda: torch.empty(1500, 5, dtype=torch.int64, pin_memory=True)),
                 ("event", lambda: torch.cuda.Event().record())):
    ts = []
    for _ in range(200):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    print(f"host us {name:18s} {statistics.median(ts) * 1e6:.1f}")
pr = cProfile.Profile()
pr.enable()
for k in range(50):
    prev, pe = step(prev, pe, False)
pr.disable()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(25)
