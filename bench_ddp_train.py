"""bench_ddp_train.py: does ddp_train.py's machinery cost speed? Measured side by side.

One invocation runs, interleaved in rounds so that drift of the machine cancels out:

  1. ddp_train.py, one process
  2. ddp_train.py under torchrun, 2 processes x 1 thread
  3. a minimal hand-written single-process loop (same model, data and batch size)
  4. a minimal tutorial-style DDP loop under torchrun, 2 x 1: a DataLoader over a TensorDataset,
     DistributedSampler, and loss.item() every step, as in the pytorch/examples DDP tutorials
  5. ddp_train.py training a user's own Dataset (examples/digits.py: random augmentation in
     __getitem__, a CNN with BatchNorm and Dropout), one process, --workers N
  6. the plain loop a user writes for that Dataset and model: a shuffling DataLoader with the same
     batch size and N workers, AdamW, cross entropy; no per-sample seeding
  7, 8. 5 and 6 again, with the Dataset augmenting through torch alone (DIGITS_AUGMENT=torch), as
     torchvision's transforms do: ddp_train.py then seeds one generator per sample instead of three
  9-12. a language model, examples/tinylm.py (variable-length functions of the standard library,
     padded by its collate_fn, a loss averaged over tokens): ddp_train.py against the loop a user
     writes by hand for the same Dataset, collate_fn and model, in one process and under torchrun 2x1

and reports steady-state training samples/s (the epochs after the first, training only), the time from
launch to the first finished optimizer step, and peak memory per process, as the median and min-max over
rounds; then the ratios, each taken within a round.

    python bench_ddp_train.py             # 10 rounds on the default workload, about 8 minutes on 2 cores
    python bench_ddp_train.py --quick     # 1 short round: checks that everything runs
    python bench_ddp_train.py --device cuda   # on a GPU: 1, 3, 5-8 on the GPU, 2 and 4 need 2 GPUs
    python bench_ddp_train.py --workers 2     # 5-8 with 2 DataLoader workers each (default: 0)

The baselines (3, 4, 6, 10, 12) are functions in this file; the bench runs itself with --baseline to
start them.

    python bench_ddp_train.py --gpu-modes     # make test-gpu's table: a short run in every GPU mode
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = {
    ("ddp_1", "hand_1"): 0.95,
    ("ddp_2", "tutorial_2"): 1.10,  # from the issue on simpler machinery
    ("digits_1", "digits_hand_1"): 0.95,
    ("digits_torch_1", "digits_torch_hand_1"): 0.95,
    ("lm_1", "lm_hand_1"): 0.95,  # and from the language-model issue
    ("lm_2", "lm_hand_2"): 1.0,
}


# ---------------------------------------------------------------------------
# The baselines. Same model, data and optimizer (AdamW, as a user would write it) as ddp_train.py.
# ---------------------------------------------------------------------------


def record(path, epoch, samples, seconds, first_step_at, device, tokens=None):
    """One metrics line, with the same memory figures ddp_train.py writes."""
    import torch

    # as ddp_train.py: KiB
    rec = {
        "epoch": epoch,
        "samples_per_sec": samples / seconds,
        "first_step_at": first_step_at,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if device.type == "cuda":
        rec["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    if tokens is not None:
        rec["tokens_per_sec"] = tokens / seconds
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def plain_training(opts, model, epoch_batches, samples: int, device) -> None:
    """The plain loop: AdamW steps over each epoch's (inputs, targets) batches, every epoch timed
    from its first batch's loading to its last step and recorded as ddp_train.py records it."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    first_step_at = None
    for epoch in range(opts.epochs):
        t0 = time.perf_counter()
        for xb, yb in epoch_batches(epoch):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            if first_step_at is None:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                first_step_at = time.time()
        if device.type == "cuda":
            torch.cuda.synchronize()
        record(opts.metrics, epoch + 1, samples, time.perf_counter() - t0, first_step_at, device)


def hand_written_loop(opts):
    """The loop a user writes by hand: tensors in memory, shuffled once per epoch, sliced into batches."""
    import torch

    import ddp_train

    args = ddp_train.parse_args(["--num-samples", str(opts.num_samples), "--seed", "0"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_set, _ = ddp_train.build_datasets(args)
    x, y = (t.to(device) for t in train_set.tensors)
    torch.manual_seed(0)
    model = ddp_train.build_model(args).to(device)

    def epoch_batches(epoch):
        perm = torch.randperm(len(x), device=device)
        return zip(x[perm].split(opts.batch_size), y[perm].split(opts.batch_size))

    plain_training(opts, model, epoch_batches, len(x), device)


def user_dataset_loop(opts):
    """The loop a user writes for their own Dataset: a DataLoader that shuffles, with the same batch
    size and worker count as ddp_train.py gets, over examples/digits.py's Dataset and model."""
    import torch
    from torch.utils.data import DataLoader

    import ddp_train
    from examples import digits

    args = ddp_train.parse_args(["--seed", "0"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    train_set, _ = digits.build_datasets(args)
    model = digits.build_model(args).to(device)
    loader = DataLoader(
        train_set,
        batch_size=opts.batch_size,
        shuffle=True,
        num_workers=opts.workers,
        persistent_workers=opts.workers > 0,
        pin_memory=device.type == "cuda",
    )

    def epoch_batches(epoch):
        return (
            (xb.to(device, non_blocking=True), yb.to(device, non_blocking=True))
            for xb, yb in loader
        )

    plain_training(opts, model, epoch_batches, len(train_set), device)


def tinylm_loop(opts):
    """The loop a user writes by hand for examples/tinylm.py: a DataLoader with its collate_fn (under
    torchrun: a DistributedSampler, DDP, and each rank's own token mean), AdamW, the same model."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    import ddp_train
    from examples import tinylm

    tinylm.TRAIN_SIZE, tinylm.EVAL_SIZE = opts.lm_samples, 0
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group(backend="gloo")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if opts.device == "cuda"
        else torch.device("cpu")
    )
    args = ddp_train.parse_args(["--seed", "0"])
    torch.manual_seed(0)
    train_set, _ = tinylm.build_datasets(args)
    model = tinylm.build_model(args).to(device)
    model = DDP(model) if distributed else model
    sampler = DistributedSampler(train_set) if distributed else None
    loader = DataLoader(
        train_set,
        batch_size=opts.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        collate_fn=tinylm.collate_fn,
        num_workers=opts.workers,
        persistent_workers=opts.workers > 0,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first_step_at = None
    for epoch in range(opts.epochs):
        if sampler:
            sampler.set_epoch(epoch)
        t0, tokens = time.perf_counter(), 0
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            optimizer.zero_grad(set_to_none=True)
            loss, count, _ = tinylm.compute_loss(model, batch)  # each rank's own token mean
            loss.backward()
            optimizer.step()
            tokens += count
            if first_step_at is None:
                first_step_at = time.time()
        tokens = int(tokens)
        if distributed:  # every rank's tokens, for the rate of the whole run
            total = torch.tensor([tokens])
            dist.all_reduce(total)
            tokens = int(total)
        if not distributed or dist.get_rank() == 0:
            record(
                opts.metrics,
                epoch + 1,
                len(train_set),
                time.perf_counter() - t0,
                first_step_at,
                device,
                tokens,
            )
    del model, optimizer
    gc.collect()
    if distributed:
        dist.destroy_process_group()


def tutorial_ddp(opts):
    """The tutorial DDP script: DataLoader over a TensorDataset, DistributedSampler, DDP, and the
    per-step loss.item() it uses for logging. (It releases DDP before the process group, so that
    the baseline itself never aborts at exit.)"""
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    import ddp_train

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    args = ddp_train.parse_args(["--num-samples", str(opts.num_samples), "--seed", "0"])
    train_set, _ = ddp_train.build_datasets(args)
    torch.manual_seed(0)
    model = DDP(ddp_train.build_model(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(
        train_set, batch_size=opts.batch_size, shuffle=False, sampler=DistributedSampler(train_set)
    )
    first_step_at = None
    for epoch in range(opts.epochs):
        loader.sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        for source, targets in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(source), targets)
            loss.backward()
            optimizer.step()
            loss.item()
            if first_step_at is None:
                first_step_at = time.time()
        if rank == 0:
            record(
                opts.metrics,
                epoch + 1,
                len(loader.sampler) * dist.get_world_size(),
                time.perf_counter() - t0,
                first_step_at,
                torch.device("cpu"),
            )
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------

CONFIGS = [  # (key, label, processes, program)
    ("ddp_1", "ddp_train.py, 1 process", 1, "ddp_train"),
    ("ddp_2", "ddp_train.py, torchrun 2x1", 2, "ddp_train"),
    ("hand_1", "hand-written loop, 1 process", 1, "hand"),
    ("tutorial_2", "tutorial DDP, torchrun 2x1", 2, "tutorial"),
    ("digits_1", "ddp_train.py (your Dataset)", 1, "digits"),
    ("digits_hand_1", "hand-written DataLoader loop", 1, "digits_hand"),
    ("digits_torch_1", "ddp_train.py (torch-only aug.)", 1, "digits"),
    ("digits_torch_hand_1", "hand-written, torch-only aug.", 1, "digits_hand"),
    ("lm_1", "ddp_train.py (tinylm), 1 process", 1, "lm"),
    ("lm_hand_1", "hand-written loop (tinylm)", 1, "lm_hand"),
    ("lm_2", "ddp_train.py (tinylm), 2x1", 2, "lm"),
    ("lm_hand_2", "hand-written DDP (tinylm), 2x1", 2, "lm_hand"),
]
RATIOS = [
    ("ddp_1", "hand_1"),
    ("ddp_2", "tutorial_2"),
    ("ddp_2", "ddp_1"),
    ("digits_1", "digits_hand_1"),
    ("digits_torch_1", "digits_torch_hand_1"),
    ("lm_1", "lm_hand_1"),
    ("lm_2", "lm_hand_2"),
]
BASELINES = {
    "hand": hand_written_loop,
    "tutorial": tutorial_ddp,
    "digits_hand": user_dataset_loop,
    "lm_hand": tinylm_loop,
}
# examples/tinylm.py with a smaller training set, as a user shrinks it: its module constants, set first.
TINYLM_SCRIPT = """import sys
sys.path[:0] = [{here!r}, {examples!r}]
import ddp_train
import tinylm
tinylm.TRAIN_SIZE, tinylm.EVAL_SIZE = {samples}, 0
sys.exit(ddp_train.main())
"""


def command(opts, nproc, program, metrics: Path) -> list[str]:
    common = ["--epochs", str(opts.epochs), "--batch-size", str(opts.batch_size)]
    if program.startswith(("digits", "lm")):  # the user-Dataset pairs: their own data, N workers
        common += ["--workers", str(opts.workers)]
    else:
        common += ["--num-samples", str(opts.num_samples)]
    if program in ("ddp_train", "digits", "lm"):
        trainer = {
            "ddp_train": HERE / "ddp_train.py",
            "digits": HERE / "examples/digits.py",
            "lm": metrics.parent / "tinylm_run.py",
        }[program]
        if program == "lm":
            trainer.write_text(
                TINYLM_SCRIPT.format(
                    here=str(HERE), examples=str(HERE / "examples"), samples=opts.lm_samples
                )
            )
        script = [str(trainer), *common, "--out-dir", str(metrics.parent), "--resume", "never"]
    else:
        script = [
            str(HERE / "bench_ddp_train.py"),
            "--baseline",
            program,
            *common,
            "--metrics",
            str(metrics),
            "--lm-samples",
            str(opts.lm_samples),
            "--device",
            opts.device,
        ]
    if nproc == 1:
        return [sys.executable, *script]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--standalone",
        *script,
    ]


def run_once(opts, key, nproc, program, workdir: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=workdir))
    metrics = out / "metrics.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # examples/digits.py imports ddp_train, as a user's script beside it would
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env.pop("OMP_NUM_THREADS", None)  # each configuration sets its threads as it would for a user
    env.pop("DIGITS_AUGMENT", None)
    if "_torch" in key:  # examples/digits.py augments with torch alone
        env["DIGITS_AUGMENT"] = "torch"
    if opts.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    launched = time.time()
    proc = subprocess.run(
        command(opts, nproc, program, metrics),
        env=env,
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=opts.timeout,
    )
    if proc.returncode != 0 or not metrics.exists():
        sys.exit(
            f"bench_ddp_train.py: {key} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    epochs = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = epochs[1:] or epochs[:1]
    return {
        "samples_per_sec": statistics.median(e["samples_per_sec"] for e in steady),
        "tokens_per_sec": statistics.median(e.get("tokens_per_sec", 0.0) for e in steady),
        "first_step_s": epochs[0]["first_step_at"] - launched,
        "peak_rss_mb": max(e["peak_rss_mb"] for e in epochs),
    }


# ---------------------------------------------------------------------------
# Every GPU mode once (make test-gpu): a short run each, its exit code and figures in one table
# ---------------------------------------------------------------------------


# Dense peak TFLOP/s of one GPU, for the table's MFU: (bf16 and fp16 tensor cores, fp32 without TF32).
PEAK_TFLOPS = {"H100": (989, 67), "H200": (989, 67), "A100": (312, 19.5), "L40S": (362, 91.6)}


def gpu_modes(opts) -> int:
    """A short training in every GPU mode; a table of mode, exit code, samples/s, MFU and peak GPU
    memory. What needs more GPUs than this machine has is skipped, with the reason. Returns 1 if any
    mode that ran failed."""
    import torch

    if not torch.cuda.is_available():
        print("bench_ddp_train.py --gpu-modes: no CUDA device here; nothing to run")
        return 0
    gpus, name = torch.cuda.device_count(), torch.cuda.get_device_name()
    peaks = next((p for model, p in PEAK_TFLOPS.items() if model in name), None)
    # 64 per GPU and step, plus one sample: an uneven last step (rank 0 alone gets the extra sample).
    uneven = str(64 * gpus * 40 + 1)
    short = ["--epochs", "2", "--num-samples", "32768", "--eval-samples", "1024"]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
    ]
    ddp_train = str(HERE / "ddp_train.py")
    two = "" if gpus >= 2 else "needs 2 GPUs: SyncBatchNorm syncs nothing in one process"
    uneven_run = [*torchrun, ddp_train, "--epochs", "2", "--num-samples", uneven]
    sync_bn = [*uneven_run, "--batch-norm", "--sync-bn"]
    modes = [
        ("1 GPU", [sys.executable, ddp_train, *short], ""),
        (f"torchrun, {gpus} GPU(s)", [*torchrun, ddp_train, *short], ""),
        ("--amp bf16", [*torchrun, ddp_train, *short, "--amp", "bf16"], ""),
        ("--amp fp16", [*torchrun, ddp_train, *short, "--amp", "fp16"], ""),
        ("--compile", [*torchrun, ddp_train, *short, "--compile"], ""),
        ("--sync-bn, uneven last step", sync_bn, two),
        ("--sync-bn --compile", [*sync_bn, "--compile"], two),
        ("--grad-accum 2", [*torchrun, ddp_train, *short, "--grad-accum", "2"], ""),
        (
            "digits, --workers 2",
            [*torchrun, str(HERE / "examples/digits.py"), "--epochs", "2", "--workers", "2"],
            "",
        ),
        (
            "tinylm, --amp bf16",
            [
                *torchrun,
                str(HERE / "examples/tinylm.py"),
                "--epochs",
                "1",
                "--batch-size",
                "16",
                "--amp",
                "bf16",
            ],
            "",
        ),
        ("SIGTERM, resume: bit-identical", None, ""),
    ]
    failed = 0
    print(
        f"{name} x {gpus}, torch {torch.__version__}; MFU against {peaks or 'no known peak'} TFLOP/s (bf16/fp16, "
        f"fp32)\n"
    )
    print(f"{'mode':<32} {'exit':>5} {'samples/s':>12} {'MFU':>7} {'peak GPU mem':>13}")
    with tempfile.TemporaryDirectory(prefix="gpu_modes-") as workdir:
        for label, cmd, skip in modes:
            if skip:
                print(f"{label:<32} {'-':>5}  skipped: {skip}", flush=True)
                continue
            out = Path(workdir) / label.replace(" ", "_").replace(",", "").replace("-", "").replace(
                ":", ""
            )
            if (
                peaks and cmd and "tinylm" not in label
            ):  # (tinylm's attention is not all counted on every torch)
                cmd = [*cmd, "--peak-tflops", str(peaks[0] if "--amp" in cmd else peaks[1])]
            code = (
                resume_mode(torchrun, short, out)
                if cmd is None
                else run_mode([*cmd, "--out-dir", str(out)], opts)
            )
            failed += code != 0
            last = (
                [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1:]
                if (out / "metrics.jsonl").exists()
                else [{}]
            )
            m = last[0]
            mfu = f"{100 * m['mfu']:.1f}%" if "mfu" in m else "-"
            print(
                f"{label:<32} {code:>5} {m.get('samples_per_sec', 0):>12,.0f} {mfu:>7} "
                f"{m.get('peak_gpu_mem_mb', 0):>10,.0f} MB",
                flush=True,
            )
    return 1 if failed else 0


def run_mode(cmd, opts) -> int:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        cmd, env=env, cwd=HERE, capture_output=True, text=True, timeout=opts.timeout
    )
    if proc.returncode:
        print(proc.stderr[-1500:], file=sys.stderr)
    return proc.returncode


def resume_mode(torchrun, short, out: Path) -> int:
    """torchrun stopped by SIGTERM after its first checkpoint, then the same command again: it resumes, and ends
    with bit for bit the weights of the same command run uninterrupted (1 when not)."""
    import torch

    cmd = [*torchrun, str(HERE / "ddp_train.py"), *short, "--save-every", "20"]
    whole = subprocess.run(
        [*cmd, "--out-dir", str(out / "whole")], cwd=HERE, capture_output=True, timeout=600
    )
    proc = subprocess.Popen(
        [*cmd, "--out-dir", str(out)],
        cwd=HERE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while (
        not (out / "checkpoint.pt").exists() and proc.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    proc.terminate()
    proc.wait(60)
    again = subprocess.run(
        [*cmd, "--out-dir", str(out)], cwd=HERE, capture_output=True, text=True, timeout=600
    )
    if whole.returncode or again.returncode or "resumed from" not in again.stdout:
        print(again.stdout[-1500:], again.stderr[-1500:], file=sys.stderr)
        return whole.returncode or again.returncode or 1
    a, b = (torch.load(d / "model.pt", weights_only=True) for d in (out, out / "whole"))
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    if differ:
        print(f"resumed run differs from the uninterrupted one in {differ}", file=sys.stderr)
    return 1 if differ else 0


def rate_of(key: str) -> str:
    """What a configuration's throughput is measured in: tokens for the language model, else samples."""
    return "tokens_per_sec" if key.startswith("lm") else "samples_per_sec"


def spread(values, fmt) -> str:
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


# ---------------------------------------------------------------------------
# The size of ddp_train.py: code tokens, as Python's tokenizer finds them
# ---------------------------------------------------------------------------


def code_tokens(path=HERE / "ddp_train.py") -> dict:
    """The file's code tokens (Python's tokenize, without comments, strings, newlines, indentation and f-string
    parts: what a reader has to read as code, whatever the formatting), the lesson's (the tokens above the line
    "THE LESSON ENDS HERE"), and the names defined below that line which the lesson uses."""
    import ast
    import io
    import tokenize

    source = Path(path).read_text()
    skip = {
        tokenize.COMMENT,
        tokenize.STRING,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    skip |= {
        getattr(tokenize, n)
        for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
        if hasattr(tokenize, n)
    }
    tokens = [
        t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in skip
    ]
    divider = next(
        i for i, line in enumerate(source.splitlines(), 1) if "THE LESSON ENDS HERE" in line
    )
    tree = ast.parse(source)
    below = set()  # the functions, classes and constants defined below the divider
    for node in tree.body[::-1]:
        if node.lineno < divider:
            break
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            below.add(node.name)
        elif isinstance(node, ast.Assign):
            below |= {
                n.id for target in node.targets for n in ast.walk(target) if isinstance(n, ast.Name)
            }
    used = {
        n.id
        for node in tree.body
        if node.lineno < divider
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and n.id in below
    }
    return {
        "total": len(tokens),
        "lesson": sum(t.start[0] < divider for t in tokens),
        "names": sorted(used),
    }


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="one short round (4,096 samples, 2 epochs)")
    p.add_argument(
        "--rounds",
        type=int,
        default=10,
        help="interleaved rounds (on a noisy machine, fewer rounds give unsteady medians)",
    )
    p.add_argument(
        "--epochs", type=int, default=6, help="epochs per run; the first is excluded as warm-up"
    )
    p.add_argument("--num-samples", type=int, default=32768)
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="DataLoader workers of the user-Dataset pairs (5-8): ddp_train.py --workers, num_workers",
    )
    p.add_argument(
        "--lm-samples", type=int, default=400, help="examples/tinylm.py's training set (functions)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--timeout", type=float, default=600, help="seconds for any one run")
    p.add_argument(
        "--gpu-modes",
        action="store_true",
        help="make test-gpu: a short run in every GPU mode, as a table",
    )
    p.add_argument(
        "--size", action="store_true", help="ddp_train.py's size in code tokens, and its lesson's"
    )
    p.add_argument("--baseline", choices=tuple(BASELINES), help=argparse.SUPPRESS)
    p.add_argument("--metrics", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.baseline:
        sys.path.insert(0, str(HERE))
        return BASELINES[opts.baseline](opts)
    if opts.gpu_modes:
        return gpu_modes(opts)
    if opts.size:
        size = code_tokens()
        print(
            f"ddp_train.py: {size['total']:,} code tokens; the lesson {size['lesson']:,}, using "
            f"{len(size['names'])} names of the machinery: {', '.join(size['names'])}"
        )
        return 0
    if opts.quick:
        opts.rounds, opts.epochs, opts.num_samples, opts.lm_samples = 1, 2, 4096, 32

    import torch

    configs = CONFIGS
    if opts.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_ddp_train.py: --device cuda, but torch sees no CUDA device")
        if torch.cuda.device_count() < 2:  # two processes need two GPUs
            configs = [c for c in CONFIGS if c[2] == 1]
    where = torch.cuda.get_device_name() if opts.device == "cuda" else f"{os.cpu_count()} CPU cores"
    print(
        f"workload: batch {opts.batch_size}/process, {opts.epochs} epochs (first excluded), "
        f"{opts.rounds} interleaved round(s); torch {torch.__version__}, {where}\n"
        f"  data: {opts.num_samples:,} in-memory samples; your Dataset: examples/digits.py's training set, "
        f"{opts.workers} DataLoader worker(s)",
        flush=True,
    )

    results = {key: [] for key, *_ in configs}
    with tempfile.TemporaryDirectory(prefix="bench_ddp_train-") as workdir:
        for round_no in range(opts.rounds):
            for key, label, nproc, program in configs:
                results[key].append(run_once(opts, key, nproc, program, Path(workdir)))
            print(f"  round {round_no + 1}/{opts.rounds} done", flush=True)

    print(
        f"\n{'configuration':<34} {'samples/s (tinylm: tokens/s), median (min-max)':>46} {'launch->first step':>22} "
        f"{'peak RSS/process':>17}"
    )
    for key, label, *_ in configs:
        runs, rate = results[key], rate_of(key)
        print(
            f"{label:<34} {spread([r[rate] for r in runs], lambda v: f'{v:,.0f}'):>46} "
            f"{spread([r['first_step_s'] for r in runs], lambda v: f'{v:.2f} s'):>22} "
            f"{spread([r['peak_rss_mb'] for r in runs], lambda v: f'{v:.0f} MB'):>17}"
        )
    print(f"\n{'ratio (per round)':<70} {'median (min-max)':>20} {'target':>8}")
    labels = {key: label for key, label, *_ in configs}
    for a, b in RATIOS:
        if a in results and b in results:
            ratios = [x[rate_of(a)] / y[rate_of(b)] for x, y in zip(results[a], results[b])]
            target = f">= {TARGETS[a, b]:.2f}" if (a, b) in TARGETS else ""
            print(
                f"{labels[a] + ' / ' + labels[b]:<70} {spread(ratios, lambda v: f'{v:.2f}x'):>20} {target:>8}"
            )
    if opts.quick:
        print(
            "\n--quick measures one short epoch per configuration: it checks that everything runs; its figures\n"
            "swing with the machine's noise. Without --quick the figures are medians over interleaved rounds."
        )


if __name__ == "__main__":
    sys.exit(main())
