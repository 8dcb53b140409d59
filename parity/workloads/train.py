"""parity's built-in trainer: eager FSDP2 or compiled SimpleFSDP with PyTorch's bucketing.

    torchrun --standalone --nproc_per_node 2 -m parity.workloads.train --mode eager
    torchrun --standalone --nproc_per_node 2 -m parity.workloads.train --mode compiled \\
        --bucketing manual --bucket-order registration

It is a plain user trainer: nothing here knows about parity's capture, which
observes it from outside like any other job. Both modes are built to be
bitwise identical step by step (fp32): same seeds, same per-rank data, same
single intra-op thread, deterministic algorithms, same reduction (average
reduce-scatter), same optimizer on the same ``Shard(0)`` local shards.

Also usable as a library: ``from parity.workloads.train import main;
main([...])`` returns the exit code (it initializes the default process group
from the torchrun environment, or as a 1-rank group when there is none).
"""

import argparse
import os
import socket
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import sdpa_kernel, SDPBackend

from parity.workloads.bucketing import BUCKET_ORDERS, BUCKETINGS
from parity.workloads.model import ModelArgs, Transformer


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
PERTURB_VALUE = 1e-5
CUDAGRAPHS_NO_CUDA = "cudagraphs requested but CUDA is not available"
FLASH_FP32_ON_CUDA = ("--attention flash on CUDA needs half precision: FLASH SDPA has no float32 "
                      "kernel; add --param-dtype bfloat16 (or float16), or use --attention math")


class UsageError(Exception):
    """A configuration this trainer refuses; main() prints it and returns 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m parity.workloads.train", description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("eager", "compiled"), default="eager")
    p.add_argument("--attention", choices=tuple(ATTENTION), default="math")
    p.add_argument("--cudagraphs", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--param-dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--reduce-dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--bucketing", choices=BUCKETINGS, default="manual", help="compiled only")
    p.add_argument("--bucket-order", choices=BUCKET_ORDERS, default="graph", help="compiled only")
    p.add_argument(
        "--perturb-grad",
        metavar="RANK:STEP:FQN",
        default=None,
        help=f"on RANK, before optimizer step STEP (1-based), add {PERTURB_VALUE} to FQN's local gradient shard",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: rank uses device LOCAL_RANK %% device_count()")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="process group backend (default: nccl on cuda, gloo on cpu); gloo lets "
                        "several ranks share one GPU")
    p.add_argument(
        "--reorder-op",
        metavar="MODULE",
        default=None,
        help="plant a one-op difference: the RMSNorm MODULE (e.g. layers.1.ffn_norm) multiplies in another order",
    )
    return p


def default_backend(args: argparse.Namespace) -> str:
    return args.backend or ("nccl" if args.device == "cuda" else "gloo")


def cuda_index(local_rank: int, device_count: int) -> int:
    """The GPU of a rank: LOCAL_RANK modulo the visible GPUs, so that more ranks than GPUs
    (gloo only) share them round-robin instead of asking for a device that does not exist."""
    return local_rank % max(device_count, 1)


def refusal(args: argparse.Namespace, cuda: bool, device_count: int, local_world: int) -> str | None:
    """The one-line reason this configuration cannot run here (main() exits 2), or None."""
    backend = default_backend(args)
    if args.cudagraphs and not cuda:
        return CUDAGRAPHS_NO_CUDA
    if args.cudagraphs and args.mode != "compiled":
        return "--cudagraphs requires --mode compiled (CUDA graphs are the compiled side's)"
    if args.device == "cuda" and not cuda:
        return "--device cuda requested but CUDA is not available"
    if args.device == "cpu" and backend == "nccl":
        return "--backend nccl needs --device cuda"
    if args.cudagraphs and args.device != "cuda":
        return "--cudagraphs needs --device cuda"
    if args.device == "cuda" and backend == "nccl" and local_world > device_count:
        return (f"--backend nccl cannot put two ranks on one GPU ({local_world} local ranks, "
                f"{device_count} GPU(s)): use --backend gloo or fewer ranks per node")
    if args.cudagraphs and backend == "gloo" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return ("--cudagraphs cannot capture gloo collectives: use --backend nccl "
                "(one GPU per rank) or a single rank")
    if args.attention == "flash" and args.device == "cuda" and args.param_dtype == "float32":
        return FLASH_FP32_ON_CUDA
    return None


def parse_perturb(spec: str | None) -> tuple[int, int, str] | None:
    if spec is None:
        return None
    parts = spec.split(":", 2)
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or not parts[2]:
        raise UsageError(f"--perturb-grad expects RANK:STEP:FQN, got {spec!r}")
    return int(parts[0]), int(parts[1]), parts[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str, backend: str | None = None) -> bool:
    """Initialize the default group; returns True if this call created it."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:
        # Library use without torchrun: a 1-rank job.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ["RANK"] = "0"
        os.environ["WORLD_SIZE"] = "1"
        os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(backend=backend or ("nccl" if device == "cuda" else "gloo"))
    return True


def registration_groups(model: Transformer) -> list[torch.nn.Module]:
    """The modules ``fully_shard`` is applied to, in FSDP2's own state order.

    That is the root's ``_state_ctx.all_states`` order after lazy init (module
    pre-order: root, then blocks). Only buckets that span several groups
    (``--bucketing auto``) depend on the order between groups.
    """
    return [model, *model.layers]


def manual_bucket_plans(model: Transformer) -> list[list[str] | str]:
    """One plan entry per FSDP2 group: each block, and the root's own parameters."""
    return [f"layers.{i}" for i in range(len(model.layers))] + [["tok_embeddings", "norm", "output"]]


def shard_eager(model: Transformer, mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> Transformer:
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy

    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def shard_compiled(model: Transformer, mesh, args: argparse.Namespace, param_dtype, reduce_dtype):
    from parity.workloads.bucketing import fsdp2_registration_order, make_backend
    from parity.workloads.simple_fsdp import data_parallel, MixedPrecisionPolicy

    # Computed before sharding: the class swap does not change module names.
    registration_order = fsdp2_registration_order(model, registration_groups(model))
    plans = manual_bucket_plans(model)
    # The cast to param_dtype happens before the all-gather (as FSDP2 does) and
    # reduce_dtype is the dtype the reduce-scatter runs in. float32 (the
    # parameters' storage dtype) means "no cast": DTensor's backward collective
    # runs in the storage dtype when backward_dtype is None, NOT in param_dtype.
    mp_policy = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=None if reduce_dtype == torch.float32 else reduce_dtype,
    )
    data_parallel(model, mesh, mp_policy)
    backend = make_backend(
        bucketing=args.bucketing,
        bucket_order=args.bucket_order,
        plans=plans,
        registration_order=registration_order,
        cudagraphs=args.cudagraphs,
    )
    return torch.compile(model, fullgraph=True, backend=backend)


def perturb(model: torch.nn.Module, fqn: str) -> None:
    grad = dict(model.named_parameters())[fqn].grad
    if grad is None:
        raise RuntimeError(f"--perturb-grad: {fqn} has no gradient at this step")
    with torch.no_grad():
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        local.add_(PERTURB_VALUE)


def run(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", cuda_index(int(os.environ.get("LOCAL_RANK", "0")),
                                                 torch.cuda.device_count()))
        torch.cuda.set_device(device)
    mesh = init_device_mesh(args.device, (world_size,))
    param_dtype = DTYPES[args.param_dtype]
    reduce_dtype = DTYPES[args.reduce_dtype]
    perturb_spec = parse_perturb(args.perturb_grad)
    if args.mode == "compiled" and args.bucket_order == "swapped" and world_size < 2:
        raise UsageError("--bucket-order swapped needs at least 2 ranks (1 rank has no reduce-scatter)")

    # Same full model on every rank, then shard.
    torch.manual_seed(args.seed)
    model_args = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads, vocab_size=args.vocab_size)
    with torch.device(device):
        model = Transformer(model_args)
    if perturb_spec is not None and perturb_spec[2] not in dict(model.named_parameters()):
        # Checked on every rank before any collective, so no rank is left waiting.
        names = ", ".join(name for name, _ in model.named_parameters())
        raise UsageError(f"--perturb-grad: no parameter {perturb_spec[2]!r}; known: {names}")
    if args.reorder_op is not None:
        norm = dict(model.named_modules()).get(args.reorder_op)
        if not hasattr(norm, "reorder"):
            norms = ", ".join(n for n, m in model.named_modules() if hasattr(m, "reorder"))
            raise UsageError(f"--reorder-op: {args.reorder_op!r} is not an RMSNorm module; known: {norms}")
        norm.reorder = True
    if args.mode == "eager":
        model = shard_eager(model, mesh, param_dtype, reduce_dtype)
        step_model = model
    else:
        step_model = shard_compiled(model, mesh, args, param_dtype, reduce_dtype)

    if args.optimizer == "adamw":
        # foreach=False: the same per-parameter kernels on both sides whatever
        # the default heuristics pick for DTensor parameters.
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, foreach=False)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, foreach=False)

    # Different data per rank, as in a data-parallel job.
    generator = torch.Generator().manual_seed(args.seed * 100003 + 1 + rank)
    times, starts = [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        starts.append(t0)
        tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator)
        tokens = tokens.to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        with sdpa_kernel(ATTENTION[args.attention]):
            logits = step_model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        if perturb_spec is not None and perturb_spec[0] == rank and perturb_spec[1] == step:
            perturb(model, perturb_spec[2])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f} time_ms {times[-1] * 1e3:.1f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the wall time below ends when the GPU is done
    if rank == 0 and times:
        rest = times[1:] or times
        # wall_step_ms: steps 2..N from start to the GPU's end, prints and syncs included (on a
        # GPU, mean_step_ms is the host's time to queue a step, which a sync inside it inflates)
        wall = (time.perf_counter() - starts[1]) / (len(starts) - 1) if len(starts) > 1 else \
            times[0]
        print(
            f"done mode={args.mode} world_size={world_size} steps={args.steps} "
            f"first_step_ms={times[0] * 1e3:.1f} mean_step_ms={sum(rest) / len(rest) * 1e3:.1f} "
            f"wall_step_ms={wall * 1e3:.1f}",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    why = refusal(args, cuda, torch.cuda.device_count() if cuda else 0,
                  int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if why is not None:
        print(why, file=sys.stderr)
        return 2

    if args.mode == "compiled":
        from parity.workloads.bucketing import missing_internals

        missing = missing_internals()
        if missing:
            print(f"compiled mode needs PyTorch internals missing from torch {torch.__version__}: "
                  f"{', '.join(missing)}", file=sys.stderr)
            return 2

    try:
        parse_perturb(args.perturb_grad)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2

    # Pinned before any work: a different intra-op thread count changes
    # reduction order in CPU kernels and breaks bitwise parity.
    torch.set_num_threads(1)
    if args.device == "cuda":
        # Deterministic cuBLAS needs a fixed workspace; read when cuBLAS first initializes,
        # which is later (torchtitan's deterministic mode sets the same).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    created = init_distributed(args.device, default_backend(args))
    try:
        run(args)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
