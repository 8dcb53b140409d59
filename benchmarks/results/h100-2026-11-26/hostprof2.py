"""Host time per step of capture's digest path, by phase and by piece (graphs on and off)."""
import cProfile, os, pstats, statistics, sys, time
from operator import is_
import torch
sys.path.insert(0, ".")
from benchmarks.run import _small_cuda_tensors
from parity.capture import hashing_triton as ht
from parity.capture.hashing import digest_tensors_async

params = _small_cuda_tensors(1500)
grads = [torch.empty_like(p) for p in params]
entry = [None if i % 100 == 50 else p for i, p in enumerate(params)]
print("torch", torch.__version__, "C address check:", ht._PTRS_EQUAL is not None, flush=True)


def step(prev, prev_entry, parts):
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
    if parts is not None:
        for k, a, b in (("entry", t0, t1), ("grads", t1, t2), ("params", t2, t3),
                        ("results", t3, t4), ("total", t0, t4)):
            parts.setdefault(k, []).append((b - a) * 1e3)
    return (d_params, d_grads), d_entry


for graphs in ("1", "0", "1"):
    os.environ[ht.ENV_GRAPHS] = graphs
    parts, prev, pe = {}, None, None
    for k in range(120):
        torch.cuda.synchronize()
        prev, pe = step(prev, pe, parts if k >= 10 else None)
    torch.cuda.synchronize()
    print(f"graphs={graphs}: " + "  ".join(f"{k} {statistics.median(v):.3f}" for k, v in parts.items())
          + " (host ms, median of 110 steps)", flush=True)
print("graphs state:", ht._state, flush=True)
os.environ[ht.ENV_GRAPHS] = "1"
seen = [s for lst in ht._stable.values() for s in lst
        if s.members[0] is params[0] and s.members[-1] is params[-1] and s.pos is None]
plan = seen[0].plan if seen else None
g = plan.graphs.get(True) if plan else None
idx = list(range(1500))
ptrs = list(map(ht._DATA_PTR, params))
cp = list(params)
stream = torch.cuda.current_stream()
pieces = [("identity x1500", lambda: all(map(is_, cp, params))),
          ("address check C x1500", lambda: ht._PTRS_EQUAL and ht._PTRS_EQUAL(params, ptrs, idx)),
          ("address check py x1500", lambda: list(map(ht._DATA_PTR, params)) == ptrs),
          ("contiguous x1500", lambda: all(map(ht._IS_CONTIGUOUS, grads))),
          ("set of types x1500", lambda: set(map(type, params))),
          ("current_stream", lambda: torch.cuda.current_stream(params[0].device)),
          ("event record", lambda: torch.cuda.Event().record()),
          ("pinned empty", lambda: torch.empty(1500, 5, dtype=torch.int64, pin_memory=True))]
if g is not None:
    pieces += [("graph replay", lambda: g.graph.replay()),
               ("_to_host", lambda: ht._to_host(plan, g.res, None, True, stream)),
               ("_launch_plan (replay)", lambda: ht._launch_plan(plan, True)),
               ("_launch (queued)", lambda: ht._launch(plan, ht.BLOCK, ht.ITERS, True))]
for name, fn in pieces:
    ts = []
    for _ in range(300):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    print(f"host us {name:24s} {statistics.median(ts) * 1e6:8.1f}", flush=True)
pr = cProfile.Profile()
prev = pe = None
pr.enable()
for k in range(50):
    prev, pe = step(prev, pe, None)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
