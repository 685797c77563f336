"""ddp_train.py: a reference PyTorch DistributedDataParallel (DDP) training script.

One file, torch only. Launch it unchanged in any of these ways:

    python ddp_train.py                                  # one process: CPU, or one GPU
    python ddp_train.py --spawn 2                        # N local processes, no launcher
    torchrun --nproc_per_node=4 ddp_train.py             # one node, 4 processes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
             --rdzv-endpoint=HOST0:29500 --rdzv-id=myjob ddp_train.py   # on every node
    python -m torch.distributed.launch --nproc_per_node=2 ddp_train.py  # legacy launcher
    srun --ntasks=8 python ddp_train.py                  # SLURM: one task per GPU

To train your model on your data, replace build_datasets() and build_model();
everything else is the distributed machinery. The steps that exist only because
of DDP carry a "DDP:" comment, and each classic DDP pitfall a "Trap:" comment
where it is handled.

Reading order: arguments, how we were launched (init_distributed), data, model,
checkpoints, the training loop, main().
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import random
import re
import resource
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset, default_collate

try:  # numpy is optional; when present, a Dataset's numpy randomness is seeded like torch's
    import numpy
except ImportError:
    numpy = None

PROG = "ddp_train.py"
# Exit code after a preemption signal (SIGTERM, SIGUSR1) once the checkpoint is saved.
# 75 is EX_TEMPFAIL: "try again later", and rerunning the same command continues the run.
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), after the checkpoint is saved: the shell's convention
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
CHECKPOINT_FORMAT = "ddp_train.checkpoint/1"
EVAL_EPOCH = -1  # evaluation's own data seeds (see SeededSamples): the same in every epoch
RANK_STREAM = -2  # mixed with --seed and the rank: each rank's own random stream for the model

# The default task: a synthetic classification problem (see build_datasets).
IN_FEATURES, NUM_CLASSES, HIDDEN = 32, 10, 256


def fail(message: str, code: int = 2, ctx=None) -> None:
    """Stop with one clear line on stderr and no traceback. With a ctx, the error is one every
    rank hits, so only rank 0 prints it."""
    if ctx is None or ctx.is_main:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        fail(f"{message} (see --help)")


def _int_at_least(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _float_at_least(low, strict=False):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            bound = "greater than" if strict else "at least"
            raise argparse.ArgumentTypeError(f"must be {bound} {low:g}, got {text}")
        return value

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(
        prog=PROG,
        description="Reference DistributedDataParallel training script. Launch with python, "
        "torchrun, torch.distributed.launch, srun, or --spawn N.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    pos, nonneg = _int_at_least(1), _int_at_least(0)
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=pos, default=3, help="passes over the training set")
    g.add_argument("--batch-size", type=pos, default=64, help="batch size PER PROCESS (global = this x world size x grad-accum)")
    g.add_argument("--grad-accum", type=pos, default=1, help="micro-batches per optimizer step; gradients are all-reduced only on the last")
    g.add_argument("--lr", type=_float_at_least(0.0), default=1e-3, help="AdamW learning rate (peak of the warmup + cosine schedule)")
    g.add_argument("--scale-lr", action="store_true", help="multiply --lr by world size x grad-accum (linear scaling rule: --lr was tuned for one process's batch)")
    g.add_argument("--warmup-steps", type=nonneg, default=0, help="optimizer steps of linear LR warmup before the cosine decay")
    g.add_argument("--seed", type=int, default=0, help="seed for the data, the model's initial weights and the shuffle order")
    g.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off", help="autocast precision; fp16 adds a GradScaler")
    g.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    g.add_argument("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm (statistics over the global batch; needs CUDA)")
    g.add_argument("--batch-norm", action="store_true", help="give the default model BatchNorm layers")
    g.add_argument("--peak-tflops", type=_float_at_least(0.0, strict=True), default=None,
                   help="peak TFLOP/s of one GPU for the MFU figure (default: looked up from the GPU's name)")
    g.add_argument("--workers", type=_int_at_least(-1), default=-1, help="DataLoader workers per process for datasets that are not in-memory tensors (-1: 0 on CPU, a few on CUDA)")

    g = p.add_argument_group("data")
    g.add_argument("--num-samples", type=pos, default=32768, help="size of the default synthetic training set")
    g.add_argument("--eval-samples", type=nonneg, default=4096, help="size of the default synthetic evaluation set (0: no evaluation)")

    g = p.add_argument_group("output and checkpoints")
    g.add_argument("--out-dir", default="out", help="where rank 0 writes model.pt, checkpoint.pt and metrics.jsonl")
    g.add_argument("--log-every", type=nonneg, default=0, help="also log the global train loss every N optimizer steps (0: once per epoch)")
    g.add_argument("--save-every", type=nonneg, default=0, help="also checkpoint every N optimizer steps (0: at each epoch end only)")
    g.add_argument("--resume", default="auto", help="'auto': continue from OUT_DIR/checkpoint.pt when there is one; 'never': start fresh; or a checkpoint path")

    g = p.add_argument_group("distributed")
    g.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto", help="process group backend; auto = nccl with CUDA, else gloo")
    g.add_argument("--init-method", default="env://", help="rendezvous: env:// (MASTER_ADDR/MASTER_PORT), tcp://HOST:PORT or file:///shared/path")
    g.add_argument("--timeout", type=_float_at_least(0.0, strict=True), default=300.0, help="seconds to wait for peers at init and in any collective before failing")
    g.add_argument("--spawn", type=nonneg, default=0, help="start N local processes with torch.multiprocessing (no launcher needed)")
    g.add_argument("--grad-compression", choices=("none", "bf16"), default="none",
                   help="all-reduce gradients in bfloat16: half the bytes on the wire, but it CHANGES THE NUMERICS "
                        "(gradients keep 8 bits of mantissa); results no longer match one process exactly")
    # Legacy `python -m torch.distributed.launch` passes --local-rank=N (older torch: --local_rank N).
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None, help="set by torch.distributed.launch; do not pass it yourself")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------
# How were we launched? One small context for the rest of the script.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class DistContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    distributed: bool = False  # False: one process, no process group, same code path
    launcher: str = "python"
    backend: str = "none"
    control_group: object = None  # CPU (gloo) group for small control messages

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    head = re.match(r"[^,\[]*(\[[^\]]*\])?", nodelist).group(0)  # 'gpu[07-09,12]'
    if "[" not in head:
        return head
    prefix, ranges = head[:-1].split("[")
    return prefix + re.split(r"[,-]", ranges)[0]


def _launch_env(args) -> tuple[str, int, int, int, int]:
    """(launcher, rank, world_size, local_rank, local_world_size) from the environment."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, torch.distributed.launch, --spawn workers
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", args.local_rank if args.local_rank is not None else 0))
        launcher = "spawn" if args.spawn else "launch" if args.local_rank is not None else "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
        return launcher, rank, world, local_rank, int(env.get("LOCAL_WORLD_SIZE", world))
    # A bare `srun python ddp_train.py`: srun sets SLURM_STEP_NUM_TASKS for its tasks; an sbatch
    # script running python directly has SLURM_NTASKS too, but it is one process, not a task.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        env.setdefault("MASTER_ADDR", first_slurm_host(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "localhost"))))
        # Every task derives the same port from the job id, so two jobs on one node don't collide.
        env.setdefault("MASTER_PORT", str(15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        per_node = int(re.match(r"\d*", env.get("SLURM_NTASKS_PER_NODE", "")).group(0) or world)  # "4" or "4(x2)"
        return "slurm", rank, world, int(env.get("SLURM_LOCALID", 0)), per_node
    return "python", 0, 1, 0, 1


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _set_threads(local_world_size: int) -> None:
    """Share the CPU cores between the processes of one node, unless the user chose."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, _cores() // max(1, local_world_size)))


def restart_safe_store(args, world: int, timeout: datetime.timedelta):
    """torchrun's agent keeps one TCPStore for the whole job, and the keys its workers write carry
    no restart number: after `--max-restarts` restarts the new workers can read the dead ones'
    addresses and fail to connect (pytorch/pytorch#135712). Give every restart its own namespace.
    TORCHELASTIC_RESTART_COUNT agrees across the workers of one node; across nodes, launch torchrun
    with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (run_multi_node.sh does), which gives each restart a
    fresh store and skips this."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or args.init_method != "env://":
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size=world, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"ddp_train/restart_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(args) -> DistContext:
    """Detect the launcher, pick the device, and join the process group (if there is one)."""
    launcher, rank, world, local_rank, local_world = _launch_env(args)
    _set_threads(local_world)
    ctx = DistContext(rank, local_rank, world, local_world, launcher=launcher)

    has_cuda = torch.cuda.is_available()
    backend = args.backend if args.backend != "auto" else ("nccl" if has_cuda else "gloo")
    if backend == "nccl" and not has_cuda:
        fail("--backend nccl needs CUDA, and this machine has no usable CUDA device; use --backend gloo (or auto)", ctx=ctx)
    if has_cuda:
        # DDP: one GPU per process, chosen by LOCAL_RANK, bound before init so nothing lands on GPU 0.
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            fail(
                f"LOCAL_RANK is {local_rank} but only {visible} CUDA device(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                f"start at most {visible} processes per node"
            )
        ctx.device = torch.device("cuda", local_rank)
        torch.cuda.set_device(ctx.device)
    if world == 1:
        return ctx  # one process: no process group at all, and every collective below is skipped

    # DDP: join the process group. The timeout turns a missing peer into an error, not a hang.
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        store = restart_safe_store(args, world, timeout)
        dist.init_process_group(
            backend=backend,
            init_method=None if store else args.init_method,
            store=store,
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=ctx.device if ctx.device.type == "cuda" else None,
        )
    except Exception as exc:  # name what was tried; the launcher has already printed the rest
        where = args.init_method
        if where == "env://":
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        fail(f"rank {rank} could not join the {world}-process group at {where} within {args.timeout:g}s: {reason}", code=1)
    ctx.distributed, ctx.backend = True, backend
    # Control messages (the stop flag, RNG states) go over a CPU group so they never sync a GPU.
    ctx.control_group = None if backend == "gloo" else dist.new_group(backend="gloo")
    return ctx


def cleanup_distributed(ctx: DistContext) -> None:
    """Leave the process group. Callers release the DDP model first."""
    if ctx.distributed and dist.is_initialized():
        # Trap: destroying the group while DDP's reducer still exists aborts at exit ("terminate
        # called without an active exception"), so collect the released model first.
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum a tensor over all ranks (in place). SUM, never AVG: AVG is unreliable on gloo."""
    if ctx.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


# ---------------------------------------------------------------------------
# Data: replace build_datasets() with your own.
# ---------------------------------------------------------------------------


def build_datasets(args) -> tuple[Dataset, Dataset]:
    """(train_set, eval_set). The default is a learnable synthetic task needing no download:
    Gaussian inputs labelled by a fixed random linear "teacher", all generated from --seed."""
    gen = torch.Generator().manual_seed(args.seed)
    teacher = torch.randn(IN_FEATURES, NUM_CLASSES, generator=gen)

    def make(n):
        x = torch.randn(n, IN_FEATURES, generator=gen)
        return TensorDataset(x, (x @ teacher).argmax(dim=1))

    return make(args.num_samples), make(args.eval_samples)


class Loader:
    """Batches of a Dataset on the device. Every sample's randomness (augmentation) is a function of
    (--seed, epoch, sample index) alone, whatever the worker count, world size or resume point."""

    def __init__(self, dataset: Dataset, batch_size: int, ctx: DistContext, workers: int, seed: int):
        self.dataset, self.batch_size, self.ctx = dataset, batch_size, ctx
        self.samples, self.plan, self.loader = SeededSamples(dataset, seed), _Plan(), None
        on_gpu = ctx.device.type == "cuda"
        if workers < 0:
            workers = min(4, max(1, _cores() // ctx.local_world_size - 1)) if on_gpu else 0
        if type(dataset) is not TensorDataset and workers > 0:
            # Workers started once, not every epoch (persistent); a private generator for the
            # loader's base seed, because the global one belongs to the model (dropout).
            self.loader = DataLoader(self.samples, batch_sampler=self.plan, num_workers=workers, persistent_workers=True,
                                     pin_memory=on_gpu, collate_fn=collate, worker_init_fn=leave_signals_to_trainer,
                                     generator=torch.Generator())

    def batches(self, indices: list[int], epoch: int):
        """Yield the samples `indices` in order, batch_size at a time."""
        if type(self.dataset) is TensorDataset:  # exactly: a subclass may augment in its own __getitem__
            # In-memory tensors: gather a whole batch with one index op instead of collating samples.
            tensors = self.dataset.tensors
            index = torch.as_tensor(indices, dtype=torch.long, device=tensors[0].device)
            for rows in index.split(self.batch_size):
                yield tuple(t[rows].to(self.ctx.device, non_blocking=True) for t in tensors)
            return
        keys = [(epoch, i) for i in indices]
        self.plan.batches = [keys[i : i + self.batch_size] for i in range(0, len(keys), self.batch_size)]
        if self.loader is None:
            loaded = (load_in_this_process(self.samples, chunk) for chunk in self.plan.batches)
        else:
            loaded = iter(self.loader)
        try:
            for batch in loaded:
                yield to_device(batch, self.ctx.device)
        except BatchError as exc:
            fail(f"cannot batch the items of {type(self.dataset).__name__}: {str(exc).rsplit('BatchError: ', 1)[-1]}",
                 ctx=self.ctx)


class _Plan:
    """The batch sampler of a Loader's DataLoader: the batches of the next pass."""

    def __init__(self):
        self.batches = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def load_in_this_process(samples: Dataset, chunk: list):
    """One batch loaded here, not in a worker: the training process's own torch stream (dropout)
    must not see the per-sample seeding, so it is put back afterwards."""
    state = torch.default_generator.get_state()
    try:
        return collate([samples[key] for key in chunk])
    finally:
        torch.default_generator.set_state(state)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_MASK64 = 2**64 - 1


def mix_seed(*parts: int) -> int:
    """A well-mixed 64-bit seed from integers: the same in every process, machine and version."""
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (part & _MASK64))
    return h


class SeededSamples(Dataset):
    """The user's Dataset, seeded per sample: before sample i of epoch e loads (its key is (e, i)),
    torch, random and numpy are seeded from (seed, e, i)."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed, self.epoch_seeds = dataset, seed, {}

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        if epoch not in self.epoch_seeds:
            self.epoch_seeds[epoch] = mix_seed(self.seed, epoch)
        s = _splitmix64(self.epoch_seeds[epoch] ^ index)
        torch.default_generator.manual_seed(s)  # not torch.manual_seed: 100x slower, it visits every device
        random.seed(s)
        if numpy is not None:
            numpy.random.seed(s >> 32)
        return self.dataset[index]


def leave_signals_to_trainer(worker_id: int) -> None:
    """DataLoader worker_init_fn. torchrun, scancel and terminals signal whole process groups, and a
    worker exits on a SIGTERM its parent did not send, which kills the trainer before it can save.
    The stop signals are the training process's to handle."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class BatchError(TypeError):
    """Items that default_collate cannot batch (raised in a worker, re-raised in the trainer)."""


def collate(items: list):
    try:
        return default_collate(items)
    except (TypeError, RuntimeError) as exc:
        raise BatchError(f"{last_line(exc)}. __getitem__ should return tensors, numbers or strings, or tuples, "
                         "lists and dicts of them, with the same shapes for every item") from None


def to_device(batch, device: torch.device):
    """Move a batch to the device: tensors, in any nesting of tuples, lists and dicts."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)  # namedtuples too
    return batch


def last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def my_share(sampler: DistributedSampler, dataset_len: int, ctx: DistContext) -> list[int]:
    """This rank's sample indices for the sampler's current epoch."""
    # Trap: DistributedSampler pads with repeated samples so every rank gets as many; they would be
    # trained twice and counted twice in metrics. The real ones come first: keep only those.
    return list(sampler)[: len(range(ctx.rank, dataset_len, ctx.world_size))]


def seed_everything(seed: int) -> None:
    """Seed torch (every device), Python's random and numpy."""
    torch.manual_seed(seed)
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def check_datasets_agree(train_set: Dataset, eval_set: Dataset | None, ctx: DistContext) -> None:
    """Every rank built its own datasets: a cheap check that they are the same (their lengths)."""
    if not ctx.distributed:
        return
    sizes = [len(train_set), len(eval_set) if eval_set is not None else 0]
    both = torch.tensor(sizes + [-n for n in sizes], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ctx.control_group)  # largest, and minus the smallest
    (most_train, most_eval), (least_train, least_eval) = both[:2].int().tolist(), (-both[2:]).int().tolist()
    if (most_train, most_eval) != (least_train, least_eval):
        fail(f"the ranks built different datasets ({least_train} to {most_train} training samples, {least_eval} to "
             f"{most_eval} evaluation samples): build_datasets must give every rank the same data (split with a "
             "seeded generator, from storage every node sees)", ctx=ctx)


def place_dataset(dataset: Dataset, ctx: DistContext) -> Dataset:
    """In-memory tensor datasets move to the GPU once, so batches never cross PCIe. (Data larger
    than GPU memory belongs in a Dataset that loads on demand: it goes through the DataLoader.)"""
    if isinstance(dataset, TensorDataset) and ctx.device.type == "cuda":
        return TensorDataset(*(t.to(ctx.device) for t in dataset.tensors))
    return dataset


# ---------------------------------------------------------------------------
# Model: replace build_model() with your own.
# ---------------------------------------------------------------------------


def build_model(args) -> nn.Module:
    """A small MLP classifier for the default task."""
    norm = (lambda: nn.BatchNorm1d(HIDDEN)) if args.batch_norm else nn.Identity
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), norm(), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), norm(), nn.ReLU(),
        nn.Linear(HIDDEN, NUM_CLASSES),
    )


def flops_per_sample(model: nn.Module) -> float:
    """Training FLOPs per sample, for the MFU figure: 6 per parameter (2 forward, 4 backward). Exact
    for the matmuls of dense layers; replace it for convolutions or attention."""
    return 6.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)


# Dense peak TFLOP/s of one GPU, (16-bit tensor cores, fp32), from the datasheets; first match wins.
GPU_PEAK_TFLOPS = [("H100 PCIe", 756.0, 51.2), ("H100", 989.4, 66.9), ("H200", 989.4, 66.9), ("GH200", 989.4, 66.9),
                   ("A100", 312.0, 19.5), ("L40S", 362.1, 91.6), ("L4", 121.0, 30.3), ("V100", 125.0, 15.7)]


def gpu_peak_tflops(device_name: str, amp: str) -> float | None:
    """Peak TFLOP/s of one GPU at the precision training runs in; None for a GPU not in the table."""
    for key, half, single in GPU_PEAK_TFLOPS:
        if key in device_name:
            return half if amp != "off" else single
    return None


def wrap_model(model: nn.Module, args, ctx: DistContext) -> nn.Module:
    """DDP: wrap the model so backward() all-reduces (averages) gradients across ranks."""
    if not ctx.distributed:
        return model
    if args.sync_bn:  # before wrapping: DDP must see the SyncBatchNorm modules
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp_model = DDP(
        model,
        device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,  # None on CPU
        gradient_as_bucket_view=True,  # gradients live in the all-reduce buckets: one copy less
    )
    if args.grad_compression == "bf16":
        ddp_model.register_comm_hook(None, bf16_allreduce_hook)
    return ddp_model


def bf16_allreduce_hook(process_group, bucket):
    """DDP communication hook: average the gradient bucket in bfloat16. torch's own bf16 hook needs
    NCCL (and DDP checks it by that hook's name, hence another name); this one works on gloo too.
    Opt-in: it changes the numerics."""
    group = process_group or dist.group.WORLD
    compressed = bucket.buffer().to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer = bucket.buffer()
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def zero_gradient_backward(ddp_model: DDP) -> None:
    """DDP: a forward and backward through DDP that touches no data and contributes zero gradients,
    so this rank takes part in the step's gradient all-reduce when it has no sample of its own.
    The model's forward is swapped for one that uses every parameter and no randomness."""
    module = ddp_model.module
    params = [p for p in module.parameters() if p.requires_grad]
    module.forward = lambda *_: sum(p.sum() for p in params) * 0.0
    try:
        ddp_model().backward()
    finally:
        del module.forward  # back to the class's own forward


def warm_up_ddp(ddp_model: nn.Module, ctx: DistContext) -> None:
    """DDP all-reduces its first backward differently from every later one (it rebuilds its buckets
    in between); with more than two ranks that changes the rounding, so without a warm-up the first
    step after a resume would not be bit-identical to the same step of an uninterrupted run. One
    zero-gradient backward, before training: no data, no RNG, no BatchNorm statistics touched."""
    if ctx.distributed:
        zero_gradient_backward(ddp_model)
        ddp_model.zero_grad(set_to_none=True)


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    # The fused kernel updates all parameters in one pass (CPU and CUDA); about 30% faster here.
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)


def build_scheduler(optimizer, warmup_steps: int, total_steps: int):
    """Linear warmup, then cosine decay to zero at the last optimizer step."""

    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------
# Checkpoints: written by rank 0, atomically; read by every rank onto its own device.
# ---------------------------------------------------------------------------


def atomic_save(obj, path: str, keep_previous: str | None = None) -> None:
    """Write to a temp file, flush + fsync, then rename: a crash never leaves a torn file.
    With keep_previous, the file being replaced is kept under that name."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if keep_previous and os.path.exists(path):
        os.replace(path, keep_previous)
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def checkpoint_paths(out_dir: str) -> tuple[str, str]:
    return os.path.join(out_dir, "checkpoint.pt"), os.path.join(out_dir, "checkpoint.prev.pt")


def save_checkpoint(state: dict, out_dir: str, ctx: DistContext) -> None:
    """Rank 0 writes checkpoint.pt; the one before it stays as checkpoint.prev.pt."""
    # Each rank's RNG state, gathered so a resumed run draws the same random numbers.
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if numpy is not None:
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        rng["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]  # plain values: weights_only loads them
    if ctx.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(ctx.device)
    rng_states = [rng]
    if ctx.distributed:
        rng_states = [None] * ctx.world_size
        dist.all_gather_object(rng_states, rng, group=ctx.control_group)
    if ctx.is_main:
        path, prev = checkpoint_paths(out_dir)
        atomic_save({**state, "rng": rng_states}, path, keep_previous=prev)


def load_checkpoint(args, ctx: DistContext) -> tuple[dict, str] | None:
    """Find and read the checkpoint to resume from, or None for a fresh start."""
    if args.resume == "never":
        return None
    if args.resume == "auto":
        candidates = [p for p in checkpoint_paths(args.out_dir) if os.path.exists(p)]
    elif os.path.isfile(args.resume):
        candidates = [args.resume]
    else:
        fail(f"--resume {args.resume}: no such file", ctx=ctx)
    problems = []
    for path in candidates:
        try:
            # Trap: without map_location every rank would load the tensors onto the GPU that saved them.
            ckpt = torch.load(path, map_location=ctx.device, weights_only=True)
            if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
                raise ValueError("not a ddp_train.py checkpoint")
        except Exception as exc:
            reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
            problems.append((path, f"{path} is unreadable ({reason})"))
            continue
        if problems and ctx.is_main:
            # Set the unreadable file aside (kept for a post-mortem), or the next save would
            # rotate it over this good one.
            for bad, problem in problems:
                print(f"{PROG}: warning: {problem}; resuming from {path} instead; "
                      f"the unreadable file is now {bad}.unreadable", file=sys.stderr, flush=True)
                os.replace(bad, f"{bad}.unreadable")
        return ckpt, path
    if problems:  # never start fresh over a checkpoint we could not read
        fail("; ".join(p for _, p in problems) + "; move it away, or pass --resume never to start over", ctx=ctx)
    return None


def run_config(args, ctx: DistContext, lr: float) -> dict:
    """What defines the run's trajectory: a resume must match it. Note the global batch,
    not its factors: 2 processes x 32 continue exactly as 1 process x 64 would."""
    return {
        "seed": args.seed, "num_samples": args.num_samples, "epochs": args.epochs, "lr": lr,
        "global_batch_size": args.batch_size * ctx.world_size * args.grad_accum,
        "warmup_steps": args.warmup_steps, "amp": args.amp, "batch_norm": args.batch_norm,
    }


def check_resumable(ckpt: dict, config: dict, path: str, ctx: DistContext) -> None:
    differences = [f"{k} {ckpt['config'].get(k)} -> {v}" for k, v in config.items() if ckpt["config"].get(k) != v]
    if differences:
        hint = ""
        if "global_batch_size" in " ".join(differences):
            hint = " (with another world size, keep batch-size x world-size x grad-accum the same)"
        fail(f"cannot resume from {path}: {', '.join(differences)}{hint}; rerun with the same settings, or --resume never to start over", ctx=ctx)


# ---------------------------------------------------------------------------
# Preemption: a signal only sets a flag; ranks agree on it at step boundaries.
# ---------------------------------------------------------------------------


class StopSignal:
    """Remembers SIGTERM / SIGUSR1 (what torchrun, Kubernetes and SLURM's --signal send) and Ctrl-C.
    The handler runs no collective (trap: a collective inside a handler deadlocks); instead
    should_stop() is called by every rank at every optimizer step and returns the same answer
    on all of them. The agreement lags one step: each call starts an all-reduce (MAX) of this
    rank's flag and reads the one started a step earlier, so it never waits on the network.
    A second Ctrl-C, a second or more after the first, stops at once without saving."""

    def __init__(self, ctx: DistContext):
        self.ctx, self.received, self.received_at, self.pending = ctx, 0, 0.0, None
        self.flag = torch.zeros(1)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        # A launcher that forwards the terminal's Ctrl-C delivers it twice within moments: once.
        if signum == signal.SIGINT and self.received == signal.SIGINT and time.monotonic() - self.received_at > 1.0:
            raise KeyboardInterrupt
        if not self.received:
            self.received, self.received_at = signum, time.monotonic()

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.received == signal.SIGINT else EXIT_PREEMPTED

    def should_stop(self) -> bool:
        if not self.ctx.distributed:
            return self.received != 0
        stop = False
        if self.pending is not None:
            self.pending.wait()
            stop = self.flag.item() > 0
        self.flag = torch.tensor([float(self.received != 0)])
        self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.ctx.control_group, async_op=True)
        return stop

    def close(self):
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


# ---------------------------------------------------------------------------
# Training and evaluation
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Progress:
    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0  # optimizer steps done in the current epoch
    step: int = 0  # optimizer steps done in total
    loss_sum: float = 0.0  # global train-loss sum and sample count of the current epoch
    samples: int = 0  # ... carried by checkpoints so a resumed epoch logs the exact mean


def autocast(args, ctx: DistContext):
    if args.amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(ctx.device.type, dtype=torch.bfloat16 if args.amp == "bf16" else torch.float16)


@torch.no_grad()
def evaluate(model: nn.Module, loader: Loader, args, ctx: DistContext) -> tuple[float, float, int]:
    """(loss, accuracy, samples) over the whole eval set, each sample counted exactly once.
    Runs the unwrapped model: DDP's forward may sync, and no collective runs until the end."""
    model.eval()
    sampler = DistributedSampler(loader.dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    indices = my_share(sampler, len(loader.dataset), ctx)
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, samples
    for x, y in loader.batches(indices, EVAL_EPOCH):
        with autocast(args, ctx):
            logits = model(x)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == y).sum()
        totals[2] += len(y)
    loss_sum, correct, count = all_reduce_sum(totals, ctx).tolist()
    model.train()
    return loss_sum / count, correct / count, int(count)


def train(args, ctx: DistContext, stop: StopSignal) -> int:
    """Train; return the process exit code (0, or EXIT_PREEMPTED after a stop signal)."""
    log = print if ctx.is_main else (lambda *a, **k: None)  # rank 0 speaks for everyone
    if args.sync_bn and ctx.distributed and ctx.device.type != "cuda":
        fail("--sync-bn needs CUDA: torch's SyncBatchNorm has no CPU implementation", ctx=ctx)
    # Seeded first, the same on every rank: a split made without its own generator agrees.
    seed_everything(args.seed)
    train_set, eval_set = (place_dataset(d, ctx) for d in build_datasets(args))
    check_datasets_agree(train_set, eval_set, ctx)

    # The same initial weights on every rank (DDP also broadcasts rank 0's at wrap time) ...
    seed_everything(args.seed)
    model = build_model(args).to(ctx.device)
    # ... then each rank its own stream for dropout and other randomness in the model.
    seed_everything(mix_seed(args.seed, RANK_STREAM, ctx.rank))  # DDP: or every rank draws the same masks
    global_batch = args.batch_size * ctx.world_size * args.grad_accum
    lr = args.lr * (ctx.world_size * args.grad_accum if args.scale_lr else 1)
    optimizer = build_optimizer(model, lr)

    # DDP: every rank reads its own shard of the data. In one process the same sampler hands
    # out everything, in the same order as the union of N ranks.
    sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed)
    steps_per_epoch = math.ceil(len(train_set) / global_batch)
    scheduler = build_scheduler(optimizer, args.warmup_steps, args.epochs * steps_per_epoch)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=args.amp == "fp16")

    # Resume: every rank reads the checkpoint onto its own device.
    config = run_config(args, ctx, lr)
    if ctx.is_main:
        os.makedirs(args.out_dir, exist_ok=True)
    progress = resume(args, ctx, config, steps_per_epoch, model, optimizer, scheduler, scaler)
    metrics_path = start_metrics_file(args.out_dir, progress, ctx)

    ddp_model = wrap_model(model, args, ctx)
    warm_up_ddp(ddp_model, ctx)
    forward = torch.compile(ddp_model) if args.compile else ddp_model
    log(f"{PROG}: {ctx.launcher}, world size {ctx.world_size} ({ctx.local_world_size}/node), "
        f"{ctx.backend if ctx.distributed else 'no process group'}, {ctx.device}, "
        f"{torch.get_num_threads()} thread(s)/process")
    eval_size = len(eval_set) if eval_set is not None else 0
    log(f"global batch {global_batch} = {args.batch_size}/process x {ctx.world_size} x {args.grad_accum} accum, "
        f"lr {lr:g}, {len(train_set):,} train / {eval_size:,} eval samples, {steps_per_epoch} steps/epoch")

    start, stopped, first_step_at, peak = time.perf_counter(), False, None, peak_flops(args, ctx)
    window_size = args.batch_size * args.grad_accum  # one rank's samples per optimizer step
    loader = Loader(train_set, args.batch_size, ctx, args.workers, args.seed)
    eval_loader = Loader(eval_set, args.batch_size, ctx, args.workers, args.seed) if eval_size else None
    while progress.epoch < args.epochs and not stopped:
        sampler.set_epoch(progress.epoch)  # Trap: without it every epoch reuses the same shuffle
        mine = my_share(sampler, len(train_set), ctx)
        # Mid-epoch resume: the batches already trained are skipped without being loaded.
        first = progress.step_in_epoch
        micro_batches = loader.batches(mine[first * window_size :], progress.epoch)
        local_loss = torch.zeros((), dtype=torch.float64, device=ctx.device)  # summed on the device:
        local_samples, epoch_start, samples_before = 0, time.perf_counter(), progress.samples  # no sync per step
        for window in range(first, steps_per_epoch):
            # Step `window` trains the samples at global positions [window, window + 1) x global batch
            # of the epoch's order, however they are split into ranks and micro-batches. The ranks
            # may hold different numbers of them in the last step (or none): each loss is scaled so
            # that DDP's average over ranks is the mean over exactly the step's samples.
            step_samples = min(len(train_set), (window + 1) * global_batch) - window * global_batch
            n_micro = max(0, min(args.grad_accum, math.ceil((len(mine) - window * window_size) / args.batch_size)))
            for micro in range(n_micro):
                x, y = next(micro_batches)
                # DDP: all-reduce gradients only on the last micro-batch of the step.
                sync = contextlib.nullcontext() if micro == n_micro - 1 or not ctx.distributed else ddp_model.no_sync()
                with sync:
                    with autocast(args, ctx):
                        loss_sum = F.cross_entropy(forward(x).float(), y, reduction="sum")
                    scaler.scale(loss_sum * (ctx.world_size / step_samples)).backward()
                local_loss += loss_sum.detach()
                local_samples += len(y)
            if n_micro == 0:  # DDP: nothing left for this rank in this step, but it must join the all-reduce
                zero_gradient_backward(ddp_model)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            progress.step += 1
            progress.step_in_epoch += 1
            if first_step_at is None:  # start-up cost, once: when the first step has really finished
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize(ctx.device)
                first_step_at = time.time()

            log_now = args.log_every and progress.step % args.log_every == 0
            save_now = args.save_every and progress.step % args.save_every == 0
            stopped = stop.should_stop()  # the same answer on every rank
            if log_now or save_now or stopped:
                fold_epoch_stats(progress, local_loss, local_samples, ctx)
                local_samples = 0
            if log_now:
                log(f"  step {progress.step:>7,}  train_loss {progress.loss_sum / progress.samples:.4f}  "
                    f"lr {scheduler.get_last_lr()[0]:.3g}")
            if save_now or stopped:
                save_checkpoint(checkpoint_state(model, optimizer, scheduler, scaler, progress, config, ctx), args.out_dir, ctx)
            if stopped:
                break
        if stopped:
            break

        # End of epoch: the exact global train loss, then evaluation, then a checkpoint.
        fold_epoch_stats(progress, local_loss, local_samples, ctx)
        train_time = time.perf_counter() - epoch_start
        record = {"epoch": progress.epoch + 1, "train_loss": progress.loss_sum / progress.samples,
                  "eval_loss": None, "eval_accuracy": None, "eval_samples": 0}
        if eval_size:
            record["eval_loss"], record["eval_accuracy"], record["eval_samples"] = evaluate(model, eval_loader, args, ctx)
        samples_per_sec = (progress.samples - samples_before) / train_time
        if peak:  # model FLOPs utilisation: achieved training FLOP/s over all GPUs' peak
            record["mfu"] = samples_per_sec * flops_per_sample(model) / peak
        record.update(
            train_samples=progress.samples, samples_per_sec=samples_per_sec,
            world_size=ctx.world_size, effective_batch_size=global_batch, step=progress.step,
            lr=scheduler.get_last_lr()[0], epoch_time_s=train_time, first_step_at=first_step_at,
            **memory_stats(ctx),
        )
        progress = Progress(epoch=progress.epoch + 1, step=progress.step)
        log_epoch(record, args, metrics_path, ctx)
        save_checkpoint(checkpoint_state(model, optimizer, scheduler, scaler, progress, config, ctx), args.out_dir, ctx)

    stop.close()
    if stopped:
        log(f"stopped by a signal at step {progress.step}: {os.path.join(args.out_dir, 'checkpoint.pt')} saved; "
            f"rerun the same command to continue (exit code {stop.exit_code})")
    elif ctx.is_main:
        # Trap: save the raw module; DDP would prefix every key with "module.", torch.compile with "_orig_mod.".
        atomic_save(model.state_dict(), os.path.join(args.out_dir, "model.pt"))
        log(f"saved {os.path.join(args.out_dir, 'model.pt')}: {progress.epoch} epoch(s), {progress.step} steps, "
            f"{time.perf_counter() - start:.1f} s")
    if ctx.distributed:
        dist.barrier()  # the other ranks wait for rank 0's files before anyone leaves
    return stop.exit_code if stopped else 0


def resume(args, ctx: DistContext, config: dict, steps_per_epoch: int, model, optimizer, scheduler, scaler) -> Progress:
    """Load the checkpoint to continue from (if any) into the training objects; return where we are."""
    found = load_checkpoint(args, ctx)
    progress = Progress()
    if found:
        ckpt, path = found
        check_resumable(ckpt, config, path, ctx)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        progress = Progress(ckpt["epoch"], ckpt["step_in_epoch"], ckpt["step"])
        if ctx.is_main:  # the epoch's global sums so far, held by rank 0 alone so they count once
            progress.loss_sum, progress.samples = ckpt["loss_sum"], ckpt["samples"]
        if ckpt["world_size"] == ctx.world_size:
            restore_rng(ckpt["rng"][ctx.rank], ctx)
        else:  # no saved stream fits a new world size: a fresh, deterministic one per rank
            seed_everything(mix_seed(args.seed, RANK_STREAM, ctx.rank, progress.step))
        if ctx.is_main:
            where = ("the end of training" if progress.epoch >= args.epochs else
                     f"epoch {progress.epoch + 1}, step {progress.step_in_epoch}/{steps_per_epoch}")
            print(f"resumed from {path} at {where} ({progress.step} optimizer steps done, "
                  f"saved by world size {ckpt['world_size']})", flush=True)
    agree_on_resume_point(progress, ctx)
    return progress


def start_metrics_file(out_dir: str, progress: Progress, ctx: DistContext) -> str:
    """metrics.jsonl keeps the lines of completed epochs (none on a fresh start), so a resumed
    run never logs an epoch twice."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if ctx.is_main:
        kept = []
        if progress.step and os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["epoch"] <= progress.epoch]
        with open(path, "w") as f:
            f.writelines(kept)
    return path


def peak_flops(args, ctx: DistContext) -> float | None:
    """All GPUs' peak FLOP/s together, for the MFU figure; None on CPU or a GPU we do not know."""
    if ctx.device.type != "cuda":
        return None
    per_gpu = args.peak_tflops or gpu_peak_tflops(torch.cuda.get_device_name(ctx.device), args.amp)
    return per_gpu * 1e12 * ctx.world_size if per_gpu else None


def fold_epoch_stats(progress: Progress, local_loss: torch.Tensor, local_samples: int, ctx: DistContext) -> None:
    """Add every rank's loss sum and sample count since the last fold to the epoch's totals."""
    totals = torch.stack([local_loss, torch.tensor(float(local_samples), dtype=torch.float64, device=ctx.device)])
    loss_sum, samples = all_reduce_sum(totals, ctx).tolist()
    progress.loss_sum += loss_sum
    progress.samples += int(samples)
    local_loss.zero_()


def checkpoint_state(model, optimizer, scheduler, scaler, progress: Progress, config: dict, ctx: DistContext) -> dict:
    return {
        "format": CHECKPOINT_FORMAT,
        "model": model.state_dict(),  # the raw module: no "module." prefix
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        **dataclasses.asdict(progress),
        "config": config,
        "world_size": ctx.world_size,
    }


def restore_rng(rng: dict, ctx: DistContext) -> None:
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in rng["python"]))
    torch.set_rng_state(rng["torch"].cpu())
    if numpy is not None and "numpy" in rng:
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, gauss))
    if "cuda" in rng and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"].cpu(), ctx.device)


def agree_on_resume_point(progress: Progress, ctx: DistContext) -> None:
    """Every rank read the checkpoint itself; make sure they all found the same one."""
    if not ctx.distributed:
        return
    steps = torch.tensor([progress.step, -progress.step], dtype=torch.float64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=ctx.control_group)
    if steps[0] != -steps[1]:
        fail(f"ranks resumed from different checkpoints (steps {int(-steps[1])} to {int(steps[0])}): "
             "every node must see the same --out-dir (shared storage)", ctx=ctx)


def memory_stats(ctx: DistContext) -> dict:
    """This process's peak memory: resident host memory, and GPU memory where there is one."""
    stats = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
    if ctx.device.type == "cuda":
        stats["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
    return stats


def log_epoch(record: dict, args, metrics_path: str, ctx: DistContext) -> None:
    if not ctx.is_main:
        return
    ev = "" if record["eval_loss"] is None else (
        f"  eval_loss {record['eval_loss']:.4f}  eval_acc {100 * record['eval_accuracy']:6.2f}%")
    mfu = f"  MFU {100 * record['mfu']:5.2f}%" if "mfu" in record else ""
    print(f"epoch {record['epoch']:>3}/{args.epochs}  train_loss {record['train_loss']:.4f}{ev}  "
          f"{record['samples_per_sec']:>9,.0f} samples/s{mfu}  world {record['world_size']}  "
          f"batch {record['effective_batch_size']}  {record['epoch_time_s']:6.2f} s", flush=True)
    with open(metrics_path, "a") as f:
        f.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def run(args) -> int:
    """One process's whole life: join, train, leave."""
    ctx = init_distributed(args)
    stop = StopSignal(ctx)
    try:
        return train(args, ctx, stop)
    except BaseException as exc:
        # The traceback keeps train()'s frame, and with it the DDP model, alive: drop those
        # locals so teardown below can release the model before the process group.
        traceback.clear_frames(exc.__traceback__)
        if isinstance(exc, KeyboardInterrupt) or (stop.received == signal.SIGINT and lost_a_peer(exc)):
            if ctx.is_main:  # every rank got the Ctrl-C; one line says it
                print(f"{PROG}: stopped by a second Ctrl-C, without saving; rerun the same command to continue "
                      "from the last checkpoint", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_INTERRUPTED) from None
        if ctx.distributed and lost_a_peer(exc):  # say what happened, not where we were waiting
            reason = str(exc).strip().splitlines()[0]
            fail(f"rank {ctx.rank} lost contact with another process (it crashed, was killed, or its node left "
                 f"the network); rerun to resume from the last checkpoint. The error: {reason}", code=1)
        raise
    finally:
        cleanup_distributed(ctx)


def lost_a_peer(exc: BaseException) -> bool:
    """A collective failed because another rank is gone (gloo reports it as a RuntimeError)."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


def _spawn_worker(local_rank: int, args) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                      WORLD_SIZE=str(args.spawn), LOCAL_WORLD_SIZE=str(args.spawn))
    # A spawned process inherits "spawn" as its default start method, so its DataLoader workers would
    # each start a fresh interpreter; give it the platform's default, as a torchrun worker has.
    mp.set_start_method(None, force=True)
    code = run(args)
    if code:
        raise SystemExit(code)


def spawn_workers(args) -> int:
    """--spawn N: start N local workers ourselves, on a free port, and forward stop signals."""
    if "RANK" in os.environ or "SLURM_STEP_NUM_TASKS" in os.environ:
        fail("--spawn starts its own processes: run it with plain python, not under torchrun or srun")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    context = mp.spawn(_spawn_worker, args=(args,), nprocs=args.spawn, join=False)
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: [os.kill(p.pid, signum) for p in context.processes if p.is_alive()])
    try:
        while not context.join(grace_period=15):  # after a failure the others get 15 s to end on their own
            pass
    except mp.ProcessExitedException as exc:
        return exc.exit_code if exc.exit_code > 0 else 1
    except mp.ProcessRaisedException as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.spawn:
        return spawn_workers(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
