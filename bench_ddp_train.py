"""bench_ddp_train.py measures, side by side, whether ddp_train.py's machinery costs speed.

One invocation runs the configurations below. It interleaves them in rounds, so that the machine's
drift cancels out.

  ddp_1       ddp_train.py, one process
  hand_1      the loop that a user writes by hand over the same model, data and optimizer. The
              tensors stay in memory, and the loop shuffles them once an epoch and slices them into
              batches.
  ddp_2       ddp_train.py under torchrun, 2 processes x 1 thread
  tutorial_2  the DDP tutorial's loop from pytorch/examples, under torchrun 2 x 1. It uses a
              DataLoader over a TensorDataset, a DistributedSampler, and loss.item() every step.
  lm_1, lm_2  examples/tinylm.py through ddp_train.py, in one process and under torchrun 2 x 1.
              tinylm trains on padded functions of the standard library, with a token mean.
  lm_hand_*   the loop that a user writes by hand for the same Dataset, collate_fn, model and
              optimizer

It reports the training throughput of the epochs after the first, in samples/s, or in tokens/s for
tinylm. It gives the median and the min-max over the rounds. Then it reports the ratios, and it
takes each ratio within a round.

    python bench_ddp_train.py               # 6 rounds take about 8 minutes on 2 cores.
    python bench_ddp_train.py --quick       # 1 short round checks that everything runs.
    python bench_ddp_train.py --against DIR/ddp_train.py
        # This also runs every configuration of the script with another version of it, side by
        # side. Make that version with git show REV:ddp_train.py > DIR/ddp_train.py. Where that
        # version's examples/tinylm.py differs, put it in DIR too, as tinylm.py.
        # --only ddp_1,against_1 runs only the configurations that it names.
    python bench_ddp_train.py --gpu-modes
        # This prints make test-gpu's table, which has a short run in every GPU mode.
    python bench_ddp_train.py --resume-memory [--against DIR/ddp_train.py]
        # This measures the host memory of 2 ranks while they resume a checkpoint of about 600 MB,
        # up to their first step. It samples every 10 ms. It reports the peak of their PSS summed,
        # where a page that both ranks map counts once. It also reports the peak of their anonymous
        # memory summed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Each key maps to a pair of the number of processes and the program.
CONFIGS = {
    "ddp_1": (1, "ddp_train"),
    "hand_1": (1, "hand"),
    "ddp_2": (2, "ddp_train"),
    "tutorial_2": (2, "tutorial"),
    "lm_1": (1, "lm"),
    "lm_hand_1": (1, "lm_hand"),
    "lm_2": (2, "lm"),
    "lm_hand_2": (2, "lm_hand"),
}
RATIOS = {("ddp_1", "hand_1"): 0.95, ("ddp_2", "tutorial_2"): 1.10, ("lm_1", "lm_hand_1"): 0.97}
RATIOS[("lm_2", "lm_hand_2")] = 0.97
# --against OLD.py adds the same two runs with another version of the script. A ratio of about 1
# means "not worse". OLD.py must be named ddp_train.py and sit in a folder of its own, because
# tinylm imports it by that name.
AGAINST = {"against_1": (1, "against"), "against_2": (2, "against")}
AGAINST |= {"against_lm_1": (1, "against_lm"), "against_lm_2": (2, "against_lm")}
AGAINST_RATIOS = {("ddp_1", "against_1"): 1.0, ("ddp_2", "against_2"): 1.0}
AGAINST_RATIOS |= {("lm_1", "against_lm_1"): 1.0, ("lm_2", "against_lm_2"): 1.0}
TINYLM = """import sys
sys.path[:0] = [{here!r}, {examples!r}]
import ddp_train, tinylm
tinylm.TRAIN_SIZE, tinylm.EVAL_SIZE = {samples}, 0
sys.exit(ddp_train.main())
"""


# ---------------------------------------------------------------------------
# The baselines follow. Each one writes an epoch record as ddp_train.py does, with train_samples,
# train_tokens and epoch_s.
# ---------------------------------------------------------------------------


def record(opts, epoch, samples, seconds, tokens=None):
    with open(opts.metrics, "a") as f:
        f.write(
            json.dumps(
                dict(epoch=epoch, train_samples=samples, train_tokens=tokens, epoch_s=seconds)
            )
            + "\n"
        )


def hand_written_loop(opts):
    import torch
    import torch.nn.functional as F

    import ddp_train

    args = ddp_train.parse_args(["--num-samples", str(opts.num_samples)])
    x, y = ddp_train.build_datasets(args)[0].tensors
    torch.manual_seed(0)
    model = ddp_train.build_model(args)
    optimizer = ddp_train.build_optimizer(args, model, plan=None)
    for epoch in range(opts.epochs):
        t0, perm = time.perf_counter(), torch.randperm(len(x))
        for xb, yb in zip(x[perm].split(opts.batch_size), y[perm].split(opts.batch_size)):
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        record(opts, epoch + 1, len(x), time.perf_counter() - t0)


def tutorial_ddp(opts):
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import ddp_train

    dist.init_process_group("gloo")
    args = ddp_train.parse_args(["--num-samples", str(opts.num_samples)])
    train_set = TensorDataset(*ddp_train.build_datasets(args)[0].tensors)
    torch.manual_seed(0)
    model = DDP(ddp_train.build_model(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=opts.batch_size, sampler=sampler)
    for epoch in range(opts.epochs):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        for source, targets in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(source), targets)
            loss.backward()
            optimizer.step()
            loss.item()
        if dist.get_rank() == 0:
            record(opts, epoch + 1, len(sampler) * 2, time.perf_counter() - t0)
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


def tinylm_loop(opts):
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
        dist.init_process_group("gloo")
    args = ddp_train.parse_args([])
    torch.manual_seed(0)
    train_set, _ = tinylm.build_datasets(args)
    model = tinylm.build_model(args)
    optimizer = ddp_train.build_optimizer(args, model, plan=None)
    model = DDP(model) if distributed else model
    sampler = DistributedSampler(train_set) if distributed else None
    loader = DataLoader(
        train_set,
        opts.batch_size,
        shuffle=not sampler,
        sampler=sampler,
        collate_fn=functools.partial(tinylm.collate_fn, args=args, training=True),
    )
    for epoch in range(opts.epochs):
        if sampler:
            sampler.set_epoch(epoch)
        t0, tokens = time.perf_counter(), 0
        for batch in loader:
            # Each rank takes its own token mean.
            count = tinylm.count_items(batch)
            loss, _ = tinylm.compute_loss(model, batch, args)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens += count
        tokens = torch.tensor(int(tokens))
        if distributed:
            dist.all_reduce(tokens)
        if not distributed or dist.get_rank() == 0:
            record(opts, epoch + 1, len(train_set), time.perf_counter() - t0, int(tokens))
    del model, optimizer
    gc.collect()
    if distributed:
        dist.destroy_process_group()


BASELINES = {"hand": hand_written_loop, "tutorial": tutorial_ddp, "lm_hand": tinylm_loop}


# ---------------------------------------------------------------------------
# The runner follows. It runs each configuration and prints the results.
# ---------------------------------------------------------------------------


def command(opts, nproc, program, out: Path) -> list[str]:
    common = ["--epochs", str(opts.epochs), "--batch-size", str(opts.batch_size)]
    if program in ("ddp_train", "against"):
        path = opts.against if program == "against" else HERE / "ddp_train.py"
        script = [str(path), *common, "--num-samples", str(opts.num_samples)]
    elif program in ("lm", "against_lm"):
        here = Path(opts.against).parent if program == "against_lm" else HERE
        (out / "tinylm_run.py").write_text(
            TINYLM.format(here=str(here), examples=str(HERE / "examples"), samples=opts.lm_samples)
        )
        script = [str(out / "tinylm_run.py"), *common]
    else:
        script = [str(HERE / "bench_ddp_train.py"), "--baseline", program, *common]
        script += ["--num-samples", str(opts.num_samples), "--lm-samples", str(opts.lm_samples)]
        script += ["--metrics", str(out / "metrics.jsonl")]
    if program in ("ddp_train", "against", "lm", "against_lm"):
        script += ["--out-dir", str(out)]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [sys.executable, *(launcher if nproc > 1 else []), *script]


def run_once(opts, key, workdir: Path) -> float:
    """Run one configuration, and return its median throughput over the epochs after the first."""
    nproc, program = {**CONFIGS, **AGAINST}[key]
    out = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=workdir))
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    # Each configuration sets its threads as it would for a user.
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(
        command(opts, nproc, program, out), env=env, cwd=HERE, capture_output=True, text=True
    )
    if proc.returncode:
        sys.exit(
            f"bench_ddp_train.py: {key} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [e for e in epochs if e.get("kind", "epoch") == "epoch"]
    counted = "train_tokens" if "lm" in key else "train_samples"
    return statistics.median(e[counted] / e["epoch_s"] for e in epochs[1:] or epochs)


def spread(values, fmt) -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return fmt(mid) if len(values) == 1 else f"{fmt(mid)} ({fmt(low)}-{fmt(high)})"


def benchmark(opts):
    import torch

    print(
        f"{opts.rounds} interleaved round(s) of {opts.epochs} epochs (the first left out), batch "
        f"{opts.batch_size}/process; torch {torch.__version__}, {os.cpu_count()} CPU cores",
        flush=True,
    )
    configs = {**CONFIGS, **(AGAINST if opts.against else {})}
    if opts.only:  # A shorter run measures only the configurations that it names.
        configs = {key: configs[key] for key in opts.only.split(",")}
    ratios = {**RATIOS, **(AGAINST_RATIOS if opts.against else {})}
    ratios = {pair: target for pair, target in ratios.items() if set(pair) <= set(configs)}
    results = {key: [] for key in configs}
    with tempfile.TemporaryDirectory(prefix="bench_ddp_train-") as workdir:
        for round_no in range(opts.rounds):
            for key in configs:
                results[key].append(run_once(opts, key, Path(workdir)))
            print(f"  round {round_no + 1}/{opts.rounds} done", flush=True)
    print(f"\n{'configuration':<14} {'samples/s (lm_*: tokens/s), median (min-max)':>48}")
    for key, rates in results.items():
        print(f"{key:<14} {spread(rates, lambda v: f'{v:,.0f}'):>48}")
    print(f"\n{'ratio (within each round)':<28} {'median (min-max)':>24} {'target':>8}")
    for (a, b), target in ratios.items():
        ratios = [x / y for x, y in zip(results[a], results[b])]
        print(
            f"{a + ' / ' + b:<28} {spread(ratios, lambda v: f'{v:.2f}x'):>24} {'>= %.2f' % target:>8}"
        )


# ---------------------------------------------------------------------------
# make test-gpu prints this table, which has a short run in every GPU mode.
# ---------------------------------------------------------------------------


def gpu_modes(opts) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench_ddp_train.py --gpu-modes: no CUDA device here; nothing to run")
        return 0
    gpus, py = torch.cuda.device_count(), sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    ddp, digits, lm = (
        str(HERE / p) for p in ("ddp_train.py", "examples/digits.py", "examples/tinylm.py")
    )
    short = ["--epochs", "2", "--eval-samples", "1024"]
    modes = [
        ("1 GPU", [py, ddp, *short], ""),
        (f"torchrun, {gpus} GPU(s)", [*torchrun, ddp, *short], ""),
        ("--amp bf16", [*torchrun, ddp, *short, "--amp", "bf16"], ""),
        ("--amp fp16", [*torchrun, ddp, *short, "--amp", "fp16"], ""),
        ("--compile", [*torchrun, ddp, *short, "--compile"], ""),
        ("--grad-accum 2", [*torchrun, ddp, *short, "--grad-accum", "2"], ""),
        (
            "digits, --sync-bn",
            [*torchrun, digits, "--epochs", "2", "--sync-bn"],
            "" if gpus > 1 else "needs 2 GPUs",
        ),
        ("digits, --workers 2", [*torchrun, digits, "--epochs", "2", "--workers", "2"], ""),
        (
            "tinylm, --amp bf16",
            [*torchrun, lm, "--epochs", "1", "--batch-size", "16", "--amp", "bf16"],
            "",
        ),
        (
            "SIGTERM, resume: bit-identical",
            [*torchrun, ddp, *short, "--save-every", "50"],
            "resume",
        ),
    ]
    env = dict(os.environ, PYTHONPATH=str(HERE))
    print(f"{torch.cuda.get_device_name()} x {gpus}, torch {torch.__version__}\n")
    print(f"{'mode':<32} {'exit':>5} {'samples/s':>12}")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="gpu_modes-") as workdir:
        for i, (label, cmd, note) in enumerate(modes):
            out = Path(workdir) / str(i)
            if note and note != "resume":
                print(f"{label:<32} {'-':>5}  skipped: {note}", flush=True)
                continue

            def run(out_dir, cmd=cmd):
                return subprocess.run(
                    [*cmd, "--out-dir", str(out_dir)], env=env, capture_output=True, text=True
                )

            if note == "resume":
                code = resumed(cmd, out, env, run(Path(workdir) / "whole"))
            else:
                proc = run(out)
                code = proc.returncode
                print(proc.stderr[-1500:] if code else "", end="", file=sys.stderr)
            failed += code != 0
            lines = (
                (out / "metrics.jsonl").read_text().splitlines()
                if (out / "metrics.jsonl").exists()
                else []
            )
            last = [json.loads(x) for x in lines if '"epoch"' in x][-1:] or [{}]
            rate = last[0].get("train_samples", 0) / last[0].get("epoch_s", 1)
            print(f"{label:<32} {code:>5} {rate:>12,.0f}", flush=True)
    return 1 if failed else 0


def resumed(cmd, out: Path, env, whole) -> int:
    """Stop the run with SIGTERM after its first checkpoint, then rerun it. Return 0 when it ends
    with bit for bit the weights of the same run uninterrupted."""
    import torch

    proc = subprocess.Popen(
        [*cmd, "--out-dir", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    while not (out / "checkpoint.pt").exists() and proc.poll() is None:
        time.sleep(0.05)
    proc.terminate()
    proc.wait(120)
    again = subprocess.run([*cmd, "--out-dir", str(out)], env=env, capture_output=True, text=True)
    if whole.returncode or again.returncode or "resumed from" not in again.stdout:
        print(again.stdout[-1500:], again.stderr[-1500:], file=sys.stderr)
        return whole.returncode or again.returncode or 1
    a, b = (torch.load(d / "model.pt", weights_only=True) for d in (out, out.parent / "whole"))
    return 0 if all(torch.equal(a[k], b[k]) for k in a) else 1


# ---------------------------------------------------------------------------
# This part measures the size of ddp_train.py.
# ---------------------------------------------------------------------------


WIDE = """import sys
sys.path.insert(0, {here!r})
import torch.nn as nn
import ddp_train
# This width gives 50M parameters. They take 200 MB of weights and 400 MB of AdamW's state, so the
# checkpoint takes 600 MB.
width = 4096
ddp_train.build_model = lambda args: nn.Sequential(
    nn.Linear(ddp_train.FEATURES, width), *[nn.Linear(width, width) for _ in range(3)],
    nn.Linear(width, ddp_train.CLASSES),
)
sys.exit(ddp_train.main())
"""


def memory_of(pids) -> tuple[int, int]:
    """Return the PSS and the anonymous memory of these processes, each summed, in bytes."""
    pss = anon = 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().split()
            status = Path(f"/proc/{pid}/status").read_text().split()
        except OSError:
            continue
        pss += int(rollup[rollup.index("Pss:") + 1]) * 1024
        anon += int(status[status.index("RssAnon:") + 1]) * 1024
    return pss, anon


def workers_of(pid) -> list[int]:
    """Return the processes that torchrun started. The argument pid is torchrun's."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as f:
            children += [int(c) for c in f.read().split()]
    return children


def resume_memory(opts) -> int:
    """Train one step of a wide model on torchrun 2, which writes a checkpoint of about 600 MB.
    Then resume it on torchrun 2, and sample the two ranks' memory until the header that precedes
    the first step. Do this with this script, and with the --against script beside it. From the
    first step on, the optimizer's state is in memory anyway, and on the CPU it is the restored
    tensors themselves."""
    scripts = {"this": HERE}
    if opts.against:
        scripts["against"] = Path(opts.against).parent
    for name, directory in scripts.items():
        work = Path(tempfile.mkdtemp(prefix=f"resume-memory-{name}-"))
        (work / "wide.py").write_text(WIDE.format(here=str(directory)))
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        flags = ["--nproc_per_node=2", str(work / "wide.py"), "--num-samples", "128"]
        flags += ["--batch-size", "32", "--eval-samples", "0", "--out-dir", str(work / "out")]
        subprocess.run([*launcher, *flags, "--max-steps", "1"], env=env, check=True)
        size = (work / "out/checkpoint.pt").stat().st_size
        log = work / "resumed.out"
        with open(log, "w") as out:
            resumed = subprocess.Popen([*launcher, *flags, "--max-steps", "2"], env=env, stdout=out)
        peak_pss = peak_anon = 0
        while resumed.poll() is None and "global batch" not in log.read_text():
            pss, anon = memory_of(workers_of(resumed.pid))
            peak_pss, peak_anon = max(peak_pss, pss), max(peak_anon, anon)
            time.sleep(0.01)
        resumed.wait()
        print(
            f"{name}: a checkpoint of {size / 2**20:,.0f} MiB resumed on 2 ranks, up to the first "
            f"step: peak PSS "
            f"{peak_pss / 2**20:,.0f} MiB, peak anonymous memory {peak_anon / 2**20:,.0f} MiB "
            f"(both summed over the ranks; exit {resumed.returncode})"
        )
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one short round (4,096 samples, 2 epochs)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    p.add_argument("--epochs", type=int, default=6, help="epochs per run; the first is left out")
    p.add_argument("--num-samples", type=int, default=32768)
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--lm-samples", type=int, default=400, help="examples/tinylm.py's functions")
    p.add_argument(
        "--gpu-modes", action="store_true", help="a short run in every GPU mode, as a table"
    )
    p.add_argument("--against", help="another version of ddp_train.py, run beside this one")
    p.add_argument("--only", help="run only these configurations, as in ddp_1,against_1")
    p.add_argument(
        "--resume-memory", action="store_true", help="the ranks' memory as they resume 600 MB"
    )
    p.add_argument("--baseline", choices=tuple(BASELINES), help=argparse.SUPPRESS)
    p.add_argument("--metrics", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.baseline:
        sys.path.insert(0, str(HERE))
        return BASELINES[opts.baseline](opts)
    if opts.gpu_modes:
        return gpu_modes(opts)
    if opts.resume_memory:
        return resume_memory(opts)
    if opts.quick:
        opts.rounds, opts.epochs, opts.num_samples, opts.lm_samples = 1, 2, 4096, 256
    return benchmark(opts)


if __name__ == "__main__":
    sys.exit(main())
