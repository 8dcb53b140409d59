"""Where capture's digest path spends host time inside a step (inclusive timers per function),
after the benchmark's own figure in the same process."""
import functools, statistics, sys, time
import torch
sys.path.insert(0, ".")
from benchmarks import run as bench
from parity.capture import hashing, hashing_triton as ht

bench._cuda_host_time(False, lambda k, v: print(k, v, flush=True))

acc: dict = {}


def timed(owner, name, label=None):
    fn = getattr(owner, name)
    label = label or name

    @functools.wraps(fn)
    def w(*a, **k):
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            acc[label] = acc.get(label, 0) + time.perf_counter_ns() - t0
    setattr(owner, name, w)


for owner, name in ((hashing, "digest_tensors_async"), (ht, "digest_all_cuda"), (ht, "_reuse"),
                    (ht, "_ptrs_equal"), (ht, "_launch_plan"), (ht, "_to_host"), (ht, "usable"),
                    (ht, "_capture"), (hashing.Digests, "result"), (hashing.Digests, "figures"),
                    (ht.Pending, "wait"), (ht.Pending, "result"), (ht.Pending, "figures_bytes")):
    timed(owner, name, f"{getattr(owner, '__name__', owner)}.{name}")
# pieces of _to_host, in the step
orig_empty = torch.empty
params = bench._small_cuda_tensors(1500)
grads = [torch.empty_like(p) for p in params]
entry = [None if i % 100 == 50 else p for i, p in enumerate(params)]
from parity.capture.hashing import digest_tensors_async as dta  # the timed one
steps, prev, pe = 200, None, None
for k in range(steps + 10):
    if k == 10:
        acc.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    d_entry = hashing.digest_tensors_async(entry, "auto", stable=True)
    d_grads = hashing.digest_tensors_async(grads, "auto", owners=params, figures=True)
    d_params = hashing.digest_tensors_async(params, "auto", stable=True, figures=True)
    if prev is not None:
        pe.result()
        for d in prev:
            d.result(); d.figures()
    acc["step"] = acc.get("step", 0) + time.perf_counter_ns() - t0
    prev, pe = (d_params, d_grads), d_entry
torch.cuda.synchronize()
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"us per step {k:40s} {v / steps / 1e3:9.1f}", flush=True)
# the replay and copy pieces in a step-like sequence (3 different graphs back to back)
gs = [(s.plan, g) for lst in ht._stable.values() for s in lst for g in s.plan.graphs.values()]
print("graphs held:", len(gs), flush=True)
pieces = {"replay": [], "empty_pinned": [], "copy_": [], "event": [], "views": []}
stream = torch.cuda.current_stream()
for k in range(200):
    torch.cuda.synchronize()
    for plan, g in gs[:3]:
        t0 = time.perf_counter_ns(); g.graph.replay(); t1 = time.perf_counter_ns()
        host = torch.empty(g.res.shape, dtype=torch.int64, pin_memory=True); t2 = time.perf_counter_ns()
        host.copy_(g.res, non_blocking=True); t3 = time.perf_counter_ns()
        ev = torch.cuda.Event(); ev.record(stream); t4 = time.perf_counter_ns()
        h = host[:plan.n]; a, b = h[:, :2], h[:, 2:].view(torch.float64) if h.shape[1] > 2 else None
        t5 = time.perf_counter_ns()
        for key, x, y in (("replay", t0, t1), ("empty_pinned", t1, t2), ("copy_", t2, t3),
                          ("event", t3, t4), ("views", t4, t5)):
            pieces[key].append((y - x) / 1e3)
for key, v in pieces.items():
    print(f"us in sequence {key:14s} median {statistics.median(v):7.1f}  mean {statistics.mean(v):7.1f}", flush=True)
