"""The capture session inside one rank: hooks, step counting, hashing, manifests, metadata.

One :class:`Session` per process (the hooks are global). It is started either by injection
(``parity exec``: inject.py calls :func:`activate_from_env` right after ``import torch``) or by
the API (``parity.capture.start``); both take the same path from there.

What happens when (docs/capture.md has the full story):

* global optimizer step pre-hook of the outermost ``step()``: a new training step k begins; on
  the first one the parameter table is built (the parameters of every optimizer that steps
  within it, named from the model) and the parameters are hashed as step 0; on a recorded step
  the gradients it is about to consume are hashed.
* global optimizer step post-hook, when the outermost ``step()`` returns: the parameters are
  hashed and step k is written (with its gradients and the last loss).
* ``Tensor.backward`` / ``torch.autograd.backward``: remember the last scalar (the loss).
* FSDP2 collectives (fsdp2.py) and compiled graphs (graph.py, if present): bucket layouts.

Everything fails soft: an exception inside capture prints ``parity: capture disabled: <reason>``
once, removes the hooks and lets training go on.
"""

from __future__ import annotations

import atexit
import collections
import functools
import gc
import json
import os
import socket
import sys
import threading
import time
import traceback
import weakref

import torch

from parity import __version__
from parity.artifacts import RankWriter
from parity.rundir import rank_dir
from parity.capture import env as cenv
from parity.capture import gpu_facts, post_import
from parity.capture.env import one_line as _one_line, say as _say
from parity.capture.records import dtype_name
from parity.capture.names import WRAPPER_COMPONENTS, normalize_fqn  # noqa: F401 (re-exported)
from parity.capture.hashing import (HASHERS, device_backend, digest_tensors, host_digest,
                                    local_tensor)
from parity.errors import ParityError

__all__ = ["Session", "normalize_fqn", "activate_from_env", "current", "sampled"]



def sampled(step: int, every: int) -> bool:
    """Steps recorded as they happen: 0, 1 and every multiple of ``every`` (plus the last, at
    the end of the run)."""
    return step <= 1 or step % every == 0


# ------------------------------------------------------------------------------ small helpers



def _placement_str(p) -> str:
    name = type(p).__name__
    if name == "Shard":
        return f"Shard({p.dim})"
    if name == "_StridedShard":
        return f"_StridedShard({p.dim}, sf={getattr(p, 'split_factor', '?')})"
    if name == "Replicate":
        return "Replicate()"
    if name in ("Partial", "_Partial"):
        return f"Partial({getattr(p, 'reduce_op', '')})"
    return repr(p)


def _is_dtensor(t) -> bool:
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "_local_tensor")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _module_roots() -> list[torch.nn.Module]:
    """Every live nn.Module that is nobody's child (a gc scan: used once, as a fallback)."""
    module_type = torch.nn.Module
    # type(), not isinstance(): the latter reads __class__, which weak proxies and deprecated
    # module attributes turn into errors or warnings.
    mods = [o for o in gc.get_objects() if issubclass(type(o), module_type)]
    children = set()
    for m in mods:
        for c in m._modules.values():
            if c is not None:
                children.add(id(c))
    return [m for m in mods if id(m) not in children]


class _Buffer:
    """A persistent buffer in the table, looked up on its module at each hash: a module may
    replace a buffer tensor (``self.running_mean = ...``), so a kept reference could go stale."""

    __slots__ = ("module", "name")
    grad = None  # buffers have no gradient: NO_HASH in every grad line

    def __init__(self, module: torch.nn.Module, name: str):
        self.module, self.name = module, name

    def tensor(self):
        return self.module._buffers.get(self.name)


def _persistent_buffers(roots) -> list[tuple[str, torch.nn.Module, str, torch.Tensor]]:
    """(fqn, owning module, attribute name, tensor) of every persistent buffer under ``roots``
    (what ``state_dict`` saves: BatchNorm running statistics, step counters)."""
    out, seen = [], set()
    for root in roots:
        for prefix, mod in root.named_modules():
            skip = getattr(mod, "_non_persistent_buffers_set", ())
            for name, buf in mod._buffers.items():
                if buf is None or name in skip or id(buf) in seen:
                    continue
                seen.add(id(buf))
                out.append((f"{prefix}.{name}" if prefix else name, mod, name, buf))
    return out


_ACTIVE: "Session | None" = None
_LOCK = threading.RLock()


def current() -> "Session | None":
    """The session capturing in this process, if any."""
    return _ACTIVE


# ---------------------------------------------------------------------------- global patches
# Installed once per process and left in place (cheap pass-throughs when no session is active),
# so that a later user patch on top of ours is never undone by restoring an old function.
_ORIG: dict[str, object] = {}


def _tracing() -> bool:
    """True inside a trace (dynamo, make_fx/export, fake tensors): capture runs no code there.

    ``torch.compiler.is_compiling()`` covers dynamo only; GraphTrainer traces its training step
    (backward included) with make_fx, where tensors are fake and a ``.item()`` would fail."""
    if torch.compiler.is_compiling():
        return True
    try:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        if get_proxy_mode() is not None:
            return True
    except Exception:  # noqa: BLE001 - older torch: no proxy mode query
        pass
    try:
        from torch._guards import detect_fake_mode

        return detect_fake_mode() is not None
    except Exception:  # noqa: BLE001
        return False


def _note_loss(t) -> None:
    s = _ACTIVE
    if s is None or s.failed:
        return
    s.backwards += 1
    try:
        if isinstance(t, (list, tuple)):
            t = t[0] if len(t) == 1 else None
        if isinstance(t, torch.Tensor) and t.numel() == 1:
            s.loss_ref = t.detach()
    except Exception:  # noqa: BLE001 - never get in the way of backward
        pass


def _install_global_patches() -> None:
    if _ORIG:
        return
    orig_tensor_backward = torch.Tensor.backward
    orig_autograd_backward = torch.autograd.backward

    # Only the outermost call counts: Tensor.backward calls torch.autograd.backward, and a
    # reentrant activation checkpoint calls it again from inside the backward pass (possibly
    # on an autograd device thread), with tensors that are not the loss.
    depth = [0]

    def backward(self, *args, **kwargs):
        if depth[0] or _tracing():
            return orig_tensor_backward(self, *args, **kwargs)
        _note_loss(self)
        depth[0] += 1
        try:
            return orig_tensor_backward(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    def autograd_backward(tensors, *args, **kwargs):
        if depth[0] or _tracing():
            return orig_autograd_backward(tensors, *args, **kwargs)
        _note_loss(tensors)
        depth[0] += 1
        try:
            return orig_autograd_backward(tensors, *args, **kwargs)
        finally:
            depth[0] -= 1

    for new, old in ((backward, orig_tensor_backward), (autograd_backward, orig_autograd_backward)):
        new.__wrapped__ = old
        new.__name__ = old.__name__
        new.__qualname__ = old.__qualname__
        new.__doc__ = old.__doc__
    _ORIG["Tensor.backward"] = orig_tensor_backward
    _ORIG["autograd.backward"] = orig_autograd_backward
    torch.Tensor.backward = backward
    torch.autograd.backward = autograd_backward

    import torch.distributed as dist

    if dist.is_available() and hasattr(dist, "destroy_process_group"):
        orig_destroy = dist.destroy_process_group

        def destroy_process_group(*args, **kwargs):
            s = _ACTIVE
            if s is not None:
                s.flush_final()  # results on disk before the process group goes away
            return orig_destroy(*args, **kwargs)

        destroy_process_group.__wrapped__ = orig_destroy
        destroy_process_group.__name__ = orig_destroy.__name__
        destroy_process_group.__doc__ = orig_destroy.__doc__
        _ORIG["destroy_process_group"] = orig_destroy
        dist.destroy_process_group = destroy_process_group

    orig_compile = torch.compile

    def compile(*args, **kwargs):
        s = _ACTIVE
        if s is not None:
            # No global module hook of ours may be traced into a compiled model: dynamo would
            # guard on it and recompile once it is gone (and warns about global hooks).
            target = args[0] if args else kwargs.get("model")
            if isinstance(target, torch.nn.Module) or isinstance(
                    getattr(target, "__self__", None), torch.nn.Module):
                s._forget_forward_hook()
            if s.manifests:
                s._install_graph()
        return orig_compile(*args, **kwargs)

    functools.update_wrapper(compile, orig_compile)
    _ORIG["compile"] = orig_compile
    torch.compile = compile

    orig_excepthook = sys.excepthook

    def excepthook(tp, value, tb):
        s = _ACTIVE
        if s is not None:
            s.error = _one_line(value) if value is not None else tp.__name__
        return orig_excepthook(tp, value, tb)

    _ORIG["excepthook"] = orig_excepthook
    sys.excepthook = excepthook


# ------------------------------------------------------------------------------------ session
class Session:
    """Capture in this process, writing ``out_dir/rank-NNNNN/`` (docs/artifacts.md)."""

    def __init__(self, out_dir, *, every: int = 1, grads: bool = True, manifests: bool = True,
                 hasher: str = "auto", rank: int | None = None, world_size: int | None = None,
                 local_rank: int | None = None, lazy: bool = False, source: str = "api"):
        if not isinstance(every, int) or every < 1:
            raise ParityError(f"capture: every must be an integer >= 1, got {every!r}")
        if hasher not in HASHERS:
            raise ParityError(f"capture: hasher must be one of {', '.join(HASHERS)}, "
                              f"got {hasher!r}")
        self.out_dir = os.path.abspath(os.fspath(out_dir))
        self.every = every
        self.grads = bool(grads)
        self.manifests = bool(manifests)
        self.hasher = hasher
        self._rank_arg = (rank, world_size, local_rank)
        self.lazy = lazy
        self.source = source
        self.pid = os.getpid()

        self.writer: RankWriter | None = None
        self.failed: str | None = None
        self.error: str | None = None
        self.started = False
        self.stopped = False
        self.warnings: list[str] = []
        self._pending_buckets: list[dict] = []
        self._handles: list = []
        self._fwd_handle = None
        self._root_ref = None
        self._fsdp = None
        self._graph = None
        self._graph_tried = False
        self._makefx = None
        self._eager = None
        self._fsdp_tried = False
        self._manifest_sources: list[str] = []  # sources hooked so far
        self._lock = threading.RLock()

        # step state
        self.k = 0  # number of the step in progress or last finished
        self.done = 0  # last finished step
        self.depth = 0
        self._outer = None  # weakref to the optimizer at depth 1
        self.open = False  # the finished step k may still be continued by a sibling optimizer
        self.step_opts: set[int] = set()
        self.backwards = 0  # backward calls since the last finished step
        self.loss_ref = None
        self._step_loss = None
        self._step_sampled = True
        self._step_grads: bytes | None = None
        self.written = -1  # last step written
        # parameter table
        self.table: list = []
        self._table_ids: dict[int, int] = {}
        self.entries: list[dict] = []
        self._table_final = False
        self._table_dirty = False
        self._p0: list[bytes] = []
        self._g1: list[bytes] = []
        self._buffers_added = False
        self._name_roots: list = []  # the module roots the parameter names came from
        self._opt_sigs: dict[int, tuple] = {}  # id(optimizer) -> param_groups signature
        self._step_base = 0  # steps recorded by earlier torchelastic attempts of this rank
        self._resolved_hasher: str | None = None
        # overhead accounting
        self.capture_seconds = 0.0
        self.recorded_steps = 0

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> "Session":
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not None and _ACTIVE is not self:
                raise ParityError("capture: a session is already active in this process "
                                  f"(writing {_ACTIVE.out_dir})")
            if self.started:
                return self
            _install_global_patches()
            self.started = True
            _ACTIVE = self
        try:
            from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                               register_optimizer_step_pre_hook)

            self._handles.append(register_optimizer_step_pre_hook(self._pre_hook))
            self._handles.append(register_optimizer_step_post_hook(self._post_hook))
            self._fwd_handle = torch.nn.modules.module.register_module_forward_pre_hook(
                self._forward_pre_hook)
            if self.manifests:
                from parity.capture import fsdp2

                post_import.when_imported(fsdp2.GROUP_MODULE, self._install_fsdp2)
                from parity.capture import graph_makefx

                post_import.when_imported(graph_makefx.TRAINER_MODULE, self._install_makefx)
                from parity.capture import eager_collectives

                post_import.when_imported(eager_collectives.MODULES[0], self._install_eager)
                # Compiled-graph manifests are hooked when the trainer first calls torch.compile
                # (see _install_global_patches); earlier, aot_autograd may be half-imported.
            if not self.lazy:
                self._ensure_writer()
            atexit.register(self._atexit)
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        return self

    def stop(self, status: str | None = None, error: str | None = None) -> None:
        """Write what is pending, close the files and remove every hook. Idempotent."""
        global _ACTIVE
        with self._lock:
            if self.stopped:
                return
            if not self.failed:
                try:
                    self.flush_final()
                except Exception as e:  # noqa: BLE001
                    self._fail(e)
            self.stopped = True
            self._uninstall()
            try:
                atexit.unregister(self._atexit)
            except Exception:  # noqa: BLE001
                pass
            if error is None:
                error = self.error
            if status is None:
                status = "error" if error else "ok"
            if self.writer is not None:
                try:
                    self.writer.meta["capture"] = self._capture_meta()
                    self.writer.close(status=status, error=error)
                except Exception as e:  # noqa: BLE001
                    _say(f"capture: cannot finish {rank_dir(self.out_dir, self.rank)}: "
                         f"{_one_line(e)}")
        with _LOCK:
            if _ACTIVE is self:
                _ACTIVE = None

    def _atexit(self) -> None:
        if os.getpid() != self.pid:  # a forked child inherited the registration
            return
        self.stop()

    def _uninstall(self) -> None:
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._handles.clear()
        self._remove_forward_hook()
        if self._fsdp is not None:
            self._fsdp.uninstall()
        if self._makefx is not None:
            self._makefx.uninstall()
            self._makefx = None
        if self._eager is not None:
            self._eager.uninstall()
            self._eager = None
        if self._graph is not None:
            try:
                self._graph.uninstall()
            except Exception:  # noqa: BLE001
                pass
            self._graph = None
        try:
            from parity.capture import fsdp2

            post_import.cancel(fsdp2.GROUP_MODULE)
        except Exception:  # noqa: BLE001
            pass

    def _fail(self, e: BaseException) -> None:
        """Capture broke: say so once, unhook, keep training."""
        if self.failed:
            return
        self.failed = _one_line(e)
        _say(f"capture disabled: {self.failed}")
        if os.environ.get("PARITY_DEBUG"):
            traceback.print_exception(type(e), e, e.__traceback__)
        self._uninstall()
        if self.writer is not None:
            try:
                self.writer.update_meta(capture=self._capture_meta())
            except Exception:  # noqa: BLE001
                pass

    def warn(self, msg: str, *, echo: bool = True) -> None:
        """A warning recorded in meta.json (``capture.warnings``) and printed once."""
        if msg in self.warnings:
            return
        self.warnings.append(msg)
        if echo:
            _say(msg)
        if self.writer is not None:
            try:
                self.writer.update_meta(capture=self._capture_meta())
            except Exception as e:  # noqa: BLE001
                self._fail(e)

    # ----------------------------------------------------------------------------- metadata
    @property
    def rank(self) -> int:
        return self._ids()[0]

    def _ids(self) -> tuple[int, int, int]:
        rank, world, local = self._rank_arg
        if rank is None or world is None:
            try:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    rank = dist.get_rank() if rank is None else rank
                    world = dist.get_world_size() if world is None else world
            except Exception:  # noqa: BLE001
                pass
        rank = _env_int("RANK", 0) if rank is None else rank
        world = _env_int("WORLD_SIZE", 1) if world is None else world
        local = _env_int("LOCAL_RANK", rank if world == 1 else 0) if local is None else local
        return rank, world, local

    def _capture_meta(self) -> dict:
        return {"every": self.every, "grads": self.grads, "manifests": list(self._manifest_sources),
                "manifests_requested": self.manifests,
                "hasher": self._resolved_hasher or self.hasher, "hasher_option": self.hasher,
                "device_digest": device_backend() if self._resolved_hasher == "device" else None,
                "source": self.source, "warnings": list(self.warnings), "disabled": self.failed,
                "recorded_steps": self.recorded_steps, "steps": self.done,
                "seconds": round(self.capture_seconds
                                 + (self._fsdp.seconds if self._fsdp is not None else 0.0), 6)}

    def _runtime_meta(self) -> dict:
        """What the trainer has configured by its first step (threads, determinism, device)."""
        dev = "cpu"
        if self.table and type(self.table[0]) is not _Buffer:
            d = local_tensor(self.table[0]).device
            dev = str(d)
        elif torch.cuda.is_available():
            dev = f"cuda:{self._ids()[2]}"
        det = {"use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
               "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
               "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
               "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
               "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
               "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
               "float32_matmul_precision": torch.get_float32_matmul_precision()}
        env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                          "CUBLAS_WORKSPACE_CONFIG", "TORCHELASTIC_RESTART_COUNT",
                                          "PYTHONHASHSEED")
               if k in os.environ}
        return {"device": dev, "deterministic": det["use_deterministic_algorithms"],
                "determinism": det, "num_threads": torch.get_num_threads(),
                "interop_threads": torch.get_num_interop_threads(), "env": env,
                "gpu": gpu_facts.collect(dev) if dev.startswith("cuda") else None}

    def _ensure_writer(self) -> RankWriter:
        if self.writer is not None:
            return self.writer
        rank, world, local = self._ids()
        self._rank_arg = (rank, world, local)
        d = rank_dir(self.out_dir, rank)
        restart = self._elastic_restart(d)
        if restart is None:
            # A new session starts this rank's record: drop what an earlier run left here.
            for name in ("meta.json", "params.json", "steps.jsonl", "hashes.jsonl",
                         "buckets.jsonl"):
                try:
                    os.unlink(d / name)
                except FileNotFoundError:
                    pass
        meta = {"world_size": world, "local_rank": local, "host": socket.gethostname(),
                "pid": os.getpid(), "argv": list(sys.argv), "torch": torch.__version__,
                "parity": __version__, "device": "cuda" if torch.cuda.is_available() else "cpu",
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "num_threads": None, "interop_threads": None,
                "capture": self._capture_meta()}
        if restart is not None:
            meta["restarts"] = restart
        self.writer = RankWriter(self.out_dir, rank, meta)
        if restart is not None:
            r = restart[-1]
            self.warn(f"torchelastic restart {r['attempt']}: this rank's earlier attempts are "
                      f"kept; steps continue after step {r['after_step']}")
        os.environ[cenv.ENV_ACTIVE] = str(os.getpid())
        pending, self._pending_buckets = self._pending_buckets, []
        for b in pending:
            self.writer.write_bucket(b)
        return self.writer

    def _elastic_restart(self, d) -> list[dict] | None:
        """A worker restarted by torchelastic (``--max-restarts``) continues its rank's record:
        the earlier attempts' steps are kept, this attempt's step k is written as step
        ``last + k``, and meta.json lists the restarts. None: not a restart (start afresh)."""
        attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
        if attempt <= 0 or self.source != "exec" or not (d / "steps.jsonl").exists():
            return None
        last = -1
        with open(d / "steps.jsonl", "rb") as f:
            data = f.read()
        for line in data.split(b"\n"):
            try:
                last = max(last, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
        for name in ("steps.jsonl", "hashes.jsonl"):  # a killed attempt may end mid-line
            p = d / name
            if p.exists() and p.stat().st_size and not p.read_bytes().endswith(b"\n"):
                with open(p, "ab") as f:
                    f.write(b"\n")
        try:
            old = json.loads((d / "meta.json").read_text()).get("restarts") or []
        except (OSError, ValueError, AttributeError):
            old = []
        self._step_base = max(last, 0)
        return [*old, {"attempt": attempt, "after_step": self._step_base, "time": time.time()}]

    # ------------------------------------------------------------------------- manifests
    def _install_fsdp2(self, _module=None) -> None:
        if self._fsdp is not None or self._fsdp_tried or self.failed or self.stopped:
            return
        from parity.capture import fsdp2

        mod = sys.modules.get(fsdp2.GROUP_MODULE)
        if mod is None or not post_import._module_ready(mod):
            return  # half-imported: the first forward tries again
        self._fsdp_tried = True

        rec = fsdp2.FSDP2Recorder(emit=self._emit_bucket, step=lambda: self.done + 1,
                                  normalize=normalize_fqn, warn=self._manifest_warn("fsdp2"),
                                  fail=self._fail)
        if rec.install():
            self._fsdp = rec
            self._source_on("fsdp2")

    def _source_on(self, source: str) -> None:
        if source not in self._manifest_sources:
            self._manifest_sources.append(source)
            if self.writer is not None:
                self.writer.update_meta(capture=self._capture_meta())

    def _manifest_warn(self, source: str):
        def warn(msg: str, echo: bool = True) -> None:
            if source in self._manifest_sources:
                self._manifest_sources.remove(source)
            self.warn(msg, echo=echo)
        return warn

    def _install_graph(self, _module=None) -> None:
        if self._graph is not None or self._graph_tried or self.failed or self.stopped:
            return
        self._graph_tried = True
        warn = self._manifest_warn("graph")
        from parity.capture import graph

        try:
            reason = graph.install(self._on_graph, warn=self.warn)
        except Exception as e:  # noqa: BLE001
            warn(f"compiled manifests unavailable: graph.install failed ({_one_line(e)})")
            return
        if reason:  # graph.py has printed it already
            warn(f"compiled manifests unavailable: {reason}", echo=False)
            return
        self._graph = graph
        self._source_on("graph")

    def _install_makefx(self, _module=None) -> None:
        if self._makefx is not None or self.failed or self.stopped:
            return
        from parity.capture import graph_makefx

        warn = self._manifest_warn("graph")
        reason = graph_makefx.install(self._on_graph, self._note_traced_loss, warn)
        if reason:
            warn(f"compiled manifests unavailable: {reason}")
            return
        self._makefx = graph_makefx
        self._source_on("graph")

    def _install_eager(self, _module=None) -> None:
        if self._eager is not None or self.failed or self.stopped:
            return
        from parity.capture.eager_collectives import EagerCollectives

        rec = EagerCollectives(self._emit_bucket, lambda: self.done, _module_roots, _tracing,
                               normalize_fqn)
        reason = rec.install()
        if reason:
            self._manifest_warn("dtensor")(f"eager collectives unavailable: {reason}")
            return
        self._eager = rec
        self._source_on("dtensor")

    def _note_traced_loss(self, t) -> None:
        """The loss a traced step returned (its backward ran inside the graph)."""
        if isinstance(t, torch.Tensor) and t.numel() == 1:
            self.backwards += 1
            self.loss_ref = t.detach()

    def _on_graph(self, record: dict) -> None:
        if self.failed or self.stopped:
            return
        try:
            with self._lock:
                for w in record.get("warnings") or ():
                    self.warn(f"graph {record.get('graph_id')}: {w}")
                for b in record.get("buckets") or ():
                    b = dict(b)
                    b.setdefault("source", "graph")
                    b.setdefault("graph", record.get("graph"))
                    b.setdefault("graph_id", record.get("graph_id"))
                    b["step"] = self.done + 1
                    b["entries"] = [dict(e, fqn=normalize_fqn(e["fqn"]))
                                    if isinstance(e.get("fqn"), str) else e
                                    for e in b.get("entries") or ()]
                    self._emit_bucket(b)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _emit_bucket(self, bucket: dict) -> None:
        if os.getpid() != self.pid:  # a forked child (data-loader worker) inherited the hooks
            return
        with self._lock:
            if self.writer is None:
                if self.lazy:
                    self._pending_buckets.append(bucket)
                    return
                self._ensure_writer()
            self.writer.write_bucket(bucket)

    # ------------------------------------------------------------------------ module names
    def _forward_pre_hook(self, module, args):
        # Runs on the first module call of the program (normally the model, outside any compiled
        # region) and removes itself: a lingering global hook makes dynamo recompile. Inside a
        # trace it does nothing (and records nothing); torch.compile and the first optimizer
        # step remove it if it is still there.
        if _tracing():
            return None
        try:
            self._root_ref = weakref.ref(module)
            self._remove_forward_hook()
            if self.manifests and self._fsdp is None:
                from parity.capture import fsdp2

                if fsdp2.GROUP_MODULE in sys.modules:
                    self._install_fsdp2()
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        return None

    def _forget_forward_hook(self) -> None:
        """Remove the forward pre-hook before it can be traced (names then come from the gc
        scan of root modules, see _names), doing first what it would have done."""
        if self._fwd_handle is None:
            return
        self._remove_forward_hook()
        try:
            if self.manifests and self._fsdp is None:
                from parity.capture import fsdp2

                if fsdp2.GROUP_MODULE in sys.modules:
                    self._install_fsdp2()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _remove_forward_hook(self) -> None:
        h, self._fwd_handle = self._fwd_handle, None
        if h is not None:
            h.remove()

    def _names(self, params: list) -> dict[int, str]:
        """Raw FQNs of ``params``, from the module tree that holds them.

        Fast path: the first module called (normally the model) holds them all. Otherwise
        (the first call was a helper, or several models) every live root module is a
        candidate, and each parameter takes its name from the root holding the most of them.
        """
        want = {id(p) for p in params}

        def scan(root) -> dict[int, str]:
            found: dict[int, str] = {}
            for n, p in root.named_parameters():
                if id(p) in want:
                    found.setdefault(id(p), n)
            return found

        first = self._root_ref() if self._root_ref is not None else None
        if first is not None:
            names = scan(first)
            if len(names) == len(want):
                if first not in self._name_roots:
                    self._name_roots.append(first)
                return names
        candidates = ([first] if first is not None else []) + [
            r for r in _module_roots() if r is not first]
        scans = [scan(r) for r in candidates]
        names: dict[int, str] = {}
        for found, root in sorted(zip(scans, candidates), key=lambda x: len(x[0]),
                                  reverse=True):  # stable: the first root wins ties
            if found and not any(root is r for r in self._name_roots):
                self._name_roots.append(root)
            for k, v in found.items():
                names.setdefault(k, v)
            if len(names) == len(want):
                break
        return names

    # -------------------------------------------------------------------------- step hooks
    def _pre_hook(self, opt, args, kwargs):
        if self.failed or self.stopped or os.getpid() != self.pid:
            return None
        t0 = time.perf_counter()
        try:
            with self._lock:
                outer = self._outer() if self._outer is not None else None
                if self.depth >= 1 and opt is outer:
                    self.depth = 0  # the previous step() of this optimizer raised midway
                self.depth += 1
                if self.depth == 1:
                    self._outer = weakref.ref(opt)
                    continuing = (self.open and self.backwards == 0
                                  and id(opt) not in self.step_opts)
                    if not continuing:
                        self._begin_step()
                    self.step_opts.add(id(opt))
                if not self._table_final:
                    self._forget_forward_hook()  # still there only if every forward was traced
                    self._add_params(opt)
                else:
                    self._check_params(opt)
                if self.depth == 1:
                    wrapped = self._wrap_closure(args, kwargs)
                    if wrapped is not None:
                        self.capture_seconds += time.perf_counter() - t0
                        return wrapped
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        self.capture_seconds += time.perf_counter() - t0
        return None

    def _wrap_closure(self, args, kwargs):
        """``opt.step(closure)`` (LBFGS and the like) computes the step's loss and gradients
        inside ``step``: the pre-hook saw the previous step's. The closure is wrapped so that
        its first call records them (what this step consumed); its result is untouched."""
        if "closure" in kwargs:
            closure = kwargs["closure"]
        elif len(args) > 1:  # args[0] is the optimizer
            closure = args[1]
        else:
            return None
        if not callable(closure):
            return None
        step = self.k
        first = [True]

        def closure_recorded(*a, **kw):
            out = closure(*a, **kw)
            if first[0]:
                first[0] = False
                self._closure_done(step, out)
            return out

        functools.update_wrapper(closure_recorded, closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_recorded}
        return (args[0], closure_recorded, *args[2:]), kwargs

    def _closure_done(self, step: int, out) -> None:
        if self.failed or self.stopped or os.getpid() != self.pid:
            return
        t0 = time.perf_counter()
        try:
            with self._lock:
                if step != self.k:
                    return
                if isinstance(out, torch.Tensor) and out.numel() == 1:
                    self._step_loss = out.detach()
                elif self.loss_ref is not None:
                    self._step_loss = self.loss_ref
                if self.grads and not self._table_final:  # step 1: the table is being built
                    self._g1 = [digest_tensors([p.grad for p in self.table], self.hasher)]
                elif self.grads and self._step_sampled:
                    self._step_grads = digest_tensors([p.grad for p in self.table], self.hasher)
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        self.capture_seconds += time.perf_counter() - t0

    def _post_hook(self, opt, args, kwargs):
        if self.failed or self.stopped or os.getpid() != self.pid:
            return
        t0 = time.perf_counter()
        try:
            with self._lock:
                if self.depth == 0:
                    return
                self.depth -= 1
                if self.depth == 0:
                    self.done = self.k
                    self.open = True
                    self.backwards = 0
                    if self._fsdp is not None:
                        self._fsdp.new_step()
                    if self._eager is not None:
                        self._eager.new_step()
                    if self.k == 1:
                        self._write_first()
                    elif self._step_sampled:
                        self._write(self.k, self._step_grads)
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        self.capture_seconds += time.perf_counter() - t0

    def _begin_step(self) -> None:
        if self.k >= 1 and not self._table_final:
            self._table_final = True
        self.k += 1
        self.open = False
        self.step_opts = set()
        self._step_sampled = sampled(self.k, self.every)
        self._step_loss = self.loss_ref
        self._step_grads = None
        if self._table_final and self._step_sampled and self.grads:
            self._step_grads = digest_tensors([p.grad for p in self.table], self.hasher)

    def _tensors(self) -> list:
        """What the table's rows hold now (parameters, and buffers looked up on their module)."""
        return [p.tensor() if type(p) is _Buffer else p for p in self.table]

    def _add_params(self, opt) -> None:
        """First step: extend the table with this optimizer's parameters (hashed as step 0)."""
        new = []
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in self._table_ids:
                    self._table_ids[id(p)] = -1
                    new.append(p)
        if not new:
            return
        self._ensure_writer()
        names = self._names(new)
        for p in new:
            raw = names.get(id(p))
            i = len(self.table)
            self._table_ids[id(p)] = i
            self.table.append(p)
            lt = local_tensor(p)
            entry = {"fqn": normalize_fqn(raw) if raw else f"<unnamed {i}>", "raw_fqn": raw,
                     "shape": list(lt.shape), "global_shape": list(p.shape),
                     "dtype": dtype_name(lt.dtype), "placement": None, "mesh_coord": None}
            if _is_dtensor(p):
                entry["placement"] = ", ".join(_placement_str(pl) for pl in p.placements)
                coord = p.device_mesh.get_coordinate()
                entry["mesh_coord"] = list(coord) if coord is not None else None
            self.entries.append(entry)
        self._p0.append(digest_tensors(new, self.hasher))
        if self.grads:
            self._g1.append(digest_tensors([p.grad for p in new], self.hasher))
        self._table_dirty = True
        if not self._buffers_added:
            self._buffers_added = True
            self._add_buffers()

    def _add_buffers(self) -> None:
        """Persistent buffers of the modules that hold the parameters join the table after the
        first optimizer's parameters, hashed in the same digest calls (no gradient)."""
        bufs = []
        for fqn, mod, name, t in _persistent_buffers(self._name_roots):
            i = len(self.table)
            self._table_ids[id(t)] = i
            self.table.append(_Buffer(mod, name))
            lt = local_tensor(t)
            self.entries.append({"fqn": normalize_fqn(fqn), "raw_fqn": fqn, "kind": "buffer",
                                 "shape": list(lt.shape), "global_shape": list(t.shape),
                                 "dtype": dtype_name(lt.dtype), "placement": None,
                                 "mesh_coord": None})
            bufs.append(t)
        if bufs:
            self._p0.append(digest_tensors(bufs, self.hasher))
            if self.grads:
                self._g1.append(digest_tensors([None] * len(bufs), self.hasher))

    def _check_params(self, opt) -> None:
        """After step 1: parameters that joined an optimizer (``add_param_group``, an optimizer
        that steps for the first time) join the table from this step on. The per-step cost is a
        signature of the param groups; the parameters are walked only when it changes."""
        sig = tuple((id(g["params"]), len(g["params"])) for g in opt.param_groups)
        if self._opt_sigs.get(id(opt)) == sig:
            return
        self._opt_sigs[id(opt)] = sig
        new = [p for g in opt.param_groups for p in g["params"] if id(p) not in self._table_ids]
        if not new:
            return
        names = self._names(new)
        for p in new:
            raw = names.get(id(p))
            i = len(self.table)
            self._table_ids[id(p)] = i
            self.table.append(p)
            lt = local_tensor(p)
            self.entries.append({"fqn": normalize_fqn(raw) if raw else f"<unnamed {i}>",
                                 "raw_fqn": raw, "shape": list(lt.shape),
                                 "global_shape": list(p.shape), "dtype": dtype_name(lt.dtype),
                                 "placement": None, "mesh_coord": None,
                                 "since": self._step_base + self.k})
        if self._step_grads is not None:  # this step's gradients, in table order
            self._step_grads += digest_tensors([p.grad for p in new], self.hasher)
        self._ensure_writer().write_params(self.entries)
        shown = ", ".join(e["fqn"] for e in self.entries[-len(new):][:3])
        self.warn(f"{len(new)} parameter(s) joined the optimizers at step "
                  f"{self._step_base + self.k} and are hashed from then on ({shown}"
                  f"{', ...' if len(new) > 3 else ''})")

    # ----------------------------------------------------------------------------- writing
    def _loss(self, ref) -> tuple[float | None, str | None]:
        if ref is None:
            return None, None
        lt = local_tensor(ref)
        return float(lt.item()), host_digest(lt).hex()

    def _write_first(self) -> None:
        w = self._ensure_writer()
        if self._table_dirty:
            counts = collections.Counter(e["fqn"] for e in self.entries)
            dupes = {f for f, c in counts.items() if c > 1}
            if dupes:
                self.warn(f"parameter names are not unique after normalization: "
                          f"{', '.join(sorted(dupes)[:5])}")
            if self._resolved_hasher is None:
                devs = {local_tensor(p).device.type for p in self._tensors() if p is not None}
                self._resolved_hasher = ("device" if self.hasher == "device"
                                         or (self.hasher == "auto" and "cuda" in devs) else "xxh3")
            w.meta.update(self._runtime_meta())
            w.meta["capture"] = self._capture_meta()
            w.update_meta()
            w.write_params(self.entries)
            if not self._step_base:  # a restarted attempt continues its rank's steps
                w.write_step(0, b"".join(self._p0))
            self._table_dirty = False
        self._write(1, b"".join(self._g1) if self.grads else None)

    def _write(self, step: int, grads: bytes | None) -> None:
        params = digest_tensors(self._tensors(), self.hasher)
        loss, loss_hash = self._loss(self._step_loss)
        self._ensure_writer().write_step(self._step_base + step, params, grads, loss, loss_hash)
        if step > self.written:
            self.recorded_steps += 1
        self.written = step

    def flush_final(self) -> None:
        """Write the last finished step if sampling skipped it (params and loss; no grads)."""
        if self.failed or self.stopped or os.getpid() != self.pid:
            return
        t0 = time.perf_counter()
        try:
            with self._lock:
                if self.depth == 0 and self.done >= 1 and self.written < self.done:
                    self._write(self.done, None)
                if self.writer is not None:
                    self.writer.update_meta(capture=self._capture_meta())
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        self.capture_seconds += time.perf_counter() - t0


# ------------------------------------------------------------------------------ activation
def _env_bool(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None:
        return default
    return v.strip().lower() not in ("0", "false", "no", "off", "")


def activate_from_env() -> Session | None:
    """Start the injected session (``parity exec``); fails soft."""
    try:
        out = os.environ.get(cenv.ENV_DIR)
        if not out or _ACTIVE is not None:
            return _ACTIVE
        every = _env_int(cenv.ENV_EVERY, 1)
        session = Session(out, every=max(every, 1), grads=_env_bool(cenv.ENV_GRADS, True),
                          manifests=_env_bool(cenv.ENV_MANIFESTS, True),
                          hasher=os.environ.get(cenv.ENV_HASHER, "auto") or "auto",
                          lazy="RANK" not in os.environ, source="exec")
        return session.start()
    except Exception as e:  # noqa: BLE001
        _say(f"capture disabled: {_one_line(e)}")
        return None

