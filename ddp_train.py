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

Read it from top to bottom. Section 1 is your task. Edit its flags and functions here, or assign
your own from a script that imports this file, as examples/digits.py does. Section 2 joins the
process group and leaves it. Section 3 is the training loop. Sections 4 to 10 hold the machinery
that the loop calls. Each of them opens with what it guarantees and the test that proves it. A first
read can trust the loop's calls by their names and stop after section 3. Each line that DDP adds to
a plain training loop is marked "DDP:". Each classic trap is marked "Trap:", and docs/guarantees.md
names the test that guards each trap.
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import inspect
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

# Trap: Keep this import, although nothing here uses it. It prevents an abort at exit. The
# functions of this module have the default argument group=group.WORLD, and Python computes a
# default once, when it imports the module. DDP imports this module after init_process_group, and
# then each default holds our process group. cleanup_distributed() could not free the group, and
# gloo's threads would live until the interpreter exits, where they can abort a run that has saved
# ("terminate called"). Imported here, before any group exists, each default holds None.
import torch.distributed.nn.functional  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing import errors
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, default_collate

try:  # numpy is optional. If a Dataset draws from numpy, we seed and checkpoint its generator.
    import numpy
except ImportError:
    numpy = None

PROG = os.path.basename(sys.argv[0])  # The messages name the script that runs, such as mine.py.
# These signals make the run save and exit with code 75. Schedulers send them to preempt a job
# (torchrun, SLURM and Kubernetes do), and Ctrl-C sends SIGINT.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


# ====== 1. Your task: replace these ==============================================================

# This says what compute_loss counts. It is "samples", or "tokens" for a language model.
COUNT_UNIT = "samples"

# These are your task's own flags, in addition to the script's flags in FLAGS (section 10). Each
# entry gives the name, the default and the help text. The default sets the type, so write 0.0 for a
# float, not 0. A default of True or False makes a switch. Then --name turns it on, and --no-name
# turns it off. Your code reads the value as args.name.
TASK_FLAGS = [
    ("num-samples", 32768, "the default task's training samples"),
    ("eval-samples", 4096, "the default task's evaluation samples (0: none)"),
]

# These replace the defaults of the script's flags for your task, by the flag's name with
# underscores, for example {"lr": 1.0, "epochs": 14}. The command line still overrides them.
TASK_DEFAULTS = {}

# The default task has Gaussian inputs. A random linear "teacher" gives each input its label.
FEATURES = 32
CLASSES = 10


class InMemory(TensorDataset):
    """The default task's tensors. It reads a whole batch with one gather, not with a loop."""

    def __getitems__(self, indices):
        rows = torch.tensor(indices)
        return tuple(tensor.index_select(0, rows) for tensor in self.tensors)


def build_datasets(args):
    """Return (train_set, eval_set). Both are map-style Datasets, which have a __len__, and every
    rank builds the same ones. The eval_set may be None or empty, and then nothing is evaluated."""
    check(args.num_samples >= 0, f"--num-samples is {args.num_samples}: it is at least 0")
    check(args.eval_samples >= 0, f"--eval-samples is {args.eval_samples}: it is at least 0")
    generator = torch.Generator().manual_seed(args.seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)

    def make(size):
        inputs = torch.randn(size, FEATURES, generator=generator)
        return InMemory(inputs, (inputs @ teacher).argmax(dim=1))

    return make(args.num_samples), make(args.eval_samples)


def build_model(args):
    """Return any nn.Module. The default task uses a small MLP classifier."""
    return nn.Sequential(
        nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES)
    )


def compute_loss(model, batch, args=None):
    """Return (loss, count) or (loss, count, metrics) for one batch that collate_fn made.

    The batch is already on the device. In training, model is the DDP model, which is compiled
    with --compile, and its forward must run so that DDP sees it. In evaluation, model is the raw
    module in eval mode. The args hold the flags, such as a --label-smoothing in TASK_FLAGS.
    The loss is the MEAN over count items, as F.cross_entropy returns it.
    The count is an int or a 0-dim tensor. It counts samples, or a language model's real tokens
    when COUNT_UNIT is "tokens", for example (labels != -100).sum().
    The metrics are a dict {name: mean over the same items}. They are logged as train_<name> and
    eval_<name>.
    The script multiplies each mean by its count, so every gradient and every logged figure is
    the exact mean over all the items of a step. A mean over no items gets a weight of 0, but its
    gradient must still be finite, as the gradient of F.cross_entropy is."""
    inputs, targets = batch
    logits = model(inputs).float()
    loss = F.cross_entropy(logits, targets)
    if model.training:  # Training skips the accuracy, so that it stays fast.
        return loss, len(targets)
    return loss, len(targets), {"accuracy": (logits.argmax(dim=1) == targets).float().mean()}


def collate_fn(items):
    """Turn what the Dataset gave for a batch into the batch. A list of items goes through
    default_collate, which stacks them, and items of different shapes need a collate_fn that pads,
    as in examples/tinylm.py. InMemory gives a whole batch as a tuple of tensors, which stays."""
    return items if isinstance(items, tuple) else default_collate(items)


def build_optimizer(args, model, plan=None):
    """Return one optimizer, or a list of them.

    The plan holds global_batch, steps_per_epoch and total_steps. A resume on another world size
    keeps the global batch, so a rate that scales with it stays the same. The default is nanoGPT's
    AdamW. It decays only the matrices and embeddings, and one fused kernel updates every weight."""
    params = list(model.parameters())
    decayed = [p for p in params if p.dim() >= 2]
    not_decayed = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decayed, "weight_decay": args.weight_decay},
        {"params": not_decayed, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, fused=True)


def build_scheduler(args, optimizer, total_steps, plan=None):
    """Return a torch LRScheduler, such as OneCycleLR, for one optimizer.

    The script steps it after each optimizer step and saves it in each checkpoint. The default
    warms up linearly over --warmup-steps and then decays to 0 along a cosine. A schedule in
    epochs takes plan.steps_per_epoch, as in StepLR(optimizer, step_size=plan.steps_per_epoch)."""

    def factor(step):  # The step argument counts the optimizer steps done before this one.
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        decay_steps = max(1, total_steps - args.warmup_steps)
        return (1 + math.cos(math.pi * (step - args.warmup_steps) / decay_steps)) / 2

    return LambdaLR(optimizer, factor)


def report(record, args, model):
    """Rank 0 calls this with each record that it logs. Send the record to W&B or TensorBoard here.

    If the record's step saves a checkpoint, the checkpoint is written before this call. The run's
    files are in args.out_dir. The model is the raw module, and its state_dict() holds the weights
    of this step."""


# ====== 2. Joining the process group, and leaving it =============================================


@dataclasses.dataclass
class World:
    """This process's place in the run."""

    rank: int  # The rank goes from 0 to world_size - 1 over all nodes.
    world_size: int
    device: torch.device
    # Small CPU messages, such as the stop flag, go over this gloo group. On GPUs it is a group
    # beside the NCCL group, because NCCL moves only GPU tensors, in the GPU's queue of work. On
    # CPUs it is the process group itself. One process has no group.
    cpu_group: object = None


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
        return World(rank, world_size, device)
    timeout = datetime.timedelta(seconds=timeout_s)
    # DDP: Join the process group. GPUs use NCCL and CPUs use gloo. The timeout turns a missing
    # peer into an error instead of a hang.
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        store = round_store(timeout)  # Each round of workers gets its own store (section 9).
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
    return World(rank, world_size, device, cpu_group)


def pick_device(local_rank):
    """Return this process's device. It is cuda:LOCAL_RANK where there are GPUs, else the CPU.

    On a GPU machine, CUDA_VISIBLE_DEVICES= makes the run train on the CPUs."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if local_rank < gpus:
        index = local_rank
    elif gpus == 1 and "LOCAL_WORLD_SIZE" not in os.environ:
        index = 0  # With srun --gpus-per-task=1, each task sees only its own GPU.
    else:
        processes = os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)
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
    # Trap: The DDP model must be freed before its process group, or gloo can abort at exit.
    gc.collect()
    if not dist.is_initialized():
        return
    # Trap: On torch before 2.8, destroy_process_group() can hang (pytorch#154976). It frees gloo's
    # backend while it holds the GIL, and the backend waits for its threads, which wait for the GIL.
    # So we keep a reference to the backend, and destroy_process_group() cannot free it. Our `del`
    # frees it last. torch's Python handle lets go of the GIL before it frees a backend, so gloo's
    # threads can finish. A copy that needs torch 2.8 or later may drop the lines of gloo_backend.
    gloo_backend = world.cpu_group._get_backend(torch.device("cpu"))
    world.cpu_group = None  # Then only gloo_backend keeps the backend alive.
    dist.destroy_process_group()  # DDP: Leave the process group.
    del gloo_backend


# ====== 3. The loop: read this section first ======================================================
# main(), train() and train_step() are the tutorials' loop, in torch's own names. The state that the
# loop keeps comes before them.


@dataclasses.dataclass
class Plan:
    """What a step is, and how many steps there are."""

    global_batch: int  # This counts the samples of a step over all ranks.
    grad_accum: int  # This counts the micro-batches of a step on each rank.
    steps_per_epoch: int  # Each step is a full global batch, so an epoch drops its partial end.
    total_steps: int
    epochs: int  # This counts the epochs that the steps reach. --max-steps can end one in part.


@dataclasses.dataclass
class Sums:
    """The sums of the loss and the metrics over some items, and the count of those items.

    Each sum adds a mean multiplied by its count, so a sum divided by the count is an exact mean.
    This rank's sums stay on the device as tensors, so that no step waits for the GPU. The loss
    all_reduce adds up the sums of all ranks and reads them to the host, where they are floats."""

    sums: dict = dataclasses.field(default_factory=dict)
    count: object = 0  # This is an int, a float, or a tensor where compute_loss counts with one.

    def add(self, other):
        for name, value in other.sums.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        self.count += other.count

    def add_batch(self, loss, count, metrics):
        """Add one batch's means, each multiplied by its count. The sums add up in float64."""
        for name, mean in {"loss": loss, **metrics}.items():
            value = torch.as_tensor(mean, dtype=torch.float64).detach() * count
            self.sums[name] = self.sums.get(name, 0.0) + value
        self.count += count

    def means(self, prefix):
        """Return {prefix + name: mean}, or {} where no item was counted."""
        if not self.count:
            return {}
        return {f"{prefix}{name}": value / self.count for name, value in self.sums.items()}

    def packed(self, device):
        """Return the sums and the count in one float64 tensor on the device."""
        values = [*self.sums.values(), self.count]
        return torch.stack([on_device(value, device) for value in values])

    def unpacked(self, packed):
        """Return packed sums as floats on the host. This is the one read of the device."""
        values = packed.tolist()
        return Sums(dict(zip(self.sums, values[:-1])), values[-1])


@dataclasses.dataclass
class Progress:
    """The run's position, and the sums that its next records report. Every checkpoint saves it."""

    step: int = 0  # This counts the optimizer steps done.
    # These sum the steps of this epoch, and the steps since the last progress record.
    epoch_totals: Sums = dataclasses.field(default_factory=Sums)
    window_totals: Sums = dataclasses.field(default_factory=Sums)
    # This is the step's count over all ranks, as we expect it before the step. Each micro-batch
    # multiplies its mean loss by its count divided by this. For samples, it is the global batch. A
    # token count is known only after the forward, but the weight is needed before the backward.
    # Adding up the real count first would make each micro-batch wait for the GPU and the other
    # ranks. So a token run guesses the last step's count, and train_step corrects the gradients
    # after the backward. None means that no step has made a guess yet.
    expected_count: object = None
    # These are the records of the last step, and they wait to be written. The loop adds them after
    # the step, and the step's checkpoint saves them as a part of Progress. After the save, all
    # ranks run the evaluation that an eval or epoch record needs, and rank 0 writes the records to
    # metrics.jsonl. A stop before the last step ends the run after the save, and so can a crash.
    # Then the resumed run writes the records before it trains. unwritten_records() leaves out the
    # records that metrics.jsonl already holds, so that each record is written once.
    records: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TrainState:
    """Everything that training holds. setup_training() makes it, in running order."""

    plan: Plan
    progress: Progress
    raw_model: nn.Module  # We save and evaluate the raw module, and report() gets it.
    ddp_model: nn.Module  # DDP's wrapper gives no_sync(). A single process has the raw module here.
    forward_model: nn.Module  # compute_loss calls this. It is the DDP model or its compiled form.
    checkpointed: dict  # A checkpoint saves and restores these stateful parts, by name.
    optimizers: list
    schedulers: list
    scaler: torch.amp.GradScaler  # It scales fp16's loss, and it is disabled otherwise.
    autocast: object  # This is --amp's autocast, or a context that does nothing.
    sampler: DistributedSampler
    batch_sampler: "ResumableBatchSampler"
    loader: DataLoader
    eval_loader: DataLoader
    local_sums: Sums  # These are this rank's sums since the last loss all_reduce.
    local_sums_since: int  # The local sums cover the steps after this one.


@errors.record  # Under torchrun, this puts a worker's traceback in torchrun's failure summary.
def main(argv=None):
    args = parse_args(argv)
    if args.spawn and "RANK" not in os.environ:
        return spawn(args.spawn, argv)  # This waits until all the processes have exited.
    world = init_distributed(args.timeout)
    try:
        return evaluate_checkpoint(args, world) if args.eval_only else train(args, world)
    except BaseException as exc:
        # Trap: The frames of a traceback hold the DDP model and the loaders. Clearing them lets
        # cleanup_distributed() free the model before the process group.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        cleanup_distributed(world)


def train(args, world):
    """Train, and return the exit code. All ranks run every line, and only rank 0 writes."""
    state = setup_training(args, world)
    plan, progress = state.plan, state.progress
    # A stop or a crash can leave the checkpoint's records unwritten, as Progress.records says.
    evaluate_and_write_records(args, world, state, progress.records)
    if progress.step >= plan.total_steps and os.path.exists(f"{args.out_dir}/model.pt"):
        log(  # A finished run without model.pt goes on, and finish() writes the file.
            f"{args.out_dir} holds a finished run ({progress.step} steps): nothing to train. Raise "
            "--epochs or --max-steps to train on, or pass another --out-dir"
        )
        return 0
    log_header(args, world, state)
    stop = StopAgreement(world)
    speed = Throughput(progress.step, plan.total_steps)
    for epoch in range(progress.step // plan.steps_per_epoch, plan.epochs):
        epoch_end = min(plan.total_steps, (epoch + 1) * plan.steps_per_epoch)
        state.sampler.set_epoch(epoch)  # Trap: Without it, every epoch repeats the first shuffle.
        # A resumed epoch skips the steps that it has already trained.
        state.batch_sampler.skip_steps = progress.step - epoch * plan.steps_per_epoch
        epoch_started = time.perf_counter()
        micro_batches = iter(state.loader)  # Each train_step takes its micro-batches from here.
        for step in range(progress.step + 1, epoch_end + 1):
            stop.send()  # All ranks send whether they got a stop signal.
            log_now = args.log_every > 0 and step % args.log_every == 0
            lr, grad_norm = train_step(args, world, state, micro_batches, want_norm=log_now)
            progress.step = step
            stop.collect()  # If any rank got a signal, all ranks stop after this step.
            eval_now = args.eval_every > 0 and step % args.eval_every == 0
            periodic_save = args.save_every > 0 and step % args.save_every == 0
            save_now = periodic_save or step == epoch_end or stop.should_stop
            # All ranks reduce the loss only here, as a reduction at every step waits for the GPU.
            if log_now or eval_now or save_now:
                reduced = all_reduce_losses(world, state)  # DDP: This is the loss all_reduce.
                state.local_sums, state.local_sums_since = Sums(), step  # The sums start again.
                progress.epoch_totals.add(reduced)
                progress.window_totals.add(reduced)
            progress.records = []  # These wait for the save, as Progress.records says.
            position = {"step": step, "epoch": epoch + 1}
            if log_now:
                metrics = progress.window_totals.means("train_") | {"lr": lr}
                metrics["grad_norm"] = grad_norm.item()
                metrics |= speed.metrics(step, progress.window_totals.count)
                progress.records.append({"kind": "progress"} | position | metrics)
                progress.window_totals = Sums()
            if step == epoch_end:  # An epoch's record evaluates too, so no eval record follows.
                metrics = epoch_metrics(world, state, epoch, lr, epoch_started)
                progress.records.append({"kind": "epoch"} | position | metrics)
                progress.epoch_totals = Sums()
            elif eval_now and len(state.eval_loader.dataset):
                progress.records.append({"kind": "eval"} | position)
            # All ranks save first, so that the grace period after a stop signal goes to the save.
            if save_now:
                save_checkpoint(args, world, state)
            # A stop before the last step ends the run here, and the rerun writes these records
            # first. A stop at the last step needs no rerun, so the run ends as usual below.
            if stop.should_stop and step < plan.total_steps:
                return finish(args, world, state, stop, stopped_early=True)
            evaluate_and_write_records(args, world, state, progress.records)
    return finish(args, world, state, stop, stopped_early=False)


def setup_training(args, world):
    """All ranks build what training needs, in running order, and resume from a checkpoint."""
    train_set, eval_set, model = build_task(args, world)
    path, checkpoint = read_checkpoint(args.out_dir)
    plan = make_plan(args, world, len(train_set), path, checkpoint)
    optimizers = call_task(build_optimizer, args, model, plan)
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]  # The task may return one optimizer or a list of them.
    schedulers = [
        call_task(build_scheduler, args, opt, plan.total_steps, plan) for opt in optimizers
    ]
    autocast = make_autocast(args, world.device)
    scaler = torch.amp.GradScaler(world.device.type, enabled=args.amp == "fp16")
    checkpointed = {"model": [model], "optimizers": optimizers, "schedulers": schedulers}
    checkpointed["scaler"] = [scaler]
    progress = Progress(expected_count=plan.global_batch if COUNT_UNIT == "samples" else None)
    # DDP: Each rank gets a random stream of its own, so that dropout differs between the ranks.
    seed_everything(args.seed + 1 + world.rank)
    if checkpoint:
        progress = restore_checkpoint(args, world, checkpointed, path, checkpoint)
    # The parts now hold what they need, so we drop the file. On GPUs this frees its pages before
    # the workers start. On the CPU, a restored optimizer keeps the loaded tensors as its state.
    del checkpoint
    # DDP: Each rank reads its own share of each epoch's shuffle. drop_last makes the shares equal.
    sampler = DistributedSampler(
        train_set, world.world_size, world.rank, seed=args.seed, drop_last=True
    )
    batch_sampler = ResumableBatchSampler(sampler, args.batch_size, plan)
    loader = DataLoader(train_set, batch_sampler=batch_sampler, **loader_options(args, world))
    eval_loader = make_eval_loader(args, world, eval_set)
    # Trap: The workers start now, once, before any collective. On Python before 3.12, a fork while
    # a gloo or NCCL thread frees a finished collective can deadlock the child (CPython #112275).
    start_workers(loader)
    start_workers(eval_loader)
    check_same_start(world, progress.step)
    ddp_model = model
    if world.world_size > 1:
        # DDP: The wrap broadcasts rank 0's weights. Then it averages the gradients in buckets.
        ddp_model = DDP(
            model,
            find_unused_parameters=args.find_unused_parameters,
            gradient_as_bucket_view=True,
        )
    forward_model = torch.compile(ddp_model) if args.compile else ddp_model
    if world.rank == 0:  # Rank 0 writes only now, after every check, so a mistake writes nothing.
        os.makedirs(args.out_dir, exist_ok=True)
    progress.records = unwritten_records(args, world, progress)
    return TrainState(
        plan=plan, progress=progress, raw_model=model, ddp_model=ddp_model,
        forward_model=forward_model, checkpointed=checkpointed, optimizers=optimizers,
        schedulers=schedulers, scaler=scaler, autocast=autocast, sampler=sampler,
        batch_sampler=batch_sampler, loader=loader, eval_loader=eval_loader,
        local_sums=Sums(), local_sums_since=progress.step,
    )  # fmt: skip


def train_step(args, world, state, micro_batches, want_norm):
    """All ranks take one optimizer step over this rank's next --grad-accum micro-batches.

    It returns the step's learning rate and its gradient norm. The norm is a tensor, and it is
    None unless the step clips or logs it."""
    progress = state.progress
    rank_items = 0  # This counts this rank's items in this step, samples or tokens.
    for i in range(state.plan.grad_accum):
        batch = to_device(next(micro_batches), world.device)
        # DDP: no_sync skips the gradient all-reduce. Only the last micro-batch's backward runs it.
        skip_sync = i < state.plan.grad_accum - 1 and world.world_size > 1
        with state.ddp_model.no_sync() if skip_sync else contextlib.nullcontext():
            with state.autocast:
                output = call_task(compute_loss, state.forward_model, batch, args)
                loss, count, metrics = unpack_loss(output)
            state.local_sums.add_batch(loss, count, metrics)
            # In a token run's first step, the first micro-batch gives the guess of the count.
            if progress.expected_count is None:
                progress.expected_count = sum_over_ranks(world, count) * state.plan.grad_accum
            # DDP: DDP averages the gradients over the ranks, so each mean is multiplied by its
            # count over the step's count, times the world size. For samples, it is 1/--grad-accum.
            # Progress.expected_count says why a token run has to guess the step's count.
            weight = count * world.world_size / progress.expected_count
            state.scaler.scale(loss * weight).backward()
        rank_items += count
    if COUNT_UNIT != "samples":
        # DDP: Now we know the step's real count over all ranks. We rescale every gradient so that
        # it uses the real count, not the guess. This holds for fp16's scaled gradients too,
        # because the scaler later divides them by its scale.
        real_count = sum_over_ranks(world, rank_items)
        grads = [p.grad for p in state.raw_model.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, (progress.expected_count / real_count).to(grads[0].dtype))
        progress.expected_count = real_count  # This is the next step's guess.
    grad_norm = None
    if args.clip_grad_norm or want_norm:
        for optimizer in state.optimizers:
            # Trap: Clip and log the true gradients, not the gradients that fp16 scaled up.
            state.scaler.unscale_(optimizer)
        max_norm = args.clip_grad_norm or math.inf  # A limit of inf only measures the norm.
        grad_norm = nn.utils.clip_grad_norm_(state.raw_model.parameters(), max_norm)
    lr = state.optimizers[0].param_groups[0]["lr"]
    for optimizer, scheduler in zip(state.optimizers, state.schedulers):
        state.scaler.step(optimizer)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    state.scaler.update()
    return lr, grad_norm


def evaluate_and_write_records(args, world, state, records):
    """All ranks run the evaluations that the eval and epoch records need. Then rank 0 writes the
    records. This comes after the step's checkpoint, so report() may use the saved files."""
    for record in records:
        if record["kind"] != "progress" and len(state.eval_loader.dataset):
            record |= evaluate(args, world, state.raw_model, state.eval_loader, state.autocast)
        write_record(args, world, record, state.raw_model, state.plan.total_steps)


def finish(args, world, state, stop, stopped_early):
    """Return the exit code. It is 75 where a stop signal ended the run before its last step, after
    its checkpoint was saved. Otherwise rank 0 saves the weights in model.pt, and the code is 0. A
    rerun of a finished run that has no model.pt writes it here, from the weights it restored."""
    if stopped_early:
        log(
            f"stopped by a signal at step {state.progress.step}, and the checkpoint is saved. "
            "Rerun the same command to resume (exit 75)"
        )
    else:
        # Trap: Save the raw module. DDP would add "module." to every key, and compile "_orig_mod.".
        if world.rank == 0:
            atomic_save(state.raw_model.state_dict(), f"{args.out_dir}/model.pt")
        log(f"saved {args.out_dir}/model.pt after {state.progress.step} steps")
    # The handlers stay until model.pt is written, so a signal before then is only noted.
    stop.restore()
    return 75 if stopped_early else 0


# ====== 4. Exact means ============================================================================
# The gradient and the logged figures are exact means over all the items of a step. The test
# test_n_processes_x_b_with_accumulation_equal_one_process_x_n_times_b proves it.


# The script logs these names itself, as train_loss, eval_samples and so on.
RESERVED_METRICS = {"loss", "samples", "tokens"}


def unpack_loss(output):
    """Check the result of compute_loss, and return it as (loss, count, metrics).

    A mean over no items is 0/0, which is NaN. It gets a weight of 0, so it becomes 0, and NaN never
    reaches a sum. For a tensor count, torch.where does this on the device, and no step waits for
    the GPU."""
    loss, count, metrics = output, None, None
    if isinstance(output, tuple) and len(output) == 2:
        loss, count, metrics = *output, {}
    elif isinstance(output, tuple) and len(output) == 3:
        loss, count, metrics = output
    if not (torch.is_tensor(loss) and loss.ndim == 0 and isinstance(metrics, dict)):
        shape = f", a loss of shape {list(loss.shape)}: its mean" if torch.is_tensor(loss) else ""
        fail(
            "compute_loss must return (loss, count) or (loss, count, {name: mean}), where "
            f"loss is a 0-dim mean over count items. It returned {type(output).__name__}{shape}"
        )
    taken = RESERVED_METRICS.intersection(metrics)
    if taken:
        fail(f"compute_loss's metrics {sorted(taken)} are the script's own names: rename them")
    if torch.is_tensor(count):
        loss = torch.where(count > 0, loss, 0.0)
        metrics = {name: torch.where(count > 0, mean, 0.0) for name, mean in metrics.items()}
    elif not count:
        loss = loss.nan_to_num()
        metrics = {name: torch.as_tensor(mean).nan_to_num() for name, mean in metrics.items()}
    return loss, count, metrics


def all_reduce_losses(world, state):
    """All ranks add up their training sums since the last call, and check them. This is the
    tutorials' loss all_reduce. It returns the sums of all ranks, on the host.

    It adds with SUM, because gloo does not support AVG on every torch version. A non-finite loss
    or weight stops every rank here, before any record or checkpoint holds it."""
    step = state.progress.step
    packed = state.local_sums.packed(world.device)
    if world.world_size > 1:
        dist.all_reduce(packed)  # DDP: Add up every rank's sums.
    totals = state.local_sums.unpacked(packed)
    advice = (
        "the run diverged. Nothing non-finite was saved. Lower --lr, or pass --clip-grad-norm 1.0"
    )
    if not math.isfinite(totals.sums["loss"]):
        fail(f"the training loss is {totals.sums['loss']} at step {step}: {advice}", code=1)
    if not torch.stack([p.isfinite().all() for p in state.raw_model.parameters()]).all():
        fail(f"the weights are not finite at step {step} (a non-finite gradient): {advice}", code=1)
    samples = (step - state.local_sums_since) * state.plan.global_batch
    check(
        COUNT_UNIT != "samples" or totals.count == samples,
        f"compute_loss counted {totals.count:g} for {samples} samples, but COUNT_UNIT is samples: "
        'return the sample count, or set COUNT_UNIT to what it counts ("tokens")',
    )
    return totals


def sum_over_ranks(world, count):
    """Return a count summed over all ranks, as a float64 tensor on the device. It is at least 1,
    because a step without a single token trains nothing and must not divide by zero."""
    total = on_device(count, world.device)
    if world.world_size > 1:
        dist.all_reduce(total)
    return total.clamp(min=1)


def on_device(number, device):
    """Return a count or a sum as a float64 tensor on the device.

    Trap: torch.as_tensor(an int, device="cuda") copies from pageable memory, and the step waits
    for the GPU. A copy from pinned memory is only queued on the stream, and the step goes on."""
    if torch.is_tensor(number) and number.device == device:
        return number.to(torch.float64)
    host = torch.tensor(float(number), dtype=torch.float64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


# ====== 5. Evaluation and records =================================================================
# Evaluation counts each eval sample once, on any world size. The test
# test_evaluation_counts_each_sample_once_on_a_size_the_world_does_not_divide proves it.


@torch.no_grad()
def evaluate(args, world, model, eval_loader, autocast):
    """All ranks compute the exact means over the eval set, as {eval_<name>: mean}.

    Each sample counts once. Rank r evaluates samples r, r + world size, and so on, because
    DistributedSampler would pad the shares with repeated samples. compute_loss gets the raw
    module in eval mode, because DDP's wrapper could wait for the other ranks."""
    if world.world_size > 1:
        # DDP: Every rank evaluates the model that rank 0 saves, with rank 0's BatchNorm statistics.
        # DDP also sends rank 0's buffers to all ranks before each forward in training.
        for buffer in model.buffers():
            dist.broadcast(buffer, 0)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    local_sums = Sums()
    for batch in eval_loader:
        with autocast:
            output = call_task(compute_loss, model, to_device(batch, world.device), args)
            loss, count, metrics = unpack_loss(output)
        local_sums.add_batch(loss, count, metrics)
    # Trap: Do not call model.train(). A part that the task froze in eval mode must stay so.
    for module, training in modes:
        module.train(training)
    this_rank = local_sums.unpacked(local_sums.packed(world.device))
    per_rank = [this_rank]
    # A rank's share may be empty, with no names in its sums. So the ranks gather objects.
    if world.world_size > 1:
        per_rank = [None] * world.world_size
        dist.all_gather_object(per_rank, this_rank, group=world.cpu_group)  # DDP: Gather all sums.
    totals = Sums()
    for rank_totals in per_rank:
        totals.add(rank_totals)
    metrics = totals.means("eval_") | {"eval_samples": len(eval_loader.dataset)}
    if COUNT_UNIT != "samples":
        metrics[f"eval_{COUNT_UNIT}"] = totals.count
    return metrics


def evaluate_checkpoint(args, world):
    """--eval-only evaluates the out-dir's checkpoint on any world size. Its record is printed and
    given to report(), but not written to metrics.jsonl, which holds the training's records."""
    path, checkpoint = read_checkpoint(args.out_dir)
    check(checkpoint, f"--eval-only: there is no checkpoint in {args.out_dir}: train first")
    _, eval_set, model = build_task(args, world)
    check(len(eval_set) > 0, "--eval-only: build_datasets gives no eval set")
    try:
        model.load_state_dict(checkpoint["model"][0])
    except RuntimeError as exc:
        fail(f"{path} is of another model: {one_line(exc)}")
    eval_loader = make_eval_loader(args, world, eval_set)
    start_workers(eval_loader)
    autocast = make_autocast(args, world.device)
    step = checkpoint["progress"]["step"]
    log(f"{PROG}: evaluating {path} (step {step}) on world size {world.world_size}, {world.device}")
    metrics = evaluate(args, world, model, eval_loader, autocast)
    record = {"kind": "eval", "step": step} | metrics
    write_record(args, world, record, model, step, to_file=False)
    return 0


def epoch_metrics(world, state, epoch, lr, epoch_started):
    """Return an epoch record's training metrics: its means, its items and its seconds."""
    totals, plan = state.progress.epoch_totals, state.plan
    steps = state.progress.step - epoch * plan.steps_per_epoch
    return {
        **totals.means("train_"),
        f"train_{COUNT_UNIT}": totals.count,
        "lr": lr,
        "train_samples": steps * plan.global_batch,
        "world_size": world.world_size,
        "epoch_s": time.perf_counter() - epoch_started,
    }


class Throughput:
    """The items trained per second since the last progress record, and the seconds left."""

    def __init__(self, first_step, total_steps):
        self.last_step, self.total_steps = first_step, total_steps
        self.last_time = time.perf_counter()

    def metrics(self, step, items):
        """Return the speed since the last call, given the items trained since then."""
        now = time.perf_counter()
        seconds = now - self.last_time
        eta_s = seconds / (step - self.last_step) * (self.total_steps - step)
        self.last_step, self.last_time = step, now
        return {f"{COUNT_UNIT}_per_s": items / seconds, "eta_s": eta_s}


def write_record(args, world, record, model, total_steps, to_file=True):
    """Rank 0 writes a progress, eval or epoch record to the console, metrics.jsonl and report()."""
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
    report(record, args, model)


def log_header(args, world, state):
    """Rank 0 says what this run is, in three lines."""
    plan, train_size = state.plan, len(state.sampler.dataset)
    backend = dist.get_backend() if world.world_size > 1 else "no process group"
    left_out = train_size - plan.steps_per_epoch * plan.global_batch
    log(
        f"{PROG}: world size {world.world_size}, {backend}, {world.device}, "
        f"{torch.get_num_threads()} thread(s)/process,\n"
        f"torch {torch.__version__}; files in {args.out_dir}: "
        "checkpoint.pt, metrics.jsonl, model.pt\n"
        f"global batch {plan.global_batch} = {args.batch_size}/process x {world.world_size} x "
        f"{plan.grad_accum} accum, {plan.steps_per_epoch} steps/epoch (each leaves out {left_out} "
        f"of its {train_size:,} samples), {len(state.eval_loader.dataset):,} eval samples"
    )


def unwritten_records(args, world, progress):
    """Return the checkpoint's records that metrics.jsonl does not hold yet, on every rank.

    Rank 0 drops the file's records past the checkpoint's step, which the run writes again. A crash
    while rank 0 wrote the step's records can leave some of them in the file, and this leaves those
    out. So each record is in the file once. All ranks take rank 0's list, as they all evaluate."""
    records = progress.records
    path = f"{args.out_dir}/metrics.jsonl"
    if world.rank == 0 and os.path.exists(path):
        kept_lines = []
        written_kinds = set()  # These are the kinds of the file's records at the checkpoint's step.
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):  # A crash can tear the last line.
                    record = json.loads(line)
                    if record["step"] <= progress.step:
                        # A line that a crash cut just after its record is whole but has no newline.
                        kept_lines.append(line.rstrip("\n") + "\n")
                    if record["step"] == progress.step:
                        written_kinds.add(record["kind"])
        with open(f"{path}.tmp", "w") as f:
            f.writelines(kept_lines)
        os.replace(f"{path}.tmp", path)
        records = [record for record in records if record["kind"] not in written_kinds]
    if world.world_size > 1:
        shared = [records]
        dist.broadcast_object_list(shared, src=0, group=world.cpu_group)
        records = shared[0]
    return records


# ====== 6. Checkpoints ============================================================================
# A stopped run resumes bit for bit, and a crash during a save keeps the last good checkpoint. The
# test test_sigterm_to_the_launcher_stops_every_rank_and_the_rerun_ends_bit_identical proves it.


# Format 1 is the format of the checkpoints that ddp_train.py wrote before its redesign.
CHECKPOINT_FORMAT = 2
# A resume does not compare these flags with the checkpoint's, since they may change freely.
FREE_AT_RESUME = ("out_dir", "eval_only", "spawn", "local_rank", "timeout")
# A weights_only torch.load reads back values of these types. Other flags are saved as str.
WEIGHTS_ONLY_TYPES = (int, float, str, bool, type(None))


def save_checkpoint(args, world, state):
    """All ranks gather their random states. Rank 0 writes the checkpoint and keeps the previous
    one. All ranks wait until it is written."""
    rng_states = [rng_state()]
    if world.world_size > 1:
        rng_states = [None] * world.world_size
        dist.all_gather_object(rng_states, rng_state(), group=world.cpu_group)
    if world.rank == 0:
        flags = {}
        for name, value in vars(args).items():
            flags[name] = value if type(value) in WEIGHTS_ONLY_TYPES else str(value)
        checkpoint = {
            "format": CHECKPOINT_FORMAT,
            # Plain values let a weights_only torch.load read the progress back.
            "progress": dataclasses.asdict(state.progress),
            "rng": rng_states,
            "global_batch": state.plan.global_batch,
            "world_size": world.world_size,
            "args": flags,
        }
        for name, objects in state.checkpointed.items():
            checkpoint[name] = [obj.state_dict() for obj in objects]
        stem = f"{args.out_dir}/checkpoint"
        atomic_save(checkpoint, f"{stem}.pt", previous=f"{stem}.prev.pt")
    if world.world_size > 1:
        # Trap: No rank goes on or exits before the checkpoint is written.
        dist.barrier(group=world.cpu_group)


def restore_checkpoint(args, world, checkpointed, path, checkpoint):
    """Load every stateful part from the checkpoint, and this rank's random generators. Return
    the run's progress.

    On another world size, the ranks keep the generators that were just seeded, because the
    checkpoint holds the states of other ranks."""
    try:
        for name, objects in checkpointed.items():
            for obj, state in zip(objects, checkpoint[name], strict=True):
                obj.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as exc:
        fail(f"{path} is of another model, optimizer or --amp: {one_line(exc)}. Use the saved ones")
    saved_by = len(checkpoint["rng"])
    if saved_by == world.world_size:
        set_rng_state(checkpoint["rng"][world.rank])
    # The checkpoint holds Progress and its sums as dicts.
    progress = Progress(**checkpoint["progress"])
    progress.epoch_totals = Sums(**progress.epoch_totals)
    progress.window_totals = Sums(**progress.window_totals)
    log(f"resumed from {path} at step {progress.step}, saved by {saved_by} process(es)")
    changed = [
        f"--{name.replace('_', '-')} {value} (it had {checkpoint['args'][name]})"
        for name, value in vars(args).items()
        if name not in FREE_AT_RESUME and checkpoint["args"].get(name, value) != value
    ]
    if changed:
        log(
            f"flags unlike the checkpoint's run: {', '.join(changed)}. Its optimizers keep their "
            "learning rate and weight decay, and it keeps its global batch. Every other flag is "
            "this command's, and a new --epochs or --max-steps reshapes the schedule from here"
        )
    return progress


def read_checkpoint(out_dir):
    """Return (path, checkpoint) for the out-dir's last checkpoint, or (None, None).

    Where the last checkpoint is damaged, it returns the one before it."""
    stem = f"{out_dir}/checkpoint"
    paths = [f"{stem}.pt", f"{stem}.prev.pt"]
    # A crash between atomic_save's two renames leaves the new checkpoint in the .tmp file.
    if not os.path.exists(paths[0]):
        paths.insert(1, f"{stem}.pt.tmp")
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
            # lets the ranks of a node share the file's pages instead of each holding a copy.
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
        f"{'. '.join(problems)}. Move it away to start over, or pass another --out-dir",
    )
    return None, None


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

    Step s of an epoch trains the stretch of the shuffle from s times the global batch to s + 1
    times the global batch. This rank's share of that stretch is the same stretch of its own
    DistributedSampler share. It is cut into micro-batches of --batch-size. A resumed epoch sets
    skip_steps, and then the first micro-batch is the one that the run stopped before."""

    def __init__(self, sampler, batch_size, plan):
        self.sampler, self.batch_size = sampler, batch_size
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


def rng_state():
    """Return this process's random states, as values that a weights_only torch.load reads."""
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


# ====== 7. Preemption =============================================================================
# A stop signal on any rank stops every rank after the same step. The test
# test_a_signal_to_one_rank_stops_every_rank_at_one_step_and_the_rerun_ends_bit_identical proves it.


class StopAgreement:
    """The stop flag that all ranks agree on. Preemption sends SIGTERM or SIGUSR1.

    Trap: The handler only notes the signal, because a collective inside a handler deadlocks. In
    each step, every rank sends its note in an asynchronous all-reduce over gloo. The rank sends it
    at the step's start and reads the result at the step's end, so the step does not wait for it."""

    def __init__(self, world):
        self.world = world
        self.signals = []  # These are the stop signals that this process got.
        self.should_stop = False  # True means that some rank got one, and every rank stops now.
        self.flag, self.reduction = None, None
        self.previous_handlers = {sig: signal.signal(sig, self.note) for sig in STOP_SIGNALS}

    def note(self, signum, frame):
        self.signals.append(signum)

    def send(self):
        if self.world.world_size > 1:
            self.flag = torch.tensor(len(self.signals))
            self.reduction = dist.all_reduce(self.flag, group=self.world.cpu_group, async_op=True)

    def collect(self):
        if self.world.world_size > 1:
            self.reduction.wait()
            self.should_stop = self.flag.item() > 0
        else:
            self.should_stop = len(self.signals) > 0

    def restore(self):
        for sig, handler in self.previous_handlers.items():
            signal.signal(sig, handler)


def ignore_signals(worker_id):
    """Trap: A DataLoader worker exits on a SIGTERM from anyone but its parent. torchrun, SLURM and
    terminals signal whole process groups. So the workers ignore the stop signals, and the
    trainer handles them."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


# ====== 8. Setup ==================================================================================
# These functions build what setup_training() needs. A resume on another world size keeps its
# global batch, as test_a_node_that_leaves_and_joins_again_resumes_the_run_with_its_global_batch
# proves.


def build_task(args, world):
    """Return (train_set, eval_set, model). They are the same on every rank and world size."""
    seed_everything(args.seed)  # This comes first, so a random split agrees across the ranks.
    train_set, eval_set = build_datasets(args)
    eval_set = eval_set or []
    for name, dataset in ("training", train_set), ("eval", eval_set):
        check(
            hasattr(dataset, "__len__"),
            f"the {name} set is a {type(dataset).__name__} without a length: DistributedSampler "
            "needs a map-style Dataset (with __len__ and __getitem__), which gives every rank an "
            "exact share and lets a stopped run resume at the very sample it stopped at",
        )
    seed_everything(args.seed)  # This gives the same initial weights on any world size.
    model = build_model(args).to(world.device)
    if args.sync_bn:
        check(world.device.type == "cuda", "--sync-bn needs GPUs (SyncBatchNorm runs on CUDA)")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return train_set, eval_set, model


def make_plan(args, world, train_size, path, checkpoint):
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
    grad_accum, rest = divmod(global_batch, args.batch_size * world.world_size)
    if not grad_accum or rest:
        per_process = global_batch // world.world_size
        hint = "" if global_batch % world.world_size == 0 else ", on a world size that divides it"
        fail(
            f"the global batch of {global_batch} is not {world.world_size} processes x "
            f"--batch-size {args.batch_size} x a whole accumulation: pass a --batch-size that "
            f"divides {per_process}{hint}"
        )
    steps_per_epoch = train_size // global_batch
    check(
        steps_per_epoch > 0,
        f"the {train_size} training samples do not fill one global batch of {global_batch}: "
        "lower --batch-size or --grad-accum",
    )
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    epochs = math.ceil(total_steps / steps_per_epoch)
    return Plan(global_batch, grad_accum, steps_per_epoch, total_steps, epochs)


def check_same_start(world, step):
    # Trap: If only some nodes see the checkpoint, the ranks would start at different steps and
    # train apart. So all ranks compare their starting step.
    if world.world_size > 1:
        starts = [None] * world.world_size
        dist.all_gather_object(starts, step, group=world.cpu_group)
        check(
            len(set(starts)) == 1,
            f"the ranks start at steps {starts}: pass an --out-dir on a disk that all nodes share",
        )


def loader_options(args, world):
    """Return the DataLoader options that both loaders share."""
    return dict(
        collate_fn=collate_fn,
        num_workers=args.workers,
        worker_init_fn=ignore_signals,  # Trap: ignore_signals() says why.
        persistent_workers=args.workers > 0,
        pin_memory=world.device.type == "cuda",
        # Trap: Each rank needs a generator of its own. Otherwise the workers' seeds come from the
        # global generator, which is the same on every rank, and the ranks augment alike.
        generator=torch.Generator().manual_seed(args.seed + 1 + world.rank),
    )


def make_eval_loader(args, world, eval_set):
    """Return the eval DataLoader. Its shares do not overlap, as evaluate() says."""
    share = range(world.rank, len(eval_set), world.world_size)
    return DataLoader(eval_set, args.batch_size, sampler=share, **loader_options(args, world))


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


def call_task(function, *arguments):
    """Call a task function with as many of the arguments as it takes. The task functions of older
    copies have fewer parameters, and compute_loss(model, batch) still works."""
    return function(*arguments[: arguments_taken(function)])


@functools.cache
def arguments_taken(function):
    """The cache keeps inspect's slow reading of a signature out of every step."""
    return len(inspect.signature(function).parameters)


# ====== 9. Launchers: a first read can skip this section ==========================================
# These functions let one command work under every launcher. The test
# test_every_launch_mode_trains_the_same_run_and_only_rank_0_writes proves it.


def spawn(processes, argv):
    """--spawn N starts N processes of this script on this machine, as torchrun --standalone does.

    This process hosts their store on a free port, and it passes the stop signals on to them. It
    returns 0, or 75 where they stopped and saved, or the exit code of the first that failed."""
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
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # Then round_store() works as under torchrun.
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets this too, as the processes share cores.
    workers = []

    # A Ctrl-C in a terminal reaches the workers too, but a kill reaches only this process.
    def pass_on(signum, frame):
        for worker in workers:
            worker.send_signal(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, pass_on)
    for rank in range(processes):
        rank_env = env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
        workers.append(subprocess.Popen(command, env=rank_env))
    codes = [worker.wait() for worker in workers]
    for code in codes:
        if code != 0:
            # A worker that a signal N killed returns -N, and a shell writes that as 128 + N.
            return code if code > 0 else 128 - code
    return 0


def round_store(timeout):
    """Return a store for this round of workers alone, so that a restarted run does not wait for
    workers that are gone. A round is one start of the workers, and torchrun starts a new round at
    each restart and each change of nodes. Without torchrun's shared store, it returns None.

    Trap: torchrun 2.5 and later keeps one store for all the rounds of a job. The keys that the
    old round's process group wrote are still there, and a new round would read them and wait for
    workers that are gone (pytorch/pytorch#135712). So each round makes a store of its own.
    Rank 0 serves a new, empty store on a free port, and it writes the port into torchrun's store.
    The other ranks read the port there, and the read waits until some round has written it. They
    may read the old round's port before rank 0 writes the new one, but that port refuses them,
    because the old rank 0 has exited. So they retry."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host = env["MASTER_ADDR"]  # This is rank 0's node, which also serves torchrun's store.
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
        except ConnectionRefusedError:  # This port is an old round's, whose rank 0 has exited.
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
    ids = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT")
    job, step, requeues = (int(env.get(name, 0)) for name in ids)
    port = 61000 + (job * 11 + step + 2221 * requeues) % 4500
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


# These are the script's flags. Each entry gives the name, the default and the help text, and the
# default sets the type. TASK_FLAGS in section 1 adds your task's flags to these.
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
    ("out-dir", f"out/{PROG.removesuffix('.py')}", "rank 0 writes here"),
    ("log-every", 100, "a progress line every N optimizer steps (0: off)"),
    ("eval-every", 0, "also evaluate every N optimizer steps (0: at each epoch's end only)"),
    ("save-every", 500, "also checkpoint every N optimizer steps (0: at each epoch's end only)"),
    ("eval-only", False, "evaluate the out-dir's checkpoint, then exit"),
    ("amp", "off", "autocast: off, bf16 or fp16 (with loss scaling)"),
    ("compile", False, "torch.compile the DDP model"),
    ("workers", 0, "DataLoader workers per process"),
    ("find-unused-parameters", False, "let parameters sit out some steps (DDP's option, slower)"),
    ("sync-bn", False, "SyncBatchNorm: BatchNorm statistics over the global batch"),
    ("timeout", 1800.0, "seconds to wait for a peer before failing"),
    ("spawn", 0, "start N local processes, as torchrun --standalone would"),
]
# These flags must be at least 1. The script's other numbers must be at least 0.
POSITIVE_FLAGS = ("epochs", "batch-size", "grad-accum")


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line and a non-zero exit, not the usage text."""

    def error(self, message):
        fail(f"{message} (see --help)")


def parse_args(argv=None):
    parser = OneLineParser(
        allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name, default, help_text in FLAGS + TASK_FLAGS:
        if isinstance(default, bool):  # A switch has --name and --no-name.
            action = argparse.BooleanOptionalAction
            parser.add_argument(f"--{name}", action=action, default=default, help=help_text)
        else:
            parser.add_argument(f"--{name}", type=type(default), default=default, help=help_text)
    parser.set_defaults(**TASK_DEFAULTS)
    # The legacy launcher passes --local-rank=N, and older torch passes --local_rank=N.
    parser.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, _, _ in FLAGS:
        value = getattr(args, name.replace("-", "_"))
        least = 1 if name in POSITIVE_FLAGS else 0
        if type(value) in (int, float) and value < least:
            fail(f"--{name} is {value}: it is at least {least}")
    check(args.amp in ("off", "bf16", "fp16"), f"--amp is off, bf16 or fp16, not {args.amp}")
    return args


def log(*args, **kwargs):
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
    return " ".join(str(exc).split())[:300]


if __name__ == "__main__":
    sys.exit(main())
