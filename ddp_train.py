"""ddp_train.py: a reference PyTorch DistributedDataParallel (DDP) training script.

This is one file, and it needs only torch (2.4 to 2.15). You launch it unchanged in any of
these ways:

    python ddp_train.py                                  # one process, on the CPU or one GPU
    python ddp_train.py --spawn 2                        # N local processes, with no launcher
    torchrun --nproc_per_node=4 ddp_train.py             # one node with 4 processes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 \\
        --rdzv-id=job1 ddp_train.py                      # the same command on each of 2 nodes
    srun --ntasks-per-node=8 --gpus-per-node=8 python ddp_train.py     # SLURM, one task per GPU
    python -m torch.distributed.launch --nproc_per_node=2 ddp_train.py  # the legacy launcher

Section 1 is your task. Edit its functions here, or assign your own from a script that imports
this file, as examples/digits.py does. Section 2 joins the process group, and section 3 is the
training loop. The later sections hold what the loop calls, and each of them opens with what it
guarantees. Each line that DDP adds to a plain training loop is marked "DDP:". Each classic trap is
marked "Trap:", and docs/guarantees.md names the test that guards it.
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import inspect
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
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing import errors
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, default_collate

try:  # numpy is optional. If a Dataset draws from numpy, we seed and checkpoint its generator.
    import numpy
except ImportError:
    numpy = None

PROG = os.path.basename(sys.argv[0])  # The messages name the script that runs, such as mine.py.
# These signals make the run save and exit with EXIT_STOPPED. Schedulers send them to preempt a
# job (torchrun, SLURM and Kubernetes do), Ctrl-C sends SIGINT, and a closed terminal sends SIGHUP.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
# A stopped run exits with 75, which is EX_TEMPFAIL in sysexits.h: "try again later". A job script
# can requeue the job when it sees this code.
EXIT_STOPPED = 75


# ====== 1. Your task: replace these ==============================================================

# This says what count_items() counts. It is "samples", or "tokens" for a language model.
COUNT_UNIT = "samples"


def add_task_flags(parser):
    """Add your task's own flags. Your code reads them as args.num_samples and so on. Here
    parser.set_defaults(lr=1.0, epochs=14) would give the script's flags your task's defaults, and
    the command line still overrides them."""
    parser.add_argument("--num-samples", type=int, default=32768, help="training samples")
    parser.add_argument("--eval-samples", type=int, default=4096, help="eval samples (0: none)")


# The default task has Gaussian inputs. A random linear "teacher" gives each input its label.
FEATURES = 32
CLASSES = 10


class InMemory(TensorDataset):
    """The default task's tensors. Where a Dataset has __getitems__, the DataLoader calls it with
    all the indices of a batch. So this reads a whole batch with one gather, not with a loop, and it
    gives the batch as a tuple of tensors."""

    def __getitems__(self, indices):
        rows = torch.tensor(indices)
        return tuple(tensor.index_select(0, rows) for tensor in self.tensors)


def configure_torch(args):
    """Set torch's global options here, such as torch.backends.cudnn.benchmark = True, or TF32 with
    torch.set_float32_matmul_precision("high"). Every rank calls this before it builds the task."""


def build_datasets(args):
    """Return (train_set, eval_set). Both are map-style Datasets, which have a __len__, and every
    rank builds the same ones. The eval_set may be None or empty, and then nothing is evaluated.
    The train_set may be a stream instead, as make_train_loader() says and examples/stream.py
    shows. args.rank and args.local_rank say where this process is. So the local rank 0 of each
    node can download the data, while the other ranks wait for its files, as cached.py in
    docs/recipes.md shows. Trap: Do not wait at a dist.barrier() here. On Python before 3.12, a
    collective before the DataLoader workers fork can deadlock them, as setup_training() says."""
    check(args.num_samples >= 0, f"--num-samples must be at least 0, not {args.num_samples}")
    check(args.eval_samples >= 0, f"--eval-samples must be at least 0, not {args.eval_samples}")
    generator = torch.Generator().manual_seed(args.seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)

    def make_split(size):
        inputs = torch.randn(size, FEATURES, generator=generator)
        return InMemory(inputs, (inputs @ teacher).argmax(dim=1))

    return make_split(args.num_samples), make_split(args.eval_samples)


def build_model(args):
    """Return any nn.Module. The default task uses a small MLP classifier."""
    return nn.Sequential(
        nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES)
    )


def collate_fn(items, args, training):
    """Turn what the Dataset gave for a batch into the batch. A list of items goes through
    default_collate, which stacks them, and items of different shapes need a collate_fn that pads,
    as in examples/tinylm.py. InMemory gives a whole batch as a tuple of tensors, which is kept.
    The args hold the flags. training is True in the training loader and False in the eval
    loader. So a batch augmentation, such as mixup, can run in training only."""
    if isinstance(items, tuple):  # InMemory gave the whole batch already.
        return items
    return default_collate(items)


def count_items(batch):
    """Return how many items a batch holds, as an int. The items are samples, or a language model's
    real target tokens when COUNT_UNIT is "tokens", as in examples/tinylm.py. The script calls this
    on the CPU before the batch moves to the device, so that no step waits for the GPU."""
    inputs, targets = batch
    return len(targets)


def compute_loss(model, batch, args):
    """Return the loss of one batch, or (loss, metrics).

    The loss is the MEAN over the batch's count_items(batch) items, as F.cross_entropy returns it.
    The metrics are a dict {name: mean over the same items}, and they are logged as train_<name>
    and eval_<name>. The names loss, samples and tokens are the script's own. The batch is already
    on the device. In training, model is the DDP model, or the model itself on one process, and
    --compile compiles it. Call model(...), not model.module(...), so that DDP's forward runs. In
    evaluation, model is the raw module in eval mode. The args hold the flags, such as a flag of
    add_task_flags(). Trap: A micro-batch of padding holds no items, and its backward must still be
    finite. F.cross_entropy with ignore_index is, and a masked mean must divide by the count of
    the mask clamped to at least 1."""
    inputs, targets = batch
    logits = model(inputs).float()
    loss = F.cross_entropy(logits, targets)
    metrics = {}
    if not model.training:  # Training skips the accuracy, so that it stays fast.
        metrics["accuracy"] = (logits.argmax(dim=1) == targets).float().mean()
    return loss, metrics


def eval_metrics(means, args):
    """Return the metrics that an evaluation logs, from the means of compute_loss's loss and
    metrics over the whole eval set. A metric that is not a mean over items, such as a macro-F1, is
    made here from the means of its parts, as in examples/digits.py. Only what this returns is
    logged, and it keeps "loss". Every rank calls it with the same means."""
    return means


def build_optimizer(args, model, plan):
    """Return one optimizer, or a list of them.

    The plan holds global_batch, steps_per_epoch and total_steps. A resume on another world size
    keeps the global batch, so a rate that scales with it stays the same. The default is AdamW with
    torch's betas. As in nanoGPT, it decays only the matrices and embeddings, and one fused kernel
    updates every weight."""
    params = list(model.parameters())
    decayed = [p for p in params if p.dim() >= 2]
    not_decayed = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decayed, "weight_decay": args.weight_decay},
        {"params": not_decayed, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, fused=True)


def build_scheduler(args, optimizer, plan):
    """Return a torch LRScheduler, such as OneCycleLR, for one optimizer.

    The script steps it after each optimizer step, and each checkpoint saves it. The default warms
    up linearly over --warmup-steps and then decays to 0 along a cosine. A schedule in epochs takes
    plan.steps_per_epoch, as in StepLR(optimizer, step_size=plan.steps_per_epoch). A scheduler
    with scheduler.per_epoch = True steps after each epoch's last step instead, as torchvision's
    recipes step theirs. A ReduceLROnPlateau steps after each evaluation, with the eval loss."""

    def lr_factor(step):  # The step argument counts the optimizer steps done before this one.
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        decay_steps = max(1, plan.total_steps - args.warmup_steps)
        return (1 + math.cos(math.pi * (step - args.warmup_steps) / decay_steps)) / 2

    return LambdaLR(optimizer, lr_factor)


def build_averaged_models(args, model):
    """Return {name: model} of models that follow the model's weights, such as an EMA, as in
    {"ema": AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))}. Every rank calls
    update_parameters(model) on each of them after each optimizer step. Each checkpoint holds them,
    each evaluation logs them as eval_<name>_loss and so on, and the run ends with <name>.pt."""
    return {}


def report(record, args, model):
    """Rank 0 calls this with each record that it logs. Send the record to W&B or TensorBoard here.

    If the record's step saves a checkpoint, the checkpoint is written before this call. The run's
    files are in args.out_dir. The model is the raw module, and its state_dict() holds the weights
    of the record's step. A run that trains its last step ends with a last call, with the record
    {"kind": "end", "step": step}, after it writes model.pt. A logger can finish there."""


# ====== 2. Joining the process group, and leaving it =============================================


@dataclasses.dataclass
class World:
    """This process's place in the run."""

    rank: int  # The rank goes from 0 to world_size - 1 over all nodes.
    local_rank: int  # The rank on this node picks its GPU.
    world_size: int
    device: torch.device
    # Small CPU messages, such as the step sync's, go over this gloo group. On GPUs it is a
    # group beside the NCCL group. NCCL moves only GPU tensors, in the GPU's queue of work, so a
    # number sent over NCCL would wait for the GPU. On CPUs it is the process group itself. One
    # process has no group.
    gloo_group: object = None


def init_distributed(timeout_s):
    """Find this process's place in the run, pick its device and join the process group.

    The place comes from torchrun's variables. --spawn and the legacy launcher set them too. A bare
    srun sets SLURM's variables, and the script translates them. Plain python is one process."""
    if "RANK" not in os.environ:  # Outside SLURM, this adds nothing.
        os.environ.update(torchrun_variables_from_slurm(os.environ))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(local_rank)
    if world_size == 1:
        return World(rank, local_rank, world_size, device)
    timeout = datetime.timedelta(seconds=timeout_s)
    # DDP: Join the process group. GPUs use NCCL and CPUs use gloo. The timeout turns a missing
    # peer into an error instead of a hang.
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        # Each round of workers gets a store of its own, as section 9 says.
        store = fresh_rendezvous_store(timeout)
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
    gloo_group = dist.group.WORLD
    if backend == "nccl":
        gloo_group = dist.new_group(backend="gloo", timeout=timeout)
    return World(rank, local_rank, world_size, device, gloo_group)


def pick_device(local_rank):
    """Return this process's device. It is cuda:LOCAL_RANK where there are GPUs, else the CPU.

    On a GPU machine, CUDA_VISIBLE_DEVICES= makes the run train on the CPUs."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if local_rank < gpus:
        index = local_rank
    elif gpus == 1 and "LOCAL_WORLD_SIZE" not in os.environ:
        # With srun --gpus-per-task=1, each task sees only its own GPU, as cuda:0. torchrun sets
        # LOCAL_WORLD_SIZE, and there too few GPUs are a mistake.
        index = 0
    else:
        processes = os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1))
        fail(
            f"{processes} processes on this node and {gpus} GPU(s), but NCCL needs one per "
            "process: start one per GPU, or train on the CPUs with CUDA_VISIBLE_DEVICES=",
            every_rank=True,
        )
    device = torch.device("cuda", index)
    # DDP: Each process has its own GPU. It must be the current device before anything uses CUDA.
    torch.cuda.set_device(device)
    return device


def cleanup_distributed(world):
    """Leave the process group. This also runs after an error."""
    # Trap: The DDP model must be freed before its process group, or gloo can abort at exit. An
    # early version of this script aborted so on torch 2.13, in about 1 run of 3. The DDP model
    # refers to itself in cycles, so only the garbage collector frees it.
    gc.collect()
    if dist.is_initialized():
        destroy_process_group_gloo_last(world)  # DDP: Leave the process group (section 11).


# ====== 3. The loop ===============================================================================
# main(), setup_training(), train() and train_step() are the tutorials' loop, in torch's own names.
# setup_training() builds the DistributedSampler, the DataLoader and DDP(...). After each step,
# after_step() runs the loss all_reduce, the progress record, model.pt, the checkpoint, report(),
# the stop and the evaluation, in this order. The state that the loop keeps comes first.


@dataclasses.dataclass
class Plan:
    """What a step is, and how many steps there are."""

    global_batch: int  # This counts the samples of a step over all ranks.
    grad_accum: int  # This counts the micro-batches of a step on each rank.
    steps_per_epoch: int  # Each step is a full global batch, so an epoch drops its partial end.
    total_steps: int
    epochs: int  # The run trains in this many epochs. --max-steps can cut the last one short.
    stream: bool  # The training set is an IterableDataset. make_train_loader() says what changes.

    def epoch_of(self, step):
        """Return the epoch of a step as the records count it. The records count epochs from 1, and
        the loop counts them from 0, as set_epoch() takes them."""
        return math.ceil(step / self.steps_per_epoch)


@dataclasses.dataclass
class Totals:
    """The sums of the loss and the metrics over some items, and the count of those items. Each sum
    adds up means multiplied by their counts, so a sum over the count is an exact mean. In
    TrainState.unreduced, the sums are tensors on the device. Elsewhere, they are floats."""

    sums: dict = dataclasses.field(default_factory=dict)
    count: int = 0

    def add(self, sums, count):
        for name, value in sums.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        self.count += count

    def add_means(self, means, count):
        """Add each mean of a batch, multiplied by the batch's count of items."""
        sums = {}
        for name, mean in means.items():
            sums[name] = torch.as_tensor(mean, dtype=torch.float64).detach() * count
        self.add(sums, count)

    def means(self, prefix):
        """Return {prefix + name: mean}, or {} where no item was counted."""
        if not self.count:
            return {}
        return {f"{prefix}{name}": value / self.count for name, value in self.sums.items()}


@dataclasses.dataclass
class SavedProgress:
    """The run's position, and the totals that its next records report. Every checkpoint saves it,
    and a resume restores it. So a record after a resume reports the same means as a run that did
    not stop."""

    step: int = 0  # This counts the optimizer steps done.
    lr: float = 0.0  # This is the last step's learning rate, which an epoch record reports.
    # These are the totals of this epoch's steps so far, and of the steps since the last progress
    # record.
    epoch_totals: Totals = dataclasses.field(default_factory=Totals)
    totals_since_log: Totals = dataclasses.field(default_factory=Totals)
    # These are the seconds since this epoch started, with its evaluations and saves. A resumed
    # epoch adds to them, so the time between a stop and its rerun is not counted.
    epoch_seconds: float = 0.0

    def start_epoch(self):
        """A new epoch starts its totals and its seconds from zero."""
        self.epoch_totals = Totals()
        self.epoch_seconds = 0.0


@dataclasses.dataclass
class TrainState:
    """Everything that training holds. setup_training() makes it. Then only the loop changes it,
    and the functions that the loop calls: train_step(), after_step() and evaluate_and_record(),
    which steps a ReduceLROnPlateau."""

    plan: Plan
    progress: SavedProgress
    raw_model: nn.Module  # This is the model itself. We save and evaluate it, and report() gets it.
    ddp_model: nn.Module  # DDP's wrapper gives no_sync(). One process has only the model here.
    forward_model: nn.Module  # The forward runs on it. It is ddp_model, or its compiled form.
    stateful_parts: dict  # A checkpoint saves and restores each of these by its name.
    averaged_models: dict  # These follow the model's weights, as build_averaged_models() says.
    optimizers: list
    schedulers: list
    scaler: torch.amp.GradScaler  # It scales fp16's loss, and it is disabled otherwise.
    autocast: object  # This is --amp's autocast, or a context that does nothing.
    sampler: DistributedSampler  # A stream has no sampler, and this is None.
    batch_sampler: "ResumableBatchSampler"  # A stream has none either.
    loader: DataLoader
    eval_loader: DataLoader
    # These are this rank's totals since the last loss all_reduce, which adds up those of all ranks.
    # Their sums stay tensors on the device, so that no step waits for the GPU.
    unreduced: Totals = dataclasses.field(default_factory=Totals)


@errors.record  # Under torchrun, this puts a worker's traceback in torchrun's failure summary.
def main(argv=None):
    args = parse_args(argv)
    if args.spawn and "RANK" not in os.environ:
        return spawn(args.spawn, argv)  # This waits until all the processes have exited.
    world = init_distributed(args.timeout)
    try:
        if args.eval_only:
            return evaluate_checkpoint(args, world)
        return train(args, world)
    except BaseException as exc:
        clear_traceback_frames(exc)  # Trap: section 11 says why.
        raise
    finally:
        cleanup_distributed(world)


def setup_training(args, world):
    """All ranks build what training needs, in running order, and resume from a checkpoint."""
    train_set, eval_set, model = build_task(args, world)
    path, checkpoint = read_checkpoint(args.out_dir)
    plan = make_plan(args, world, train_set, path, checkpoint)
    optimizers = build_optimizer(args, model, plan)
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]  # The task may return one optimizer or a list of them.
    schedulers = [build_scheduler(args, optimizer, plan) for optimizer in optimizers]
    scaler = torch.amp.GradScaler(world.device.type, enabled=args.amp == "fp16")
    averaged_models = build_averaged_models(args, model)
    stateful_parts = checkpointed_parts(model, scaler, optimizers, schedulers, averaged_models)
    # DDP: Each rank gets a random stream of its own, so that dropout differs between the ranks.
    seed_everything(rank_seed(args, world))
    progress = SavedProgress()
    if checkpoint:
        progress = restore_checkpoint(args, world, stateful_parts, path, checkpoint)
    if checkpoint and plan.stream:
        restore_stream(world, train_set, path, checkpoint)
    del checkpoint  # This frees its memory before the workers fork. See unmap_optimizer_state().
    sampler, batch_sampler, loader = make_train_loader(args, world, train_set, plan)
    eval_loader = make_eval_loader(args, world, eval_set)
    # Trap: The workers start now, once, before any collective. On Python before 3.12, a fork while
    # a gloo or NCCL thread frees a finished collective can deadlock the child (CPython #112275).
    start_workers(loader)
    start_workers(eval_loader)
    check_same_start(world, progress.step)
    promote_tmp_checkpoint(world, path)  # Trap: Every rank has read the checkpoint by now.
    ddp_model = model
    if world.world_size > 1:
        # DDP: The wrap broadcasts rank 0's weights, and it needs no device_ids after set_device().
        # It averages the gradients in buckets, and the gradients live in them, which saves a copy.
        ddp_model = DDP(
            model, find_unused_parameters=args.find_unused_parameters, gradient_as_bucket_view=True
        )
    forward_model = ddp_model
    # We compile the DDP model, not the model inside it. Then torch.compile splits its graph where
    # DDP's buckets end, so each bucket's all-reduce still overlaps the rest of the backward.
    if args.compile:
        forward_model = torch.compile(ddp_model)
    if world.rank == 0:  # Rank 0 writes only now, after every check, so a mistake writes nothing.
        os.makedirs(args.out_dir, exist_ok=True)
    return TrainState(
        plan=plan,
        progress=progress,
        raw_model=model,
        ddp_model=ddp_model,
        forward_model=forward_model,
        stateful_parts=stateful_parts,
        averaged_models=averaged_models,
        optimizers=optimizers,
        schedulers=schedulers,
        scaler=scaler,
        autocast=make_autocast(args, world.device),
        sampler=sampler,
        batch_sampler=batch_sampler,
        loader=loader,
        eval_loader=eval_loader,
    )


def make_train_loader(args, world, train_set, plan):
    """Return the training DataLoader, its sampler and its batch sampler.

    A stream, an IterableDataset, has neither. It gives each rank its own items, and it may ask
    torch.distributed for the rank. It has no length, so its run is one epoch of --max-steps steps.
    The step sync finishes before each forward, and all ranks stop with one line when a rank's
    stream runs out. Each checkpoint holds every rank's stream.state_dict(), so a resume needs the
    same world size. A stream needs --workers 0, because each worker would hold a copy that no
    checkpoint can read."""
    options = loader_options(args, world, args.workers, training=True)
    if plan.stream:
        # The stream gives this rank its own items. drop_last keeps every batch whole, so a step
        # with fewer batches means that the stream has ended.
        return None, None, DataLoader(train_set, args.batch_size, drop_last=True, **options)
    # DDP: Each rank reads its own share of each epoch's shuffle. drop_last makes the shares equal.
    sampler = DistributedSampler(
        train_set, world.world_size, world.rank, seed=args.seed, drop_last=True
    )
    batch_sampler = ResumableBatchSampler(sampler, args.batch_size, plan)
    loader = DataLoader(train_set, batch_sampler=batch_sampler, **options)
    return sampler, batch_sampler, loader


def train(args, world):
    """Train, and return the exit code. All ranks run every line, and only rank 0 writes."""
    state = setup_training(args, world)
    plan = state.plan
    progress = state.progress
    finish_resumed_step(args, world, state)
    if progress.step >= plan.total_steps:
        return rewrite_final_weights(args, world, state)
    log_header(args, world, state)
    step_sync = StepSync(world)
    throughput = Throughput(progress.step, plan.total_steps)
    for epoch in range(progress.step // plan.steps_per_epoch, plan.epochs):
        last_step_of_epoch = min(plan.total_steps, (epoch + 1) * plan.steps_per_epoch)
        # A resumed epoch has trained some of its steps already. It skips them and keeps its totals.
        steps_done_in_epoch = progress.step - epoch * plan.steps_per_epoch
        if not plan.stream:  # A stream has no sampler, and its state_dict() holds its place.
            state.sampler.set_epoch(epoch)  # DDP: Trap: Each epoch needs it for its own shuffle.
            state.batch_sampler.skip_steps = steps_done_in_epoch
        if steps_done_in_epoch == 0:
            progress.start_epoch()
        epoch_started = time.perf_counter()
        saved_seconds = progress.epoch_seconds  # A resumed epoch counts on from these.
        loader_iterator = iter(state.loader)  # Each step takes its --grad-accum batches from here.
        for step in range(progress.step + 1, last_step_of_epoch + 1):
            log_now = args.log_every > 0 and step % args.log_every == 0
            # The step takes the loader's next --grad-accum batches. islice stops early where a
            # stream has ended, so the list then holds fewer.
            batches = list(itertools.islice(loader_iterator, plan.grad_accum))
            epoch_ends = step % plan.steps_per_epoch == 0
            lr, grad_norm = train_step(args, world, state, batches, step_sync, log_now, epoch_ends)
            progress.step = step
            progress.lr = lr
            progress.epoch_seconds = saved_seconds + time.perf_counter() - epoch_started
            throughput.add(step_sync.global_items)
            stopped = after_step(args, world, state, step_sync, throughput, grad_norm, log_now)
            if stopped:
                return EXIT_STOPPED  # The rerun runs the evaluation that the stop skipped.
    step_sync.restore_signal_handlers()
    return end_run(args, world, state)


def train_step(args, world, state, batches, step_sync, log_now, epoch_ends):
    """All ranks take one optimizer step over this rank's micro-batches of the step. It returns the
    step's learning rate and its gradient norm, a tensor that is None unless the step clips or logs
    (log_now). epoch_ends says whether the step is the last of its epoch."""
    counts = [count_items(batch) for batch in batches]  # They are counted on the CPU.
    stream_ended = len(batches) < state.plan.grad_accum  # Only a stream ends inside an epoch.
    step_sync.start(sum(counts), stream_ended)
    # DDP: Each micro-batch's weight needs the step's count of items over all ranks. For samples,
    # the plan knows that count. A count of tokens, or of a stream, comes only from the step sync's
    # all-reduce, so the step waits for it before the first forward.
    global_items = state.plan.global_batch
    needs_count_before_forward = COUNT_UNIT != "samples" or state.plan.stream
    if needs_count_before_forward:
        step_sync.finish()
        check_step_sync(step_sync, state)
        global_items = max(1, step_sync.global_items)  # A step of 0 tokens gets weight 0, not 0/0.
    for i, (batch, count) in enumerate(zip(batches, counts)):
        batch = to_device(batch, world.device)
        # DDP: no_sync skips the gradient all-reduce. Only the last micro-batch's backward runs it.
        if i < len(batches) - 1 and world.world_size > 1:
            gradient_sync = state.ddp_model.no_sync()
        else:
            gradient_sync = contextlib.nullcontext()
        with gradient_sync:
            with state.autocast:
                output = compute_loss(state.forward_model, batch, args)
            loss, metrics = check_loss_output(output, count)
            state.unreduced.add_means({"loss": loss, **metrics}, count)
            # DDP: DDP averages the gradients over the ranks. So each mean is multiplied by its
            # count over the step's count, times the world size. Then the gradient is the exact
            # mean over all the items of the step. When every batch holds the same count, the
            # weight is 1 / grad_accum, as in nanoGPT's loss / gradient_accumulation_steps. fp16's
            # scaler scales a mean, never a sum.
            weight = count * world.world_size / global_items
            state.scaler.scale(loss * weight).backward()
    grad_norm = None
    if args.clip_grad_norm or log_now:
        for optimizer in state.optimizers:
            # Trap: Clip and log the true gradients, not the gradients that fp16 scaled up.
            state.scaler.unscale_(optimizer)
        if args.clip_grad_norm:
            max_norm = args.clip_grad_norm
        else:
            max_norm = math.inf  # An infinite limit clips nothing, and the call only measures.
        grad_norm = nn.utils.clip_grad_norm_(state.raw_model.parameters(), max_norm)
    lr = state.optimizers[0].param_groups[0]["lr"]  # This is read before the scheduler moves it.
    for optimizer, scheduler in zip(state.optimizers, state.schedulers):
        state.scaler.step(optimizer)
        if scheduler_steps_now(scheduler, epoch_ends):
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    state.scaler.update()
    for averaged in state.averaged_models.values():
        averaged.update_parameters(state.raw_model)
    if not needs_count_before_forward:
        # A step of samples reads the step sync's sums only now, so that it does not wait for them.
        # The check of the count still comes before any record or save.
        step_sync.finish()
        check_step_sync(step_sync, state)
    return lr, grad_norm


def after_step(args, world, state, step_sync, throughput, grad_norm, log_now):
    """All ranks finish a step, and return whether the run stops after it. The numbered comments
    give the order, and they say why each comes where it does."""
    step = state.progress.step
    plan = state.plan
    periodic_save = args.save_every > 0 and step % args.save_every == 0
    record_kind = due_record_kind(args, state, step)  # It is "epoch", "eval" or None.
    # A step that evaluates also saves, for the reason that block 4 gives.
    save_now = periodic_save or record_kind is not None or step_sync.should_stop
    # 1. A record and a checkpoint both need the losses of all ranks. A checkpoint holds their sums.
    if log_now or save_now:
        reduced = all_reduce_losses(world, state.unreduced)  # DDP: This is the loss all_reduce.
        state.unreduced = Totals()
        check_finite(reduced.sums["loss"], state.raw_model, step)
        state.progress.epoch_totals.add(reduced.sums, reduced.count)
        state.progress.totals_since_log.add(reduced.sums, reduced.count)
    # 2. The progress record reaches metrics.jsonl before the save, so a crash cannot lose it.
    record = None
    if log_now:
        record = progress_record(plan, state.progress, grad_norm, throughput)
        write_record(args, world, record, plan.total_steps)
        state.progress.totals_since_log = Totals()
    # 3. The final checkpoint marks the run as finished, so model.pt comes before it. After a kill
    # between the two, the rerun trains the last steps again and writes both files. A rerun that
    # finds the final checkpoint writes model.pt again from it.
    if step == plan.total_steps and world.rank == 0:  # DDP: Only rank 0 writes.
        save_weights(args, state)
    # 4. The save comes before the evaluation, so a kill during the evaluation loses no step.
    if save_now:
        save_checkpoint(args, world, state)
    # 5. report() comes after the save, so that a logger can read the checkpoint of its step.
    if record is not None and world.rank == 0:
        report(record, args, state.raw_model)
    # 6. A stop skips the evaluation, and the rerun runs it. finish_resumed_step() says how.
    if step_sync.should_stop and step < plan.total_steps:
        step_sync.restore_signal_handlers()
        log(f"stopped by a signal at step {step}, and saved. Rerun to resume (exit 75)")
        return True
    # 7. The evaluation and its record come last.
    if record_kind is not None:
        evaluate_and_record(args, world, state, record_kind)
    return False


def check_step_sync(step_sync, state):
    """All ranks stop with one line if the stream of any rank has ended before this step, or if the
    count of the step's items is wrong. train_step() calls it before train() sets progress.step, so
    progress.step still holds the last step that trained."""
    if step_sync.stream_ended:  # Only a stream ends, so other steps never build this message.
        trained_steps = state.progress.step
        if trained_steps > 0:
            advice = f"pass --max-steps {trained_steps}"
        else:
            advice = "give each rank a whole step"
        fail(
            f"the training stream of a rank ended before step {trained_steps + 1} of "
            f"{state.plan.total_steps}: {advice}, or let the stream repeat"
        )
    check_step_items(step_sync.global_items, state.plan)


def scheduler_steps_now(scheduler, epoch_ends):
    """Return whether a scheduler steps after this optimizer step. A ReduceLROnPlateau steps after
    evaluations instead, and a scheduler marked per_epoch after the last step of an epoch."""
    if isinstance(scheduler, ReduceLROnPlateau):
        return False
    if getattr(scheduler, "per_epoch", False):
        return epoch_ends
    return True


# ====== 4. The step sync ==========================================================================
# A stop signal on any rank stops every rank after the same step. The test
# test_a_signal_to_one_rank_stops_every_rank_at_one_step_and_the_rerun_ends_bit_identical proves it.


class StepSync:
    """At every step, all ranks add up three numbers in one all-reduce over gloo. These are the
    stop signals that they got, their counts of the step's items, and whether their streams have
    ended. So every rank knows the step's count of items over all ranks, and all ranks stop after
    the same step. The three numbers share one all-reduce, because each collective costs a round
    trip between the ranks at every step. start() sends the numbers before the first forward, and
    finish() waits for the sums. A step of tokens, or of a stream, needs its count before the
    first forward, so it calls finish() there. Other steps call finish() at their end, so that they
    do not wait.

    Preemption sends SIGTERM or SIGUSR1, Ctrl-C sends SIGINT, and a closed terminal sends SIGHUP.
    Trap: The handler only notes the signal, because a collective inside a handler deadlocks."""

    def __init__(self, world):
        self.world = world
        self.signals = []  # These are the stop signals that this process got.
        self.should_stop = False  # This says whether any rank got a stop signal.
        self.stream_ended = False  # This says whether any rank's stream ran out in this step.
        self.global_items = 0  # This counts the step's items over all ranks.
        self.numbers = None  # These are the numbers that start() sends, and the all-reduce sums.
        self.reduction = None  # This is the all-reduce in flight between start() and finish().
        self.previous_handlers = handle_stop_signals(self.on_signal)

    def on_signal(self, signum, frame):
        self.signals.append(signum)

    def start(self, rank_items, stream_ended):
        """Send this rank's signals, its count of items and whether its stream has ended."""
        # The all-reduce replaces each of the three numbers with its sum over all ranks, in place.
        # finish() reads the sums in the same order.
        self.numbers = torch.tensor([len(self.signals), rank_items, int(stream_ended)])
        if self.world.world_size > 1:
            # DDP: This adds with SUM, and it runs while the step computes.
            self.reduction = dist.all_reduce(
                self.numbers, group=self.world.gloo_group, async_op=True
            )

    def finish(self):
        """Wait for the sums of all ranks, once in each step."""
        if self.reduction is not None:
            self.reduction.wait()
            # Trap: A finished all-reduce that stays referenced holds the gloo group. Before torch
            # 2.8, a group that is freed late, at exit, can hang the process.
            self.reduction = None
        signals, global_items, ended_ranks = self.numbers.tolist()
        self.should_stop = signals > 0
        self.global_items = global_items
        self.stream_ended = ended_ranks > 0

    def restore_signal_handlers(self):
        for sig, handler in self.previous_handlers.items():
            signal.signal(sig, handler)


def handle_stop_signals(handler):
    """Install the handler for each stop signal, and return the handlers that it replaced."""
    previous_handlers = {}
    for sig in STOP_SIGNALS:
        # Trap: nohup ignores SIGHUP, so that the run outlives its terminal. That choice stays.
        if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        previous_handlers[sig] = signal.signal(sig, handler)
    return previous_handlers


def ignore_signals(worker_id):
    """Trap: A DataLoader worker exits on a SIGTERM from anyone but its parent. torchrun, SLURM and
    terminals signal whole process groups. So the workers ignore the stop signals, and the
    trainer handles them."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


# ====== 5. Exact means ============================================================================
# The gradient and the logged figures are exact means over all the items of a step. Each rank
# counts its items on the CPU before the forward. The plan knows a step's count of samples, and for
# tokens the step sync adds up the counts of all ranks first. Each micro-batch's mean is then
# multiplied by its count over the step's count. The test
# test_n_processes_x_b_with_accumulation_equal_one_process_x_n_times_b proves it.


# The script logs these names itself, as train_loss, eval_samples and so on.
RESERVED_METRICS = {"loss", "samples", "tokens"}


def check_loss_output(output, count):
    """Check what compute_loss returned, and return it as (loss, metrics).

    A mean over no items is 0/0, which is NaN. Its weight is 0, and here it becomes 0, so that NaN
    never reaches a sum. compute_loss() says why its backward must be finite too."""
    if isinstance(output, tuple) and len(output) == 2:
        loss, metrics = output
    else:
        loss, metrics = output, {}
    if not (torch.is_tensor(loss) and loss.ndim == 0 and isinstance(metrics, dict)):
        returned = type(output).__name__
        if torch.is_tensor(loss):
            returned += f", a loss of shape {list(loss.shape)}: its mean"
        fail(
            "compute_loss must return loss or (loss, {name: mean}), where loss is a 0-dim mean "
            f"over the batch's count_items() items. It returned {returned}"
        )
    taken = RESERVED_METRICS.intersection(metrics)
    check(
        not taken, f"compute_loss's metrics {sorted(taken)} are the script's own names: rename them"
    )
    if count == 0:
        loss = loss.nan_to_num()
        metrics = {name: torch.as_tensor(mean).nan_to_num() for name, mean in metrics.items()}
    return loss, metrics


def check_step_items(global_items, plan):
    """A step of samples holds exactly the global batch. Another count means that count_items
    counts something else, such as tokens, and then every mean would be wrong."""
    if COUNT_UNIT != "samples":
        return
    check(
        global_items == plan.global_batch,
        f"count_items counted {global_items} items in a step of {plan.global_batch} samples, but "
        'COUNT_UNIT is samples: count the samples, or set COUNT_UNIT to "tokens"',
    )


def all_reduce_losses(world, totals):
    """Return the totals of all ranks, from this rank's totals since the last call. This is the
    tutorials' loss all_reduce. It is the one place where training reads the device, and only the
    steps that log, evaluate or save reach it. It adds with SUM, because gloo does not support AVG
    on every torch version."""
    names = list(totals.sums)
    # A metric that compute_loss gave as a float has its sum on the CPU, and .to() moves it.
    tensors = [totals.sums[name].to(world.device) for name in names]
    # The count rides in the same all_reduce as the sums. A float64 holds it exactly.
    tensors.append(torch.tensor(totals.count, dtype=torch.float64).to(world.device))
    values = torch.stack(tensors)
    if world.world_size > 1:
        dist.all_reduce(values)  # DDP: Add up the sums and the counts of all ranks.
    *sums, count = values.tolist()
    return Totals(dict(zip(names, sums)), int(count))


def check_finite(loss_sum, model, step):
    """A non-finite loss or weight stops every rank, before a record or a checkpoint holds it. All
    ranks see the same loss sum and the same weights, so they all stop."""
    advice = (
        "the run diverged. Nothing non-finite was saved. Lower --lr, or pass --clip-grad-norm 1.0"
    )
    if not math.isfinite(loss_sum):
        fail(f"the training loss is {loss_sum} at step {step}: {advice}", code=1)
    if not torch.stack([p.isfinite().all() for p in model.parameters()]).all():
        fail(f"the weights are not finite at step {step} (a non-finite gradient): {advice}", code=1)


# ====== 6. Evaluation and records =================================================================
# Evaluation counts each eval sample once, on any world size, as the test
# test_evaluation_counts_each_sample_once_on_a_size_the_world_does_not_divide proves. Each record is
# written once, across stops and crashes, as test_a_crash_between_a_checkpoint_and_its_records_
# loses_no_record proves.


@torch.no_grad()
def evaluate(args, world, model, eval_loader, autocast, prefix="eval_"):
    """All ranks compute the exact means over the eval set, and eval_metrics() turns them into the
    record's {eval_<name>: value}. The prefix of an averaged model is eval_<its name>_.

    Each sample counts once. Rank r evaluates samples r, r + world size, and so on, because
    DistributedSampler would pad the shares with repeated samples. compute_loss gets the raw
    module in eval mode, because DDP's wrapper could wait for the other ranks."""
    if world.world_size > 1:
        # DDP: Every rank evaluates the model that rank 0 saves, with rank 0's BatchNorm statistics.
        # DDP also sends rank 0's buffers to all ranks before each forward in training.
        for buffer in model.buffers():
            dist.broadcast(buffer, 0)
    training_modes = [(module, module.training) for module in model.modules()]
    model.eval()
    rank_totals = Totals()
    for batch in eval_loader:
        count = count_items(batch)
        with autocast:
            output = compute_loss(model, to_device(batch, world.device), args)
        loss, metrics = check_loss_output(output, count)
        rank_totals.add_means({"loss": loss, **metrics}, count)
    # Trap: Do not call model.train(). A part that the task froze in eval mode must stay so.
    for module, training in training_modes:
        module.train(training)
    # A rank's share may be empty, with no names in its sums. So the ranks gather plain values.
    plain_sums = {name: float(value) for name, value in rank_totals.sums.items()}
    this_rank = (plain_sums, rank_totals.count)
    per_rank = [this_rank]
    if world.world_size > 1:
        per_rank = [None] * world.world_size
        dist.all_gather_object(per_rank, this_rank, group=world.gloo_group)  # DDP: Gather all sums.
    totals = Totals()
    for rank_sums, rank_count in per_rank:
        totals.add(rank_sums, rank_count)
    means = eval_metrics(totals.means(""), args)
    metrics = {f"{prefix}{name}": value for name, value in means.items()}
    metrics["eval_samples"] = len(eval_loader.dataset)
    if COUNT_UNIT != "samples":
        metrics[f"eval_{COUNT_UNIT}"] = totals.count
    return metrics


def evaluate_models(args, world, model, averaged_models, eval_loader, autocast):
    """Evaluate the model and each averaged model, and return their metrics as one record."""
    metrics = evaluate(args, world, model, eval_loader, autocast)
    for name, averaged in averaged_models.items():
        metrics |= evaluate(args, world, averaged.module, eval_loader, autocast, f"eval_{name}_")
    return metrics


def progress_record(plan, progress, grad_norm, throughput):
    """Return a progress record: the means since the last one, the lr, the norm and the speed."""
    step = progress.step
    record = {"kind": "progress", "step": step, "epoch": plan.epoch_of(step)}
    record.update(progress.totals_since_log.means("train_"))
    record["lr"] = progress.lr
    record["grad_norm"] = grad_norm.item()
    record.update(throughput.metrics(step))  # This also starts the next window of the throughput.
    return record


def due_record_kind(args, state, step):
    """Return the kind of record that is due after this step: "epoch" after the last step of an
    epoch or of the run, "eval" after an --eval-every step of a run with an eval set, or None."""
    plan = state.plan
    if step % plan.steps_per_epoch == 0 or step == plan.total_steps:
        return "epoch"
    has_eval_set = len(state.eval_loader.dataset) > 0
    if has_eval_set and args.eval_every > 0 and step % args.eval_every == 0:
        return "eval"
    return None


def evaluate_and_record(args, world, state, kind):
    """All ranks evaluate, and rank 0 writes the record of the last step, of the kind that
    due_record_kind() gave, and gives it to report(). An epoch record evaluates too, so no eval
    record comes beside it. A ReduceLROnPlateau steps with the record's eval loss."""
    plan = state.plan
    step = state.progress.step
    record = {"kind": kind, "step": step, "epoch": plan.epoch_of(step)}
    if kind == "epoch":
        record.update(epoch_metrics(world, state))
    if len(state.eval_loader.dataset) > 0:
        metrics = evaluate_models(
            args, world, state.raw_model, state.averaged_models, state.eval_loader, state.autocast
        )
        record.update(metrics)
    write_record(args, world, record, plan.total_steps)
    if world.rank == 0:
        report(record, args, state.raw_model)
    step_plateau_schedulers(state, record)


def finish_resumed_step(args, world, state):
    """All ranks finish the step that the run resumes from, as the stopped run would have.

    Rank 0 first deletes the records past that step from metrics.jsonl, because this run writes
    them again. Then the step's own eval or epoch record needs care. After such a step, after_step()
    does three things in this order:
    1. It saves the checkpoint, and this run resumed from it.
    2. It evaluates, and rank 0 writes the record.
    3. Each ReduceLROnPlateau steps with the record's eval loss.
    A stop signal ends the run between 1 and 2, and a kill can end it anywhere. So the record may
    be missing, and then all ranks do 2 and 3 now. If the record is there, only 3 is left to do,
    because the checkpoint was saved before 3."""
    step = state.progress.step
    records_in_file = truncate_metrics_after(args, world, step)
    kind = due_record_kind(args, state, step)
    if step == 0 or kind is None:
        return  # A new run, or a step without an eval or epoch record, has nothing to finish.
    if kind not in records_in_file:
        evaluate_and_record(args, world, state, kind)  # This does 2 and 3.
    else:
        step_plateau_schedulers(state, records_in_file[kind])  # This does 3.


def step_plateau_schedulers(state, record):
    """Every rank steps each ReduceLROnPlateau with the eval loss of the record."""
    for scheduler in state.schedulers:
        if isinstance(scheduler, ReduceLROnPlateau) and "eval_loss" in record:
            scheduler.step(record["eval_loss"])


def epoch_metrics(world, state):
    """Return an epoch record's training metrics: its means, its items, its rate and its seconds."""
    totals = state.progress.epoch_totals
    plan = state.plan
    step = state.progress.step
    epoch = plan.epoch_of(step)
    steps = step - (epoch - 1) * plan.steps_per_epoch  # These are the epoch's steps up to this one.
    metrics = totals.means("train_")
    metrics["train_samples"] = steps * plan.global_batch
    if COUNT_UNIT != "samples":
        metrics[f"train_{COUNT_UNIT}"] = totals.count
    metrics["lr"] = state.progress.lr
    metrics["world_size"] = world.world_size
    metrics["epoch_s"] = state.progress.epoch_seconds
    return metrics


def evaluate_checkpoint(args, world):
    """--eval-only evaluates the out-dir's checkpoint on any world size. Its record is printed and
    given to report(), but not written to metrics.jsonl, which holds the training's records."""
    path, checkpoint = read_checkpoint(args.out_dir)
    check(checkpoint, f"--eval-only: there is no checkpoint in {args.out_dir}: train first")
    _, eval_set, model = build_task(args, world)
    check(len(eval_set) > 0, "--eval-only: build_datasets gives no eval set")
    averaged_models = build_averaged_models(args, model)
    for name, part in {"model": model, **averaged_models}.items():
        trained_without = f"{path} was trained without {name}: pass the flags of its training"
        check(name in checkpoint["parts"], f"--eval-only: {trained_without}")
        try:
            part.load_state_dict(checkpoint["parts"][name])
        except RuntimeError as exc:
            fail(f"{path} is of another model: {one_line(exc)}")
    eval_loader = make_eval_loader(args, world, eval_set)
    start_workers(eval_loader)
    step = checkpoint["progress"]["step"]
    log(f"{PROG}: evaluating {path} (step {step}) on world size {world.world_size}, {world.device}")
    record = {"kind": "eval", "step": step}
    autocast = make_autocast(args, world.device)
    record |= evaluate_models(args, world, model, averaged_models, eval_loader, autocast)
    write_record(args, world, record, step, to_file=False)
    if world.rank == 0:
        report(record, args, model)
    return 0


class Throughput:
    """The items trained per second since the last progress record, and the seconds left. It
    counts the steps of this process only, so a resume in the middle of a window measures what it
    trains."""

    def __init__(self, first_step, total_steps):
        self.total_steps = total_steps
        self.last_step = first_step  # This is the step of the last call to metrics().
        self.last_time = time.perf_counter()
        self.items = 0  # This counts the items since the last call to metrics().

    def add(self, count):
        self.items += count

    def metrics(self, step):
        """Return the speed since the last call, and start counting again."""
        now = time.perf_counter()
        seconds = now - self.last_time
        eta_s = seconds / (step - self.last_step) * (self.total_steps - step)
        speed = {f"{COUNT_UNIT}_per_s": self.items / seconds, "eta_s": eta_s}
        self.last_step = step
        self.last_time = now
        self.items = 0
        return speed


def write_record(args, world, record, total_steps, to_file=True):
    """Rank 0 prints a progress, eval or epoch record and adds it to metrics.jsonl."""
    if world.rank != 0:
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


def truncate_metrics_after(args, world, step):
    """Rank 0 removes the records past the checkpoint's step from metrics.jsonl, as TensorBoard's
    purge_step does. Return the records that the file holds at the step, as {kind: record}, on
    every rank."""
    path = f"{args.out_dir}/metrics.jsonl"
    records_in_file = {}
    kept_lines = []
    if world.rank == 0 and os.path.exists(path):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):  # A crash can tear the last line.
                    record = json.loads(line)
                    if record["step"] <= step:
                        # A line that a crash cut just after its record is whole but has no newline.
                        kept_lines.append(line.rstrip("\n") + "\n")
                    if record["step"] == step:
                        records_in_file[record["kind"]] = record
        with open(f"{path}.tmp", "w") as f:
            f.writelines(kept_lines)
        os.replace(f"{path}.tmp", path)
    if world.world_size > 1:  # All ranks need the records, because they all evaluate.
        broadcast_list = [records_in_file]
        dist.broadcast_object_list(broadcast_list, src=0, group=world.gloo_group)
        records_in_file = broadcast_list[0]
    return records_in_file


def end_run(args, world, state):
    """All ranks end a run that has trained its last step. Rank 0 gives report() a last record."""
    log(f"saved {args.out_dir}/model.pt after {state.progress.step} steps")
    if world.rank == 0:
        report({"kind": "end", "step": state.progress.step}, args, state.raw_model)
    return 0


def rewrite_final_weights(args, world, state):
    """A rerun of a finished run writes model.pt again from the final checkpoint. Then model.pt
    always holds the weights of the run that the checkpoint finished, even if the same out-dir had
    an earlier run of fewer steps."""
    if world.rank == 0:
        save_weights(args, state)
    log(
        f"{args.out_dir} holds a finished run ({state.progress.step} steps): nothing to train. "
        "Raise --epochs or --max-steps to train on, or pass another --out-dir"
    )
    log(f"saved {args.out_dir}/model.pt after {state.progress.step} steps")
    return 0


def save_weights(args, state):
    """Rank 0 writes model.pt, and <name>.pt for each averaged model."""
    # Trap: Save the raw module. DDP adds "module." to every key, and compile adds "_orig_mod.".
    atomic_save(state.raw_model.state_dict(), f"{args.out_dir}/model.pt")
    for name, averaged in state.averaged_models.items():
        atomic_save(averaged.module.state_dict(), f"{args.out_dir}/{name}.pt")


def log_header(args, world, state):
    """Rank 0 says what this run is, in three lines."""
    plan = state.plan
    backend = dist.get_backend() if world.world_size > 1 else "no process group"
    epoch = f"{plan.steps_per_epoch} steps/epoch"
    if not plan.stream:  # A stream's length is unknown.
        train_size = len(state.sampler.dataset)
        left_out = train_size - plan.steps_per_epoch * plan.global_batch
        epoch += f" (each leaves out {left_out} of its {train_size:,} samples)"
    log(
        f"{PROG}: world size {world.world_size}, {backend}, {world.device}, "
        f"{torch.get_num_threads()} thread(s)/process,\n"
        f"torch {torch.__version__}; files in {args.out_dir}: "
        "checkpoint.pt, metrics.jsonl, model.pt\n"
        f"global batch {plan.global_batch} = {args.batch_size}/process x {world.world_size} x "
        f"{plan.grad_accum} accum, {epoch}, {len(state.eval_loader.dataset):,} eval samples"
    )


# ====== 7. Checkpoints ============================================================================
# A stopped run resumes bit for bit, and a crash during a save keeps the last good checkpoint. The
# test test_sigterm_to_the_launcher_stops_every_rank_and_the_rerun_ends_bit_identical proves it.


# A checkpoint of another format is of another version of ddp_train.py, and the script refuses it.
CHECKPOINT_FORMAT = 4
# A resume does not compare these flags with the checkpoint's, since they may change freely.
FREE_AT_RESUME = ("out_dir", "eval_only", "spawn", "rank", "local_rank", "timeout")


def save_checkpoint(args, world, state):
    """All ranks gather their random states. Rank 0 writes the checkpoint and keeps the previous
    one. All ranks wait until it is written."""
    own_state = rng_state()
    if state.plan.stream:  # Each rank's stream has a place of its own, which rides with its rng.
        own_state["stream"] = state.loader.dataset.state_dict()
    rng_states = [own_state]
    if world.world_size > 1:
        rng_states = [None] * world.world_size
        dist.all_gather_object(rng_states, own_state, group=world.gloo_group)
    if state.plan.stream:  # Every rank checks every stream's state, so all ranks agree.
        # Trap: A value that a weights_only torch.load cannot read, such as numpy's int64, would
        # make the checkpoint unreadable.
        streams = [rank_state["stream"] for rank_state in rng_states]
        check(
            is_plain(streams),
            "the stream's state_dict() holds values other than ints, floats, strings, bools, "
            "None, lists and dicts with string keys: make them plain, so that a checkpoint can "
            "hold them",
        )
    unmap_optimizer_state(state.optimizers)  # Trap: Its docstring says why a resume needs this.
    if world.rank == 0:  # DDP: Only rank 0 writes the checkpoint.
        # Plain values let a weights_only torch.load read the progress and the flags back.
        plain_args = {}
        for name, value in vars(args).items():
            if type(value) not in (int, float, str, bool, type(None)):
                value = str(value)
            plain_args[name] = value
        checkpoint = {
            "format": CHECKPOINT_FORMAT,
            "progress": dataclasses.asdict(state.progress),
            "args": plain_args,
            "rng": rng_states,
            "global_batch": state.plan.global_batch,
            "world_size": world.world_size,
            "parts": {name: part.state_dict() for name, part in state.stateful_parts.items()},
        }
        stem = f"{args.out_dir}/checkpoint"
        atomic_save(checkpoint, f"{stem}.pt", previous=f"{stem}.prev.pt")
    if world.world_size > 1:
        # Trap: No rank goes on or exits before the checkpoint is written.
        dist.barrier(group=world.gloo_group)


def is_plain(value):
    """Return whether a value holds only ints, floats, strings, bools, None, lists, and dicts with
    string keys. The types must match exactly, because a weights_only torch.load refuses their
    subclasses, such as numpy's float64."""
    if type(value) is list:
        return all(is_plain(item) for item in value)
    if type(value) is dict:
        return all(type(key) is str and is_plain(item) for key, item in value.items())
    return type(value) in (int, float, str, bool, type(None))


def unmap_optimizer_state(optimizers):
    """Trap: A resumed optimizer keeps tensors that map the checkpoint's file, and a deleted file
    keeps its disk space while a process maps it. So before a save, each rank copies those tensors
    into memory of its own, and then the save deletes the old file for good.

    read_checkpoint() maps the file, so that the ranks of a node share its pages. The model's
    load_state_dict() copies the saved tensors into the model's own tensors. The optimizer's
    load_state_dict() keeps a saved tensor itself where its device and dtype are already right. On
    the CPU, that holds for its whole state. On a GPU, it holds only for the step counts of an
    optimizer that is neither fused nor capturable, which stay on the CPU. torch cannot resize a
    tensor that maps a file, because the file fixes its size. So `not resizable()` finds the mapped
    tensors, and only those are copied."""
    for optimizer in optimizers:
        for values in optimizer.state.values():
            for key, value in values.items():
                if torch.is_tensor(value) and not value.untyped_storage().resizable():
                    values[key] = value.clone()


def restore_checkpoint(args, world, stateful_parts, path, checkpoint):
    """Load every stateful part from the checkpoint, and this rank's random generators. Return
    the run's progress.

    On another world size, the ranks keep the generators that were just seeded, because the
    checkpoint holds the states of other ranks."""
    saved_parts = checkpoint["parts"]
    advice = "Use the saved ones"
    if saved_parts.keys() != stateful_parts.keys():
        fail(
            f"{path} is of another model, optimizer or --amp: it holds {sorted(saved_parts)}, "
            f"and this run has {sorted(stateful_parts)}. {advice}"
        )
    try:
        for name, part in stateful_parts.items():
            part.load_state_dict(saved_parts[name])
    except (RuntimeError, ValueError, KeyError) as exc:
        fail(f"{path} is of another model, optimizer or --amp: {one_line(exc)}. {advice}")
    saved_ranks = len(checkpoint["rng"])
    if saved_ranks == world.world_size:
        set_rng_state(checkpoint["rng"][world.rank])
    progress = SavedProgress(**checkpoint["progress"])
    # dataclasses.asdict() saved each Totals as a dict, and these lines make them Totals again.
    progress.epoch_totals = Totals(**progress.epoch_totals)
    progress.totals_since_log = Totals(**progress.totals_since_log)
    log(f"resumed from {path} at step {progress.step}, saved by {saved_ranks} process(es)")
    changed = []
    for name, value in vars(args).items():
        # A flag that the checkpoint's run did not have counts as unchanged.
        saved_value = checkpoint["args"].get(name, value)
        if name not in FREE_AT_RESUME and saved_value != value:
            changed.append(f"--{name.replace('_', '-')} {value} (it had {saved_value})")
    if changed:
        log(
            f"flags unlike the checkpoint's run: {', '.join(changed)}. Its optimizers keep their "
            "learning rate and weight decay, and it keeps its global batch. Every other flag is "
            "this command's, and a new --epochs or --max-steps reshapes the schedule from here"
        )
    return progress


def restore_stream(world, stream, path, checkpoint):
    """Load this rank's place in its stream. The checkpoint holds each rank's place beside its
    random states, so a stream resumes on the same world size only."""
    saved_ranks = len(checkpoint["rng"])
    check("stream" in checkpoint["rng"][0], f"{path} has no stream: pass another --out-dir")
    check(
        saved_ranks == world.world_size,
        f"{path} holds the places of {saved_ranks} streams: resume on {saved_ranks} processes",
    )
    stream.load_state_dict(checkpoint["rng"][world.rank]["stream"])


def read_checkpoint(out_dir):
    """Return (path, checkpoint) for the out-dir's last checkpoint, or (None, None).

    Where the last checkpoint is damaged, it returns the one before it."""
    stem = f"{out_dir}/checkpoint"
    if os.path.exists(f"{stem}.pt"):
        paths = [f"{stem}.pt", f"{stem}.prev.pt"]
    else:
        # A crash between atomic_save's two renames leaves the new checkpoint in the .tmp file.
        paths = [f"{stem}.pt.tmp", f"{stem}.prev.pt"]
    problems = []
    for path in paths:
        if not os.path.exists(path):
            continue
        if path.endswith(".tmp") and not zipfile.is_zipfile(path):
            # A save that was cut short has no zip directory at its end. It was never published.
            log(f"{path} was cut short while it was written, so the run starts without it")
            continue
        try:
            # Trap: Without map_location, every rank loads onto the GPU that saved the file. mmap
            # lets the ranks of a node share the file's pages while they restore. Without it, each
            # rank of a node reads the whole file into its own memory at the same time.
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            problems.append(f"{path} is unreadable ({one_line(exc)})")
            continue
        if not (isinstance(checkpoint, dict) and "progress" in checkpoint):
            problems.append(f"{path} is not a checkpoint of {PROG}")
            continue
        check(
            checkpoint.get("format") == CHECKPOINT_FORMAT,
            f"{path} is of another ddp_train.py (checkpoint format {checkpoint.get('format', 1)}, "
            f"this one reads {CHECKPOINT_FORMAT}): finish its run with the script that wrote it, "
            "or pass another --out-dir",
        )
        if problems:
            log(f"{problems[0]}: resuming from {path}")
        return path, checkpoint
    check(
        not problems,
        f"{'. '.join(problems)}. Move it away to start over, or pass another --out-dir",
    )
    return None, None


def promote_tmp_checkpoint(world, path):
    """Trap: A crash between atomic_save's two renames leaves the newest checkpoint in
    checkpoint.pt.tmp, and read_checkpoint() takes it. The next save deletes any .tmp file before
    it writes. So rank 0 renames the file to checkpoint.pt first, once every rank has read it."""
    if world.rank == 0 and path and path.endswith(".tmp"):
        os.replace(path, path.removesuffix(".tmp"))


def atomic_save(obj, path, previous=None):
    """Trap: A crash in the middle of a write must not cost the last good file. So we write a temp
    file, flush it to the disk and then rename it. The file that it replaces becomes `previous`."""
    # Trap: Write a new file, and do not cut the old one to zero. A run that resumed from the old
    # file still maps its pages.
    with contextlib.suppress(FileNotFoundError):
        os.remove(f"{path}.tmp")
    with open(f"{path}.tmp", "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if previous and os.path.exists(path):
        os.replace(path, previous)
    os.replace(f"{path}.tmp", path)


class ResumableBatchSampler:
    """The training DataLoader's batch_sampler. It gives this rank's micro-batches of an epoch.

    Step s of an epoch trains the items of the epoch's shuffle from s x G to (s + 1) x G, where G
    is the global batch. DistributedSampler gives rank r the items r, r + W, r + 2W and so on of the
    shuffle, where W is the world size. So this rank's items of step s are the items from s x P to
    (s + 1) x P of its share, where P is G / W. They are cut into micro-batches of --batch-size. A
    resumed epoch sets skip_steps, and then the first micro-batch is the one that the run stopped
    before."""

    def __init__(self, sampler, batch_size, plan):
        self.sampler = sampler
        self.batch_size = batch_size
        self.per_step = plan.grad_accum * batch_size  # This counts this rank's samples in a step.
        self.steps_per_epoch = plan.steps_per_epoch
        self.skip_steps = 0  # A resumed epoch leaves out the steps that it has trained.

    def __iter__(self):
        share = list(self.sampler)
        end = self.steps_per_epoch * self.per_step
        for start in range(self.skip_steps * self.per_step, end, self.batch_size):
            yield share[start : start + self.batch_size]

    def __len__(self):
        return (self.steps_per_epoch - self.skip_steps) * self.per_step // self.batch_size


def seed_everything(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    if numpy:
        numpy.random.seed(seed % 2**32)


def rank_seed(args, world):
    """Return the seed of this rank's random draws in training. Every rank builds the model from
    args.seed, so the 1 sets the ranks' seeds apart from it."""
    return args.seed + 1 + world.rank


def rng_state():
    """Return this process's random states, as values that a weights_only torch.load reads."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if numpy:
        # numpy's state holds an array of keys, which becomes a list of ints here.
        numpy_state = list(numpy.random.get_state())
        numpy_state[1] = numpy_state[1].tolist()
        state["numpy"] = numpy_state
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    if numpy and "numpy" in state:
        numpy.random.set_state(state["numpy"])


# ====== 8. Setup ==================================================================================
# These functions build what setup_training() needs. A resume on another world size keeps its
# global batch, as test_a_node_that_leaves_and_joins_again_resumes_the_run_with_its_global_batch
# proves.


def checkpointed_parts(model, scaler, optimizers, schedulers, averaged_models):
    """Return {name: part} of every part that a checkpoint saves and restores."""
    parts = {"model": model, "scaler": scaler}
    for i, (optimizer, scheduler) in enumerate(zip(optimizers, schedulers)):
        parts[f"optimizer{i}"] = optimizer
        parts[f"scheduler{i}"] = scheduler
    taken = sorted(parts.keys() & averaged_models.keys())
    check(not taken, f"build_averaged_models names {taken}, which the checkpoint uses: rename them")
    parts.update(averaged_models)
    return parts


def build_task(args, world):
    """Return (train_set, eval_set, model). They are the same on every rank and world size."""
    args.rank = world.rank  # The task's functions may read where this process is.
    args.local_rank = world.local_rank
    configure_torch(args)
    seed_everything(args.seed)  # This comes first, so a random split agrees across the ranks.
    train_set, eval_set = build_datasets(args)
    if eval_set is None:
        eval_set = []
    stream = isinstance(train_set, torch.utils.data.IterableDataset)
    for name, dataset in [("training", train_set), ("eval", eval_set)]:
        if name == "training" and stream:
            continue  # A stream has no length. make_train_loader() says how it trains.
        check(
            hasattr(dataset, "__len__"),
            f"the {name} set is a {type(dataset).__name__} without a length: DistributedSampler "
            "needs a map-style Dataset (with __len__ and __getitem__), which gives every rank an "
            "exact share and lets a stopped run resume at the very sample it stopped at",
        )
    if stream:  # make_train_loader() says how a stream trains and resumes.
        check(
            hasattr(train_set, "state_dict") and hasattr(train_set, "load_state_dict"),
            "the training stream has no state_dict() and load_state_dict(): add them",
        )
    if stream and not args.eval_only:  # --eval-only starts no training loader.
        check(args.workers == 0, "a stream keeps its place in the workers: pass --workers 0")
    parameters = list(inspect.signature(collate_fn).parameters)
    check(
        parameters[1:] == ["args", "training"],
        f"collate_fn takes ({', '.join(parameters)}), and the loaders call it with the keywords "
        "args and training: make it collate_fn(items, args, training)",
    )
    seed_everything(args.seed)  # This gives the same initial weights on any world size.
    model = build_model(args).to(world.device)
    if args.sync_bn:
        check(world.device.type == "cuda", "--sync-bn needs GPUs (SyncBatchNorm runs on CUDA)")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return train_set, eval_set, model


def make_plan(args, world, train_set, path, checkpoint):
    # DDP: A step's global batch is --batch-size times the world size times the accumulation. A run
    # that resumes on another world size keeps its global batch and changes its accumulation.
    # nanoGPT does the same when it divides its accumulation by the world size.
    global_batch = args.batch_size * world.world_size * args.grad_accum
    if checkpoint and checkpoint["global_batch"] != global_batch:
        if checkpoint["world_size"] == world.world_size:  # Here the flags differ, not the world.
            fail(
                f"{path} trained with a global batch of {checkpoint['global_batch']}, "
                f"this run's is {global_batch}: pass the same --batch-size and --grad-accum, "
                "or another --out-dir"
            )
        global_batch = checkpoint["global_batch"]  # A new world keeps it, so grad_accum changes.
    batch_of_all_ranks = args.batch_size * world.world_size
    grad_accum = global_batch // batch_of_all_ranks
    if grad_accum == 0 or global_batch % batch_of_all_ranks != 0:
        per_process = global_batch // world.world_size
        hint = "" if global_batch % world.world_size == 0 else ", on a world size that divides it"
        fail(
            f"the global batch of {global_batch} is not {world.world_size} processes x "
            f"--batch-size {args.batch_size} x a whole accumulation: pass a --batch-size that "
            f"divides {per_process}{hint}"
        )
    stream = isinstance(train_set, torch.utils.data.IterableDataset)
    if stream:  # A stream has no length. Its one epoch is --max-steps steps.
        check(
            args.max_steps > 0, "the training set is a stream of unknown length: pass --max-steps"
        )
        steps_per_epoch = args.max_steps
    else:
        steps_per_epoch = len(train_set) // global_batch
        check(
            steps_per_epoch > 0,
            f"the {len(train_set)} training samples do not fill one global batch of "
            f"{global_batch}: lower --batch-size or --grad-accum",
        )
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    epochs = math.ceil(total_steps / steps_per_epoch)
    return Plan(global_batch, grad_accum, steps_per_epoch, total_steps, epochs, stream)


def check_same_start(world, step):
    # Trap: If only some nodes see the checkpoint, the ranks would start at different steps and
    # train apart. So all ranks compare their starting step.
    if world.world_size > 1:
        starts = [None] * world.world_size
        dist.all_gather_object(starts, step, group=world.gloo_group)
        check(
            len(set(starts)) == 1,
            f"the ranks start at steps {starts}: pass an --out-dir on a disk that all nodes share",
        )


def loader_options(args, world, workers, training):
    """Return the DataLoader options of the training loader or of the eval loader."""
    return dict(
        collate_fn=functools.partial(collate_fn, args=args, training=training),
        num_workers=workers,
        worker_init_fn=ignore_signals,  # Trap: ignore_signals() says why.
        persistent_workers=workers > 0,
        pin_memory=world.device.type == "cuda",
        # Trap: Each loader needs a generator of its own. Otherwise iter() draws the workers' seeds
        # from the global generator, and that draw shifts the numbers that the model draws later.
        generator=torch.Generator().manual_seed(rank_seed(args, world)),
    )


def make_eval_loader(args, world, eval_set):
    """Return the eval DataLoader. Its shares do not overlap, as evaluate() says. Its workers are
    --eval-workers, and the default of 0 keeps no worker idle while the run trains."""
    rank_indices = range(world.rank, len(eval_set), world.world_size)
    options = loader_options(args, world, args.eval_workers, training=False)
    return DataLoader(eval_set, args.batch_size, sampler=rank_indices, **options)


def start_workers(loader):
    """Start a DataLoader's persistent workers now. Each later iter() reuses them."""
    if loader.num_workers > 0:
        iter(loader)


def make_autocast(args, device):
    """Return --amp's autocast. Without --amp, there is no autocast at all, because even a disabled
    one costs microseconds in every forward."""
    if args.amp == "off":
        return contextlib.nullcontext()
    amp_dtype = torch.bfloat16 if args.amp == "bf16" else torch.float16
    return torch.autocast(device.type, amp_dtype)


def to_device(batch, device):
    """Move a batch to the device, without waiting for the GPU.

    The batch may nest tuples, namedtuples, lists and mappings of tensors. A tensor moves itself,
    and so does any object with a .to() of its own, such as a tokenizer's BatchEncoding."""
    if hasattr(batch, "to"):
        try:
            return batch.to(device, non_blocking=True)
        except TypeError:  # Some objects have a .to() that takes no non_blocking.
            return batch.to(device)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # This is a namedtuple.
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


# ====== 9. Launchers: a first read can skip this section ==========================================
# These functions let one command work under every launcher. The test
# test_every_launch_mode_trains_the_same_run_and_only_rank_0_writes proves it.


def spawn(processes, argv):
    """--spawn N starts N processes of this script on this machine, as torchrun --standalone does.

    This process hosts their store on a free port, and it passes the stop signals on to them. It
    returns 0, or 75 where they stopped and saved. Where one fails, it kills the others, and it
    returns the exit code of the first that failed."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    main_spec = sys.modules["__main__"].__spec__  # `python -m pkg.train` runs that module again.
    script = ["-m", main_spec.name] if main_spec else [sys.argv[0]]
    command = [sys.executable, *script, *(argv or sys.argv[1:])]
    env = {
        **os.environ,
        "WORLD_SIZE": str(processes),
        "LOCAL_WORLD_SIZE": str(processes),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        # Then fresh_rendezvous_store() works as it does under torchrun.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets this too, as the processes share cores.
    workers = []

    # A Ctrl-C in a terminal reaches the workers too, but a kill reaches only this process.
    def pass_on(signum, frame):
        for worker in workers:
            worker.send_signal(signum)

    handle_stop_signals(pass_on)
    for rank in range(processes):
        rank_env = env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
        workers.append(subprocess.Popen(command, env=rank_env))
    return wait_for_workers(workers)


def wait_for_workers(workers):
    """Wait for the workers of --spawn, and return their exit code as spawn() says."""
    codes = {}  # This maps each worker that has ended to its exit code, in the order of their ends.
    while len(codes) < len(workers):
        time.sleep(0.1)
        for worker in workers:
            if worker not in codes and worker.poll() is not None:
                codes[worker] = worker.returncode
        # Trap: A failed worker leaves the others waiting for it until --timeout, as in a
        # collective. So the first failure kills the others, as torchrun does.
        if any(code not in (0, EXIT_STOPPED) for code in codes.values()):
            for worker in workers:
                if worker not in codes:
                    worker.kill()
    failures = [code for code in codes.values() if code not in (0, EXIT_STOPPED)]
    if not failures and EXIT_STOPPED in codes.values():
        return EXIT_STOPPED
    if not failures:
        return 0
    first_failure = failures[0]
    if first_failure < 0:
        # A worker that a signal N killed returns -N, and a shell writes that as 128 + N.
        return 128 - first_failure
    return first_failure


def fresh_rendezvous_store(timeout):
    """Return a store for this round of workers alone, or None outside torchrun.

    A store is the key-value server where the processes find each other when they join the
    process group. A round is one start of the workers. torchrun starts a new round at each
    restart and at each change of nodes. torchrun sets TORCHELASTIC_USE_AGENT_STORE=True when its
    workers share its own store, and --spawn sets it too.

    Trap: torchrun 2.5 and later keeps one store for all the rounds of a job. The keys that the
    old round's process group wrote are still there, and a new round would read them and wait for
    workers that are gone (pytorch/pytorch#135712). The first round works without this function,
    and only a later round would hang. So a job that torchrun never restarts, with no
    --max-restarts and a fixed --nnodes, does not need it. Here each round makes a store of its own:
    1. Rank 0 serves a new, empty store on a free port.
    2. Rank 0 writes that port into torchrun's store, under one key that every round uses.
    3. The other ranks read the port from that key. The read waits until some round has written it.
    4. A rank may read the old round's port, if it reads before rank 0 writes the new one. That
       port refuses the connection, because the old rank 0 has exited. So the rank reads again."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host = env["MASTER_ADDR"]  # This is rank 0's node, which also serves torchrun's store.
    torchrun_store = dist.TCPStore(host, int(env["MASTER_PORT"]), timeout=timeout)
    if env["RANK"] == "0":
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        torchrun_store.set("ddp_train_round_store", str(store.port))
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        port = int(torchrun_store.get("ddp_train_round_store"))
        try:
            socket.create_connection((host, port), timeout=10).close()
            return dist.TCPStore(host, port, timeout=timeout)
        except ConnectionRefusedError:
            # Only an old round's port refuses, because its rank 0 has exited. Any other error is a
            # real fault, and it stops the run.
            time.sleep(0.1)
    raise TimeoutError(f"rank 0 of this round served no store within {timeout}")


def torchrun_variables_from_slurm(env):
    """Translate SLURM's variables into torchrun's, for a bare `srun python ddp_train.py`.

    With several tasks, this gives the rank, the world size and the local rank. The first node of
    the job step serves the rendezvous, on a port of the step's own, by run_multi_node.sh's rule.
    Outside SLURM, or with one task, it returns no variables."""
    if int(env.get("SLURM_STEP_NUM_TASKS", 1)) <= 1:
        return {}
    variables = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"]}
    variables["LOCAL_RANK"] = env["SLURM_LOCALID"]
    variables["MASTER_ADDR"] = env.get("MASTER_ADDR") or first_host(env["SLURM_STEP_NODELIST"])
    # The port lies in 61000 to 65499, above Linux's ephemeral ports. Each job gets 11 ports in a
    # row, one for each of its first 11 job steps, so two jobs on one node get two ports. A requeue
    # moves the port by 2221, about half the range, so the requeued job does not wait for its old
    # port. The numbers have no other meaning, and run_multi_node.sh uses the same formula.
    job = int(env.get("SLURM_JOB_ID", 0))
    job_step = int(env.get("SLURM_STEP_ID", 0))
    requeues = int(env.get("SLURM_RESTART_COUNT", 0))
    port = 61000 + (job * 11 + job_step + 2221 * requeues) % 4500
    variables["MASTER_PORT"] = env.get("MASTER_PORT") or str(port)
    return variables


def first_host(nodelist):
    """Return the first host of a SLURM node list. "gpu[07-09,12]-ib,cpu1" gives "gpu07-ib"."""
    # The first entry ends at the first comma outside brackets. Here it is "gpu[07-09,12]-ib".
    first_entry = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist).group()
    # Each bracket becomes its first number. "gpu[07-09,12]-ib" becomes "gpu07-ib".
    return re.sub(r"\[(\d+)[^\]]*\]", r"\1", first_entry)


# ====== 10. Flags and errors ======================================================================
# A classic mistake ends in one line that names the fix. The test
# test_a_classic_mistake_is_one_line_naming_the_fix_and_costs_nothing proves it.


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line and a non-zero exit, not the usage text."""

    def error(self, message):
        fail(f"{message} (see --help)")


def parse_args(argv=None):
    """Return the script's flags and the task's flags. Each flag's default is in --help."""
    parser = OneLineParser(
        allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_script_flags(parser)
    add_task_flags(parser)
    args = parser.parse_args(argv)
    minimums = {
        "epochs": 1,
        "batch_size": 1,
        "grad_accum": 1,
        "max_steps": 0,
        "lr": 0,
        "warmup_steps": 0,
        "weight_decay": 0,
        "clip_grad_norm": 0,
        "seed": 0,
        "log_every": 0,
        "eval_every": 0,
        "save_every": 0,
        "workers": 0,
        "eval_workers": 0,
        "timeout": 0,
        "spawn": 0,
    }
    for name, least in minimums.items():
        value = getattr(args, name)
        check(value >= least, f"--{name.replace('_', '-')} must be at least {least}, not {value}")
    return args


def add_script_flags(parser):
    """Add the script's own flags. A switch, such as --compile, also has a --no-compile."""
    switch = argparse.BooleanOptionalAction
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--max-steps", type=int, default=0, help="steps to train (0: --epochs)")
    parser.add_argument("--batch-size", type=int, default=64, help="per process and micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="the peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=0, help="steps of linear warmup")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's, on matrices")
    parser.add_argument(
        "--clip-grad-norm", type=float, default=0.0, help="max gradient norm (0: off)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the data, weights and shuffle")
    parser.add_argument(
        "--out-dir", default=f"out/{PROG.removesuffix('.py')}", help="rank 0's files"
    )
    parser.add_argument(
        "--log-every", type=int, default=100, help="steps per progress line (0: off)"
    )
    parser.add_argument("--eval-every", type=int, default=0, help="steps (0: at epoch ends only)")
    parser.add_argument("--save-every", type=int, default=500, help="steps (0: at epoch ends)")
    parser.add_argument("--eval-only", action=switch, default=False, help="evaluate, then exit")
    parser.add_argument("--amp", default="off", choices=["off", "bf16", "fp16"], help="autocast")
    parser.add_argument("--compile", action=switch, default=False, help="compile the DDP model")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per process")
    parser.add_argument("--eval-workers", type=int, default=0, help="the eval DataLoader's")
    parser.add_argument("--find-unused-parameters", action=switch, default=False, help="DDP's flag")
    parser.add_argument("--sync-bn", action=switch, default=False, help="SyncBatchNorm on GPUs")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for peers")
    parser.add_argument("--spawn", type=int, default=0, help="start N processes on this machine")
    # The legacy launcher passes --local-rank=N, and older torch passes --local_rank=N.
    parser.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)


def log(*args, **kwargs):
    """Print on rank 0 only. It reads the rank from the environment, where every launcher puts it,
    because it also prints before the process group exists."""
    if os.environ.get("RANK", "0") != "0":  # DDP: Only rank 0 prints.
        return
    try:
        print(*args, **kwargs, flush=True)
    except BrokenPipeError:  # Trap: A closed standard output, as in | head, must not stop us.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def check(ok, message):
    if not ok:
        fail(message)


def fail(message, code=2, every_rank=False):
    """Stop with one line and no traceback. Only rank 0 prints it, since all ranks have the same to
    say, unless every_rank asks each rank to print its own."""
    if every_rank or os.environ.get("RANK", "0") == "0":
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def one_line(exc):
    """Return an exception's message on one line of at most 300 characters."""
    return " ".join(str(exc).split())[:300]


# ====== 11. Workarounds for torch =================================================================
# Each of these works around a behaviour of some torch versions. Each names the versions that need
# it and the test that guards it. A copy may delete one only for the versions that do not need it.

# Trap: Keep this import, although nothing here uses it. It prevents an abort at exit.
# 1. The functions of torch.distributed.nn.functional take group=group.WORLD as a default argument.
#    Python computes a default once, when it imports the module, and the default stays for good.
# 2. DDP imports that module. Had it done so after init_process_group, each default would hold our
#    process group for good, and destroy_process_group() could not free the group.
# 3. Then gloo's threads would live until the interpreter exits, and there they can abort a run
#    that has already saved ("terminate called").
# This line runs when Python imports this file, before main() makes any group. So each default
# holds None. test_no_thread_of_the_process_group_outlives_main guards it. Without this import,
# that test fails on torch 2.5.1, 2.6, 2.8, 2.10, 2.13 and 2.15, and it passes on 2.4.1. So torch
# 2.5 and later need the import.
import torch.distributed.nn.functional  # noqa: E402, F401


def destroy_process_group_gloo_last(world):
    """Trap: On torch before 2.8, destroy_process_group() can hang (pytorch#154976).
    1. destroy_process_group() frees gloo's backend while it holds the GIL.
    2. The backend waits for its threads to end, and the threads wait for the GIL. So both wait.
    So we keep a reference of our own to the backend, which torch's private _get_backend() gives.
    Then destroy_process_group() cannot free the backend. Our `del` frees it last, through torch's
    Python handle, which lets go of the GIL before it frees a backend. So gloo's threads can end.
    The version tier on torch 2.4.1 guards it, where runs of two processes would hang at exit now
    and then. On torch 2.8 and later, destroy_process_group() is enough, and a copy for those
    versions may call it in place of this function."""
    gloo_backend = world.gloo_group._get_backend(torch.device("cpu"))
    world.gloo_group = None  # Then only gloo_backend keeps the backend alive.
    dist.destroy_process_group()
    del gloo_backend


def clear_traceback_frames(exc):
    """Trap: The frames of a traceback hold the DDP model and the loaders. Clearing them lets
    cleanup_distributed() free the model before the process group, so that an error that leaves the
    loop exits without an abort. test_no_thread_of_the_process_group_outlives_main[spawn 2-error]
    guards it. Without this call, gloo's threads outlive main() after an error on torch 2.4.1,
    2.5.1, 2.6, 2.13 and 2.15, so keep it on every torch."""
    traceback.clear_frames(exc.__traceback__)


if __name__ == "__main__":
    sys.exit(main())
