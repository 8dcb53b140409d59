"""Which parameter's gradient an eager DTensor reduction carries (eager_collectives.py).

Why: a layer data parallel by DTensor alone (its parameters ``Replicate`` on a mesh, no FSDP or
DDP) gets its gradients back ``Partial``; they are summed over the ranks by an eager DTensor
redistribution (``Partial -> Replicate``: an all-reduce; ``Partial -> Shard``: a
reduce-scatter), explicitly (``p.grad.redistribute(...)``) or inside an op's dispatch (the
optimizer's ``param.add_(grad)``: DTensor all-reduces the Partial operand first). Such a
tensor is no parameter's local shard, so the source wrote its entry with ``fqn`` null (round
9a, found and left): the diff could not say whose reduction moved, and the reduction-coverage
check could not count that parameter as reduced.

How, chosen so that it never changes the job (no hook of any kind, no extra collective or
synchronisation, no value read: only autograd's running node, ``.grad`` attributes and tensor
metadata; nothing kept alive past the call but weak references and the parameters, which the
model holds anyway):

- in a backward, the redistribution the autograd engine runs because of a ``redistribute``
  in the forward (the running node is ``Redistribute``'s backward: a Shard parameter gathered
  to Replicate in the forward reduce-scatters its Partial gradient here) is named after the
  leaf its gradient flows into: the running node's only next function (through at most two
  single-input nodes, such as a cast) is that parameter's ``AccumulateGrad``, of the same
  global shape (``torch._C._current_autograd_node``: a read);
- otherwise, at the call, while both are alive: a tensor whose memory is exactly that of a
  parameter's current ``.grad`` local tensor (same address, shape, stride, dtype) is that
  gradient or an alias of it (SGD's first step all-reduces inside ``grad.detach().clone()``:
  the detached alias; the trainer's ``p.grad.redistribute(...)``). ``GradMap`` keeps the
  gradients' keys between calls and checks every hit against the parameter's ``.grad`` now
  (a stale key is never trusted); it is rebuilt on a miss only when the tensor has some
  parameter's shape (an activation of another shape costs a set lookup);
- else, at the end of the step (the optimizer's post-hook, where the source resolves its
  names), a weak reference to the call's output still alive that *is* a parameter's
  ``.grad`` local tensor names it (``p.grad = (p.grad * c).redistribute(...)``). Addresses
  are not compared then: a freed Partial gradient's memory is reused within the step.

A Partial tensor that is neither (an activation all-reduced by tensor parallelism, a loss
statistic) stays unnamed, and the shape fallback that names a cast of a parameter (a bf16
all-gather input) is not applied to Partial tensors: a Partial value is a sum still to be
taken, never a copy of a parameter.

Not chosen: a gradient hook (``register_post_accumulate_grad_hook``, a hook on
``AccumulateGrad``) on each parameter: code of parity's in the job's backward, registered on
the trainer's tensors (it must know them before the first backward, and it would see the
gradient, not which collective carried it); comparing the Partial tensor's address with
``.grad`` after the step: by then a replaced gradient is freed and its memory reused by the
next one (a wrong name, where no name is honest).

Left out: a reduction of a temporary derived from a gradient (a copy or a scaled gradient,
not an alias) whose result does not become the ``.grad``: it stays unnamed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["autograd_leaf", "weak", "key", "GradMap", "grad_owners"]

_CHAIN = 3  # nodes followed from the running one to the AccumulateGrad


def autograd_leaf(shape: list) -> Any | None:
    """In a backward, inside ``Redistribute``'s backward: the leaf tensor (a parameter) whose
    ``AccumulateGrad`` the running node feeds alone, of global ``shape``; else None."""
    import torch

    node = torch._C._current_autograd_node()
    if node is None or "Redistribute" not in type(node).__name__:
        return None
    return leaf_fed_by(node, shape, _CHAIN)


def leaf_fed_by(node: Any, shape: list, depth: int) -> Any | None:
    """The leaf tensor whose ``AccumulateGrad`` ``node`` feeds alone, through single links (at
    most ``depth``), when it has global ``shape``; else None."""
    for _ in range(depth):
        if node is None:
            return None
        nxt = [f for f, _ in node.next_functions if f is not None]
        if len(nxt) != 1:
            return None
        node = nxt[0]
        var = getattr(node, "variable", None)  # AccumulateGrad's leaf
        if var is not None:
            return var if list(var.shape) == list(shape) else None
    return None


def key(t: Any) -> tuple:
    """What identifies a tensor's memory: its address, shape, stride and dtype (a detached
    alias of a gradient has the gradient's), else (no storage: a subclass, fake) the object."""
    try:
        ptr = t.data_ptr()
    except Exception:  # noqa: BLE001 - no storage (a subclass, fake)
        ptr = 0
    if ptr:
        return ("mem", ptr, tuple(t.shape), tuple(t.stride()), str(t.dtype))
    return ("id", id(t))


def weak(t: Any) -> Any | None:
    try:
        return weakref.ref(t)
    except TypeError:
        return None


class GradMap:
    """The parameters' ``.grad`` local tensors by memory key, kept between calls, every hit
    checked against the parameter's ``.grad`` at the call (the map may be stale: a hit is
    trusted only when the gradient has that memory now)."""

    def __init__(self, local: Callable[[Any], Any] | None = None):
        # a gradient's tensor whose memory is matched: a DTensor's local shard (the default),
        # or for plain gradients the tensor itself (eager_funcol.py passes ``plain_or_local``)
        self.local = local or _local
        self.params: list[tuple[str, Any]] = []
        self.shapes: set[tuple] = set()
        self.grads: dict[tuple, tuple[str, Any]] = {}

    def set_params(self, params: list[tuple[str, Any]]) -> None:
        self.params = params
        self.shapes = {tuple(p.shape) for _, p in params}
        self.grads = {}

    def _rebuild(self) -> None:
        self.grads = {}
        for fqn, p in self.params:
            g = self.local(getattr(p, "grad", None))
            if g is not None:
                self.grads.setdefault(key(g), (fqn, p))

    def _hit(self, k: tuple) -> str | None:
        got = self.grads.get(k)
        if got is None:
            return None
        g = self.local(getattr(got[1], "grad", None))
        return got[0] if g is not None and key(g) == k else None

    def find(self, t: Any, shape: list) -> str | None:
        """The FQN of the parameter whose current ``.grad`` has ``t``'s memory, else None."""
        k = key(t)
        if k[0] != "mem" or not self.params:
            return None
        fqn = self._hit(k)
        if fqn is None and tuple(shape) in self.shapes:
            self._rebuild()
            fqn = self._hit(k)
        return fqn


def _local(t: Any) -> Any:
    return getattr(t, "_local_tensor", None)


def plain_or_local(t: Any) -> Any:
    """A DTensor's local shard, else the tensor itself (None stays None)."""
    return getattr(t, "_local_tensor", t)


def grad_owners(params: list[tuple[str, Any]]) -> dict[int, str]:
    """id(local tensor) -> the FQN of the parameter whose ``.grad`` (a DTensor) it is. Read at
    the end of the step, compared by identity with tensors still alive (never by address)."""
    out: dict[int, str] = {}
    for fqn, p in params:
        g = _local(getattr(p, "grad", None))
        if g is not None:
            out.setdefault(id(g), fqn)
    return out
