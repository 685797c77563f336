"""ddp_train.py: the minimal reference PyTorch DistributedDataParallel (DDP) training script.

One file, torch only (2.4 to 2.15). Launch it unchanged:

    python ddp_train.py                                  # one process: the CPU or one GPU
    python ddp_train.py --spawn 2                        # N local processes, no launcher to type
    torchrun --nproc_per_node=4 ddp_train.py             # one node, 4 processes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 \\
        --rdzv-id=job1 ddp_train.py                      # the same on each of 2 nodes
    srun --ntasks-per-node=8 --gpus-per-task=1 python ddp_train.py     # SLURM: a task per GPU
    python -m torch.distributed.launch --nproc_per_node=2 ddp_train.py  # the legacy launcher

Your task is the functions at the top: edit them, or assign yours from a script that imports this
file (examples/digits.py). Then the training loop of the tutorials, in torch's own names: each line
DDP adds to a plain loop says "DDP:", each classic trap "Trap:". Then a few small helpers.
"""

import argparse
import collections
import contextlib
import datetime
import gc
import json
import math
import os
import random
import re
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, default_collate

try:  # optional: where a Dataset draws from numpy, its generator is seeded and checkpointed too
    import numpy
except ImportError:
    numpy = None

PROG = "ddp_train.py"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # preemption: torchrun, SLURM, Kubernetes
FEATURES, CLASSES = 32, 10  # the default task


# ====== Your task: replace these ================================================================


class InMemory(TensorDataset):
    """The default task's tensors: a whole batch at once (one gather, not a loop over samples)."""

    def __getitems__(self, indices):
        rows = torch.tensor(indices)
        return tuple(tensor.index_select(0, rows) for tensor in self.tensors)


def build_datasets(args):
    """(train_set, eval_set): map-style Datasets, the same on every rank; eval_set may be None. The
    default: Gaussian inputs labelled by a random linear "teacher"."""
    gen = torch.Generator().manual_seed(args.seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)

    def make(n):
        x = torch.randn(n, FEATURES, generator=gen)
        return InMemory(x, (x @ teacher).argmax(dim=1))

    return make(args.num_samples), make(args.eval_samples)  # (an empty eval set: no evaluation)


def build_model(args):
    """Any nn.Module. The default: a small MLP classifier."""
    return nn.Sequential(
        nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES)
    )


def compute_loss(model, batch):
    """(loss, count) or (loss, count, metrics) of a batch (collate_fn's, on the device), in training
    and evaluation. loss: the MEAN over count items, as F.cross_entropy returns it. count: an int or
    a 0-dim tensor, the samples (or a language model's real tokens, (labels != -100).sum(), with
    COUNT_UNIT = "tokens"). metrics: means over the same items ("accuracy": eval_accuracy). Each
    mean is weighed by its count: every gradient and figure is the exact mean of a step's items (a
    mean of no items weighs nothing, but its gradient must be finite, as F.cross_entropy's is)."""
    inputs, targets = batch
    logits = model(inputs).float()
    metrics = {} if model.training else {"accuracy": (logits.argmax(1) == targets).float().mean()}
    return F.cross_entropy(logits, targets), len(targets), metrics


def collate_fn(items):
    """A list of items -> a batch: torch's default_collate stacks them (items of different shapes
    need one that pads: examples/tinylm.py); a batch fetched whole (__getitems__) stays."""
    return items if isinstance(items, tuple) else default_collate(items)


def build_optimizer(args, model):
    """One optimizer, or a list. The default: AdamW as nanoGPT sets it up, --weight-decay on weights
    (matrices and embeddings) only, not biases and norms; fused: one kernel for all."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay}]
    groups.append({"params": [p for p in params if p.dim() < 2], "weight_decay": 0})
    return torch.optim.AdamW(groups, lr=args.lr, fused=True)


def build_scheduler(args, optimizer, total_steps):
    """A torch LRScheduler for one optimizer (OneCycleLR...), stepped after each optimizer step and
    checkpointed. The default: a linear warmup over --warmup-steps, then cosine decay to 0."""

    def factor(step):  # the optimizer steps done before this one
        warmup = args.warmup_steps
        if step < warmup:
            return (step + 1) / warmup
        return (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup))) / 2

    return LambdaLR(optimizer, factor)


def report(record):
    """Rank 0 calls this with each record it logs: send them to W&B or TensorBoard here."""


# what compute_loss's count counts: "samples", or "tokens" for a language model
COUNT_UNIT = "samples"


# ====== The training loop, and the lines DDP adds to it =========================================


@record  # under torchrun, a worker's traceback shows in torchrun's failure summary
def main(argv=None):
    args = parse_args(argv)
    if args.spawn and "RANK" not in os.environ:
        # --spawn N: torch's launcher starts N processes on a free port (passing SIGUSR1: 2.10+)
        os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGUSR1")
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.spawn}"]
        os.execv(sys.executable, [sys.executable, *launcher, sys.argv[0], *(argv or sys.argv[1:])])
    return run(args)


def run(args):
    """One process's whole life: find its place, join the process group, train, leave."""
    # torchrun's RANK, LOCAL_RANK and WORLD_SIZE (srun's translated); plain python: one process
    rank, local_rank, world = place()
    device = torch.device("cpu")  # (CUDA_VISIBLE_DEVICES= trains on the CPUs of a GPU machine)
    if torch.cuda.is_available():
        gpus, here = torch.cuda.device_count(), os.environ.get("LOCAL_WORLD_SIZE", "1")
        check(
            int(here) <= gpus,
            f"{here} processes on this node and {gpus} GPU(s), but NCCL needs one per process: "
            "start one per GPU, or train on the CPUs with CUDA_VISIBLE_DEVICES=",
        )
        # DDP: a GPU per process, current before anything touches CUDA (srun --gpus-per-task=1: 0)
        device = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(device)
    gloo = None  # small messages (the stop flag, generators, a barrier): on CPUs the default group
    if world > 1:
        env, store = os.environ, None
        timeout = datetime.timedelta(seconds=args.timeout)
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # Trap: torchrun (2.5+) keeps one store for all restarts of a job, where restarted
            # workers would find the dead ones' addresses (pytorch/pytorch#135712): a prefix each
            agent = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), timeout=timeout)
            store = dist.PrefixStore(f"restart{env['TORCHELASTIC_RESTART_COUNT']}", agent)
        # DDP: join the process group: NCCL on GPUs, gloo on CPUs (a missing peer: an error in time)
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(
                backend, timeout=timeout, store=store, rank=rank, world_size=world
            )
        except Exception as exc:
            fail(
                f"rank {rank} could not join the others at {env['MASTER_ADDR']}:"
                f"{env['MASTER_PORT']} within {args.timeout:g} s: is MASTER_ADDR node 0's address "
                f"as this node sees it, and MASTER_PORT free there and open? ({one_line(exc)})",
                code=1,
                every_rank=True,
            )
        if device.type == "cuda":  # beside NCCL, a gloo group of their own
            gloo = dist.new_group(backend="gloo", timeout=timeout)
    try:
        return train(args, device, rank, world, gloo)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # Trap: they hold the DDP model and the loaders
        raise
    finally:
        gc.collect()  # Trap: the DDP model freed before its process group: gloo can abort at exit
        if dist.is_initialized():
            # Trap: torch < 2.8 frees a group holding the GIL, which a gloo thread freeing a tensor
            # may wait for (a rare hang at exit): gloo's part outlives it, then goes without the GIL
            keep = (gloo or dist.group.WORLD)._get_backend(device)
            dist.destroy_process_group()  # DDP: leave the process group, also after an error
            del keep  # (pytorch/pytorch#154976)


def train(args, device, rank, world, gloo):
    """Every rank runs every line together; rank 0 alone prints, writes. Returns the exit code."""
    seed_everything(args.seed)  # first: a random split in build_datasets agrees across ranks
    train_set, eval_set = build_datasets(args)
    seed_everything(args.seed)  # the same initial weights, whatever the world size
    model = build_model(args).to(device)
    if args.sync_bn:
        check(device.type == "cuda", "--sync-bn needs GPUs (SyncBatchNorm runs on CUDA)")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    path, ckpt = read_checkpoint(args.out_dir)  # the out-dir's last checkpoint: the run resumes
    # DDP: a step's global batch is per process x world size x accumulation. A run resumed on
    # another world size keeps its own, with another accumulation (nanoGPT divides its by world).
    batch = args.batch_size * world * args.grad_accum
    if ckpt and ckpt["global_batch"] != batch:
        check(
            ckpt["world_size"] != world,
            f"{path} trained with a global batch of {ckpt['global_batch']}, this run's is {batch}: "
            "pass the same --batch-size and --grad-accum, or another --out-dir",
        )
        batch = ckpt["global_batch"]
    accum, rest = divmod(batch, args.batch_size * world)
    check(
        accum and not rest,
        f"the global batch of {batch} is not {world} processes x --batch-size {args.batch_size} x "
        f"a whole accumulation: pass a --batch-size that divides {batch // world}"
        f"{'' if batch % world == 0 else f', on a world size that divides {batch}'}",
    )
    # Every step is a full global batch: an epoch leaves out its last, incomplete one (as nanoGPT).
    steps_per_epoch = len(train_set) // batch
    check(
        steps_per_epoch,
        f"the {len(train_set)} training samples do not fill one global batch of {batch}: lower "
        "--batch-size or --grad-accum",
    )
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    optimizers = build_optimizer(args, model)
    optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    schedulers = [build_scheduler(args, opt, total_steps) for opt in optimizers]
    # --amp; without it none at all: even a disabled autocast costs microseconds in every forward
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    autocast = torch.autocast(device.type, amp) if amp else contextlib.nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)  # fp16: loss scaling
    # Every stateful part, by name: what a checkpoint saves and restores, one list each.
    parts = dict(model=[model], optimizers=optimizers, schedulers=schedulers, scaler=[scaler])
    # The run's position is one step counter. Also the loss sums and counts of the epoch and of the
    # line, and the count of a step over all ranks that its means are weighed against (samples: the
    # global batch; tokens: the last step's, and the gradients are scaled to the step's own later).
    progress = {"step": 0, "epoch": [0.0, 0.0], "line": [0.0, 0.0], "count": batch}
    seed_everything(args.seed + 1 + rank)  # DDP: each rank a random stream of its own (dropout)
    if ckpt:
        try:
            for name, objects in parts.items():
                for obj, state in zip(objects, ckpt[name], strict=True):
                    obj.load_state_dict(state)
        except (RuntimeError, ValueError, KeyError) as exc:
            fail(f"{path} is of another model, optimizer or --amp: {one_line(exc)}. Use theirs")
        # every rank's generators as they were (on another world size: the fresh ones just seeded)
        progress, rngs = ckpt["progress"], ckpt["rng"]
        if len(rngs) == world:
            set_rng_state(rngs[rank])
        log(f"resumed from {path} at step {progress['step']}, saved by {len(rngs)} process(es)")
    # DDP: each rank reads its own share of each epoch's shuffle (drop_last: equal shares)
    sampler = DistributedSampler(train_set, world, rank, seed=args.seed, drop_last=True)
    # The DataLoaders' options. Trap: ignore_signals, else torchrun's SIGTERM kills the workers and the
    # trainer dies before it saves. Trap: a generator of the rank's own, else their workers' seeds are
    # drawn from the global generator (dropout's), and the same on every rank.
    options = dict(collate_fn=collate_fn, num_workers=args.workers, worker_init_fn=ignore_signals)
    options |= dict(persistent_workers=args.workers > 0, pin_memory=device.type == "cuda")
    options["generator"] = torch.Generator().manual_seed(args.seed + 1 + rank)
    micro_batches = []  # this rank's micro-batches of an epoch: set before each pass
    loader = DataLoader(train_set, batch_sampler=micro_batches, **options)
    eval_set = eval_set or []  # rank r evaluates samples r, r + world size... (no padding)
    ours = range(rank, len(eval_set), world)
    eval_loader = DataLoader(eval_set, args.batch_size, sampler=ours, **options)
    # Trap: their workers start now, once, before any collective: a fork while a gloo or NCCL thread
    # frees a finished one deadlocks the child on Python before 3.12 (CPython issue 112275)
    iter(loader), iter(eval_loader)
    if world > 1:  # Trap: a checkpoint that only some nodes see: they would train different steps
        starts = [None] * world
        dist.all_gather_object(starts, progress["step"])
        check(len(set(starts)) == 1, f"the ranks start at steps {starts}: a shared --out-dir")
    # DDP: the wrap: it broadcasts rank 0's weights, then averages the gradients in its buckets
    ddp_model = (
        DDP(model, find_unused_parameters=args.find_unused_parameters, gradient_as_bucket_view=True)
        if world > 1
        else model
    )
    forward = torch.compile(ddp_model) if args.compile else ddp_model

    def fold():
        """All ranks: every rank's loss sum and count since the last fold, added to the epoch's and
        the line's. A non-finite loss stops every rank, before anything is written."""
        if world > 1:
            dist.all_reduce(sums)  # DDP: the loss all_reduce (SUM: gloo's AVG is unreliable)
        total, counted = sums.tolist()
        sums.zero_()
        if not math.isfinite(total):
            fail(
                f"the training loss is {total} at step {progress['step']}: the run diverged; "
                "nothing non-finite was saved. Lower --lr, or pass --clip-grad-norm 1.0",
                code=1,
            )
        samples, folded[0] = (progress["step"] - folded[0]) * batch, progress["step"]
        check(
            COUNT_UNIT != "samples" or counted == samples,
            f"compute_loss counted {counted:g} for {samples} samples, but COUNT_UNIT is samples: "
            'return the sample count, or set COUNT_UNIT to what it counts ("tokens")',
        )
        for totals in progress["epoch"], progress["line"], ran:
            totals[:] = totals[0] + total, totals[1] + counted

    @torch.no_grad()
    def evaluate():
        """All ranks: the means over the eval set, each sample once (DistributedSampler pads)."""
        for buffer in model.buffers() if world > 1 else ():
            dist.broadcast(buffer, 0)  # DDP: rank 0's BatchNorm statistics: the model rank 0 saves
        sums = collections.Counter()
        model.eval()
        for inputs in eval_loader:
            with autocast:
                loss, n, metrics = checked(compute_loss(model, to_device(inputs, device)))
            sums["items"] += float(n)  # (no metric's key: theirs begin with eval_)
            for name, mean in {"loss": loss, **metrics}.items():
                sums[f"eval_{name}"] += float(mean * n) if n else 0.0  # (no items: 0/0)
        model.train()
        every = [sums] * world
        if world > 1:
            dist.all_gather_object(every, sums, group=gloo)  # DDP: every rank's sums, added
        totals = collections.Counter()
        for s in every:
            totals.update(s)
        count = totals.pop("items")
        figures = {k: v / count for k, v in totals.items()}
        figures["eval_samples"] = len(eval_set)  # the ranks' shares: every sample once
        if COUNT_UNIT != "samples":
            figures[f"eval_{COUNT_UNIT}"] = count
        return figures

    def emit(kind, figures):
        """Rank 0: a record (progress, eval, epoch) to the console, metrics.jsonl and report()."""
        if rank == 0:
            record = dict(kind=kind, step=step, epoch=epoch + 1, **figures)
            shown = [
                f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
            ]
            print(f"{kind:>8}  step {step}/{total_steps}", *shown[2:], sep="  ", flush=True)
            with open(f"{args.out_dir}/metrics.jsonl", "a") as f:
                print(json.dumps(record), file=f)
            report(record)

    def save_checkpoint():
        """All ranks: losses folded, generators gathered; rank 0 writes; all wait for the write."""
        fold()
        rngs = [rng_state()] * world
        if world > 1:
            dist.all_gather_object(rngs, rngs[0], group=gloo)
        if rank == 0:
            state = {name: [obj.state_dict() for obj in objects] for name, objects in parts.items()}
            state.update(progress=progress, rng=rngs, global_batch=batch, world_size=world)
            stem = f"{args.out_dir}/checkpoint"
            atomic_save(state, f"{stem}.pt", f"{stem}.prev.pt")
        if world > 1:
            dist.barrier(group=gloo)  # Trap: nobody goes on, or exits, before the file is written

    step = progress["step"]
    if step >= total_steps:
        log(
            f"{path} holds a finished run ({step} steps): nothing to train. Raise --epochs or "
            "--max-steps to train on, or pass another --out-dir"
        )
        return 0
    os.makedirs(args.out_dir, exist_ok=True)
    log(
        f"{PROG}: world size {world}, {dist.get_backend() if world > 1 else 'no process group'}, "
        f"{device}, {torch.get_num_threads()} thread(s)/process, torch {torch.__version__}\n"
        f"global batch {batch} = {args.batch_size}/process x {world} x {accum} accum, "
        f"{steps_per_epoch} steps/epoch (each leaves out {len(train_set) % batch} of its "
        f"{len(train_set):,} samples), {len(eval_set):,} eval samples"
    )
    signals = []
    for sig in STOP_SIGNALS:  # Trap: a handler only notes the signal: a collective in one deadlocks
        signal.signal(sig, lambda signum, frame: signals.append(signum))
    # this rank's loss sum and count since the last fold, its step; all ranks' items in this run
    sums, folded, ran = torch.zeros(2, dtype=torch.float64, device=device), [step], [0.0, 0.0]
    loss_sum, count = sums
    first, started = step, time.perf_counter()
    while step < total_steps:
        epoch, done = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)  # Trap: without it every epoch repeats the first one's shuffle
        # DDP: step s trains the samples at [s, s + 1) x global batch of the shuffle: this rank's
        # share of them is the same stretch of its own share. A resumed epoch skips the steps done.
        mine, each = list(sampler), args.batch_size
        micro_batches[:] = [mine[i : i + each] for i in range(done * accum * each, len(mine), each)]
        data, end = iter(loader), min(total_steps, (epoch + 1) * steps_per_epoch)
        epoch_at = time.perf_counter()
        while step < end:
            # DDP: a stop signal on any rank stops every rank after the same step: this rank's flag
            # rides an asynchronous all-reduce over gloo, sent now and read at the step's end
            if world > 1:
                flag = torch.tensor(len(signals))
                agreement = dist.all_reduce(flag, group=gloo, async_op=True)
            # this rank's count in this step, and what its means are weighed against
            counts, expected = 0, progress["count"]
            for i in range(accum):
                inputs = to_device(next(data), device)
                # DDP: all-reduce the gradients only in the backward of the step's last micro-batch
                sync = i == accum - 1 or world == 1
                with contextlib.nullcontext() if sync else ddp_model.no_sync():
                    with autocast:
                        loss, n, _ = checked(compute_loss(forward, inputs))
                    loss_sum += loss.detach() * n
                    counts += n
                    # DDP: DDP averages the ranks' gradients: a mean weighs its share of the count
                    scaler.scale(loss * (n * world / expected)).backward()
            count += counts
            if COUNT_UNIT != "samples":
                # DDP: the step's count over all ranks, then every gradient as if weighed by it
                counts = torch.as_tensor(counts, dtype=torch.float64, device=device)
                if world > 1:
                    dist.all_reduce(counts)
                progress["count"] = counts = counts.clamp(min=1)  # (no token at all: no gradient)
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                torch._foreach_mul_(grads, (expected / counts).to(grads[0].dtype))
            log_now = args.log_every and (step + 1) % args.log_every == 0
            if args.clip_grad_norm or log_now:
                for opt in optimizers:
                    scaler.unscale_(opt)  # Trap: clip and log the true gradients, not fp16's scaled
                norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm or math.inf)
            lr = optimizers[0].param_groups[0]["lr"]
            for opt, scheduler in zip(optimizers, schedulers):
                scaler.step(opt)
                scheduler.step()
                opt.zero_grad(set_to_none=True)
            scaler.update()
            step = progress["step"] = step + 1
            if log_now:  # all ranks fold; rank 0 prints
                fold()
                (total, counted), progress["line"] = progress["line"], [0.0, 0.0]
                seconds = time.perf_counter() - started
                eta = seconds / (step - first) * (total_steps - step)
                figures = {"train_loss": total / counted, "lr": lr, "grad_norm": norm.item()}
                emit("progress", figures | {f"{COUNT_UNIT}_per_s": ran[1] / seconds, "eta_s": eta})
            if args.eval_every and step % args.eval_every == 0 and step < end and eval_set:
                fold()  # first: a non-finite loss stops every rank before a record holds it
                emit("eval", evaluate())
            # all ranks: a stop signal on any of them, as the step's start saw it
            stop = agreement.wait() and flag.item() if world > 1 else signals
            if stop:
                break
            if args.save_every and step % args.save_every == 0 and step < end:
                save_checkpoint()
        if step == end:  # the end of an epoch, or of the run: all ranks
            fold()
            (total, counted), progress["epoch"] = progress["epoch"], [0.0, 0.0]
            samples = (step - epoch * steps_per_epoch) * batch
            figures = {"train_loss": total / counted, f"train_{COUNT_UNIT}": counted, "lr": lr}
            figures |= {"train_samples": samples, "world_size": world}
            figures["epoch_s"] = time.perf_counter() - epoch_at
            emit("epoch", figures | (evaluate() if eval_set else {}))
        save_checkpoint()
        if stop and step < total_steps:
            log(f"stopped by a signal at step {step}; checkpoint saved: rerun to resume (exit 75)")
            return 75
    # Trap: save the raw module: DDP prefixes each key with "module.", compile "_orig_mod."
    if rank == 0:
        atomic_save(model.state_dict(), f"{args.out_dir}/model.pt")
    log(f"saved {args.out_dir}/model.pt after {step} steps")
    return 0


# ====== THE LESSON ENDS HERE: the helpers =======================================================

# The flags: --name, its default (and so its type), what it does.
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
    ("num-samples", 32768, "the default task's training samples"),
    ("eval-samples", 4096, "the default task's evaluation samples (0: none)"),
    ("out-dir", f"out/{os.path.basename(sys.argv[0]).removesuffix('.py')}", "rank 0 writes here"),
    ("log-every", 100, "a progress line every N optimizer steps (0: off)"),
    ("eval-every", 0, "also evaluate every N optimizer steps (0: at each epoch's end only)"),
    ("save-every", 500, "also checkpoint every N optimizer steps (0: at each epoch's end only)"),
    ("amp", "off", "autocast: off, bf16 or fp16 (with loss scaling)"),
    ("compile", False, "torch.compile the DDP model"),
    ("workers", 0, "DataLoader workers per process"),
    ("find-unused-parameters", False, "let parameters sit out some steps (DDP's option; slower)"),
    ("sync-bn", False, "SyncBatchNorm: BatchNorm statistics over the global batch"),
    ("timeout", 1800.0, "seconds to wait for a peer before failing"),
    ("spawn", 0, "start N local processes (torchrun --standalone, started for you)"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.error = lambda message: fail(f"{message} (see --help)")  # one line, not argparse's usage
    for name, default, help in FLAGS:
        if default is False:
            p.add_argument(f"--{name}", action="store_true", help=help)
        else:
            p.add_argument(f"--{name}", type=type(default), default=default, help=help)
    # the legacy `python -m torch.distributed.launch` passes --local-rank=N (older torch: _rank)
    p.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    least = min(args.epochs, args.batch_size, args.grad_accum, args.num_samples)
    numbers = [v for v in vars(args).values() if isinstance(v, (int, float))]
    check(
        least >= 1 and min(numbers) >= 0,
        "--epochs, --batch-size, --grad-accum and --num-samples are at least 1, other numbers 0",
    )
    check(args.amp in ("off", "bf16", "fp16"), f"--amp is off, bf16 or fp16, not {args.amp}")
    return args


def place():
    """(RANK, LOCAL_RANK, WORLD_SIZE): torchrun's variables, which the legacy launcher and --spawn
    set too. A bare `srun python ddp_train.py` has SLURM's, translated here; plain python: none."""
    env = os.environ
    if "RANK" not in env and int(env.get("SLURM_STEP_NUM_TASKS", 1)) > 1:
        env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_STEP_NUM_TASKS"])
        env["LOCAL_RANK"] = env["SLURM_LOCALID"]
        # the step's first node ('gpu[07-09,12],cpu1': gpu07), and a port of the job's own
        first_node = re.match(r"([^,\[]*)\[?(\d*)", env["SLURM_STEP_NODELIST"]).groups()
        env.setdefault("MASTER_ADDR", "".join(first_node))
        env.setdefault("MASTER_PORT", str(15000 + int(env["SLURM_JOB_ID"]) % 20000))
    return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))


def checked(out):
    """compute_loss's result, its contract checked; a mean of no items (0/0) weighs nothing."""
    loss, n, metrics = (
        [*out, {}][:3] if isinstance(out, tuple) and len(out) in (2, 3) else [out] * 3
    )
    if not (torch.is_tensor(loss) and loss.ndim == 0 and isinstance(metrics, dict)):
        fail(
            "compute_loss must return (loss, count) or (loss, count, {name: mean}): loss the mean "
            f"over count items, a 0-dim tensor; it returned {type(out).__name__}"
            f"{f', a loss of shape {list(loss.shape)}: its mean' if torch.is_tensor(loss) else ''}"
        )
    if torch.is_tensor(n):
        loss = torch.where(n > 0, loss, 0.0)
    elif not n:
        loss = loss.nan_to_num()
    return loss, n, metrics


def to_device(batch, device):
    """A batch on the device: its tensors, in any nesting of tuples, lists and dicts."""
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch.to(device, non_blocking=True) if torch.is_tensor(batch) else batch


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
    """(path, checkpoint): the out-dir's, or the one before where that is damaged; (None, None)."""
    tried = []
    for path in f"{out_dir}/checkpoint.pt", f"{out_dir}/checkpoint.prev.pt":
        if os.path.exists(path):
            try:  # Trap: map_location, else every rank loads onto the GPU that saved it
                ckpt = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:
                tried.append(f"{path} is unreadable ({one_line(exc)})")
                continue
            if isinstance(ckpt, dict) and "progress" in ckpt:
                if tried:
                    log(f"{tried[0]}: resuming from {path}")
                return path, ckpt
            tried.append(f"{path} is not a checkpoint of {PROG}")
    check(not tried, f"{'; '.join(tried)}: move it away to start over, or pass another --out-dir")
    return None, None


def atomic_save(obj, path, previous=None):
    """Trap: a crash in the middle of a write must not cost the last good file. Write a temp file,
    flush it to the disk, then rename it (keeping the file it replaces as `previous`)."""
    with open(f"{path}.tmp", "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if previous and os.path.exists(path):
        os.replace(path, previous)
    os.replace(f"{path}.tmp", path)


def log(*args, **kwargs):
    if os.environ.get("RANK", "0") == "0":  # DDP: one log: rank 0's
        print(*args, **kwargs, flush=True)


def check(ok, message):
    if not ok:
        fail(message)


def fail(message, code=2, every_rank=False):
    """Stop with one line, no traceback: from rank 0 (all ranks have the same to say), or each."""
    (print if every_rank else log)(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def one_line(exc):
    return " ".join(str(exc).split())[:300]


if __name__ == "__main__":
    sys.exit(main())
