"""ddp_train.py: a reference PyTorch DistributedDataParallel (DDP) training script.

One file, torch only. Launch it unchanged in any of these ways:

    python ddp_train.py                                  # one process: the CPU, or one GPU
    python ddp_train.py --spawn 2                        # N local processes, no launcher
    torchrun --nproc_per_node=4 ddp_train.py             # one node, 4 processes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST0:29500 --rdzv-id=job1 ddp_train.py   # on every node
    srun --ntasks-per-node=8 --gpus-per-task=1 python ddp_train.py     # SLURM: one task per GPU
    python -m torch.distributed.launch --nproc_per_node=2 ddp_train.py  # the legacy launcher

Your task is the functions at the top: build_datasets(), build_model(), compute_loss(), build_optimizer(),
report() and, for items of different shapes, collate_fn(). Edit them here, or import this file from your
own script and assign yours (see the README).

Read it top to bottom: first the lesson, where each line DDP adds to a plain loop says "DDP:" and
each classic trap "Trap:"; then, after a divider, the machinery, one section per feature.
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.elastic.multiprocessing.errors import record
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils import flop_counter
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset, default_collate

PROG = "ddp_train.py"
# One default --out-dir per script (out/ddp_train, out/tinylm): another task's checkpoint never stops its resume.
OUT_DIR = "out/" + os.path.basename(sys.argv[0] if os.path.isfile(sys.argv[0]) else PROG).removesuffix(".py")
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
        nn.Linear(IN_FEATURES, HIDDEN), norm(), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), norm(), nn.ReLU(),
        nn.Linear(HIDDEN, NUM_CLASSES),
    )


def compute_loss(model: nn.Module, batch) -> tuple:
    """(loss_sum, count) or (loss_sum, count, metric_sums) of one batch, for training and evaluation.
    loss_sum is a SUM of losses and count what it sums over (an int or a 0-dim tensor): samples for a classifier,
    real tokens for a language model. Every mean the script takes (the gradient, the logged losses) is a sum
    over all micro-batches and ranks divided by theirs: exact, whatever the world size. metric_sums: further
    sums that evaluation divides by the count (eval_accuracy). `batch`: collate_fn's batch, on the device."""
    inputs, targets = batch
    logits = model(inputs).float()
    loss_sum = F.cross_entropy(logits, targets, reduction="sum")
    return loss_sum, len(targets), {"accuracy": (logits.argmax(dim=1) == targets).sum()}


def build_optimizer(args, model: nn.Module):
    """One optimizer or a list of them, each trainable parameter in exactly one, in parameter groups as you
    like (their own lr, weight_decay...): --schedule multiplies each group's lr. The default: AdamW as nanoGPT
    sets it up, --weight-decay on matrices and embeddings (2 or more dimensions), none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, fused=True)  # fused: one kernel


def report(record: dict) -> None:
    """Rank 0 calls this with every record it logs (progress lines, epochs, evaluations), each with its
    "step" and "kind": plug W&B, MLflow or anything else in here (the README shows W&B). By default: nothing."""


# collate_fn(items) -> batch: how a list of items becomes one batch. torch's default stacks tensors and
# numbers of equal shapes; items of different lengths need one that pads them (examples/tinylm.py).
collate_fn = default_collate
COUNT_UNIT = "samples"  # what compute_loss's count counts: samples (known from the plan) or "tokens" (summed)


def parse_args(argv=None) -> argparse.Namespace:
    """The core arguments; the machinery adds its own (add_machinery_arguments)."""
    p = Parser(prog=PROG, formatter_class=argparse.ArgumentDefaultsHelpFormatter, description="Reference "
               "DistributedDataParallel training script: python, torchrun, torch.distributed.launch, srun, --spawn N.")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=at_least(1), default=3, help="passes over the training set")
    g.add_argument("--batch-size", type=at_least(1), default=64,
                   help="samples per process and micro-batch (global batch: this x world size x --grad-accum)")
    g.add_argument("--grad-accum", type=at_least(1), default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=at_least(0.0), default=1e-3, help="peak learning rate (build_optimizer's)")
    g.add_argument("--warmup-steps", type=at_least(0), default=0, help="linear warmup, then --schedule")
    g.add_argument("--seed", type=int, default=0, help="seeds the data, the initial weights and the shuffle")
    g.add_argument("--out-dir", default=OUT_DIR, help="where rank 0 writes model.pt, checkpoints and metrics.jsonl")
    g = p.add_argument_group("the default task")
    g.add_argument("--num-samples", type=at_least(1), default=32768, help="training samples")
    g.add_argument("--eval-samples", type=at_least(0), default=4096, help="evaluation samples (0: no evaluation)")
    g.add_argument("--batch-norm", action="store_true", help="give the model BatchNorm layers")
    add_machinery_arguments(p)
    return p.parse_args(argv)


# ====== Joining the process group: torchrun's environment contract ==========================================


@dataclasses.dataclass
class DistContext:
    rank: int = 0  # this process, 0 .. world_size - 1
    local_rank: int = 0  # this process on its node: which GPU it drives
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    distributed: bool = False  # False: one process, no process group, the same code path
    launcher: str = "python"
    backend: str = "none"
    control_group: object = None  # gloo, for small control messages beside training's (no GPU involved)
    patient_group: object = None  # gloo, for waiting on rank 0's own work (a checkpoint write)
    timeout: datetime.timedelta = datetime.timedelta(minutes=30)  # --timeout: how long a collective waits

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(args) -> DistContext:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), pick the device and join the process group. Other launchers are first translated
    into that environment; plain python has none of it and runs one process without a group."""
    launcher = adopt_launcher_environment(args)
    env = os.environ
    world, rank = int(env.get("WORLD_SIZE", 1)), int(env.get("RANK", 0))
    local_rank, local_world = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world))
    ctx = DistContext(rank, local_rank, world, local_world, launcher=launcher)
    set_up_process(args, ctx)  # threads, and --debug's environment
    backend = "nccl" if torch.cuda.is_available() else "gloo"  # for CPU training, hide the GPUs (CUDA_VISIBLE_DEVICES=)
    if torch.cuda.is_available():
        ctx.device = gpu_of(ctx)  # DDP: one GPU per process, picked by LOCAL_RANK ...
        torch.cuda.set_device(ctx.device)  # ... and made current before init: nothing lands on GPU 0
    if world == 1:
        return ctx  # one process: no process group, and every collective below is skipped
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        # DDP: join the process group; the timeout makes a missing peer an error (no device_id: pytorch/pytorch#153960)
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout,
                                **rendezvous(world, timeout))  # env://, or a workaround's store
    except Exception as exc:  # name what was tried; the launcher has said the rest
        fail(f"rank {rank} could not join the {world}-process group at {env.get('MASTER_ADDR')}:"
             f"{env.get('MASTER_PORT')} within {args.timeout:g}s: {one_line(exc)}", code=1)
    ctx.distributed, ctx.backend, ctx.timeout = True, backend, timeout
    ctx.control_group = dist.new_group(backend="gloo", timeout=timeout)
    ctx.patient_group = dist.new_group(backend="gloo", timeout=PATIENT_TIMEOUT)
    return ctx


def cleanup_distributed(ctx: DistContext) -> None:
    """DDP: leave the process group, once the DDP model and the DataLoader workers are released."""
    # Collect what training left behind (explain_failure() drops a failure's frames first). Trap, torch
    # 2.13 with gloo (seen here, about 1 run in 3): destroying the process group while DDP's reducer is
    # alive aborts the process at exit ("terminate called without an active exception"). And persistent
    # DataLoader workers outliving their loader are only ended at exit, and ours ignore SIGTERM.
    gc.collect()
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def log(ctx: DistContext, message: str, error: bool = False) -> None:
    """Rank 0 speaks for everyone: the one place that prints."""
    if ctx.is_main:  # DDP: one log, not one per rank
        print(message, file=sys.stderr if error else sys.stdout, flush=True)


# ====== The training loop ===================================================================================


def train(args, ctx: DistContext, agreement: Agreement) -> int:
    """Every rank builds the same data and model, wraps it in DDP, and trains. Returns the exit code."""
    seed_everything(args.seed)  # first: a random split inside build_datasets then agrees across ranks
    train_set, eval_set = (place_dataset(d, ctx) for d in build_datasets(args))
    check_datasets(train_set, eval_set, args, ctx)
    seed_everything(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(args).to(ctx.device)
    seed_everything(mix_seed(args.seed, RANK_STREAM, ctx.rank))  # DDP: each rank its own dropout masks

    # DDP: the batch of one optimizer step: per process x world size x accumulation, or --global-batch
    global_batch = args.global_batch or args.batch_size * ctx.world_size * args.grad_accum
    optimizers = Optimizers(build_optimizer(args, model), model, ctx)  # yours: one or a list, over every parameter
    steps_per_epoch = count_steps(len(train_set), global_batch, args, ctx)  # --drop-last: full steps only
    total_steps = args.max_steps or args.epochs * steps_per_epoch  # --max-steps: as many epochs as that takes
    check_batchnorm_batch_sizes(model, len(train_set), global_batch, steps_per_epoch, args, ctx)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=args.amp == "fp16")  # fp16 only: loss scaling
    progress = Progress()
    # Everything a checkpoint saves and restores, by name: one more stateful part is one more line here.
    state = {"model": model, "optimizers": optimizers, "scaler": scaler, "progress": progress,
             "rng": RankRNG(ctx, args.seed, progress)}
    if args.ema:  # --ema DECAY: an exponential moving average of the weights (and buffers), after every step
        state["ema"] = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema), use_buffers=True)

    checkpoints = Checkpoints(args, ctx, train_set, eval_set, global_batch, optimizers)
    if not checkpoints.resume(state, steps_per_epoch, total_steps):
        return 0  # a finished run, rerun: nothing to train

    train_data = Loader(train_set, args.batch_size, ctx, args.workers, args.seed)
    flops, why_not = count_flops(model, train_data, args, ctx) if args.count_flops else (None, "")  # before DDP
    ddp_model = wrap_model(model, args, ctx)
    job = Job(args, ctx, model, ddp_model, torch.compile(ddp_model) if args.compile else ddp_model,
              optimizers, scaler, state,
              # DDP: each rank reads its own share of each epoch's shuffle; one process reads it all.
              DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed),
              train_data, Loader(eval_set, args.batch_size, ctx, args.workers, args.seed) if eval_set else None,
              global_batch, steps_per_epoch, total_steps, flops, agreement, StepCount(ctx),
              Records(args, ctx, progress, total_steps, steps_per_epoch))
    warm_up(job)  # the first batch through DDP once, untrained: all-reduce buckets in the real order
    log_start(job, why_not)
    return train_loop(job, progress, checkpoints)


def wrap_model(model: nn.Module, args, ctx: DistContext) -> nn.Module:
    """DDP: wrap the model so that backward() also averages the gradients over all ranks."""
    if not ctx.distributed:
        return model
    if args.sync_bn:  # BatchNorm statistics over the global batch; before wrapping: DDP must see SyncBatchNorm
        if ctx.device.type != "cuda":
            fail("--sync-bn needs CUDA: torch's SyncBatchNorm has no CPU implementation", ctx=ctx)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # DDP: the wrap. It broadcasts rank 0's weights, then all-reduces gradients during backward().
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               find_unused_parameters=args.find_unused_parameters,
               gradient_as_bucket_view=True)  # gradients live in the all-reduce buckets: one copy less


def train_loop(job: Job, progress: Progress, checkpoints: Checkpoints) -> int:
    """Optimizer steps, epoch after epoch, to the run's total. All ranks run every line together; rank 0
    alone prints and writes."""
    args, ctx, stats = job.args, job.ctx, EpochStats(job.ctx, job.args.amp, job.train_data, job.model)
    while progress.step < job.total_steps:
        job.sampler.set_epoch(progress.epoch)  # Trap: without it every epoch repeats the same shuffle
        # DDP: this rank's samples of each step: its share of the step's global batch, as micro-batches.
        steps = plan_steps(my_share(job.sampler, ctx), job)
        data = job.train_data.batches([mb for step in steps[progress.step_in_epoch :] for mb in step], progress.epoch)
        stats.start_epoch(progress)
        last = min(job.steps_per_epoch, progress.step_in_epoch + job.total_steps - progress.step)  # --max-steps
        for step in range(progress.step_in_epoch, last):  # (a resumed epoch skips the steps done)
            samples = min(len(job.sampler.dataset) - step * job.global_batch, job.global_batch)  # over all ranks
            set_learning_rate(job, progress.step)  # --warmup-steps, then --schedule: x each group's own lr
            train_step(job, data, len(steps[step]), samples, stats)
            progress.step_done(samples)
            if args.eval_every and progress.step % args.eval_every == 0 and step < last - 1:  # (the end evaluates)
                job.records({"kind": "eval", **evaluation(job, progress)})  # all ranks evaluate, rank 0 writes
            # --- periodic: all ranks decide together (a signal, rank 0's clocks), then act together ---
            stopping, log_now, save_now = job.agreement.decide(progress.step)
            if stopping or log_now or save_now:
                stats.fold(progress)  # DDP: the loss sums of all ranks, all-reduced
            if log_now:  # rank 0 only
                stats.log_progress(progress, job)
            if stopping or save_now:
                checkpoints.save(job)  # rank 0 writes, every rank waits for it
            if stopping and progress.step < job.total_steps:  # (a stop in the run's last step finishes it)
                return job.agreement.stopped(progress, args.out_dir)
        # --- end of epoch (or of the run, with --max-steps): all ranks ---
        stats.fold(progress)  # DDP: all-reduce the loss sums: the exact global train loss
        record = {**stats.epoch_record(progress, job), **evaluation(job, progress)}
        if progress.step_in_epoch == job.steps_per_epoch:
            progress.next_epoch()
        job.records(record)  # rank 0 only
        checkpoints.save(job)  # rank 0 writes, every rank waits for it
    job.agreement.close()
    save_model(job.state, args, ctx)
    return 0


def train_step(job: Job, data, n_micro: int, samples: int, stats: EpochStats) -> None:
    """One optimizer step: forward and backward over this rank's micro-batches, then the update."""
    args, ctx, count = job.args, job.ctx, 0
    for micro in range(n_micro):
        # DDP: all-reduce the gradients only in the backward of the step's last micro-batch.
        last = micro == n_micro - 1
        with contextlib.nullcontext() if last or not ctx.distributed else job.ddp_model.no_sync():
            with autocast(args, ctx):
                loss_sum, n, _ = call_compute_loss(job.forward, next(data), ctx)
            stats.add(loss_sum, n)  # this rank's sums; and its compute time, for the stragglers' figures
            count = count + n  # what this rank's losses sum over in this step: samples, tokens
            if last:
                job.step_count.start(count, samples)  # DDP: the count over all ranks (tokens: summed now)
            job.scaler.scale(loss_sum / job.typical_count).backward()  # the sum: / the global count below
    if n_micro == 0:  # DDP: none of the step's samples are here, but every rank joins the all-reduces
        zero_gradient_backward(job.ddp_model, job.step_count, samples)
    stats.end_step(mean_gradients(job, job.step_count.total()))  # DDP: sums / the global count, then clipped
    for optimizer in job.optimizers:
        job.scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    job.scaler.update()
    if "ema" in job.state:
        job.state["ema"].update_parameters(job.model)


@torch.no_grad()
def evaluate(model: nn.Module, data: Loader, args, ctx: DistContext) -> dict:
    """Loss and metric means over the whole eval set, each sample counted exactly once. All ranks:
    each evaluates its share with the raw model (DDP's forward may sync), then the sums are added."""
    broadcast_buffers(model, ctx)  # DDP: rank 0's BatchNorm statistics on every rank: one model evaluated
    model.eval()
    # DDP: each rank evaluates its own share, in order; my_share() drops the sampler's padding.
    sampler = DistributedSampler(data.dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    mine = my_share(sampler, ctx)
    sums: dict = {"samples": len(mine)}
    for batch in data.batches(split(mine, args.batch_size), EVAL_EPOCH):
        with autocast(args, ctx):
            loss_sum, n, metric_sums = call_compute_loss(model, batch, ctx)
        for name, value in {"loss": loss_sum, "count": n, **metric_sums}.items():
            sums[name] = sums.get(name, 0) + (value.detach().double() if torch.is_tensor(value) else value)
    gathered = everyone({name: float(value) for name, value in sums.items()}, ctx)  # DDP: all ranks' (some lack names)
    totals = {n: sum(g.get(n, 0.0) for g in gathered) for n in dict.fromkeys(k for g in gathered for k in g)}
    model.train()
    samples, count = int(totals.pop("samples")), totals.pop("count", 0.0)
    return {**{f"eval_{name}": value / count for name, value in totals.items()}, "eval_samples": samples,
            **({f"eval_{COUNT_UNIT}": whole(count)} if COUNT_UNIT != "samples" else {})}


def save_model(state: dict, args, ctx: DistContext) -> None:
    """The final weights: rank 0 writes model.pt (and --ema's model_ema.pt); every rank waits for it."""
    model, progress = state["model"], state["progress"]
    check_finite(model, "the final weights", ctx)
    if ctx.is_main:  # DDP: rank 0 alone writes; the others hold the same weights
        path = os.path.join(args.out_dir, "model.pt")
        # Trap: save the raw module: DDP would prefix every key with "module.", torch.compile with "_orig_mod.".
        atomic_save(model.state_dict(), path)
        if "ema" in state:
            atomic_save(state["ema"].module.state_dict(), os.path.join(args.out_dir, "model_ema.pt"))
        log(ctx, f"saved {path}: {progress.epoch} epoch(s), {progress.step} steps, "
                 f"{datetime.timedelta(seconds=int(time.monotonic() - STARTED))} since launch")
    wait_for_rank0(ctx)  # Trap: a barrier, so that no rank tears down before rank 0's files are written


def run(args) -> int:
    """One process's whole life: join, train, leave."""
    ctx = init_distributed(args)
    agreement = Agreement(ctx, args)
    try:
        return train(args, ctx, agreement)
    except BaseException as exc:
        explain_failure(exc, ctx, agreement)  # one line for the ends that deserve one, else the traceback
        raise
    finally:
        cleanup_distributed(ctx)  # DDP: leave the process group, also after an error


@record  # under torchrun, a traceback shows in its failure summary (fail() writes our one line there itself)
def main(argv=None) -> int:
    args = parse_args(argv)
    return spawn_workers(args) if args.spawn else run(args)


# ############################################################################
#                        THE LESSON ENDS HERE
#   Below: the machinery, one section per feature. Each has one call site above.
# ############################################################################


def add_machinery_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("performance")
    g.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off", help="autocast; fp16 adds loss scaling")
    g.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    g.add_argument("--workers", type=at_least(-1), default=-1,
                   help="DataLoader workers per process for Datasets that are not in-memory tensors (-1: none on "
                        "the CPU, a few with CUDA; 0 for a Dataset holding CUDA tensors)")
    g.add_argument("--count-flops", action=argparse.BooleanOptionalAction, default=True,
                   help="count the training FLOPs per sample on the first batch (torch's FlopCounterMode): FLOP/s, MFU")
    g.add_argument("--peak-tflops", type=at_least(0.0, strict=True), default=None,
                   help="peak TFLOP/s of one GPU at the precision training runs in (bf16, TF32, ...), for MFU")
    g = p.add_argument_group("your recipe")
    g.add_argument("--max-steps", type=at_least(1), default=None, metavar="N",
                   help="train exactly N optimizer steps, through as many epochs as that takes (overrides --epochs)")
    g.add_argument("--schedule", choices=("cosine", "linear", "constant", "wsd"), default="cosine",
                   help="after the warmup: cosine or linear decay to 0, constant, or wsd (warmup-stable-decay)")
    g.add_argument("--weight-decay", type=at_least(0.0), default=0.01,
                   help="the default AdamW's (torch's default), on parameters of 2 or more dimensions")
    g.add_argument("--eval-every", type=at_least(0), default=0, metavar="N",
                   help="also evaluate every N optimizer steps (0: at each epoch's end only)")
    g.add_argument("--keep-best", metavar="METRIC",
                   help="write best.pt when an evaluation improves METRIC (eval_loss...): lower is better for losses, "
                        "higher for the rest, unless it ends in :min or :max")
    g.add_argument("--ema", type=at_least(0.0, strict=True), default=None, metavar="DECAY",
                   help="an exponential moving average of the weights (0.999...): eval_ema_*, model_ema.pt")
    g.add_argument("--tensorboard", action="store_true", help="write TensorBoard curves under OUT_DIR/tensorboard")
    g = p.add_argument_group("hangs and stragglers")
    g.add_argument("--stall-seconds", type=at_least(0.0), default=300.0, metavar="S",
                   help="S seconds without a step: each rank's stacks in OUT_DIR/stall/, who holds up whom (0: off)")
    g.add_argument("--debug", action="store_true",
                   help="torch's distributed debugging (INFO, NCCL_DEBUG=INFO, C++ stacks); ranks' in OUT_DIR/debug")
    g = p.add_argument_group("model and optimizer")
    g.add_argument("--clip-grad-norm", type=at_least(0.0, strict=True), default=None, metavar="MAX",
                   help="clip the global gradient norm to MAX once per optimizer step")
    g.add_argument("--find-unused-parameters", action="store_true",
                   help="let parameters sit out some steps (DDP's find_unused_parameters; slower)")
    g.add_argument("--sync-bn", action="store_true",
                   help="SyncBatchNorm: statistics over the global batch (CUDA); implies --drop-last")
    g.add_argument("--drop-last", action="store_true",
                   help="drop each epoch's last, partial global batch (the same samples whatever the world size)")
    g = p.add_argument_group("checkpoints and logging")
    g.add_argument("--save-every", type=at_least(0), default=0, help="also checkpoint every N steps (0: off)")
    g.add_argument("--log-seconds", type=at_least(0.0), default=30.0, metavar="S",
                   help="a progress line at least every S seconds (step, loss, throughput, ETA; 0: off)")
    g.add_argument("--save-minutes", type=at_least(0.0), default=30.0, metavar="M",
                   help="also checkpoint every M minutes (0: off), so that a hard kill loses at most about M")
    g.add_argument("--resume", default="auto",
                   help="auto: continue from OUT_DIR/checkpoint.pt if there is one; never: start over; or a path")
    g.add_argument("--init-from", metavar="PATH", help="start a new run from these weights (a model.pt)")
    g = p.add_argument_group("elastic")
    g.add_argument("--global-batch", type=at_least(1), default=None, metavar="G",
                   help="the samples of one optimizer step, whatever the world size (--batch-size: the most per "
                        "process and micro-batch): a resume on another world size (--nnodes=MIN:MAX) continues the run")
    g = p.add_argument_group("launching")
    g.add_argument("--timeout", type=at_least(0.0, strict=True), default=1800.0,
                   help="seconds to wait for peers at start and in any collective before failing (a dead peer is "
                        "noticed at once). Generous: one rank's cold compile can take minutes longer than another's")
    g.add_argument("--spawn", type=at_least(0), default=0, help="start N local processes, no launcher needed")
    # The legacy `python -m torch.distributed.launch` also passes --local-rank=N (older torch: --local_rank N).
    g.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)


@dataclasses.dataclass
class Job:
    """What the loop works with, built once by train()."""
    args: argparse.Namespace
    ctx: DistContext
    model: nn.Module  # the raw model: saved, evaluated
    ddp_model: nn.Module  # DDP(model), or the model itself in one process
    forward: nn.Module  # ddp_model, compiled with --compile
    optimizers: Optimizers  # build_optimizer's, as a list
    scaler: torch.amp.GradScaler
    state: dict  # every stateful part by name (model, optimizers, ...): what a checkpoint saves and restores
    sampler: DistributedSampler
    train_data: Loader
    eval_data: Loader | None
    global_batch: int
    steps_per_epoch: int
    total_steps: int  # the run's optimizer steps: --max-steps, or --epochs x steps_per_epoch
    flops_per_sample: float | None  # training FLOPs (forward + backward), counted on the first batch
    agreement: Agreement  # what the ranks decide together at each step: stop, log, save
    step_count: StepCount  # the step's count over all ranks: samples from the plan, tokens summed
    records: Records  # rank 0's: metrics.jsonl, TensorBoard, report()
    typical_count: float = 1.0  # the first batch's count: the scale of the sums that backward sees

    @functools.cached_property
    def params(self) -> list[nn.Parameter]:  # every trainable parameter, listed once: what the gradient steps cover
        return [p for p in self.model.parameters() if p.requires_grad]


# ====== Checkpoints and exact resume ========================================================================

CHECKPOINT_FORMAT = "ddp_train.checkpoint/3"  # /2: each stateful part under its own name; /3: optimizers, ema
RANK_STREAM = -2  # mixed with --seed and the rank: each rank's own random stream for the model


@dataclasses.dataclass
class Progress:
    """Where the run is; checkpoints carry it."""
    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0  # optimizer steps done in the current epoch
    step: int = 0  # optimizer steps done in total
    loss_sum: float = 0.0  # the current epoch's global train-loss sum and its count so far,
    samples: int = 0  # ... and samples trained, so that a resumed epoch still logs the exact means
    count: float = 0.0
    max_norm: float | None = None  # the epoch's largest gradient norm so far (before clipping)
    skipped: int = 0  # fp16: the epoch's steps that the GradScaler skipped
    best: float | None = None  # --keep-best: the best evaluation so far

    def step_done(self, samples: int):
        self.step, self.step_in_epoch, self.samples = self.step + 1, self.step_in_epoch + 1, self.samples + samples

    def next_epoch(self):  # the epoch's own fields back to their defaults
        self.__dict__.update(Progress(epoch=self.epoch + 1, step=self.step, best=self.best).__dict__)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


class RankRNG:
    """Every rank's random generators (torch, CUDA, Python, numpy) as a stateful part: state_dict()
    gathers all ranks' states (every rank calls it), load_state_dict() restores this rank's. A new
    world size fits no saved stream: each rank then gets a fresh, deterministic one."""

    def __init__(self, ctx: DistContext, seed: int, progress: Progress):
        self.ctx, self.seed, self.progress = ctx, seed, progress

    def state_dict(self) -> list[dict]:
        return everyone(rng_state(self.ctx.device), self.ctx)

    def load_state_dict(self, states: list[dict]) -> None:
        if len(states) == self.ctx.world_size:
            set_rng_state(states[self.ctx.rank], self.ctx.device)
        else:
            seed_everything(mix_seed(self.seed, RANK_STREAM, self.ctx.rank, self.progress.step))


class Optimizers(list):
    """build_optimizer's optimizer(s) as one stateful part; every trainable parameter in exactly one of them."""

    def __init__(self, built, model: nn.Module, ctx: DistContext):
        super().__init__(built if isinstance(built, (list, tuple)) else [built])
        owners = collections.Counter(id(p) for opt in self for group in opt.param_groups for p in group["params"])
        odd = [name for name, p in model.named_parameters() if p.requires_grad and owners[id(p)] != 1]
        if odd:
            fail(f"build_optimizer must give every trainable parameter to exactly one optimizer; {len(odd)} are in "
                 f"none or in several: {', '.join(odd[:5])}{', ...' if len(odd) > 5 else ''}", ctx=ctx)

    def state_dict(self) -> list[dict]:
        return [optimizer.state_dict() for optimizer in self]

    def load_state_dict(self, states: list[dict]) -> None:
        for optimizer, state in zip(self, states, strict=True):
            optimizer.load_state_dict(state)


class Checkpoints:
    """Rank 0 writes OUT_DIR/checkpoint.pt atomically, keeping the one before as checkpoint.prev.pt;
    every rank reads it onto its own device. A resumed run continues bit for bit: model, optimizer,
    schedule, loss scaler, position in the epoch, every rank's RNG states. What defines the run
    (config) must match, except --epochs, which may grow."""

    def __init__(self, args, ctx: DistContext, train_set, eval_set, global_batch: int, optimizers: Optimizers):
        self.args, self.ctx = args, ctx
        self.path, self.prev = checkpoint_paths(args.out_dir)
        # Note the global batch, not its factors: 2 processes x 32 continue exactly as 1 x 64.
        self.config = {"seed": args.seed, "lr": args.lr, "global_batch_size": global_batch,
                       "warmup_steps": args.warmup_steps, "amp": args.amp, "clip_grad_norm": args.clip_grad_norm,
                       "drop_last": args.drop_last, "init_from": args.init_from, "schedule": args.schedule,
                       "optimizers": [type(optimizer).__name__ for optimizer in optimizers], "ema": args.ema,
                       "train_samples": len(train_set), "eval_samples": len(eval_set) if eval_set else 0}
        if ctx.is_main:
            os.makedirs(args.out_dir, exist_ok=True)

    def resume(self, state: dict, steps_per_epoch: int, total_steps: int) -> bool:
        """Load the checkpoint, if any, into every stateful part; False: a finished run (model.pt written again)."""
        found, progress = load_checkpoint(self.args, self.ctx), state["progress"]
        if found:
            ckpt, path = found
            check_same_model(ckpt["model"], state["model"], path, self.ctx)
            self.check_same_run(ckpt["config"], path)
            for name, part in state.items():  # in order: "rng" reads the progress restored before it
                part.load_state_dict(ckpt[name])
            steps = everyone(progress.step, self.ctx)  # every rank read the checkpoint itself: the same one?
            if len(set(steps)) > 1:
                fail(f"ranks resumed from different checkpoints (steps {min(steps)} to {max(steps)}): every node "
                     "must see the same --out-dir (shared storage)", ctx=self.ctx)
            if progress.step >= total_steps:
                log(self.ctx, f"{path} holds a finished run ({progress.epoch} epochs, {progress.step} steps): "
                              "nothing to train. Raise --epochs or --max-steps to train on, or start over with "
                              "--resume never or another --out-dir")
                save_model(state, self.args, self.ctx)
                return False
            log(self.ctx, f"resumed from {path} at epoch {progress.epoch + 1}, step {progress.step_in_epoch}/"
                          f"{steps_per_epoch} ({progress.step} optimizer steps done, saved by world size "
                          f"{ckpt['world_size']}); the learning-rate schedule spans {total_steps} steps")
        elif self.args.init_from:
            init_weights(state["model"], self.args.init_from, self.ctx)
        return True

    def check_same_run(self, saved: dict, path: str) -> None:
        differences = [f"{key} {saved.get(key)} -> {value}" for key, value in self.config.items()
                       if saved.get(key) != value]
        if differences:
            fail(f"cannot resume from {path}: {', '.join(differences)}; rerun with the same settings (on another world "
                 "size, --global-batch keeps the global batch), or start over with --resume never or another --out-dir",
                 ctx=self.ctx)

    def save(self, job: Job) -> None:
        """All ranks: every stateful part's state (the RNG's gathers every rank's); rank 0 writes; everyone
        waits for the write."""
        state = {name: part.state_dict() for name, part in job.state.items()}  # the raw module: no prefixes
        check_finite(job.model, f"the weights after step {job.state['progress'].step}", self.ctx)
        if self.ctx.is_main:
            atomic_save({"format": CHECKPOINT_FORMAT, "config": {**self.config, "epochs": self.args.epochs},
                         "world_size": self.ctx.world_size, **state}, self.path, keep_previous=self.prev)
        wait_for_rank0(self.ctx)  # a write longer than --timeout must not look like a dead peer
        job.agreement.saved_at = time.monotonic()  # --save-minutes counts from here


def checkpoint_paths(out_dir: str) -> tuple[str, str]:
    return os.path.join(out_dir, "checkpoint.pt"), os.path.join(out_dir, "checkpoint.prev.pt")


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
    os.fsync(dir_fd)  # make the rename itself durable
    os.close(dir_fd)


def load_checkpoint(args, ctx: DistContext) -> tuple[dict, str] | None:
    """Read the checkpoint to resume from, or None for a fresh start. A checkpoint that cannot be read
    stops the run: starting fresh would write over it (checkpoint.prev.pt holds the one before)."""
    if args.resume == "never":
        return None
    path = args.resume
    if args.resume == "auto":  # checkpoint.pt, or the one before if a save stopped between its two renames
        path = next((p for p in checkpoint_paths(args.out_dir) if os.path.exists(p)), None)
        if path is None:
            return None
    elif not os.path.isfile(path):
        fail(f"--resume {path}: no such file", ctx=ctx)
    try:
        ckpt = torch.load(path, **checkpoint_load_options(ctx.device.type, path))
    except Exception as exc:
        fail(f"{path} is unreadable ({one_line(exc)[:120]}): move it away, resume from the one before with "
             f"--resume {checkpoint_paths(args.out_dir)[1]}, or pass --resume never to start over", ctx=ctx)
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        fail(f"{path} is not a checkpoint of this {PROG}: --init-from {path} starts a new run from the weights of a "
             "model.pt or an older checkpoint; or move it away, or pass --resume never to start over", ctx=ctx)
    return ckpt, path


def checkpoint_load_options(device_type: str, path: str) -> dict:
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
    return {"map_location": "cpu", "mmap": device_type != "cpu" and zipfile.is_zipfile(path), "weights_only": True}


def init_weights(model: nn.Module, path: str, ctx: DistContext) -> None:
    """--init-from: a new run starts from saved weights (a model.pt, or a checkpoint's model)."""
    try:
        saved = torch.load(path, **checkpoint_load_options(ctx.device.type, path))
    except Exception as exc:
        fail(f"--init-from {path}: cannot read it ({one_line(exc)[:120]})", ctx=ctx)
    if isinstance(saved, dict) and str(saved.get("format")).startswith("ddp_train.checkpoint/"):
        saved = saved["model"]  # a checkpoint of any version: its model
    check_same_model(saved, model, path, ctx)
    model.load_state_dict(saved)
    log(ctx, f"initialised the model from {path}")


def check_same_model(saved: dict, model: nn.Module, path: str, ctx: DistContext) -> None:
    """One line naming how build_model() differs from the saved weights (names and shapes)."""
    now = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    then = {k: tuple(v.shape) for k, v in saved.items()} if isinstance(saved, dict) else {}
    changed = [f"{k} {list(then[k])} -> {list(now[k])}" for k in now if k in then and then[k] != now[k]]
    new, gone = [k for k in now if k not in then], [k for k in then if k not in now]
    parts = [f"{len(v)} {what} ({', '.join(v[:3])}{', ...' if len(v) > 3 else ''})"
             for what, v in (("changed shape", changed), ("new", new), ("gone", gone)) if v]
    if parts:
        fail(f"the model differs from the one in {path}: {'; '.join(parts)}. Build the same model, or start over "
             "with --resume never or another --out-dir", ctx=ctx)


def rng_state(device: torch.device) -> dict:
    """This process's random generators: torch, CUDA, Python's random and numpy (as plain values, which
    a weights_only load reads)."""
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if numpy is not None:
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        rng["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def set_rng_state(rng: dict, device: torch.device) -> None:
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in rng["python"]))
    torch.set_rng_state(rng["torch"].cpu())
    if numpy is not None and "numpy" in rng:
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, gauss))
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"].cpu(), device)


def wait_for_rank0(ctx: DistContext) -> None:
    """All ranks wait here until rank 0 is done with its own work: the others for up to
    PATIENT_TIMEOUT, rank 0 (which arrives last) for --timeout only, so that a peer lost meanwhile
    is reported within --timeout, not after an hour. (monitored_barrier enforces its timeout on
    rank 0 alone; the others wait as long as the group's.)"""
    if ctx.distributed:
        dist.monitored_barrier(group=ctx.patient_group, timeout=ctx.timeout)


def check_finite(model: nn.Module, what: str, ctx: DistContext) -> None:
    """Nothing non-finite is ever written over good weights."""
    if not all(bool(p.isfinite().all()) for p in model.parameters()):
        diverged(f"{what} are not finite (nan or inf)", ctx)


def diverged(what: str, ctx: DistContext) -> None:
    fail(f"{what}: the run diverged and stopped; nothing non-finite was saved, the last checkpoint is intact. "
         "Lower --lr, or try --clip-grad-norm 1.0", code=1, ctx=ctx)


# ====== Agreeing at every step: a stop signal (preemption), and rank 0's clocks (progress lines, checkpoints) ======

EXIT_PREEMPTED = 75  # after SIGTERM or SIGUSR1, once the checkpoint is saved: EX_TEMPFAIL, "run again"
EXIT_INTERRUPTED = 130  # after Ctrl-C (SIGINT), once the checkpoint is saved: the shell's convention
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Agreement:
    """What every rank decides together after each optimizer step: stop (a signal: SIGTERM and SIGUSR1,
    which torchrun, Kubernetes and SLURM's --signal send, or Ctrl-C), log a progress line, save a
    checkpoint (rank 0's clocks: --log-seconds, --save-minutes). Logging and saving are collectives, and
    the ranks' clocks and signals disagree, so each rank's flags() are summed over all ranks by a vote:
    an all-reduce over gloo that one step starts and a later one reads, long done by then (it never waits
    on the network or a GPU). A vote costs about a millisecond on gloo (a third of a small model's step
    on 2 CPU cores), so rank 0 proposes in each vote how many steps until the next: about VOTE_SECONDS at
    its pace, at most VOTE_STEPS (a pace that changes cannot put a vote far off). What was due comes at
    most about two votes later. A signal handler only sets a flag (trap: a collective inside a handler
    deadlocks). A second Ctrl-C, a second or more after the first, stops at once, without saving."""

    VOTE_SECONDS, VOTE_STEPS = 0.25, 10

    def __init__(self, ctx: DistContext, args):
        self.ctx, self.args, self.received, self.received_at, self.pending = ctx, args, 0, 0.0, None
        self.flag, self.next_vote, self.gap, self.voted = None, 0, 1, None  # voted: (step, time)
        self.logged_at = self.saved_at = time.monotonic()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)
        self.step = 0  # the last finished optimizer step, which the watchdog (--stall-seconds) reads
        threading.Thread(target=watchdog, args=(self, args, ctx), daemon=True).start()

    def _handler(self, signum, frame):
        # A launcher that forwards the terminal's Ctrl-C delivers it twice within moments: that is one.
        if signum == signal.SIGINT and self.received == signal.SIGINT and time.monotonic() - self.received_at > 1:
            raise KeyboardInterrupt
        if not self.received:
            self.received, self.received_at = signum, time.monotonic()

    def flags(self) -> list[float]:
        """This rank's say: a stop signal; on rank 0, whether a progress line and a checkpoint are due."""
        now, clock = time.monotonic(), self.ctx.is_main
        log_due = clock and self.args.log_seconds > 0 and now - self.logged_at >= self.args.log_seconds
        save_due = clock and self.args.save_minutes > 0 and now - self.saved_at >= 60 * self.args.save_minutes
        return [float(self.received != 0), float(log_due), float(save_due)]

    def decide(self, step: int) -> tuple[bool, bool, bool]:
        """(stop, log, save) after optimizer step `step`: the same on every rank. --save-every counts
        steps, which the ranks agree on without asking."""
        self.step, voting = step, step >= self.next_vote  # the votes say when the next one is: the same on every rank
        stop, log_now, save_due = (total > 0 for total in self.last_vote()) if voting else (False,) * 3
        save_now = save_due or bool(self.args.save_every and step % self.args.save_every == 0)
        if log_now:
            self.logged_at = time.monotonic()
        if save_now or stop:
            self.saved_at = time.monotonic()
        if voting:
            self.vote(step)  # after the clocks were reset: what was due is not voted for again
        return stop, log_now, save_now

    def last_vote(self) -> list[float]:
        """All ranks' flags as the last vote summed them (this rank's own now, in one process)."""
        if not self.ctx.distributed:
            return self.flags()
        if self.pending is None:
            return [0.0] * 3
        self.close()
        *flags, gap = self.flag.tolist()
        self.gap = max(1, int(gap))  # rank 0's proposal (the others sent 0)
        return flags

    def vote(self, step: int) -> None:
        """Start summing this rank's flags over all ranks, read at the next vote, `gap` steps from here.
        Rank 0 proposes the gap after that one: about VOTE_SECONDS at the pace of the steps since its last."""
        if not self.ctx.distributed:
            return
        now, gap = time.monotonic(), 0
        if self.ctx.is_main and self.voted:
            per_step = (now - self.voted[1]) / (step - self.voted[0])
            gap = max(1, min(self.VOTE_STEPS, int(self.VOTE_SECONDS / max(per_step, 1e-6))))
        self.voted, self.next_vote = (step, now), step + self.gap
        self.flag = torch.tensor([*self.flags(), float(gap)])
        self.pending = dist.all_reduce(self.flag, group=self.ctx.control_group, async_op=True)  # SUM

    def close(self) -> None:
        """Wait for the last agreement still on the wire (before the process group goes)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def stopped(self, progress: Progress, out_dir: str) -> int:
        """The checkpoint is saved: say so, and return the exit code."""
        self.close()
        code = EXIT_INTERRUPTED if self.received == signal.SIGINT else EXIT_PREEMPTED
        log(self.ctx, f"stopped by a signal at step {progress.step}: {os.path.join(out_dir, 'checkpoint.pt')} saved; "
                      f"rerun the same command to continue (exit code {code})")
        return code


def explain_failure(exc: BaseException, ctx: DistContext, agreement: Agreement) -> None:
    """The ends that deserve one line instead of a traceback from every rank."""
    # The traceback holds train()'s frames, and with them the DDP model and the DataLoader
    # workers: drop them, so that teardown can release those first.
    chained = exc
    while chained is not None:
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__context__
    gloo = isinstance(exc, RuntimeError) and ("gloo" in str(exc) or "timeout" in str(exc))  # gloo's own errors
    lost_a_peer = isinstance(exc, dist.DistError) or gloo  # a collective failed: a rank is gone, or hung past --timeout
    if isinstance(exc, KeyboardInterrupt) or (agreement.received == signal.SIGINT and lost_a_peer):
        log(ctx, f"{PROG}: stopped by a second Ctrl-C, without saving; rerun the same command to continue from "
                 "the last checkpoint", error=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    if ctx.distributed and lost_a_peer:  # say what happened, not where we were waiting
        fail(f"rank {ctx.rank} lost contact with another process (it crashed, hung past --timeout, was killed, or its "
             f"node left the network); rerun to resume from the last checkpoint. The error: {one_line(exc)}", code=1)


# ====== When a run hangs: which rank, where, and why =========================================================

# What a rank does: the innermost of these on its main thread's stack ("waiting": for the other ranks).
PLACES = {"call_compute_loss": "in compute_loss", "batches": "loading data", "evaluate": "evaluating",
          "atomic_save": "saving", "train_step": "waiting in backward: the gradient all-reduce", "fold": "waiting in "
          "the loss all-reduce", "last_vote": "waiting in the vote", "wait_for_rank0": "waiting for rank 0"}


def watchdog(agreement: Agreement, args, ctx: DistContext) -> None:
    """--stall-seconds S, a thread in every rank: S seconds without an optimizer step, each rank writes its
    threads' stacks to OUT_DIR/stall/rank{R}.txt and posts its step and place to the process group's TCP store
    (which answers when collectives do not); rank 0 prints one report. Nothing per step; the run waits on."""
    last, since = -1, time.monotonic()
    while args.stall_seconds:  # (0: off)
        time.sleep(min(1.0, args.stall_seconds / 10))
        if agreement.step != last:
            last, since, reported = agreement.step, time.monotonic(), False
        elif not reported and time.monotonic() - since >= args.stall_seconds:
            reported = True
            report_stall(last, time.monotonic() - since, args, ctx)


def report_stall(step: int, seconds: float, args, ctx: DistContext) -> None:
    path = os.path.join(args.out_dir, "stall", f"rank{ctx.rank}.txt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        faulthandler.dump_traceback(f, all_threads=True)
    stack = traceback.extract_stack(sys._current_frames()[threading.main_thread().ident])
    place = next((PLACES[f.name] for f in reversed(stack) if f.filename == __file__ and f.name in PLACES), "")
    inner = stack[-1].filename  # your code innermost (a hook, a forward) is where it is; torch's collectives wait
    if place.startswith("waiting") and not inner.startswith(os.path.dirname(torch.__file__)):
        place = ""
    elif any(part in inner for part in ("torch/distributed", "torch/nn/parallel")) and not place.startswith("waiting"):
        place = f"waiting in a collective, {place}"
    where = f"{place or 'in ' + stack[-1].name} ({os.path.basename(stack[-1].filename)}:{stack[-1].lineno})"
    ranks = [{"rank": ctx.rank, "step": step, "place": where, "stacks": path}]
    if ctx.distributed:  # a client of the store that init_process_group used (env://)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        prefix = f"ddp_train/stall/{os.environ.get('TORCHELASTIC_RESTART_COUNT')}/{step}"  # this attempt, this step
        keys = [f"{prefix}/{r}" for r in range(ctx.world_size)]
        store.set(keys[ctx.rank], json.dumps(ranks[0]))
        if not ctx.is_main:
            return
        with contextlib.suppress(dist.DistError):  # the others fire about when rank 0 does
            store.wait(keys, datetime.timedelta(seconds=15))
        ranks = [json.loads(store.get(k)) if store.check([k]) else dict(rank=r, step="?", place="no answer", stacks="")
                 for r, k in enumerate(keys)]
    ranks.sort(key=lambda r: r["place"].startswith("waiting"))  # the ones the others wait for first
    log(ctx, f"{PROG}: stall: no optimizer step for {seconds:.0f} s. Rank {ranks[0]['rank']} holds the others up: "
             f"{ranks[0]['place']}; its stacks: {ranks[0]['stacks']}\n"
             + "\n".join(f"  rank {r['rank']}: last step {r['step']}, {r['place']}" for r in ranks), error=True)


# ====== Deterministic data loading: a sample's randomness is a function of (seed, epoch, index) =============

try:  # optional; when present, a Dataset's numpy randomness is seeded like torch's
    import numpy
except ImportError:
    numpy = None

EVAL_EPOCH = -1  # evaluation's own data seeds: the same in every epoch


class Loader:
    """Batches of a Dataset on the device. Every sample's randomness (its augmentation) depends
    only on (--seed, epoch, sample index), whatever the worker count, the world size, the order in
    which workers take batches, or where a run resumed."""

    def __init__(self, dataset: Dataset, batch_size: int, ctx: DistContext, workers: int, seed: int):
        self.dataset, self.batch_size, self.ctx = dataset, batch_size, ctx
        # The DataLoader's batch sampler: the batches of the next pass, set before each (it iterates the list).
        self.samples, self.plan, self.loader, self.waited = SeededSamples(dataset, seed), [], None, 0.0
        on_gpu = ctx.device.type == "cuda"
        if in_memory(dataset):  # no workers needed: a batch is one index gather
            return
        if workers < 0:  # by default none on the CPU (they would take the cores training needs), a few on a
            workers = min(4, max(1, process_cpus(ctx) - 1)) if on_gpu else 0  # GPU: a core each, one for training
        if workers > 0:
            # Workers started once, not every epoch (persistent); a private generator for the
            # loader's base seed, because the global one belongs to the model (dropout).
            self.loader = DataLoader(self.samples, batch_sampler=self.plan, num_workers=workers,
                                     persistent_workers=True, pin_memory=on_gpu, collate_fn=collate,
                                     worker_init_fn=leave_signals_to_trainer, generator=torch.Generator())

    def first_batch(self) -> tuple[object, int]:
        """The training set's first micro-batch (samples 0, 1, ... of epoch 0), and its sample count."""
        indices = list(range(min(self.batch_size, len(self.dataset))))
        return next(self.batches([indices], 0)), len(indices)

    def batches(self, micro_batches: list[list[int]], epoch: int):
        """Yield the batches of `epoch` made of these sample indices, in order."""
        if in_memory(self.dataset):
            # In-memory tensors: gather a whole batch with one index op instead of collating samples.
            tensors = self.dataset.tensors
            flat = torch.tensor([i for rows in micro_batches for i in rows], device=tensors[0].device)
            for rows in flat.split([len(rows) for rows in micro_batches]):
                yield tuple(t[rows] for t in tensors)  # on the device already (place_dataset)
            return
        self.plan[:] = [[(epoch, i) for i in rows] for rows in micro_batches]
        loaded = iter(self.loader) if self.loader else (load_here(self.samples, b) for b in self.plan)
        clock = time.perf_counter()
        for batch in loaded:  # (an exception in a worker comes here with the worker's traceback in its message)
            self.waited += time.perf_counter() - clock  # for the stragglers' figures: the time spent waiting for data
            if isinstance(batch, Unbatchable):
                fail(f"cannot batch the items of {type(self.dataset).__name__}: {batch}", ctx=self.ctx)
            yield to_device(batch, self.ctx.device)
            clock = time.perf_counter()


def in_memory(dataset) -> bool:
    """Exactly a TensorDataset (a subclass may augment in its own __getitem__), batched by stacking."""
    return type(dataset) is TensorDataset and collate_fn is default_collate


class SeededSamples(Dataset):
    """The user's Dataset, seeded per sample: before sample i of epoch e loads (its key is (e, i)),
    each global generator it may draw from (torch, Python's random, numpy) is seeded from (seed, e, i).
    That costs about 8 us a sample on a 2-core machine (torch's 2, random's 5, numpy's 1), whether or not
    the Dataset draws: one rule, and no batch is ever loaded twice."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed, self.epoch_seeds = dataset, seed, {}

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:
        """One batch's items (the DataLoader calls this, in a worker or here)."""
        items = []
        for epoch, index in keys:  # the hot loop: a few us per sample, on top of the Dataset's own
            if epoch not in self.epoch_seeds:
                self.epoch_seeds[epoch] = mix_seed(self.seed, epoch) >> 1  # + index stays below 2**64
            s = self.epoch_seeds[epoch] + index  # consecutive seeds are fine: each generator mixes its own
            torch.default_generator.manual_seed(s)  # not torch.manual_seed: 100x slower, it visits every device
            random.seed(s)
            if numpy is not None:
                numpy.random.seed(s & 0xFFFFFFFF)  # 32 bits: per index within an epoch
            items.append(self.dataset[index])
        return items


def load_here(samples: SeededSamples, keys: list) -> object:
    """One batch loaded in the training process (no workers). Trap: the per-sample seeding must not
    reach the training process's own generators (dropout, and whatever compute_loss draws: a mixup's
    random.random()), so all of them are put back as they were."""
    state = rng_state(torch.device("cpu"))
    try:
        return collate(samples.__getitems__(keys))
    finally:
        set_rng_state(state, torch.device("cpu"))


def my_share(sampler: DistributedSampler, ctx: DistContext) -> list[int]:
    """This rank's sample indices for the sampler's current epoch."""
    # Trap: DistributedSampler pads with repeated samples so that every rank gets as many: they would
    # be trained twice and counted twice in metrics. The real ones come first: keep only those.
    return list(sampler)[: len(range(ctx.rank, len(sampler.dataset), ctx.world_size))]


class StepCount:
    """DDP: the step's count (what compute_loss's losses sum over) over all ranks.
    - Samples (COUNT_UNIT = "samples"): every rank knows it from the plan, so no rank sends anything.
      That compute_loss really counts samples is checked on the first batch (warm_up) and at every fold.
    - Any other unit (tokens): one small all-reduce, started before the step's last backward and waited
      for after it: it runs while backward computes, ahead of the gradient buckets. On a GPU the count
      stays there: no host-device sync in a step."""

    def __init__(self, ctx: DistContext):
        self.ctx, self.count, self.work = ctx, 0, None

    def start(self, count, samples: int) -> None:
        """This rank's count of the step, before the step's last backward; samples: the step's, all ranks'."""
        self.count = count
        if COUNT_UNIT == "samples":
            self.count = samples
        elif self.ctx.distributed:
            self.count = count_tensor(count, self.ctx.device)
            self.work = dist.all_reduce(self.count, async_op=True)  # SUM

    def total(self):
        """The step's count over all ranks: a number, or on a GPU a float64 tensor there (no host sync)."""
        if self.work is not None:
            self.work.wait()  # on a GPU: the stream waits, not the host
            self.work = None
        return float(self.count) if self.ctx.device.type == "cpu" or not torch.is_tensor(self.count) else self.count


def count_tensor(count, device: torch.device) -> torch.Tensor:
    """A count (an int, a float or a 0-dim tensor) as a float64 0-dim tensor on the device, to all-reduce.
    Trap: torch.tensor(n, device="cuda") copies from pageable memory and so waits for all queued GPU
    work (tensor_new.cpp -> copy_kernel_cuda -> memcpy_and_sync); torch.full writes it there instead."""
    if torch.is_tensor(count):
        return count.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.full((), float(count), dtype=torch.float64, device=device)


def check_count_unit(count: float, samples: int, ctx: DistContext) -> None:
    """With COUNT_UNIT = "samples" the gradient's mean divides by the plan's sample count, not by what
    compute_loss returned: the two must agree."""
    if COUNT_UNIT == "samples" and count != samples:
        fail(f"compute_loss counted {whole(count)} for {samples} samples, but COUNT_UNIT is \"samples\": return the "
             "batch's sample count, or set COUNT_UNIT to what your count counts (ddp_train.COUNT_UNIT = \"tokens\")",
             ctx=ctx)


def whole(x: float):
    """A count as JSON shows it best: an int when it is whole (tokens), else the float (weights)."""
    return int(x) if float(x).is_integer() else x


def count_steps(num_samples: int, global_batch: int, args, ctx: DistContext) -> int:
    """Optimizer steps per epoch: the last one short, or with --drop-last (which --sync-bn implies) only
    full ones. SyncBatchNorm runs collectives of its own in every forward and backward, so every rank
    must run as many micro-batches as every other in every step: only full steps give them that."""
    if args.sync_bn and ctx.distributed and not args.drop_last:
        args.drop_last = True
        log(ctx, f"--sync-bn: every step is a full global batch, as with --drop-last (the last "
                 f"{num_samples % global_batch} sample(s) of each epoch sit out), so that every rank runs "
                 "SyncBatchNorm's collectives alike")
    if args.global_batch and args.grad_accum != 1:
        fail("--global-batch fixes the samples of a step and --grad-accum follows from it and the world size: pass "
             "one of them", ctx=ctx)
    if global_batch % ctx.world_size:
        fail(f"--global-batch {global_batch} is split evenly over the ranks, so the world size ({ctx.world_size}) "
             "must divide it", ctx=ctx)
    if args.ema is not None and args.ema >= 1:
        fail(f"--ema {args.ema:g}: the decay is below 1 (0.999 keeps about the last 1000 steps)", ctx=ctx)
    if args.drop_last and num_samples < global_batch:
        fail(f"--drop-last: the {num_samples} training samples do not fill one global batch of {global_batch}", ctx=ctx)
    return num_samples // global_batch if args.drop_last else math.ceil(num_samples / global_batch)


def check_batchnorm_batch_sizes(model: nn.Module, num_samples: int, global_batch: int, steps: int, args,
                                ctx: DistContext) -> None:
    """Trap: BatchNorm cannot train on one sample ("Expected more than 1 value per channel"), and the
    last step of an epoch can leave a rank one. Stop before training, on every rank alike, and say so."""
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    per_rank = global_batch // ctx.world_size
    for rank in range(ctx.world_size):
        share = len(range(rank, num_samples, ctx.world_size))  # what DistributedSampler deals this rank
        for where, n in (("every step", per_rank), ("the last step", min(per_rank, share - (steps - 1) * per_rank))):
            if 1 in (len(b) for b in split(range(max(0, n)), args.batch_size)):
                fix = ("raise --batch-size" if where == "every step" else f"pass --drop-last to leave out the last "
                       f"{num_samples % global_batch} sample(s) of each epoch ({num_samples} samples, global batch "
                       f"{global_batch}), or change --batch-size")
                fail(f"BatchNorm cannot train on a micro-batch of one sample, and {where} of each epoch would give "
                     f"rank {rank} one: {fix}", ctx=ctx)


def plan_steps(mine: list[int], job: Job) -> list[list[list[int]]]:
    """This rank's micro-batches in each step of the epoch. Step s trains the samples at [s, s + 1) x
    global batch of the epoch's shuffle, which DistributedSampler deals out round-robin: this rank's
    share of them is the same stretch of `mine`. (One process: all of them, in the same order.)"""
    per_rank = job.global_batch // job.ctx.world_size
    return [split(mine[s * per_rank : (s + 1) * per_rank], job.args.batch_size) for s in range(job.steps_per_epoch)]


def split(indices: list[int], most: int) -> list[list[int]]:
    """`indices` in as few batches of at most `most` as can hold them, their sizes differing by one at
    most: 65 samples at 64 are 33 + 32, never 64 + 1 (BatchNorm cannot train on one sample)."""
    n = math.ceil(len(indices) / most)
    bounds = [len(indices) * i // n for i in range(n + 1)] if n else []
    return [indices[a:b] for a, b in zip(bounds, bounds[1:])]


def zero_gradient_backward(ddp_model: nn.Module, step_count: StepCount, samples: int) -> None:
    """A forward and backward through DDP that reads no data and contributes zero gradients, with a
    count of 0, so that a rank without samples in a step still takes part in its collectives, in the
    order every other rank runs them: the forward's buffer broadcast, the count, the gradient buckets.
    The model's forward is swapped for one that uses every parameter and no randomness."""
    module = ddp_model.module
    params = [p for p in module.parameters() if p.requires_grad]
    module.forward = lambda *_: sum(p.sum() for p in params) * 0.0
    try:
        zero = ddp_model(torch.zeros(()))  # Trap: with device_ids (CUDA), DDP's forward needs an input to move
    finally:
        del module.forward  # back to the class's own forward
    step_count.start(0, samples)
    zero.backward()


def seed_everything(seed: int) -> None:
    """Seed torch (every device), Python's random and numpy."""
    torch.manual_seed(seed)
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def mix_seed(*parts: int) -> int:
    """A well-mixed 64-bit seed from integers: the same in every process, machine and version."""
    return random.Random(repr(parts)).getrandbits(64)  # a str seeds through SHA-512: no hash randomisation


def check_datasets(train_set: Dataset, eval_set: Dataset | None, args, ctx: DistContext) -> None:
    """Map-style Datasets, the same on every rank (each built its own: a cheap check, their lengths), and an
    eval set where --keep-best or --eval-every needs one."""
    if (args.keep_best or args.eval_every) and eval_set is None:
        fail(f"{'--keep-best' if args.keep_best else '--eval-every'}: there is no eval set to evaluate", ctx=ctx)
    for name, data in (("train", train_set), ("eval", eval_set)):
        if isinstance(data, IterableDataset) or (data is not None and not hasattr(data, "__getitem__")):
            fail(f"build_datasets returned an IterableDataset ({type(data).__name__}) as the {name} set: {PROG} needs "
                 "map-style Datasets (__len__ and __getitem__) for its sampler, exact resume and N x B == 1 x N*B; "
                 "index your samples (a list of token files, a memory-mapped array) instead of streaming them", ctx=ctx)
    trains, evals = zip(*everyone((len(train_set), len(eval_set) if eval_set is not None else 0), ctx))
    if len(set(trains)) > 1 or len(set(evals)) > 1:
        fail(f"the ranks built different datasets ({min(trains)} to {max(trains)} training samples, {min(evals)} to "
             f"{max(evals)} evaluation samples): build_datasets must give every rank the same data (split with a "
             "seeded generator, from storage every node sees)", ctx=ctx)


def leave_signals_to_trainer(worker_id: int) -> None:
    """DataLoader worker_init_fn. torchrun, scancel and terminals signal whole process groups, and a
    worker exits on a SIGTERM its parent did not send, which kills the trainer before it can save.
    The stop signals are the training process's to handle."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class Unbatchable(str):
    """What collate() returns for items that cannot be batched, and why: a value, not an exception, so
    that it reaches the trainer from a DataLoader worker as it is, and the run stops with one line."""


def collate(items: list):
    """collate_fn(items), looked up when called: yours, assigned on this module, in workers too."""
    try:
        return collate_fn(items)
    except Exception as exc:
        if collate_fn is not default_collate:
            return Unbatchable(f"your collate_fn raised {type(exc).__name__}: {one_line(exc, last=True)}")
        return Unbatchable(f"{one_line(exc, last=True)}. __getitem__ should return tensors, numbers or strings, or "
                           "tuples, lists and dicts of them, with the same shapes for every item; items of different "
                           "shapes need a collate_fn of yours that pads them")


def to_device(batch, device: torch.device):
    """Move a batch to the device: tensors, in any nesting of tuples, lists and dicts."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)  # namedtuples too
    return batch


def place_dataset(dataset: Dataset | None, ctx: DistContext) -> Dataset | None:
    """In-memory tensor datasets move to the GPU once, so that batches never cross PCIe. (Data larger
    than GPU memory belongs in a Dataset that loads on demand, read through the DataLoader.)"""
    if in_memory(dataset) and ctx.device.type == "cuda":  # only what the Loader reads without workers
        return TensorDataset(*(t.to(ctx.device) for t in dataset.tensors))
    return dataset


@contextlib.contextmanager
def rank0_first(local: bool = False):
    """Rank 0 (local=True: the first process of each node) runs the body first, say to download or
    build a cache, while the others wait for up to PATIENT_TIMEOUT; then the others run it."""
    group = dist.new_group(backend="gloo", timeout=PATIENT_TIMEOUT) if dist.is_initialized() else None  # all ranks
    first = group is None or (int(os.environ.get("LOCAL_RANK", 0)) if local else dist.get_rank()) == 0
    if not first:
        dist.barrier(group=group)
    yield
    if first and group is not None:
        dist.barrier(group=group)


# ====== Launcher adapters: SLURM, the legacy launcher and --spawn speak torchrun's environment ==============


def adopt_launcher_environment(args) -> str:
    """Name the launcher, and give the ones that do not set torchrun's variables those variables."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (torch.distributed.launch is it too), --spawn's workers
        return "spawn" if args.spawn else "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
    # A bare `srun python ddp_train.py`: srun sets SLURM_STEP_* for its tasks; an sbatch script running
    # python directly sees the job's SLURM_NTASKS, but it is one process, not a task. The step's own
    # variables win over the job's: a step may run on part of the allocation.
    if "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        world = env["SLURM_STEP_NUM_TASKS"]
        env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=world, LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
                   LOCAL_WORLD_SIZE=str(tasks_on_this_node(env.get("SLURM_STEP_TASKS_PER_NODE", world),
                                                           int(env.get("SLURM_NODEID", "0")))))
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        env.setdefault("MASTER_ADDR", first_slurm_host(nodes or "localhost"))
        # Every task derives the same port from the job id, so that two jobs on one node don't collide.
        env.setdefault("MASTER_PORT", str(15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        return "slurm"
    return "python"


def tasks_on_this_node(tasks_per_node: str, node: int) -> int:
    """SLURM_STEP_TASKS_PER_NODE lists every node's task count ('2(x2),1' -> 2, 2, 1); pick this node's.
    It is always set, while SLURM_NTASKS_PER_NODE exists only when --ntasks-per-node was given."""
    counts = []
    for count, times in re.findall(r"(\d+)(?:\(x(\d+)\))?", tasks_per_node):
        counts += [int(count)] * int(times or 1)
    return counts[min(node, len(counts) - 1)]


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    head = re.match(r"[^,\[]*(\[[^\]]*\])?", nodelist).group(0)  # 'gpu[07-09,12]'
    if "[" not in head:
        return head
    prefix, ranges = head[:-1].split("[")
    return prefix + re.split(r"[,-]", ranges)[0]


def gpu_of(ctx: DistContext) -> torch.device:
    """This process's GPU, or one line saying why it has none of its own."""
    choice = choose_gpu(ctx.local_rank, ctx.local_world_size, torch.cuda.device_count(), ctx.launcher,
                        os.environ.get("CUDA_VISIBLE_DEVICES"))
    if isinstance(choice, str):
        fail(choice, ctx=ctx)
    return torch.device("cuda", choice)


def choose_gpu(local_rank: int, local_world_size: int, visible: int, launcher: str,
               cuda_visible_devices: str | None) -> int | str:
    """The index of this process's GPU among the visible ones, or why there is none (one line). Every
    local process must drive a GPU of its own: NCCL refuses two ranks on one ("Duplicate GPU").
    - As many visible GPUs as local processes, or more: cuda:LOCAL_RANK (torchrun, --spawn, the legacy
      launcher, srun --gpus-per-node=8 --gpu-bind=none, where every task sees the node's GPUs).
    - Fewer: only SLURM's per-task binding makes that right (srun --gpus-per-task=1: each task sees
      just its own, as cuda:0). Anything else, torchrun --nproc_per_node=2 on a one-GPU machine say,
      would put two processes on one GPU."""
    if local_rank < visible and local_world_size <= visible:
        return local_rank
    if launcher == "slurm" and 0 < visible < local_world_size:
        return 0
    return (f"every process on this node needs a GPU of its own, but LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE="
            f"{local_world_size} sees {visible} (CUDA_VISIBLE_DEVICES={cuda_visible_devices or '<unset>'}): start at "
            f"most {visible} process(es) per node, or give each process its own GPU (srun --gpus-per-task=1)")


def process_cpus(ctx: DistContext) -> int:
    """The CPU cores this process may use (see cpus_per_process)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cpus_per_process(cores, ctx.local_world_size, ctx.launcher, os.environ.get("SLURM_CPUS_PER_TASK"))


def cpus_per_process(affinity: int, local_world_size: int, launcher: str, slurm_cpus_per_task: str | None) -> int:
    """Divide only what the processes share. A task that srun started with --cpus-per-task has that
    many cores of its own (SLURM binds them: its affinity already is its share); the workers of
    torchrun, --spawn or the legacy launcher share the cores their launcher had, as do srun tasks
    without --cpus-per-task."""
    if launcher == "slurm" and slurm_cpus_per_task:
        return max(1, min(affinity, int(slurm_cpus_per_task)))
    return max(1, affinity // max(1, local_world_size))


def set_up_process(args, ctx: DistContext) -> None:
    """Threads: this process's cores, unless the user chose (OMP_NUM_THREADS). --debug, before the process
    group starts: DDP's and c10d's checks (TORCH_DISTRIBUTED_DEBUG: mismatched collectives, unused parameters
    by name), NCCL's log, C++ stack traces; every rank but 0 writes its stderr to OUT_DIR/debug/rank{R}.log."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(process_cpus(ctx))
    if args.debug:  # INFO: DETAIL made torch 2.13's CPU build segfault while building DDP; yours wins if you set it
        os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "INFO")
        os.environ.update(TORCH_SHOW_CPP_STACKTRACES="1", NCCL_DEBUG="INFO")
        dist.set_debug_level_from_env()  # torch.distributed read the variable when it was imported
        if ctx.rank:  # its stderr (fd 2, where C++ and NCCL log too) becomes the file
            os.makedirs(debug := os.path.join(args.out_dir, "debug"), exist_ok=True)
            os.dup2(os.open(os.path.join(debug, f"rank{ctx.rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    if torch.cuda.is_available():  # NCCL's flight recorder: the collectives in flight, dumped on a timeout
        for name, value in flight_recorder_env(args.out_dir).items():
            os.environ.setdefault(name, value)


def flight_recorder_env(out_dir: str) -> dict:
    """NCCL's flight recorder: each rank keeps its last 2000 collectives and dumps them on a timeout to
    OUT_DIR/nccl_trace_rank_{R} (in the out-dir, which exists: the recorder makes no directory). Both spellings:
    torch 2.4 reads TORCH_NCCL_* alone, newer versions TORCH_FR_* too (seen in 2.15's library)."""
    prefix, env = os.path.join(out_dir, "nccl_trace_rank_"), {}
    for new, old, value in (("BUFFER_SIZE", "TRACE_BUFFER_SIZE", "2000"), ("DUMP_ON_TIMEOUT", "DUMP_ON_TIMEOUT", "1"),
                            ("DUMP_TEMP_FILE", "DEBUG_INFO_TEMP_FILE", prefix)):
        env[f"TORCH_FR_{new}"] = env[f"TORCH_NCCL_{old}"] = value
    return env


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
        # After a failure the others get 15 s to end on their own (torch >= 2.6; before, they are stopped at once).
        grace = {"grace_period": 15} if "grace_period" in inspect.signature(context.join).parameters else {}
        while not context.join(**grace):
            pass
    except mp.ProcessExitedException as exc:
        return exc.exit_code if exc.exit_code > 0 else 1
    return 0


def _spawn_worker(local_rank: int, args) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                      WORLD_SIZE=str(args.spawn), LOCAL_WORLD_SIZE=str(args.spawn))
    # A spawned process inherits "spawn" as its default start method, so its DataLoader workers would
    # each start a fresh interpreter; give it the platform's default, as a torchrun worker has.
    mp.set_start_method(None, force=True)
    code = run(args)
    if code:
        raise SystemExit(code)


# ====== Upstream workarounds: each names the issue and the torch versions that need it ======================

PATIENT_TIMEOUT = datetime.timedelta(hours=1)  # how long ranks wait for rank 0's own work


def rendezvous(world: int, timeout: datetime.timedelta) -> dict:
    """How init_process_group finds its peers: MASTER_ADDR and MASTER_PORT, except under torchrun restarts.
    torch >= 2.5 (seen through 2.13): torchrun's agent keeps one TCPStore for the whole job, and its
    workers' keys carry no restart number, so after `--max-restarts` restarts the new workers can
    read the dead ones' addresses and fail to connect (pytorch/pytorch#135712). Give every restart
    its own namespace. TORCHELASTIC_RESTART_COUNT agrees within a node; across nodes, launch torchrun
    with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (run_multi_node.sh does), which skips this."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {"init_method": "env://"}
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size=world, is_master=False,
                          timeout=timeout)
    return {"store": dist.PrefixStore(f"ddp_train/restart_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)}


def warm_up(job: Job) -> None:
    """The first batch once forward and backward through DDP before training, leaving no trace (RNG,
    BatchNorm statistics, gradients). DDP (every version) rebuilds its gradient buckets after its first
    backward, in the order the gradients arrived: from a real batch that is the model's own order, so
    that buckets all-reduce while backward still runs; and since every run, fresh or resumed, then
    starts training on rebuilt buckets, the all-reduce rounds the same (bit-exact resume with more
    than two ranks). It also checks that every parameter gets a gradient, and notes the batch's count."""
    with preserved_state(job.model, job.ctx):
        batch, samples = job.train_data.first_batch()  # the same samples on every rank
        with autocast(job.args, job.ctx):
            loss_sum, count, _ = call_compute_loss(job.ddp_model, batch, job.ctx)
        loss_sum.backward()
        check_every_parameter_got_a_gradient(job)
    check_count_unit(float(count), samples, job.ctx)
    job.train_data.waited = 0.0  # training's waits for data only: not the first batch's loads, nor workers' start
    job.typical_count = float(count) if float(count) > 0 else 1.0
    if job.ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(job.ctx.device)  # peak_gpu_mem_mb: training's, not resuming's


# ====== Statistics: the exact global loss, gradient norms, divergence, throughput, memory, FLOP/s ===========


class EpochStats:
    """This rank's training loss sums, counts and gradient norms since the last fold, kept on the
    device (no host sync per step). fold() adds every rank's into the epoch's totals, and stops the
    run, on every rank, at the first non-finite loss or gradient norm. With fp16 a non-finite norm
    is a step that the GradScaler skipped by design: those are counted, and kept out of the maximum.
    For the stragglers, each rank times its waits for data (the Loader) and its compute: from its model's forward
    (after DDP's buffer broadcast) to compute_loss's end; not backward, whose all-reduce waits for the slowest rank."""

    def __init__(self, ctx: DistContext, amp: str, loader: Loader | None = None, model: nn.Module | None = None):
        self.ctx, self.fp16, self.loader, self.timing = ctx, amp == "fp16", loader, [0.0] * 2 * ctx.world_size
        self.step_losses, self.norms, self.count, self.current = [], [], 0, None
        self.last_norm, self.first_step_at, self.forward_at, self.computing, self.computed = None, None, None, [], 0.0
        self.loop_started, self.first_step, self.zero = time.perf_counter(), None, torch.zeros((), device=ctx.device)
        if model is not None:  # (a graph break under torch.compile: dynamo would trace the CUDA event into its graph)
            model.register_forward_pre_hook(torch.compiler.disable(self.forward_starts))

    def start_epoch(self, progress: Progress) -> None:
        # (time, samples, count, loss sum, timing) when the epoch began, and at the last progress line
        self.began = self.line = (time.perf_counter(), progress.samples, progress.count, progress.loss_sum, self.timing)
        self.first_step = progress.step if self.first_step is None else self.first_step

    def forward_starts(self, model: nn.Module, inputs) -> None:  # the model's forward pre-hook: compute starts
        self.forward_at = self.stamp()

    def stamp(self):
        """Now: on CUDA an event recorded in the stream (read at the next fold: no sync in a step), else the clock."""
        if self.ctx.device.type == "cuda":
            return torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
        return time.perf_counter()

    def add(self, loss_sum: torch.Tensor, count) -> None:
        loss = loss_sum.detach()
        self.current = loss if self.current is None else self.current + loss
        self.count = self.count + count
        if self.forward_at is not None:  # this rank's compute: from its model's forward to the end of compute_loss
            self.computing.append((self.forward_at, self.stamp()))
            self.forward_at = None  # so an add() with no forward of the model since the last one times nothing

    def end_step(self, grad_norm: torch.Tensor) -> None:
        """grad_norm: the step's gradient norm before clipping (0-dim)."""
        self.step_losses.append(self.current if self.current is not None else self.zero)
        self.current = None
        self.norms.append(grad_norm)
        if self.first_step_at is None:  # start-up cost, once: when the first step has really finished
            if self.ctx.device.type == "cuda":
                torch.cuda.synchronize(self.ctx.device)
            self.first_step_at = time.time()

    def fold(self, progress: Progress) -> None:
        """All ranks: add the sums since the last fold into the epoch's global totals."""
        world, cuda = self.ctx.world_size, self.ctx.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.ctx.device)  # the compute events, read now (the sums below wait for it anyway)
        self.computed += sum(start.elapsed_time(end) / 1000 if cuda else end - start for start, end in self.computing)
        count = torch.as_tensor(self.count, dtype=torch.float64, device=self.ctx.device).reshape(1)
        timing = torch.zeros(2, world, dtype=torch.float64, device=self.ctx.device)  # its slots: waits, compute
        timing[0, self.ctx.rank], timing[1, self.ctx.rank] = self.loader.waited if self.loader else 0.0, self.computed
        losses = torch.stack(self.step_losses).double().reshape(-1) if self.step_losses else count[:0]
        sums = torch.cat([losses, count, timing.reshape(-1)])
        if self.ctx.distributed:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # DDP: each step's loss sum, the count, every rank's timing
        *losses, count = sums[: -2 * world].tolist()
        self.timing = sums[-2 * world :].tolist()
        loss_sum, first = sum(losses), progress.step - len(losses) + 1  # first: the step of the first entry
        bad = [i for i, loss in enumerate(losses) if not math.isfinite(loss)]
        if bad:
            diverged(f"the training loss is {losses[bad[0]]} at step {first + bad[0]}", self.ctx)
        if self.norms:  # the norms of the all-reduced gradient: the same on every rank
            self.fold_norms(torch.stack(self.norms), first, progress)
        progress.loss_sum += loss_sum
        progress.count += count
        check_count_unit(progress.count, progress.samples, self.ctx)  # the plan's samples scaled the gradients
        self.step_losses, self.norms, self.count, self.computing = [], [], 0, []

    def fold_norms(self, norms: torch.Tensor, first: int, progress: Progress) -> None:
        finite = norms.isfinite()
        if not self.fp16 and not finite.all():
            bad = int((~finite).nonzero()[0])
            diverged(f"the gradient norm is {float(norms[bad])} at step {first + bad}", self.ctx)
        if finite.any():
            progress.max_norm = max(progress.max_norm or 0.0, float(norms[finite].max()))
        self.last_norm = float(norms[-1])  # the last step's, for the progress record
        if self.fp16:
            progress.skipped += int((~finite).sum())

    def log_progress(self, progress: Progress, job: Job) -> None:
        """Rank 0: a progress record, with the loss and throughput since the last one (or the epoch's start),
        the time since launch and the time left, at the pace of this run's steps so far."""
        now, (then, samples, count, loss, timing) = time.perf_counter(), self.line
        self.line = (now, progress.samples, progress.count, progress.loss_sum, self.timing)
        count, per_step = progress.count - count, (now - self.loop_started) / max(1, progress.step - self.first_step)
        job.records({"kind": "progress", "step": progress.step, "epoch": progress.epoch + 1,
                     "train_loss": (progress.loss_sum - loss) / count if count else None,
                     **self.rates(progress.samples - samples, count, max(now - then, 1e-9), job, timing),
                     "lr": job.optimizers[0].param_groups[0]["lr"], "grad_norm": self.last_norm,
                     "elapsed_s": time.monotonic() - STARTED, "eta_s": per_step * (job.total_steps - progress.step)})

    def rates(self, samples: int, count: float, seconds: float, job: Job, timing: list) -> dict:
        """samples/s, tokens/s, FLOP/s per process, MFU, and each rank's shares of the time: data waits, compute."""
        shares = [round((now - then) / seconds, 4) for now, then in zip(self.timing, timing)]
        rates = {"samples_per_sec": samples / seconds, "data_wait_by_rank": shares[: self.ctx.world_size],
                 "compute_by_rank": shares[self.ctx.world_size :]}
        if COUNT_UNIT != "samples":
            rates[f"{COUNT_UNIT}_per_sec"] = count / seconds
        if job.flops_per_sample:
            rates["tflops_per_process"] = samples / seconds * job.flops_per_sample / self.ctx.world_size / 1e12
            if job.args.peak_tflops:
                rates["mfu"] = rates["tflops_per_process"] / job.args.peak_tflops
        return rates

    def epoch_record(self, progress: Progress, job: Job) -> dict:
        """The epoch's record, but for evaluation, at the end of its training."""
        then, samples, count, _, timing = self.began
        seconds = time.perf_counter() - then
        job.agreement.logged_at = time.monotonic()  # the epoch's line is a sign of life: --log-seconds counts from here
        record = {"kind": "epoch", "epoch": progress.epoch + 1, "step": progress.step,
                  "train_loss": progress.loss_sum / progress.count if progress.count else None, "eval_loss": None,
                  "eval_samples": 0, "train_samples": progress.samples, "world_size": self.ctx.world_size,
                  "effective_batch_size": job.global_batch, "lr": job.optimizers[0].param_groups[0]["lr"],
                  **self.rates(progress.samples - samples, progress.count - count, seconds, job, timing),
                  "epoch_time_s": seconds, "first_step_at": self.first_step_at,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
        if self.ctx.device.type == "cuda":  # peak GPU memory
            record["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated(self.ctx.device) / 2**20
        if COUNT_UNIT != "samples":  # tokens: train_tokens
            record[f"train_{COUNT_UNIT}"] = whole(progress.count)
        if progress.max_norm is not None:
            record["grad_norm_max"] = progress.max_norm  # the largest before clipping, over the epoch's steps
        if self.fp16:
            record["skipped_steps"] = progress.skipped  # by the GradScaler: their gradients overflowed
        if job.flops_per_sample:
            record["flops_per_sample"] = job.flops_per_sample  # training FLOPs (forward + backward)
        return record


def log_start(job: Job, flops_not_counted: str) -> None:
    """Rank 0: how the run is set up, in two lines (and why FLOPs were not counted, if they were not)."""
    ctx, args, eval_set = job.ctx, job.args, job.eval_data.dataset if job.eval_data else ()
    log(ctx, f"{PROG}: {ctx.launcher}, world size {ctx.world_size} ({ctx.local_world_size}/node), "
             f"{ctx.backend if ctx.distributed else 'no process group'}, {ctx.device}, "
             f"{torch.get_num_threads()} thread(s)/process")
    per_rank = job.global_batch // ctx.world_size
    accum = math.ceil(per_rank / args.batch_size)  # micro-batches per step: at most --batch-size each
    split_up = (f"{per_rank // accum}/process x {ctx.world_size} x {accum} accum" if per_rank % accum == 0 else
                f"{per_rank}/process x {ctx.world_size}, in {accum} micro-batches of at most {-(-per_rank // accum)}")
    log(ctx, f"global batch {job.global_batch} = {split_up}, lr {args.lr:g}, {len(job.sampler.dataset):,} train / "
             f"{len(eval_set):,} eval samples, {job.steps_per_epoch} steps/epoch")
    if flops_not_counted:
        log(ctx, f"FLOPs not counted: {flops_not_counted}; no FLOP/s or MFU is logged")


class Records:
    """Rank 0's sinks for every record (progress, epoch, eval): the console, metrics.jsonl (epochs, evaluations),
    TensorBoard (--tensorboard: KIND/NAME at the step) and report(). A resume drops what was written after
    its checkpoint's step (TensorBoard: purge_step), so that no step is written twice."""

    def __init__(self, args, ctx: DistContext, progress: Progress, total: int, steps_per_epoch: int):
        self.ctx, self.writer, self.total, self.epochs = ctx, None, total, math.ceil(total / steps_per_epoch)
        self.path = os.path.join(args.out_dir, "metrics.jsonl")
        if args.tensorboard:  # optional: only this flag needs the package
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                fail("--tensorboard needs TensorBoard: pip install tensorboard", ctx=ctx)
        if not ctx.is_main:
            return
        kept = []
        if progress.step and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= progress.step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        if args.tensorboard:
            self.writer = SummaryWriter(os.path.join(args.out_dir, "tensorboard"), purge_step=progress.step + 1)

    def __call__(self, record: dict) -> None:
        if not self.ctx.is_main:
            return
        log(self.ctx, console_line(record, self.total, self.epochs))
        if record["kind"] != "progress":
            strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
            with open(self.path, "a") as f:
                f.write(json.dumps(strict, allow_nan=False) + "\n")  # strict JSON: jq and JavaScript read it
        if self.writer:
            for name, value in record.items():
                if isinstance(value, (int, float)) and name not in ("step", "epoch"):
                    self.writer.add_scalar(f"{record['kind']}/{name}", value, record["step"])
            self.writer.flush()
        report(record)


def console_line(record: dict, total: int, epochs: int) -> str:
    """A record as one aligned line: a progress line and an evaluation (indented), or an epoch's line."""
    r, step = record, f"step {record['step']:>{len(f'{total:,}')},}/{total:,}"
    evals = "".join(f"  {k} {v:.4f}" for k, v in r.items() if k.startswith("eval_") and v is not None
                    and k not in ("eval_samples", f"eval_{COUNT_UNIT}"))
    if r["kind"] == "eval":
        return f"  {step}{evals}"
    rates = f"{r['samples_per_sec']:>9,.0f} samples/s"
    if COUNT_UNIT != "samples":
        rates += f"  {r[f'{COUNT_UNIT}_per_sec']:>9,.0f} {COUNT_UNIT}/s"
    if "mfu" in r:
        rates += f"  MFU {100 * r['mfu']:5.2f}%"
    named, most = "", 0.05  # a straggler: the rank that computes, or waits for data, the most over 1.5 x the median
    for shares, does in ((r["compute_by_rank"], "computes"), (r["data_wait_by_rank"], "waits for data")):
        median, (share, worst) = sorted(shares)[(len(shares) - 1) // 2], max((s, rank) for rank, s in enumerate(shares))
        if share - 1.5 * median > most:
            named, most = f"rank {worst} {does} {share:.0%} of the time (median {median:.0%})", share - 1.5 * median
    rates += f"  {named or f'data wait {median:3.0%}'}"  # (median: the data wait's)
    if r["kind"] == "epoch":
        return (f"epoch {r['epoch']:>3}/{epochs}  train_loss {r['train_loss']:.4f}{evals}  {rates}  "
                f"world {r['world_size']}  batch {r['effective_batch_size']}  {r['epoch_time_s']:6.2f} s")
    loss = f"train_loss {r['train_loss']:.4f}" if r["train_loss"] is not None else "train_loss    -  "
    elapsed, eta = (datetime.timedelta(seconds=int(r[k])) for k in ("elapsed_s", "eta_s"))  # h:mm:ss
    return (f"  epoch {r['epoch']:>3}/{epochs}  {step} ({100 * r['step'] / total:5.1f}%)  {loss}  {rates}  "
            f"lr {r['lr']:.2e}  elapsed {elapsed}  ETA {eta}")


def everyone(value, ctx: DistContext) -> list:
    """Every rank's value (a small Python object) in rank order, on every rank: over gloo, no GPU involved."""
    if not ctx.distributed:
        return [value]
    values = [None] * ctx.world_size
    dist.all_gather_object(values, value, group=ctx.control_group)
    return values


def count_flops(model: nn.Module, data: Loader, args, ctx: DistContext) -> tuple[float | None, str]:
    """Training FLOPs (forward + backward) per sample, measured by torch's FlopCounterMode on the first
    micro-batch of the training set, before training. Nothing of the run changes: no RNG draw, no
    BatchNorm statistic, no gradient is left behind. (None, why) where the counter cannot count: it
    counts matmuls, convolutions and attention, not recurrent layers, nor custom kernels (which it
    cannot see, and aten ops it has no formula for (a grouped matmul): their FLOPs are missing)."""
    recurrent = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.RNNBase)})
    if recurrent:
        return None, f"torch's FlopCounterMode has no formula for {', '.join(recurrent)}"
    with preserved_state(model, ctx):
        batch, samples = data.first_batch()
        counter = flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)
        with counter:
            try:
                with autocast(args, ctx):
                    loss_sum = call_compute_loss(model, batch, ctx)[0]
                loss_sum.backward()
            except Exception as exc:
                if flop_counter.__file__ not in (frame.filename for frame in traceback.extract_tb(exc.__traceback__)):
                    raise  # the model's own error, which training would raise too
                return None, f"torch's FlopCounterMode failed ({type(exc).__name__}: {one_line(exc)[:100]})"
    if not counter.get_total_flops():
        return None, "torch's FlopCounterMode counted no FLOPs in this model"
    return counter.get_total_flops() / samples, ""


@contextlib.contextmanager
def preserved_state(model: nn.Module, ctx: DistContext):
    """Run a forward and backward that leave no trace: every RNG state, the buffers (BatchNorm's
    statistics) and the gradients are as they were before."""
    rng, buffers = rng_state(ctx.device), [b.clone() for b in model.buffers()]
    try:
        yield
    finally:
        set_rng_state(rng, ctx.device)
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers):
                b.copy_(saved)
        model.zero_grad(set_to_none=True)


# FlopCounterMode's formulas for attention cover the CUDA kernels; the CPU's fused kernel is the same count.
# (custom_mapping takes formulas of the inputs' shapes, as torch's own are written.)
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *_, out_shape=None, **__: flop_counter.sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *_, out_shape=None, **__: flop_counter.sdpa_backward_flop_count(grad, q, k, v)}


# ====== Extras: gradients, precision, the schedule, argument parsing, errors ================================


def evaluation(job: Job, progress: Progress) -> dict:
    """All ranks: the eval figures of the weights, and of --ema's as eval_ema_*; then --keep-best."""
    if not job.eval_data:
        return {}
    figures = evaluate(job.model, job.eval_data, job.args, job.ctx)
    if "ema" in job.state:
        ema = evaluate(job.state["ema"].module, job.eval_data, job.args, job.ctx)
        figures.update({f"eval_ema_{k[5:]}": v for k, v in ema.items() if k[5:] not in ("samples", COUNT_UNIT)})
    if job.args.keep_best:
        keep_best(figures, job, progress)
    return {"step": progress.step, "epoch": progress.epoch + 1, **figures}


def keep_best(figures: dict, job: Job, progress: Progress) -> None:
    """--keep-best METRIC[:min|:max]: best.pt (--ema's for eval_ema_*) at each evaluation that beats progress.best."""
    name, _, way = job.args.keep_best.partition(":")
    if name not in figures or way not in ("", "min", "max"):
        fail(f"--keep-best {job.args.keep_best}: name one of the evaluation's figures ({', '.join(figures)}), "
             "with :min or :max if you like", ctx=job.ctx)
    value, lower = figures[name], way == "min" if way else "loss" in name
    if progress.best is None or (value < progress.best if lower else value > progress.best):
        progress.best = value
        model = job.state["ema"].module if name.startswith("eval_ema_") else job.model
        if job.ctx.is_main:
            atomic_save(model.state_dict(), os.path.join(job.args.out_dir, "best.pt"))
        wait_for_rank0(job.ctx)


def call_compute_loss(model: nn.Module, batch, ctx: DistContext) -> tuple:
    """compute_loss(model, batch) as (loss_sum, count, metric_sums), checked on the way."""
    out = compute_loss(model, batch)
    if not (isinstance(out, tuple) and len(out) in (2, 3) and torch.is_tensor(out[0]) and out[0].dim() == 0
            and (isinstance(out[1], (int, float)) or torch.is_tensor(out[1]) and out[1].numel() == 1)
            and (len(out) == 2 or isinstance(out[2], dict))):
        shape = tuple(out[0].shape) if isinstance(out, tuple) and out and torch.is_tensor(out[0]) else None
        fail(f"compute_loss must return (loss_sum, count) or (loss_sum, count, {{name: sum}}): loss_sum a 0-dim "
             f"tensor, count a number or a 0-dim tensor; it returned {type(out).__name__}"
             + (f" with a loss of shape {shape}: sum the per-sample losses" if shape else ""), ctx=ctx)
    return out[0], out[1], out[2] if len(out) == 3 else {}


def check_every_parameter_got_a_gradient(job: Job) -> None:
    """Trap: a parameter that got no gradient in a step leaves DDP waiting for it; it fails at the next
    step on every rank, with a hundred lines each. Checked in warm_up's backward, in one process too."""
    if job.args.find_unused_parameters:
        return
    missing = [name for name, p in job.model.named_parameters() if p.requires_grad and p.grad is None]
    missing = list(dict.fromkeys(name for names in everyone(missing, job.ctx) for name in names))  # all ranks'
    if missing:
        fail(f"{len(missing)} parameter(s) got no gradient in the first step: {', '.join(missing[:5])}"
             f"{', ...' if len(missing) > 5 else ''}. Pass --find-unused-parameters if some parameters sit out "
             "some steps, or set requires_grad=False on those you freeze", ctx=job.ctx)


def mean_gradients(job: Job, count) -> torch.Tensor:
    """Make the step's gradient the mean over its global count, once per step, then --clip-grad-norm
    it, over every parameter of the model. Backward saw the sums / typical_count (a constant that keeps
    them in fp16's range), and DDP averaged them over ranks: x world size x typical_count / count.
    Returns the gradient norm before clipping (a 0-dim tensor: no host sync)."""
    for optimizer in job.optimizers:
        job.scaler.unscale_(optimizer)  # Trap: clip and log the true gradients, not fp16's loss-scaled ones
    grads = [p.grad for p in job.params if p.grad is not None]
    scale = gradient_scale(count, job.ctx.world_size * job.typical_count, grads[0].dtype)  # DDP: sums -> mean
    if scale is not None:
        torch._foreach_mul_(grads, scale)  # one kernel for all gradients (what torch's own optimizers use)
    # The norm, and the clip if asked (without: x 1.0 when finite, which changes nothing): one call on every torch.
    return torch.nn.utils.clip_grad_norm_(job.params, job.args.clip_grad_norm or math.inf)


def gradient_scale(count, factor: float, dtype: torch.dtype):
    """factor / count, what turns the gradients DDP averaged into the mean over the step's count: None
    where it is exactly 1 (a classifier without accumulation), 0 for a step without a count. A count on
    a GPU gives a 0-dim tensor there, in the gradients' dtype. Trap: a float64 scale on float32
    gradients sends _foreach_mul_ to its slow path, one kernel per parameter (ForeachBinaryOpScalarTensor.cu
    takes the fast path only when the scalar tensor's dtype matches)."""
    if torch.is_tensor(count):
        return torch.where(count > 0, factor / count, 0.0).to(dtype)
    if count == factor:
        return None
    return factor / count if count > 0 else 0.0


def broadcast_buffers(model: nn.Module, ctx: DistContext) -> None:
    """DDP: give every rank rank 0's buffers (BatchNorm statistics), so that evaluation on every
    rank, and model.pt, describe one model. (DDP itself does this at the next step's start.)"""
    if ctx.distributed:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def autocast(args, ctx: DistContext):
    if args.amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(ctx.device.type, dtype=torch.bfloat16 if args.amp == "bf16" else torch.float16)


def set_learning_rate(job: Job, step: int) -> None:
    """Each parameter group's own base rate (noted in the group the first time: the checkpoint carries it) x the
    schedule's factor at `step`, which depends only on the step and the run's length: no state of its own."""
    factor = lr_factor(job.args.schedule, step, job.total_steps, job.args.warmup_steps)
    for optimizer in job.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group.setdefault("base_lr", group["lr"]) * factor


def lr_factor(schedule: str, step: int, total: int, warmup: int) -> float:
    """--schedule's multiplier at step `step` (0-based) of `total`: a linear warmup over `warmup` steps, then a
    cosine or linear decay to 0, a constant, or wsd (constant, then linear to 0 over the run's last fifth)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "wsd":
        return min(1.0, (total - step) / max(1.0, 0.2 * total))
    done = (step - warmup) / max(1, total - warmup)
    return {"cosine": 0.5 * (1 + math.cos(math.pi * done)), "linear": 1 - done, "constant": 1.0}[schedule]


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        fail(f"{message} (see --help)")


def at_least(low, strict: bool = False):
    """An argparse type: a number (an int if `low` is one) no smaller than `low` (strict: greater)."""

    def parse(text):
        value = type(low)(text)
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'greater than' if strict else 'at least'} {low:g}, got {text}")
        return value

    parse.__name__ = type(low).__name__  # argparse's own "invalid int value: 'abc'" takes the type's name from here
    return parse


def fail(message: str, code: int = 2, ctx: DistContext | None = None) -> None:
    """Stop with one clear line on stderr and no traceback. With a ctx, the error is one that every
    rank hits, so only rank 0 prints it."""
    if ctx is None or ctx.is_main:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's summary shows this line (@record skips SystemExit)
        with contextlib.suppress(OSError), open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": f"{PROG}: error: {message}",  # the layout of torch's ErrorHandler
                                   "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    raise SystemExit(code)


def one_line(exc: BaseException, last: bool = False) -> str:
    """An exception's first line (or last), or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[-1 if last else 0] if text else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
