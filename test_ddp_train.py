"""Tests for ddp_train.py: the real script, in real processes, with real process groups (gloo on
CPU), organised by feature. The launch harness is in conftest.py."""

from __future__ import annotations

import ast
import json
import math
import os
import pickle
import re
import shlex
import signal
import socket
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ddp_train
from conftest import (
    CORES,
    FINAL_STATES,
    HAS_CUDA,
    PY,
    ROOT,
    RUN_MULTI,
    SCRIPT,
    VARIANTS,
    Launch,
    Result,
    assert_only_rank0_files,
    assert_same_run,
    assert_same_weights,
    clean_env,
    default_args,
    edited_copy,
    finish,
    free_port,
    fresh_clone,
    last_line,
    node_env,
    python_cmd,
    resumed_at,
    run,
    send,
    sh,
    start_nodes,
    torchrun_cmd,
    wait_for_checkpoint,
    worker_pids,
)

# A small workload: 2 epochs, 32 samples per process and step. 1000 divides by 2 and 4
# processes, and not by the global batch (a short last step).
SMALL = ["--num-samples", "1000", "--eval-samples", "301", "--epochs", "2", "--batch-size", "32"]
README = (ROOT / "README.md").read_text()
gpu = pytest.mark.gpu
multinode = pytest.mark.multinode
# each pytest-xdist worker starts clusters of its own, their job ids apart
slurm = pytest.mark.slurm


# ---------------------------------------------------------------------------
# Launch modes: each completes and writes model.pt once
# ---------------------------------------------------------------------------


def check_completed_run(r: Result, world_size: int, launcher: str):
    assert f"{launcher}, world size {world_size}" in r.stdout, r
    assert r.stdout.count("saved ") == 1, r  # rank 0 alone speaks and saves
    assert [m["world_size"] for m in r.metrics] == [world_size, world_size]
    assert_only_rank0_files(r.out_dir)
    model = ddp_train.build_model(default_args())
    model.load_state_dict(r.weights)  # plain, strict: no "module." or "_orig_mod." prefixes


@pytest.mark.tier
@pytest.mark.fast
def test_plain_python_runs_one_process_without_process_group(tmp_path):
    r = run(python_cmd(*SMALL), tmp_path, env=clean_env(OMP_NUM_THREADS=None))
    check_completed_run(r, 1, "python")
    # all cores for one process
    assert f"no process group, cpu, {CORES} thread(s)/process" in r.stdout


@pytest.mark.parametrize("nproc", [1, 2])
def test_torchrun_single_node(tmp_path, nproc):
    check_completed_run(run(torchrun_cmd(nproc, *SMALL), tmp_path), nproc, "torchrun")


@pytest.mark.tier
def test_spawn_starts_local_processes_itself(tmp_path):
    r = run(python_cmd(*SMALL, "--spawn", 2), tmp_path, env=clean_env(OMP_NUM_THREADS=None))
    check_completed_run(r, 2, "spawn")
    # the cores shared between the processes
    assert f"{max(1, CORES // 2)} thread(s)/process" in r.stdout


@pytest.mark.tier
@pytest.mark.parametrize("helper", ["run_single.sh", "run_multi_node.sh"])
def test_the_launch_helpers_run_a_script_of_yours_that_imports_ddp_train(tmp_path, helper):
    # examples/digits.py has no ddp_train.py beside it: the helper makes the one beside itself importable.
    yours, multi = ROOT / "examples" / "digits.py", helper == "run_multi_node.sh"
    cmd = [
        str(ROOT / helper),
        *(["--script", yours, "--nproc-per-node", 2] if multi else []),
        "--epochs",
        1,
    ]
    r = run(
        cmd,
        tmp_path,
        cwd=tmp_path,
        env=clean_env(PYTHON=PY, PYTHONPATH=None, SCRIPT=None if multi else yours),
    )
    assert "1,437 train / 360 eval samples" in r.stdout, r
    assert [m["world_size"] for m in r.metrics] == [2 if multi else 1]


def test_user_thread_setting_is_respected(tmp_path):
    # Unset, one process would take every core (test_plain_python_runs_one_process_without_process_group).
    r = run(python_cmd(*SMALL), tmp_path, env=clean_env(OMP_NUM_THREADS=1))
    assert "1 thread(s)/process" in r.stdout


@pytest.mark.tier
def test_legacy_distributed_launch_passes_local_rank_argument(tmp_path):
    # torch.distributed.launch is torchrun's agent too, plus the --local-rank argument.
    cmd = [
        PY,
        "-m",
        "torch.distributed.launch",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        SCRIPT,
        *SMALL,
    ]
    check_completed_run(run(cmd, tmp_path), 2, "torchrun")


@pytest.mark.fast
@pytest.mark.parametrize("spelling", ["--local-rank=1", "--local_rank=1"])
def test_both_legacy_local_rank_spellings_parse(spelling):
    assert ddp_train.parse_args([spelling]).local_rank == 1


def test_slurm_tasks_find_master_from_nodelist_and_port_from_job_id(tmp_path):
    # srun's variables for 2 tasks on one node. MASTER_ADDR is unset: it comes from the first host
    # of the node list; MASTER_PORT is unset: every task derives it from the job id.
    port = free_port(15000, 35000)
    slurm = dict(
        SLURM_NTASKS=2,
        SLURM_STEP_NUM_TASKS=2,
        SLURM_NTASKS_PER_NODE=2,
        SLURM_JOB_ID=port - 15000,
        SLURM_JOB_NODELIST="127.0.0.[1-2]",
    )
    out_dir = tmp_path / "out"
    tasks = [
        Launch(
            python_cmd(*SMALL, "--out-dir", out_dir),
            tmp_path,
            f"task{i}",
            env=clean_env(**slurm, SLURM_PROCID=i, SLURM_LOCALID=i),
        )
        for i in range(2)
    ]
    codes = finish(tasks)
    assert codes == [0, 0], tasks[0].stderr + tasks[1].stderr
    check_completed_run(Result.of(tasks[0], out_dir), 2, "slurm")
    assert tasks[1].stdout == ""  # rank 1 prints nothing


@pytest.mark.fast
def test_sbatch_script_running_python_directly_is_one_process(tmp_path):
    # Inside an sbatch script (no srun) SLURM_NTASKS may be 4, but this is one process, not a task.
    env = clean_env(
        SLURM_NTASKS=4, SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_JOB_ID=7, SLURM_JOB_NODELIST="n[1-4]"
    )
    check_completed_run(run(python_cmd(*SMALL), tmp_path, env=env), 1, "python")


def test_two_torchrun_nodes_on_localhost_only_rank0_writes(tmp_path):
    # Two "nodes", each one torchrun with one process, each in its own directory with a
    # relative --out-dir: node 1's directory must stay empty.
    port = free_port()
    nodes = []
    for node_rank in range(2):
        cwd = tmp_path / f"node{node_rank}"
        cwd.mkdir()
        cmd = [
            PY,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=1",
            f"--node_rank={node_rank}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            SCRIPT,
            *SMALL,
            "--out-dir",
            "out",
        ]
        nodes.append(Launch(cmd, tmp_path, f"node{node_rank}", cwd=cwd))
    codes = finish(nodes)
    assert codes == [0, 0], nodes[0].stderr + nodes[1].stderr
    check_completed_run(Result.of(nodes[0], tmp_path / "node0" / "out"), 2, "torchrun")
    assert not (tmp_path / "node1" / "out").exists()


@pytest.mark.tier
@pytest.mark.fast
def test_importing_starts_nothing():
    r = subprocess.run(
        [PY, "-c", "import ddp_train, torch.distributed as d; print(d.is_initialized())"],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.strip() == "False" and r.returncode == 0, r.stderr


def test_repeated_torchrun_runs_never_abort_at_exit(tmp_path):
    # The classic gloo abort ("terminate called without an active exception") hit about one run in
    # three when the process group died before the DDP model. run() checks every run of the suite for
    # it; here two clean exits in a row of the smallest torchrun run.
    tiny = ["--num-samples", "256", "--eval-samples", "64", "--epochs", "1", "--batch-size", "32"]
    for i in range(2):
        r = run(torchrun_cmd(2, *tiny), tmp_path, out=f"out{i}")
        assert "terminate called" not in r.stderr, r


# ---------------------------------------------------------------------------
# A newcomer's first commands: each script and each make target has an out-dir of its own, so that
# one's checkpoint (another world size, another model) never stops another's auto-resume
# ---------------------------------------------------------------------------

TINY = ["--epochs", "1", "--num-samples", "256", "--eval-samples", "64"]  # a second of training


def typed(cmd, tmp_path, name, repo, env=None) -> Launch:
    """cmd run to its end in repo as a user types it (no --out-dir added): it must succeed."""
    env = env or clean_env(MAKEFLAGS=None, MAKELEVEL=None, MFLAGS=None)
    with Launch(cmd, tmp_path, name, env=env, cwd=repo) as launch:
        assert launch.wait(120) == 0, f"{launch.cmd}\n{launch.stdout}\n{launch.stderr}"
    return launch


@pytest.mark.tier
def test_make_train_then_train_cpu_then_train_again_each_target_continues_its_own_run(tmp_path):
    repo = fresh_clone(tmp_path)
    first, cpu, again = [
        typed(["make", "-s", target, f"ARGS={shlex.join(TINY)}"], tmp_path, f"{i}-{target}", repo)
        for i, target in enumerate(["train", "train-cpu", "train"])
    ]
    assert "saved out/train/ddp_train/model.pt" in first.stdout, first.stdout
    assert (
        "torchrun, world size 2" in cpu.stdout
        and "saved out/train-cpu/ddp_train/model.pt" in cpu.stdout
    ), cpu.stdout
    # its own, resumed
    assert "out/train/ddp_train/checkpoint.pt holds a finished run" in again.stdout, again.stdout
    # A script of yours has its own too; an --out-dir in ARGS wins (argparse takes the last), and make train
    # puts the target's after run_single.sh's own --gpu N, which must come first.
    dry = lambda *a: subprocess.run(
        ["make", "-n", "-s", *a],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(MAKEFLAGS=None, MAKELEVEL=None, MFLAGS=None),
    ).stdout.rstrip()
    cpu_dry = dry("train-cpu", "SCRIPT=examples/digits.py", "ARGS=--out-dir mine")
    assert (
        " SCRIPT=examples/digits.py ./run_multi_node.sh --out-dir out/train-cpu/digits --out-dir mine"
        in cpu_dry
    )
    assert dry("train", "ARGS=--gpu 1 --out-dir mine").endswith(
        "./run_single.sh --gpu 1 --out-dir out/train/ddp_train --out-dir mine"
    )
    assert dry("train-multinode").endswith(
        "./run_multi_node.sh --out-dir out/train-multinode/ddp_train"
    )


@pytest.mark.tier
def test_make_setup_offline_reuses_the_torch_of_the_python_that_makes_it_and_says_what_it_lacks(
    tmp_path,
):
    # An offline GPU node: its image's python (often a venv's own, as this suite's interpreter is) imports torch,
    # numpy and pytest; pip reaches no registry. make setup, make train and make test-gpu must work there.
    # The image's python: a venv whose site-packages hold this suite's, but for pytest-xdist and tensorboard
    # (optional: each missing one is one line, and setup goes on).
    image = tmp_path / "image"
    subprocess.run([PY, "-m", "venv", "--without-pip", image], check=True, timeout=120)
    packages = Path(
        subprocess.run(
            [
                image / "bin" / "python",
                "-c",
                "import sysconfig; print(sysconfig.get_path('purelib'))",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    ours = Path(torch.__file__).parent.parent
    for entry in ours.iterdir():
        if not entry.name.startswith(
            ("xdist", "pytest_xdist", "tensorboard")
        ) and not entry.name.endswith(".pth"):
            (packages / entry.name).symlink_to(entry)
    repo = fresh_clone(tmp_path)
    shutil.rmtree(repo / ".venv")
    offline = clean_env(
        MAKEFLAGS=None,
        MAKELEVEL=None,
        MFLAGS=None,
        PIP_NO_INDEX=1,
        PIP_FIND_LINKS="",
        PIP_CONFIG_FILE=os.devnull,
    )
    make = lambda *a, env=offline: subprocess.run(
        ["make", "-s", *a, f"PYTHON={image / 'bin' / 'python'}"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    r = make("setup")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"torch {torch.__version__} ready in .venv" in r.stdout.splitlines(), r.stdout
    assert (
        "make setup: no pytest-xdist (offline?): make test runs one test at a time" in r.stdout
    ), r.stdout
    assert "make setup: no tensorboard (offline?): the TensorBoard tests skip" in r.stdout, r.stdout
    assert "outside" not in r.stdout, r.stdout
    train = make("train", f"ARGS={shlex.join(TINY)}")
    assert train.returncode == 0 and "saved out/train/ddp_train/model.pt" in train.stdout, (
        train.stdout + train.stderr
    )
    gpu = make("test-gpu")
    assert gpu.returncode == 0, gpu.stdout + gpu.stderr
    # A torch outside the tested range is named in one line, and used all the same.
    old = tmp_path / "old"
    (old / "torch").mkdir(parents=True)
    (old / "torch" / "__init__.py").write_text("__version__ = '2.3.1'\n")
    (repo / ".venv" / ".ready").unlink()
    r = make("setup", env={**offline, "PYTHONPATH": str(old)})
    assert r.returncode == 0 and (repo / ".venv" / ".ready").exists(), r.stdout + r.stderr
    assert (
        "make setup: torch 2.3.1 is outside 2.4 to 2.15, the versions tested; going on" in r.stdout
    ), r.stdout


def test_python_ddp_train_and_python_examples_tinylm_in_one_directory_write_out_dirs_of_their_own(
    tmp_path,
):
    repo = fresh_clone(tmp_path)
    tinylm = repo / "examples" / "tinylm.py"  # shrunk to a few steps
    text = tinylm.read_text()
    assert "TRAIN_SIZE, EVAL_SIZE = 3000, 300" in text
    tinylm.write_text(
        text.replace("TRAIN_SIZE, EVAL_SIZE = 3000, 300", "TRAIN_SIZE, EVAL_SIZE = 64, 16")
    )
    ours = typed([PY, "ddp_train.py", *TINY], tmp_path, "ddp_train", repo)
    lm = typed(
        [PY, "examples/tinylm.py", "--epochs", 1, "--batch-size", 16],
        tmp_path,
        "tinylm",
        repo,
        env=clean_env(PYTHONPATH="."),
    )
    # torchrun's workers know the script's name too: the same script's run, found finished.
    again = typed(torchrun_cmd(1, *TINY, script="ddp_train.py"), tmp_path, "again", repo)
    assert "saved out/ddp_train/model.pt" in ours.stdout, ours.stdout
    assert "saved out/tinylm/model.pt" in lm.stdout, lm.stdout
    assert "out/ddp_train/checkpoint.pt holds a finished run" in again.stdout, again.stdout


# ---------------------------------------------------------------------------
# Equivalence: N processes x batch B == 1 process x batch N*B
# ---------------------------------------------------------------------------


@pytest.mark.tier
@pytest.mark.fast
def test_two_ranks_match_single_process_global_batch(tmp_path, reference):
    two = reference(torchrun_cmd(2, *SMALL))
    one = reference(python_cmd(*SMALL, "--batch-size", 64))
    assert_same_weights(two.weights, one.weights)
    # The logged global train loss is the same number the single process computed.
    for a, b in zip(two.metrics, one.metrics):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["train_samples"] == b["train_samples"] == 1000
    # Negative control: the tolerance does tell a different global batch apart.
    other = run(python_cmd(*SMALL), tmp_path, out="other")
    with pytest.raises(AssertionError):
        assert_same_weights(two.weights, other.weights)


def test_grad_accum_two_ranks_match_single_process_four_times_batch(tmp_path):
    accum = run(torchrun_cmd(2, *SMALL, "--grad-accum", 2), tmp_path, out="accum")
    one = run(python_cmd(*SMALL, "--batch-size", 128), tmp_path, out="one")
    assert_same_weights(accum.weights, one.weights)
    assert accum.metrics[-1]["effective_batch_size"] == 128


def test_logged_train_loss_is_exact_global_mean(tmp_path):
    # With lr 0 the weights never move, so the epoch's train loss must be the initial model's
    # mean loss over every training sample, whichever rank saw it.
    r = run(torchrun_cmd(2, *SMALL, "--lr", 0), tmp_path)
    args = default_args(*SMALL)
    train_set, _ = ddp_train.build_datasets(args)
    torch.manual_seed(args.seed)
    model = ddp_train.build_model(args)
    x, y = train_set.tensors
    with torch.no_grad():
        expected = F.cross_entropy(model(x), y).item()
    assert r.metrics[0]["train_loss"] == pytest.approx(expected, rel=1e-6)
    assert r.metrics[0]["train_samples"] == len(train_set)


# ---------------------------------------------------------------------------
# Evaluation counts each sample once
# ---------------------------------------------------------------------------


def test_eval_counts_each_sample_once_with_uneven_split(tmp_path):
    # 301 eval samples over 3 ranks: DistributedSampler pads to 303; the padding must not count.
    r = run(torchrun_cmd(3, *SMALL), tmp_path)
    final = r.metrics[-1]
    assert final["eval_samples"] == 301
    # The accuracy equals one process evaluating the saved model over the whole eval set.
    args = default_args(*SMALL)
    _, eval_set = ddp_train.build_datasets(args)
    model = ddp_train.build_model(args)
    model.load_state_dict(r.weights)
    x, y = eval_set.tensors
    with torch.no_grad():
        logits = model(x)
    # (compute_loss's accuracy is a float32 mean per micro-batch: exact to its rounding, 3e-8)
    correct = (logits.argmax(1) == y).sum().item()
    assert final["eval_accuracy"] == pytest.approx(correct / 301, abs=1e-7)
    assert round(final["eval_accuracy"] * 301) == correct
    assert final["eval_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)


# ---------------------------------------------------------------------------
# Your data: a user's own Dataset (examples/digits.py) with random augmentation, DataLoader
# workers, BatchNorm and Dropout, and an odd number of training samples (1437)
# ---------------------------------------------------------------------------

# 1 process x 16: 90 steps per epoch; 2 x 16: 45 (in the last one rank 1 holds 13 samples).
DIGITS = ["--epochs", "2", "--batch-size", "16", "--save-every", "10"]


def digits_cmd(project: Path, launcher: str, *args, script="stopper.py", launcher_args=()):
    script = str(project / script)
    if launcher == "torchrun":
        return torchrun_cmd(2, *DIGITS, *args, script=script, launcher_args=launcher_args)
    return python_cmd(
        *DIGITS, *args, *(["--spawn", "2"] if launcher == "spawn" else []), script=script
    )


@pytest.mark.parametrize(
    "launcher, workers, stop, stop_code",
    [
        # One process. A terminal or scancel signals the whole process group, DataLoader workers too.
        ("python", 2, dict(STOP_SIGNAL="TERM", STOP_TARGET="group", STOP_AT=30), 75),
        # SLURM's SIGUSR1 in the last step of epoch 1: the stop lands on the epoch boundary.
        ("python", 0, dict(STOP_SIGNAL="USR1", STOP_AT=90), 75),
        # Ctrl-C to the whole group of --spawn 2: the parent forwards it too, and each rank stops once.
        ("spawn", 2, dict(STOP_SIGNAL="INT", STOP_TARGET="group", STOP_AT=20), 130),
        # SIGTERM to torchrun, which passes it on to every worker's process group.
        ("torchrun", 2, dict(STOP_SIGNAL="TERM", STOP_TARGET="parent", STOP_AT=20), 1),
        # kill -9 of rank 1 in the first step of epoch 2; torchrun restarts both, from the epoch boundary.
        ("torchrun", 0, dict(STOP_SIGNAL="KILL", STOP_RANK=1, STOP_AT=46), 0),
    ],
    ids=[
        "python-workers2-TERM-group",
        "python-USR1-epoch-end",
        "spawn-workers2-Ctrl-C",
        "torchrun-workers2-TERM",
        "torchrun-kill9-epoch-boundary",
    ],
)
def test_user_dataset_resumes_bit_identical_with_augmentation_dropout_and_workers(
    project, tmp_path, reference, launcher, workers, stop, stop_code
):
    # The uninterrupted run loads in the training process (--workers 0); the interrupted one as
    # the case says. Augmentation, dropout and BatchNorm must come out bit for bit the same.
    world = "python" if launcher == "python" else "torchrun"
    expected = reference(digits_cmd(project, world))
    out = tmp_path / "out"
    restarts = ["--max-restarts=1"] if stop["STOP_SIGNAL"] == "KILL" else []
    extra = ["--save-every", "0"] if restarts else []
    first = run(
        digits_cmd(project, launcher, "--workers", workers, *extra, launcher_args=restarts),
        tmp_path,
        env=clean_env(**stop),
        expect=stop_code,
    )
    if restarts:  # torchrun restarted the workers, which resumed at the start of epoch 2
        assert "resumed from" in first.stdout and resumed_at(first.stdout) == (0, 45), first
        final = first
    else:
        m = re.search(r"stopped by a signal at step (\d+)", first.stdout)
        assert m, first
        if launcher != "torchrun":  # (torchrun prints its own report of the stopped workers)
            assert "Traceback" not in first.stderr and "DataLoader worker" not in first.stderr, (
                first
            )
        final = run(digits_cmd(project, launcher, "--workers", workers), tmp_path)
        assert resumed_at(final.stdout)[1] == int(m.group(1)), final
    assert_same_weights(final.weights, expected.weights, exact=True)
    assert [m["epoch"] for m in final.metrics] == [1, 2]
    for a, b in zip(final.metrics, expected.metrics):
        assert a["train_loss"] == b["train_loss"] and a["eval_accuracy"] == b["eval_accuracy"]
        assert a["train_samples"] == 1437  # each sample once per epoch, none repeated as padding


# A deterministic model (no BatchNorm, no Dropout) on randomly augmented data, clipped (the largest
# gradient norm is about 0.5), with a global batch of 64: 23 steps per epoch.
PLAIN = ["--epochs", "2", "--clip-grad-norm", "0.25", "--lr", "0.002"]


def test_user_dataset_two_ranks_match_one_process_with_augmentation_and_odd_size(
    project, tmp_path, reference
):
    # 1437 samples do not divide by 2 ranks, and nothing is padded or dropped.
    plain = str(project / "plain.py")
    two = run(torchrun_cmd(2, *PLAIN, "--batch-size", "32", script=plain), tmp_path, out="two")
    one = reference(python_cmd(*PLAIN, "--batch-size", "64", script=plain))
    assert_same_weights(two.weights, one.weights)
    assert "lr 0.002," in two.stdout and two.metrics[0]["grad_norm_max"] > 0.25  # it clipped
    for a, b in zip(two.metrics, one.metrics):
        assert a["train_samples"] == b["train_samples"] == 1437
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["eval_samples"] == b["eval_samples"] == 360
        # (a float32 mean per micro-batch, and micro-batches of other sizes: exact to that rounding)
        assert a["eval_accuracy"] == pytest.approx(b["eval_accuracy"], rel=1e-6)


def test_user_dataset_resumed_on_another_world_size_matches_the_uninterrupted_run(
    project, tmp_path, reference
):
    # Stopped mid-epoch 2 under --spawn 2 x 32, resumed by one process x 64: the same samples with
    # the same augmentation in every later step, each exactly once. The signal comes at the first step of
    # epoch 2 (23 steps an epoch): the ranks agree on it within two votes, at most 10 steps apart each.
    plain = str(project / "plain.py")
    first = run(
        python_cmd(*PLAIN, "--batch-size", "32", "--spawn", "2", script=plain),
        tmp_path,
        env=clean_env(STOP_SIGNAL="TERM", STOP_TARGET="parent", STOP_AT=24),
        expect=75,
    )
    m = re.search(r"stopped by a signal at step (\d+)", first.stdout)
    assert m and 23 < int(m.group(1)) < 46, first
    final = run(python_cmd(*PLAIN, "--batch-size", "64", script=plain), tmp_path)
    step = int(m.group(1))
    assert (
        resumed_at(final.stdout) == (step - 23, step) and "saved by world size 2" in final.stdout
    ), final
    one = reference(python_cmd(*PLAIN, "--batch-size", "64", script=plain))
    assert_same_weights(final.weights, one.weights)
    assert [e["train_samples"] for e in final.metrics] == [1437, 1437]
    assert final.metrics[1]["train_loss"] == pytest.approx(one.metrics[1]["train_loss"], rel=1e-5)


def test_a_generator_the_dataset_draws_from_only_now_and_then_is_seeded_too(project, tmp_path):
    # Which generators a Dataset draws from is found batch by batch, in each loading process on its
    # own: here numpy turns up mid-epoch, in each worker at another batch. The weights do not care.
    script = str(project / "now_and_then.py")
    loaded = [
        run(python_cmd("--epochs", "1", "--workers", w, script=script), tmp_path, out=f"workers{w}")
        for w in (0, 2)
    ]
    assert_same_weights(loaded[0].weights, loaded[1].weights, exact=True)


# mixup.py's compute_loss draws its lambda (Python's random) and its pairing (numpy) in the training
# process: 1 x 32, 45 steps per epoch.
MIXUP = ["--batch-size", "32"]


def mixup_draws(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


# The Dataset augments with torch alone (Python's random and numpy are generators it never draws
# from), or with all three (digits.py's own augmentation).
@pytest.mark.parametrize(
    "augment", ["torch", "all"], ids=["dataset-draws-from-torch", "dataset-draws-from-all-three"]
)
def test_data_loading_leaves_the_training_process_random_and_numpy_as_it_found_them(
    project, tmp_path, augment
):
    # Per-sample seeding of the Dataset's generators must not reach a compute_loss that draws from
    # Python's random and numpy itself (mixup): every step draws anew, whether the samples load in
    # the training process or in workers, and a stopped run resumes with the same draws.
    env = dict(DIGITS_AUGMENT=augment if augment == "torch" else None)
    draws, loaded = {}, {}
    for w in (0, 2):
        log = tmp_path / f"draws{w}"
        loaded[w] = run(
            digits_cmd(project, "python", *MIXUP, "--workers", w, script="mixup.py"),
            tmp_path,
            out=f"workers{w}",
            env=clean_env(MIXUP_LOG=log, **env),
        )
        draws[w] = mixup_draws(Path(f"{log}.0"))
        assert len(draws[w]) == 90, len(draws[w])  # 2 epochs x 45 steps
        lams, perms = [d[0] for d in draws[w]], [tuple(d[1]) for d in draws[w]]
        assert len(set(lams)) == len(lams), (
            f"--workers {w}: mixup's lambda repeats across steps: {lams[:5]}"
        )
        assert len(set(perms)) == len(perms), (
            f"--workers {w}: mixup's pairing repeats across steps: {perms[:2]}"
        )
    assert draws[0] == draws[2]
    assert_same_weights(loaded[0].weights, loaded[2].weights, exact=True)
    # Stopped by SIGTERM mid-epoch 2 and rerun: the same draws from where it stopped, the same weights.
    log = tmp_path / "stopped"
    first = run(
        digits_cmd(project, "python", *MIXUP, "--workers", 0, script="mixup.py"),
        tmp_path,
        out="resumed",
        env=clean_env(MIXUP_LOG=log, STOP_SIGNAL="TERM", STOP_AT=60, **env),
        expect=75,
    )
    m = re.search(r"stopped by a signal at step (\d+)", first.stdout)
    assert m, first
    step = int(m.group(1))
    before = mixup_draws(Path(f"{log}.0"))
    assert len(before) == step, (len(before), step)
    final = run(
        digits_cmd(project, "python", *MIXUP, "--workers", 0, script="mixup.py"),
        tmp_path,
        out="resumed",
        env=clean_env(MIXUP_LOG=log, **env),
    )
    assert resumed_at(final.stdout)[1] == step, final
    # the stopped run's draws, then the resumed run's
    assert mixup_draws(Path(f"{log}.0")) == draws[0]
    assert_same_weights(final.weights, loaded[0].weights, exact=True)


def test_each_rank_draws_its_own_model_randomness(project, tmp_path):
    # The same initial weights on every rank, but not the same dropout masks.
    record = tmp_path / "draw"
    run(digits_cmd(project, "spawn", "--epochs", "1"), tmp_path, env=clean_env(RECORD_RNG=record))
    rank0, rank1 = (torch.load(f"{record}.{r}", weights_only=True) for r in (0, 1))
    assert not torch.equal(rank0, rank1)


def test_ranks_that_built_different_datasets_stop_with_one_line(project, tmp_path):
    r = run(digits_cmd(project, "spawn", script="uneven.py"), tmp_path, expect=2)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "the ranks built different datasets" in lines[0], r
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def test_no_eval_set_means_no_evaluation(project, tmp_path):
    r = run(digits_cmd(project, "python", "--epochs", "1", script="noeval.py"), tmp_path)
    assert (
        "eval_loss" not in r.stdout
        and r.metrics[0]["eval_loss"] is None
        and r.metrics[0]["eval_samples"] == 0
    )


@pytest.mark.parametrize("empty", ["training", "eval"])
def test_an_empty_training_or_eval_set_is_one_line(tmp_path, empty):
    # An exact TensorDataset without samples: its index gather would raise, and an eval set without samples
    # would divide by zero; both stop before anything is written.
    script = tmp_path / "empty.py"
    script.write_text(
        "import sys, torch\n"
        "from torch.utils.data import TensorDataset\n"
        "import ddp_train\n"
        "def sets(args, n=sys.argv.pop(1)):\n"
        "    data = lambda n: TensorDataset(torch.zeros(n, 32), torch.zeros(n, dtype=torch.long))\n"
        "    return (data(0), data(8)) if n == 'training' else (data(64), data(0))\n"
        "ddp_train.build_datasets = sets\n"
        "sys.exit(ddp_train.main())\n"
    )
    r = run(
        python_cmd(empty, script=str(script)),
        tmp_path,
        expect=2,
        env=clean_env(PYTHONPATH=ROOT),
    )
    lines = r.stderr.strip().splitlines()
    assert lines == [
        f"ddp_train.py: error: build_datasets returned an empty {empty} set: give it samples (an eval set of "
        "None: no evaluation)"
    ], r
    assert not (tmp_path / "out").exists()


def test_a_metric_named_count_is_a_figure_of_its_own_and_leaves_the_means_exact(tmp_path):
    # compute_loss's metric "count" (the accuracy again) beside the evaluation's own count of samples: the
    # eval figures are the plain run's, bit for bit, plus eval_count.
    script = tmp_path / "named.py"
    script.write_text(
        "import sys\n"
        "import ddp_train\n"
        "def compute_loss(model, batch, plain=ddp_train.compute_loss):\n"
        "    loss, n, metrics = plain(model, batch)\n"
        "    return loss, n, metrics | {'count': metrics['accuracy']}\n"
        "ddp_train.compute_loss = compute_loss\n"
        "sys.exit(ddp_train.main())\n"
    )
    args = ["--num-samples", 256, "--eval-samples", 100, "--epochs", 1, "--batch-size", 32]
    plain = run(python_cmd(*args), tmp_path, out="plain")
    named = run(
        python_cmd(*args, script=str(script)), tmp_path, out="named", env=clean_env(PYTHONPATH=ROOT)
    )
    (want,), (got,) = plain.metrics, named.metrics
    assert got["eval_count"] == got["eval_accuracy"] == want["eval_accuracy"], (got, want)
    assert (got["eval_loss"], got["eval_samples"]) == (want["eval_loss"], 100), (got, want)


def test_a_rank_set_by_hand_without_master_addr_is_one_line(tmp_path):
    # RANK and WORLD_SIZE by hand (no launcher) but no MASTER_ADDR: init_process_group cannot start.
    r = run(python_cmd("--timeout", 5), tmp_path, expect=1, env=clean_env(RANK=0, WORLD_SIZE=2))
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "ddp_train.py: error: rank 0 could not join the 2-process group at None:None within 5s: "
    ), r
    assert "MASTER_ADDR" in lines[0], r


def test_second_ctrl_c_stops_at_once_without_saving(project, tmp_path):
    stop = dict(STOP_SIGNAL="INT", STOP_AT=25, STOP_AGAIN_AFTER=1.5)
    r = run(digits_cmd(project, "python"), tmp_path, env=clean_env(**stop), expect=130)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "second Ctrl-C" in lines[0] and "Traceback" not in r.stderr, r
    # --save-every 10
    assert (
        torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)["progress"]["step"] == 20
    )


@pytest.mark.fast
def test_tensor_dataset_subclass_is_read_through_its_own_getitem():
    class Doubled(torch.utils.data.TensorDataset):  # an augmenting subclass: no fast path for it
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return 2 * x, y

    data = Doubled(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    x, y = ddp_train.SeededSamples(data, seed=0).__getitems__((0, list(range(10))))
    assert torch.equal(x.squeeze(1), 2 * torch.arange(10.0)) and torch.equal(y, torch.arange(10))


# ---------------------------------------------------------------------------
# Your model and loss: compute_loss is the one place, and the classic DDP failures are one line
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["python", "torchrun", "spawn"])
def test_edited_copy_with_an_mse_loss_runs_in_every_launch_mode(
    tmp_path_factory, tmp_path, launcher
):
    # The other way in: a copy of ddp_train.py whose three task functions were edited (digits data
    # and model, a mean-squared-error loss). Nothing else in the script knows about the loss.
    script = str(edited_copy(tmp_path_factory.getbasetemp() / "way1"))
    cmd = {
        "python": python_cmd("--epochs", "2", script=script),
        "torchrun": torchrun_cmd(2, "--epochs", "2", "--batch-size", "32", script=script),
        "spawn": python_cmd("--epochs", "2", "--batch-size", "32", "--spawn", "2", script=script),
    }[launcher]
    r = run(cmd, tmp_path)
    first, last = r.metrics
    assert "eval_accuracy" not in last and 0 < last["eval_loss"] < first["train_loss"] < 0.2, (
        r.metrics
    )
    assert last["train_samples"] == 1437 and last["eval_samples"] == 360


def test_dict_items_tuple_outputs_and_a_train_only_head_work_under_ddp(project, tmp_path):
    r = run(
        torchrun_cmd(2, "--epochs", "2", "--batch-size", "32", script=str(project / "aux.py")),
        tmp_path,
    )
    assert r.metrics[-1]["eval_accuracy"] > 0.3 and r.metrics[-1]["eval_samples"] == 360


@pytest.mark.parametrize("flag", [False, True])
def test_a_parameter_without_gradient_is_one_line_unless_allowed(project, tmp_path, flag):
    extra = ["--find-unused-parameters"] if flag else []
    r = run(
        digits_cmd(project, "spawn", "--epochs", "1", *extra, script="unused.py"),
        tmp_path,
        expect=0 if flag else 2,
    )
    if not flag:
        lines = r.stderr.strip().splitlines()
        assert (
            len(lines) == 1
            and "spare.weight, spare.bias" in lines[0]
            and "--find-unused-parameters" in lines[0]
        ), r


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_a_head_every_rank_leaves_out_in_some_steps_trains_with_find_unused_parameters(
    project, tmp_path, launcher
):
    # sometimes.py's extra head takes part in every third training step only: in the others no rank
    # gives its parameters a gradient, and the step's gradient has fewer tensors than in the third.
    args = ["--epochs", "2", "--batch-size", "32", "--find-unused-parameters"]
    script = str(project / "sometimes.py")
    cmd = (
        python_cmd(*args, script=script)
        if launcher == "python"
        else torchrun_cmd(2, *args, script=script)
    )
    r = run(cmd, tmp_path)
    assert [m["epoch"] for m in r.metrics] == [1, 2], r
    for m in r.metrics:
        assert m["train_samples"] == 1437 and m["eval_samples"] == 360
        assert all(math.isfinite(m[k]) for k in ("train_loss", "eval_loss", "grad_norm_max")), m
    assert "extra.weight" in r.weights and r.weights["extra.weight"].isfinite().all()


def test_another_split_or_model_in_the_same_out_dir_is_one_line_and_touches_nothing(
    project, tmp_path
):
    run(digits_cmd(project, "python", "--epochs", "1"), tmp_path)
    saved = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    for script, says in [
        ("split.py", "train_samples 1437 -> 1400"),
        ("plain.py", "the model differs from the one in"),
    ]:
        r = run(digits_cmd(project, "python", "--epochs", "2", script=script), tmp_path, expect=2)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], r
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == saved


def test_finished_runs_say_so_train_on_with_more_epochs_and_seed_new_runs(tmp_path):
    first = run(python_cmd(*SMALL, "--epochs", "1"), tmp_path)
    model_pt = first.out_dir / "model.pt"
    again = run(python_cmd(*SMALL, "--epochs", "1"), tmp_path)
    assert "holds a finished run" in again.stdout and "Raise --epochs" in again.stdout
    assert (
        not re.search(r"^epoch ", again.stdout, re.M)
        and again.out_dir.joinpath("model.pt").exists()
    )
    more = run(python_cmd(*SMALL, "--epochs", "2"), tmp_path)
    assert "the learning-rate schedule spans 64 steps" in more.stdout, more
    # The record's lr is the last step's: the cosine over 64 steps at step 63 (0-based), near its end.
    last_lr = 1e-3 * 0.5 * (1 + math.cos(math.pi * 63 / 64))
    assert [m["epoch"] for m in more.metrics] == [1, 2] and more.metrics[1]["lr"] == pytest.approx(
        last_lr, rel=1e-9
    )
    # model.pt is weights only: --resume says what to use instead; --init-from starts a new run from it.
    r = run(python_cmd(*SMALL, "--resume", model_pt), tmp_path, out="other", expect=2)
    assert len(r.stderr.strip().splitlines()) == 1 and f"--init-from {model_pt}" in r.stderr, r
    # With --lr 0 the new run keeps the weights it started from: it evaluates exactly as model.pt did.
    seeded = run(
        python_cmd(*SMALL, "--epochs", "1", "--lr", "0", "--init-from", model_pt),
        tmp_path,
        out="seeded",
    )
    assert f"initialised the model from {model_pt}" in seeded.stdout
    assert seeded.metrics[0]["eval_loss"] == more.metrics[-1]["eval_loss"]


def test_clipping_with_accumulation_keeps_two_ranks_equal_to_one_process(tmp_path):
    # One clip per optimizer step, on the all-reduced gradient.
    knobs = ["--clip-grad-norm", "0.1", "--lr", "0.002", "--grad-accum", "2"]
    two = run(torchrun_cmd(2, *SMALL, *knobs, "--batch-size", "16"), tmp_path, out="two")
    one = run(python_cmd(*SMALL, *knobs, "--batch-size", "32"), tmp_path, out="one")
    assert_same_weights(two.weights, one.weights)
    for a, b in zip(two.metrics, one.metrics):
        # it clipped
        assert (
            a["grad_norm_max"] == pytest.approx(b["grad_norm_max"], rel=1e-4)
            and a["grad_norm_max"] > 0.1
        )


def test_a_diverging_run_stops_on_every_rank_and_keeps_the_last_good_checkpoint(project, tmp_path):
    r = run(digits_cmd(project, "spawn"), tmp_path, env=clean_env(POISON_AT=25), expect=1)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "the training loss is nan at step 25" in lines[0], r
    ckpt = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    assert ckpt["progress"]["step"] == 20 and all(
        v.isfinite().all() for v in ckpt["model"].values()
    )
    assert not (tmp_path / "out" / "model.pt").exists()


def test_batchnorm_evaluation_is_that_of_the_saved_model(project, tmp_path):
    # Each rank's BatchNorm statistics drift apart within a step; rank 0's are broadcast before
    # evaluating, so the logged metrics are those of model.pt evaluated by one process.
    r = run(digits_cmd(project, "spawn", "--epochs", "1", "--batch-size", "32"), tmp_path)
    out = subprocess.run(
        [PY, project / "evaluate_saved.py", r.out_dir / "model.pt"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=project,
        env=clean_env(),
    )
    alone = json.loads(out.stdout)
    # (a float32 mean per micro-batch, and micro-batches of other sizes: exact to that rounding)
    assert r.metrics[0]["eval_accuracy"] == pytest.approx(alone["eval_accuracy"], rel=1e-6), (
        out.stderr
    )
    assert r.metrics[0]["eval_loss"] == pytest.approx(alone["eval_loss"], rel=1e-6)


def test_rank0_first_preparation_and_slow_checkpoint_writes_outlast_the_timeout(project, tmp_path):
    env = clean_env(PREP_SECONDS=4, SAVE_SECONDS=3)
    r = run(
        digits_cmd(
            project,
            "spawn",
            "--epochs",
            "1",
            "--save-every",
            "0",
            "--timeout",
            "2",
            script="patient.py",
        ),
        tmp_path,
        env=env,
    )
    assert (tmp_path / "prepared").exists() and (r.out_dir / "model.pt").exists()


@pytest.mark.parametrize(
    "bad, says",
    [
        ("loss", "compute_loss must return (loss, count)"),
        ("items", "cannot batch the items of OddItems"),
        (
            "collate",
            "cannot batch the items of Digits: your collate_fn raised AttributeError: 'tuple' object has no "
            "attribute 'tolist'",
        ),
        ("iterable", "build_datasets returned an IterableDataset (Stream) as the train set"),
        ("count", 'but COUNT_UNIT is "samples": return the batch\'s sample count'),
    ],
)
def test_a_wrong_compute_loss_or_unbatchable_items_are_one_line(project, tmp_path, bad, says):
    r = run(
        digits_cmd(project, "spawn", "--workers", "1", script="bad.py"),
        tmp_path,
        env=clean_env(BAD=bad),
        expect=2,
    )
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in r.stderr, r


def test_a_bug_in_the_dataset_ends_the_run_with_the_workers_traceback(project, tmp_path):
    # The worker's exception reaches the trainer, which exits (its DataLoader workers with it).
    r = run(
        digits_cmd(project, "python", "--workers", "1", script="bad.py"),
        tmp_path,
        env=clean_env(BAD="getitem"),
        expect=1,
        timeout=60,
    )
    assert (
        "ValueError: sample 700 is broken" in r.stderr
        and "in DataLoader worker process 0" in r.stderr
    ), r


# ---------------------------------------------------------------------------
# Language models: examples/tinylm.py, variable-length token batches padded by its collate_fn,
# a loss averaged over tokens, and FLOPs measured for any model
# ---------------------------------------------------------------------------

# 48 functions of the standard library, no dropout: a deterministic model, for exact comparisons.
LM_EXACT = dict(LM_TRAIN_SIZE=48, LM_EVAL_SIZE=8, LM_DROPOUT=0)


@pytest.fixture
def tinylm(monkeypatch):
    """examples/tinylm.py in this process, without its hold on ddp_train's task functions, and
    with its sizes restored after the test."""
    task = {
        name: getattr(ddp_train, name)
        for name in ("build_datasets", "build_model", "collate_fn", "compute_loss", "COUNT_UNIT")
    }
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import tinylm

    for name, value in task.items():
        setattr(ddp_train, name, value)
    for name in ("TRAIN_SIZE", "EVAL_SIZE", "MAX_LEN", "DIM", "LAYERS", "HEADS", "DROPOUT"):
        monkeypatch.setattr(tinylm, name, getattr(tinylm, name))
    return tinylm


def lm_cmd(project: Path, launch: str, *args):
    """tinylm through the script: "python", or "torchrun N"."""
    script = str(project / "lm.py")
    if launch == "python":
        return python_cmd(*args, script=script)
    return torchrun_cmd(int(launch.split()[1]), *args, script=script)


@pytest.mark.parametrize(
    "launch, per_process",
    [
        ("python", ["--batch-size", 48]),
        ("torchrun 2", ["--batch-size", 24]),
        ("torchrun 2", ["--batch-size", 12, "--grad-accum", 2]),
    ],
    ids=["1x48", "2x24", "2x12x2"],
)
def test_one_step_gradient_is_the_token_mean_over_every_rank_and_micro_batch(
    project, tmp_path, tinylm, launch, per_process
):
    # One optimizer step over all 48 sequences (1,3xx target tokens of unequal lengths), however they are split.
    tinylm.TRAIN_SIZE, tinylm.DROPOUT = 48, 0.0
    torch.manual_seed(0)
    model = tinylm.build_model(default_args())
    torch.save(model.state_dict(), tmp_path / "init.pt")
    r = run(
        lm_cmd(project, launch, "--epochs", 1, *per_process, "--init-from", tmp_path / "init.pt"),
        tmp_path,
        env=clean_env(**LM_EXACT),
    )
    assert r.metrics[0]["step"] == 1 and r.metrics[0]["train_samples"] == 48
    # The same step by hand, in float64: one padded batch of all 48, every real target token weighed equally.
    train_set, _ = tinylm.build_datasets(default_args())
    batch = tinylm.collate_fn([train_set[i] for i in range(48)])
    model = model.double()
    logits = model(batch["inputs"])
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100, reduction="sum"
    )
    tokens = int((batch["targets"] != -100).sum())
    (loss_sum / tokens).backward()
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    assert r.metrics[0]["train_tokens"] == tokens and r.metrics[0]["train_loss"] == pytest.approx(
        loss_sum.item() / tokens, rel=1e-6
    )
    assert r.metrics[0]["grad_norm_max"] == pytest.approx(norm, rel=1e-5)
    # Negative control: the mean over sequences (the gradient divided by 48, not by the tokens) is far off.
    assert r.metrics[0]["grad_norm_max"] != pytest.approx(norm * tokens / 48, rel=0.5)


# ---------------------------------------------------------------------------
# The mean contract: compute_loss returns a mean and its count; one plain SGD step over a global batch that
# holds the whole data set is w0 - lr x the gradient of the mean loss over every item, computed here in float64
# ---------------------------------------------------------------------------


def relative_gap(got: dict, want: dict) -> float:
    """The largest, over the tensors, of |got - want| / |want| (norms): how far one update is from another."""
    return max(((got[k].double() - want[k]).norm() / want[k].norm()).item() for k in want)


def sgd_step(model, loss_of, lr):
    """w0 - lr x the gradient of loss_of(model) in float64, and that loss: the update by hand."""
    model = model.double()
    loss = loss_of(model)
    loss.backward()
    return {k: (p - lr * p.grad).detach() for k, p in model.named_parameters()}, loss.item()


def one_sgd_step(project, tmp_path, launch, seed, split, env=None):
    """sgd.py: one step of SGD at lr 0.5 over 100 samples from seeded initial weights; (the run, the weights)."""
    torch.manual_seed(seed)
    w0 = ddp_train.build_model(default_args()).state_dict()
    torch.save(w0, tmp_path / "init.pt")
    args = ["--num-samples", 100, "--eval-samples", 0, "--max-steps", 1, "--lr", 0.5]
    args += ["--schedule", "constant", "--init-from", tmp_path / "init.pt", *split]
    script = str(project / "sgd.py")
    cmd = (
        python_cmd(*args, script=script)
        if launch == "python"
        else torchrun_cmd(3, *args, script=script)
    )
    return run(cmd, tmp_path, env=env), w0


def assert_one_sgd_step_on_the_mean(r, w0, x, y, unit):
    """The run's weights and logged loss are those of one step on the mean cross-entropy over (x, y), by hand in
    float64, and it counted len(x) of its unit; (the model, those weights)."""
    model = ddp_train.build_model(default_args())
    model.load_state_dict(w0)
    want, loss = sgd_step(model, lambda m: F.cross_entropy(m(x.double()), y), 0.5)
    assert relative_gap(r.weights, want) < 1e-5, relative_gap(r.weights, want)
    assert r.metrics[0]["train_loss"] == pytest.approx(loss, rel=1e-6), r.metrics[0]
    assert r.metrics[0][unit] == len(x), r.metrics[0]
    return model, want


@pytest.mark.parametrize(
    "launch, split",
    [
        ("python", ["--global-batch", 100, "--batch-size", 30]),
        ("torchrun 3", ["--global-batch", 102, "--batch-size", 12]),
    ],
    ids=["1-process-4-micro-batches", "torchrun-3-uneven-shares-3-micro-batches"],
)
def test_one_sgd_step_over_every_sample_is_w0_minus_lr_times_the_gradient_of_their_mean_loss(
    project, tmp_path, launch, split
):
    # 100 samples in one step. One process: 4 micro-batches (30, 30, 30, 10). torchrun 3: 34, 33 and 33
    # samples (a global batch of 102 that the data set does not fill), each rank's in 3 micro-batches.
    r, w0 = one_sgd_step(project, tmp_path, launch, 1234, split)
    x, y = ddp_train.build_datasets(default_args("--num-samples", "100"))[0].tensors
    model, want = assert_one_sgd_step_on_the_mean(r, w0, x, y, "train_samples")
    # Negative controls, which the tolerance tells apart: the sum's gradient (a mean taken for a sum), and under
    # torchrun 3 the mean of the ranks' means (34, 33 and 33 samples weighed alike).
    model.load_state_dict(w0)
    summed, _ = sgd_step(model, lambda m: F.cross_entropy(m(x.double()), y, reduction="sum"), 0.5)
    assert relative_gap(r.weights, summed) > 1e-2
    if launch != "python":
        model.load_state_dict(w0)
        # uneven thirds (which thirds, changes no mean)
        shares = [list(range(rank, 100, 3)) for rank in range(3)]
        mean_of_means, _ = sgd_step(
            model, lambda m: sum(F.cross_entropy(m(x[s].double()), y[s]) for s in shares) / 3, 0.5
        )
        assert relative_gap(r.weights, mean_of_means) > 10 * relative_gap(r.weights, want)


@pytest.mark.parametrize("launch", ["python", "torchrun 3"])
def test_micro_batches_without_a_token_weigh_nothing_and_the_step_is_the_mean_over_the_tokens_there_are(
    project, tmp_path, launch
):
    # masked.py: 100 samples of which 10 carry a target (9, 19, ... 99; the rest ignore_index), in micro-batches
    # of 4 or fewer: most hold no token, their mean is 0/0 = NaN, and the warm-up's first batch (samples 0-3)
    # holds none either. One SGD step over all of them is still w0 - lr x the gradient of the 10 tokens' mean.
    split = ["--global-batch", 102, "--batch-size", 4]
    r, w0 = one_sgd_step(project, tmp_path, launch, 99, split, env=clean_env(SGD_PROJECT="masked"))
    x, y = ddp_train.build_datasets(default_args("--num-samples", "100"))[0].tensors
    assert_one_sgd_step_on_the_mean(r, w0, x[9::10], y[9::10], "train_tokens")


@pytest.mark.parametrize(
    "launch, split",
    [
        ("python", ["--global-batch", 48, "--batch-size", 16]),
        ("torchrun 2", ["--global-batch", 48, "--batch-size", 8]),
    ],
    ids=["1-process-3-micro-batches", "torchrun-2-3-micro-batches-each"],
)
def test_one_sgd_step_over_every_token_is_w0_minus_lr_times_the_gradient_of_their_mean_loss(
    project, tmp_path, tinylm, launch, split
):
    # tinylm's 48 functions of unequal lengths in one step, padded per micro-batch (the padding is
    # ignore_index): every real target token weighs the same, whichever micro-batch and rank holds it.
    tinylm.TRAIN_SIZE, tinylm.EVAL_SIZE, tinylm.DROPOUT = 48, 8, 0.0
    torch.manual_seed(0)
    model = tinylm.build_model(default_args())
    w0 = model.state_dict()
    torch.save(w0, tmp_path / "init.pt")
    args = [
        "--max-steps",
        1,
        "--lr",
        0.5,
        "--schedule",
        "constant",
        "--init-from",
        tmp_path / "init.pt",
        *split,
    ]
    env = clean_env(SGD_PROJECT="lm", **LM_EXACT)
    script = str(project / "sgd.py")
    cmd = (
        python_cmd(*args, script=script)
        if launch == "python"
        else torchrun_cmd(2, *args, script=script)
    )
    r = run(cmd, tmp_path, env=env)
    train_set, _ = tinylm.build_datasets(default_args())
    batch = tinylm.collate_fn([train_set[i] for i in range(48)])

    def token_mean(m):
        return F.cross_entropy(
            m(batch["inputs"]).flatten(0, 1), batch["targets"].flatten(), ignore_index=-100
        )

    want, loss = sgd_step(model, token_mean, 0.5)
    gap = relative_gap(
        {k: v.double() - w0[k] for k, v in r.weights.items()},
        {k: v - w0[k] for k, v in want.items()},
    )
    assert gap < 1e-3, gap  # the updates themselves: float32 through a transformer against float64
    assert r.metrics[0]["train_loss"] == pytest.approx(loss, rel=1e-5)
    assert r.metrics[0]["train_tokens"] == int((batch["targets"] != -100).sum())
    # Negative control: the mean over the sequences' own token means (a short function's tokens weigh more).
    model.load_state_dict(w0)
    per_sequence = (
        lambda m: F.cross_entropy(
            m(batch["inputs"]).transpose(1, 2),
            batch["targets"],
            ignore_index=-100,
            reduction="none",
        )
        .sum(1)
        .div((batch["targets"] != -100).sum(1))
        .mean()
    )
    other, _ = sgd_step(model, per_sequence, 0.5)
    assert (
        relative_gap(
            {k: v - w0[k] for k, v in other.items()}, {k: v - w0[k] for k, v in want.items()}
        )
        > 10 * gap
    )


@pytest.mark.fast
def test_the_step_count_is_made_on_the_device_and_scales_gradients_in_their_own_dtype(monkeypatch):
    # What a GPU step does with a token count, driven here on the CPU case by case: an int becomes a tensor
    # through torch.full (no pageable host-to-device copy, which waits for all queued GPU work); and the
    # gradients, weighed against the last step's count, are scaled to the step's own by a scale in their dtype
    # (a float64 scale sends _foreach_mul_ to its one-kernel-per-parameter path).
    cpu = torch.device("cpu")
    made = []
    real_full, real_tensor = torch.full, torch.tensor
    try:
        torch.full = lambda *a, **k: made.append("full") or real_full(*a, **k)
        torch.tensor = lambda *a, **k: made.append("tensor") or real_tensor(*a, **k)
        for count in (7, 12.5, 2**40 + 1):
            assert ddp_train.count_tensor(count, cpu).item() == count and made[-1] == "full"
    finally:
        torch.full, torch.tensor = real_full, real_tensor
    assert "tensor" not in made
    tokens = torch.tensor(41, dtype=torch.int64)
    as_sent = ddp_train.count_tensor(tokens, cpu)
    assert as_sent.dtype == torch.float64 and as_sent.shape == () and as_sent.item() == 41
    monkeypatch.setattr(ddp_train, "COUNT_UNIT", "tokens")
    scales, real_mul = [], torch._foreach_mul_
    monkeypatch.setattr(
        torch, "_foreach_mul_", lambda grads, scale: scales.append(scale) or real_mul(grads, scale)
    )
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        p = torch.nn.Parameter(torch.ones(3, dtype=dtype))
        p.grad = torch.full((3,), 6.0, dtype=dtype)
        t = types.SimpleNamespace(
            ctx=ddp_train.Context(), progress=ddp_train.Progress(expected=64.0), params=[p]
        )
        count = ddp_train.StepCount(t)
        count.start(samples=2)  # (tokens: the samples do not say the count)
        count.add(torch.tensor(20), last=False)
        count.add(12, last=True)  # 32 tokens this step, where the last had 64
        count.finish()
        assert (
            scales[-1].dtype == dtype
            and scales[-1].item() == 2.0
            and torch.equal(p.grad, torch.full_like(p, 12))
        )
        # the next step's expectation
        assert t.progress.expected.item() == 32 and count.expected.item() == 32


@pytest.mark.tier
def test_lm_two_ranks_with_accumulation_match_one_process_on_variable_length_batches(
    project, tmp_path
):
    # 2 x 8 x accum 2 == 1 x 32 on 200 functions of unequal lengths (a short last step too). Each
    # micro-batch is padded to its own longest sample, so the matmuls have other shapes than in the
    # one-process batch: the real tokens' results are the same up to float rounding (causal attention
    # never looks right, into the padding). AdamW then amplifies that rounding on parameters whose
    # gradients are nearly zero (biases: 6.5e-5 apart after 14 steps, measured), so the test is
    # assert_same_run's: every tensor within 1e-3 of its norm (measured: 1.8e-4), not bit equality.
    common = ["--epochs", 2, "--lr", "3e-3"]
    env = clean_env(**{**LM_EXACT, "LM_TRAIN_SIZE": 200, "LM_EVAL_SIZE": 40})
    two = run(
        lm_cmd(project, "torchrun 2", *common, "--batch-size", 8, "--grad-accum", 2),
        tmp_path,
        out="two",
        env=env,
    )
    one = run(lm_cmd(project, "python", *common, "--batch-size", 32), tmp_path, out="one", env=env)
    assert_same_run(two.weights, one.weights)
    for a, b in zip(two.metrics, one.metrics):
        assert a["train_tokens"] == b["train_tokens"] and a["eval_tokens"] == b["eval_tokens"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
    assert two.metrics[-1]["train_loss"] < two.metrics[0]["train_loss"]
    # Negative control: another global batch is another run, well outside that tolerance.
    other = run(
        lm_cmd(project, "python", *common, "--batch-size", 16), tmp_path, out="other", env=env
    )
    with pytest.raises(AssertionError):
        assert_same_run(other.weights, one.weights)


def test_lm_global_batch_with_drop_last_is_the_same_run_on_one_rank_or_two(project, tmp_path):
    # --global-batch 32 --drop-last on 200 functions of unequal lengths: 6 full steps an epoch, the last 8
    # samples sitting out, whatever the world size. One rank takes 4 micro-batches of 8 a step, two take 2
    # each; both must be the one-process batch of 32 (assert_same_run's tolerance, as above: the padding
    # shapes differ).
    common = ["--epochs", 2, "--lr", "3e-3", "--global-batch", 32, "--batch-size", 8, "--drop-last"]
    env = clean_env(**{**LM_EXACT, "LM_TRAIN_SIZE": 200, "LM_EVAL_SIZE": 40})
    two = run(lm_cmd(project, "torchrun 2", *common), tmp_path, out="two", env=env)
    one = run(lm_cmd(project, "python", *common), tmp_path, out="one", env=env)
    plain = run(
        lm_cmd(project, "python", *common[:4], "--batch-size", 32, "--drop-last"),
        tmp_path,
        out="plain",
        env=env,
    )
    for r in (two, one):
        assert_same_run(r.weights, plain.weights)
        assert [(m["step"], m["train_samples"]) for m in r.metrics] == [(6, 192), (12, 192)]
        for a, b in zip(r.metrics, plain.metrics):
            assert a["train_tokens"] == b["train_tokens"]
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    assert "8/process x 2 x 2 accum" in two.stdout and "8/process x 1 x 4 accum" in one.stdout, (
        two.stdout,
        one.stdout,
    )


@pytest.mark.tier
def test_lm_stopped_mid_epoch_resumes_bit_identical_with_dropout_and_workers(
    project, tmp_path, reference
):
    # Dropout on both ranks, padding collated in 2 DataLoader workers; the reference loads without
    # workers. 320 functions at 2 x 16: 10 steps per epoch; the stop comes in epoch 2.
    env = dict(LM_TRAIN_SIZE=320, LM_EVAL_SIZE=32)
    cmd = lm_cmd(project, "python", "--epochs", 2, "--batch-size", 16, "--spawn", 2)
    expected = reference(cmd + ["--workers", 0], **env)
    first = run(
        cmd + ["--workers", 2],
        tmp_path,
        env=clean_env(**env, STOP_SIGNAL="TERM", STOP_AT=14),
        expect=75,
    )
    m = re.search(r"stopped by a signal at step (\d+)", first.stdout)
    assert m and 10 < int(m.group(1)) < 20, first
    final = run(cmd + ["--workers", 2], tmp_path, env=clean_env(**env))
    assert resumed_at(final.stdout) == (int(m.group(1)) - 10, int(m.group(1))), final
    assert_same_weights(final.weights, expected.weights, exact=True)
    for a, b in zip(final.metrics, expected.metrics):
        assert a["train_loss"] == b["train_loss"] and a["eval_loss"] == b["eval_loss"]


def test_flops_per_sample_are_counted_exactly_for_an_mlp_a_cnn_and_a_language_model(
    project, tmp_path, reference, tinylm
):
    # Training FLOPs = forward + backward matmuls: 2 per multiply-add forward, and as many again for
    # each gradient backward computes (the weights', and the input's for all but the first layer).
    mlp = reference(python_cmd(*SMALL)).metrics[0]["flops_per_sample"]
    layers = [(32, 256), (256, 256), (256, 10)]  # the default MLP's Linear layers
    assert mlp == 6 * sum(i * o for i, o in layers) - 2 * 32 * 256
    # digits' CNN: two 3x3 convolutions (1 -> 16 channels on 8x8, 16 -> 32 at stride 2 on 4x4), a Linear.
    conv1, conv2, linear = 2 * 16 * 8 * 8 * 1 * 9, 2 * 32 * 4 * 4 * 16 * 9, 2 * 512 * 10
    cnn = reference(digits_cmd(project, "python")).metrics[0]["flops_per_sample"]
    assert cnn == 3 * (conv2 + linear) + 2 * conv1  # 6 x parameters would say 60k: 8.5x too few
    # tinylm: 6 FLOPs per Linear weight per (padded) token, plus causal attention as torch's fused
    # kernel computes it: 4 T^2 D forward and 10 T^2 D backward (it recomputes the scores) per layer.
    r = run(
        lm_cmd(project, "python", "--epochs", 1, "--batch-size", 16),
        tmp_path,
        env=clean_env(LM_TRAIN_SIZE=32, LM_EVAL_SIZE=0, LM_DROPOUT=0),
    )
    tinylm.TRAIN_SIZE, tinylm.EVAL_SIZE = 32, 0
    train_set, _ = tinylm.build_datasets(default_args())
    # the first batch's padded length
    T = tinylm.collate_fn([train_set[i] for i in range(16)])["inputs"].shape[1]
    model = tinylm.build_model(default_args())
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert (
        r.metrics[0]["flops_per_sample"]
        == 6 * weights * T + tinylm.LAYERS * 14 * T * T * tinylm.DIM
    )
    assert r.metrics[0]["tflops_per_process"] == pytest.approx(
        r.metrics[0]["samples_per_sec"] * r.metrics[0]["flops_per_sample"] / 1e12, rel=1e-9
    )


def test_a_model_the_flop_counter_cannot_count_gets_no_figure_and_one_line_saying_why(
    project, tmp_path
):
    r = run(torchrun_cmd(2, "--epochs", 1, script=str(project / "rnn.py")), tmp_path)
    assert (
        r.stdout.count("FLOPs not counted: torch's FlopCounterMode has no formula for LSTM") == 1
    ), r
    assert not {"flops_per_sample", "tflops_per_process", "mfu"} & set(r.metrics[0])


def test_counting_flops_leaves_the_run_bit_identical(project, tmp_path, reference):
    # The count runs a forward and backward of the first batch: dropout, BatchNorm and augmentation
    # must come out as if it never happened.
    counted = reference(digits_cmd(project, "python"))
    uncounted = run(digits_cmd(project, "python", "--no-count-flops"), tmp_path)
    assert (
        "flops_per_sample" in counted.metrics[0] and "flops_per_sample" not in uncounted.metrics[0]
    )
    assert_same_weights(uncounted.weights, counted.weights, exact=True)


# ---------------------------------------------------------------------------
# It learns, and it says so clearly
# ---------------------------------------------------------------------------


@pytest.mark.fast
def test_default_run_learns(tmp_path):
    r = run(python_cmd(), tmp_path)
    assert r.metrics[-1]["eval_accuracy"] > 0.9  # chance is 0.1
    assert r.metrics[-1]["train_loss"] < r.metrics[0]["train_loss"]
    for key in (
        "epoch",
        "train_loss",
        "eval_loss",
        "eval_accuracy",
        "eval_samples",
        "train_samples",
        "samples_per_sec",
        "world_size",
        "effective_batch_size",
        "first_step_at",
        "peak_rss_mb",
    ):
        assert key in r.metrics[0]


@pytest.mark.fast
@pytest.mark.parametrize(
    "argv, says",
    [
        (["--epochs", "abc"], "--epochs: invalid int value: 'abc'"),
        (["--batch-size", "0"], "--batch-size: must be at least 1"),
        (["--amp", "fp8"], "--amp: invalid choice"),
        (["--lr", "nan"], "--lr: must be at least 0"),
        (["--no-such-flag"], "unrecognized arguments"),
        (["--resume", "missing.pt"], "--resume missing.pt: no such file"),
        (["--timeout", "0"], "--timeout: must be greater than 0"),
        (["--max-steps", "0"], "--max-steps: must be at least 1"),
        (["--ema", "1.5"], "--ema 1.5: the decay is below 1"),
        (["--keep-best", "eval_loss", "--eval-samples", "0"], "--keep-best: there is no eval set"),
        (["--eval-every", "5", "--eval-samples", "0"], "--eval-every: there is no eval set"),
        (["--schedule", "step"], "--schedule: invalid choice"),
    ],
)
def test_bad_input_exits_with_one_clear_line(tmp_path, argv, says):
    r = run(python_cmd(*SMALL, *argv), tmp_path, expect=2)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp_train.py: error:") and says in lines[0], r
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("case", [pytest.param("one line", marks=pytest.mark.fast), "traceback"])
def test_torchruns_failure_summary_names_our_error_as_the_root_cause_never_n_a(
    project, tmp_path, case
):
    # torchrun's 30-line banner comes after our line: its "Root Cause" must say the same (fail() writes each
    # worker's error file, also on ranks that print nothing) or show the traceback (@record), never "<N/A>".
    # (Which rank is the root cause, and whether torchrun stops the other first, varies from run to run.)
    if case == "one line":
        cmd, env, says = (
            torchrun_cmd(2, *SMALL, "--resume", "missing.pt"),
            None,
            "traceback : ddp_train.py: error: --resume missing.pt: no such file\n",
        )
    else:
        cmd, env, says = (
            torchrun_cmd(1, *DIGITS, "--workers", 1, script=str(project / "bad.py")),
            clean_env(BAD="getitem"),
            "ValueError: sample 700 is broken",
        )
    r = run(cmd, tmp_path, env=env, expect=1)
    root = r.stderr.partition("Root Cause (first observed failure):")[2]
    assert says in root and "<N/A>" not in root and "To enable traceback" not in root, r


def test_sync_bn_on_cpu_says_it_needs_cuda(tmp_path):
    if HAS_CUDA:
        pytest.skip("CUDA is present: SyncBatchNorm works")
    r = run(torchrun_cmd(2, *SMALL, "--batch-norm", "--sync-bn"), tmp_path, expect=None)
    assert r.returncode != 0
    # not the summary's
    errors = [line for line in r.stderr.splitlines() if line.startswith("ddp_train.py: error:")]
    assert len(errors) == 1 and errors[0].startswith("ddp_train.py: error: --sync-bn needs CUDA"), r


def test_compiled_ddp_saves_a_plain_state_dict(tmp_path):
    # torch.compile wraps the module in _orig_mod, DDP in module: neither may leak into model.pt.
    r = run(torchrun_cmd(2, *SMALL, "--compile"), tmp_path)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in r.weights)
    ddp_train.build_model(default_args()).load_state_dict(r.weights)


@pytest.mark.parametrize("amp", [pytest.param("bf16", marks=pytest.mark.tier), "fp16"])
def test_mixed_precision_trains_on_cpu_too(tmp_path, reference, amp):
    r = run(torchrun_cmd(2, *SMALL, "--amp", amp), tmp_path)
    exact = reference(torchrun_cmd(2, *SMALL))
    assert r.metrics[-1]["train_loss"] == pytest.approx(exact.metrics[-1]["train_loss"], rel=0.02)


@pytest.mark.fast
def test_slurm_node_lists_and_task_counts_are_read_like_slurm_writes_them():
    assert ddp_train.first_slurm_host("gpu[07-09,12],cpu1") == "gpu07"
    assert ddp_train.first_slurm_host("node3,node4") == "node3"
    assert ddp_train.first_slurm_host("a-b[1,3]") == "a-b1"
    # SLURM_STEP_TASKS_PER_NODE: '2(x2),1' is 2 tasks on nodes 0 and 1, and 1 on node 2.
    assert [ddp_train.tasks_on_this_node("2(x2),1", node) for node in range(3)] == [2, 2, 1]
    assert ddp_train.tasks_on_this_node("3,1", 1) == 1 and ddp_train.tasks_on_this_node("4", 0) == 4


# ---------------------------------------------------------------------------
# What a first GPU run would hit, checked on the CPU: BatchNorm's one-sample batches, the GPU and
# core each process takes, loading checkpoints, strict metrics, the order of DDP's buckets
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("launch", ["python", "torchrun"])
def test_batchnorm_with_a_one_sample_micro_batch_stops_before_training_and_names_drop_last(
    tmp_path, launch
):
    # 65 samples at 64: the last step holds one. Under torchrun 2 x 64, 129 samples: rank 0 gets one.
    bn = ["--batch-norm", "--batch-size", 64, "--eval-samples", 0]
    cmd = (
        python_cmd(*bn, "--num-samples", 65)
        if launch == "python"
        else torchrun_cmd(2, *bn, "--num-samples", 129)
    )
    r = run(cmd, tmp_path, expect=2 if launch == "python" else 1)
    errors = [line for line in r.stderr.splitlines() if line.startswith("ddp_train.py: error:")]
    assert (
        len(errors) == 1
        and "a micro-batch of one sample" in errors[0]
        and "pass --drop-last" in errors[0]
    ), r
    assert (
        "Expected more than 1 value" not in r.stderr
        and not (tmp_path / "out" / "checkpoint.pt").exists()
    )
    if launch == "python":
        assert len(r.stderr.strip().splitlines()) == 1, r
    # --drop-last trains the full global batches only.
    r = run([*cmd, "--drop-last"], tmp_path, out="dropped")
    assert [m["train_samples"] for m in r.metrics] == [64 if launch == "python" else 128] * 3


@pytest.mark.parametrize(
    "launch, per_process, short_rank, held",
    [("python", 718, 0, 718 * 2), ("torchrun", 239, 1, 478 * 3)],
)
def test_batchnorm_one_sample_line_and_drop_last_on_a_user_cnn(
    project, tmp_path, launch, per_process, short_rank, held
):
    # examples/digits.py: a CNN with BatchNorm on 1,437 samples. 1 x 718 leaves the last step one sample;
    # 2 x 239 gives rank 1 one in the last step (1,437 = 3 x 478 + 3: ranks 0 and 1 get 2 and 1).
    cmd = digits_cmd(project, launch, "--batch-size", per_process, "--eval-samples", 0)
    r = run(cmd, tmp_path, expect=2 if launch == "python" else 1)
    errors = [line for line in r.stderr.splitlines() if line.startswith("ddp_train.py: error:")]
    assert (
        len(errors) == 1
        and "a micro-batch of one sample" in errors[0]
        and "pass --drop-last" in errors[0]
    ), r
    assert f"rank {short_rank} one" in errors[0], r
    assert (
        "Expected more than 1 value" not in r.stderr
        and not (tmp_path / "out" / "checkpoint.pt").exists()
    )
    r = run([*cmd, "--drop-last"], tmp_path, out="dropped")
    assert [m["train_samples"] for m in r.metrics] == [held] * 2


def test_drop_last_drops_the_same_samples_in_n_by_b_and_one_by_nb(tmp_path, reference):
    # 1000 samples, global batch 64: 15 full steps, 40 samples left out of each epoch's shuffle.
    two = run(torchrun_cmd(2, *SMALL, "--drop-last"), tmp_path, out="two")
    one = run(python_cmd(*SMALL, "--batch-size", 64, "--drop-last"), tmp_path, out="one")
    assert (
        [m["train_samples"] for m in two.metrics]
        == [m["train_samples"] for m in one.metrics]
        == [960, 960]
    )
    assert two.metrics[-1]["step"] == 30 and "15 steps/epoch" in two.stdout
    assert_same_weights(two.weights, one.weights)
    assert two.metrics[-1]["train_loss"] == pytest.approx(one.metrics[-1]["train_loss"], rel=1e-6)
    with pytest.raises(AssertionError):  # negative control: without --drop-last it is another run
        assert_same_weights(two.weights, reference(python_cmd(*SMALL, "--batch-size", 64)).weights)


def test_a_rank_without_samples_in_the_last_step_keeps_the_collectives_in_order_with_buffers(
    project, tmp_path
):
    # 129 samples at 64 a rank: the second step has one sample, rank 1 none. Its zero-gradient step must run
    # DDP's buffer broadcast, the count and the buckets in the order rank 0 does, and give DDP's forward an input:
    # buffered.py's DDP moves its inputs first, as DDP does on GPUs (where a call without any raised IndexError).
    args = ["--num-samples", 129, "--eval-samples", 64, "--epochs", 2]
    two = run(
        torchrun_cmd(2, *args, "--batch-size", 64, script=str(project / "buffered.py")),
        tmp_path,
        out="two",
    )
    one = run(
        python_cmd(*args, "--batch-size", 128, script=str(project / "buffered.py")),
        tmp_path,
        out="one",
    )
    assert [m["train_samples"] for m in two.metrics] == [129, 129]
    assert_same_weights(two.weights, one.weights)


@pytest.mark.fast
def test_an_in_memory_tensor_dataset_takes_no_workers_on_a_gpu_and_only_what_workers_load_is_pinned():
    # --workers -1 on a GPU: a TensorDataset's batch is one index gather, done here; another Dataset's samples
    # load in workers (a core each, one left for training); an explicit --workers wins; on the CPU, none.
    gpu, cpu = ddp_train.Context(device=torch.device("cuda", 0)), ddp_train.Context()
    data, other = (
        torch.utils.data.TensorDataset(torch.zeros(4, 2)),
        torch.utils.data.Subset(range(4), [0, 1]),
    )
    default, two, none = (
        default_args(),
        default_args("--workers", "2"),
        default_args("--workers", "0"),
    )
    torch.set_num_threads(3)
    assert (
        ddp_train.data_workers(data, default, gpu) == 0
        and ddp_train.data_workers(other, default, gpu) == 2
    )
    assert (
        ddp_train.data_workers(data, two, gpu) == 2
        and ddp_train.data_workers(other, default, cpu) == 0
    )
    # torch's pin_memory refuses a CUDA tensor ("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors
    # can be pinned", torch/utils/data/_utils/pin_memory.py -> Tensor.pin_memory): a Dataset that holds its
    # data on the GPU loads in the training process (--workers 0, and a TensorDataset's default), unpinned.
    # Batches from workers (CPU tensors, always) are pinned, so that their copy to the GPU overlaps compute.
    pinned = lambda ds, args, ctx: ddp_train.loader_of(ds, args, ctx)[0].pin_memory  # noqa: E731
    assert not pinned(data, default, gpu) and not pinned(other, none, gpu)
    assert pinned(other, default, gpu) and pinned(data, two, gpu) and not pinned(other, two, cpu)


@pytest.mark.fast
def test_micro_batches_are_balanced_and_never_hold_one_sample_when_more_fit():
    sizes = lambda n, most: [len(b) for b in ddp_train.split(list(range(n)), most)]  # noqa: E731
    assert (
        sizes(65, 64) == [32, 33] and sizes(128, 64) == [64, 64] and sizes(129, 64) == [43, 43, 43]
    )
    assert sizes(1, 64) == [1] and sizes(0, 64) == [] and sizes(7, 1) == [1] * 7
    assert sum(ddp_train.split(list(range(100)), 30), []) == list(range(100))  # in order, each once


@pytest.mark.fast
def test_each_local_process_gets_a_gpu_of_its_own_or_one_line_saying_why():
    choose = ddp_train.choose_gpu
    # more GPUs than processes
    assert [choose(r, 4, 8, "torchrun", None) for r in range(4)] == [
        0,
        1,
        2,
        3,
    ]
    # srun --gpu-bind=none
    assert [choose(r, 8, 8, "slurm", None) for r in range(8)] == list(range(8))
    assert [choose(r, 8, 1, "slurm", "0") for r in range(8)] == [
        0
    ] * 8  # srun --gpus-per-task=1: its own
    assert [choose(r, 4, 2, "slurm", "2,3") for r in range(4)] == [0, 0, 0, 0]  # --gpus-per-task=2
    for shared in (
        choose(1, 2, 1, "torchrun", "0"),
        choose(0, 2, 1, "torchrun", "0"),
        choose(0, 2, 1, "spawn", None),
    ):
        # one GPU
        assert (
            isinstance(shared, str) and "LOCAL_RANK=" in shared and "LOCAL_WORLD_SIZE=2" in shared
        )
    assert "sees 1 (CUDA_VISIBLE_DEVICES=0)" in choose(1, 2, 1, "torchrun", "0")
    beyond = choose(1, 1, 1, "env", None)  # LOCAL_RANK beyond the visible GPUs
    assert isinstance(beyond, str) and "LOCAL_RANK=1" in beyond and "<unset>" in beyond
    assert isinstance(choose(2, 4, 2, "torchrun", "0,1"), str) and isinstance(
        choose(0, 4, 2, "torchrun", "0,1"), str
    )


@pytest.mark.fast
def test_threads_divide_only_what_the_processes_share():
    cpus = ddp_train.cpus_per_process
    # srun --ntasks-per-node=8 --cpus-per-task=16: its own 16
    assert cpus(16, 8, "slurm", "16") == 16
    assert cpus(128, 8, "slurm", "16") == 16  # the same without binding: at most what it was given
    # torchrun's workers share
    assert cpus(128, 8, "torchrun", None) == 16 and cpus(32, 8, "torchrun", "32") == 4
    assert cpus(128, 8, "slurm", None) == 16 and cpus(2, 4, "spawn", None) == 1


def test_srun_tasks_with_cpus_per_task_take_their_own_cores(tmp_path):
    port = free_port(15000, 35000)
    slurm = dict(
        SLURM_NTASKS=2,
        SLURM_STEP_NUM_TASKS=2,
        SLURM_STEP_TASKS_PER_NODE=2,
        SLURM_JOB_ID=port - 15000,
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_CPUS_PER_TASK=CORES,
        OMP_NUM_THREADS=None,
    )
    out_dir = tmp_path / "out"
    tasks = [
        Launch(
            python_cmd(*SMALL, "--epochs", 1, "--out-dir", out_dir),
            tmp_path,
            f"task{i}",
            env=clean_env(**slurm, SLURM_PROCID=i, SLURM_LOCALID=i),
        )
        for i in range(2)
    ]
    assert finish(tasks) == [0, 0], tasks[0].stderr + tasks[1].stderr
    assert f"slurm, world size 2 (2/node), gloo, cpu, {CORES} thread(s)/process" in tasks[0].stdout


@pytest.mark.fast
def test_checkpoints_load_onto_the_cpu_memory_mapped_for_gpus_and_read_for_the_cpu(tmp_path):
    zipped, legacy = tmp_path / "zipped.pt", tmp_path / "legacy.pt"
    weights = ddp_train.build_model(default_args()).state_dict()
    torch.save(weights, zipped)
    torch.save(weights, legacy, _use_new_zipfile_serialization=False)  # torch < 1.6's format
    assert ddp_train.checkpoint_load_options("cuda", zipped) == {
        "map_location": "cpu",
        "mmap": True,
        "weights_only": True,
    }
    assert ddp_train.checkpoint_load_options("cpu", zipped)["mmap"] is False
    # A legacy file cannot be memory-mapped (torch.load raises): it is read, on a GPU run too.
    assert ddp_train.checkpoint_load_options("cuda", legacy)["mmap"] is False
    for path in (zipped, legacy):
        # as a GPU run loads
        loaded = torch.load(path, **ddp_train.checkpoint_load_options("cuda", str(path)))
        assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    with pytest.raises(RuntimeError):  # negative control: what a GPU run did before
        torch.load(legacy, map_location="cpu", mmap=True, weights_only=True)


def test_a_legacy_format_init_from_file_starts_a_run(tmp_path):
    legacy = tmp_path / "legacy.pt"
    torch.save(
        ddp_train.build_model(default_args()).state_dict(),
        legacy,
        _use_new_zipfile_serialization=False,
    )
    r = run(python_cmd(*SMALL, "--epochs", 1, "--init-from", legacy), tmp_path)
    assert f"initialised the model from {legacy}" in r.stdout, r


def test_checkpoints_load_onto_the_cpu_and_resume_bit_identical(project, tmp_path, reference):
    log = tmp_path / "loads"
    env = clean_env(LOAD_LOG=log)
    out = tmp_path / "out"
    with Launch(
        python_cmd(*FT, "--spawn", 2, "--out-dir", out, script=str(project / "spy_load.py")),
        tmp_path,
        "stopped",
        env=env,
    ) as launch:
        wait_for_checkpoint(launch, out)
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.wait() == 75, launch.stderr
    r = run(python_cmd(*FT, "--spawn", 2, script=str(project / "spy_load.py")), tmp_path, env=env)
    assert resumed_at(r.stdout)[0] > 0
    for rank in (
        0,
        1,
    ):  # each rank reads it onto the CPU: on GPUs memory-mapped (see the test above)
        assert Path(f"{log}.{rank}").read_text().splitlines() == [
            "checkpoint.pt map_location=cpu mmap=False"
        ]
    assert_same_weights(r.weights, reference(torchrun_cmd(2, *FT)).weights, exact=True)


def test_fp16_skipped_steps_are_counted_out_of_the_norm_and_metrics_stay_strict_json(
    project, tmp_path
):
    def strict(line):
        return json.loads(
            line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl: {line}")
        )

    script = str(project / "overflow.py")
    # A third of the steps overflow: GradScaler skips them; they are counted, and kept out of the maximum.
    some = run(
        python_cmd(
            "--epochs", 1, "--batch-size", 16, "--amp", "fp16", "--clip-grad-norm", 1, script=script
        ),
        tmp_path,
        out="some",
        env=clean_env(OVERFLOW_EVERY=3),
    )
    [record] = [strict(line) for line in (some.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert 25 <= record["skipped_steps"] <= 35 and 0 < record["grad_norm_max"] < 100, record
    assert "warning" not in some.stderr, some
    # Every step overflows: every step is counted as skipped.
    every = run(
        python_cmd("--epochs", 1, "--batch-size", 16, "--amp", "fp16", script=script),
        tmp_path,
        out="every",
        env=clean_env(OVERFLOW_EVERY=1),
    )
    [record] = [strict(line) for line in (every.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["skipped_steps"] == 90 and "grad_norm_max" not in record


def test_ddp_buckets_follow_the_order_gradients_really_arrive_in(project, tmp_path):
    # The model registers its layers last-first and runs them first-last: its first layer's gradients
    # arrive first, and DDP's first bucket, the one it all-reduces while backward still runs, holds them.
    buckets = tmp_path / "buckets"
    run(
        torchrun_cmd(2, *SMALL, "--epochs", 1, script=str(project / "reversed.py")),
        tmp_path,
        env=clean_env(BUCKETS=buckets),
    )
    layout = json.loads(Path(f"{buckets}.0").read_text())
    order = [
        [int(i) for i in bucket.split()]
        for bucket in layout["rebuilt_per_bucket_param_indices"].split(",")
    ]
    # Parameters by index: layers.0 (0, 1) .. layers.3 (6, 7), head (8, 9). Backward reaches the head
    # first, then layers.0, which ran last. A warm-up on a made-up loss would give registration order
    # reversed (9, 8, 7, ...), and layers.0 would wait in the last bucket.
    assert sum(order, []) == [9, 8, 1, 0, 3, 2, 5, 4, 7, 6] and {0, 1} <= set(order[0]), layout
    assert len(order) > 1 and layout["has_rebuilt_buckets"] == 1


# ---------------------------------------------------------------------------
# Long runs you can watch: progress lines and checkpoints on a clock, agreed by all ranks
# ---------------------------------------------------------------------------

PROGRESS = re.compile(
    r"^  epoch +(\d+)/(\d+)  step +([\d,]+)/([\d,]+) \( *([\d.]+)%\)  train_loss ([\d.]+) +([\d,]+) "
    r"samples/s(?: +([\d,]+) tokens/s)?  (?:data wait +\d+%|rank \d+ (?:waits for data|computes) \d+% of "
    r"the time \(median \d+%\))  lr \S+  elapsed (\d+):(\d\d):(\d\d)  ETA (\d+):(\d\d):(\d\d)$",
    re.M,
)


def seconds(h, m, s) -> int:
    return 3600 * int(h) + 60 * int(m) + int(s)


def test_progress_lines_come_on_a_clock_with_percentage_throughput_and_a_fair_eta(tmp_path):
    # 2 epochs of 65,536 samples: seconds, and a line at least every 0.2 s.
    r = run(
        python_cmd(
            "--num-samples", 65536, "--eval-samples", 0, "--epochs", 2, "--log-seconds", 0.2
        ),
        tmp_path,
    )
    lines = PROGRESS.findall(r.stdout)
    first_epoch_line = r.stdout.index("\nepoch   1/2")
    assert (
        len(lines) >= 4 and r.stdout.index(PROGRESS.search(r.stdout).group(0)) < first_epoch_line
    ), r.stdout
    percents = [float(line[4]) for line in lines]
    assert (
        percents == sorted(percents) and percents[-1] < 100 and len(set(percents)) == len(percents)
    )
    assert all(int(line[6].replace(",", "")) > 1000 for line in lines) and all(
        float(line[5]) < 3 for line in lines
    )
    assert all(line[3] == "2,048" for line in lines)  # 1,024 steps an epoch, 2 epochs
    # The last line's ETA against the time the run really took from there (whole seconds on both sides).
    elapsed, eta = seconds(*lines[-1][8:11]), seconds(*lines[-1][11:14])
    total = re.search(
        r"saved .*: 2 epoch\(s\), 2048 steps, (\d+):(\d\d):(\d\d) since launch$", r.stdout, re.M
    )
    assert total, r.stdout
    assert abs(seconds(*total.groups()) - elapsed - eta) <= 2, (lines[-1], total.group(0))


def test_clock_driven_progress_lines_come_once_each_not_on_two_steps_in_a_row(tmp_path):
    # The ranks agree one step late; what was due must not be voted for again at the step that acts on it
    # (a progress line here; a clock-driven checkpoint takes the same path).
    r = run(
        torchrun_cmd(
            2, "--num-samples", 65536, "--eval-samples", 0, "--epochs", 2, "--log-seconds", 0.2
        ),
        tmp_path,
    )
    steps = [int(line[2].replace(",", "")) for line in PROGRESS.findall(r.stdout)]
    assert len(steps) >= 3 and all(b - a > 1 for a, b in zip(steps, steps[1:])), steps


def test_short_runs_print_what_they_always_printed(tmp_path):
    # The default task takes a few seconds: shorter than --log-seconds' 30, so no progress line.
    r = run(python_cmd(*SMALL), tmp_path)
    assert [line.split()[0] for line in r.stdout.splitlines()] == [
        "ddp_train.py:",
        "global",
        "epoch",
        "epoch",
        "saved",
    ]
    assert not PROGRESS.search(r.stdout) and r.stderr == ""


def test_clock_driven_logging_and_saving_with_a_slow_rank_neither_hang_nor_change_the_run(
    project, tmp_path, reference
):
    # Rank 1's Dataset takes 2 ms a sample, so the ranks' clocks and paces differ; lines every 0.2 s and
    # checkpoints every 0.5 s are decided together, and the run is the one without them, bit for bit.
    slow = str(project / "slow.py")
    env = clean_env(SLOW_RANKS="1", SLOW_MS=2)
    clocks = run(
        torchrun_cmd(
            2,
            *DIGITS,
            "--save-every",
            0,
            "--log-seconds",
            0.2,
            "--save-minutes",
            1 / 120,
            script=slow,
        ),
        tmp_path,
        env=env,
    )
    assert len(PROGRESS.findall(clocks.stdout)) >= 3, clocks.stdout
    assert (clocks.out_dir / "checkpoint.pt").exists()
    assert_same_weights(
        clocks.weights, reference(digits_cmd(project, "torchrun")).weights, exact=True
    )


def test_a_hard_kill_loses_only_the_minutes_since_the_clock_checkpoint_and_resumes_bit_identical(
    project, tmp_path, reference
):
    # A slowed user project (20 ms a sample: 7 s an epoch) with 2 DataLoader workers, checkpoints every
    # 0.3 s and none by step count:
    # kill -9 of the whole job once a checkpoint lands mid-epoch; the rerun starts from there.
    out, slow = tmp_path / "out", str(project / "slow.py")
    cmd = torchrun_cmd(
        2, *DIGITS, "--workers", 2, "--save-every", 0, "--save-minutes", 0.005, script=slow
    )
    with Launch([*cmd, "--out-dir", out], tmp_path, "killed", env=clean_env(SLOW_MS=20)) as launch:

        def mid_epoch_checkpoint():
            try:
                return (
                    torch.load(out / "checkpoint.pt", weights_only=True)["progress"][
                        "step_in_epoch"
                    ]
                    >= 10
                )
            except (OSError, RuntimeError, EOFError):  # not there yet
                return False

        launch.wait_for(mid_epoch_checkpoint, "a clock-driven checkpoint mid-epoch")
        for worker in worker_pids(
            launch.proc.pid
        ).values():  # torchrun starts each in a session of its own
            os.killpg(worker, signal.SIGKILL)  # with its DataLoader workers
        launch.kill()
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    r = run(cmd, tmp_path)
    saved = saved["progress"]
    assert (
        resumed_at(r.stdout) == (saved["step_in_epoch"], saved["step"])
        and saved["step_in_epoch"] > 0
    ), r
    assert_same_weights(r.weights, reference(digits_cmd(project, "torchrun")).weights, exact=True)
    assert [m["epoch"] for m in r.metrics] == [1, 2]


# ---------------------------------------------------------------------------
# Fault tolerance: checkpoints, resume, preemption
# ---------------------------------------------------------------------------

# Long enough epochs to stop mid-epoch: 2 processes x 16 take 256 steps per epoch, 1 x 16 take 512.
FT = [
    "--num-samples",
    "8192",
    "--eval-samples",
    "256",
    "--epochs",
    "2",
    "--batch-size",
    "16",
    "--save-every",
    "40",
]


FT_TORCHRUN2, FT_PYTHON = torchrun_cmd(2, *FT), python_cmd(*FT)


def test_killed_worker_is_restarted_and_ends_bit_identical(tmp_path, reference):
    out = tmp_path / "out"
    cmd = torchrun_cmd(2, *FT, "--out-dir", out, launcher_args=["--max-restarts=1"])
    with Launch(cmd, tmp_path) as launch:
        wait_for_checkpoint(launch, out)
        os.kill(worker_pids(launch.proc.pid)[1], signal.SIGKILL)  # rank 1 dies mid-epoch
        code = launch.wait()
    r = Result.of(launch, out)
    assert code == 0, r
    step_in_epoch, _ = resumed_at(r.stdout)
    assert step_in_epoch > 0  # it really was mid-epoch
    assert_same_weights(r.weights, reference(FT_TORCHRUN2).weights, exact=True)
    assert [m["epoch"] for m in r.metrics] == [1, 2]  # no epoch logged twice
    for a, b in zip(r.metrics, reference(FT_TORCHRUN2).metrics):
        assert (
            a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-9)
            and a["eval_accuracy"] == b["eval_accuracy"]
        )


@pytest.mark.tier
def test_sigterm_to_torchrun_checkpoints_on_every_rank_and_rerun_is_bit_identical(
    tmp_path, reference
):
    out = tmp_path / "out"
    cmd = torchrun_cmd(2, *FT)
    with Launch([*cmd, "--out-dir", out], tmp_path, "stopped") as launch:
        wait_for_checkpoint(launch, out)
        os.kill(launch.proc.pid, signal.SIGTERM)  # what a scheduler sends the launcher
        code = launch.wait()
    # torchrun forwards SIGTERM to the workers, waits for them, then exits 1 itself.
    assert code == 1, launch.stderr
    m = re.search(r"stopped by a signal at step (\d+).*exit code 75", launch.stdout)
    assert m, launch.stdout
    assert torch.load(out / "checkpoint.pt", weights_only=True)["progress"]["step"] == int(
        m.group(1)
    )
    assert not (out / "model.pt").exists()
    again = run(cmd, tmp_path)
    assert resumed_at(again.stdout)[1] == int(m.group(1))
    assert_same_weights(again.weights, reference(FT_TORCHRUN2).weights, exact=True)


TORCHRUN_HELP = subprocess.run(
    [PY, "-m", "torch.distributed.run", "--help"], capture_output=True, text=True
).stdout


@pytest.mark.tier
def test_the_launch_helpers_give_torchrun_a_shutdown_timeout_of_120_s_or_yours_or_say_in_one_line_it_has_none(
    tmp_path,
):
    # torchrun SIGKILLs its workers 30 s after a stop signal unless told otherwise: too short for a big save.
    # Every make target's torchrun goes through run_multi_node.sh, which passes the timeout on.
    env = clean_env(MAKEFLAGS=None, MAKELEVEL=None, MFLAGS=None)
    make = lambda *a: subprocess.run(
        ["make", "-n", "-s", *a], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    ).stdout
    for target in ("train-cpu", "train-2gpu", "train-multinode"):
        assert "SHUTDOWN_TIMEOUT=120 " in make(target, "gpus=2") and "./run_multi_node.sh " in make(
            target
        ), target
        assert "SHUTDOWN_TIMEOUT=300 " in make(target, "gpus=2", "SHUTDOWN_TIMEOUT=300"), target
    # run_multi_node.sh prints its timeouts and torchrun's command, here of a script that does nothing. A torchrun
    # before torch 2.12 has no --shutdown-timeout: its 30 s are said in one line, and the run goes on.
    (tmp_path / "noop.py").write_text("")
    helper = [RUN_MULTI, "--nproc-per-node", 1, "--script", tmp_path / "noop.py"]
    has_it = "--shutdown-timeout" in TORCHRUN_HELP
    assert has_it == (tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 12))
    for setting, timeout in ({}, 120), (dict(SHUTDOWN_TIMEOUT=7), 7):
        r = run(helper, tmp_path, env=clean_env(PYTHON=PY, **setting))
        timeout = timeout if has_it else 30
        said = f"{timeout}s for the workers to save (torchrun) and SIGKILL to torchrun at {timeout + 15}s"
        assert said in r.stderr, r
        assert (f" --shutdown-timeout={timeout} " in r.stderr) == has_it, r
        no_flag = [line for line in r.stderr.splitlines() if "has no --shutdown-timeout" in line]
        assert len(no_flag) == (0 if has_it else 1), r
        if not has_it:
            assert (
                "30 s to save their checkpoint, then SIGKILL; a longer save needs torch 2.12"
                in no_flag[0]
            ), r
    r = run(helper, tmp_path, env=clean_env(PYTHON=PY, SHUTDOWN_TIMEOUT="2m"), expect=2)
    assert (
        last_line(r.stderr)
        == "run_multi_node.sh: SHUTDOWN_TIMEOUT must be a whole number, got '2m'"
    ), r


def test_run_multi_node_sigkills_a_torchrun_deaf_to_the_signal_15_s_after_its_shutdown_timeout(
    tmp_path,
):
    # A "torchrun" that ignores every stop signal (as one blocked on a node that left the network does).
    deaf = tmp_path / "deaf"
    deaf.write_text(
        '#!/bin/sh\ncase "$*" in *--help*) echo --shutdown-timeout; exit;; esac\n'
        "trap '' TERM INT HUP USR1\nexec sleep 120\n"
    )
    deaf.chmod(0o755)
    cmd = [RUN_MULTI, "--nproc-per-node", 1, "--script", RUN_MULTI]
    with Launch(cmd, tmp_path, env=clean_env(PYTHON=deaf, SHUTDOWN_TIMEOUT=1)) as launch:
        launch.wait_for(
            lambda: "SIGKILL to torchrun at 16s" in launch.stderr, "the timeouts line", timeout=30
        )
        time.sleep(0.5)  # the helper's own loop is running
        launch.proc.send_signal(signal.SIGTERM)  # to the helper alone: it passes it on, then kills
        signalled = time.monotonic()
        code = launch.wait(60)
    took = time.monotonic() - signalled
    assert code == 128 + signal.SIGKILL, launch.stderr  # its own exit: torchrun's
    assert 14.5 < took < 25, took  # SHUTDOWN_TIMEOUT + 15 s (bash counts whole seconds)


def torchrun_agent(launch: Launch) -> int:
    """The pid of the torchrun agent in launch's session that runs two workers (a make's, say)."""
    for proc in Path("/proc").iterdir():
        try:
            pid = int(proc.name)
            if os.getsid(pid) == launch.proc.pid and len(worker_pids(pid)) == 2:
                return pid
        except (ValueError, OSError):
            continue
    pytest.fail(
        f"no torchrun with two workers under {launch.cmd}\n{launch.stdout}\n{launch.stderr}"
    )


@pytest.mark.skipif(
    "--shutdown-timeout" not in TORCHRUN_HELP, reason="torchrun's --shutdown-timeout: torch 2.12+"
)
def test_sigterm_to_make_train_cpu_saves_a_checkpoint_that_takes_longer_than_torchruns_30_s(
    project, tmp_path
):
    # A big model on a slow disk: the preemption checkpoint takes 35 s, past torchrun's default 30 s.
    # The same run twice at once: as make train-cpu launches it (SHUTDOWN_TIMEOUT 120 s), and with
    # SHUTDOWN_TIMEOUT=30, which must lose the checkpoint (the test can tell a cut-off save).
    # make's VENV, set up: this interpreter, and .ready newer than the Makefile
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(PY)} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".ready").touch()
    runs = {}
    for name, shutdown in ("saved", []), ("cut", ["SHUTDOWN_TIMEOUT=30"]):
        args = shlex.join(
            [
                "--epochs",
                "1",
                "--batch-size",
                "16",
                "--save-every",
                "0",
                "--out-dir",
                f"{tmp_path}/{name}",
            ]
        )
        cmd = [
            "make",
            "-s",
            "train-cpu",
            f"VENV={venv}",
            f"SCRIPT={project / 'slow_stop.py'}",
            f"ARGS={args}",
            *shutdown,
        ]
        env = clean_env(
            HOLD_AT=5,
            HOLD_FILE=tmp_path / f"{name}.held",
            SAVE_SECONDS=35,
            MAKEFLAGS=None,
            MAKELEVEL=None,
            MFLAGS=None,
        )
        runs[name] = Launch(cmd, tmp_path, name, env=env)
    try:
        for name, launch in runs.items():  # rank 0 waits at its 5th step for the signal
            launch.wait_for(lambda: (tmp_path / f"{name}.held").exists(), "training", timeout=120)
        for launch in runs.values():
            os.kill(torchrun_agent(launch), signal.SIGTERM)  # what a scheduler sends the launcher
        signalled = time.time()
        codes = {name: launch.wait(120) for name, launch in runs.items()}
    finally:
        for launch in runs.values():
            launch.kill()
    saved, cut = runs["saved"], runs["cut"]
    took = time.time() - signalled
    # torchrun's 1 after SIGTERM
    assert codes["saved"] == 2 and "Error 1" in saved.stderr, saved.stderr
    m = re.search(r"stopped by a signal at step (\d+).*exit code 75", saved.stdout)
    assert m, saved.stdout + saved.stderr
    checkpoint = tmp_path / "saved" / "checkpoint.pt"
    assert torch.load(checkpoint, weights_only=True)["progress"]["step"] == int(m.group(1))
    # the save really took 35 s
    assert checkpoint.stat().st_mtime - signalled > 30 and took > 35, took
    # With torchrun's 30 s the workers were SIGKILLed mid-save: nothing saved, nothing said.
    assert codes["cut"] == 2, cut.stderr
    assert (
        "stopped by a signal" not in cut.stdout
        and not (tmp_path / "cut" / "checkpoint.pt").exists()
    ), cut.stdout
    assert "forcefully exiting via 9" in cut.stderr and "forcefully" not in saved.stderr, cut.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_single_process_stop_signal_exits_75_and_rerun_is_bit_identical(tmp_path, reference, sig):
    out = tmp_path / "out"
    with Launch(python_cmd(*FT, "--out-dir", out), tmp_path, "stopped") as launch:
        wait_for_checkpoint(launch, out)
        launch.proc.send_signal(sig)
        assert launch.wait() == 75, launch.stderr
    again = run(python_cmd(*FT), tmp_path)
    assert "resumed from" in again.stdout
    assert_same_weights(again.weights, reference(FT_PYTHON).weights, exact=True)


# Four ranks x 16: 64 steps, a checkpoint every 10. The same run whichever way its 4 processes start.
FOUR = [
    "--num-samples",
    "4096",
    "--eval-samples",
    "64",
    "--epochs",
    "1",
    "--batch-size",
    "16",
    "--save-every",
    "10",
]


def test_four_ranks_stop_and_resume_bit_identical(tmp_path, reference):
    # Beyond two ranks the all-reduce's rounding depends on DDP's bucket state: still bit-identical.
    out = tmp_path / "out"
    with Launch(python_cmd(*FOUR, "--spawn", 4, "--out-dir", out), tmp_path, "stopped") as launch:
        wait_for_checkpoint(launch, out)
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.wait() == 75, launch.stderr
    again = run(python_cmd(*FOUR, "--spawn", 4), tmp_path)
    assert resumed_at(again.stdout)[0] > 0
    assert_same_weights(again.weights, reference(torchrun_cmd(4, *FOUR)).weights, exact=True)


def test_a_truncated_checkpoint_stops_with_one_line_and_the_one_before_resumes_exactly(
    tmp_path, reference
):
    first = run(python_cmd(*FT), tmp_path)
    ckpt, prev = first.out_dir / "checkpoint.pt", first.out_dir / "checkpoint.prev.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # a full disk, a bad copy
    (first.out_dir / "model.pt").unlink()
    r = run(python_cmd(*FT), tmp_path, expect=2)
    lines = r.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and "checkpoint.pt is unreadable" in lines[0]
        and f"--resume {prev}," in lines[0]
    ), r
    r = run(python_cmd(*FT, "--resume", prev), tmp_path)  # what the line says
    assert "resumed from" in r.stdout and "checkpoint.prev.pt" in r.stdout
    assert_same_weights(r.weights, reference(FT_PYTHON).weights, exact=True)
    # A save stopped between its two renames (checkpoint.pt already moved to checkpoint.prev.pt, the new
    # one not yet in place): the rerun finds checkpoint.prev.pt, a finished run, and writes model.pt from it.
    os.replace(ckpt, prev)
    (first.out_dir / "model.pt").unlink()
    r = run(python_cmd(*FT), tmp_path)
    assert "checkpoint.prev.pt holds a finished run" in r.stdout, r
    assert_same_weights(r.weights, reference(FT_PYTHON).weights, exact=True)
    # Rerunning a finished run changes nothing.
    done = run(python_cmd(*FT), tmp_path)
    assert "holds a finished run" in done.stdout and "nothing to train" in done.stdout
    assert_same_weights(done.weights, r.weights, exact=True)


def test_unreadable_checkpoints_stop_with_one_line_and_stay_untouched(tmp_path):
    first = run(python_cmd(*SMALL), tmp_path)
    files = {p: p.read_bytes()[:500] for p in first.out_dir.glob("checkpoint*.pt")}
    for p, head in files.items():
        p.write_bytes(head)
    r = run(python_cmd(*SMALL), tmp_path, expect=2)
    lines = r.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and "checkpoint.pt is unreadable" in lines[0]
        and "Traceback" not in r.stderr
    ), r
    assert {p: p.read_bytes() for p in files} == files


def test_resume_with_another_world_size_keeps_global_batch(tmp_path, reference):
    out = tmp_path / "out"
    with Launch(python_cmd(*FT, "--spawn", 2, "--out-dir", out), tmp_path, "stopped") as launch:
        wait_for_checkpoint(launch, out)
        launch.proc.send_signal(signal.SIGTERM)  # the --spawn parent forwards it to its workers
        assert launch.wait() == 75, launch.stderr
    saved = (out / "checkpoint.pt").read_bytes()
    # Another global batch would be another run: one clear line, nothing touched.
    r = run(python_cmd(*FT), tmp_path, expect=2)
    assert "global_batch_size 32 -> 16" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r
    assert (out / "checkpoint.pt").read_bytes() == saved
    # One process with twice the batch continues the same run (to float rounding).
    r = run(python_cmd(*FT, "--batch-size", 32), tmp_path)
    assert resumed_at(r.stdout)[0] > 0 and "saved by world size 2" in r.stdout
    assert_same_run(r.weights, reference(FT_TORCHRUN2).weights)
    for a, b in zip(r.metrics, reference(FT_TORCHRUN2).metrics):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)


def test_resume_never_ignores_checkpoint_and_keeps_it_until_its_first_save(tmp_path, reference):
    other = run(python_cmd(*SMALL, "--seed", 1), tmp_path)
    before = (other.out_dir / "checkpoint.pt").read_bytes()
    # A fresh run killed before its first save (epoch end) leaves the old checkpoint as it was.
    big = ["--num-samples", "65536", "--eval-samples", "64", "--epochs", "1"]
    with Launch(
        python_cmd(*big, "--resume", "never", "--out-dir", other.out_dir), tmp_path, "killed"
    ) as launch:
        launch.wait_for(lambda: "global batch" in launch.stdout, "training to start")
        launch.kill()
    assert (other.out_dir / "checkpoint.pt").read_bytes() == before
    # Run to the end, it is exactly a fresh run, and the old checkpoint survived its first save.
    r = run(python_cmd(*FT, "--resume", "never"), tmp_path)
    assert "resumed" not in r.stdout and [m["epoch"] for m in r.metrics] == [1, 2]
    assert_same_weights(r.weights, reference(FT_PYTHON).weights, exact=True)


# ---------------------------------------------------------------------------
# Multi-node: two hosts with their own addresses, in network namespaces
# ---------------------------------------------------------------------------


@multinode
@pytest.mark.parametrize(
    "rdzv, hostname",
    [("c10d", None), ("static", None), ("c10d", "localhost")],
    ids=["c10d", "static", "c10d-hostnames-on-loopback"],
)
def test_two_hosts_match_single_process_with_same_global_batch(two_hosts, tmp_path, rdzv, hostname):
    # With IFNAME set, nothing depends on hostnames resolving to the hosts' own addresses.
    out = tmp_path / "out"
    nodes = start_nodes(
        two_hosts, tmp_path, [*SMALL, "--out-dir", out], free_port(), RDZV=rdzv, hostname=hostname
    )
    assert finish(nodes) == [0, 0], nodes[0].stderr + nodes[1].stderr
    r = Result.of(nodes[0], out)
    assert "torchrun, world size 4 (2/node)" in r.stdout, r
    assert [m["world_size"] for m in r.metrics] == [4, 4] and r.metrics[-1][
        "effective_batch_size"
    ] == 128
    one = run(python_cmd(*SMALL, "--batch-size", 128), tmp_path, out="one")
    assert_same_weights(r.weights, one.weights)


@multinode
def test_two_hosts_slurm_mode_takes_master_from_nodelist(two_hosts, tmp_path):
    # What sbatch + `srun ./run_multi_node.sh --slurm` gives each node: no MASTER_ADDR at all.
    out = tmp_path / "out"
    nodes = []
    for i, h in enumerate(two_hosts):
        # No MASTER_PORT: --slurm derives it from the job id, the same on both hosts.
        env = clean_env(
            PYTHON=PY,
            SLURM_JOB_ID=4242,
            SLURM_NODEID=i,
            SLURM_JOB_NUM_NODES=2,
            SLURM_PROCID=i,
            SLURM_JOB_NODELIST="node[0-1]",
            NPROC_PER_NODE=2,
            IFNAME=h.ifname,
            TIMEOUT=30,
        )
        nodes.append(
            Launch(
                h.command(RUN_MULTI, "--slurm", "--", *SMALL, "--out-dir", out),
                tmp_path,
                f"slurm{i}",
                env=env,
            )
        )
    assert finish(nodes) == [0, 0], nodes[0].stderr + nodes[1].stderr
    assert "world size 4 (2/node)" in nodes[0].stdout and (out / "model.pt").exists()


@multinode
def test_unreachable_master_is_one_line_within_timeout(two_hosts, tmp_path):
    env = node_env(
        two_hosts,
        1,
        free_port(),
        TIMEOUT=5,
        MASTER_ADDR=two_hosts[0].addr.rsplit(".", 1)[0] + ".99",
    )
    t0 = time.monotonic()
    with Launch(
        two_hosts[1].command(RUN_MULTI, *SMALL, "--out-dir", tmp_path / "out"), tmp_path, env=env
    ) as node:
        code = node.wait(60)
    assert code != 0 and time.monotonic() - t0 < 25
    assert (
        "cannot reach MASTER_ADDR" in last_line(node.stderr) and "Traceback" not in node.stderr
    ), node.stderr


@multinode
def test_second_node_never_arriving_is_one_line_within_timeout(two_hosts, tmp_path):
    env = node_env(two_hosts, 0, free_port(), TIMEOUT=5)
    t0 = time.monotonic()
    with Launch(
        two_hosts[0].command(RUN_MULTI, *SMALL, "--out-dir", tmp_path / "out"), tmp_path, env=env
    ) as node:
        code = node.wait(60)
    assert code != 0 and time.monotonic() - t0 < 30
    assert "not all 2 nodes joined within 5s" in last_line(node.stderr), node.stderr


@multinode
def test_taken_master_port_is_one_line(two_hosts, tmp_path):
    port = free_port()
    holder = [
        PY,
        "-c",
        f"import socket,time; s=socket.socket(); s.bind(({two_hosts[0].addr!r}, {port})); s.listen(); "
        "print('listening', flush=True); time.sleep(60)",
    ]
    with Launch(two_hosts[0].command(*holder), tmp_path, "holder") as listener:
        listener.wait_for(lambda: "listening" in listener.stdout, "the port to be taken")
        with Launch(
            two_hosts[0].command(RUN_MULTI, *SMALL), tmp_path, env=node_env(two_hosts, 0, port)
        ) as node:
            code = node.wait(60)
    assert code == 2 and f"port {port} on {two_hosts[0].addr} is already in use" in last_line(
        node.stderr
    ), node.stderr


@multinode
def test_hostname_on_loopback_without_interface_is_one_line(two_hosts, tmp_path):
    # The classic multi-NIC trap: the hostname resolves to 127.0.x.x, so gloo would advertise it.
    env = node_env(two_hosts, 0, free_port(), IFNAME="")
    with Launch(
        two_hosts[0].command(RUN_MULTI, *SMALL, hostname="localhost"), tmp_path, env=env
    ) as node:
        code = node.wait(60)
    assert code == 2 and f"set IFNAME={two_hosts[0].ifname}" in last_line(node.stderr), node.stderr


@multinode
@pytest.mark.parametrize("how", ["killed", "left the network"])
def test_surviving_node_exits_with_a_message_when_the_other_dies(two_hosts, tmp_path, how):
    out = tmp_path / "out"
    long_run = [
        "--num-samples",
        "400000",
        "--eval-samples",
        "64",
        "--epochs",
        "1",
        "--save-every",
        "20",
    ]
    nodes = start_nodes(two_hosts, tmp_path, [*long_run, "--out-dir", out], free_port(), TIMEOUT=10)
    try:
        nodes[0].wait_for(lambda: (out / "checkpoint.pt").exists(), "training to run")
        t0 = time.monotonic()
        if how == "killed":
            two_hosts[1].kill_all()
        else:  # no RST, no FIN: the other node simply stops answering
            sh("ip", "-n", two_hosts[1].ns, "link", "set", two_hosts[1].ifname, "down")
        code = nodes[0].wait(90)
        elapsed = time.monotonic() - t0
    finally:
        subprocess.run(
            ["ip", "-n", two_hosts[1].ns, "link", "set", two_hosts[1].ifname, "up"],
            capture_output=True,
        )
        for n in nodes:
            n.kill()
    assert code != 0 and elapsed < 60, (code, elapsed)
    err = nodes[0].stderr
    assert (
        "lost contact with another process" in err
        and "a worker on another node stopped" in last_line(err)
    ), err


@multinode
def test_restarted_node_rejoins_and_run_ends_bit_identical(two_hosts, tmp_path, reference):
    out, port = tmp_path / "out", free_port()
    nodes = start_nodes(two_hosts, tmp_path, [*FOUR, "--out-dir", out], port, MAX_RESTARTS=1)
    try:
        nodes[0].wait_for(lambda: (out / "checkpoint.pt").exists(), "a first checkpoint")
        nodes[1].kill()  # node 1 dies; node 0's torchrun restarts its workers and waits for it
        two_hosts[1].kill_all()
        again = Launch(
            two_hosts[1].command(RUN_MULTI, *FOUR, "--out-dir", out),
            tmp_path,
            "node1-again",
            env=node_env(two_hosts, 1, port, MAX_RESTARTS=1),
        )
        codes = finish([nodes[0], again])
    finally:
        for n in nodes:
            n.kill()
    assert codes == [0, 0], nodes[0].stderr + again.stderr
    assert "resumed from" in nodes[0].stdout
    # Two nodes x 2 processes run exactly what 4 processes on one node run.
    assert_same_weights(
        torch.load(out / "model.pt", weights_only=True),
        reference(torchrun_cmd(4, *FOUR)).weights,
        exact=True,
    )


# ---------------------------------------------------------------------------
# Elastic: --global-batch fixes the run whatever the world size; torchrun --nnodes=MIN:MAX survives a
# lost node and welcomes a joining one
# ---------------------------------------------------------------------------

# 8,192 samples, 32 a step however many processes take them: 256 steps an epoch, a checkpoint every 40.
ELASTIC = [
    "--num-samples",
    8192,
    "--eval-samples",
    256,
    "--epochs",
    2,
    "--batch-size",
    16,
    "--global-batch",
    32,
    "--save-every",
    40,
    "--timeout",
    30,
]
# examples/digits.py's deterministic variant with 2 DataLoader workers: 23 steps an epoch.
LAST_CALL = 10  # seconds the rendezvous waits for more nodes once one is there
ELASTIC_PLAIN = [
    "--epochs",
    2,
    "--batch-size",
    32,
    "--global-batch",
    64,
    "--workers",
    2,
    "--save-every",
    5,
    "--timeout",
    30,
]


def elastic_agent(
    tmp_path: Path, name: str, port: int, host: bool, *args, script=SCRIPT, **env
) -> Launch:
    """One torchrun agent of an elastic job of one to two nodes, one process each, on this machine;
    the first hosts the rendezvous. A node without heartbeat for 3 s is dropped from it; the last call
    (10 s) is the slack a late agent has to join the others, however loaded the machine. `env`: more
    environment variables for it and its worker."""
    cmd = [
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc_per_node=1",
        "--max-restarts=3",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=elastic",
        f"--rdzv-conf=is_host={int(host)},last_call_timeout={LAST_CALL},keep_alive_interval=1,keep_alive_max_attempt=3",
        script,
        *map(str, args),
    ]
    return Launch(cmd, tmp_path, name, env=clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, **env))


def trains_as_two(launch: Launch, out: Path):
    """Until the first checkpoint of a run both nodes joined from the start (else this test is moot)."""

    def started() -> bool:
        first = launch.stdout.partition("\n")[0]
        assert "world size 1" not in first, (
            f"the other node missed the first rendezvous:\n{launch.stdout}"
        )
        return "world size 2" in first and (out / "checkpoint.pt").exists()

    launch.wait_for(started, "a first checkpoint of both nodes")


def kill_node(agent: Launch):
    """SIGKILL to a torchrun agent and its workers (each in a session of its own), DataLoader workers too."""
    for worker in worker_pids(agent.proc.pid).values():
        os.killpg(worker, signal.SIGKILL)
    agent.kill()


@pytest.mark.parametrize("user", [False, True], ids=["default-task", "user-project-with-workers"])
def test_a_lost_node_is_survived_with_the_same_global_batch(project, tmp_path, reference, user):
    args, script = (ELASTIC_PLAIN, str(project / "plain.py")) if user else (ELASTIC, SCRIPT)
    out, port = tmp_path / "out", free_port()
    a = elastic_agent(tmp_path, "a", port, True, *args, "--out-dir", out, script=script)
    b = elastic_agent(tmp_path, "b", port, False, *args, "--out-dir", out, script=script)
    try:
        trains_as_two(a, out)
        # node b is gone, agent and all: a's worker loses its peer, a restarts it alone
        kill_node(b)
        assert a.wait(180) == 0, a.stderr
    finally:
        for agent in (a, b):
            agent.kill()
    r = Result.of(a, out)
    assert "saved by world size 2" in r.stdout and r.metrics[-1]["world_size"] == 1, r
    assert {m["effective_batch_size"] for m in r.metrics} == {64 if user else 32}
    two = reference(torchrun_cmd(2, *args, *(["--workers", 0] if user else []), script=script))
    # the uninterrupted run at world size 2, to float rounding
    assert_same_run(r.weights, two.weights)


def test_a_joining_node_is_welcomed_with_the_same_global_batch(project, tmp_path, reference):
    # Node a trains alone through epoch 1, and is held at step 10 of epoch 2 (its 532nd micro-batch of 16)
    # until b joins: else, on a loaded machine, a can train all its steps before b's torchrun has even
    # started, and the rerun with b finds nothing to train. The hold ends with the SIGTERM with which
    # torchrun stops a's worker for the new rendezvous: the step goes on, the run stops at its end.
    script, out, port, held = (
        str(project / "alone.py"),
        tmp_path / "out",
        free_port(),
        tmp_path / "held",
    )
    a = elastic_agent(
        tmp_path,
        "a",
        port,
        True,
        *ELASTIC,
        "--out-dir",
        out,
        script=script,
        HOLD_AT=2 * (256 + 10),
        HOLD_FILE=held,
    )
    b = None
    try:
        a.wait_for(held.exists, "node a held alone at step 266")
        # a stops, saves, and resumes with b
        b = elastic_agent(tmp_path, "b", port, False, *ELASTIC, "--out-dir", out, script=script)
        assert finish([a, b], 180) == [0, 0], a.stderr + b.stderr
    finally:
        for agent in filter(None, (a, b)):
            agent.kill()
    r = Result.of(a, out)
    assert "stopped by a signal at step 266:" in r.stdout and "saved by world size 1" in r.stdout, r
    assert [m["world_size"] for m in r.metrics] == [1, 2]
    # at constant world size 1
    assert_same_run(r.weights, reference(python_cmd(*ELASTIC, script=script)).weights)


def test_global_batch_gives_the_same_run_on_every_world_size_that_divides_it(tmp_path, reference):
    fixed = [*SMALL, "--global-batch", 64, "--batch-size", 16]
    one, two, four = (
        run(cmd, tmp_path, out=name)
        for name, cmd in (
            ("one", python_cmd(*fixed)),
            ("two", torchrun_cmd(2, *fixed)),
            ("four", torchrun_cmd(4, *fixed)),
        )
    )
    assert (
        "global batch 64 = 16/process x 1 x 4 accum" in one.stdout
        and "16/process x 4 x 1 accum" in four.stdout
    )
    for r in (two, four):
        assert_same_weights(r.weights, one.weights)
        assert [m["effective_batch_size"] for m in r.metrics] == [64, 64]
    r = run(torchrun_cmd(3, *fixed), tmp_path, out="three", expect=1)
    errors = [line for line in r.stderr.splitlines() if line.startswith("ddp_train.py: error:")]
    assert len(errors) == 1 and "the world size (3) must divide it" in errors[0], r


@multinode
def test_a_node_cut_off_from_the_network_is_survived_by_an_elastic_job(
    two_hosts, tmp_path, reference
):
    # run_multi_node.sh with NNODES=1:2. Node 1's link goes down: node 0's worker waits --timeout (10 s)
    # in its collective, fails, and node 0 restarts it alone once node 1 has missed its heartbeats.
    out, port = tmp_path / "out", free_port()
    nodes = start_nodes(
        two_hosts,
        tmp_path,
        [*ELASTIC, "--out-dir", out],
        port,
        NNODES="1:2",
        NPROC_PER_NODE=1,
        TIMEOUT=10,
        LAST_CALL=LAST_CALL,
    )
    try:
        trains_as_two(nodes[0], out)
        sh("ip", "-n", two_hosts[1].ns, "link", "set", two_hosts[1].ifname, "down")
        assert nodes[0].wait(240) == 0, nodes[0].stderr
    finally:
        for n in nodes:
            n.kill()
        two_hosts[1].kill_all()
        subprocess.run(
            ["ip", "-n", two_hosts[1].ns, "link", "set", two_hosts[1].ifname, "up"],
            capture_output=True,
        )
    r = Result.of(nodes[0], out)
    assert "--nnodes=1:2" in r.stderr and f"last_call_timeout={LAST_CALL}" in r.stderr, r.stderr
    assert r.metrics[-1]["world_size"] == 1 and "saved by world size 2" in r.stdout, r
    assert_same_run(r.weights, reference(torchrun_cmd(2, *ELASTIC)).weights)


# ---------------------------------------------------------------------------
# SLURM: launch modes, preemption and requeue on a real cluster (conftest.py's slurm_cluster fixtures)
# ---------------------------------------------------------------------------

# 2 nodes x 2 processes x 16: 64 steps, a checkpoint every 8.
FT4 = [
    "--num-samples",
    "4096",
    "--eval-samples",
    "64",
    "--epochs",
    "1",
    "--batch-size",
    "16",
    "--save-every",
    "8",
]
# What the jobs' tasks get: two processes per node without GPUs, a rendezvous that gives up after 30 s.
JOB_ENV = {"NPROC_PER_NODE": "2", "TIMEOUT": "30"}


def sbatch_recipe(out_root: Path, *train_args) -> str:
    """The batch script in run_multi_node.sh's header as it stands, with /shared/runs -> out_root and
    train_args for ddp_train.py: the tests run what the header shows."""
    lines = [
        line[4:] for line in Path(RUN_MULTI).read_text().splitlines() if line.startswith("#   ")
    ]
    text = (
        "\n".join(
            lines[next(i for i, line in enumerate(lines) if line.startswith("#!/bin/bash")) :]
        )
        + "\n"
    )
    assert "srun ./run_multi_node.sh --slurm -- --out-dir /shared/runs/$SLURM_JOB_ID" in text, text
    assert '|| scontrol requeue "$SLURM_JOB_ID"' in text and "--requeue" in text, text
    return text.replace("/shared/runs", str(out_root)).replace(
        "-- --out-dir", f"-- {shlex.join(train_args)} --out-dir"
    )


def submit(cluster, tmp_path, script, *options, env=JOB_ENV):
    """sbatch from the project directory (for ./run_multi_node.sh); output in tmp_path/slurm-JOB.out."""
    return cluster.sbatch(script, *options, cwd=ROOT, env=env, output=tmp_path / "slurm-%j.out")


def finished(cluster, job, out_dir, timeout=120, restarts="0") -> Result:
    """Wait for the job: it must have COMPLETED after `restarts` requeues. Its output and out_dir."""
    info = cluster.wait(job, timeout)
    out = cluster.output(job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == (
        "COMPLETED",
        "0:0",
        restarts,
    ), (info, out)
    assert "terminate called" not in out, out
    return Result(0, out, out, Path(out_dir))


def workers_of(job) -> list[int]:
    """The ddp_train.py workers of a job, on all its nodes (the nodes share one pid namespace)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            if (
                f"SLURM_JOB_ID={job}".encode() in env
                and any(v.startswith(b"LOCAL_RANK=") for v in env)
                and b"ddp_train.py" in (proc / "cmdline").read_bytes()
            ):
                pids.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return pids


def wait_until(predicate, what, timeout=60, output=lambda: ""):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout}s\n{output()}"
        time.sleep(0.05)


def wait_for_training(cluster, job, out_dir, world):
    """Until the job's first checkpoint exists; returns the pids of its `world` workers."""
    wait_until(
        lambda: (out_dir / "checkpoint.pt").exists(),
        "first checkpoint",
        90,
        lambda: cluster.output(job),
    )
    pids = workers_of(job)
    assert len(pids) == world, (pids, cluster.output(job))
    return pids


def freeze(pids):
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def thaw(pids):
    send(pids, signal.SIGCONT)


def reached(pid, sig) -> bool:
    """Whether `sig` reached the frozen process `pid`: it waits there pending, or the process runs again
    (SLURM sends SIGCONT with the signals it delivers) or is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    masks = re.findall(r"^(?:SigPnd|ShdPnd):\s*(\w+)", status, re.M)
    return "State:\tT" not in status or any(int(m, 16) >> (sig - 1) & 1 for m in masks)


def assert_stopped_and_resumed(r: Result, sig: signal.Signals):
    """torchrun got `sig` and passed it on; every worker saved a checkpoint at one step and exited 75;
    the second run resumed from that step and saved model.pt once."""
    got = rf"Received (Signals\.)?({sig.name}|{sig.value}) death signal, shutting down workers"
    assert re.search(got, r.stdout), r.stdout
    m = re.search(r"stopped by a signal at step (\d+): .* saved; .*\(exit code 75\)", r.stdout)
    assert m and resumed_at(r.stdout)[1] == int(m.group(1)), r.stdout
    assert len(re.findall("^saved ", r.stdout, re.M)) == 1, r.stdout


_uninterrupted = {}


def uninterrupted(cluster, tmp_path_factory, wait=True) -> Result | None:
    """The header's batch script run to the end with FT4 on 2 nodes x 2 processes, once per session: what
    a stopped and resumed run must equal bit for bit. wait=False only submits it."""
    run = _uninterrupted
    if "result" not in run and (
        "job" not in run
        or run["cluster"].job_info(run["job"]).get("JobState", "gone")
        in FINAL_STATES - {"COMPLETED"} | {"gone"}
    ):  # none yet, or cancelled by a failed test
        run["cluster"], run["dir"] = cluster, tmp_path_factory.mktemp("uninterrupted")
        run["job"] = submit(cluster, run["dir"], sbatch_recipe(run["dir"], *FT4))
    if wait and "result" not in run:
        run["result"] = finished(run["cluster"], run["job"], run["dir"] / run["job"])
    return run.get("result")


# ---------------------------------------------------------------------------
# Launch modes on SLURM
# ---------------------------------------------------------------------------


@slurm
def test_srun_tasks_are_the_processes_of_one_run(slurm_cluster, tmp_path):
    # A bare `srun -n2 python ddp_train.py`: two tasks, one world of 2, one model.pt.
    out = tmp_path / "out"
    r = slurm_cluster.run(
        ["srun", "-n2", PY, SCRIPT, *SMALL, "--timeout", 30, "--out-dir", out],
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    check_completed_run(Result(r.returncode, r.stdout, r.stderr, out), 2, "slurm")


@slurm
def test_sbatch_script_running_python_directly_is_one_process_on_a_real_cluster(
    slurm_cluster, tmp_path
):
    # The batch script sees the job's SLURM_NTASKS=2 and SLURM_PROCID=0, but it is one process, not a task.
    out = tmp_path / "out"
    script = f"python {SCRIPT} {shlex.join(SMALL)} --timeout 30 --out-dir {out}\n"
    job = submit(slurm_cluster, tmp_path, script, "--ntasks=2")
    check_completed_run(finished(slurm_cluster, job, out), 1, "python")


@slurm
def test_a_step_on_part_of_the_allocation_runs_on_the_steps_own_nodes(slurm_cluster2, tmp_path):
    # The step's node list and node count (node1, 1), not the job's (node[0-1], 2).
    out = tmp_path / "out"
    script = f"srun -N1 -n1 -w node1 ./run_multi_node.sh --slurm -- {shlex.join(SMALL)} --out-dir {out}\n"
    r = finished(
        slurm_cluster2,
        submit(slurm_cluster2, tmp_path, script, "--nodes=2", "--ntasks-per-node=1"),
        out,
    )
    assert "--nnodes=1 " in r.stdout and "--rdzv-endpoint=node1:" in r.stdout, r.stdout
    check_completed_run(r, 2, "torchrun")


@slurm
def test_two_slurm_jobs_on_one_node_rendezvous_on_ports_of_their_own(slurm_cluster, tmp_path):
    # Each batch script waits for the other's, so that both runs are up at the same time on the one node.
    barrier = (
        f"touch {tmp_path}/ready.$SLURM_JOB_ID\n"
        f"for i in $(seq 300); do [ $(ls {tmp_path}/ready.* | wc -l) -ge 2 ] && break; sleep 0.1; done\n"
    )
    script = (
        barrier
        + f"srun ./run_multi_node.sh --slurm -- {shlex.join(SMALL)} --out-dir {tmp_path}/$SLURM_JOB_ID\n"
    )
    jobs = [
        submit(slurm_cluster, tmp_path, script, env={**JOB_ENV, "NPROC_PER_NODE": "1"})
        for _ in range(2)
    ]
    results = [finished(slurm_cluster, job, tmp_path / job) for job in jobs]
    ports = {re.search(r"--rdzv-endpoint=\S+:(\d+) ", r.stdout).group(1) for r in results}
    assert len(ports) == 2, ports
    for r in results:
        check_completed_run(r, 1, "torchrun")


def linger_in_time_wait(port):
    """Leave 127.0.0.1:port in TIME_WAIT (for a minute), as a run leaves its rendezvous port on node 0
    when node 0 closes the connections first."""
    with (
        socket.create_server(("127.0.0.1", port)) as server,
        socket.create_connection(("127.0.0.1", port)) as client,
    ):
        conn, _ = server.accept()
        conn.close()  # the listening side's FIN first: its end goes to TIME_WAIT once the client closes
        assert client.recv(1) == b""


@slurm
def test_a_rerun_at_once_on_the_same_port_is_not_refused_for_its_connections_in_time_wait(
    slurm_cluster, tmp_path
):
    # A stopped or requeued run that comes back at once on the same node with the same port (the same
    # --master-port, or the same job and step ids) finds the port's last connections in TIME_WAIT.
    port, out = free_port(), tmp_path / "out"
    linger_in_time_wait(port)
    assert slurm_cluster.run(
        ["ss", "-Htan", "state", "time-wait", f"( sport = :{port} )"]
    ).stdout.strip()
    script = f"srun ./run_multi_node.sh --slurm --master-port {port} -- {shlex.join(SMALL)} --out-dir {out}\n"
    r = finished(slurm_cluster, submit(slurm_cluster, tmp_path, script), out)
    assert f"--rdzv-endpoint={slurm_cluster.nodes[0]}:{port} " in r.stdout, r.stdout
    check_completed_run(r, 2, "torchrun")


# ---------------------------------------------------------------------------
# run_multi_node.sh's batch script: two nodes, preemption and requeue
# ---------------------------------------------------------------------------


@slurm
@pytest.mark.parametrize("slurm_cluster2", ["pgid"], indirect=True)
def test_signal_before_the_time_limit_reaches_every_worker_through_torchrun_and_the_requeued_job_resumes_bit_identical(
    slurm_cluster2, tmp_path, tmp_path_factory
):
    # The header's script as it stands: --signal=USR1@120, --requeue, its requeue line. The job gets 10
    # minutes; once it trains, its workers are frozen (so that it is still mid-run whenever the signal
    # comes) and the limit drops to 2: the signal is due, and slurmctld's next time-limit pass (every
    # 30 s) sends it. Under proctrack/pgid it goes to the task's process group only: torchrun's workers,
    # in sessions of their own, get it from torchrun or not at all. Frozen, they keep it pending.
    cluster = slurm_cluster2
    # Frozen up to 45 s, a worker must not find its collectives timed out when thawed: --timeout 120.
    job = submit(cluster, tmp_path, sbatch_recipe(tmp_path, *FT4, "--timeout", "120"), "--time=10")
    out = tmp_path / job
    workers = wait_for_training(cluster, job, out, world=4)
    freeze(workers)
    try:
        cluster.update(job, TimeLimit=2)
        uninterrupted(cluster, tmp_path_factory, wait=False)  # meanwhile, on the free CPUs
        wait_until(
            lambda: all(reached(p, signal.SIGUSR1) for p in workers),
            "SIGUSR1 through torchrun",
            45,
            lambda: cluster.output(job),
        )
        # the next allocation has the time to finish, as a real one would
        cluster.update(job, TimeLimit=10)
    finally:
        thaw(workers)
    # The workers save and exit 75, torchrun exits 1; model.pt is missing, so the script requeues the job,
    # and its second run resumes. (--open-mode=append keeps both runs' output.)
    r = finished(cluster, job, out, restarts="1")
    assert_stopped_and_resumed(r, signal.SIGUSR1)
    assert "srun: error: node0: task 0: Exited with exit code 1" in r.stdout, r.stdout
    assert_same_weights(r.weights, uninterrupted(cluster, tmp_path_factory).weights, exact=True)


@slurm
def test_header_batch_script_on_two_nodes_matches_one_process_with_the_same_global_batch(
    slurm_cluster2, tmp_path_factory, reference
):
    # srun starts one run_multi_node.sh --slurm per node, each a torchrun with 2 workers: world 4 x 16,
    # the same as 1 process x 64.
    r = uninterrupted(slurm_cluster2, tmp_path_factory)
    assert "torchrun, world size 4 (2/node)" in r.stdout, r.stdout
    assert [m["world_size"] for m in r.metrics] == [4] and r.metrics[-1][
        "effective_batch_size"
    ] == 64
    # Each node prints the torchrun command it runs; node 0 hosts the rendezvous at its own name.
    commands = re.findall(r"^run_multi_node.sh: .*-m torch.distributed.run (.*)$", r.stdout, re.M)
    assert len(commands) == 2 and all(
        "--nnodes=2 --nproc_per_node=2" in c and "--rdzv-endpoint=node0:" in c for c in commands
    ), r.stdout
    assert_same_run(r.weights, reference(python_cmd(*FT4, "--batch-size", 64)).weights)


@slurm
def test_scontrol_requeue_from_outside_stops_a_user_project_and_it_resumes_bit_identical(
    slurm_cluster, project, tmp_path, reference
):
    # A requeue (by an admin, or to preempt the job) signals every process of its steps with SIGTERM, and
    # SIGKILL KillWait seconds later (here 2: saving takes well under a second); the batch script's last
    # line never runs. SLURM's SIGTERM also reaches run_multi_node.sh's tee, which must outlive torchrun,
    # and the DataLoader workers, which must leave it to their trainer. The job runs the user's script
    # (examples/digits.py, as stopper.py) through run_multi_node.sh --script, with 2 workers per rank.
    hold = tmp_path / "holding"
    recipe = sbatch_recipe(tmp_path, *DIGITS, "--workers", "2").replace(
        "--slurm", f"--slurm --script {project}/stopper.py"
    )
    job = submit(
        slurm_cluster,
        tmp_path,
        recipe,
        "--nodes=1",
        env={**JOB_ENV, "HOLD_AT": "30", "HOLD_FILE": str(hold)},
    )
    wait_until(hold.exists, "run mid-epoch", 90, lambda: slurm_cluster.output(job))
    slurm_cluster.requeue(job)
    r = finished(slurm_cluster, job, tmp_path / job, restarts="1")
    assert "DUE TO JOB REQUEUE" in r.stdout and "DataLoader worker" not in r.stdout, r.stdout
    assert_stopped_and_resumed(r, signal.SIGTERM)
    assert_same_weights(r.weights, reference(digits_cmd(project, "torchrun")).weights, exact=True)


# ---------------------------------------------------------------------------
# Performance machinery (speed itself is measured by bench_ddp_train.py, never asserted here)
# ---------------------------------------------------------------------------


@pytest.mark.fast
def test_dataloader_path_yields_the_same_batches_as_the_in_memory_path():
    # Any Dataset that is not a TensorDataset goes through a DataLoader; same samples, same order.
    class Wrapped(torch.utils.data.Dataset):
        def __init__(self, inner):
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            return self.inner[i]

    train_set, _ = ddp_train.build_datasets(default_args("--num-samples", "100"))
    indices = torch.randperm(100).tolist()
    micro_batches = ddp_train.split(indices, 32)  # balanced: 25 each, never 32 + 32 + 32 + 4
    fast, slow = (ddp_train.SeededSamples(data, seed=0) for data in (train_set, Wrapped(train_set)))
    fast, slow = ([samples.__getitems__((0, b)) for b in micro_batches] for samples in (fast, slow))
    assert [len(b[0]) for b in fast] == [25, 25, 25, 25]
    assert all(torch.equal(a, b) for fa, sl in zip(fast, slow) for a, b in zip(fa, sl)) and len(
        fast
    ) == len(slow)


def test_mfu_is_the_counted_flops_over_the_peak_that_peak_tflops_gives(tmp_path):
    # No table of GPU peaks (a GPU's peak depends on the precision, and FP32 runs mix in TF32): you say it.
    none = run(python_cmd(*SMALL, "--epochs", 1), tmp_path, out="none")
    assert (
        "mfu" not in none.metrics[0]
        and "MFU" not in none.stdout
        and none.metrics[0]["tflops_per_process"] > 0
    )
    r = run(
        python_cmd(*SMALL, "--epochs", 1, "--peak-tflops", 0.002, "--log-seconds", 0.01), tmp_path
    )
    record = r.metrics[0]
    assert (
        record["mfu"] == pytest.approx(record["tflops_per_process"] / 0.002, rel=1e-12)
        and "  MFU " in r.stdout
    )


def test_benchmark_quick_runs_and_prints_its_table(tmp_path):
    with Launch([PY, ROOT / "bench_ddp_train.py", "--quick"], tmp_path, "bench") as launch:
        assert launch.wait(300) == 0, launch.stderr
    out = launch.stdout
    for label in (
        "ddp_train.py, 1 process",
        "ddp_train.py, torchrun 2x1",
        "hand-written loop, 1 process",
        "tutorial DDP, torchrun 2x1",
        "ddp_train.py (your Dataset)",
        "hand-written DataLoader loop",
        "ddp_train.py (tinylm), 2x1",
        "hand-written DDP (tinylm), 2x1",
        "launch->first step",
        "peak RSS/process",
        "ratio (per round)",
    ):
        assert label in out, out
    assert re.search(
        r"ddp_train.py, 1 process / hand-written loop, 1 process\s+[\d.]+x\s+>= 0.95", out
    ), out


# ---------------------------------------------------------------------------
# Your recipe: several optimizers with parameter groups of their own (SGD, AdamW, Muon), --schedule,
# --max-steps with --eval-every and --keep-best
# ---------------------------------------------------------------------------

# recipe_two_optimizers.py: plain.py's deterministic CNN on digits, SGD (Nesterov momentum) over the
# convolutions in two parameter groups of their own lrs, AdamW over the head; clipped (the largest gradient
# norm is about 0.4). A global batch of 64 either way: 23 steps an epoch.
TWO_OPTIMIZERS = ["--epochs", "2", "--clip-grad-norm", "0.25", "--lr", "0.002"]


def test_two_optimizers_with_parameter_groups_of_their_own_keep_two_ranks_with_accumulation_equal_to_one_process(
    project, tmp_path
):
    script = str(project / "recipe_two_optimizers.py")
    two = torchrun_cmd(2, *TWO_OPTIMIZERS, "--batch-size", "16", "--grad-accum", "2", script=script)
    one = run(python_cmd(*TWO_OPTIMIZERS, "--batch-size", "64", script=script), tmp_path, out="one")
    r = run(two, tmp_path, out="two")
    assert_same_weights(r.weights, one.weights)
    # it clipped
    assert r.metrics[0]["grad_norm_max"] > 0.25 and r.metrics[-1]["effective_batch_size"] == 64
    for a, b in zip(r.metrics, one.metrics):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["eval_accuracy"] == pytest.approx(b["eval_accuracy"], rel=1e-6)  # (float32 means)
    # Both optimizers were stepped and saved, each group with its own base rate.
    ckpt = torch.load(r.out_dir / "checkpoint.pt", weights_only=True)
    assert ckpt["config"]["optimizers"] == ["SGD", "AdamW"]
    sgd, adamw = ckpt["optimizers"]
    assert [g["initial_lr"] for g in sgd["param_groups"]] == [0.04, 0.01] and adamw["param_groups"][
        0
    ]["initial_lr"] == 0.002
    assert all("momentum_buffer" in s for s in sgd["state"].values()) and len(adamw["state"]) == 2
    # Negative control: the step's gradient scale applied to the first optimizer's parameters only is caught.
    bug = run(two, tmp_path, out="bug", env=clean_env(SCALE_ONLY_FIRST=1))
    with pytest.raises(AssertionError):
        assert_same_weights(bug.weights, one.weights)


# recipe_muon.py: the default task's MLP, Muon on the hidden layers' weights, AdamW on the rest in two groups.
# 1 x 32: 64 steps an epoch, checkpoints at epoch ends only.
MUON = [
    "--num-samples",
    "2048",
    "--eval-samples",
    "256",
    "--epochs",
    "2",
    "--batch-size",
    "32",
    "--save-every",
    "0",
]


def test_muon_and_adamw_stopped_by_sigterm_mid_epoch_resume_bit_identical(project, tmp_path):
    cmd = python_cmd(*MUON, script=str(project / "recipe_muon.py"))
    whole = run(cmd, tmp_path, out="whole")
    step = 70  # SIGTERM in epoch 2's 6th step: one process stops right after it
    stopped = run(cmd, tmp_path, env=clean_env(STOP_SIGNAL="TERM", STOP_AT=step), expect=75)
    assert f"stopped by a signal at step {step}:" in stopped.stdout, stopped
    ckpt = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    assert ckpt["progress"]["step"] == step and ckpt["config"]["optimizers"] == ["Muon", "AdamW"]
    muon, adamw = ckpt["optimizers"]
    assert len(muon["state"]) == 2 and all("momentum_buffer" in s for s in muon["state"].values())
    assert len(adamw["param_groups"]) == 2 and len(adamw["state"]) == 4
    again = run(cmd, tmp_path)
    assert resumed_at(again.stdout) == (step - 64, step), again
    assert_same_weights(again.weights, whole.weights, exact=True)
    assert [m["eval_loss"] for m in again.metrics] == [m["eval_loss"] for m in whole.metrics]


# The default task (recipe_mlp.py: with stopper.py's tripwire), 20 steps an epoch, 50 steps in all (2.5 epochs),
# an evaluation every 8 steps (step 40 is an epoch's end). At a constant lr of 0.05 the eval loss rises again
# after its low: best.pt is not model.pt.
MAX_STEPS = [
    "--num-samples",
    "640",
    "--eval-samples",
    "64",
    "--batch-size",
    "32",
    "--max-steps",
    "50",
    "--eval-every",
    "8",
    "--keep-best",
    "eval_loss",
    "--lr",
    "0.05",
    "--schedule",
    "constant",
]


def eval_loss_of(weights: Path, argv: list[str]) -> float:
    """The default task's mean cross-entropy over its eval set, of saved weights, computed here."""
    args = default_args(*argv)
    _, eval_set = ddp_train.build_datasets(args)
    model = ddp_train.build_model(args)
    model.load_state_dict(torch.load(weights, weights_only=True))
    x, y = eval_set.tensors
    with torch.no_grad():
        return F.cross_entropy(model(x).double(), y).item()


def test_max_steps_evaluates_at_the_multiples_of_eval_every_across_epoch_ends_and_best_pt_is_the_lowest(
    project, tmp_path, reference
):
    r = reference(python_cmd(*MAX_STEPS, script=str(project / "recipe_mlp.py")))
    # Evaluations at 8, 16, 24, 32, 48; at 40 (an epoch's end) and 50 (the run's) the epoch's record carries it.
    assert [(m["kind"], m["step"], m["epoch"]) for m in r.metrics] == [
        ("eval", 8, 1),
        ("eval", 16, 1),
        ("epoch", 20, 1),
        ("eval", 24, 2),
        ("eval", 32, 2),
        ("epoch", 40, 2),
        ("eval", 48, 3),
        ("epoch", 50, 3),
    ]
    assert all(m["eval_samples"] == 64 and m["eval_loss"] > 0 for m in r.metrics)
    # the last: 10 steps
    assert [m["train_samples"] for m in r.metrics if m["kind"] == "epoch"] == [
        640,
        640,
        320,
    ]
    assert "model.pt: 2 epoch(s), 50 steps" in r.stdout, r
    lowest = min(m["eval_loss"] for m in r.metrics)
    assert eval_loss_of(r.out_dir / "best.pt", MAX_STEPS) == pytest.approx(lowest, rel=1e-6)
    final = eval_loss_of(r.out_dir / "model.pt", MAX_STEPS)
    # not the best
    assert final == pytest.approx(r.metrics[-1]["eval_loss"], rel=1e-6) and final > lowest * 1.01


def test_max_steps_with_keep_best_stopped_twice_around_the_best_resumes_to_bit_identical_model_and_best_pt(
    project, tmp_path, reference
):
    cmd = python_cmd(*MAX_STEPS, script=str(project / "recipe_mlp.py"))
    whole = reference(cmd)
    steps = [m["step"] for m in whole.metrics]
    i = min(range(len(steps)), key=lambda i: whole.metrics[i]["eval_loss"])
    # the best evaluation is neither the first nor the last, with a step free on either side
    best = steps[i]
    assert 0 < i < len(steps) - 1 and steps[i - 1] < best - 1 and steps[i + 1] > best + 1, (
        whole.metrics
    )
    # Stopped one step before the best evaluation, then one step after it: a resumed run writes best.pt, and
    # the next carries the best value on (no later evaluation beats it), across an epoch's end to --max-steps.
    first = run(cmd, tmp_path, env=clean_env(STOP_SIGNAL="TERM", STOP_AT=best - 1), expect=75)
    assert f"stopped by a signal at step {best - 1}:" in first.stdout, first
    # its own 2nd step
    second = run(cmd, tmp_path, env=clean_env(STOP_SIGNAL="TERM", STOP_AT=2), expect=75)
    assert (
        resumed_at(second.stdout)[1] == best - 1
        and f"stopped by a signal at step {best + 1}:" in second.stdout
    )
    final = run(cmd, tmp_path)
    assert resumed_at(final.stdout)[1] == best + 1, final
    for name in ("model.pt", "best.pt"):
        assert_same_weights(
            torch.load(final.out_dir / name, weights_only=True),
            torch.load(whole.out_dir / name, weights_only=True),
            exact=True,
        )
    assert [(m["kind"], m["step"], m["eval_loss"]) for m in final.metrics] == [
        (m["kind"], m["step"], m["eval_loss"]) for m in whole.metrics
    ]


def test_lm_max_steps_on_two_ranks_evaluates_every_n_steps_and_keeps_best_pt_at_the_lowest_token_mean(
    project, tmp_path, tinylm
):
    # tinylm (a token mean over functions of unequal lengths) under torchrun 2: 200 functions at 2 x 8, 13 steps
    # an epoch, 30 steps in all, an evaluation every 5. best.pt is, bit for bit, the model of the step whose
    # evaluation was lowest: the same command stopped there by --max-steps ends with those weights, whichever step
    # it is (no margin that training happens to give). It is also scored here, over the whole eval set as one
    # padded batch (the per-token losses' sum over the real tokens), against that evaluation's figure.
    sizes = {**LM_EXACT, "LM_TRAIN_SIZE": 200, "LM_EVAL_SIZE": 40}
    common = [
        "--batch-size",
        8,
        "--eval-every",
        5,
        "--keep-best",
        "eval_loss",
        "--lr",
        "0.03",
        "--schedule",
        "constant",
    ]
    r = run(
        lm_cmd(project, "torchrun 2", *common, "--max-steps", 30), tmp_path, env=clean_env(**sizes)
    )
    assert [(m["kind"], m["step"]) for m in r.metrics] == [
        ("eval", 5),
        ("eval", 10),
        ("epoch", 13),
        ("eval", 15),
        ("eval", 20),
        ("eval", 25),
        ("epoch", 26),
        ("epoch", 30),
    ]
    lowest = min(r.metrics, key=lambda m: m["eval_loss"])
    there = run(
        lm_cmd(project, "torchrun 2", *common, "--max-steps", lowest["step"]),
        tmp_path,
        out="there",
        env=clean_env(**sizes),
    )
    best = torch.load(r.out_dir / "best.pt", weights_only=True)
    assert_same_weights(best, there.weights, exact=True)
    if lowest["step"] != 30:  # then best.pt is not model.pt
        with pytest.raises(AssertionError):
            assert_same_weights(best, r.weights, exact=True)
    for name, value in sizes.items():
        setattr(tinylm, name[3:], value)
    args = default_args()
    _, eval_set = tinylm.build_datasets(args)
    batch = tinylm.collate_fn([eval_set[i] for i in range(len(eval_set))])

    def token_mean_loss(path):
        model = tinylm.build_model(args)
        model.load_state_dict(torch.load(path, weights_only=True))
        with torch.no_grad():
            logits = model.eval()(batch["inputs"]).double()
        real = batch["targets"] != tinylm.IGNORE
        return (
            F.cross_entropy(
                logits.flatten(0, 1),
                batch["targets"].flatten(),
                ignore_index=tinylm.IGNORE,
                reduction="sum",
            )
            / real.sum()
        ).item()

    assert all(
        m["eval_tokens"] == int((batch["targets"] != tinylm.IGNORE).sum()) for m in r.metrics
    ), r.metrics
    assert token_mean_loss(r.out_dir / "best.pt") == pytest.approx(lowest["eval_loss"], rel=1e-5)
    assert token_mean_loss(r.out_dir / "model.pt") == pytest.approx(
        r.metrics[-1]["eval_loss"], rel=1e-5
    )


def test_a_stop_in_the_runs_last_step_finishes_the_run_with_its_last_record_and_evaluation(
    project, tmp_path, reference
):
    # Its checkpoint would hold step == total before the end-of-run record and evaluation: the run ends them.
    cmd = python_cmd(*MAX_STEPS, script=str(project / "recipe_mlp.py"))
    whole = reference(cmd)
    first = run(cmd, tmp_path, env=clean_env(STOP_SIGNAL="TERM", STOP_AT=50))
    assert "stopped by a signal" not in first.stdout and "saved " in first.stdout, first
    assert [(m["kind"], m["step"], m["eval_loss"]) for m in first.metrics] == [
        (m["kind"], m["step"], m["eval_loss"]) for m in whole.metrics
    ], first
    for name in ("model.pt", "best.pt"):
        assert_same_weights(
            torch.load(first.out_dir / name, weights_only=True),
            torch.load(whole.out_dir / name, weights_only=True),
            exact=True,
        )
    again = run(cmd, tmp_path)
    assert "holds a finished run" in again.stdout and again.metrics == first.metrics, again


# recipe_lr_log.py: the default task, 10 steps an epoch, an AdamW whose step() logs its two groups' lrs
# (the weights at --lr, the biases at a quarter of it).
LR_RUN = [
    "--num-samples",
    "320",
    "--eval-samples",
    "32",
    "--batch-size",
    "32",
    "--lr",
    "0.004",
    "--warmup-steps",
    "5",
]


def schedule_factor(schedule: str, s: int, total: int, warmup: int) -> float:
    """The lr multiplier of step s (0-based: the steps done before it), as --help describes it."""
    if s < warmup:
        return (s + 1) / warmup
    if schedule == "wsd":  # constant, then linear to 0 over the last fifth of the run
        return min(1.0, (total - s) / (0.2 * total))
    done = (s - warmup) / (total - warmup)
    return {"cosine": 0.5 * (1 + math.cos(math.pi * done)), "linear": 1 - done, "constant": 1.0}[
        schedule
    ]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_every_step_gives_each_parameter_group_its_own_lr_times_the_schedule_and_a_longer_run_follows_the_new_total(
    project, tmp_path, schedule
):
    script, logged = str(project / "recipe_lr_log.py"), []
    for total in (
        12,
        30,
    ):  # 12 steps; then the same run made longer, resumed mid-epoch 2: 30 steps in all
        log = tmp_path / f"lr{total}"
        r = run(
            python_cmd(*LR_RUN, "--schedule", schedule, "--max-steps", str(total), script=script),
            tmp_path,
            env=clean_env(LR_LOG=log),
        )
        logged += [json.loads(line) for line in log.read_text().splitlines()]
    assert (
        resumed_at(r.stdout) == (2, 12) and "the learning-rate schedule spans 30 steps" in r.stdout
    ), r
    expected = [
        [0.004 * f, 0.001 * f]
        for f in [schedule_factor(schedule, s, 12, 5) for s in range(12)]
        + [schedule_factor(schedule, s, 30, 5) for s in range(12, 30)]
    ]
    assert len(logged) == 30
    for s, (got, want) in enumerate(zip(logged, expected)):
        assert got == pytest.approx(want, rel=1e-12, abs=0), f"step {s}: {got} != {want}"


@pytest.mark.parametrize(
    "odd, launch", [("none", ["--spawn", "2"]), ("twice", [])], ids=["none-spawn2", "twice"]
)
def test_a_build_optimizer_that_leaves_out_or_repeats_parameters_is_one_line_naming_them(
    project, tmp_path, odd, launch
):
    r = run(
        python_cmd("--epochs", "1", *launch, script=str(project / "recipe_odd_optimizer.py")),
        tmp_path,
        env=clean_env(ODD=odd),
        expect=2,
    )
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r
    assert lines[0] == (
        "ddp_train.py: error: build_optimizer must give every trainable parameter to exactly one "
        "optimizer; 2 are in none or in several: 8.weight, 8.bias"
    ), r
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


@pytest.mark.parametrize("keep_best", ["eval_nosuch", "eval_loss:lowest"])
def test_keep_best_of_a_figure_the_evaluation_lacks_is_one_line_listing_the_figures(
    tmp_path, keep_best
):
    r = run(python_cmd(*SMALL, "--keep-best", keep_best), tmp_path, expect=2)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r
    assert lines[0].startswith(
        f"ddp_train.py: error: --keep-best {keep_best}: name one of the evaluation's figures "
        "(eval_loss, eval_accuracy, eval_samples)"
    ), r
    assert (
        not (tmp_path / "out" / "best.pt").exists()
        and not (tmp_path / "out" / "checkpoint.pt").exists()
    )


# ---------------------------------------------------------------------------
# A reference you can read: the lesson first, its DDP lines tagged, the README pointing at them
# ---------------------------------------------------------------------------


# ddp_train.py's budget in code tokens (bench_ddp_train.py --size: Python's tokenizer, without comments, strings,
# newlines, indentation and f-string parts), and its lesson's: what a reader has to read as code.
TOKEN_BUDGET, LESSON_BUDGET, LESSON_NAMES = 11_700, 3_000, 24  # (the aim: 7,000 in all)


@pytest.mark.fast
def test_the_lesson_reads_like_the_tutorial_within_its_token_budget_and_every_file_is_ruff_formatted():
    import bench_ddp_train

    size = bench_ddp_train.code_tokens()
    assert size["total"] <= TOKEN_BUDGET and size["lesson"] <= LESSON_BUDGET, size
    # of the machinery's: the rest is torch's, or yours
    assert len(size["names"]) <= LESSON_NAMES, size["names"]
    source = (ROOT / "ddp_train.py").read_text()
    lesson = source[: source.index("THE LESSON ENDS HERE")]
    for call in (
        "init_process_group(",
        "DistributedSampler(",
        "DataLoader(",
        ".set_epoch(",
        "DDP(",
        ".no_sync()",
        ".backward()",
        "dist.all_reduce(",
        "rank == 0",
        "destroy_process_group()",
    ):
        assert call in lesson, f"{call} is not in the lesson"
    for node in ast.walk(ast.parse(source)):  # (parse_args: a flat list of flags)
        if isinstance(node, ast.FunctionDef) and node.name != "parse_args":
            assert node.end_lineno - node.lineno < 100, (
                f"{node.name} is {node.end_lineno - node.lineno + 1} lines"
            )
    ruff = subprocess.run(
        [PY, "-m", "ruff", "format", "--check", "--line-length", "100", *PYTHON_FILES],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if "No module named ruff" in ruff.stderr:
        pytest.skip("ruff is not installed here (make setup installs it)")
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr


PYTHON_FILES = [
    "ddp_train.py",
    "test_ddp_train.py",
    "conftest.py",
    "bench_ddp_train.py",
    "examples/digits.py",
    "examples/tinylm.py",
]


@pytest.mark.fast
def test_the_readme_ddp_diff_points_at_tagged_lines():
    lines = (ROOT / "ddp_train.py").read_text().splitlines()
    readme = (ROOT / "README.md").read_text()
    diff = readme[
        readme.index("## The DDP diff") : readme.index("\n## ", readme.index("## The DDP diff") + 1)
    ]
    refs = [int(n) for n in re.findall(r"ddp_train\.py:(\d+)", diff)]
    assert len(refs) >= 15, diff
    for n in refs:
        assert re.search(r"\b(DDP|Trap):", lines[n - 1]), (
            f"ddp_train.py:{n} is not a tagged line: {lines[n - 1]!r}"
        )


@pytest.mark.fast
def test_make_help_lists_every_target_once():
    r = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    names = re.findall(r"^  make (\S+)", r.stdout, re.M)
    assert r.returncode == 0 and len(names) == len(set(names)), r.stdout
    for target in (
        "train",
        "train-cpu",
        "train-Ngpu",
        "train-multinode",
        "test",
        "test-fast",
        "bench",
    ):
        assert target in names, r.stdout


# ---------------------------------------------------------------------------
# GPU: skipped cleanly where there is no CUDA
# ---------------------------------------------------------------------------


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_local_rank_beyond_visible_gpus_is_one_clear_line(tmp_path):
    env = clean_env(
        RANK=0,
        WORLD_SIZE=1,
        LOCAL_RANK=torch.cuda.device_count(),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=free_port(),
    )
    r = run(python_cmd(*SMALL), tmp_path, env=env, expect=2)
    assert "CUDA_VISIBLE_DEVICES" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_two_processes_on_one_visible_gpu_stop_with_one_line(tmp_path):
    r = run(torchrun_cmd(2, *SMALL), tmp_path, env=clean_env(CUDA_VISIBLE_DEVICES=0), expect=1)
    errors = [line for line in r.stderr.splitlines() if line.startswith("ddp_train.py: error:")]
    assert len(errors) == 1 and "LOCAL_WORLD_SIZE=2 sees 1 (CUDA_VISIBLE_DEVICES=0)" in errors[0], r


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("compiled", [[], ["--compile"]], ids=["eager", "compile"])
def test_sync_bn_with_an_uneven_last_step_neither_hangs_nor_crashes(tmp_path, compiled):
    # 129 samples on 2 GPUs at 64: floor(129 / 2) = 64 is a multiple of the batch, so rank 1 would have
    # no sample in the last step while rank 0 runs SyncBatchNorm's collectives: --sync-bn drops that step.
    r = run(
        torchrun_cmd(
            2,
            "--num-samples",
            129,
            "--eval-samples",
            64,
            "--epochs",
            2,
            "--batch-norm",
            "--sync-bn",
            *compiled,
        ),
        tmp_path,
        timeout=300,
    )
    assert "--sync-bn: every step is a full global batch" in r.stdout, r
    assert [m["train_samples"] for m in r.metrics] == [128, 128]


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_rank_whose_first_compiled_step_is_minutes_late_survives_the_default_timeout(
    project, tmp_path
):
    # Rank 1 starts its first step 11 minutes after rank 0: a cold compile on a slow node. NCCL's own
    # default (600 s) would kill the job; --timeout's default waits. (Long: run by make test-gpu.)
    r = run(
        torchrun_cmd(2, "--epochs", 1, "--compile", script=str(project / "stopper.py")),
        tmp_path,
        env=clean_env(LATE_RANK=1, LATE_SECONDS=660),
        timeout=900,
    )
    assert r.metrics[0]["world_size"] == 2


@pytest.mark.fast
def test_the_default_timeout_outlasts_a_cold_compile_and_nccls_own_default():
    assert ddp_train.parse_args([]).timeout >= 1800  # NCCL's default is 600 s
    assert (
        "cold compile"
        in subprocess.run([PY, SCRIPT, "--help"], capture_output=True, text=True, timeout=60).stdout
    )


def test_make_test_gpu_without_cuda_says_so_in_one_line_and_exits_0():
    if HAS_CUDA:
        pytest.skip("CUDA is present: make test-gpu runs for real")
    r = subprocess.run(
        ["make", "-s", "test-gpu"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert (
        r.returncode == 0
        and r.stdout.strip().splitlines()[-1]
        == "make test-gpu: no CUDA device here; nothing to run"
    )


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("extra", [["--amp", "bf16"], ["--compile"], ["--amp", "fp16"]])
def test_gpu_single_process_precisions_and_compile(tmp_path, extra):
    r = run(python_cmd(*SMALL, "--epochs", "3", *extra), tmp_path)
    assert "cuda:0" in r.stdout and r.metrics[-1]["eval_accuracy"] > 0.5
    assert r.metrics[-1]["peak_gpu_mem_mb"] > 0
    ddp_train.build_model(default_args()).load_state_dict(r.weights)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("launch", ["python", "torchrun"])
def test_a_gpu_training_step_never_waits_for_the_gpu(project, tmp_path, launch):
    # CUDA's sync debug mode raises at any host-device synchronisation inside a step: the count made on
    # the device, its all-reduce waited for by the stream, the scale, norm and clipping all stay there.
    if launch == "torchrun" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cmd = (python_cmd if launch == "python" else lambda *a, **k: torchrun_cmd(2, *a, **k))(
        *SMALL, "--epochs", 1, "--clip-grad-norm", 1.0, script=str(project / "nosync.py")
    )
    r = run(cmd, tmp_path)
    assert r.metrics[0]["train_samples"] == 1000, r


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_cnn_gets_mfu_only_from_the_peak_it_is_given(project, tmp_path):
    # cuDNN runs the convolutions in TF32 and the matmuls stay FP32 (torch's defaults): no one peak.
    off = run(digits_cmd(project, "python", "--epochs", 1), tmp_path, out="off")
    assert "mfu" not in off.metrics[0] and "MFU" not in off.stdout, off
    given = run(
        digits_cmd(project, "python", "--epochs", 1, "--peak-tflops", 100), tmp_path, out="given"
    )
    assert 0 < given.metrics[0]["mfu"] < 1, given


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_token_count_scales_the_gradients_on_the_gpu_in_their_dtype_without_a_sync(monkeypatch):
    # StepCount on CUDA: the count, its expectation and the scale stay on the GPU, the scale in the gradients'
    # dtype (_foreach_mul_'s fast path), all under CUDA's sync debug mode "error".
    monkeypatch.setattr(ddp_train, "COUNT_UNIT", "tokens")
    p = torch.nn.Parameter(torch.ones(3, device="cuda"))
    p.grad = torch.full((3,), 6.0, device="cuda")
    t = types.SimpleNamespace(
        ctx=ddp_train.Context(device=torch.device("cuda", 0)),
        params=[p],
        progress=ddp_train.Progress(expected=64.0),
    )
    count = ddp_train.StepCount(t)
    torch.cuda.set_sync_debug_mode("error")
    try:
        count.start(samples=2)
        count.add(torch.tensor(32, device="cuda"), last=True)
        count.finish()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert count.expected.device.type == "cuda" and torch.equal(p.grad, torch.full_like(p, 12))


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus_match_single_gpu_global_batch(tmp_path):
    two = run(torchrun_cmd(2, *SMALL), tmp_path, out="two")
    assert "nccl" in two.stdout
    one = run(python_cmd(*SMALL, "--batch-size", 64), tmp_path, out="one")
    for k, v in two.weights.items():
        assert torch.allclose(v, one.weights[k], rtol=1e-3, atol=1e-4)  # TF32 and reduction order


# ---------------------------------------------------------------------------
# Your recipe: --ema, --tensorboard and report(), read back from what real runs leave: model_ema.pt,
# TensorBoard's event files (with TensorBoard's own reader) and the records a report() of yours receives
# ---------------------------------------------------------------------------

import shutil  # noqa: E402 (this section's own)

from conftest import shared  # noqa: E402

# Scripts of a user's, written into a test's tmp_path; ddp_train comes from PYTHONPATH=ROOT.
RECIPE_SCRIPTS = {
    # report() of a user's: every record it gets, as a JSON line (with the process id), into REPORT_TO.RANK. On the
    # default task, or on the project REPORT_PROJECT names (lm: tinylm; with the project on PYTHONPATH).
    "reporter.py": """
import importlib
import json
import os
import sys
import ddp_train

if os.environ.get("REPORT_PROJECT"):
    importlib.import_module(os.environ["REPORT_PROJECT"])


def report(record):
    with open(f"{os.environ['REPORT_TO']}.{os.environ.get('RANK', '0')}", "a") as f:
        f.write(json.dumps({**record, "pid": os.getpid()}) + "\\n")


ddp_train.report = report
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # A machine without TensorBoard: every import of tensorboard fails as a missing package does.
    "no_tensorboard.py": """
import importlib.abc
import sys


class NoTensorBoard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTensorBoard())
import ddp_train  # noqa: E402

if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
}


def recipe_script(directory: Path, name: str) -> Path:
    path = directory / name
    path.write_text(RECIPE_SCRIPTS[name].lstrip())
    return path


def f32(x: float) -> float:
    """x as TensorBoard stores a scalar: a float32."""
    return torch.tensor(x, dtype=torch.float64).float().item()


def tensorboard_scalars(out_dir: Path, purge: bool = True) -> dict[str, list[tuple[int, float]]]:
    """OUT_DIR/tensorboard as TensorBoard's own reader loads it: {tag: [(step, value), ...]} in the order
    read. purge (TensorBoard's default): what it shows, a restart's SessionLog START dropping the events at
    and after its step; without: every event the files hold."""
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="TensorBoard's reader: make setup installs the pinned tensorboard",
    )
    acc = accumulator.EventAccumulator(
        str(out_dir / "tensorboard"),
        size_guidance={accumulator.SCALARS: 0},
        purge_orphaned_data=purge,
    ).Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def records_as_scalars(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The curves that records make: each number but the step (the axis) and the epoch as KIND/NAME at the
    record's step, as float32."""
    curves = {}
    for record in records:
        for name, value in record.items():
            if isinstance(value, (int, float)) and name not in ("step", "epoch"):
                curves.setdefault(f"{record['kind']}/{name}", []).append(
                    (record["step"], f32(value))
                )
    return curves


def flat(weights: dict) -> torch.Tensor:
    return torch.cat([t.detach().double().flatten() for t in weights.values()])


# ------ --ema: the average of the weights, evaluated, saved, and resumed -------------------------------

# A short run from --init-from weights: the default task 20 steps (evaluated every 5), tinylm 12 steps over
# 2 epochs of 48 functions (every 4). A constant learning rate, so that a run one step longer is the same run
# plus one step.
EMA_RUNS = {
    "default-task": (
        [
            "--num-samples",
            1000,
            "--eval-samples",
            301,
            "--batch-size",
            32,
            "--schedule",
            "constant",
            "--max-steps",
            20,
            "--eval-every",
            5,
        ],
        20,
        [5, 10, 15],
        [20],
    ),
    "tinylm": (
        ["--batch-size", 8, "--schedule", "constant", "--max-steps", 12, "--eval-every", 4],
        12,
        [4, 8],
        [6, 12],
    ),
}
EMA_LR = 1e-3  # both tasks' default --lr


@pytest.fixture(scope="session")
def ema_inits(tmp_path_factory) -> dict[str, Path]:
    """{task: a model.pt of initial weights}, other than any --seed's own, for --init-from."""
    with shared(tmp_path_factory, "ema-inits") as d:
        if not (d / "tinylm.pt").exists():
            torch.manual_seed(1234)
            torch.save(ddp_train.build_model(default_args()).state_dict(), d / "default-task.pt")
            task = {
                name: getattr(ddp_train, name)
                for name in (
                    "build_datasets",
                    "build_model",
                    "collate_fn",
                    "compute_loss",
                    "COUNT_UNIT",
                )
            }
            with pytest.MonkeyPatch.context() as mp:
                mp.syspath_prepend(str(ROOT / "examples"))
                import tinylm
            for name, value in task.items():  # importing tinylm plugs it into ddp_train: undone
                setattr(ddp_train, name, value)
            torch.save(tinylm.build_model(default_args()).state_dict(), d / "tinylm.pt")
    return {task: d / f"{task}.pt" for task in EMA_RUNS}


def ema_cmd(task: str, project: Path, init: Path, *args, script=SCRIPT):
    if task == "tinylm":
        return lm_cmd(project, "python", *EMA_RUNS[task][0], "--init-from", init, *args)
    return python_cmd(*EMA_RUNS[task][0], "--init-from", init, *args, script=script)


def ema_env(task: str) -> dict:
    return dict(LM_EXACT) if task == "tinylm" else {}


def task_eval_loss_of(task: str, weights: dict, request) -> float:
    """The eval set's mean loss under these weights, computed here, in one batch."""
    if task == "tinylm":
        tinylm = request.getfixturevalue("tinylm")
        tinylm.TRAIN_SIZE, tinylm.EVAL_SIZE = LM_EXACT["LM_TRAIN_SIZE"], LM_EXACT["LM_EVAL_SIZE"]
        _, eval_set = tinylm.build_datasets(default_args())
        batch, model, loss = (
            tinylm.collate_fn(list(eval_set)),
            tinylm.build_model(default_args()),
            tinylm.compute_loss,
        )
    else:
        _, eval_set = ddp_train.build_datasets(
            default_args("--num-samples", "1000", "--eval-samples", "301")
        )
        batch, model, loss = (
            eval_set.tensors,
            ddp_train.build_model(default_args()),
            ddp_train.compute_loss,
        )
    model.load_state_dict(weights)
    with torch.no_grad():
        mean, count, _ = loss(model.eval(), batch)
    return float(mean)


@pytest.mark.parametrize("task", list(EMA_RUNS))
def test_ema_0_9999_stays_within_one_step_of_the_init_from_weights_and_ema_0_5_follows_them_update_by_update(
    project, tmp_path, reference, ema_inits, request, task
):
    _, steps, eval_steps, epoch_steps = EMA_RUNS[task]
    init, env = torch.load(ema_inits[task], weights_only=True), ema_env(task)
    slow = reference(ema_cmd(task, project, ema_inits[task], "--ema", "0.9999"), **env)
    # --ema 0.5 one step longer, with a checkpoint at step `steps`: checkpoint.prev.pt, the step before the last.
    fast = run(
        ema_cmd(
            task,
            project,
            ema_inits[task],
            "--ema",
            "0.5",
            "--max-steps",
            steps + 1,
            "--save-every",
            steps,
        ),
        tmp_path,
        env=clean_env(**env),
    )
    before = torch.load(fast.out_dir / "checkpoint.prev.pt", weights_only=True)
    # one update a step
    assert before["progress"]["step"] == steps and int(before["ema"]["n_averaged"]) == steps
    ema_before = {
        k.removeprefix("module."): v for k, v in before["ema"].items() if k.startswith("module.")
    }
    slow_ema, fast_ema = (
        torch.load(r.out_dir / "model_ema.pt", weights_only=True) for r in (slow, fast)
    )
    # plain names: build_model() loads model_ema.pt as it is
    assert slow_ema.keys() == slow.weights.keys()
    # the average never feeds back into training
    assert_same_weights(before["model"], slow.weights, exact=True)
    # 0.9999: the average starts at the weights after step 1 (torch's AveragedModel copies its first
    # update), one AdamW step from the start, at most lr an element (plus a weight decay of lr x 0.01 x w);
    # the later steps weigh 1 - 0.9999^steps < 0.2% together. The weights themselves travel far further.
    moved, kept = flat(slow.weights) - flat(init), flat(slow_ema) - flat(init)
    assert moved.abs().max() > 10 * EMA_LR, moved.abs().max()
    assert kept.abs().max() <= 1.05 * EMA_LR, (
        f"model_ema.pt is {kept.abs().max():.3g} from the start (lr {EMA_LR})"
    )
    assert kept.norm() < 0.25 * moved.norm(), (kept.norm(), moved.norm())
    # 0.5: the average trails the weights by about one step, where 0.9999's is the whole way behind.
    lag, behind = flat(ema_before) - flat(before["model"]), flat(slow_ema) - flat(slow.weights)
    assert lag.abs().max() <= 2 * EMA_LR and lag.norm() < 0.1 * behind.norm(), (
        lag.norm(),
        behind.norm(),
    )
    # The last update: ema <- 0.5 ema + 0.5 weights, the weights after that step's optimizer step (model.pt).
    for k, weights in fast.weights.items():
        assert (fast_ema[k] - (0.5 * ema_before[k] + 0.5 * weights)).abs().max() <= 1e-6, k
    assert (flat(fast_ema) - flat(ema_before)).abs().max() > 1e-4  # and that update did move it
    # Every evaluation also evaluates the average, as eval_ema_*: the final figures are those of the files.
    assert [m["step"] for m in slow.metrics if m["kind"] == "eval"] == eval_steps, slow.metrics
    assert [m["step"] for m in slow.metrics if m["kind"] == "epoch"] == epoch_steps, slow.metrics
    for r, ema in (slow, slow_ema), (fast, fast_ema):
        for m in r.metrics:
            assert {
                "eval_loss",
                "eval_accuracy",
                "eval_ema_loss",
                "eval_ema_accuracy",
            } <= m.keys(), m
        assert r.metrics[-1]["eval_loss"] == pytest.approx(
            task_eval_loss_of(task, r.weights, request), rel=1e-5
        )
        assert r.metrics[-1]["eval_ema_loss"] == pytest.approx(
            task_eval_loss_of(task, ema, request), rel=1e-5
        )
    assert slow.metrics[-1]["eval_ema_loss"] != pytest.approx(
        slow.metrics[-1]["eval_loss"], rel=1e-3
    )


# Where each task's run is stopped: the default task mid-epoch 1 (step 7 of 32), tinylm in epoch 2 (step 2 of 6).
EMA_STOPS = {"default-task": (7, (7, 7)), "tinylm": (8, (2, 8))}


@pytest.mark.parametrize("task", list(EMA_RUNS))
def test_ema_stopped_by_sigterm_resumes_bit_identical_average_and_eval_ema_figures(
    project, tmp_path, reference, ema_inits, task
):
    env = ema_env(task)
    expected = reference(ema_cmd(task, project, ema_inits[task], "--ema", "0.9999"), **env)
    script = str(project / "recipe_mlp.py")  # stopper.py's tripwire (tinylm: lm.py has it too)
    cmd = ema_cmd(task, project, ema_inits[task], "--ema", "0.9999", script=script)
    stop_at, resumed = EMA_STOPS[task]
    stopped = run(
        cmd,
        tmp_path,
        env=clean_env(**env, PYTHONPATH=ROOT, STOP_SIGNAL="TERM", STOP_AT=stop_at),
        expect=75,
    )
    assert f"stopped by a signal at step {stop_at}:" in stopped.stdout, stopped
    assert not (stopped.out_dir / "model_ema.pt").exists()
    # The checkpoint carries the average and its count of updates, one a step.
    saved = torch.load(stopped.out_dir / "checkpoint.pt", weights_only=True)["ema"]
    assert int(saved["n_averaged"]) == stop_at
    again = run(cmd, tmp_path, env=clean_env(**env, PYTHONPATH=ROOT))
    assert resumed_at(again.stdout) == resumed, again
    assert_same_weights(again.weights, expected.weights, exact=True)
    assert_same_weights(
        torch.load(again.out_dir / "model_ema.pt", weights_only=True),
        torch.load(expected.out_dir / "model_ema.pt", weights_only=True),
        exact=True,
    )
    assert [(m["kind"], m["step"]) for m in again.metrics] == [
        (m["kind"], m["step"]) for m in expected.metrics
    ]
    for a, b in zip(again.metrics, expected.metrics):
        assert (a["eval_loss"], a["eval_ema_loss"]) == (b["eval_loss"], b["eval_ema_loss"]), (a, b)


def test_an_epoch_resumed_mid_way_records_the_largest_gradient_norm_of_all_its_steps(
    project, tmp_path, reference, ema_inits
):
    # tinylm's gradient norm is largest in its first steps: stopped at step 3 of 6, the resumed epoch 1 has
    # trained steps 4 to 6 only since the resume.
    env = ema_env("tinylm")
    expected = reference(ema_cmd("tinylm", project, ema_inits["tinylm"], "--ema", "0.9999"), **env)
    cmd = ema_cmd("tinylm", project, ema_inits["tinylm"], "--ema", "0.9999")
    run(cmd, tmp_path, env=clean_env(**env, STOP_SIGNAL="TERM", STOP_AT=3), expect=75)
    again = run(cmd, tmp_path, env=clean_env(**env))
    assert resumed_at(again.stdout) == (3, 3), again
    assert_same_weights(again.weights, expected.weights, exact=True)
    epochs = [(a, b) for a, b in zip(again.metrics, expected.metrics) if a["kind"] == "epoch"]
    assert [(a["step"], a["train_loss"]) for a, _ in epochs] == [
        (b["step"], b["train_loss"]) for _, b in epochs
    ]
    # measured: 2.17 != 8.81
    assert [a["grad_norm_max"] for a, _ in epochs] == [b["grad_norm_max"] for _, b in epochs]


# ------ --tensorboard: every record as KIND/NAME at its step, each step once after a resume -------------

# 2 epochs of 32 steps, a progress record at every step (--log-seconds of a nanosecond), an evaluation every
# 10 steps (10, 20, 30, 40, 50, 60), a checkpoint every 10.
TB = [
    "--num-samples",
    1000,
    "--eval-samples",
    301,
    "--epochs",
    2,
    "--batch-size",
    32,
    "--eval-every",
    10,
    "--log-seconds",
    1e-9,
    "--save-every",
    10,
    "--tensorboard",
]
TB_STEPS = list(range(1, 65))
# The curves that are the same in every run of TB (not those of the clock: rates, times, memory).
TB_EXACT = [
    "progress/train_loss",
    "progress/lr",
    "progress/grad_norm",
    "epoch/train_loss",
    "epoch/eval_loss",
    "epoch/eval_accuracy",
    "epoch/lr",
    "epoch/train_samples",
    "eval/eval_loss",
    "eval/eval_accuracy",
]


def test_tensorboard_holds_every_record_as_kind_slash_name_at_its_step(tmp_path, reference):
    r = reference(python_cmd(*TB))
    scalars = tensorboard_scalars(r.out_dir)
    # Epochs and evaluations: metrics.jsonl's numbers, the same (as float32) at the same steps, and no others.
    logged = records_as_scalars(r.metrics)
    assert {t: v for t, v in scalars.items() if not t.startswith("progress/")} == logged
    assert [s for s, _ in scalars["epoch/train_loss"]] == [32, 64]
    assert [s for s, _ in scalars["eval/eval_loss"]] == [10, 20, 30, 40, 50, 60]
    assert {"epoch/eval_loss", "epoch/grad_norm_max", "eval/eval_accuracy"} <= scalars.keys()
    # Progress records, one a step: at the step just trained, its learning rate (the cosine over 64 steps
    # at the step's start), its loss and gradient norm, which add up to the epochs' figures.
    progress = {t.split("/", 1)[1]: v for t, v in scalars.items() if t.startswith("progress/")}
    for name in ("train_loss", "lr", "grad_norm", "samples_per_sec", "elapsed_s", "eta_s"):
        assert [s for s, _ in progress[name]] == TB_STEPS, name
    factor = [0.5 * (1 + math.cos(math.pi * (s - 1) / 64)) for s in TB_STEPS]
    assert [v for _, v in progress["lr"]] == pytest.approx([1e-3 * f for f in factor], rel=1e-6)
    assert all(v > 0 for _, v in progress["samples_per_sec"])
    # each epoch's last step: 8 samples
    sizes = [min(32, 1000 - 32 * ((s - 1) % 32)) for s in TB_STEPS]
    for epoch, m in enumerate(m for m in r.metrics if m["kind"] == "epoch"):
        mine = slice(32 * epoch, 32 * (epoch + 1))
        assert max(v for _, v in progress["grad_norm"][mine]) == f32(m["grad_norm_max"])
        losses = [v * n for (_, v), n in zip(progress["train_loss"][mine], sizes[mine])]
        assert sum(losses) / sum(sizes[mine]) == pytest.approx(m["train_loss"], rel=1e-6)


def test_tensorboard_after_a_sigterm_a_hard_kill_and_reruns_shows_each_step_once_with_the_uninterrupted_values(
    project, tmp_path, reference
):
    expected = tensorboard_scalars(reference(python_cmd(*TB)).out_dir)
    # the default task, stopper.py's tripwire
    cmd = python_cmd(*TB, script=str(project / "recipe_mlp.py"))
    # Stopped by SIGTERM at step 20 (its checkpoint); resumed, and killed at step 27, 6 progress records after
    # the last checkpoint (step 20 still: --save-every 10); resumed again, to the end.
    stopped = run(
        cmd,
        tmp_path,
        out="out",
        name="stopped",
        env=clean_env(PYTHONPATH=ROOT, STOP_SIGNAL="TERM", STOP_AT=20),
        expect=75,
    )
    assert "stopped by a signal at step 20:" in stopped.stdout, stopped
    killed = run(
        cmd,
        tmp_path,
        out="out",
        name="killed",
        env=clean_env(PYTHONPATH=ROOT, STOP_SIGNAL="KILL", STOP_AT=7),
        expect=-signal.SIGKILL,
    )
    assert resumed_at(killed.stdout) == (20, 20) and "step 26/64" in killed.stdout, killed
    again = run(cmd, tmp_path, env=clean_env(PYTHONPATH=ROOT))
    assert resumed_at(again.stdout) == (20, 20), again
    # On disk, the last run wrote again the steps that the killed one had logged after the checkpoint.
    written = [s for s, _ in tensorboard_scalars(again.out_dir, purge=False)["progress/train_loss"]]
    assert sorted(s for s in set(written) if written.count(s) > 1) == list(range(21, 27)), written
    # TensorBoard shows each step once, the last run's: those of the run that was never stopped.
    shown = tensorboard_scalars(again.out_dir)
    assert shown.keys() == expected.keys()
    for tag, values in shown.items():
        assert [s for s, _ in values] == [s for s, _ in expected[tag]], tag
    for tag in TB_EXACT:
        assert shown[tag] == expected[tag], tag
    assert [s for s, _ in shown["progress/train_loss"]] == TB_STEPS


def test_tensorboard_of_a_run_started_over_with_resume_never_shows_the_new_run_alone(
    tmp_path, reference
):
    # The old run's event files stay in OUT_DIR/tensorboard; the new run (another seed) starts at step 1.
    shutil.copytree(reference(python_cmd(*TB)).out_dir, tmp_path / "out")
    new = run(python_cmd(*TB, "--seed", 1, "--resume", "never"), tmp_path)
    assert "resumed" not in new.stdout
    written = tensorboard_scalars(new.out_dir, purge=False)
    # both runs' events are on disk
    assert [s for s, _ in written["epoch/eval_loss"]] == [
        32,
        64,
        32,
        64,
    ]
    shown = tensorboard_scalars(new.out_dir)
    assert {t: v for t, v in shown.items() if not t.startswith("progress/")} == records_as_scalars(
        new.metrics
    )
    for tag, values in shown.items():
        if tag.startswith("progress/"):
            assert [s for s, _ in values] == TB_STEPS, tag
    # the old run's values are gone
    assert shown["epoch/eval_loss"] != written["epoch/eval_loss"][:2]


def test_tensorboard_without_the_package_is_one_line_saying_how_to_install_it_and_all_else_needs_only_torch(
    tmp_path,
):
    # An import finder refuses tensorboard in the training process, as on a machine without it.
    cmd, env = (
        python_cmd(*SMALL, script=recipe_script(tmp_path, "no_tensorboard.py")),
        clean_env(PYTHONPATH=ROOT),
    )
    r = run([*cmd, "--tensorboard"], tmp_path, env=env, expect=2)
    assert r.stderr.strip().splitlines() == [
        "ddp_train.py: error: --tensorboard needs TensorBoard: pip install tensorboard"
    ], r
    assert "Traceback" not in r.stderr and not (r.out_dir / "checkpoint.pt").exists()
    # The same run without --tensorboard trains, evaluates, averages and saves: nothing else imports it.
    r = run([*cmd, "--max-steps", 3, "--ema", "0.9"], tmp_path, out="plain", env=env)
    assert (r.out_dir / "model_ema.pt").exists() and not (r.out_dir / "tensorboard").exists(), r


# ------ report(): rank 0 hands it every record, once ----------------------------------------------------

REPORT = [
    "--num-samples",
    1000,
    "--eval-samples",
    301,
    "--epochs",
    2,
    "--batch-size",
    16,
    "--eval-every",
    10,
    "--log-seconds",
    0.01,
]


def test_report_of_a_users_script_gets_every_record_once_on_rank_0_alone(tmp_path):
    # torchrun 2 x 16: 32 steps an epoch; a progress record at each of the ranks' votes (10 steps apart at most).
    script = recipe_script(tmp_path, "reporter.py")
    r = run(
        torchrun_cmd(2, *REPORT, script=script),
        tmp_path,
        env=clean_env(PYTHONPATH=ROOT, REPORT_TO=tmp_path / "report"),
    )
    # rank 1 never called it
    assert sorted(p.name for p in tmp_path.glob("report.*")) == ["report.0"]
    records = [json.loads(line) for line in (tmp_path / "report.0").read_text().splitlines()]
    assert len({record.pop("pid") for record in records}) == 1
    assert all(
        record["kind"] in ("progress", "epoch", "eval") and isinstance(record["step"], int)
        for record in records
    ), records
    steps = [record["step"] for record in records]
    assert steps == sorted(steps) and steps[-1] == 64
    # Every line of metrics.jsonl, each once, in order: the epochs' and the evaluations' records.
    assert [record for record in records if record["kind"] != "progress"] == r.metrics
    assert (
        sum(m["kind"] == "eval" for m in r.metrics) == 6
        and sum(m["kind"] == "epoch" for m in r.metrics) == 2
    )
    # And the progress lines the console shows, one record each, with their figures.
    progress = [record for record in records if record["kind"] == "progress"]
    shown = [int(line[2].replace(",", "")) for line in PROGRESS.findall(r.stdout)]
    assert len(progress) >= 4 and [record["step"] for record in progress] == shown, (
        progress,
        r.stdout,
    )
    for record in progress:
        assert {
            "epoch",
            "train_loss",
            "lr",
            "grad_norm",
            "samples_per_sec",
            "elapsed_s",
            "eta_s",
        } <= record.keys()
        # one share a rank
        assert len(record["data_wait_by_rank"]) == len(record["compute_by_rank"]) == 2, record
        assert all(
            0 <= share <= 1 for share in record["data_wait_by_rank"] + record["compute_by_rank"]
        ), record


def samples_since_the_last_line(progress, n, global_batch, steps_per_epoch):
    """(record, its first step, the samples of its steps) for each progress record: the steps after the
    last line, and in this epoch. Independently of the script: DistributedSampler deals out each
    epoch's shuffle (seeded by --seed 0 + epoch) round-robin, and step s of the epoch trains its
    [s, s + 1) x global batch stretch, so steps first..step of one epoch train one stretch of it."""
    last = 0
    for record in progress:
        step = record["step"]
        epoch, first = divmod(
            max(last, (step - 1) // steps_per_epoch * steps_per_epoch), steps_per_epoch
        )
        shuffle = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
        stop = (step - epoch * steps_per_epoch) * global_batch
        yield record, epoch * steps_per_epoch + first + 1, shuffle[first * global_batch : stop]
        last = step


def test_log_every_n_gives_rank_0_a_record_at_exactly_every_nth_step_with_the_exact_mean_loss_since_the_last(
    tmp_path,
):
    # torchrun 2 x 16 on 1000 samples: 32 steps an epoch (the last of 8 samples), 64 in all; --log-every 6,
    # the clock off. --lr 0 keeps the weights at w0, so each record's train_loss is known in advance: the mean
    # cross entropy at w0 over the samples of the steps since the last line (a progress line, or the epoch's).
    torch.manual_seed(7)
    w0 = ddp_train.build_model(default_args()).state_dict()
    torch.save(w0, tmp_path / "init.pt")
    script = recipe_script(tmp_path, "reporter.py")
    args = [
        "--num-samples",
        1000,
        "--eval-samples",
        0,
        "--epochs",
        2,
        "--batch-size",
        16,
        "--lr",
        0,
        "--log-every",
        6,
        "--log-seconds",
        0,
        "--init-from",
        tmp_path / "init.pt",
    ]
    r = run(
        torchrun_cmd(2, *args, script=script),
        tmp_path,
        env=clean_env(PYTHONPATH=ROOT, REPORT_TO=tmp_path / "report"),
    )
    # rank 1 never called it
    assert sorted(p.name for p in tmp_path.glob("report.*")) == ["report.0"]
    records = [json.loads(line) for line in (tmp_path / "report.0").read_text().splitlines()]
    progress = [record for record in records if record["kind"] == "progress"]
    assert [record["step"] for record in progress] == list(range(6, 61, 6)), progress
    shown = [int(line[2].replace(",", "")) for line in PROGRESS.findall(r.stdout)]
    assert shown == list(range(6, 61, 6)), r.stdout  # one console line each
    x, y = ddp_train.build_datasets(default_args("--num-samples", "1000"))[0].tensors
    model = ddp_train.build_model(default_args())
    model.load_state_dict(w0)
    with torch.no_grad():
        losses = F.cross_entropy(model.double()(x.double()), y, reduction="none")
    for record, first, samples in samples_since_the_last_line(progress, 1000, 32, 32):
        assert record["train_loss"] == pytest.approx(losses[samples].mean().item(), rel=1e-6), (
            record,
            first,
        )
        assert record["lr"] == 0 and record["samples_per_sec"] > 0
    # The epochs' records: every sample once, at w0.
    assert [m["train_loss"] for m in r.metrics] == pytest.approx(
        [losses.mean().item()] * 2, rel=1e-6
    )


def test_lm_log_every_n_gives_rank_0_a_record_at_exactly_every_nth_step_with_the_exact_token_mean_since_the_last(
    project, tmp_path, tinylm
):
    # tinylm on 90 functions of unequal lengths, no dropout, torchrun 2 x 2 samples x 2 micro-batches: a global batch
    # of 8, 12 steps an epoch (the last of 2 samples, one a rank), 24 in all; --log-every 5, the clock off. --lr 0
    # keeps the weights at w0, so each record's train_loss is known in advance: the mean at w0 over every real target
    # token (the padding is ignore_index) of the samples of the steps since the last line (a progress line, or the
    # epoch's start).
    tinylm.TRAIN_SIZE, tinylm.EVAL_SIZE, tinylm.DROPOUT = 90, 8, 0.0
    torch.manual_seed(5)
    model = tinylm.build_model(default_args())
    torch.save(model.state_dict(), tmp_path / "init.pt")
    script = recipe_script(tmp_path, "reporter.py")
    args = ["--epochs", 2, "--batch-size", 2, "--grad-accum", 2, "--lr", 0]
    args += ["--log-every", 5, "--log-seconds", 0, "--init-from", tmp_path / "init.pt"]
    env = {**LM_EXACT, "LM_TRAIN_SIZE": 90, "REPORT_PROJECT": "lm", "PYTHONPATH": project}
    r = run(
        torchrun_cmd(2, *args, script=script),
        tmp_path,
        env=clean_env(REPORT_TO=tmp_path / "report", **env),
    )
    # rank 1 never called it
    assert sorted(p.name for p in tmp_path.glob("report.*")) == ["report.0"]
    records = [json.loads(line) for line in (tmp_path / "report.0").read_text().splitlines()]
    progress = [record for record in records if record["kind"] == "progress"]
    assert [record["step"] for record in progress] == [5, 10, 15, 20], progress
    shown = [int(line[2].replace(",", "")) for line in PROGRESS.findall(r.stdout)]
    assert shown == [5, 10, 15, 20], r.stdout  # one console line each
    # Every sample's loss summed over its real target tokens, and their count, at w0 in float64.
    train_set, _ = tinylm.build_datasets(default_args())
    batch = tinylm.collate_fn([train_set[i] for i in range(90)])
    with torch.no_grad():
        logits = model.double()(batch["inputs"])
        token_losses = F.cross_entropy(
            logits.transpose(1, 2), batch["targets"], ignore_index=-100, reduction="none"
        )
    loss_sums, tokens = token_losses.sum(1), (batch["targets"] != -100).sum(1)
    for record, first, samples in samples_since_the_last_line(progress, 90, 8, 12):
        want = (loss_sums[samples].sum() / tokens[samples].sum()).item()
        assert record["train_loss"] == pytest.approx(want, rel=1e-6), (record, first)
        # not the mean of the samples' own token means (a short function's tokens would weigh more)
        assert record["train_loss"] != pytest.approx(
            (loss_sums[samples] / tokens[samples]).mean().item(), rel=1e-4
        )
        assert record["lr"] == 0 and record["tokens_per_sec"] > 0
    # The epochs' records: every real token of every sample once, at w0.
    assert [m["train_tokens"] for m in r.metrics] == [int(tokens.sum())] * 2
    assert [m["train_loss"] for m in r.metrics] == pytest.approx(
        [(loss_sums.sum() / tokens.sum()).item()] * 2, rel=1e-6
    )


def one_cycle_stopped_and_resumed(tmp_path, script, args, total, **stop):
    """Three runs of a script whose build_scheduler returns torch's OneCycleLR over `total` steps, with a record a
    step (--log-every 1) through report(): uninterrupted; stopped by SIGTERM (stopper's STOP_AT...); rerun. Every
    step's lr in the records is the one OneCycleLR gives that step, computed here by torch on an optimizer of our
    own, before the stop and after it; the final weights are the uninterrupted run's, bit for bit. Returns the
    runs and the step the stop came at."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=total)
    want = []
    for _ in range(total):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()

    def launch(name, expect=0, **env):
        return run(
            python_cmd(*args, "--lr", 0.01, "--log-every", 1, "--log-seconds", 0, script=script),
            tmp_path,
            out="whole" if name == "whole" else "out",
            env=clean_env(REPORT_TO=tmp_path / f"{name}.jsonl", **env),
            expect=expect,
        )

    def lrs(name):
        records = [
            json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()
        ]
        return {record["step"]: record["lr"] for record in records if record["kind"] == "progress"}

    whole = launch("whole")
    assert lrs("whole") == dict(enumerate(want, 1))  # exactly: JSON keeps a float's every bit
    first = launch("first", expect=75, STOP_SIGNAL="TERM", **stop)
    stopped = int(re.search(r"stopped by a signal at step (\d+)", first.stdout).group(1))
    final = launch("final")
    assert resumed_at(final.stdout)[1] == stopped, final
    assert lrs("final") == {step: want[step - 1] for step in range(stopped + 1, total + 1)}
    assert_same_weights(final.weights, whole.weights, exact=True)
    return whole, first, final, stopped


def test_a_users_one_cycle_lr_gets_every_step_and_resumes_bit_identical(project, tmp_path):
    # torch's OneCycleLR from build_scheduler (onecycle.py) over 2 x 16 steps, stopped mid-epoch 2.
    args = ["--num-samples", 512, "--eval-samples", 64, "--batch-size", 32, "--epochs", 2]
    script = str(project / "onecycle.py")
    whole, first, final, stopped = one_cycle_stopped_and_resumed(
        tmp_path, script, args, 32, STOP_AT=21
    )
    assert 21 <= stopped < 32, first
    # OneCycleLR was built for 32 steps: a longer run on the finished one is one line, and nothing changes.
    saved = (final.out_dir / "checkpoint.pt").read_bytes()
    longer = run(
        python_cmd(*args, "--lr", 0.01, "--epochs", 3, script=script),
        tmp_path,
        expect=2,
        env=clean_env(REPORT_TO=tmp_path / "longer.jsonl"),
    )
    assert "for 48 steps: your scheduler was built for the run's 32" in longer.stderr, longer
    assert (
        len(longer.stderr.strip().splitlines()) == 1
        and (final.out_dir / "checkpoint.pt").read_bytes() == saved
    )
    for a, b in zip(final.metrics, whole.metrics):
        assert (a["step"], a["train_loss"], a.get("eval_loss")) == (
            b["step"],
            b["train_loss"],
            b.get("eval_loss"),
        )


def test_a_users_one_cycle_lr_on_digits_with_augmentation_dropout_and_workers_gets_every_step_and_resumes_bit_identical(
    project, tmp_path
):
    # onecycle_digits.py: digits.py's own Dataset (random augmentation with torch, Python's random and numpy), its CNN
    # (BatchNorm, Dropout), 2 DataLoader workers, and torch's OneCycleLR from build_scheduler. 1437 samples at 64:
    # 23 steps an epoch (the last of 29 samples), 46 in all. Stopped by SIGTERM to the whole process group (workers
    # too) mid-epoch 2.
    args = ["--epochs", 2, "--batch-size", 64, "--workers", 2]
    whole, first, final, stopped = one_cycle_stopped_and_resumed(
        tmp_path, str(project / "onecycle_digits.py"), args, 46, STOP_TARGET="group", STOP_AT=30
    )
    assert 30 <= stopped < 46, first
    assert "Traceback" not in first.stderr and "DataLoader worker" not in first.stderr, first
    assert resumed_at(final.stdout) == (stopped - 23, stopped), final  # mid-epoch 2
    assert [m["epoch"] for m in final.metrics] == [1, 2]
    for a, b in zip(final.metrics, whole.metrics):
        assert a["train_samples"] == 1437
        assert (a["step"], a["train_loss"], a["eval_loss"], a["eval_accuracy"]) == (
            b["step"],
            b["train_loss"],
            b["eval_loss"],
            b["eval_accuracy"],
        )


# ------ make setup: the pinned TensorBoard for the tests, not a dependency of ddp_train.py ---------------


@pytest.mark.fast
def test_make_setup_installs_the_pinned_tensorboard_that_the_tests_read_curves_with(tmp_path):
    env = clean_env(MAKEFLAGS=None, MAKELEVEL=None, MFLAGS=None)
    r = subprocess.run(
        ["make", "-n", "-s", "setup", f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    py = tmp_path / "venv" / "bin" / "python"
    line = (
        f'{py} -c "import tensorboard" 2>/dev/null || {py} -m pip install -q --disable-pip-version-check '
        f"tensorboard==2.20.0 "
    )
    assert r.returncode == 0 and any(s.startswith(line) for s in r.stdout.splitlines()), (
        r.stdout + r.stderr
    )


# ---------------------------------------------------------------------------
# When a run hangs or crawls: a stall report naming the rank the others wait for and where it is,
# each rank's share of time waiting for data, --debug
# ---------------------------------------------------------------------------

STALL_REPORT = re.compile(
    r"^ddp_train\.py: stall: no optimizer step for (\d+) s\. Rank (\d+) holds the others up: "
    r"(.+); its stacks: (.*)\n((?:  rank \d+: last step .*\n?)+)",
    re.M,
)


def stall_reports(stderr: str) -> list[dict]:
    """Rank 0's stall reports: the rank it names, that rank's place and stacks' path, and each rank's
    (last step, place) from the lines under it."""
    return [
        {
            "seconds": int(m[1]),
            "rank": int(m[2]),
            "place": m[3],
            "stacks": m[4],
            "ranks": {
                int(r): (step, place)
                for r, step, place in re.findall(
                    r"^  rank (\d+): last step (\S+), (.+)$", m[5], re.M
                )
            },
        }
        for m in STALL_REPORT.finditer(stderr)
    ]


def stuck_line(place: str) -> int:
    """The line of stall_stuck.py where a rank gets stuck in `place` (its "# stuck in ..." comment)."""
    lines = VARIANTS["stall_stuck.py"].lstrip().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.endswith(f"# stuck in {place}"))


def process_tree(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of `root` and of every process under it, now."""
    parents, started = {}, {}
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            parents[int(proc.name)], started[int(proc.name)] = int(fields[1]), fields[19]
        except (OSError, ValueError, IndexError):
            continue
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in started:
            tree.add((pid, started[pid]))
            todo += [child for child, parent in parents.items() if parent == pid]
    return tree


def still_running(processes: set[tuple[int, str]]) -> list[int]:
    """Those of `processes` that still run: not gone, not a zombie, not a new process with the same pid."""
    running = []
    for pid, started in processes:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and fields[19] == started:
            running.append(pid)
    return running


class StuckRun:
    """torchrun 2 of stall_stuck.py on digits, one rank stuck as `env` says (STALL_IN, STALL_AT, STALL_RANK).
    As a context manager: afterwards every process the job had when it got stuck is killed (torchrun starts
    each worker in a session of its own, so killing torchrun's group would leave them running)."""

    def __init__(self, project: Path, tmp_path: Path, *args, **env):
        self.out, self.marker, self.processes = tmp_path / "out", tmp_path / "stuck", set()
        cmd = torchrun_cmd(
            2,
            "--epochs",
            2,
            "--batch-size",
            16,
            *args,
            "--out-dir",
            self.out,
            script=str(project / "stall_stuck.py"),
        )
        self.launch = Launch(cmd, tmp_path, env=clean_env(STALL_FILE=self.marker, **env))

    def wait_for_stall(self) -> float:
        """When the rank got stuck; every process of the job is noted then (DataLoader workers too)."""
        self.launch.wait_for(self.marker.exists, "a rank stuck", timeout=90)
        stuck_at = time.monotonic()
        self.processes = process_tree(self.launch.proc.pid)
        assert len(self.processes) >= 3, self.processes  # torchrun and its two workers
        return stuck_at

    def wait_for_report(self, timeout=40) -> dict:
        """Rank 0's first report of a stall after a step (not one of a slow start, before the first step)."""

        def found():
            reports = stall_reports(self.launch.stderr)
            return [r for r in reports if r["ranks"].get(r["rank"], ("?",))[0] not in ("0", "?")]

        self.launch.wait_for(found, "stall report", timeout=timeout)
        return found()[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        send(still_running(self.processes | process_tree(self.launch.proc.pid)))
        self.launch.kill()


def test_a_rank_stuck_in_compute_loss_is_named_with_its_stacks_and_the_job_ends_by_itself(
    project, tmp_path
):
    # Rank 1 sleeps for good in the user's compute_loss at its 8th training step (a model without buffers:
    # rank 0 waits in backward's gradient all-reduce). Rank 0 reports about 10 s later; at --timeout it
    # stops with one line, and torchrun ends rank 1, deaf to SIGTERM, 30 s after that (its fixed shutdown).
    with StuckRun(
        project,
        tmp_path,
        "--stall-seconds",
        10,
        "--timeout",
        20,
        STALL_IN="compute_loss",
        STALL_AT=8,
        STALL_MODEL="plain",
    ) as job:
        stuck_at = job.wait_for_stall()
        report = job.wait_for_report()
        assert 9 <= time.monotonic() - stuck_at <= 40, report
        code = job.launch.wait(90)
        ended_at = time.monotonic()
        left = still_running(job.processes)
    r = Result.of(job.launch, job.out)
    line = stuck_line("compute_loss")
    assert report["rank"] == 1 and report["place"] == f"in compute_loss (stall_stuck.py:{line})", r
    assert report["ranks"] == {1: ("7", report["place"]), 0: ("7", report["ranks"][0][1])}, r
    assert report["ranks"][0][1].startswith("waiting in backward: the gradient all-reduce"), r
    assert 10 <= report["seconds"] <= 40, r
    stacks = job.out / "stall" / "rank1.txt"
    assert report["stacks"] == str(stacks), r
    # faulthandler's dump of every thread: the main one stuck on the sleep's line of compute_loss, under
    # ddp_train's call of it; the report's own thread.
    dump = stacks.read_text()
    assert (
        f'File "{project / "stall_stuck.py"}", line {line} in compute_loss\n'
        f'  File "{project / "ddp_train.py"}", line ' in dump
    ), dump
    assert " in call_compute_loss\n" in dump and " in report_stall\n" in dump, dump
    assert (job.out / "stall" / "rank0.txt").exists()
    # The end: on its own, non-zero, rank 0's one line naming a hang, and nothing left running.
    assert code != 0 and ended_at - stuck_at < 85, r
    assert (
        "rank 0 lost contact with another process (it crashed, hung past --timeout" in r.stderr
    ), r
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left]


# Where a rank gets stuck (STALL_IN of stall_stuck.py), and what the report says: the stuck rank, the start of
# its place, the other rank's place, and what the stuck rank's stacks show (a pattern); a model without buffers
# (the test after it has one with some).
STALLS = {
    # Rank 1's Dataset, in one of its 2 DataLoader workers at that worker's 160th sample, sleeps for good; its
    # training process waits for the batch. The job ends by itself (--timeout), the sleeping worker with it.
    "dataloader-worker": (
        dict(STALL_IN="getitem", STALL_AT=160),
        ["--workers", 2],
        1,
        "loading data (",
        "waiting in backward: the gradient all-reduce",
        r'line \d+ in __next__\n  File "[^"]+/ddp_train\.py", line \d+ in on_device\n',
    ),
    # Rank 1 never reaches the step's all-reduce: its collate_fn, in the training process, sleeps.
    "collate_fn": (
        dict(STALL_IN="collate", STALL_AT=8),
        ["--workers", 0],
        1,
        f"loading data (stall_stuck.py:{stuck_line('collate_fn')})",
        "waiting in backward: the gradient all-reduce",
        rf'stall_stuck\.py", line {stuck_line("collate_fn")} in collate_fn\n',
    ),
    # Rank 0's second write of checkpoint.pt (--save-every 5) hangs in fsync (a filesystem that stopped
    # answering); rank 1 waits for it, patiently: a slow save must not look like a dead peer.
    "checkpoint-write": (
        dict(STALL_IN="fsync", STALL_AT=2, STALL_RANK=0),
        ["--save-every", 5],
        0,
        f"saving (stall_stuck.py:{stuck_line('fsync')})",
        "waiting for rank 0",
        rf'stall_stuck\.py", line {stuck_line("fsync")} in stuck_fsync\n'
        r'  File "[^"]+/ddp_train\.py", line \d+ in atomic_save\n',
    ),
}


@pytest.mark.parametrize("case", list(STALLS))
def test_the_stall_report_names_the_stuck_rank_and_its_place(project, tmp_path, case):
    env, args, stuck_rank, place, others, dumped = STALLS[case]
    with StuckRun(
        project, tmp_path, "--stall-seconds", 5, "--timeout", 12, *args, STALL_MODEL="plain", **env
    ) as job:
        stuck_at = job.wait_for_stall()
        report = job.wait_for_report(timeout=30)
        assert time.monotonic() - stuck_at <= 30, report
        if case == "dataloader-worker":
            code = job.launch.wait(90)
            left = still_running(job.processes)
    r = Result.of(job.launch, job.out)
    assert report["rank"] == stuck_rank and report["place"].startswith(place), r
    assert report["stacks"] == str(job.out / "stall" / f"rank{stuck_rank}.txt"), r
    assert (
        sorted(report["ranks"]) == [0, 1] and report["ranks"][stuck_rank][1] == report["place"]
    ), r
    assert report["ranks"][1 - stuck_rank][1].startswith(others), r
    assert report["ranks"][0][0] == report["ranks"][1][0], r  # the same last step
    dumps = [(job.out / "stall" / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    # every thread's stack, on each rank
    assert all(" in report_stall\n" in dump for dump in dumps), dumps
    assert re.search(dumped, dumps[stuck_rank]), dumps[stuck_rank]
    if case == "dataloader-worker":
        assert code != 0 and "hung past --timeout" in r.stderr, r
        assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left]


@pytest.mark.parametrize(
    "stuck_in, model, where",
    [("compute_loss", "digits", "compute_loss"), ("backward", "plain", "a gradient hook")],
    ids=["compute_loss-batchnorm", "gradient-hook"],
)
def test_the_stuck_rank_is_named_also_where_the_others_wait_in_the_same_function(
    project, tmp_path, stuck_in, model, where
):
    # Rank 1 sleeps in compute_loss with digits' BatchNorm model (rank 0 waits in DDP's forward, broadcasting
    # the buffers: inside compute_loss too); or in a gradient hook of the user's (rank 0 waits in backward).
    with StuckRun(
        project,
        tmp_path,
        "--stall-seconds",
        5,
        "--timeout",
        30,
        STALL_IN=stuck_in,
        STALL_AT=8,
        STALL_MODEL=model,
    ) as job:
        job.wait_for_stall()
        report = job.wait_for_report(timeout=30)
    r = Result.of(job.launch, job.out)
    assert report["rank"] == 1 and f"(stall_stuck.py:{stuck_line(where)})" in report["place"], r


SHARES = re.compile(
    r"  (?:rank (\d+) (waits for data|computes) (\d+)% of the time \(median (\d+)%\)|data wait +(\d+)%)  "
)


def timed_epoch(script: Path, tmp_path, env, *workers) -> Result:
    """torchrun 2: one epoch of `script` (a slow rank's project) in micro-batches of 16, a progress line
    every 0.3 s; --workers as given."""
    workers = ["--workers", *workers] if workers else []
    args = ["--epochs", 1, "--batch-size", 16, "--log-seconds", 0.3, *workers]
    return run(torchrun_cmd(2, *args, script=str(script)), tmp_path, env=env)


def wait_shares(stdout: str, does: str = "waits for data") -> list[tuple]:
    """(rank named or None, its share, the median share) in %, of each progress line and epoch line; a rank is
    named for what it `does` (or None, with the data wait's median)."""
    shares = [
        SHARES.search(line) for line in stdout.splitlines() if line.lstrip().startswith("epoch ")
    ]
    # no line names the other figure
    assert all(shares) and all(m[2] in (None, does) for m in shares), stdout
    return [
        (int(m[1]), int(m[3]), int(m[4])) if m[2] else (None, int(m[5]), int(m[5])) for m in shares
    ]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_rank_with_slow_data_is_named_by_its_share_of_time_waiting_for_it(
    project, tmp_path, workers
):
    # Rank 1's Dataset takes 3 ms a sample (slow.py reads RANK, which DataLoader workers inherit), rank 0's
    # none: rank 1 waits for its batches (with 2 workers, less), rank 0 for rank 1, in the all-reduce.
    r = timed_epoch(project / "slow.py", tmp_path, clean_env(SLOW_RANKS=1, SLOW_MS=3), workers)
    [epoch] = r.metrics
    waits = epoch["data_wait_by_rank"]
    assert len(waits) == 2 and waits[1] > 0.4 and waits[0] < waits[1] / 3, epoch
    # Rank 0 waits for rank 1's data in DDP's broadcast of digits' BatchNorm buffers, at its forward's start:
    # before its compute starts (the model's forward pre-hook), so that wait is not in its compute share.
    assert epoch["compute_by_rank"][0] < waits[1] / 4, epoch
    shares = wait_shares(r.stdout)
    assert len(shares) >= 3, r.stdout  # progress lines, and the epoch's
    assert {rank for rank, _, _ in shares} == {1}, r.stdout  # each line names rank 1, none rank 0
    rank, share, median = shares[-1]  # the epoch's line: its record's figures
    assert rank == 1 and abs(share - 100 * waits[1]) <= 1 and abs(median - 100 * waits[0]) <= 1, (
        shares,
        epoch,
    )


@pytest.mark.parametrize("task", ["digits", "lm"])
def test_a_rank_that_computes_slowly_is_named_by_its_share_of_time_computing(
    project, tmp_path, task
):
    # Rank 1's compute_loss sleeps 100 ms after its model's forward in every training step. Its compute share
    # must exceed rank 0's by the share of the epoch it slept (known here: steps x 100 ms): rank 0 waits for it
    # in the gradient all-reduce, which is not compute. On digits (BatchNorm) and tinylm (tokens: a count
    # all-reduce). (The sleep is most of the epoch, so that the ranks' own compute, which a busy machine makes
    # unequal by a few hundredths of the epoch, stays well inside the bounds: with 30 ms it did not.)
    env = clean_env(
        SLOW_PROJECT=task,
        SLOW_COMPUTE_MS=100,
        **({**LM_EXACT, "LM_TRAIN_SIZE": 640} if task == "lm" else {}),
    )
    r = timed_epoch(project / "slow_compute.py", tmp_path, env)
    [epoch] = r.metrics
    compute, waits, seconds = (
        epoch["compute_by_rank"],
        epoch["data_wait_by_rank"],
        epoch["epoch_time_s"],
    )
    slept = epoch["step"] * 0.100 / seconds  # one micro-batch a step on each rank
    assert 0.9 * slept <= compute[1] - compute[0] <= 1.5 * slept + 0.05, (slept, epoch)
    assert compute[0] > 0 and max(waits) < 0.2 and compute[1] + waits[1] <= 1.0, epoch
    shares = wait_shares(r.stdout, "computes")
    # every line names rank 1
    assert len(shares) >= 2 and {rank for rank, _, _ in shares} == {1}, r.stdout
    rank, share, median = shares[-1]  # the epoch's line: its record's figures
    assert abs(share - 100 * compute[1]) <= 1 and abs(median - 100 * compute[0]) <= 1, (
        shares,
        epoch,
    )


def test_data_wait_shares_are_shares_of_the_time_at_most_100_percent(project, tmp_path):
    r = timed_epoch(project / "slow.py", tmp_path, clean_env(SLOW_RANKS=1, SLOW_MS=3), 2)
    shares = wait_shares(r.stdout)
    assert len(shares) >= 2 and all(share <= 100 for _, share, _ in shares), r.stdout
    assert all(0 <= share <= 1 for share in r.metrics[0]["data_wait_by_rank"]), r.metrics


def test_debug_turns_on_torchs_distributed_debugging_and_puts_the_other_ranks_output_in_the_out_dir(
    project, tmp_path
):
    # stall_debug.py: every rank prints torch.distributed's debug level to its stderr, once.
    cmd = torchrun_cmd(2, "--epochs", 1, "--batch-size", 64, script=str(project / "stall_debug.py"))
    env = clean_env(TORCH_DISTRIBUTED_DEBUG=None, TORCH_CPP_LOG_LEVEL=None)
    plain = run(cmd, tmp_path, out="plain", env=env)
    assert (
        "rank 0: debug level OFF" in plain.stderr and "rank 1: debug level OFF" in plain.stderr
    ), plain
    # without --debug, every rank's output on the console
    assert not (plain.out_dir / "debug").exists(), plain
    r = run([*cmd, "--debug"], tmp_path, out="debug", env=env)
    # INFO on every backend (DETAIL made torch 2.13's CPU build crash while building DDP); yours, if you set one.
    assert "rank 0: debug level INFO" in r.stderr and "rank 1:" not in r.stderr, r
    assert sorted(p.name for p in (r.out_dir / "debug").iterdir()) == ["rank1.log"], r
    assert "rank 1: debug level INFO" in (r.out_dir / "debug" / "rank1.log").read_text(), r
    # a log, not a program: no execute bits
    assert (r.out_dir / "debug" / "rank1.log").stat().st_mode & 0o111 == 0
    # rank 0's console as ever
    assert "epoch   1/1" in r.stdout and r.stdout.count("saved ") == 1, r
    mine = run(
        [*cmd, "--debug"], tmp_path, out="mine", env=clean_env(TORCH_DISTRIBUTED_DEBUG="OFF")
    )
    assert "rank 0: debug level OFF" in mine.stderr, mine


@pytest.mark.fast
def test_the_readmes_flight_recorder_command_reads_the_dumps_under_the_names_the_recorder_writes(
    tmp_path,
):
    # NCCL's recorder dumps rank R's collectives to the file TORCH_FR_DUMP_TEMP_FILE (TORCH_NCCL_DEBUG_INFO_TEMP_FILE
    # before) + R (c10d's DebugInfoWriter: c10::str(prefix, rank)). Two ranks' dumps, as the script sets the names;
    # then the README's command, as written: its -p must end where the rank starts (fr_trace reads int(name[len(p):])).
    pytest.importorskip(
        "torch.distributed.flight_recorder.fr_trace",
        reason="torch's analyser: torch 2.10 and later",
    )
    env = ddp_train.flight_recorder_env(str(tmp_path / "out"))
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    (tmp_path / "out").mkdir()
    for rank in range(2):  # an empty dump of each rank's: no collective in flight
        dump = {
            "entries": [],
            "version": "2.10",
            "pg_config": {"0": {"desc": "default_pg", "ranks": "[0, 1]"}},
        }
        Path(env["TORCH_FR_DUMP_TEMP_FILE"] + str(rank)).write_bytes(pickle.dumps(dump))
    command = re.search(
        r"`(python -m torch\.distributed\.flight_recorder\.fr_trace [^`]+)`", README
    ).group(1)
    argv = [str(tmp_path / "out") if word == "OUT_DIR" else word for word in shlex.split(command)]
    r = subprocess.run([PY, *argv[1:]], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_a_peer_hung_past_the_timeout_while_ddp_broadcasts_buffers_is_one_line(monkeypatch, capsys):
    # What rank 0 gets (torch 2.13, gloo) in most runs where its peer hangs while DDP's forward broadcasts
    # BatchNorm buffers (the compute_loss-batchnorm case above, with a short --timeout); in the others, a
    # recv timeout whose message names gloo.
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setattr(ddp_train.dist, "is_initialized", lambda: True)  # it had joined the group
    ctx = ddp_train.Context(rank=0, world_size=2)
    timed_out = RuntimeError("Application timeout caused pair closure")
    with pytest.raises(SystemExit) as stop:
        ddp_train.explain_failure(timed_out, ctx)
    assert stop.value.code == 1
    assert (
        "error: rank 0 lost contact with another process (it crashed, hung past --timeout"
        in capsys.readouterr().err
    )
