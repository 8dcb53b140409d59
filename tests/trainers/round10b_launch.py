"""Round 10b: torchtitan's GraphTrainer, unmodified, in the jit path with the inductor backend,
recorded (imports nothing from parity). Round 9c's launcher (tests/trainers/round9c_launch.py:
the CPU shims, ``run_traced`` / the aot_eager compilers / ``forward_backward_step`` wrapped)
plus what jit + inductor and the eager part of the jit path need:

* jit + inductor: ``compile.get_compile_backend_with_passes`` (the name GraphTrainer's
  ``_apply_jit_compile`` calls) is wrapped; when it returns inductor (``compile_fx``), the
  launcher hands dynamo ``compile_fx`` with an ``inner_compile`` that calls inductor's own
  ``compile_fx_inner`` and then runs each compiled forward / backward under round 9c's
  ``Recorder`` (entered inside the compiled region, round 9b's way). torchtitan's bucketing pass
  runs in ``compile_fx_inner`` as inductor's ``post_grad_custom_post_pass`` and rewrites the
  graph in place, so the graph read after it is the one inductor generated code from; the i-th
  collective the code issues is checked to be that graph's i-th collective node (op names);
* ``R10B_EAGER=1``: the functional collectives called from Python outside compilation (jit:
  lm_head under the chunked loss, DTensor ``redistribute``) are recorded by wrapping
  ``torch.distributed._functional_collectives``' entry points (round 9a's way: DTensor calls them
  as module attributes at call time; torch 2.13's placements call ``all_gather_single`` /
  ``reduce_scatter_single``): ``{"step", "graph": "eager", "op", "input", "ranks",
  "reduce_op", "dim", "dtensor": issued under DTensor's redistribute_local_tensor}`` in
  ``TRUTH["eager"]``; calls made while dynamo traces (fake
  tensors) are not collectives that ran and are skipped;
* ``TRUTH["counters"]``: dynamo's counters at the end (frames, graphs, recompiles, inductor's
  own), to compare a recorded run with an unrecorded one.

R9C_RECORD=0 leaves every collective unwrapped (no inner compile of the launcher's, no funcol
wrapper): the run the recorded one must equal. Everything else (R9C_SAVE, R9C_ORDER) is round
9c's; ``R10B_ORDER=reversed`` hands the bucketing pass each transformer block's bucket as the
list of its children in reverse module order (``fsdp_manual_buckets``; still one bucket per
block), a layout-only change for the payload-order pair: GraphTrainer has no switch for it.
``R10B_ORDER=children``: the same lists in module order.

    torchrun --nproc_per_node 2 tests/trainers/round10b_launch.py [torchtitan.train args]
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import round9c_launch as r9c  # noqa: E402

E = os.environ.get
TRUTH = r9c.TRUTH
TRUTH.update(eager=[], counters={})


def inductor_recorded(gm, example_inputs, **kwargs):
    """``compile_fx`` with an inner compile whose compiled graphs run under the recorder."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(g, inputs, **kw):
        compiled = compile_fx_inner(g, inputs, **kw)
        kind = "backward" if kw.get("is_backward") else "forward"
        gid = r9c._new_graph(g, kind)
        nodes = TRUTH["nodes"][gid]
        call = type(compiled).__call__

        def recorded(self, args):
            with r9c.Recorder(kind, gid, nodes):
                return call(self, args)

        compiled.__class__ = type(f"R10b{type(compiled).__name__}", (type(compiled),),
                                  {"__call__": recorded})
        return compiled

    return compile_fx(gm, example_inputs, inner_compile=inner, **kwargs)


# a llama3 block's children in reverse module order: one bucket per block still, its payloads in
# this order (inductor's manual bucketing packs a bucket's nodes in plan order)
BLOCK_CHILDREN = ("ffn_norm", "feed_forward", "attention_norm", "attention")


def wrap_backend_factory(original):
    def get_compile_backend_with_passes(compile_config, buckets, *a, **k):
        if E("R10B_ORDER") in ("reversed", "children") and buckets:
            kids = BLOCK_CHILDREN if E("R10B_ORDER") == "reversed" else BLOCK_CHILDREN[::-1]
            buckets = [[f"{b}.{c}" for c in kids]
                       if isinstance(b, str) and b.startswith("layers.") else b for b in buckets]
        backend = original(compile_config, buckets, *a, **k)
        if r9c.RECORD and compile_config.backend == "inductor":
            return inductor_recorded
        return backend

    return get_compile_backend_with_passes


SIGNATURES = {"all_gather_tensor": ("self", "gather_dim", "group"),
              "all_gather_single": ("self", "gather_dim", "group"),
              "reduce_scatter_tensor": ("self", "reduceOp", "scatter_dim", "group"),
              "reduce_scatter_single": ("self", "reduceOp", "scatter_dim", "group"),
              "all_reduce": ("self", "reduceOp", "group")}


def _ranks(group):
    """Global ranks of a funcol group: a process group, a 1-D mesh or (mesh, mesh dim)."""
    import torch.distributed as dist

    try:
        if isinstance(group, tuple):
            group = group[0].get_group(group[1])
        elif hasattr(group, "get_group"):
            group = group.get_group()
        return dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001
        return None


def _in_redistribute() -> bool:
    """Whether DTensor's ``redistribute_local_tensor`` is on the stack (a placement change,
    what parity's ``dtensor`` lines describe), not a trainer's own funcol call (torchtitan's
    loss / metric all-reduces)."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "redistribute_local_tensor":
            return True
        f = f.f_back
    return False


def wrap_funcol():
    import torch.distributed._functional_collectives as funcol

    busy = {"in": False}
    for name in SIGNATURES:
        fn = getattr(funcol, name, None)
        if fn is None:
            continue

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            x = args[0] if args else kwargs.get("self")
            fake = type(x).__name__ in ("FakeTensor", "FunctionalTensor") or \
                torch.compiler.is_compiling()
            if not busy["in"] and not fake and isinstance(x, torch.Tensor):
                bound = dict(zip(SIGNATURES[_name], args), **kwargs)
                TRUTH["eager"].append({"step": r9c.STATE["step"], "graph": "eager", "op": _name,
                                       "input": r9c._keep(x), "ranks": _ranks(bound["group"]),
                                       "reduce_op": bound.get("reduceOp"),
                                       "dim": bound.get("gather_dim", bound.get("scatter_dim")),
                                       "dtensor": _in_redistribute()})
            busy["in"], was = True, busy["in"]
            try:
                return _fn(*args, **kwargs)
            finally:
                busy["in"] = was

        setattr(funcol, name, wrapper)


def counters():
    from torch._dynamo.utils import counters as c

    return {k: dict(v) for k, v in c.items() if v}


def install():
    """After round 9c's shims (torchtitan picks its device type at import time)."""
    from torchtitan.experiments.graph_trainer import compile as gt_compile

    gt_compile.get_compile_backend_with_passes = wrap_backend_factory(
        gt_compile.get_compile_backend_with_passes)
    if r9c.RECORD and E("R10B_EAGER") == "1":
        wrap_funcol()


def main():
    install_9c = r9c.install
    r9c.install = lambda: (install_9c(), install())
    save = r9c.save

    def save_with_counters():
        TRUTH["counters"] = counters()
        save()

    r9c.save = save_with_counters
    r9c.main()


if __name__ == "__main__":
    main()
