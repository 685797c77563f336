"""ddp_train.py: the minimal reference PyTorch DistributedDataParallel (DDP) training script.

One file, torch only (2.4 to 2.15). Launch it unchanged:

    python ddp_train.py                                  # one process: the CPU or one GPU
    python ddp_train.py --spawn 2                        # N local processes, no launcher to type
    torchrun --nproc_per_node=4 ddp_train.py             # one node, 4 processes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 \\
        --rdzv-id=job1 ddp_train.py                      # the same on each of 2 nodes
    srun --ntasks-per-node=8 --gpus-per-node=8 python ddp_train.py     # SLURM: a task per GPU
    python -m torch.distributed.launch --nproc_per_node=2 ddp_train.py  # the legacy launcher

Read it top to bottom:
  1. your task: its flags and functions. Edit them, or assign yours from a script that imports
     this file (examples/digits.py);
  2. init_distributed() and cleanup_distributed(): join the process group, and leave it;
  3. train(): the tutorials' loop in torch's own names, its setup first, then the small functions
     it calls (one step, the loss all_reduce, evaluation, checkpoints, the stop agreement);
  4. helpers.
Each line that DDP adds to a plain training loop says "DDP:", each classic trap "Trap:".
"""

import argparse
import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
import zipfile
from collections.abc import Mapping

import torch
import torch.distributed as dist

# Trap: the functions of this module take the process group that exists when it is first imported
# as their default group. DDP imports it after the group is made, and that reference keeps gloo's
# threads alive past destroy_process_group, which can abort the exit ("terminate called").
import torch.distributed.nn.functional  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing import errors
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, default_collate

try:  # optional: where a Dataset draws from numpy, its generator is seeded and checkpointed too
    import numpy
except ImportError:
    numpy = None

PROG = os.path.basename(sys.argv[0])  # this script's name in its lines, or yours (mine.py)
# Stop, save and exit 75: preemption (torchrun, SLURM, Kubernetes), and Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


# ====== 1. Your task: replace these ==============================================================

# What compute_loss's count counts: "samples", or "tokens" for a language model.
COUNT_UNIT = "samples"

# Your task's own flags, beside the script's: --name, its default, what it does. The default gives
# the type (0.0 for a float, not 0). True or False makes a switch: --name turns it on, --no-name
# off. Read it as args.name.
TASK_FLAGS = [
    ("num-samples", 32768, "the default task's training samples"),
    ("eval-samples", 4096, "the default task's evaluation samples (0: none)"),
]

FEATURES, CLASSES = (
    32,
    10,
)  # the default task: Gaussian inputs labelled by a random linear "teacher"


class InMemory(TensorDataset):
    """The default task's tensors: a whole batch at once (one gather, not a loop over samples)."""

    def __getitems__(self, indices):
        rows = torch.tensor(indices)
        return tuple(tensor.index_select(0, rows) for tensor in self.tensors)


def build_datasets(args):
    """(train_set, eval_set): map-style Datasets (with a __len__), the same on every rank; eval_set
    may be None or empty (no evaluation)."""
    check(args.num_samples >= 0, f"--num-samples is {args.num_samples}: it is at least 0")
    check(args.eval_samples >= 0, f"--eval-samples is {args.eval_samples}: it is at least 0")
    generator = torch.Generator().manual_seed(args.seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)

    def make(size):
        inputs = torch.randn(size, FEATURES, generator=generator)
        return InMemory(inputs, (inputs @ teacher).argmax(dim=1))

    return make(args.num_samples), make(args.eval_samples)


def build_model(args):
    """Any nn.Module. The default: a small MLP classifier."""
    return nn.Sequential(
        nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES)
    )


def compute_loss(model, batch):
    """(loss, count) or (loss, count, metrics) of one batch (collate_fn's, on the device).

    model: in training the DDP model (compiled with --compile), whose forward DDP must see; in
    evaluation the raw module, in eval mode. loss: the MEAN over count items, as F.cross_entropy
    returns it. count: an int or a 0-dim tensor, the samples (or, with COUNT_UNIT = "tokens", a
    language model's real tokens: (labels != -100).sum()). metrics: {name: mean over the same
    items}, logged as train_<name> and eval_<name>. The script weighs each mean by its count, so
    every gradient and figure is the exact mean over all items of a step (a mean of no items weighs
    nothing, but its gradient must be finite, as F.cross_entropy's is)."""
    inputs, targets = batch
    logits = model(inputs).float()
    loss = F.cross_entropy(logits, targets)
    if model.training:  # (accuracy only in evaluation: training stays fast)
        return loss, len(targets)
    return loss, len(targets), {"accuracy": (logits.argmax(dim=1) == targets).float().mean()}


def collate_fn(items):
    """What the Dataset gave for a batch -> the batch: a list of items, which torch's
    default_collate stacks (items of different shapes need one that pads: examples/tinylm.py); or
    InMemory's whole batch, a tuple of tensors already, which stays."""
    return items if isinstance(items, tuple) else default_collate(items)


def build_optimizer(args, model):
    """One optimizer, or a list. The default: AdamW as nanoGPT sets it up, --weight-decay on weights
    (matrices and embeddings) only, not biases and norms; fused: one kernel for all."""
    params = list(model.parameters())
    decayed = [p for p in params if p.dim() >= 2]
    not_decayed = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decayed, "weight_decay": args.weight_decay},
        {"params": not_decayed, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, fused=True)


def build_scheduler(args, optimizer, total_steps):
    """A torch LRScheduler for one optimizer (OneCycleLR...), stepped after each optimizer step and
    checkpointed. The default: a linear warmup over --warmup-steps, then cosine decay to 0."""

    def factor(step):  # step: the optimizer steps done before this one
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        decay_steps = max(1, total_steps - args.warmup_steps)
        return (1 + math.cos(math.pi * (step - args.warmup_steps) / decay_steps)) / 2

    return LambdaLR(optimizer, factor)


def report(record, args, model):
    """Rank 0 calls this with each record it logs (after the checkpoint of the record's step, where
    that step saves): send it to W&B or TensorBoard here. args: the flags (args.out_dir: the run's
    files); model: the raw module, whose state_dict() holds the weights of this step."""


# ====== 2. Joining the process group, and leaving it =============================================


@dataclasses.dataclass
class DistContext:
    """This process's place in the run."""

    rank: int  # 0 to world_size - 1, over all nodes
    world_size: int
    device: torch.device
    # small CPU messages (the stop flag, the random states, the barrier) go over gloo: on CPUs the
    # process group itself, on GPUs a gloo group beside NCCL (None: a single process, no group)
    cpu_group: object = None


def init_distributed(timeout_s):
    """Find this process's place (torchrun's variables, which --spawn and the legacy launcher set
    too; a bare srun's, translated; plain python: one process), pick its device, join the group."""
    if "RANK" not in os.environ:
        os.environ.update(torchrun_variables_from_slurm(os.environ))  # {} outside SLURM
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(local_rank)
    if world_size == 1:
        return DistContext(rank, world_size, device)
    timeout = datetime.timedelta(seconds=timeout_s)
    # DDP: join the process group: NCCL on GPUs, gloo on CPUs (a missing peer: an error in time)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        store = round_store(timeout)  # None: torchrun's env:// rendezvous
        dist.init_process_group(
            backend, timeout=timeout, store=store, rank=rank, world_size=world_size
        )
    except Exception as exc:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        fail(
            f"rank {rank} could not join the others at {where} within {timeout_s:g} s: is "
            "MASTER_ADDR node 0's address as this node sees it, and MASTER_PORT free there and "
            f"open? ({one_line(exc)})",
            code=1,
            every_rank=True,
        )
    if backend == "nccl":
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    else:
        cpu_group = dist.group.WORLD
    return DistContext(rank, world_size, device, cpu_group)


def pick_device(local_rank):
    """This process's device: cuda:LOCAL_RANK where there are GPUs, else the CPU (on a GPU machine
    CUDA_VISIBLE_DEVICES= trains on its CPUs)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if local_rank < gpus:
        index = local_rank
    elif gpus == 1 and "LOCAL_WORLD_SIZE" not in os.environ:
        index = 0  # srun --gpus-per-task=1 shows each task its own GPU only
    else:
        processes = os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)
        fail(
            f"{processes} processes on this node and {gpus} GPU(s), but NCCL needs one per "
            "process: start one per GPU, or train on the CPUs with CUDA_VISIBLE_DEVICES=",
            every_rank=True,
        )
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)  # DDP: a GPU per process, current before anything touches CUDA
    return device


def round_store(timeout):
    """A store of this round of workers' own, where torchrun (2.5+) shares its store across the
    rounds of a job; else None.

    Trap: torchrun's store outlives a round of workers, at a restart or when a node joins or
    leaves. A new round would find the old round's keys there and wait for workers that are gone
    (pytorch/pytorch#135712). So rank 0 serves a new store for each round and leaves its port in
    torchrun's store. The other ranks read the port there until it answers: the port of an old
    round's store refuses a connection, since its rank 0 has exited."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host = env["MASTER_ADDR"]  # the node of rank 0, which serves torchrun's store too
    shared = dist.TCPStore(host, int(env["MASTER_PORT"]), timeout=timeout)
    if env["RANK"] == "0":
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        shared.set("ddp_train_round_store", str(store.port))
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        port = int(shared.get("ddp_train_round_store"))
        try:
            socket.create_connection((host, port), timeout=10).close()
            return dist.TCPStore(host, port, timeout=timeout)
        except ConnectionRefusedError:  # an old round's port: its rank 0 has exited
            time.sleep(0.1)
    raise TimeoutError(f"rank 0 of this round served no store within {timeout}")


def cleanup_distributed(ctx):
    """Leave the process group, also after an error."""
    gc.collect()  # Trap: the DDP model freed before its process group: gloo can abort at exit
    if not dist.is_initialized():
        return
    # Trap: torch < 2.8 frees a group holding the GIL, which a gloo thread freeing a tensor may wait
    # for (a rare hang at exit): gloo's part outlives the group, then goes without the GIL
    # (pytorch/pytorch#154976)
    gloo_backend = ctx.cpu_group._get_backend(torch.device("cpu"))
    ctx.cpu_group = None  # (its last reference: the group goes with destroy_process_group)
    dist.destroy_process_group()  # DDP: leave the process group
    del gloo_backend


# ====== 3. Training ==============================================================================


@errors.record  # under torchrun, a worker's traceback shows in torchrun's failure summary
def main(argv=None):
    args = parse_args(argv)
    if args.spawn and "RANK" not in os.environ:
        return spawn(args.spawn, argv)  # the processes' exit code, once they have all exited
    ctx = init_distributed(args.timeout)
    try:
        return evaluate_checkpoint(args, ctx) if args.eval_only else train(args, ctx)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # Trap: they hold the DDP model and the loaders
        raise
    finally:
        cleanup_distributed(ctx)


@dataclasses.dataclass
class Plan:
    """What a step is, and how many there are."""

    global_batch: int  # samples a step, over all ranks: --batch-size x world size x grad_accum
    grad_accum: int  # micro-batches a step on each rank
    steps_per_epoch: int  # full global batches only: an epoch leaves out its last, partial one
    total_steps: int


@dataclasses.dataclass
class Totals:
    """Sums over items, over all ranks: of the loss and each metric, each mean weighed by its count;
    and the count. A mean is a sum / the count."""

    sums: dict = dataclasses.field(default_factory=dict)
    count: float = 0.0

    def add(self, other):
        for name, value in other.sums.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        self.count += other.count

    def means(self, prefix):
        """{prefix + name: mean}; none where no item was counted (a window of no token)."""
        if not self.count:
            return {}
        return {f"{prefix}{name}": value / self.count for name, value in self.sums.items()}


@dataclasses.dataclass
class Progress:
    """The run's position, and the sums its next records report. Saved in every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch_totals: Totals = dataclasses.field(default_factory=Totals)  # of this epoch's steps
    window_totals: Totals = dataclasses.field(default_factory=Totals)  # since the last log line
    # The step's count over all ranks, as expected before the step: each micro-batch's mean is
    # weighed against it. Samples: the global batch. Tokens: the last step's (None: the first
    # micro-batches' tell); the gradients are rescaled to the step's real count after backward.
    expected_count: object = None
    # This step's records. The checkpoint holds them before they are written, so that a run that
    # resumes from it writes those that a stop or a crash left out.
    records: list = dataclasses.field(default_factory=list)

    @classmethod
    def from_dict(cls, saved):
        progress = cls(**saved)
        progress.epoch_totals = Totals(**saved["epoch_totals"])
        progress.window_totals = Totals(**saved["window_totals"])
        return progress


@dataclasses.dataclass
class Run:
    """What training holds, made by setup_training() in running order."""

    plan: Plan
    progress: Progress
    model: nn.Module  # the raw module: what is saved, evaluated and given to report()
    ddp_model: nn.Module  # DDP's wrapper, for no_sync() (the raw module in a single process)
    train_model: nn.Module  # what compute_loss gets in training: the DDP model, or its compiled one
    parts: dict  # every stateful part, by name: what a checkpoint saves and restores
    optimizers: list
    schedulers: list
    scaler: torch.amp.GradScaler  # fp16's loss scaling (disabled otherwise)
    autocast: object  # --amp's autocast, or a context that does nothing
    sampler: DistributedSampler
    batches: "StepBatches"
    loader: DataLoader
    eval_loader: DataLoader
    rank_sums: "RankSums"  # this rank's loss sums, since the last all_reduce_losses()


def train(args, ctx):
    """All ranks run every line together; rank 0 alone prints and writes. Returns the exit code."""
    run = setup_training(args, ctx)
    plan, progress = run.plan, run.progress
    # all ranks: first the records of the checkpoint's step that a stop or a crash left unwritten
    write_records(progress.records, args, ctx, run)
    if progress.step >= plan.total_steps and os.path.exists(f"{args.out_dir}/model.pt"):
        log(  # (a finished run without model.pt goes on to finish(), which writes it)
            f"{args.out_dir} holds a finished run ({progress.step} steps): nothing to train. Raise "
            "--epochs or --max-steps to train on, or pass another --out-dir"
        )
        return 0
    log_header(args, ctx, run)
    stop = StopAgreement(ctx)
    speed = Throughput(progress.step, plan.total_steps)
    while progress.step < plan.total_steps and not stop.agreed:
        epoch = progress.step // plan.steps_per_epoch
        epoch_end = min(plan.total_steps, (epoch + 1) * plan.steps_per_epoch)
        run.sampler.set_epoch(epoch)  # Trap: without it every epoch repeats the first one's shuffle
        run.batches.skip_steps = progress.step - epoch * plan.steps_per_epoch  # (a resumed epoch)
        epoch_started = time.perf_counter()
        micro_batches = iter(run.loader)  # the DataLoader's: train_step's for takes a step's
        while progress.step < epoch_end and not stop.agreed:
            stop.vote()  # all ranks: whether this rank got a stop signal, as the step starts
            step = progress.step + 1
            log_now = args.log_every and step % args.log_every == 0
            lr, grad_norm = train_step(run, ctx, args, micro_batches, want_norm=log_now)
            progress.step = step
            stop.count_votes()  # all ranks: did any rank get one? then all stop after this step
            eval_now = args.eval_every and step % args.eval_every == 0 and step < epoch_end
            save_now = args.save_every and step % args.save_every == 0
            save_now = save_now or step == epoch_end or stop.agreed
            if log_now or eval_now or save_now:  # all ranks: first, the losses since the last time
                reduced = all_reduce_losses(run, ctx)  # DDP: the loss all_reduce
                progress.epoch_totals.add(reduced)
                progress.window_totals.add(reduced)
                speed.items += reduced.count
            # This step's records. An eval or epoch record gets its evaluation when it is written.
            progress.records = []
            where = {"step": step, "epoch": epoch + 1}
            if log_now:
                figures = progress.window_totals.means("train_") | {"lr": lr}
                figures["grad_norm"] = grad_norm.item()
                figures |= speed.figures(step)
                progress.records.append({"kind": "progress"} | where | figures)
                progress.window_totals = Totals()
            if eval_now and len(run.eval_loader.dataset):
                progress.records.append({"kind": "eval"} | where)
            if step == epoch_end:  # the end of an epoch, or of the run
                figures = epoch_figures(run, ctx, epoch, lr, epoch_started)
                progress.records.append({"kind": "epoch"} | where | figures)
                progress.epoch_totals = Totals()
            # all ranks: the save comes first, so that the grace period after a stop goes to it
            if save_now:
                save_checkpoint(args, ctx, run)
            if not stop.agreed or step == plan.total_steps:  # (a stop: the rerun writes them first)
                write_records(progress.records, args, ctx, run)
    exit_code = finish(args, ctx, run, stopped=stop.agreed)
    stop.restore()  # only now: a signal that comes before model.pt is written only gets noted
    return exit_code


def write_records(records, args, ctx, run):
    """All ranks: the evaluations that eval and epoch records need; then rank 0 writes the records
    (after the step's checkpoint, so that report() may use the files)."""
    for record in records:
        if record["kind"] != "progress" and len(run.eval_loader.dataset):
            record |= evaluate(run.model, run.eval_loader, ctx, run.autocast)
        write_record(record, args, ctx, run.model, run.plan.total_steps)


def finish(args, ctx, run, stopped):
    """The exit code: 75 where a stop signal ended the run early (its checkpoint is saved); else
    0, once rank 0 has saved the weights. A rerun of a finished run without model.pt writes it
    from the checkpoint."""
    if stopped and run.progress.step < run.plan.total_steps:
        log(f"stopped by a signal at step {run.progress.step}; saved: rerun to resume (exit 75)")
        return 75
    if ctx.rank == 0:  # Trap: save the raw module: DDP prefixes "module.", compile "_orig_mod."
        atomic_save(run.model.state_dict(), f"{args.out_dir}/model.pt")
    log(f"saved {args.out_dir}/model.pt after {run.progress.step} steps")
    return 0


def setup_training(args, ctx):
    """All ranks: the data, the model, its optimizers and their state from the out-dir's last
    checkpoint (the run resumes), the DataLoaders and the DDP wrap, in running order."""
    train_set, eval_set, model = build_task(args, ctx)
    if args.sync_bn:
        check(ctx.device.type == "cuda", "--sync-bn needs GPUs (SyncBatchNorm runs on CUDA)")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    path, checkpoint = read_checkpoint(args.out_dir)
    plan = make_plan(args, ctx, len(train_set), path, checkpoint)
    optimizers = build_optimizer(args, model)
    optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    schedulers = [build_scheduler(args, opt, plan.total_steps) for opt in optimizers]
    autocast, amp_dtype = make_autocast(args, ctx.device)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp_dtype == torch.float16)
    parts = {"model": [model], "optimizers": optimizers, "schedulers": schedulers}
    parts["scaler"] = [scaler]
    expected_count = plan.global_batch if COUNT_UNIT == "samples" else None
    progress = Progress(expected_count=expected_count)
    seed_everything(args.seed + 1 + ctx.rank)  # DDP: each rank a random stream of its own (dropout)
    if checkpoint:
        progress = restore_checkpoint(args, parts, path, checkpoint, ctx)
    # The parts now hold what they need. On GPUs that frees the file's pages before the DataLoader
    # workers start, while on the CPU a restored optimizer keeps the loaded tensors as its state.
    del checkpoint
    # DDP: each rank reads its own share of each epoch's shuffle (drop_last: equal shares)
    sampler = DistributedSampler(
        train_set, ctx.world_size, ctx.rank, seed=args.seed, drop_last=True
    )
    batches = StepBatches(sampler, args.batch_size, plan)
    loader = DataLoader(train_set, batch_sampler=batches, **loader_options(args, ctx))
    eval_loader = make_eval_loader(args, ctx, eval_set)
    # Trap: the workers start now, once, before any collective: a fork while a gloo or NCCL thread
    # frees a finished one deadlocks the child on Python before 3.12 (CPython issue 112275)
    start_workers(loader)
    start_workers(eval_loader)
    check_same_start(progress.step, ctx)
    ddp_model = model
    if ctx.world_size > 1:
        # DDP: the wrap: it broadcasts rank 0's weights, then averages the gradients in its buckets
        ddp_model = DDP(
            model,
            find_unused_parameters=args.find_unused_parameters,
            gradient_as_bucket_view=True,
        )
    train_model = torch.compile(ddp_model) if args.compile else ddp_model
    rank_sums = RankSums(ctx.device, progress.step)
    if ctx.rank == 0:  # (after every check: a mistake writes nothing)
        os.makedirs(args.out_dir, exist_ok=True)
        written = drop_records_after(progress.step, args.out_dir)  # (no record twice)
        progress.records = [r for r in progress.records if r["kind"] not in written]
    if ctx.world_size > 1:  # all ranks: rank 0's list, as every rank evaluates for them
        unwritten = [progress.records]
        dist.broadcast_object_list(unwritten, src=0, group=ctx.cpu_group)
        progress.records = unwritten[0]
    return Run(
        plan, progress, model, ddp_model, train_model, parts, optimizers, schedulers, scaler,
        autocast, sampler, batches, loader, eval_loader, rank_sums,
    )  # fmt: skip


def build_task(args, ctx):
    """All ranks: (train_set, eval_set, model), the same on every rank and world size."""
    seed_everything(args.seed)  # first: a random split in build_datasets agrees across ranks
    train_set, eval_set = build_datasets(args)
    eval_set = eval_set or []
    check_datasets(train_set, eval_set)
    seed_everything(args.seed)  # the same initial weights, whatever the world size
    return train_set, eval_set, build_model(args).to(ctx.device)


def make_plan(args, ctx, train_size, path, checkpoint):
    # DDP: a step's global batch is per process x world size x accumulation. A run resumed on
    # another world size keeps its own, with another accumulation (nanoGPT divides its by world).
    global_batch = args.batch_size * ctx.world_size * args.grad_accum
    if checkpoint and checkpoint["global_batch"] != global_batch:
        if checkpoint["world_size"] == ctx.world_size:  # the same world: the flags differ
            fail(
                f"{path} trained with a global batch of {checkpoint['global_batch']}, this run's is "
                f"{global_batch}: pass the same --batch-size and --grad-accum, or another --out-dir"
            )
        global_batch = checkpoint["global_batch"]  # another world: its accumulation follows
    grad_accum, rest = divmod(global_batch, args.batch_size * ctx.world_size)
    if not grad_accum or rest:
        per_process = global_batch // ctx.world_size
        hint = "" if global_batch % ctx.world_size == 0 else ", on a world size that divides it"
        fail(
            f"the global batch of {global_batch} is not {ctx.world_size} processes x --batch-size "
            f"{args.batch_size} x a whole accumulation: pass a --batch-size that divides "
            f"{per_process}{hint}"
        )
    # Every step is a full global batch: an epoch leaves out its last, incomplete one (as nanoGPT).
    steps_per_epoch = train_size // global_batch
    check(
        steps_per_epoch > 0,
        f"the {train_size} training samples do not fill one global batch of {global_batch}: "
        "lower --batch-size or --grad-accum",
    )
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    return Plan(global_batch, grad_accum, steps_per_epoch, total_steps)


def train_step(run, ctx, args, micro_batches, want_norm):
    """All ranks: one optimizer step over this rank's next --grad-accum micro-batches. Returns the
    step's learning rate and its gradient norm (a tensor; None unless clipped or logged)."""
    progress = run.progress
    rank_items = 0  # this rank's items in this step (samples or tokens)
    for i, batch in enumerate(itertools.islice(micro_batches, run.plan.grad_accum)):
        batch = to_device(batch, ctx.device)
        last = i == run.plan.grad_accum - 1
        # DDP: all-reduce the gradients only in the backward of the step's last micro-batch
        with contextlib.nullcontext() if last or ctx.world_size == 1 else run.ddp_model.no_sync():
            with run.autocast:
                loss, count, metrics = unpack_loss(compute_loss(run.train_model, batch))
            run.rank_sums.add(loss, count, metrics)
            if progress.expected_count is None:  # a token run's first step: guess from this one
                progress.expected_count = sum_over_ranks(count, ctx) * run.plan.grad_accum
            # DDP: DDP averages the ranks' gradients: a mean weighs its share of the step's count
            # (samples: count x world / global batch, 1 / --grad-accum for full micro-batches)
            weight = count * ctx.world_size / progress.expected_count
            run.scaler.scale(loss * weight).backward()
        rank_items += count
    if COUNT_UNIT != "samples":
        # DDP: the step's count over all ranks, then every gradient as if weighed by it
        real_count = sum_over_ranks(rank_items, ctx)
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, (progress.expected_count / real_count).to(grads[0].dtype))
        progress.expected_count = real_count  # the next step's guess
    grad_norm = None
    if args.clip_grad_norm or want_norm:
        for optimizer in run.optimizers:
            run.scaler.unscale_(optimizer)  # Trap: clip and log the true gradients, not fp16's
        max_norm = args.clip_grad_norm or math.inf
        grad_norm = nn.utils.clip_grad_norm_(run.model.parameters(), max_norm)
    lr = run.optimizers[0].param_groups[0]["lr"]
    for optimizer, scheduler in zip(run.optimizers, run.schedulers):
        run.scaler.step(optimizer)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    run.scaler.update()
    return lr, grad_norm


class RankSums:
    """This rank's sums of the loss and each metric, each mean weighed by its count, and the count:
    in training since the last all_reduce_losses(), in evaluation since its start. They stay on
    the device, so that no step waits for the GPU."""

    def __init__(self, device, since_step):
        self.device = device
        self.since_step = since_step  # the sums are of the steps after this one
        self.sums = {}  # name -> a float64 0-dim tensor
        self.count = 0  # an int, or a tensor where compute_loss counts with one

    def add(self, loss, count, metrics):
        if not self.sums:  # the first micro-batch since the last reduction: a sum for each figure
            for name in ("loss", *metrics):
                self.sums[name] = torch.zeros((), dtype=torch.float64, device=self.device)
        self.sums["loss"] += loss.detach() * count
        for name, mean in metrics.items():
            self.sums[name] += (mean.detach() if torch.is_tensor(mean) else mean) * count
        self.count += count

    def packed(self):
        """The sums and the count, in one float64 tensor on the device."""
        return torch.stack([*self.sums.values(), on_device(self.count, self.device)])


def all_reduce_losses(run, ctx):
    """All ranks: every rank's training sums since the last call, added: the loss all_reduce of the
    tutorials (SUM: gloo's AVG is unreliable). Returns them as Totals; this rank's start again.
    A non-finite loss or weight stops every rank here, before any record or checkpoint has it."""
    rank_sums, step = run.rank_sums, run.progress.step
    names = list(rank_sums.sums)
    packed = rank_sums.packed()
    if ctx.world_size > 1:
        dist.all_reduce(packed)  # DDP: every rank's sums, added
    *sums, count = packed.tolist()
    run.rank_sums = RankSums(ctx.device, step)
    advice = (
        "the run diverged; nothing non-finite was saved. Lower --lr, or pass --clip-grad-norm 1.0"
    )
    if not math.isfinite(sums[0]):
        fail(f"the training loss is {sums[0]} at step {step}: {advice}", code=1)
    if not torch.stack([p.isfinite().all() for p in run.model.parameters()]).all():
        fail(f"the weights are not finite at step {step} (a non-finite gradient): {advice}", code=1)
    samples = (step - rank_sums.since_step) * run.plan.global_batch
    check(
        COUNT_UNIT != "samples" or count == samples,
        f"compute_loss counted {count:g} for {samples} samples, but COUNT_UNIT is samples: "
        'return the sample count, or set COUNT_UNIT to what it counts ("tokens")',
    )
    return Totals(dict(zip(names, sums)), count)


def sum_over_ranks(count, ctx):
    """A count over all ranks, as a float64 tensor on the device. It is at least 1: a step without
    a single token trains nothing."""
    total = on_device(count, ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(total)
    return total.clamp(min=1)


def on_device(number, device):
    """A count or a sum as a float64 tensor on the device. Trap: torch.as_tensor(an int,
    device="cuda") copies from pageable memory and makes the step wait for the GPU. A copy from
    pinned memory is queued on the stream, and the step goes on."""
    if torch.is_tensor(number) and number.device == device:
        return number.to(torch.float64)
    host = torch.tensor(float(number), dtype=torch.float64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def epoch_figures(run, ctx, epoch, lr, epoch_started):
    """An epoch record's training figures: its means, items and seconds."""
    totals, plan = run.progress.epoch_totals, run.plan
    steps = run.progress.step - epoch * plan.steps_per_epoch
    figures = totals.means("train_") | {f"train_{COUNT_UNIT}": totals.count, "lr": lr}
    figures |= {"train_samples": steps * plan.global_batch, "world_size": ctx.world_size}
    figures["epoch_s"] = time.perf_counter() - epoch_started
    return figures


@torch.no_grad()
def evaluate(model, eval_loader, ctx, autocast):
    """All ranks: the exact means over the eval set, {eval_<name>: mean}, each sample counted once
    (rank r evaluates samples r, r + world size...: DistributedSampler would pad with repeats).
    compute_loss gets the raw module, in eval mode: DDP's wrapper could wait for other ranks."""
    if ctx.world_size > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, 0)  # DDP: rank 0's BatchNorm statistics: the model rank 0 saves
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    rank_sums = RankSums(ctx.device, since_step=0)
    for batch in eval_loader:
        with autocast:
            loss, n, metrics = unpack_loss(compute_loss(model, to_device(batch, ctx.device)))
        rank_sums.add(loss, n, metrics)
    for module, training in modes:  # Trap: not model.train(): a part frozen in eval mode stays so
        module.train(training)
    *sums, count = rank_sums.packed().tolist()  # the only read of the device
    this_rank = Totals(dict(zip(rank_sums.sums, sums)), count)
    per_rank = [this_rank]
    if ctx.world_size > 1:  # (a rank's share may be empty: it has no names to add)
        per_rank = [None] * ctx.world_size
        dist.all_gather_object(per_rank, this_rank, group=ctx.cpu_group)  # DDP: all sums
    totals = Totals()
    for rank_totals in per_rank:
        totals.add(rank_totals)
    figures = totals.means("eval_") | {"eval_samples": len(eval_loader.dataset)}
    if COUNT_UNIT != "samples":
        figures[f"eval_{COUNT_UNIT}"] = totals.count
    return figures


def evaluate_checkpoint(args, ctx):
    """--eval-only: the out-dir's checkpoint, evaluated on any world size; its record is printed
    and given to report() (metrics.jsonl holds the training's)."""
    path, checkpoint = read_checkpoint(args.out_dir)
    check(checkpoint, f"--eval-only: there is no checkpoint in {args.out_dir}: train first")
    _, eval_set, model = build_task(args, ctx)
    check(len(eval_set) > 0, "--eval-only: build_datasets gives no eval set")
    try:
        model.load_state_dict(checkpoint["model"][0])
    except RuntimeError as exc:
        fail(f"{path} is of another model: {one_line(exc)}")
    eval_loader = make_eval_loader(args, ctx, eval_set)
    start_workers(eval_loader)
    autocast, _ = make_autocast(args, ctx.device)
    step = checkpoint["progress"]["step"]
    log(f"{PROG}: evaluating {path} (step {step}) on world size {ctx.world_size}, {ctx.device}")
    figures = evaluate(model, eval_loader, ctx, autocast)
    write_record({"kind": "eval", "step": step} | figures, args, ctx, model, step, to_file=False)
    return 0


def save_checkpoint(args, ctx, run):
    """All ranks: every rank's random states gathered; rank 0 writes the checkpoint, keeping the
    previous one; all wait until it is written."""
    rng_states = [rng_state()]
    if ctx.world_size > 1:
        rng_states = [None] * ctx.world_size
        dist.all_gather_object(rng_states, rng_state(), group=ctx.cpu_group)
    if ctx.rank == 0:
        checkpoint = {name: [obj.state_dict() for obj in objs] for name, objs in run.parts.items()}
        checkpoint["format"] = CHECKPOINT_FORMAT
        checkpoint["progress"] = dataclasses.asdict(run.progress)  # plain values: weights_only
        checkpoint["rng"] = rng_states
        checkpoint["global_batch"] = run.plan.global_batch
        checkpoint["world_size"] = ctx.world_size
        checkpoint["args"] = {k: v if type(v) in PLAIN else str(v) for k, v in vars(args).items()}
        stem = f"{args.out_dir}/checkpoint"
        atomic_save(checkpoint, f"{stem}.pt", previous=f"{stem}.prev.pt")
    if ctx.world_size > 1:
        dist.barrier(group=ctx.cpu_group)  # Trap: nobody goes on, or exits, before it is written


def restore_checkpoint(args, parts, path, checkpoint, ctx):
    """Every stateful part as the checkpoint holds it, and this rank's random generators (on
    another world size, the fresh ones just seeded). Returns the run's progress."""
    try:
        for name, objects in parts.items():
            for obj, state in zip(objects, checkpoint[name], strict=True):
                obj.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as exc:
        fail(f"{path} is of another model, optimizer or --amp: {one_line(exc)}. Use theirs")
    saved_by = len(checkpoint["rng"])
    if saved_by == ctx.world_size:
        set_rng_state(checkpoint["rng"][ctx.rank])
    progress = Progress.from_dict(checkpoint["progress"])
    log(f"resumed from {path} at step {progress.step}, saved by {saved_by} process(es)")
    changed = [
        f"--{name.replace('_', '-')} {value} (it had {checkpoint['args'][name]})"
        for name, value in vars(args).items()
        if name not in NOT_COMPARED and checkpoint["args"].get(name, value) != value
    ]
    if changed:
        log(
            f"flags unlike the checkpoint's run: {', '.join(changed)}. Its optimizers keep their "
            "learning rate and weight decay, and it keeps its global batch; every other flag is "
            "this command's (a new --epochs or --max-steps reshapes the schedule from here)"
        )
    return progress


def drop_records_after(step, out_dir):
    """Rank 0, at a resume: metrics.jsonl without the records past the checkpoint's step (written
    before a crash): the resumed run writes them again, once. Returns the kinds of the records
    that the file holds for that step."""
    path = f"{out_dir}/metrics.jsonl"
    if not os.path.exists(path):
        return set()
    kept = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(ValueError):  # (a line torn by the crash)
                if json.loads(line)["step"] <= step:
                    kept.append(line)
    with open(f"{path}.tmp", "w") as f:
        f.writelines(kept)
    os.replace(f"{path}.tmp", path)
    return {json.loads(line)["kind"] for line in kept if json.loads(line)["step"] == step}


class StopAgreement:
    """A stop signal on any rank (preemption: SIGTERM, SIGUSR1) stops every rank after one step.

    Trap: the handler only notes the signal: a collective inside a handler deadlocks. Each step,
    every rank's note rides an asynchronous all-reduce over gloo, sent at the step's start and read
    at its end: it costs the step no wait."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.signals = []  # the stop signals this process got
        self.agreed = False  # True: some rank got one; every rank stops after this step
        self.flag, self.reduction = None, None
        self.previous_handlers = {sig: signal.signal(sig, self.note) for sig in STOP_SIGNALS}

    def note(self, signum, frame):
        self.signals.append(signum)

    def vote(self):
        if self.ctx.world_size > 1:
            self.flag = torch.tensor(len(self.signals))
            self.reduction = dist.all_reduce(self.flag, group=self.ctx.cpu_group, async_op=True)

    def count_votes(self):
        if self.ctx.world_size > 1:
            self.reduction.wait()
            self.agreed = self.flag.item() > 0
        else:
            self.agreed = len(self.signals) > 0

    def restore(self):
        for sig, handler in self.previous_handlers.items():
            signal.signal(sig, handler)


class Throughput:
    """Items trained a second since this process started, and the seconds left."""

    def __init__(self, first_step, total_steps):
        self.first_step, self.total_steps = first_step, total_steps
        self.started = time.perf_counter()
        self.items = 0.0  # over all ranks

    def figures(self, step):
        seconds = time.perf_counter() - self.started
        eta_s = seconds / (step - self.first_step) * (self.total_steps - step)
        return {f"{COUNT_UNIT}_per_s": self.items / seconds, "eta_s": eta_s}


def write_record(record, args, ctx, model, total_steps, to_file=True):
    """Rank 0: a record (progress, eval, epoch) to the console, metrics.jsonl and report()."""
    if ctx.rank != 0:
        return
    shown = [
        f"{name} {value:.6g}" if isinstance(value, float) else f"{name} {value}"
        for name, value in record.items()
        if name not in ("kind", "step")
    ]
    log(f"{record['kind']:>8}  step {record['step']}/{total_steps}", *shown, sep="  ")
    if to_file:
        with open(f"{args.out_dir}/metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    report(record, args, model)


def log_header(args, ctx, run):
    """Rank 0: what this run is, in three lines."""
    plan, train_size = run.plan, len(run.sampler.dataset)
    backend = dist.get_backend() if ctx.world_size > 1 else "no process group"
    threads = torch.get_num_threads()
    log(
        f"{PROG}: world size {ctx.world_size}, {backend}, {ctx.device}, {threads} thread(s)/process,"
    )
    log(
        f"torch {torch.__version__}; files in {args.out_dir}: checkpoint.pt, metrics.jsonl, model.pt"
    )
    left_out = train_size - plan.steps_per_epoch * plan.global_batch
    log(
        f"global batch {plan.global_batch} = {args.batch_size}/process x {ctx.world_size} x "
        f"{plan.grad_accum} accum, {plan.steps_per_epoch} steps/epoch (each leaves out {left_out} "
        f"of its {train_size:,} samples), {len(run.eval_loader.dataset):,} eval samples"
    )


# ====== 4. Helpers ===============================================================================

# The script's flags: --name, its default (and so its type), what it does. TASK_FLAGS add yours.
FLAGS = [
    ("epochs", 3, "passes over the training set"),
    ("max-steps", 0, "train exactly N optimizer steps (0: --epochs)"),
    ("batch-size", 64, "samples per process and micro-batch (x world x --grad-accum: a step's)"),
    ("grad-accum", 1, "micro-batches per optimizer step"),
    ("lr", 1e-3, "peak learning rate (build_optimizer's)"),
    ("warmup-steps", 0, "linear warmup over N steps, then cosine decay to 0"),
    ("weight-decay", 0.01, "the default AdamW's, on matrices"),
    ("clip-grad-norm", 0.0, "clip the global gradient norm to this at every step (0: off)"),
    ("seed", 0, "seeds the data, the initial weights and the shuffle"),
    ("out-dir", f"out/{os.path.basename(sys.argv[0]).removesuffix('.py')}", "rank 0 writes here"),
    ("log-every", 100, "a progress line every N optimizer steps (0: off)"),
    ("eval-every", 0, "also evaluate every N optimizer steps (0: at each epoch's end only)"),
    ("save-every", 500, "also checkpoint every N optimizer steps (0: at each epoch's end only)"),
    ("eval-only", False, "evaluate the out-dir's checkpoint, then exit"),
    ("amp", "off", "autocast: off, bf16 or fp16 (with loss scaling)"),
    ("compile", False, "torch.compile the DDP model"),
    ("workers", 0, "DataLoader workers per process"),
    ("find-unused-parameters", False, "let parameters sit out some steps (DDP's option; slower)"),
    ("sync-bn", False, "SyncBatchNorm: BatchNorm statistics over the global batch"),
    ("timeout", 1800.0, "seconds to wait for a peer before failing"),
    ("spawn", 0, "start N local processes, as torchrun --standalone would"),
]
AT_LEAST_ONE = ("epochs", "batch-size", "grad-accum")  # the script's other numbers: 0
RESERVED_METRICS = {"loss", "samples", "tokens"}  # the script's own: train_loss, eval_samples...
CHECKPOINT_FORMAT = 2  # 1: the checkpoints of ddp_train.py before its redesign
NOT_COMPARED = ("out_dir", "eval_only", "spawn", "local_rank", "timeout")  # at a resume
PLAIN = (int, float, str, bool, type(None))  # what a weights_only torch.load reads back


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose errors are one line (not its usage text) and a non-zero exit."""

    def error(self, message):
        fail(f"{message} (see --help)")


def parse_args(argv=None):
    parser = OneLineParser(
        allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name, default, help_text in FLAGS + TASK_FLAGS:
        if isinstance(default, bool):  # a switch: --name and --no-name
            action = argparse.BooleanOptionalAction
            parser.add_argument(f"--{name}", action=action, default=default, help=help_text)
        else:
            parser.add_argument(f"--{name}", type=type(default), default=default, help=help_text)
    # the legacy `python -m torch.distributed.launch` passes --local-rank=N (older torch: _rank)
    parser.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, _, _ in FLAGS:
        value = getattr(args, name.replace("-", "_"))
        least = 1 if name in AT_LEAST_ONE else 0
        if type(value) in (int, float) and value < least:
            fail(f"--{name} is {value}: it is at least {least}")
    check(args.amp in ("off", "bf16", "fp16"), f"--amp is off, bf16 or fp16, not {args.amp}")
    return args


def spawn(processes, argv):
    """--spawn N: N processes of this script on this machine, as torchrun --standalone starts them.
    This process hosts their store on a free port and passes the stop signals on to them. It
    returns 0, 75 where they stopped and saved, or the exit code of the first that failed."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    main_spec = sys.modules["__main__"].__spec__  # `python -m pkg.train`: that module again
    script = ["-m", main_spec.name] if main_spec else [sys.argv[0]]
    command = [sys.executable, *script, *(argv or sys.argv[1:])]
    env = os.environ | {"WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes)}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    env |= {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it: the processes share the cores
    workers = []

    def pass_on(signum, frame):  # a terminal's Ctrl-C reaches them too, but a kill only this one
        for worker in workers:
            worker.send_signal(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, pass_on)
    for rank in range(processes):
        rank_env = env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
        workers.append(subprocess.Popen(command, env=rank_env))
    codes = [worker.wait() for worker in workers]
    # A worker that a signal N killed returns -N, which a shell writes as 128 + N.
    failed = [code if code > 0 else 128 - code for code in codes if code]
    return failed[0] if failed else 0


def torchrun_variables_from_slurm(env):
    """A bare `srun python ddp_train.py` of several tasks: torchrun's variables from SLURM's (the
    rank, the world, the local rank; the step's first node; a port of the job step's own, by
    run_multi_node.sh's rule). Anywhere else: none."""
    if int(env.get("SLURM_STEP_NUM_TASKS", 1)) <= 1:
        return {}
    variables = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"]}
    variables["LOCAL_RANK"] = env["SLURM_LOCALID"]
    variables["MASTER_ADDR"] = env.get("MASTER_ADDR") or first_host(env["SLURM_STEP_NODELIST"])
    # 61000-65499: above Linux's ephemeral ports; two jobs, or two steps of one job, on a node get
    # two ports; a requeued job moves to another (the last run's processes may still hold theirs)
    ids = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT")
    job, step, requeues = (int(env.get(name, 0)) for name in ids)
    port = 61000 + (job * 11 + step + 2221 * requeues) % 4500
    variables["MASTER_PORT"] = env.get("MASTER_PORT") or str(port)
    return variables


def first_host(nodelist):
    """The first host of a SLURM node list: "gpu[07-09,12]-ib,cpu1" -> "gpu07-ib"."""
    first_entry = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist).group()
    return re.sub(r"\[(\d+)[^\]]*\]", r"\1", first_entry)


def check_datasets(train_set, eval_set):
    for name, dataset in ("training", train_set), ("eval", eval_set):
        check(
            hasattr(dataset, "__len__"),
            f"the {name} set is a {type(dataset).__name__} without a length: DistributedSampler "
            "needs a map-style Dataset (with __len__ and __getitem__), which gives every rank an "
            "exact share and lets a stopped run resume at the very sample it stopped at",
        )


def check_same_start(step, ctx):
    if ctx.world_size > 1:  # Trap: a checkpoint that only some nodes see: they would train apart
        starts = [None] * ctx.world_size
        dist.all_gather_object(starts, step, group=ctx.cpu_group)
        check(len(set(starts)) == 1, f"the ranks start at steps {starts}: a shared --out-dir")


class StepBatches:
    """The training DataLoader's batch_sampler: this rank's micro-batches of an epoch. Step s of
    the epoch trains the samples at [s, s + 1) x global batch of its shuffle: this rank's share of
    them is the same stretch of its DistributedSampler share, in micro-batches of --batch-size."""

    def __init__(self, sampler, batch_size, plan):
        self.sampler, self.batch_size = sampler, batch_size
        self.per_step = plan.grad_accum * batch_size  # this rank's samples in a step
        self.steps_per_epoch = plan.steps_per_epoch
        self.skip_steps = 0  # a resumed epoch leaves out the steps it trained

    def __iter__(self):
        share = list(self.sampler)
        end = self.steps_per_epoch * self.per_step
        for start in range(self.skip_steps * self.per_step, end, self.batch_size):
            yield share[start : start + self.batch_size]

    def __len__(self):
        return (self.steps_per_epoch - self.skip_steps) * self.per_step // self.batch_size


def loader_options(args, ctx):
    """Trap: ignore_signals, else torchrun's SIGTERM kills the workers and the trainer dies before
    it saves. Trap: a generator of the rank's own, else the workers' seeds are drawn from the
    global generator (dropout's), the same on every rank."""
    return dict(
        collate_fn=collate_fn,
        num_workers=args.workers,
        worker_init_fn=ignore_signals,
        persistent_workers=args.workers > 0,
        pin_memory=ctx.device.type == "cuda",
        generator=torch.Generator().manual_seed(args.seed + 1 + ctx.rank),
    )


def make_eval_loader(args, ctx, eval_set):
    # rank r evaluates samples r, r + world size... (no padding: each sample counted once)
    share = range(ctx.rank, len(eval_set), ctx.world_size)
    return DataLoader(eval_set, args.batch_size, sampler=share, **loader_options(args, ctx))


def start_workers(loader):
    """A DataLoader's persistent workers, started now (each later iter() reuses them)."""
    if loader.num_workers > 0:
        iter(loader)


def make_autocast(args, device):
    """--amp's autocast and its dtype; without it no autocast at all (even a disabled one costs
    microseconds in every forward)."""
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    if amp_dtype is None:
        return contextlib.nullcontext(), None
    return torch.autocast(device.type, amp_dtype), amp_dtype


def unpack_loss(output):
    """compute_loss's result as (loss, count, metrics), its contract checked. A mean of no items
    (0/0) weighs nothing, so the loss and each metric become 0 there."""
    loss, count, metrics = output, None, None
    if isinstance(output, tuple) and len(output) == 2:
        loss, count, metrics = *output, {}
    elif isinstance(output, tuple) and len(output) == 3:
        loss, count, metrics = output
    if not (torch.is_tensor(loss) and loss.ndim == 0 and isinstance(metrics, dict)):
        shape = f", a loss of shape {list(loss.shape)}: its mean" if torch.is_tensor(loss) else ""
        fail(
            "compute_loss must return (loss, count) or (loss, count, {name: mean}): loss the mean "
            f"over count items, a 0-dim tensor; it returned {type(output).__name__}{shape}"
        )
    if not RESERVED_METRICS.isdisjoint(metrics):
        taken = sorted(RESERVED_METRICS.intersection(metrics))
        fail(f"compute_loss's metric {taken[0]!r} is one of the script's own names: rename it")
    if torch.is_tensor(count):
        loss = torch.where(count > 0, loss, 0.0)
        metrics = {name: torch.where(count > 0, mean, 0.0) for name, mean in metrics.items()}
    elif not count:
        loss = loss.nan_to_num()
        metrics = {name: torch.as_tensor(mean).nan_to_num() for name, mean in metrics.items()}
    return loss, count, metrics


def to_device(batch, device):
    """A batch on the device: its tensors, in any nesting of tuples (named ones too), lists and
    mappings; an object with a .to() of its own (a tokenizer's BatchEncoding) moves itself."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if hasattr(batch, "to"):
        try:  # without waiting for the previous step, as the tensors above
            return batch.to(device, non_blocking=True)
        except TypeError:  # (a .to() that takes no non_blocking)
            return batch.to(device)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def ignore_signals(worker_id):
    """Trap: a DataLoader worker exits on a SIGTERM from anyone but its parent (torchrun, SLURM and
    terminals signal whole process groups): the stop signals are the trainer's."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def seed_everything(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    if numpy:
        numpy.random.seed(seed % 2**32)


def rng_state():
    """This process's random generators, as values that a weights_only torch.load reads."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if numpy:
        kind, keys, *rest = numpy.random.get_state()
        state["numpy"] = [kind, keys.tolist(), *rest]
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    if numpy and "numpy" in state:
        numpy.random.set_state(state["numpy"])


def read_checkpoint(out_dir):
    """(path, checkpoint): the out-dir's last checkpoint, or the one before where it is damaged;
    (None, None) where there is none."""
    stem = f"{out_dir}/checkpoint"
    paths = [f"{stem}.pt", f"{stem}.prev.pt"]
    if not os.path.exists(paths[0]):  # a crash between atomic_save's renames: the new one is here
        paths.insert(1, f"{stem}.pt.tmp")
    problems = []
    for path in paths:
        if not os.path.exists(path):
            continue
        if path.endswith(".tmp") and not zipfile.is_zipfile(path):
            # A save that was cut short has no zip directory at its end. It was never published as
            # the checkpoint, so nothing is lost without it.
            log(f"{path} was cut short while it was written, so the run starts without it")
            continue
        try:
            # Trap: map_location, else every rank loads onto the GPU that saved it. mmap lets the
            # ranks of a node share the file's pages instead of each holding a copy.
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            problems.append(f"{path} is unreadable ({one_line(exc)})")
            continue
        if not (isinstance(checkpoint, dict) and "progress" in checkpoint):
            problems.append(f"{path} is not a checkpoint of {PROG}")
            continue
        check(
            checkpoint.get("format") == CHECKPOINT_FORMAT,
            f"{path} is of an older ddp_train.py (checkpoint format {checkpoint.get('format', 1)}, "
            f"this one reads {CHECKPOINT_FORMAT}): finish its run with the script that wrote it, "
            "or pass another --out-dir",
        )
        if problems:
            log(f"{problems[0]}: resuming from {path}")
        return path, checkpoint
    check(
        not problems,
        f"{'; '.join(problems)}: move it away to start over, or pass another --out-dir",
    )
    return None, None


def atomic_save(obj, path, previous=None):
    """Trap: a crash in the middle of a write must not cost the last good file. Write a temp file,
    flush it to the disk, then rename it (keeping the file it replaces as `previous`)."""
    # Trap: a new file, not the old one cut to zero: a run that resumed from it maps its pages
    with contextlib.suppress(FileNotFoundError):
        os.remove(f"{path}.tmp")
    with open(f"{path}.tmp", "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if previous and os.path.exists(path):
        os.replace(path, previous)
    os.replace(f"{path}.tmp", path)


def log(*args, **kwargs):
    if os.environ.get("RANK", "0") != "0":  # DDP: one log: rank 0's
        return
    try:
        print(*args, **kwargs, flush=True)
    except BrokenPipeError:  # Trap: a closed standard output (| head) must not stop the run
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def check(ok, message):
    if not ok:
        fail(message)


def fail(message, code=2, every_rank=False):
    """Stop with one line, no traceback: from rank 0 (all ranks have the same to say), or each."""
    if every_rank or os.environ.get("RANK", "0") == "0":
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def one_line(exc):
    return " ".join(str(exc).split())[:300]


if __name__ == "__main__":
    sys.exit(main())
