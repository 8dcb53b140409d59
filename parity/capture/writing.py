"""What one rank writes: its identity, metadata (meta.json), and each recorded step.

:class:`RankRecord` opens the rank's :class:`~parity.artifacts.RankWriter` (continuing the record
of an earlier torchelastic attempt), keeps ``capture`` in meta.json current (manifest sources,
warnings, overhead), adds the runtime facts at the first step, and writes steps 0..k. A part of
:class:`~parity.capture.session.Session` (a mixin: state in ``Session.__init__``).
"""

from __future__ import annotations

import collections
import json
import os
import socket
import sys
import time

import torch

from parity import __version__
from parity.artifacts import HASH_BYTES, NO_FIGURES, NO_HASH, RankWriter
from parity.capture import env as cenv
from parity.capture import fingerprint, gpu_facts, host_native, nccl_emulation, opt_state
from parity.capture.env import env_int as _env_int
from parity.capture.hashing import DEVICE_DIGEST_VERSION, device_backend, host_digest, local_tensor
from parity.rundir import RANK_FILES, rank_dir
from parity.capture.claims import ClaimRefused, claim_rank
from parity.capture.table import _Buffer


class RankRecord:
    """Rank identity, meta.json and step writes (state in ``Session.__init__``)."""

    # the last parameter record written, and the one of the step before it (_resolve)
    _last_params: bytes | None = None
    _last_param_ref: tuple[int, str] | None = None
    _last_param_step = -1
    _prev_params: tuple = (None, -1)

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
                "device_digest_version": (DEVICE_DIGEST_VERSION
                                          if self._resolved_hasher == "device" else None),
                # how the cached device tables were checked: native (host_native), building,
                # python loop (why), not built (no table was used twice)
                "device_digest_host_check": (host_native.status()
                                             if self._resolved_hasher == "device" else None),
                "source": self.source, "warnings": list(self.warnings), "disabled": self.failed,
                "recorded_steps": self.recorded_steps, "steps": self.done,
                "optimizers": self._top_optimizer_count,
                # module trees not hashed (fake / meta / subclass tensors), tensors of the
                # model that could not be (named on the verdict line): trees.py, table.py
                "skipped": list(self._trees_skipped),
                "unhashed": [{"fqn": f, "reason": r} for f, r in self._unhashed.items()],
                # not in state_dict, so not hashed by design; the verdict line names them
                "non_persistent_buffers": list(self._non_persistent),
                # per-parameter optimizer state (Adam's moments...): its keys, named on the
                # verdict line unless both runs hashed it in the final state (opt_state.py)
                "optimizer_state": dict(self._opt_state),
                "optimizer_state_final": self._opt_state_final,
                # which state entries are rows (diff/opt_state.rows_version): 2 = tensors,
                # Python numbers, lists, a second optimizer's "#2" rows (round 7)
                "optimizer_state_rows": opt_state.ROWS_VERSION,
                "seconds": round(self.capture_seconds
                                 + sum(s.seconds for s in self._sources.values() if s is not None),
                                 6)}

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
                "gpu": gpu_facts.collect(dev) if dev.startswith("cuda") else None,
                "numerics": fingerprint.collect()}

    def _ensure_writer(self) -> RankWriter:
        if self.writer is not None:
            return self.writer
        if self._claim_refused:
            raise ClaimRefused(self._claim_refused)
        rank, world, local = self._ids()
        self._rank_arg = (rank, world, local)
        d = rank_dir(self.out_dir, rank)
        restart = self._elastic_restart(d)
        refused = claim_rank(d, rank, self.out_dir, takeover=restart is not None,
                             exec_run=self.source == "exec",
                             elastic=_env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0)
        if refused:
            self._claim_refused = refused
            raise ClaimRefused(refused)
        if restart is None:
            # A new session starts this rank's record: drop what an earlier run left here.
            for name in RANK_FILES:
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
        nccl_emulation.record_in(meta)  # the one mode that changes the job's numbers
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
        # A killed attempt may end mid-line; a torn hashes.bin record at its end is never read
        # (records are found by the offsets in steps.jsonl).
        if data and not data.endswith(b"\n"):
            with open(d / "steps.jsonl", "ab") as f:
                f.write(b"\n")
        try:
            old = json.loads((d / "meta.json").read_text()).get("restarts") or []
        except (OSError, ValueError, AttributeError):
            old = []
        self._step_base = max(last, 0)
        return [*old, {"attempt": attempt, "after_step": self._step_base, "time": time.time()}]

    # ----------------------------------------------------------------------------- writing
    # A recorded step is written in two halves. ``_write`` queues its digests (on a GPU:
    # kernels, and copies into pinned memory behind CUDA events; nothing waits) and appends it
    # to ``_inflight``; ``_resolve`` writes queued steps in step order once their digests are
    # on the host: at the next step's end (waiting then if they are not: the GPU is busy with
    # that next step by then, so the wait drains nothing), or at close. On CPU every digest is
    # known at once and the step is written at once. A job killed between the two halves loses
    # its last recorded step (steps.jsonl never lists a step whose hashes were not written).
    def _loss(self, ref):
        """The step's loss and its hash, or a _LossCopy on its way from the device."""
        if ref is None:
            return None, None
        lt = local_tensor(ref)
        if lt.is_cuda:
            return _LossCopy(lt)
        return float(lt.item()), host_digest(lt).hex()

    def _write_first(self) -> None:
        w = self._ensure_writer()
        if self._table_dirty:
            counts = collections.Counter(e["fqn"] for e in self.entries)
            dupes = {f for f, c in counts.items() if c > 1}
            if dupes:
                self.warn(f"parameter names are not unique after normalization: "
                          f"{', '.join(sorted(dupes)[:5])}")
            self._table_hasher([])  # resolved at the first digest already (table.py)
            w.meta.update(self._runtime_meta())
            w.meta["capture"] = self._capture_meta()
            w.update_meta()
            w.write_params(self.entries)
            if not self._step_base:  # a restarted attempt continues its rank's steps
                w.write_step(0, b"".join(d for d, _ in self._p0),
                             param_figures=b"".join(f for _, f in self._p0))
            self._table_dirty = False
        self._write(1, self._grad_line() if self.grads else None)

    def _write(self, step: int, grads: list | None) -> None:
        """Queue step ``step`` (its parameter digests now; ``grads``: the parts of its gradient
        line, steps.py; the entry digests, the loss scale and a skip when it is the step in
        progress) and write every step that is ready."""
        params = self._digest_rows(self._tensors(), stable=True, figures=True)
        self._ensure_writer()
        current = step == self.k
        scale = self._loss_scale if current else None
        self._inflight.append(_InFlight(
            self._step_base + step, len(self.table), params, grads, self._loss(self._step_loss),
            entry=self._entry if current else None,
            scale=None if scale is None else self._loss(scale),
            skipped=self._skipped if current else None,
            rng=getattr(self, "_rng", None) if current else None,
            opt=(getattr(self, "_opt_groups", None) or None) if current else None,
            opt_impl=(getattr(self, "_opt_impl", None) or None) if current else None))
        if step > self.written:
            self.recorded_steps += 1
        self.written = step
        self._resolve(before=self._step_base + step)

    def _resolve(self, before: int | None = None) -> None:
        """Write the queued steps in order: those before step ``before`` (waiting for their
        digests if needed), then any whose digests are already on the host; every one when
        ``before`` is None (close)."""
        q = self._inflight
        while q:
            head = q[0]
            if before is not None and head.step >= before and not head.ready():
                return
            q.popleft()
            loss, loss_hash = head.loss_value()
            params = head.params.result()
            grads = head.grad_line()
            ref = self._ensure_writer().write_step(
                head.step, params, grads, loss, loss_hash,
                param_figures=head.params.figures(),
                grad_figures=None if grads is None else head.grad_figures(),
                entry_hashes=self._changed_entry(head), loss_scale=head.scale_value(),
                skipped=head.skipped, rng=head.rng, opt=head.opt,
                opt_impl=head.opt_impl)
            if head.step != self._last_param_step:  # (a sibling optimizer writes a step again)
                self._prev_params = (self._last_params, self._last_param_step)
            self._last_params, self._last_param_ref, self._last_param_step = \
                params, ref, head.step

    def _changed_entry(self, head) -> bytes | None:
        """Step ``head``'s entry digests (steps.py ``_entry_hashes``) when they differ from the
        previous step's parameter record, its buffer rows left out; else None (nothing to
        write: the step found what the previous step left)."""
        last, step = self._last_params, self._last_param_step
        if step == head.step:  # written again: compare with the step before, as the first time
            last, step = self._prev_params
        if head.entry is None or last is None or step != head.step - 1:
            return None
        digests, buffers = head.entry
        now, last = digests.result(), bytearray(last)
        for i in buffers:
            last[i * HASH_BYTES:(i + 1) * HASH_BYTES] = NO_HASH
        n = min(len(now), len(last))
        return None if now[:n] == bytes(last[:n]) else now

    def write_final_state(self) -> None:
        """Hash every row once more when capture stops (the process ends, or ``stop()``),
        after the trainer's last edit, and write it as the final state: a new record when it
        differs from the last step's, else a line that refers to that step's record. A
        failure is a warning (the diff then says the final state was recorded by one side
        only); capture is stopping anyway."""
        if (self.failed or self.stopped or os.getpid() != self.pid or self.writer is None
                or self.done < 1):
            return
        t0 = time.perf_counter()
        try:
            with self._lock:
                self._resolve()
                self._final_rows(self._step_base + self.done)
                freed = self._state_rows(self._step_base + self.done + 1)  # opt_state.py
                tensors = self._tensors()
                for i in self._left_rows():
                    tensors[i] = None  # the model no longer holds it: absent (NO_HASH)
                now = self._digest_rows(tensors, stable=True).result()
                if freed:  # the state of optimizers freed earlier, hashed then
                    buf = bytearray(now)
                    for i, d in freed.items():
                        buf[i * HASH_BYTES:(i + 1) * HASH_BYTES] = d
                    now = bytes(buf)
                after = self._step_base + self.done
                last = self._last_params if self._last_param_step == after else None
                same = last is not None and now[:len(last)] == last
                if same and len(now) == len(last):
                    self.writer.write_final(after, same_as=self._last_param_ref)
                else:  # (rows only the final state has: the optimizers' state, opt_state.py)
                    self.writer.write_final(after, hashes=now, changed=not same)
        except Exception as e:  # noqa: BLE001
            self.warn(f"the final state (after step {self.done}) was not recorded: "
                      f"{cenv.one_line(e)}")
        self.capture_seconds += time.perf_counter() - t0

    def _final_rows(self, after: int) -> None:
        """The module trees read once more before the final state is hashed: a parameter set on
        a module after the last step (a LoRA merge, ``load_state_dict(..., assign=True)``, a
        folded norm: torch's registration hooks fire), a buffer registered then, or a model
        built then (``AveragedModel``: its buffer's registration announces it) is not in the
        table, whose rows are the objects the steps saw. Each joins it (from the
        step after ``after``: in the final state only), named, and the table is written again;
        without this the final state would hash the objects the model no longer holds and two
        runs that end in different models could hold."""
        # What announced itself since the last step (a registration hook fired, a model was
        # copied) is read, as at a step; a known tree is not walked on suspicion: between an
        # all-gather and its reshard (an eval forward after training, a job interrupted
        # mid-step) FSDP2 holds unsharded parameters on its modules, set without a hook, and
        # those are the shards' state, not new parameters (trees.fsdp_unsharded skips them).
        self._trees_scanned = None
        self._sync_trees(after + 1, final=True)

    def _left_rows(self) -> list[int]:
        """Parameter rows whose module no longer holds a parameter of that name when the run
        ends (``m.bias = None``, ``del m.bias``, a submodule replaced by one without it): the
        final state is the model the run ended with, so they are absent there (the all-zero
        hash), with a warning. Capture keeps a reference to every row's tensor, so without
        this the final state hashed the removed parameter's old values and a run that dropped
        a bias after training held against one that kept it (round 5). A parameter replaced
        by another tensor (FSDP2's unsharded one after an eval forward, a new Parameter: it
        joins as its own row) is not absent, nor one the trees still hold under another name
        (moved into a parametrization)."""
        left = []
        for i, (root, raw) in self._row_homes.items():
            path, _, name = raw.rpartition(".")
            try:
                mod = root.get_submodule(path) if path else root
            except AttributeError:
                left.append(i)  # the submodule left the tree
                continue
            params = getattr(mod, "_parameters", None)
            if isinstance(params, dict) and params.get(name) is None \
                    and not isinstance(getattr(mod, "_buffers", {}).get(name), torch.Tensor):
                left.append(i)
        if left:  # moved, not removed (a parametrization's ``original``, a tied twin): held
            held = {id(t) for r in self._name_roots for t in r.parameters()}
            left = [i for i in left if id(self.table[i]) not in held]
        if left:
            names = [self.entries[i]["fqn"] for i in left]
            self.warn(f"{len(left)} parameter(s) left the model after step {self.done} "
                      f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): absent "
                      "from the final state")
        return left

    def flush_final(self) -> None:
        """Write the last finished step if sampling skipped it (params and loss; no grads)."""
        if self.failed or self.stopped or os.getpid() != self.pid:
            return
        t0 = time.perf_counter()
        try:
            with self._lock:
                if self.depth == 0 and self.done >= 1 and self.written < self.done:
                    self._write(self.done, None)
                self._resolve()
                if self.writer is not None:
                    self.writer.update_meta(capture=self._capture_meta())
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        self.capture_seconds += time.perf_counter() - t0


class _LossCopy:
    """A CUDA loss on its way to pinned host memory (its value and hash read at resolution)."""

    __slots__ = ("host", "event")

    def __init__(self, lt: torch.Tensor):
        self.host = torch.empty(lt.shape, dtype=lt.dtype, pin_memory=True)
        self.host.copy_(lt.detach(), non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        return self.event.query()

    def value(self) -> tuple[float, str]:
        self.event.synchronize()
        return float(self.host.item()), host_digest(self.host).hex()


class _InFlight:
    """A recorded step whose digests may still be on the device (see RankRecord._resolve)."""

    __slots__ = ("step", "rows", "params", "grads", "loss", "entry", "scale", "skipped", "rng",
                 "opt", "opt_impl")

    def __init__(self, step: int, rows: int, params, grads: list | None, loss, *,
                 entry=None, scale=None, skipped: str | None = None, rng=None, opt=None,
                 opt_impl=None):
        self.step, self.rows, self.params, self.grads, self.loss = step, rows, params, grads, loss
        self.entry, self.scale, self.skipped, self.rng = entry, scale, skipped, rng
        self.opt, self.opt_impl = opt, opt_impl

    def ready(self) -> bool:
        return (self.params.ready() and all(d.ready() for _, d in self.grads or ())
                and (not isinstance(self.loss, _LossCopy) or self.loss.ready())
                and (self.entry is None or self.entry[0].ready())
                and (not isinstance(self.scale, _LossCopy) or self.scale.ready()))

    def loss_value(self) -> tuple[float | None, str | None]:
        return self.loss.value() if isinstance(self.loss, _LossCopy) else self.loss

    def scale_value(self) -> float | None:
        """The loss scale (a GradScaler's), or None."""
        if self.scale is None:
            return None
        return (self.scale.value() if isinstance(self.scale, _LossCopy) else self.scale)[0]

    def grad_line(self) -> bytes | None:
        """The gradient digests in table order from the parts (rows: a list, or an int n for
        rows 0..n-1; a later part wins for a row noted twice)."""
        if self.grads is None:
            return None
        parts = self.grads
        for i in range(len(parts) - 1, -1, -1):
            if parts[i][0] == self.rows:  # a part of every row: the ones before it do not matter
                parts = parts[i:]
                break
        if len(parts) == 1 and parts[0][0] == self.rows:
            return parts[0][1].result()
        import numpy as np

        out = np.zeros((self.rows, HASH_BYTES), dtype=np.uint8)
        for rows, d in parts:
            got = np.frombuffer(d.result(), dtype=np.uint8).reshape(-1, HASH_BYTES)
            if isinstance(rows, int):
                out[:rows] = got
            else:
                out[np.asarray(rows, dtype=np.int64)] = got
        return out.tobytes()

    def grad_figures(self) -> bytes | None:
        """The gradients' figures in table order, assembled from the parts as ``grad_line``
        (None when a part was digested without figures)."""
        parts = self.grads or []
        if any(d.figs is None for _, d in parts):
            return None
        import numpy as np

        out = np.frombuffer(NO_FIGURES * self.rows, dtype="<f8").reshape(-1, 3).copy()
        for rows, d in parts:
            got = np.frombuffer(d.figures(), dtype="<f8").reshape(-1, 3)
            if isinstance(rows, int):
                out[:rows] = got
            else:
                out[np.asarray(rows, dtype=np.int64)] = got
        return out.tobytes()
