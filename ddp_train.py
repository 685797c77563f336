"""ddp_train.py: a reference PyTorch DistributedDataParallel (DDP) training script.

One file, torch only (2.4 to 2.15). Launch it unchanged in any of these ways:

    python ddp_train.py                                  # one process: the CPU, or one GPU
    python ddp_train.py --spawn 2                        # N local processes, no launcher
    torchrun --nproc_per_node=4 ddp_train.py             # one node, 4 processes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST0:29500 --rdzv-id=job1 ddp_train.py   # on every node
    srun --ntasks-per-node=8 --gpus-per-task=1 python ddp_train.py     # SLURM: one task per GPU
    python -m torch.distributed.launch --nproc_per_node=2 ddp_train.py  # the legacy launcher

Your task is the functions at the top: build_datasets(), build_model(), compute_loss(), build_optimizer(),
build_scheduler(), report() and, for items of different shapes, collate_fn(). Edit them here, or import this
file from your own script and assign yours (see the README).

Read it top to bottom: first the lesson, the training loop of the tutorials, in which each line DDP adds
says "DDP:" and each classic trap "Trap:"; then, after a divider, the machinery, one section per feature,
each called from one place in the lesson.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import faulthandler
import functools
import gc
import inspect
import json
import math
import os
import random
import re
import resource
import signal
import socket
import sys
import threading
import time
import traceback
import zipfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils import flop_counter
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset
from torch.utils.data import default_collate

PROG = "ddp_train.py"
# One default --out-dir per script (out/ddp_train, out/tinylm): another task's checkpoint never stops its resume.
OUT_DIR = "out/" + os.path.basename(
    sys.argv[0] if os.path.isfile(sys.argv[0]) else PROG
).removesuffix(".py")
STARTED = time.monotonic()  # for the wall time that the progress lines and the last line give
IN_FEATURES, NUM_CLASSES, HIDDEN = 32, 10, 256  # the default task (see build_datasets)


# ====== Your task: replace these functions ==================================================================


def build_datasets(args) -> tuple[Dataset, Dataset | None]:
    """(train_set, eval_set): map-style Datasets, the same on every rank; eval_set may be None.

    Items: tensors, numbers, strings, or tuples, lists and dicts of them. Random augmentation in
    __getitem__ is welcome: its random numbers depend only on (--seed, epoch, sample index).
    A download? `with rank0_first(): prepare(path)` runs it once while the other ranks wait.
    The default task: Gaussian inputs labelled by a fixed random linear "teacher", from --seed.
    """
    gen = torch.Generator().manual_seed(args.seed)
    teacher = torch.randn(IN_FEATURES, NUM_CLASSES, generator=gen)

    def make(n):
        x = torch.randn(n, IN_FEATURES, generator=gen)
        return TensorDataset(x, (x @ teacher).argmax(dim=1))

    return make(args.num_samples), make(args.eval_samples) if args.eval_samples else None


def build_model(args) -> nn.Module:
    """A small MLP classifier for the default task; --batch-norm adds BatchNorm layers."""
    norm = (lambda: nn.BatchNorm1d(HIDDEN)) if args.batch_norm else nn.Identity
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        norm(),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        norm(),
        nn.ReLU(),
        nn.Linear(HIDDEN, NUM_CLASSES),
    )


def compute_loss(model: nn.Module, batch) -> tuple:
    """(loss, count) or (loss, count, metrics) of one batch (collate_fn's, on the device), for training and
    evaluation. loss is the MEAN over count items, as F.cross_entropy returns it (or HF's outputs.loss, or
    nanoGPT's model); count what it averages over, an int or a 0-dim tensor: samples for a classifier, real
    tokens for a language model ((labels != -100).sum(); then set COUNT_UNIT = "tokens"). metrics: further
    means over the same items ({"accuracy": ...}: eval_accuracy). The script weighs each mean by its count, so
    that every gradient and every logged figure is the exact mean over all the items of all micro-batches on
    all ranks, whatever the world size, batch size and accumulation."""
    inputs, targets = batch
    logits = model(inputs).float()
    accuracy = (logits.argmax(dim=1) == targets).float().mean()
    return F.cross_entropy(logits, targets), len(targets), {"accuracy": accuracy}


def build_optimizer(args, model: nn.Module):
    """One optimizer or a list of them, each trainable parameter in exactly one, in parameter groups as you
    like (their own lr, weight_decay...). The default: AdamW as nanoGPT sets it up, --weight-decay on
    matrices and embeddings (2 or more dimensions), none on biases and norms; fused: one kernel for all."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, fused=True)


def build_scheduler(args, optimizer, total_steps: int):
    """A torch LRScheduler for one optimizer (called once per optimizer): OneCycleLR, CosineAnnealingLR, ...
    The script steps it after every optimizer step and saves it with the checkpoint. The default: a linear
    warmup over --warmup-steps, then --schedule: cosine or linear decay to 0, constant, or wsd (constant,
    then linear to 0 over the run's last fifth), multiplying each parameter group's own lr."""

    def factor(step):  # step: the optimizer steps done before this one
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        if args.schedule == "wsd":
            return min(1.0, (total_steps - step) / max(1.0, 0.2 * total_steps))
        done = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
        return {"cosine": (1 + math.cos(math.pi * done)) / 2, "linear": 1 - done}.get(
            args.schedule, 1.0
        )

    return LambdaLR(optimizer, factor)


def report(record: dict) -> None:
    """Rank 0 calls this with every record it logs (progress lines, epochs, evaluations), each with its
    "step" and "kind": plug W&B, MLflow or anything else in here (the README shows W&B). By default: nothing."""


# collate_fn(items) -> batch: how a list of items becomes one batch. torch's default stacks tensors and
# numbers of equal shapes; items of different lengths need one that pads them (examples/tinylm.py).
collate_fn = default_collate
# what compute_loss's count counts: "samples" (known from the batches) or "tokens"
COUNT_UNIT = "samples"


# ====== The lesson: the plain training loop, and the lines DDP adds to it ==================================


@record  # under torchrun, a traceback shows in its failure summary (fail() writes our one line there itself)
def main(argv=None) -> int:
    args = parse_args(argv)
    return spawn_workers(args) if args.spawn else run(args)


def run(args) -> int:
    """One process's whole life: find its place, join the process group, train, leave. Without a launcher
    (plain python) it is one process without a process group, on the same code path."""
    # RANK, WORLD_SIZE, LOCAL_RANK: torchrun's environment (srun's and --spawn's translated into it).
    ctx = Context.of_this_process(args)
    if ctx.device.type == "cuda":
        # DDP: one GPU per process, made current before anything else touches CUDA
        torch.cuda.set_device(ctx.device)
    trainer = None
    try:
        if ctx.world_size > 1:
            # DDP: join the process group (gloo on CPUs, NCCL on GPUs). The timeout makes a missing peer an
            # error, not a hang. (No device_id: its eager NCCL init can hang, pytorch/pytorch#153960.)
            dist.init_process_group(
                ctx.backend,
                rank=ctx.rank,
                world_size=ctx.world_size,
                timeout=ctx.timeout,
                **rendezvous(ctx),
            )
            ctx.make_groups()  # gloo groups of our own: control messages, waits for rank 0's writes
        trainer = Trainer(args, ctx)
        return trainer.train()
    except BaseException as exc:
        explain_failure(exc, ctx)  # one line for the ends that deserve one, else the traceback
        raise
    finally:
        # Trap: release what training holds, before the process group goes. DDP's reducer: with gloo, destroying
        # the group while it lives can abort the process at exit. The DataLoaders: freed, they stop their
        # persistent workers; left to the garbage collector, they may not (it closes their queues first), and at
        # exit the workers ignore the SIGTERM they get: the process would hang.
        if trainer:
            vars(trainer).clear()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()  # DDP: leave the process group, also after an error


class Trainer:
    """Every rank builds the same data and model, wraps the model in DDP, and trains it. All ranks run every
    line together; rank 0 alone prints and writes."""

    def __init__(self, args, ctx):
        self.args, self.ctx = args, ctx
        # first: a random split inside build_datasets then agrees across ranks
        seed_everything(args.seed)
        self.train_set, self.eval_set = build_datasets(args)
        # the same initial weights on every rank (DDP also broadcasts rank 0's)
        seed_everything(args.seed)
        self.model = model = build_model(args).to(ctx.device)
        # DDP: then each rank a random stream of its own, as nanoGPT offsets its seed: its own dropout masks.
        seed_everything(args.seed + 1 + ctx.rank)
        # DDP: the batch of one optimizer step: per process x world size x accumulation, or --global-batch.
        self.global_batch = args.global_batch or args.batch_size * ctx.world_size * args.grad_accum
        # one line for what cannot train, before anything is written
        self.steps_per_epoch = check_the_run(self)
        # --max-steps: its epochs
        self.total_steps = args.max_steps or args.epochs * self.steps_per_epoch
        # yours: one or a list
        self.optimizers = every_parameter_once(build_optimizer(args, model), model, ctx)
        self.schedulers = [build_scheduler(args, o, self.total_steps) for o in self.optimizers]
        # --amp: autocast in bf16 or fp16; fp16's gradients need loss scaling.
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
        # (none at all without: a disabled autocast still costs microseconds in every forward)
        self.autocast = (
            functools.partial(torch.autocast, ctx.device.type, half)
            if half
            else contextlib.nullcontext
        )
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=args.amp == "fp16")
        self.progress = Progress()
        # Every stateful part, by name: what a checkpoint saves and restores. One more part, one more line.
        # (the optimizers and the schedulers: lists, saved part by part)
        self.state = dict(
            model=model,
            optimizers=self.optimizers,
            schedulers=self.schedulers,
            scaler=self.scaler,
            progress=self.progress,
            rng=RankRNG(self),
        )
        if args.ema:  # the average of the weights (and buffers), after every step
            self.state["ema"] = AveragedModel(
                model, multi_avg_fn=get_ema_multi_avg_fn(args.ema), use_buffers=True
            )
        # DDP: each rank reads its own share of each epoch's shuffle; one process reads it all.
        self.sampler = DistributedSampler(
            self.train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed
        )
        # its batches: set for each epoch
        self.loader, self.batches = loader_of(self.train_set, args, ctx)
        # BatchNorm statistics over the global batch: DDP must wrap SyncBatchNorm layers
        if args.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # DDP: the wrap. It broadcasts rank 0's weights, then averages the gradients.
        if ctx.world_size > 1:
            model = DDP(
                model,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                find_unused_parameters=args.find_unused_parameters,
                gradient_as_bucket_view=True,  # gradients live in the all-reduce buckets: one copy less
            )
        self.ddp_model, self.forward = model, torch.compile(model) if args.compile else model
        # DDP: the step's count over all ranks, which each mean is weighed by
        self.count = StepCount(self)
        # what the ranks decide together: a stop signal, rank 0's clocks
        self.agreement = Agreement(self)

    def train(self) -> int:
        """Optimizer steps, epoch after epoch, to the run's total; returns the exit code."""
        args, progress = self.args, self.progress
        if not resume(self):  # from the out-dir's checkpoint, if there is one
            return 0  # a finished run, rerun: model.pt written again, nothing to train
        # the exact global loss, gradient norms, throughput, every rank's timing
        self.meter = Meter(self)
        # the first batch once through DDP, untrained: its buckets in the real order; FLOPs
        warm_up(self)
        while progress.step < self.total_steps:
            # Trap: without it every epoch repeats the same shuffle
            self.sampler.set_epoch(progress.epoch)
            # DDP: this rank's micro-batches of each step: its share of the step's global batch.
            # (a resumed epoch skips the steps done)
            steps = plan_steps(self)[progress.step_in_epoch :]
            # (--max-steps: the run may end mid-epoch)
            steps = steps[: self.total_steps - progress.step]
            self.batches[:] = [(progress.epoch, mb) for step in steps for mb in step]
            # on the device; its waits timed: data_wait_by_rank
            data = self.meter.timed(iter(self.loader))
            for i, micro_batches in enumerate(steps):
                done = progress.step_in_epoch * self.global_batch
                # the step's, over all ranks
                samples = min(len(self.train_set) - done, self.global_batch)
                self.step(data, len(micro_batches), samples)
                progress.step_done(samples)
                if args.eval_every and progress.step % args.eval_every == 0 and i < len(steps) - 1:
                    # all ranks evaluate, rank 0 writes
                    self.meter.emit({"kind": "eval", **evaluation(self)})
                # --- periodic: all ranks decide together (a signal, rank 0's clocks, steps), then act ---
                stop, log_now, save_now = self.agreement.decide()
                if stop or log_now or save_now:
                    self.fold()  # DDP: the loss all-reduce: every rank's sums into the epoch's totals
                if log_now:
                    self.meter.emit(self.meter.record("progress"))  # rank 0 prints
                if stop or save_now:
                    save_checkpoint(self)  # rank 0 writes, every rank waits for it
                # (a stop in the run's last step finishes it)
                if stop and progress.step < self.total_steps:
                    return self.agreement.stopped()
            # --- end of the epoch (or of the run, with --max-steps): all ranks ---
            self.fold()  # DDP: the loss all-reduce: the exact global train loss of the epoch
            record = {**self.meter.record("epoch"), **evaluation(self)}
            if progress.step_in_epoch == self.steps_per_epoch:
                progress.next_epoch()
            self.meter.emit(record)  # rank 0 only
            save_checkpoint(self)
        self.save_model()
        return 0

    def step(self, data, n_micro, samples) -> None:
        """One optimizer step: forward and backward over this rank's n_micro micro-batches, then the update."""
        count, world = self.count, self.ctx.world_size
        count.start(samples)  # samples: every rank knows the step's count; tokens: summed below
        for i in range(max(n_micro, 1)):
            # DDP: a rank without samples in this step still joins its collectives, with a zero gradient.
            batch = next(data) if n_micro else self.first_batch
            last = i >= n_micro - 1
            # DDP: all-reduce the gradients only in the backward of the step's last micro-batch.
            with contextlib.nullcontext() if last or world == 1 else self.ddp_model.no_sync():
                with self.autocast():
                    loss, n, _ = call_compute_loss(self.forward, batch, self.ctx)
                n = n if n_micro else 0
                self.meter.add(loss, n)  # this rank's loss sum and count, on the device
                # tokens: the all-reduce of the step's count starts here, beside backward
                count.add(n, last)
                # DDP: DDP averages the ranks' gradients: weigh this mean by its share of the step's items.
                self.scaler.scale(loss * (n * world / count.expected)).backward()
        count.finish()  # tokens: the gradients x the expected count / the step's own
        for optimizer in self.optimizers:
            # Trap: clip and log the true gradients, not fp16's scaled ones
            self.scaler.unscale_(optimizer)
        # The norm of the whole gradient (the same on every rank), clipped by --clip-grad-norm.
        norm = grad_norm(self.params, self.args.clip_grad_norm)
        lr = self.optimizers[0].param_groups[0]["lr"]  # the step's, for its record
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            self.scaler.step(optimizer)  # (fp16: skipped if the gradients overflowed)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        self.scaler.update()
        if "ema" in self.state:
            self.state["ema"].update_parameters(self.model)
        self.meter.end_step(norm, lr)

    def fold(self) -> None:
        """All ranks, before a progress line, a checkpoint and at an epoch's end: every rank's sums since the last
        fold into the epoch's totals (the exact global train loss); a non-finite loss stops every rank."""
        sums = self.meter.sums()  # this rank's: every step's loss sum, the count, and its timing
        if self.ctx.world_size > 1:
            # DDP: the logged loss is every rank's: the sums all-reduced (SUM: gloo's AVG is unreliable), over gloo.
            dist.all_reduce(sums, group=self.ctx.control)
        self.meter.fold(sums)

    def save_model(self) -> None:
        """The final weights: rank 0 writes model.pt (and --ema's model_ema.pt); every rank waits for it."""
        if self.ctx.rank == 0:  # DDP: rank 0 alone writes; the others hold the same weights
            out, progress = self.args.out_dir, self.progress
            # Trap: save the raw module: DDP would prefix every key with "module.", torch.compile with "_orig_mod.".
            atomic_save(self.model.state_dict(), f"{out}/model.pt")
            if "ema" in self.state:
                atomic_save(self.state["ema"].module.state_dict(), f"{out}/model_ema.pt")
            took = datetime.timedelta(seconds=int(time.monotonic() - STARTED))
            print(
                f"saved {out}/model.pt: {progress.epoch} epoch(s), {progress.step} steps, {took} since launch"
            )
        # Trap: a barrier, so that no rank tears down before rank 0's files are written
        wait_for_rank0(self.ctx)

    @functools.cached_property
    def params(self) -> list:  # every trainable parameter: what the gradient steps cover
        return [p for p in self.model.parameters() if p.requires_grad]


def loader_of(dataset, args, ctx) -> tuple:
    """A DataLoader of this rank's batches, and its batch sampler: a list of micro-batches, each a list of
    (epoch, index) keys, set before each pass. A sample's randomness comes from (--seed, epoch, index) alone."""
    batches = []  # set before each pass
    workers = data_workers(dataset, args, ctx)  # --workers -1: none on the CPU, a few with CUDA
    loader = DataLoader(
        SeededSamples(dataset, args.seed),  # seeds each sample, and collates the batch itself
        batch_sampler=batches,
        num_workers=workers,
        persistent_workers=workers > 0,  # started once, not every epoch
        # (in the workers' pinning thread; a Dataset of CUDA tensors, loaded here, could not be pinned)
        pin_memory=workers > 0 and ctx.device.type == "cuda",
        collate_fn=SeededSamples.as_is,
        worker_init_fn=SeededSamples.leave_signals_to_trainer,  # Trap: else a SIGTERM kills the workers first
        generator=torch.Generator(),  # Trap: its base seed from a generator of its own: the global one is dropout's
    )
    return loader, batches


# ############################################################################
#                        THE LESSON ENDS HERE
#   Below: the machinery, one section per feature. Each has one call site above.
# ############################################################################


# ====== Arguments ==========================================================================================


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog=PROG, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument_group("training").add_argument
    add("--epochs", type=at_least(1), default=3, help="passes over the training set")
    add(
        "--max-steps",
        type=at_least(1),
        help="train exactly N optimizer steps, through as many epochs as that "
        "takes (overrides --epochs)",
    )
    add(
        "--batch-size",
        type=at_least(1),
        default=64,
        help="samples per process and micro-batch (global batch: this x world size x --grad-accum)",
    )
    add("--grad-accum", type=at_least(1), default=1, help="micro-batches per optimizer step")
    add(
        "--global-batch",
        type=at_least(1),
        help="the samples of one optimizer step, whatever the world size "
        "(--batch-size: the most per process and micro-batch): a resume on another world size continues the run",
    )
    add(
        "--drop-last",
        action="store_true",
        help="drop each epoch's last, partial global batch (the same samples "
        "whatever the world size)",
    )
    add("--lr", type=at_least(0.0), default=1e-3, help="peak learning rate (build_optimizer's)")
    add("--warmup-steps", type=at_least(0), default=0, help="linear warmup, then --schedule")
    add(
        "--schedule",
        choices=("cosine", "linear", "constant", "wsd"),
        default="cosine",
        help="after the warmup: "
        "cosine or linear decay to 0, constant, or wsd (warmup-stable-decay)",
    )
    add(
        "--weight-decay",
        type=at_least(0.0),
        default=0.01,
        help="the default AdamW's, on parameters of 2 or more dimensions",
    )
    add(
        "--clip-grad-norm",
        type=at_least(0.0, strict=True),
        help="clip the global gradient norm to this once per optimizer step",
    )
    add(
        "--ema",
        type=at_least(0.0, strict=True),
        help="an exponential moving average of the weights with this "
        "decay (0.999...): eval_ema_*, model_ema.pt",
    )
    add("--seed", type=int, default=0, help="seeds the data, the initial weights and the shuffle")
    add(
        "--num-samples", type=at_least(1), default=32768, help="the default task's training samples"
    )
    add(
        "--eval-samples",
        type=at_least(0),
        default=4096,
        help="the default task's evaluation samples (0: none)",
    )
    add("--batch-norm", action="store_true", help="give the default task's model BatchNorm layers")
    add = p.add_argument_group("evaluation, logging and checkpoints").add_argument
    add(
        "--out-dir",
        default=OUT_DIR,
        help="where rank 0 writes model.pt, checkpoints and metrics.jsonl",
    )
    add(
        "--eval-every",
        type=at_least(0),
        default=0,
        help="also evaluate every N optimizer steps (0: at each epoch's end only)",
    )
    add(
        "--keep-best",
        help="write best.pt when an evaluation improves this figure (eval_loss...): lower is "
        "better for losses, higher for the rest, unless it ends in :min or :max",
    )
    add(
        "--log-every",
        type=at_least(0),
        default=0,
        help="a progress line and report() record every N optimizer steps (0: off)",
    )
    add(
        "--log-seconds",
        type=at_least(0.0),
        default=30.0,
        help="a progress line at least every S seconds (step, loss, throughput, ETA; 0: off)",
    )
    add(
        "--tensorboard",
        action="store_true",
        help="write TensorBoard curves under OUT_DIR/tensorboard",
    )
    add("--save-every", type=at_least(0), default=0, help="also checkpoint every N steps (0: off)")
    add(
        "--save-minutes",
        type=at_least(0.0),
        default=30.0,
        help="also checkpoint every M minutes (0: off), so that a hard kill loses at most about M",
    )
    add(
        "--resume",
        default="auto",
        help="auto: continue from OUT_DIR/checkpoint.pt if there is one; never: "
        "start over; or a path",
    )
    add("--init-from", help="start a new run from these weights (a model.pt)")
    add = p.add_argument_group("performance, launching, hangs").add_argument
    add(
        "--amp",
        choices=("off", "bf16", "fp16"),
        default="off",
        help="autocast; fp16 adds loss scaling",
    )
    add("--compile", action="store_true", help="torch.compile the DDP model")
    add(
        "--workers",
        type=at_least(-1),
        default=-1,
        help="DataLoader workers per process (-1: none on the CPU "
        "or for an in-memory TensorDataset, a few with CUDA; 0 for a Dataset holding CUDA tensors)",
    )
    add(
        "--count-flops",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="count the training FLOPs per sample on the first batch (torch's FlopCounterMode)",
    )
    add(
        "--peak-tflops",
        type=at_least(0.0, strict=True),
        help="peak TFLOP/s of one GPU at the precision training runs in (bf16, TF32, ...), for MFU",
    )
    add(
        "--find-unused-parameters",
        action="store_true",
        help="let parameters sit out some steps (DDP's find_unused_parameters; slower)",
    )
    add(
        "--sync-bn",
        action="store_true",
        help="SyncBatchNorm: statistics over the global batch (CUDA); implies --drop-last",
    )
    add(
        "--timeout",
        type=at_least(0.0, strict=True),
        default=1800.0,
        help="seconds to wait for peers at start "
        "and in any collective before failing (a dead peer is noticed at once). Generous: one rank's cold "
        "compile can take minutes longer than another's",
    )
    add("--spawn", type=at_least(0), default=0, help="start N local processes, no launcher needed")
    add(
        "--stall-seconds",
        type=at_least(0.0),
        default=300.0,
        help="S seconds without a step: each rank's stacks "
        "in OUT_DIR/stall/, who holds up whom (0: off)",
    )
    add(
        "--debug",
        action="store_true",
        help="torch's distributed debugging (INFO, NCCL_DEBUG=INFO, C++ stacks); "
        "the other ranks' output in OUT_DIR/debug",
    )
    # The legacy `python -m torch.distributed.launch` also passes --local-rank=N (older torch: --local_rank N).
    add("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ema and args.ema >= 1:
        fail(f"--ema {args.ema:g}: the decay is below 1 (0.999 keeps about the last 1000 steps)")
    if args.global_batch and args.grad_accum > 1:
        fail(
            "--global-batch fixes the samples of a step and --grad-accum follows from it and the world size: "
            "pass one of them"
        )
    if args.tensorboard:  # only this flag needs the package
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            fail("--tensorboard needs TensorBoard: pip install tensorboard")
    return args


# ====== Where this process is: torchrun's environment, the other launchers translated into it ==============

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# how long ranks wait for rank 0's own work (a checkpoint's write)
PATIENT = datetime.timedelta(hours=1)


@dataclasses.dataclass
class Context:
    """This process's place (rank, GPU) and the stop signal it received. A signal handler only notes it
    (trap: a collective inside a handler deadlocks); the ranks agree on it at a step (Agreement)."""

    rank: int = 0  # this process, 0 .. world_size - 1
    local_rank: int = 0  # this process on its node: which GPU it drives
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "python"
    # --timeout: how long a collective waits
    timeout: datetime.timedelta = datetime.timedelta(minutes=30)
    device: torch.device = torch.device("cpu")
    # SIGTERM or SIGUSR1 (torchrun, Kubernetes, SLURM's --signal), or SIGINT (Ctrl-C);
    received: int = 0
    received_at: float = 0.0  # and when
    control: object = None  # gloo groups (make_groups)
    patient: object = None

    @classmethod
    def of_this_process(cls, args):
        """torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), other launchers' translated
        into it; plain python has none of it: one process. Then its threads, GPU and signal handlers."""
        launcher, env = adopt_launcher_environment(args), os.environ
        world = int(env.get("WORLD_SIZE", 1))
        ctx = cls(
            int(env.get("RANK", 0)),
            int(env.get("LOCAL_RANK", 0)),
            world,
            int(env.get("LOCAL_WORLD_SIZE", world)),
            launcher,
            datetime.timedelta(seconds=args.timeout),
        )
        # Threads: this process's share of the cores, unless the user chose (OMP_NUM_THREADS).
        if "OMP_NUM_THREADS" not in env:
            cores = (
                len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            )
            torch.set_num_threads(
                cpus_per_process(
                    cores, ctx.local_world_size, launcher, env.get("SLURM_CPUS_PER_TASK")
                )
            )
        # --debug, before the process group starts: c10d's and DDP's checks (unused parameters named), NCCL's
        # log and C++ stacks; every rank but 0 writes its stderr (fd 2, where C++ and NCCL log too) to a file.
        # INFO: DETAIL made torch 2.13's CPU build segfault while building DDP; a TORCH_DISTRIBUTED_DEBUG of yours wins.
        if args.debug:
            env.setdefault("TORCH_DISTRIBUTED_DEBUG", "INFO")
            env.update(TORCH_SHOW_CPP_STACKTRACES="1", NCCL_DEBUG="INFO")
            dist.set_debug_level_from_env()  # torch.distributed read the variable when it was imported
            if ctx.rank:
                os.makedirs(f"{args.out_dir}/debug", exist_ok=True)
                with open(f"{args.out_dir}/debug/rank{ctx.rank}.log", "w") as log_file:
                    os.dup2(log_file.fileno(), 2)
        # (for CPU training on a GPU machine, hide the GPUs: CUDA_VISIBLE_DEVICES=)
        if torch.cuda.is_available():
            gpus = env.get("CUDA_VISIBLE_DEVICES")
            choice = choose_gpu(
                ctx.local_rank, ctx.local_world_size, torch.cuda.device_count(), launcher, gpus
            )
            if isinstance(choice, str):
                fail(choice, ctx)
            ctx.device = torch.device("cuda", choice)
            # NCCL's: collectives dumped on a hang
            for name, value in flight_recorder_env(args.out_dir).items():
                env.setdefault(name, value)
        for sig in STOP_SIGNALS:
            signal.signal(sig, ctx.on_signal)
        return ctx

    def on_signal(self, signum, frame):
        # A launcher that forwards the terminal's Ctrl-C delivers it twice within moments: that is one.
        # A second Ctrl-C, a second or more after the first, stops at once, without saving.
        if signum == signal.SIGINT == self.received and time.monotonic() - self.received_at > 1:
            raise KeyboardInterrupt
        if not self.received:
            self.received, self.received_at = signum, time.monotonic()

    backend = property(lambda self: "nccl" if self.device.type == "cuda" else "gloo")

    def make_groups(self):
        """gloo groups beside training's, made right after joining, while every rank is there (a group made later
        waits for every rank for its own timeout, an hour for the patient one, if a node is lost meanwhile):
        control, for small control messages (no GPU involved); patient, for waiting on rank 0's own work."""
        self.control = dist.new_group(backend="gloo", timeout=self.timeout)
        self.patient = dist.new_group(backend="gloo", timeout=PATIENT)


def adopt_launcher_environment(args):
    """Name the launcher, and give the ones that do not set torchrun's variables those variables."""
    env = os.environ
    # torchrun (torch.distributed.launch is it too), --spawn's workers
    if "RANK" in env and "WORLD_SIZE" in env:
        return "spawn" if args.spawn else "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
    # A bare `srun python ddp_train.py`: srun sets SLURM_STEP_* for its tasks; an sbatch script running
    # python directly sees the job's SLURM_NTASKS, but it is one process, not a task. The step's own
    # variables win over the job's: a step may run on part of the allocation.
    world = env.get("SLURM_STEP_NUM_TASKS", "1")
    if world == "1" or "SLURM_PROCID" not in env:
        return "python"
    here = tasks_on_this_node(
        env.get("SLURM_STEP_TASKS_PER_NODE", world), int(env.get("SLURM_NODEID", 0))
    )
    env.update(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=world,
        LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
        LOCAL_WORLD_SIZE=str(here),
    )
    nodes = (
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    )
    env.setdefault("MASTER_ADDR", first_slurm_host(nodes or "localhost"))
    # Every task derives the same port from the job id, so that two jobs on one node don't collide.
    env.setdefault("MASTER_PORT", str(15000 + int(env.get("SLURM_JOB_ID", 0)) % 20000))
    return "slurm"


def tasks_on_this_node(tasks_per_node, node):
    """SLURM_STEP_TASKS_PER_NODE lists every node's task count ('2(x2),1' -> 2, 2, 1); pick this node's.
    It is always set, while SLURM_NTASKS_PER_NODE exists only when --ntasks-per-node was given."""
    counts = [
        int(n)
        for n, times in re.findall(r"(\d+)(?:\(x(\d+)\))?", tasks_per_node)
        for _ in range(int(times or 1))
    ]
    return counts[min(node, len(counts) - 1)]


def first_slurm_host(nodelist):
    """First host of a SLURM node list: 'gpu[07-09,12],cpu1' -> 'gpu07' (its prefix and first number)."""
    return "".join(re.match(r"([^,\[]*)(?:\[(\d+))?", nodelist).groups(""))


def choose_gpu(local_rank, local_world, visible, launcher, cuda_visible_devices):
    """The index of this process's GPU among the visible ones, or why there is none (one line). Every
    local process must drive a GPU of its own: NCCL refuses two ranks on one ("Duplicate GPU").
    - As many visible GPUs as local processes, or more: cuda:LOCAL_RANK (torchrun, --spawn, the legacy
      launcher, srun --gpus-per-node=8 --gpu-bind=none, where every task sees the node's GPUs).
    - Fewer: only SLURM's per-task binding makes that right (srun --gpus-per-task=1: each task sees
      just its own, as cuda:0). Anything else, torchrun --nproc_per_node=2 on a one-GPU machine say,
      would put two processes on one GPU."""
    if local_rank < visible and local_world <= visible:
        return local_rank
    if launcher == "slurm" and 0 < visible < local_world:
        return 0
    return (
        f"every process on this node needs a GPU of its own, but LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE="
        f"{local_world} sees {visible} (CUDA_VISIBLE_DEVICES={cuda_visible_devices or '<unset>'}): start at "
        f"most {visible} process(es) per node, or give each process its own GPU (srun --gpus-per-task=1)"
    )


def cpus_per_process(affinity, local_world, launcher, slurm_cpus_per_task):
    """Divide only what the processes share. A task that srun started with --cpus-per-task has that many cores
    of its own (SLURM binds them: its affinity already is its share); the workers of torchrun, --spawn or
    the legacy launcher share the cores their launcher had, as do srun tasks without --cpus-per-task."""
    if launcher == "slurm" and slurm_cpus_per_task:
        return min(affinity, int(slurm_cpus_per_task))
    return max(1, affinity // local_world)


def flight_recorder_env(out_dir):
    """NCCL's flight recorder: each rank keeps its last 2000 collectives and dumps them on a timeout to
    OUT_DIR/nccl_trace_rank_{R} (in the out-dir, which exists: the recorder makes no directory). Both spellings:
    torch 2.4 reads TORCH_NCCL_* alone, newer versions TORCH_FR_* too (seen in 2.15's library)."""
    prefix = os.path.join(out_dir, "nccl_trace_rank_")
    return {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }


def spawn_workers(args):
    """--spawn N: start N local workers ourselves, on a free port, and forward stop signals."""
    if "RANK" in os.environ or "SLURM_STEP_NUM_TASKS" in os.environ:
        fail(
            "--spawn starts its own processes: run it with plain python, not under torchrun or srun"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    context = mp.spawn(_spawn_worker, args=(args,), nprocs=args.spawn, join=False)
    for sig in STOP_SIGNALS:
        signal.signal(
            sig,
            lambda signum, _: [os.kill(p.pid, signum) for p in context.processes if p.is_alive()],
        )
    # After a failure the others get 15 s to end on their own (torch >= 2.6; before, they are stopped at once).
    grace = (
        {"grace_period": 15} if "grace_period" in inspect.signature(context.join).parameters else {}
    )
    try:
        while not context.join(**grace):
            pass
    except mp.ProcessExitedException as exc:
        return max(exc.exit_code, 1)  # (a negative code: a signal ended it)
    return 0


def _spawn_worker(local_rank, args):
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(args.spawn))
    # A spawned process inherits "spawn" as its default start method, so its DataLoader workers would
    # each start a fresh interpreter; give it the platform's default, as a torchrun worker has.
    mp.set_start_method(None, force=True)
    sys.exit(run(args))


def rendezvous(ctx):
    """How init_process_group finds its peers: MASTER_ADDR and MASTER_PORT, except under torchrun restarts.
    torch >= 2.5 (seen through 2.13): torchrun's agent keeps one TCPStore for the whole job, and its
    workers' keys carry no restart number, so after `--max-restarts` restarts the new workers can
    read the dead ones' addresses and fail to connect (pytorch/pytorch#135712). Give every restart
    its own namespace. TORCHELASTIC_RESTART_COUNT agrees within a node; across nodes, launch torchrun
    with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (run_multi_node.sh does), which skips this."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {"init_method": "env://"}
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), ctx.world_size, False, timeout=ctx.timeout
    )
    return {
        "store": dist.PrefixStore(
            f"ddp_train/restart_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store
        )
    }


@contextlib.contextmanager
def rank0_first(local=False):
    """Rank 0 (local=True: the first process of each node) runs the body first, say to download or
    build a cache, while the others wait for up to an hour; then the others run it."""
    # (every rank makes it)
    group = dist.is_initialized() and dist.new_group(backend="gloo", timeout=PATIENT)
    first = not group or int(os.environ["LOCAL_RANK"] if local else dist.get_rank()) == 0
    if not first:
        dist.barrier(group)
    yield
    if first and group:
        dist.barrier(group)


def explain_failure(exc, ctx):
    """The ends that deserve one line instead of a traceback from every rank."""
    # The traceback holds training's frames, and with them the DDP model and the DataLoader workers:
    # drop them, so that teardown can release those first.
    chained = exc
    while chained:
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__context__
    # A collective failed: a rank is gone, or hung past --timeout (gloo's own errors name it, or a timeout).
    text = str(exc) if isinstance(exc, RuntimeError) else ""
    lost_a_peer = isinstance(exc, dist.DistError) or "gloo" in text or "timeout" in text
    if isinstance(exc, KeyboardInterrupt) or ctx.received == signal.SIGINT and lost_a_peer:
        log(
            ctx,
            f"{PROG}: stopped by a second Ctrl-C, without saving; rerun the same command to continue from "
            "the last checkpoint",
            error=True,
        )
        raise SystemExit(130) from None
    if ctx.world_size > 1:
        if isinstance(exc, Exception) and not dist.is_initialized():
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"  # what was tried; the launcher says the rest
            fail(
                f"rank {ctx.rank} could not join the {ctx.world_size}-process group at {where} within "
                f"{ctx.timeout.total_seconds():g}s: {one_line(exc)}",
                code=1,
            )
        if lost_a_peer:  # say what happened, not where we were waiting
            fail(
                f"rank {ctx.rank} lost contact with another process (it crashed, hung past --timeout, was killed, or its "
                f"node left the network); rerun to resume from the last checkpoint. The error: {one_line(exc)}",
                code=1,
            )


# ====== Agreeing at a step: a stop signal (preemption), and rank 0's clocks (progress lines, checkpoints) ======


class Agreement:
    """What every rank decides together after an optimizer step: stop (a signal), log a progress line, save
    a checkpoint (rank 0's clocks: --log-seconds, --save-minutes; and --log-every, --save-every, which count
    steps). Logging and saving are collectives, and the ranks' clocks and signals disagree, so they vote:
    each rank's flags, summed by a small all-reduce over gloo (no GPU involved). A vote costs about a
    millisecond on gloo, a third of a small model's step on 2 CPU cores: rank 0 proposes in each vote how
    many steps until the next, about 0.25 s at its pace, at most 10 steps apart; what was due waits for the
    next vote. The watchdog (--stall-seconds) starts here too."""

    def __init__(self, t):
        self.t, self.next_vote, self.voted = t, 0, (t.progress.step, time.monotonic())
        self.logged_at = self.saved_at = time.monotonic()
        # (Trap: not the trainer itself: the thread would keep its DataLoader workers alive past the run.)
        threading.Thread(target=watchdog, args=(t.progress, t.args, t.ctx), daemon=True).start()

    def decide(self):
        """(stop, log, save) after the step just done: the same on every rank."""
        args, ctx, step, now = self.t.args, self.t.ctx, self.t.progress.step, time.monotonic()
        flags = [0] * 4
        # the votes say when the next one is: the same step on every rank (one process: every step)
        if step >= self.next_vote or ctx.world_size == 1:
            flags[0] = ctx.received
            # rank 0's clocks, and how many steps until the next vote (at its pace: s a step)
            if ctx.rank == 0:
                pace = max(now - self.voted[1], 1e-6) / (step - self.voted[0])
                flags[1:] = [
                    0 < args.log_seconds <= now - self.logged_at,
                    0 < 60 * args.save_minutes <= now - self.saved_at,
                    min(10, 1 + int(0.25 / pace)),
                ]
            if ctx.world_size > 1:
                flags = torch.tensor(flags, dtype=torch.float64)
                # SUM: every rank's say (the gap: rank 0's alone)
                dist.all_reduce(flags, group=ctx.control)
            self.next_vote, self.voted = step + int(flags[3]), (step, now)
        stop = bool(flags[0] > 0)
        log_now = bool(flags[1] > 0 or args.log_every and step % args.log_every == 0)
        save_now = bool(flags[2] > 0 or args.save_every and step % args.save_every == 0)
        # (--log-seconds and --save-minutes count from the record and the checkpoint: Meter, save_checkpoint)
        return stop, log_now, save_now

    def stopped(self):
        """The checkpoint is saved: say so, and return the exit code (130 after Ctrl-C, else 75: EX_TEMPFAIL)."""
        t, code = self.t, 130 if self.t.ctx.received == signal.SIGINT else 75
        log(
            t.ctx,
            f"stopped by a signal at step {t.progress.step}: {t.args.out_dir}/checkpoint.pt saved; rerun "
            f"the same command to continue (exit code {code})",
        )
        return code


# ====== When a run hangs: which rank, where, and why =========================================================

# What a rank does: the innermost of these on its main thread's stack ("waiting": for the other ranks).
PLACES = {
    "call_compute_loss": "in compute_loss",
    "__getitems__": "loading data",
    "waits": "loading data",
    "evaluate": "evaluating",
    "atomic_save": "saving",
    "step": "waiting in backward: the gradient all-reduce",
    "fold": "waiting in the loss all-reduce",
    "decide": "waiting in the vote",
    "wait_for_rank0": "waiting for rank 0",
}


def watchdog(progress, args, ctx):
    """--stall-seconds S, a thread in every rank: S seconds without an optimizer step, each rank writes its
    threads' stacks to OUT_DIR/stall/rank{R}.txt and posts its step and place to the process group's TCP store
    (which answers when collectives do not); rank 0 prints one report. Nothing per step; the run waits on."""
    last, since, reported = -1, time.monotonic(), False
    while args.stall_seconds:  # (0: off)
        time.sleep(min(1, args.stall_seconds / 10))
        if progress.step != last:
            last, since, reported = progress.step, time.monotonic(), False
        elif not reported and time.monotonic() - since >= args.stall_seconds:
            reported = True
            report_stall(args, ctx, last, time.monotonic() - since)


def report_stall(args, ctx, step, seconds):
    path = f"{args.out_dir}/stall/rank{ctx.rank}.txt"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        faulthandler.dump_traceback(f, all_threads=True)
    stack = traceback.extract_stack(sys._current_frames()[threading.main_thread().ident])
    place = next(
        (PLACES[f.name] for f in reversed(stack) if f.filename == __file__ and f.name in PLACES), ""
    )
    # The innermost frame: your code's is where it is; torch's collectives wait.
    inner, waiting = stack[-1], place.startswith("waiting")
    if waiting and not inner.filename.startswith(os.path.dirname(torch.__file__)):
        place = ""
    elif not waiting and re.search("torch/(distributed|nn/parallel)", inner.filename):
        place = f"waiting in a collective, {place}"
    where = f"{place or 'in ' + inner.name} ({os.path.basename(inner.filename)}:{inner.lineno})"
    ranks = [{"rank": ctx.rank, "step": step, "place": where, "stacks": path}]
    if ctx.world_size > 1:  # a client of the store that init_process_group used (env://)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
        )
        keys = [
            f"ddp_train/stall/{os.environ.get('TORCHELASTIC_RESTART_COUNT')}/{step}/{r}"
            for r in range(ctx.world_size)
        ]
        store.set(keys[ctx.rank], json.dumps(ranks[0]))  # (this attempt, this step)
        if ctx.rank:
            return
        with contextlib.suppress(dist.DistError):  # the others fire about when rank 0 does
            store.wait(keys, datetime.timedelta(seconds=15))
        missing = {"step": "?", "place": "no answer", "stacks": ""}
        ranks = [
            json.loads(store.get(k)) if store.check([k]) else {"rank": r, **missing}
            for r, k in enumerate(keys)
        ]
    ranks.sort(key=lambda r: r["place"].startswith("waiting"))  # the ones the others wait for first
    lines = "".join(f"\n  rank {r['rank']}: last step {r['step']}, {r['place']}" for r in ranks)
    log(
        ctx,
        f"{PROG}: stall: no optimizer step for {seconds:.0f} s. Rank {ranks[0]['rank']} holds the others up: "
        f"{ranks[0]['place']}; its stacks: {ranks[0]['stacks']}{lines}",
        error=True,
    )


# ====== Deterministic data: a sample's randomness is a function of (seed, epoch, index) ====================

try:  # optional; when present, a Dataset's numpy randomness is seeded like torch's
    import numpy
except ImportError:
    numpy = None


class SeededSamples(Dataset):
    """The user's Dataset, seeded per sample: before sample i of epoch e loads (its key is (e, i)), each
    global generator it may draw from (torch, Python's random, numpy) is seeded from (seed, e, i), whatever
    the worker count, the world size, the order in which workers take batches, or where a run resumed. That
    costs about 8 us a sample on a 2-core machine, whether or not the Dataset draws: one rule. An exact
    TensorDataset draws nothing: a batch of it is one index gather per tensor."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed = dataset, seed

    def __getitems__(self, batch):
        """One batch, collated: (epoch, sample indices) from the batch sampler. The DataLoader calls this, in a
        worker or here."""
        epoch, indices = batch
        # (>> 1: + an index stays below 2**64)
        data, first = self.dataset, mix_seed(self.seed, epoch) >> 1
        # An exact TensorDataset (a subclass may augment) draws nothing: as default_collate batches its tuples.
        if type(data) is TensorDataset and collate_fn is default_collate:
            rows = torch.tensor(indices)
            return [tensor[rows] for tensor in data.tensors]
        # Trap: loaded here (no workers), the seeding must not reach the training process's own generators
        # (dropout; a mixup's random.random() in compute_loss): all of them are put back as they were.
        kept = torch.utils.data.get_worker_info() is None and rng_state("cpu")
        items = []
        for index in indices:  # the hot loop: a few us per sample, on top of the Dataset's own
            # Consecutive seeds are fine: each generator mixes its own. The CPU's torch generator alone: a
            # Dataset draws there (torch.manual_seed, which visits every device, is 100x slower).
            seed_everything(first + index, torch.default_generator)
            items.append(data[index])
        if kept:
            set_rng_state(kept, "cpu")
        try:
            # yours, assigned on this module, looked up now: in workers too
            return collate_fn(items)
        # a value, not an exception: it reaches the trainer from a worker as it is
        except Exception as exc:
            why = f"your collate_fn raised {type(exc).__name__}: {one_line(exc, last=True)}"
            if collate_fn is default_collate:
                why = (
                    f"{one_line(exc, last=True)}. __getitem__ should return tensors, numbers or strings, or "
                    "tuples, lists and dicts of them, with the same shapes for every item; items of different "
                    "shapes need a collate_fn of yours that pads them"
                )
            return Unbatchable(f"cannot batch the items of {type(data).__name__}: {why}")

    @staticmethod
    def as_is(batch):  # the DataLoader's collate_fn: __getitems__ collated the batch
        return batch

    @staticmethod
    def leave_signals_to_trainer(worker_id):
        """A DataLoader worker exits on a SIGTERM its parent did not send, and torchrun, scancel and terminals
        signal whole process groups: the trainer would die before it saves. The stop signals are its."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


class Unbatchable(str):
    """Why the items of a batch could not be batched: the run stops with this line."""


def on_device(batches, ctx):
    """A DataLoader's batches on the device; one line for items it could not batch."""
    # (an exception in a worker comes here with the worker's traceback in its message)
    for batch in batches:
        if isinstance(batch, Unbatchable):
            fail(batch, ctx)
        yield to_device(batch, ctx.device)


def to_device(batch, device):
    """Move a batch to the device: tensors, in any nesting of tuples (named ones too), lists and dicts."""
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch.to(device, non_blocking=True) if torch.is_tensor(batch) else batch


def data_workers(dataset, args, ctx):
    """--workers: -1 is none on the CPU (they would take the cores training needs) or for an exact
    TensorDataset (a batch is one index gather), and on a GPU a few: a core each, one left for training."""
    if args.workers >= 0 or ctx.device.type != "cuda" or type(dataset) is TensorDataset:
        return max(args.workers, 0)
    # (the threads: this process's share of the cores)
    return min(4, max(1, torch.get_num_threads() - 1))


def plan_steps(t):
    """This rank's micro-batches in each step of the epoch. Step s trains the samples at [s, s + 1) x
    global batch of the epoch's shuffle, which DistributedSampler deals out round-robin: this rank's
    share of them is the same stretch of its share. (One process: all of them, in the same order.)"""
    mine, each = my_share(t.sampler, t.ctx), t.global_batch // t.ctx.world_size
    return [
        split(mine[s * each : (s + 1) * each], t.args.batch_size) for s in range(t.steps_per_epoch)
    ]


def my_share(sampler, ctx):
    """This rank's sample indices for the sampler's current epoch."""
    # Trap: DistributedSampler pads with repeated samples so that every rank gets as many: they would
    # be trained twice and counted twice in metrics. The real ones come first: keep only those.
    return list(sampler)[: len(range(ctx.rank, len(sampler.dataset), ctx.world_size))]


def split(indices, most):
    """`indices` in as few batches of at most `most` as can hold them, their sizes differing by one at
    most: 65 samples at 64 are 33 + 32, never 64 + 1 (BatchNorm cannot train on one sample)."""
    n, size = math.ceil(len(indices) / most), len(indices)
    return [indices[size * i // n : size * (i + 1) // n] for i in range(n)]


def seed_everything(seed, torch_generators=torch):
    """Seed torch (every device, or the one generator given), Python's random and numpy."""
    torch_generators.manual_seed(seed)
    random.seed(seed)
    if numpy:
        numpy.random.seed(seed % 2**32)


@functools.lru_cache
def mix_seed(*parts):
    """A well-mixed 64-bit seed from integers and strings: the same in every process, machine and version."""
    # a str seeds through SHA-512: no hash randomisation
    return random.Random(repr(parts)).getrandbits(64)


def rng_state(device):
    """This process's random generators: torch, CUDA, Python's random and numpy (as plain values and tensors,
    which a weights_only load reads)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if numpy:
        kind, keys, *rest = numpy.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), *rest]
    if str(device).startswith("cuda"):
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if numpy and "numpy" in state:
        kind, keys, *rest = state["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), *rest))
    if "cuda" in state and str(device).startswith("cuda"):
        torch.cuda.set_rng_state(state["cuda"], device)


class RankRNG:
    """Every rank's random generators as a stateful part: state_dict() gathers all ranks' states (every
    rank calls it), load_state_dict() restores this rank's. A new world size fits no saved stream: each
    rank then gets a fresh, deterministic one."""

    def __init__(self, t):
        self.t = t

    def state_dict(self):
        return everyone(rng_state(self.t.ctx.device), self.t.ctx)

    def load_state_dict(self, states):
        t = self.t
        if len(states) == t.ctx.world_size:
            set_rng_state(states[t.ctx.rank], t.ctx.device)
        else:
            seed_everything(mix_seed(t.args.seed, "rank", t.ctx.rank, t.progress.step))


# ====== Checkpoints and exact resume ========================================================================

CHECKPOINT_FORMAT = "ddp_train.checkpoint/4"  # /4: the schedulers; the losses as means


@dataclasses.dataclass
class Progress:
    """Where the run is; checkpoints carry it."""

    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0  # optimizer steps done in the current epoch
    step: int = 0  # optimizer steps done in total
    # the current epoch's samples trained, and its global train-loss sum and count so far,
    samples: int = 0
    loss_sum: float = 0.0  # so that a resumed epoch still logs the exact means
    count: float = 0.0
    max_norm: float | None = None  # the epoch's largest gradient norm so far (before clipping), and
    skipped: int = 0  # (fp16) its steps that the GradScaler skipped
    best: float | None = None  # --keep-best: the best evaluation so far
    # tokens: the last step's count over all ranks (a 0-dim tensor once training)
    expected: float = 0.0

    def step_done(self, samples):
        self.step += 1
        self.step_in_epoch += 1
        self.samples += samples

    def next_epoch(self):  # the epoch's own fields back to their defaults
        self.__init__(self.epoch + 1, 0, self.step, best=self.best, expected=self.expected)

    def state_dict(self):
        return dict(self.__dict__)

    def load_state_dict(self, state):
        self.__dict__.update(state)


def every_parameter_once(built, model, ctx):
    """build_optimizer's optimizer(s) as a list, each trainable parameter in exactly one of them."""
    optimizers = list(built) if isinstance(built, (list, tuple)) else [built]
    owners = collections.Counter(
        id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]
    )
    odd = [name for name, p in model.named_parameters() if p.requires_grad and owners[id(p)] != 1]
    if odd:
        fail(
            f"build_optimizer must give every trainable parameter to exactly one optimizer; {len(odd)} are in "
            f"none or in several: {', '.join(odd[:5])}{', ...' if len(odd) > 5 else ''}",
            ctx,
        )
    return optimizers


def run_config(t):
    """What defines the run: a checkpoint's must match, except --epochs and --max-steps, which may grow. The
    global batch, not its factors: 2 processes x 32 continue exactly as 1 x 64."""
    names = "seed lr warmup_steps amp clip_grad_norm drop_last init_from schedule ema"
    return {name: getattr(t.args, name) for name in names.split()} | {
        "global_batch_size": t.global_batch,
        "optimizers": [type(o).__name__ for o in t.optimizers],
        "train_samples": len(t.train_set),
        "eval_samples": len(t.eval_set or ()),
    }


def resume(t):
    """Rank 0 writes OUT_DIR/checkpoint.pt (save_checkpoint); every rank reads it itself here, onto the CPU, into
    every stateful part: the resumed run continues bit for bit. False: a finished run (model.pt written again)."""
    args, ctx, progress = t.args, t.ctx, t.progress
    path = args.resume
    if path == "auto":  # checkpoint.pt, or the one before if a save stopped between its two renames
        path = next((p for p in checkpoint_paths(args.out_dir) if os.path.exists(p)), None)
    if path in (None, "never"):
        if args.init_from:  # a new run from saved weights (a model.pt, or a checkpoint's model)
            saved = load(args.init_from, ctx, "--init-from")
            fit(t.model, saved["model"] if "format" in saved else saved, args.init_from, ctx)
            log(ctx, f"initialised the model from {args.init_from}")
        return True
    ckpt = load(path, ctx, "--resume")
    if ckpt.get("format") != CHECKPOINT_FORMAT:
        fail(
            f"{path} is not a checkpoint of this {PROG}: --init-from {path} starts a new run from the weights of a "
            "model.pt or an older checkpoint; or move it away, or pass --resume never to start over",
            ctx,
        )
    fit(t.model, ckpt["model"], path, ctx)
    config, saved = run_config(t), ckpt["config"]
    changed = [
        f"{key} {saved.get(key)} -> {value}"
        for key, value in config.items()
        if saved.get(key) != value
    ]
    if changed:
        fail(
            f"cannot resume from {path}: {', '.join(changed)}; rerun with the same settings (on another world size, "
            "--global-batch keeps the global batch), or start over with --resume never or another --out-dir",
            ctx,
        )
    # Every part but the model (fit loaded it), in order: "rng" reads the progress restored before it.
    for name, part in t.state.items():
        if name != "model":  # (a list, the optimizers or the schedulers: each of its parts)
            parts = (
                zip(part, ckpt[name], strict=True)
                if isinstance(part, list)
                else [(part, ckpt[name])]
            )
            for one, saved in parts:
                one.load_state_dict(saved)
    # A run of another length: only a LambdaLR follows it (its function reads the new total); another
    # scheduler keeps the total it was built for (OneCycleLR would raise past it, a cosine climb back).
    if ckpt["total_steps"] != t.total_steps and not all(
        isinstance(s, LambdaLR) for s in t.schedulers
    ):
        fail(
            f"cannot resume from {path} for {t.total_steps} steps: your scheduler was built for the run's "
            f"{ckpt['total_steps']}; keep --epochs and --max-steps, or start over with --resume never",
            ctx,
        )
    # A longer run: the next step's lr from the schedule as it now is. (A LambdaLR's function is not in its
    # state, and it knows the new total; the optimizer's lr is the old schedule's.)
    for s in t.schedulers:
        if isinstance(s, LambdaLR):
            for group, base, factor in zip(s.optimizer.param_groups, s.base_lrs, s.lr_lambdas):
                group["lr"] = base * factor(s.last_epoch)
    steps = everyone(progress.step, ctx)  # every rank read the file itself: the same one?
    if min(steps) < max(steps):
        fail(
            f"ranks resumed from different checkpoints (steps {min(steps)} to {max(steps)}): every node must see "
            "the same --out-dir (shared storage)",
            ctx,
        )
    if progress.step >= t.total_steps:
        log(
            ctx,
            f"{path} holds a finished run ({progress.epoch} epochs, {progress.step} steps): nothing to train. "
            "Raise --epochs or --max-steps to train on, or start over with --resume never or another --out-dir",
        )
        t.save_model()
        return False
    log(
        ctx,
        f"resumed from {path} at epoch {progress.epoch + 1}, step {progress.step_in_epoch}/{t.steps_per_epoch} "
        f"({progress.step} optimizer steps done, saved by world size {ckpt['world_size']}); the learning-rate "
        f"schedule spans {t.total_steps} steps",
    )
    return True


def save_checkpoint(t):
    """All ranks: every stateful part's state (the RNG's gathers every rank's); rank 0 writes it atomically,
    keeping the one before as checkpoint.prev.pt; everyone waits for the write."""
    # (the raw module: no prefixes)
    state = {
        name: [one.state_dict() for one in part] if isinstance(part, list) else part.state_dict()
        for name, part in t.state.items()
    }
    check_finite(t.model, f"the weights after step {t.progress.step}", t.ctx)
    if t.ctx.rank == 0:
        state.update(
            format=CHECKPOINT_FORMAT,
            config=run_config(t) | {"epochs": t.args.epochs},
            total_steps=t.total_steps,
            world_size=t.ctx.world_size,
        )
        atomic_save(state, *checkpoint_paths(t.args.out_dir))
    wait_for_rank0(t.ctx)  # a write longer than --timeout must not look like a dead peer
    t.agreement.saved_at = time.monotonic()  # --save-minutes counts from here


def checkpoint_paths(out_dir):
    return f"{out_dir}/checkpoint.pt", f"{out_dir}/checkpoint.prev.pt"


def atomic_save(obj, path, keep_previous=None):
    """Write to a temp file, flush + fsync, then rename: a crash never leaves a torn file.
    With keep_previous, the file being replaced is kept under that name."""
    with open(f"{path}.tmp", "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if keep_previous and os.path.exists(path):
        os.replace(path, keep_previous)
    os.replace(f"{path}.tmp", path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(directory)  # make the rename itself durable
    os.close(directory)


def load(path, ctx, flag):
    """A checkpoint or weights file, read onto the CPU. One that cannot be read stops the run: starting over
    would write over it (checkpoint.prev.pt holds the one before)."""
    if not os.path.isfile(path):
        fail(f"{flag} {path}: no such file", ctx)
    try:
        return torch.load(path, **checkpoint_load_options(ctx.device.type, path))
    except Exception as exc:
        prev = checkpoint_paths(os.path.dirname(path))[1]
        fix = f"move it away, resume from the one before with --resume {prev}, or pass --resume never to start over"
        fail(
            f"{path} is unreadable ({one_line(exc)[:120]}): {fix if flag == '--resume' else 'pass another file'}",
            ctx,
        )


def checkpoint_load_options(device_type, path):
    """torch.load's options: onto the CPU always, and load_state_dict then copies the tensors into place. Trap:
    map_location. Without it every rank loads onto the GPU that saved; with map_location=cuda each GPU holds the
    whole checkpoint beside the model until load_state_dict is done: OOM. Memory-mapped when training on GPUs: the
    ranks of a node then share the file's pages instead of each reading a private copy, and load_state_dict moves
    each tensor to its GPU. Not when training on the CPU: there Optimizer.load_state_dict keeps the loaded tensors
    as they are (Tensor.to copies nothing), so AdamW's moments would stay in the mapping and hold the whole file for
    the rest of the run; copying them out costs more at the peak than a plain read (measured with a 426 MB
    checkpoint and 2 ranks: +136 MiB peak RSS a rank either way; the storage reads are the same, once per node, as
    the page cache already shares the file). Trap: only torch's zip format maps; a legacy file (torch.save(...,
    _use_new_zipfile_serialization=False), or torch < 1.6) makes torch.load(mmap=True) raise (serialization.py), so
    it is read."""
    return {
        "map_location": "cpu",
        "mmap": device_type != "cpu" and zipfile.is_zipfile(path),
        "weights_only": True,
    }


def fit(model, weights, path, ctx):
    """Saved weights into build_model()'s model, or one line saying how the two differ (in torch's words)."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:  # (missing and unexpected keys, shapes that differ)
        fail(
            f"the model differs from the one in {path}: {' '.join(str(exc).split())[:600]}. Build the same model, "
            "or start over with --resume never or another --out-dir",
            ctx,
        )


def check_finite(model, what, ctx):
    """Nothing non-finite is ever written over good weights."""
    if not all(p.isfinite().all() for p in model.parameters()):
        diverged(f"{what} are not finite (nan or inf)", ctx)


def diverged(what, ctx):
    fail(
        f"{what}: the run diverged and stopped; nothing non-finite was saved, the last checkpoint is intact. "
        "Lower --lr, or try --clip-grad-norm 1.0",
        ctx,
        1,
    )


def wait_for_rank0(ctx):
    """All ranks wait here until rank 0 is done with its own work: the others for up to an hour, rank 0
    (which arrives last) for --timeout only, so that a peer lost meanwhile is reported within --timeout,
    not after an hour. (monitored_barrier enforces its timeout on rank 0 alone.)"""
    if ctx.world_size > 1:
        dist.monitored_barrier(ctx.patient, ctx.timeout)


# ====== The step's count: every mean weighed exactly ========================================================


class StepCount:
    """DDP: the step's count over all ranks (what compute_loss counts), which each micro-batch's mean is
    weighed against before its backward: loss x count x world size / expected (DDP averages over the ranks).
    - Samples (COUNT_UNIT = "samples"): every rank knows the step's count from its batches: expected is it,
      exactly, and nothing is sent. That compute_loss really counts samples is checked at every fold.
    - Any other unit (tokens): one small all-reduce of the step's count, started before its last backward
      and waited for after it (it runs while backward computes). expected is the last step's count (saved
      with the checkpoint); once the step's own is known, the gradients are scaled by expected / count. On a
      GPU the count stays there: no host-device sync in a step."""

    def __init__(self, t):
        self.t, self.expected = t, None

    def start(self, samples):
        self.local = 0
        if COUNT_UNIT == "samples":
            self.expected = samples
        elif self.expected is None:  # this process's first step: the last step's count, as saved
            self.expected = count_tensor(self.t.progress.expected, self.t.ctx.device)

    def add(self, count, last):
        """This rank's count of a micro-batch, before its backward."""
        self.local += count
        if last and COUNT_UNIT != "samples":
            self.total = count_tensor(self.local, self.t.ctx.device)
            # SUM
            self.work = self.t.ctx.world_size > 1 and dist.all_reduce(self.total, async_op=True)

    def finish(self):
        """After the step's backward: the gradients as if weighed against the step's own count."""
        if COUNT_UNIT == "samples":
            return
        if self.work:
            self.work.wait()  # on a GPU: the stream waits, not the host
        grads = [p.grad for p in self.t.params if p.grad is not None]
        # Trap: a float64 scale on float32 gradients sends _foreach_mul_ to its slow path, one kernel per
        # parameter (ForeachBinaryOpScalarTensor.cu takes the fast path only when the dtypes match).
        # (a step without tokens anywhere: nothing to weigh, and the next one expects the last count)
        some = self.total > 0
        torch._foreach_mul_(
            grads, torch.where(some, self.expected / self.total, 0).to(grads[0].dtype)
        )
        self.expected = self.t.progress.expected = torch.where(some, self.total, self.expected)


def grad_norm(params, clip):
    """The norm of the whole gradient, before clipping, and --clip-grad-norm's clip of it. Without a clip, a
    norm alone (torch >= 2.6; before, clip_grad_norm_ to infinity, which multiplies every gradient by 1)."""
    if clip or not hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.clip_grad_norm_(params, clip or math.inf)
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def count_tensor(count, device):
    """A count (an int, a float or a 0-dim tensor) as a float64 0-dim tensor on the device, to all-reduce.
    Trap: torch.tensor(n, device="cuda") copies from pageable memory and so waits for all queued GPU
    work (tensor_new.cpp -> copy_kernel_cuda -> memcpy_and_sync); torch.full writes it there instead."""
    if torch.is_tensor(count):
        return count.detach().to(device, torch.float64).reshape(())
    return torch.full((), count, dtype=torch.float64, device=device)


# ====== Statistics: the exact global loss, gradient norms, divergence, throughput, every rank's timing ======


class Meter:
    """This rank's loss sums and counts and the steps' gradient norms since the last fold, on the device (no
    host sync in a step). fold() adds every rank's into the epoch's totals with one all-reduce, and stops the
    run, on every rank, at the first non-finite loss or gradient norm (with fp16 a non-finite norm is a step
    the GradScaler skipped by design: those are counted, and kept out of the maximum). For the stragglers each
    rank times its waits for data and its compute: from its model's forward (after DDP's broadcast of the
    buffers) to compute_loss's end; not backward, whose all-reduce waits for the slowest rank. Rank 0 writes
    every record: the console, metrics.jsonl (epochs, evaluations), TensorBoard (KIND/NAME at the step) and
    report(). A resume drops what was written after its checkpoint's step, so that no step is written twice."""

    def __init__(self, t):
        self.t, self.cuda = t, t.ctx.device.type == "cuda"
        self.started = time.perf_counter(), t.progress.step  # for the ETA: this run's pace
        self.losses, self.norms, self.computing = [], [], []
        # waited, computed: this rank's seconds, since the start
        self.loss = self.count = self.waited = self.computed = 0
        self.timing = [0.0] * 2 * t.ctx.world_size  # every rank's, as of the last fold
        self.forward_at = self.flops = self.first_step_at = self.last_norm = self.writer = None
        # the next step's lr (also for an epoch resumed at its end, which runs no step before its record)
        self.lr = t.optimizers[0].param_groups[0]["lr"]
        hook = self.forward_starts
        # Under --compile a graph break: dynamo would trace the CUDA event into its graph.
        t.model.register_forward_pre_hook(torch.compiler.disable(hook) if t.args.compile else hook)
        if t.ctx.rank == 0:
            os.makedirs(t.args.out_dir, exist_ok=True)
            with open(f"{t.args.out_dir}/metrics.jsonl", "a+") as f:
                f.seek(0)
                kept = [line for line in f if json.loads(line)["step"] <= t.progress.step]
                f.truncate(0)
                f.writelines(kept)
            if t.args.tensorboard:  # (parse_args made sure the package is there)
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(
                    f"{t.args.out_dir}/tensorboard", purge_step=t.progress.step + 1
                )

    def stamp(self):
        """Now: on CUDA an event recorded in the stream (read at the next fold: no sync in a step), else the clock."""
        if self.cuda:
            return torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
        return time.perf_counter()

    # the model's forward pre-hook: this rank's compute starts
    def forward_starts(self, *hook_args):
        self.forward_at = self.stamp()

    def timed(self, batches):
        """An epoch's batches, on the device; the time this rank waits for each (data_wait_by_rank)."""
        p = self.t.progress
        self.began = self.line = (time.perf_counter(), p.samples, p.count, p.loss_sum, self.timing)
        return self.waits(on_device(batches, self.t.ctx))

    def waits(self, batches):
        clock = time.perf_counter()
        for batch in batches:
            self.waited += time.perf_counter() - clock
            yield batch
            clock = time.perf_counter()

    def add(self, loss, count):
        """One micro-batch's mean loss and its count."""
        self.loss += loss.detach() * count
        self.count += count
        # this rank's compute: from its model's forward to the end of compute_loss
        if self.forward_at:
            self.computing.append((self.forward_at, self.stamp()))
            # so an add() with no forward of the model since the last one times nothing
            self.forward_at = None

    def end_step(self, norm, lr):
        """The step's gradient norm before clipping (0-dim), and its lr."""
        self.losses.append(self.loss)
        self.norms.append(norm)
        self.loss, self.lr = 0, lr
        if not self.first_step_at:  # start-up cost, once: when the first step has really finished
            if self.cuda:
                torch.cuda.synchronize()
            self.first_step_at = time.time()

    def sums(self):
        """This rank's since the last fold, on the CPU: every step's loss sum, the count, and its seconds of
        waiting for data and of compute in its own slots of every rank's (a CUDA sync: a fold's place)."""
        ctx = self.t.ctx
        if self.cuda:
            torch.cuda.synchronize()  # the compute events, read now (the sums wait for the GPU anyway)
        self.computed += sum(
            a.elapsed_time(b) / 1000 if self.cuda else b - a for a, b in self.computing
        )
        timing = torch.zeros(2, ctx.world_size, dtype=torch.float64)
        timing[:, ctx.rank] = torch.tensor([self.waited, self.computed])
        sums = [count_tensor(value, ctx.device) for value in [*self.losses, self.count]]
        return torch.cat([torch.stack(sums).cpu(), timing.flatten()])

    def fold(self, sums):
        """All ranks: every rank's sums since the last fold (all-reduced) into the epoch's totals."""
        t, p, world = self.t, self.t.progress, self.t.ctx.world_size
        *losses, count = sums[: -2 * world].tolist()
        self.timing = sums[-2 * world :].tolist()
        norms = torch.stack(self.norms).tolist() if self.norms else []
        first = p.step - len(losses) + 1  # the step of losses[0]
        for what, values in (
            ("training loss", losses),
            ("gradient norm", norms if t.args.amp != "fp16" else []),
        ):
            # (fp16: an overflow is a step that the GradScaler skipped)
            for i, value in enumerate(values):
                if not math.isfinite(value):
                    diverged(f"the {what} is {value} at step {first + i}", t.ctx)
        finite = [norm for norm in norms if math.isfinite(norm)]
        if finite:
            p.max_norm = max(finite + [p.max_norm or 0.0])
        p.skipped += len(norms) - len(finite)
        self.last_norm = norms[-1] if norms else self.last_norm
        p.loss_sum += sum(losses)
        p.count += count
        self.losses, self.norms, self.computing, self.count = [], [], [], 0
        counts_samples(p.count, p.samples, t.ctx)  # the batches' sample counts weighed the means

    def record(self, kind):
        """The record of this progress line (since the last one) or epoch (since it began, resumed or not)."""
        t, p, world = self.t, self.t.progress, self.t.ctx.world_size
        then, samples, counted, loss, timing = self.began if kind == "epoch" else self.line
        now = time.perf_counter()
        self.line, seconds = (now, p.samples, p.count, p.loss_sum, self.timing), now - then
        shares = [round((a - b) / seconds, 4) for a, b in zip(self.timing, timing)]
        record = {
            "kind": kind,
            "step": p.step,
            "epoch": p.epoch + 1,
            "lr": self.lr,
            "train_loss": p.loss_sum / p.count
            if kind == "epoch"
            else (p.loss_sum - loss) / (p.count - counted),
            "samples_per_sec": (p.samples - samples) / seconds,
            "data_wait_by_rank": shares[:world],
            "compute_by_rank": shares[world:],
        }
        if COUNT_UNIT != "samples":
            record[f"{COUNT_UNIT}_per_sec"] = (p.count - counted) / seconds
        if self.flops:
            record["tflops_per_process"] = record["samples_per_sec"] * self.flops / world / 1e12
            if t.args.peak_tflops:
                record["mfu"] = record["tflops_per_process"] / t.args.peak_tflops
        # a line is a sign of life: --log-seconds counts from here
        t.agreement.logged_at = time.monotonic()
        if kind == "progress":
            eta = (now - self.started[0]) / (p.step - self.started[1]) * (t.total_steps - p.step)
            return record | {
                "grad_norm": self.last_norm,
                "elapsed_s": time.monotonic() - STARTED,
                "eta_s": eta,
            }
        record |= {
            "eval_loss": None,
            "eval_samples": 0,
            "train_samples": p.samples,
            "world_size": world,
            "effective_batch_size": t.global_batch,
            "epoch_time_s": seconds,
            "first_step_at": self.first_step_at,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        }
        if self.cuda:
            record["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
        if COUNT_UNIT != "samples":
            record[f"train_{COUNT_UNIT}"] = whole(p.count)
        if p.max_norm is not None:
            # the largest before clipping, over the epoch's steps
            record["grad_norm_max"] = p.max_norm
        if t.args.amp == "fp16":
            record["skipped_steps"] = p.skipped  # by the GradScaler: their gradients overflowed
        if self.flops:
            record["flops_per_sample"] = self.flops  # training FLOPs (forward + backward)
        return record

    def emit(self, record):
        """Rank 0: a record to the console, metrics.jsonl (epochs and evaluations), TensorBoard and report()."""
        t = self.t
        if t.ctx.rank:
            return
        log(
            t.ctx, console_line(record, t.total_steps, math.ceil(t.total_steps / t.steps_per_epoch))
        )
        if record["kind"] != "progress":
            strict = {
                k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in record.items()
            }
            with open(f"{t.args.out_dir}/metrics.jsonl", "a") as f:
                # strict JSON: jq and JavaScript read it
                f.write(json.dumps(strict, allow_nan=False) + "\n")
        if self.writer:
            for name, value in record.items():
                if isinstance(value, (int, float)) and name not in ("step", "epoch"):
                    self.writer.add_scalar(f"{record['kind']}/{name}", value, record["step"])
            self.writer.flush()
        report(record)


def console_line(record, total, epochs):
    """A record as one aligned line: a progress line and an evaluation (indented), or an epoch's line."""
    r, step = record, f"step {record['step']:>{len(f'{total:,}')},}/{total:,}"
    evals = "".join(
        f"  {k} {v:.4f}" for k, v in r.items() if k[:5] == "eval_" and isinstance(v, float)
    )
    if r["kind"] == "eval":
        return f"  {step}{evals}"
    rates = f"{r['samples_per_sec']:>9,.0f} samples/s"
    if COUNT_UNIT != "samples":
        rates += f"  {r[f'{COUNT_UNIT}_per_sec']:>9,.0f} {COUNT_UNIT}/s"
    if "mfu" in r:
        rates += f"  MFU {100 * r['mfu']:5.2f}%"
    # a straggler: the rank that computes, or waits for data, the most over 1.5 x the median
    named, most = "", 0.05
    for shares, does in (
        (r["compute_by_rank"], "computes"),
        (r["data_wait_by_rank"], "waits for data"),
    ):
        median, (share, worst) = (
            sorted(shares)[(len(shares) - 1) // 2],
            max((s, rank) for rank, s in enumerate(shares)),
        )
        if share - 1.5 * median > most:
            named, most = (
                f"rank {worst} {does} {share:.0%} of the time (median {median:.0%})",
                share - 1.5 * median,
            )
    rates += f"  {named or f'data wait {median:3.0%}'}"  # (median: the data wait's)
    if r["kind"] == "epoch":
        return (
            f"epoch {r['epoch']:>3}/{epochs}  train_loss {r['train_loss']:.4f}{evals}  {rates}  "
            f"world {r['world_size']}  batch {r['effective_batch_size']}  {r['epoch_time_s']:6.2f} s"
        )
    # h:mm:ss
    elapsed, eta = (datetime.timedelta(seconds=int(r[k])) for k in ("elapsed_s", "eta_s"))
    return (
        f"  epoch {r['epoch']:>3}/{epochs}  {step} ({100 * r['step'] / total:5.1f}%)  train_loss "
        f"{r['train_loss']:.4f}  {rates}  lr {r['lr']:.2e}  elapsed {elapsed}  ETA {eta}"
    )


def whole(x):
    """A count as JSON shows it best: an int when it is whole (tokens), else the float (weights)."""
    return int(x) if float(x).is_integer() else x


def log(ctx, message, error=False):
    """Rank 0 speaks for everyone: the one place that prints."""
    if ctx.rank == 0:  # DDP: one log, not one per rank
        print(message, file=sys.stderr if error else sys.stdout, flush=True)


def everyone(value, ctx):
    """Every rank's value (a small Python object) in rank order, on every rank: over gloo, no GPU involved."""
    values = [value] * ctx.world_size
    if ctx.world_size > 1:
        dist.all_gather_object(values, value, group=ctx.control)
    return values


# ====== Before training: one clear line for what cannot train; the warm-up; FLOPs ===========================


def check_the_run(t):
    """What cannot train stops here, before anything is written, on every rank alike, with one line. Returns
    the optimizer steps per epoch: the last one short, or with --drop-last (which --sync-bn implies) only full
    ones. SyncBatchNorm runs collectives of its own in every forward and backward, so every rank must run as
    many micro-batches as every other in every step: only full steps give them that."""
    args, ctx, batch, world = t.args, t.ctx, t.global_batch, t.ctx.world_size
    if (args.keep_best or args.eval_every) and t.eval_set is None:
        fail(
            f"{'--keep-best' if args.keep_best else '--eval-every'}: there is no eval set to evaluate",
            ctx,
        )
    for name, data in ("train", t.train_set), ("eval", t.eval_set or ()):
        if isinstance(data, IterableDataset) or not hasattr(data, "__getitem__"):
            fail(
                f"build_datasets returned an IterableDataset ({type(data).__name__}) as the {name} set: {PROG} needs "
                "map-style Datasets (__len__ and __getitem__) for its sampler, exact resume and N x B == 1 x N*B; "
                "index your samples (a list of token files, a memory-mapped array) instead of streaming them",
                ctx,
            )
    n = len(t.train_set)
    if not n or t.eval_set is not None and not len(t.eval_set):
        fail(
            f"build_datasets returned an empty {'eval' if n else 'training'} set: give it samples (an eval set of "
            "None: no evaluation)",
            ctx,
        )
    sizes = everyone((n, len(t.eval_set or ())), ctx)
    if len(set(sizes)) > 1:
        trains, evals = zip(*sizes)
        fail(
            f"the ranks built different datasets ({min(trains)} to {max(trains)} training samples, {min(evals)} to "
            f"{max(evals)} evaluation samples): build_datasets must give every rank the same data (split with a "
            "seeded generator, from storage every node sees)",
            ctx,
        )
    if args.sync_bn and world > 1:
        if ctx.device.type != "cuda":
            fail("--sync-bn needs CUDA: torch's SyncBatchNorm has no CPU implementation", ctx)
        if not args.drop_last:
            log(
                ctx,
                f"--sync-bn: every step is a full global batch, as with --drop-last (the last {n % batch} "
                "sample(s) of each epoch sit out), so that every rank runs SyncBatchNorm's collectives alike",
            )
        args.drop_last = True
    if batch % world:
        fail(
            f"--global-batch {batch} is split evenly over the ranks, so the world size ({world}) must divide it",
            ctx,
        )
    if args.drop_last and n < batch:
        fail(
            f"--drop-last: the {n} training samples do not fill one global batch of {batch}",
            ctx,
        )
    steps = n // batch if args.drop_last else math.ceil(n / batch)
    # Trap: BatchNorm cannot train on one sample ("Expected more than 1 value per channel"), and the last step
    # of an epoch can leave a rank one: every rank's micro-batches, of every step and of the last.
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in t.model.modules()):
        each = batch // world  # a rank's samples in a full step
        for rank in range(world):
            last = len(range(rank, n, world)) - (steps - 1) * each
            for where, size, fix in (
                ("every step", each, "raise --batch-size"),
                (
                    "the last step",
                    min(each, last),
                    f"pass --drop-last to leave out the last {n % batch} sample(s) of each epoch ({n} samples, "
                    f"global batch {batch}), or change --batch-size",
                ),
            ):
                if 1 in map(len, split(range(size), args.batch_size)):
                    fail(
                        f"BatchNorm cannot train on a micro-batch of one sample, and {where} of each epoch would give "
                        f"rank {rank} one: {fix}",
                        ctx,
                    )
    return steps


def warm_up(t):
    """The training set's first micro-batch (samples 0, 1, ... of epoch 0, the same on every rank) once forward
    and backward through DDP before training, leaving no trace (RNG, BatchNorm statistics, gradients). DDP
    (every version) rebuilds its gradient buckets after its first backward, in the order the gradients arrived:
    from a real batch that is the model's own order, so that buckets all-reduce while backward still runs; and
    since every run, fresh or resumed, then starts training on rebuilt buckets, the all-reduce rounds the same
    (bit-exact resume with more than two ranks). It also checks that every parameter gets a gradient and what
    compute_loss counts; torch's FlopCounterMode counts the pass's FLOPs (matmuls, convolutions, attention; not
    recurrent layers, nor kernels it cannot see); and the batch is kept for a rank without samples in a step."""
    args, ctx, keys = t.args, t.ctx, range(min(t.args.batch_size, len(t.train_set)))
    t.first_batch = batch = next(on_device([t.loader.dataset.__getitems__((0, keys))], ctx))
    rnn = sorted({type(m).__name__ for m in t.model.modules() if isinstance(m, nn.RNNBase)})
    why_not = f"torch's FlopCounterMode has no formula for {', '.join(rnn)}" if rnn else ""
    counting = args.count_flops and not rnn
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)
    with preserved_state(t.model, ctx.device), counter if counting else contextlib.nullcontext():
        with t.autocast():
            loss, count, _ = call_compute_loss(t.ddp_model, batch, ctx)
        loss.backward()
        # Trap: a parameter that got no gradient in a step leaves DDP waiting for it; it fails at the next step
        # on every rank, with a hundred lines each. Checked here, in one process too.
        missing = [
            name for name, p in t.model.named_parameters() if p.requires_grad and p.grad is None
        ]
        missing = list(dict.fromkeys(sum(everyone(missing, ctx), [])))  # every rank's
        if missing and not args.find_unused_parameters:
            fail(
                f"{len(missing)} parameter(s) got no gradient in the first step: {', '.join(missing[:5])}"
                f"{', ...' if len(missing) > 5 else ''}. Pass --find-unused-parameters if some parameters sit out "
                "some steps, or set requires_grad=False on those you freeze",
                ctx,
            )
    counts_samples(float(count), len(keys), ctx)
    # tokens: the first step's guess of its count, which keeps fp16 in range
    if not t.progress.step:
        t.progress.expected = max(float(count), 1.0) * t.global_batch / len(keys)
    if counting:
        t.meter.flops = counter.get_total_flops() / len(keys) or None
        why_not = "" if t.meter.flops else "torch's FlopCounterMode counted no FLOPs in this model"
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()  # peak_gpu_mem_mb: training's, not resuming's
    # Rank 0: how the run is set up, in two lines (and why FLOPs were not counted, if they were not).
    each = t.global_batch // ctx.world_size
    accum = math.ceil(each / args.batch_size)  # micro-batches per step: at most --batch-size each
    split_up = (
        f"{each}/process x {ctx.world_size}, in {accum} micro-batches of at most {-(-each // accum)}"
        if each % accum
        else f"{each // accum}/process x {ctx.world_size} x {accum} accum"
    )
    log(
        ctx,
        f"{PROG}: {ctx.launcher}, world size {ctx.world_size} ({ctx.local_world_size}/node), "
        f"{ctx.backend if ctx.world_size > 1 else 'no process group'}, {ctx.device}, "
        f"{torch.get_num_threads()} thread(s)/process, torch {torch.__version__}\n"
        f"global batch {t.global_batch} = {split_up}, lr {args.lr:g}, {len(t.train_set):,} train / "
        f"{len(t.eval_set or ()):,} eval samples, {t.steps_per_epoch} steps/epoch"
        + (f"\nFLOPs not counted: {why_not}; no FLOP/s or MFU is logged" if why_not else ""),
    )


# FlopCounterMode's formulas for attention cover the CUDA kernels, and the CPU's fused kernel only from torch
# 2.14 on: before, the same count is given here (custom_mapping takes formulas of the inputs' shapes).
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: (
        lambda q, k, v, *_, **__: flop_counter.sdpa_flop_count(q, k, v)
    ),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda g, q, k, v, *_, **__: flop_counter.sdpa_backward_flop_count(g, q, k, v)
    ),
}


@contextlib.contextmanager
def preserved_state(model, device):
    """A forward and backward that leave no trace: every RNG state, the buffers (BatchNorm's statistics)
    and the gradients are as they were before."""
    rng, buffers = rng_state(device), [b.clone() for b in model.buffers()]
    yield
    set_rng_state(rng, device)
    with torch.no_grad():
        for buffer, saved in zip(model.buffers(), buffers):
            buffer.copy_(saved)
    model.zero_grad(set_to_none=True)


# ====== Evaluation: every sample once, on every rank; the EMA's too; the best weights kept ===================


def evaluation(t):
    """All ranks: the eval figures of the weights, and of --ema's as eval_ema_*; then --keep-best."""
    if t.eval_set is None:
        return {}
    figures = evaluate(t.model, t)
    if "ema" in t.state:
        figures |= {
            f"eval_ema_{k[5:]}": v
            for k, v in evaluate(t.state["ema"].module, t).items()
            if k[5:] not in ("samples", COUNT_UNIT)
        }
    # METRIC[:min|:max]: best.pt (--ema's for eval_ema_*) at each better evaluation
    if t.args.keep_best:
        name, _, way = t.args.keep_best.partition(":")
        if name not in figures or way not in ("", "min", "max"):
            fail(
                f"--keep-best {t.args.keep_best}: name one of the evaluation's figures ({', '.join(figures)}), "
                "with :min or :max if you like",
                t.ctx,
            )
        value, best, lower = figures[name], t.progress.best, way == "min" if way else "loss" in name
        if best is None or (value < best if lower else value > best):
            t.progress.best = value
            model = t.state["ema"].module if name.startswith("eval_ema_") else t.model
            if t.ctx.rank == 0:
                atomic_save(model.state_dict(), f"{t.args.out_dir}/best.pt")
            wait_for_rank0(t.ctx)
    return {"step": t.progress.step, "epoch": t.progress.epoch + 1, **figures}


@torch.no_grad()
def evaluate(model, t):
    """Loss and metric means over the whole eval set, each sample counted exactly once. All ranks: each
    evaluates its share with the raw model (DDP's forward may sync), then the sums are added."""
    ctx = t.ctx
    # DDP: rank 0's buffers (BatchNorm statistics) on every rank: one model evaluated (DDP itself does this at
    # the next step's start).
    for buffer in model.buffers() if ctx.world_size > 1 else ():
        dist.broadcast(buffer, 0)
    if not hasattr(t, "eval_loader"):
        t.eval_loader = loader_of(t.eval_set, t.args, ctx)
    loader, batches = t.eval_loader
    # DDP: each rank evaluates its own share, in order: what DistributedSampler(shuffle=False) deals it, without
    # its padding. (Evaluation's own data seeds: epoch -1.)
    mine = range(ctx.rank, len(t.eval_set), ctx.world_size)
    batches[:] = [(-1, b) for b in split(mine, t.args.batch_size)]
    sums = {"count": 0}
    model.eval()
    for batch in on_device(loader, ctx):
        with t.autocast():
            loss, n, metrics = call_compute_loss(model, batch, ctx)
        # means, weighed by their count; by the figures' names, so that a metric named "count" is its own
        for name, mean in {"loss": loss, **metrics}.items():
            sums[f"eval_{name}"] = sums.get(f"eval_{name}", 0) + torch.as_tensor(mean).double() * n
        sums["count"] += n
    model.train()
    # DDP: all ranks' sums, added in rank order (some may lack names)
    totals = {}
    for rank_sums in everyone({k: float(v) for k, v in sums.items()}, ctx):
        for name, value in rank_sums.items():
            totals[name] = totals.get(name, 0.0) + value
    count = totals.pop("count")
    figures = {name: value / count for name, value in totals.items()}
    figures["eval_samples"] = len(t.eval_set)  # the ranks' shares add up to it: every sample once
    if COUNT_UNIT != "samples":
        figures[f"eval_{COUNT_UNIT}"] = whole(count)
    return figures


# ====== Extras: precision, compute_loss's contract, argument parsing, errors =================================


def call_compute_loss(model, batch, ctx):
    """compute_loss(model, batch) as (loss, count, metrics), checked on the way."""
    out = compute_loss(model, batch)
    loss, count, metrics = (
        (*out, {})[:3] if isinstance(out, tuple) and len(out) in (2, 3) else (out, None, None)
    )
    if torch.is_tensor(loss) and loss.ndim == 0 and isinstance(metrics, dict):
        if isinstance(count, (int, float)) or torch.is_tensor(count) and count.numel() == 1:
            # No items (all ignore_index): the mean is 0/0, and weighs nothing.
            if torch.is_tensor(count):
                some = count.reshape(()).to(loss.device) > 0
                loss = torch.where(some, loss, 0.0)
                metrics = {k: torch.where(some, v, 0.0) for k, v in metrics.items()}
            return loss, count, metrics
    shape = list(loss.shape) if torch.is_tensor(loss) else None
    fail(
        f"compute_loss must return (loss, count) or (loss, count, {{name: mean}}): loss the mean over count items, "
        f"a 0-dim tensor; count a number or a 0-dim tensor; it returned {type(out).__name__}"
        + (f" with a loss of shape {shape}: take the mean over the batch" if shape else ""),
        ctx,
    )


def counts_samples(counted, samples, ctx):
    """COUNT_UNIT "samples": compute_loss's counts must add up to the samples it was given (the warm-up's batch,
    and at every fold the epoch's), or one line."""
    if COUNT_UNIT == "samples" and counted != samples:
        fail(
            f'compute_loss counted {whole(counted)} for {samples} samples, but COUNT_UNIT is "samples": '
            "return the batch's sample count, or set COUNT_UNIT to what your count counts (ddp_train.COUNT_UNIT = "
            '"tokens")',
            ctx,
        )


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        fail(f"{message} (see --help)")


def at_least(low, strict=False):
    """An argparse type: a number (an int if `low` is one) no smaller than `low` (strict: greater)."""

    def parse(text):
        value = type(low)(text)
        if not low <= value < math.inf or strict and value == low:
            raise argparse.ArgumentTypeError(
                f"must be {'greater than' if strict else 'at least'} {low:g}, got {text}"
            )
        return value

    # argparse's own "invalid int value: 'abc'" takes the type's name from here
    parse.__name__ = type(low).__name__
    return parse


def fail(message, ctx=None, code=2):
    """Stop with one clear line on stderr and no traceback. With a ctx, the error is one that every
    rank hits, so only rank 0 prints it."""
    if ctx is None or ctx.rank == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    # torchrun's summary shows this line (@record skips SystemExit)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            info = {"timestamp": str(int(time.time()))}  # the layout of torch's ErrorHandler
            json.dump({"message": {"message": f"{PROG}: error: {message}", "extraInfo": info}}, f)
    raise SystemExit(code)


def one_line(exc, last=False):
    """An exception's first line (or last), or its type's name."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return lines[-1 if last else 0]


if __name__ == "__main__":
    sys.exit(main())
