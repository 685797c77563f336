"""Tests for ddp_train.py: the real script, in real processes, with real process groups
(gloo on CPU). Every launch has a hard timeout that kills its whole process group."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ddp_train

ROOT = Path(__file__).resolve().parent
SCRIPT = str(ROOT / "ddp_train.py")
PY = sys.executable
TIMEOUT = 150  # seconds for any one launch; a hang fails fast instead of eating CI
# A small workload: 2 epochs, 32 samples per process and step. 1000 divides by 2 and 4
# processes (no sampler padding), and not by the global batch (a short last step).
SMALL = ["--num-samples", "1000", "--eval-samples", "301", "--epochs", "2", "--batch-size", "32"]
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


# ---------------------------------------------------------------------------
# The shared launcher
# ---------------------------------------------------------------------------


def clean_env(**extra) -> dict:
    """The test's environment without any launcher's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port(low=None, high=None) -> int:
    """A port nobody listens on: the kernel's pick, or a random one in [low, high)."""
    for _ in range(200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.randrange(low, high) if low else 0))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


class Launch:
    """A command started in its own session (process group), output to files. Use as a context
    manager: on exit the whole group is killed, whatever happened."""

    def __init__(self, cmd, log_dir: Path, name="run", env=None, cwd=None):
        self.cmd, self.out_path, self.err_path = [str(c) for c in cmd], log_dir / f"{name}.out", log_dir / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=err, env=env or clean_env(),
                                         cwd=cwd or ROOT, start_new_session=True)

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait(self, timeout=TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"timed out after {timeout}s: {' '.join(self.cmd)}\n{self.stdout}\n{self.stderr}")

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def wait_for(self, predicate, what: str, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                pytest.fail(f"exited ({self.proc.returncode}) before {what}\n{self.stdout}\n{self.stderr}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout}s\n{self.stdout}\n{self.stderr}")
            time.sleep(0.005)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def finish(nodes, timeout=TIMEOUT):
    """Wait for every launch; kill them all afterwards, whatever happened."""
    try:
        return [n.wait(timeout) for n in nodes]
    finally:
        for n in nodes:
            n.kill()


class Result:
    def __init__(self, launch: Launch, out_dir: Path):
        self.returncode, self.stdout, self.stderr, self.out_dir = launch.proc.returncode, launch.stdout, launch.stderr, out_dir

    @property
    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.out_dir / "metrics.jsonl").read_text().splitlines()]

    @property
    def weights(self) -> dict:
        return torch.load(self.out_dir / "model.pt", weights_only=True)

    def __repr__(self):
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def python_cmd(*args):
    return [PY, SCRIPT, *args]


def torchrun_cmd(nproc, *args, launcher_args=()):
    return [PY, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0", *launcher_args, SCRIPT, *args]


def run(cmd, tmp_path: Path, out="out", name=None, env=None, cwd=None, timeout=TIMEOUT, expect=0) -> Result:
    """Launch `cmd` (ddp_train.py's args get --out-dir tmp_path/out), wait, check the exit code."""
    out_dir = tmp_path / out
    name = name or out
    with Launch([*cmd, "--out-dir", out_dir], tmp_path, name, env=env, cwd=cwd) as launch:
        launch.wait(timeout)
    result = Result(launch, out_dir)
    if expect is not None:
        assert result.returncode == expect, result
    return result


def assert_same_weights(a: dict, b: dict, exact=False):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{k} differs (max {(a[k] - b[k]).abs().max():.3g})"
        else:
            assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), f"{k} differs by up to {(a[k] - b[k]).abs().max():.3g}"


def assert_same_run(a: dict, b: dict):
    """The same training run up to float rounding, for long runs that change how the global batch
    is split: AdamW amplifies rounding on units whose gradients are nearly zero, so single elements
    may drift by ~1e-4 while every tensor stays within 1e-4 relative norm. A resume that is one
    batch off lands near 3e-2."""
    for k in a:
        assert (a[k] - b[k]).norm() <= 1e-3 * b[k].norm(), f"{k} differs by {(a[k] - b[k]).norm() / b[k].norm():.2g} (relative norm)"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """reference(cmd): the Result of a run that several tests compare against, made once per module."""
    made = {}

    def get(cmd):
        key = tuple(map(str, cmd))
        if key not in made:
            made[key] = run(cmd, tmp_path_factory.mktemp("reference"))
        return made[key]

    return get


def default_args(*argv):
    return ddp_train.parse_args(list(argv))


def assert_only_rank0_files(out_dir: Path):
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(["checkpoint.pt", "checkpoint.prev.pt", "metrics.jsonl", "model.pt"])


# ---------------------------------------------------------------------------
# Launch modes: each completes and writes model.pt once
# ---------------------------------------------------------------------------


CORES = len(os.sched_getaffinity(0))


def check_completed_run(r: Result, world_size: int, launcher: str):
    assert f"{launcher}, world size {world_size}" in r.stdout, r
    assert r.stdout.count("saved ") == 1, r  # rank 0 alone speaks and saves
    assert [m["world_size"] for m in r.metrics] == [world_size, world_size]
    assert_only_rank0_files(r.out_dir)
    model = ddp_train.build_model(default_args())
    model.load_state_dict(r.weights)  # plain, strict: no "module." or "_orig_mod." prefixes


def test_plain_python_runs_one_process_without_process_group(tmp_path):
    r = run(python_cmd(*SMALL), tmp_path)
    check_completed_run(r, 1, "python")
    assert f"no process group, cpu, {CORES} thread(s)/process" in r.stdout  # all cores for one process


@pytest.mark.parametrize("nproc", [1, 2])
def test_torchrun_single_node(tmp_path, nproc):
    check_completed_run(run(torchrun_cmd(nproc, *SMALL), tmp_path), nproc, "torchrun")


def test_spawn_starts_local_processes_itself(tmp_path):
    r = run(python_cmd(*SMALL, "--spawn", 2), tmp_path)
    check_completed_run(r, 2, "spawn")
    assert f"{max(1, CORES // 2)} thread(s)/process" in r.stdout  # the cores shared between the processes


def test_user_thread_setting_is_respected(tmp_path):
    r = run(python_cmd(*SMALL), tmp_path, env=clean_env(OMP_NUM_THREADS=1))
    assert "1 thread(s)/process" in r.stdout


def test_legacy_distributed_launch_passes_local_rank_argument(tmp_path):
    cmd = [PY, "-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={free_port()}", SCRIPT, *SMALL]
    check_completed_run(run(cmd, tmp_path), 2, "launch")


@pytest.mark.parametrize("spelling", ["--local-rank=1", "--local_rank=1"])
def test_both_legacy_local_rank_spellings_parse(spelling):
    assert ddp_train.parse_args([spelling]).local_rank == 1


def test_slurm_tasks_find_master_from_nodelist_and_port_from_job_id(tmp_path):
    # srun's variables for 2 tasks on one node. MASTER_ADDR is unset: it comes from the first host
    # of the node list; MASTER_PORT is unset: every task derives it from the job id.
    port = free_port(15000, 35000)
    slurm = dict(SLURM_NTASKS=2, SLURM_STEP_NUM_TASKS=2, SLURM_NTASKS_PER_NODE=2, SLURM_JOB_ID=port - 15000,
                 SLURM_JOB_NODELIST="127.0.0.[1-2]")
    out_dir = tmp_path / "out"
    tasks = [Launch(python_cmd(*SMALL, "--out-dir", out_dir), tmp_path, f"task{i}",
                    env=clean_env(**slurm, SLURM_PROCID=i, SLURM_LOCALID=i)) for i in range(2)]
    codes = finish(tasks)
    assert codes == [0, 0], tasks[0].stderr + tasks[1].stderr
    check_completed_run(Result(tasks[0], out_dir), 2, "slurm")
    assert tasks[1].stdout == ""  # rank 1 prints nothing


def test_sbatch_script_running_python_directly_is_one_process(tmp_path):
    # Inside an sbatch script (no srun) SLURM_NTASKS may be 4, but this is one process, not a task.
    env = clean_env(SLURM_NTASKS=4, SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_JOB_ID=7, SLURM_JOB_NODELIST="n[1-4]")
    check_completed_run(run(python_cmd(*SMALL), tmp_path, env=env), 1, "python")


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_tcp_and_file_init_methods(tmp_path, scheme):
    where = f"tcp://127.0.0.1:{free_port()}" if scheme == "tcp" else f"file://{tmp_path}/rendezvous"
    r = run(python_cmd(*SMALL, "--spawn", 2, "--init-method", where), tmp_path)
    check_completed_run(r, 2, "spawn")


def test_two_torchrun_nodes_on_localhost_only_rank0_writes(tmp_path):
    # Two "nodes", each one torchrun with one process, each in its own directory with a
    # relative --out-dir: node 1's directory must stay empty.
    port = free_port()
    nodes = []
    for node_rank in range(2):
        cwd = tmp_path / f"node{node_rank}"
        cwd.mkdir()
        cmd = [PY, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node_rank}",
               "--master_addr=127.0.0.1", f"--master_port={port}", SCRIPT, *SMALL, "--out-dir", "out"]
        nodes.append(Launch(cmd, tmp_path, f"node{node_rank}", cwd=cwd))
    codes = finish(nodes)
    assert codes == [0, 0], nodes[0].stderr + nodes[1].stderr
    check_completed_run(Result(nodes[0], tmp_path / "node0" / "out"), 2, "torchrun")
    assert not (tmp_path / "node1" / "out").exists()


def test_importing_starts_nothing():
    r = subprocess.run([PY, "-c", "import ddp_train, torch.distributed as d; print(d.is_initialized())"],
                       cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False" and r.returncode == 0, r.stderr


def test_repeated_torchrun_runs_never_abort_at_exit(tmp_path):
    # The classic gloo abort ("terminate called without an active exception") hits about one run in
    # three when the process group dies before the DDP model: ten clean exits in a row.
    tiny = ["--num-samples", "256", "--eval-samples", "64", "--epochs", "1", "--batch-size", "32"]
    for i in range(10):
        r = run(torchrun_cmd(2, *tiny), tmp_path, out=f"out{i}")
        assert "terminate called" not in r.stderr, r


# ---------------------------------------------------------------------------
# Equivalence: N processes x batch B == 1 process x batch N*B
# ---------------------------------------------------------------------------


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
    assert final["eval_accuracy"] == pytest.approx((logits.argmax(1) == y).sum().item() / 301, abs=1e-12)
    assert final["eval_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)


# ---------------------------------------------------------------------------
# It learns, and it says so clearly
# ---------------------------------------------------------------------------


def test_default_run_learns(tmp_path):
    r = run(python_cmd(), tmp_path)
    assert r.metrics[-1]["eval_accuracy"] > 0.9  # chance is 0.1
    assert r.metrics[-1]["train_loss"] < r.metrics[0]["train_loss"]
    for key in ("epoch", "train_loss", "eval_loss", "eval_accuracy", "eval_samples", "train_samples",
                "samples_per_sec", "world_size", "effective_batch_size", "first_step_at", "peak_rss_mb"):
        assert key in r.metrics[0]


@pytest.mark.parametrize("argv, says", [
    (["--epochs", "abc"], "--epochs: expected an integer"),
    (["--batch-size", "0"], "--batch-size: must be at least 1"),
    (["--amp", "fp8"], "--amp: invalid choice"),
    (["--lr", "nan"], "--lr: must be at least 0"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--resume", "missing.pt"], "--resume missing.pt: no such file"),
    (["--timeout", "0"], "--timeout: must be greater than 0"),
    pytest.param(["--backend", "nccl"], "--backend nccl needs CUDA",
                 marks=pytest.mark.skipif(HAS_CUDA, reason="CUDA is present: nccl works")),
])
def test_bad_input_exits_with_one_clear_line(tmp_path, argv, says):
    r = run(python_cmd(*SMALL, *argv), tmp_path, expect=2)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp_train.py: error:") and says in lines[0], r
    assert "Traceback" not in r.stderr


def test_sync_bn_on_cpu_says_it_needs_cuda(tmp_path):
    if HAS_CUDA:
        pytest.skip("CUDA is present: SyncBatchNorm works")
    r = run(torchrun_cmd(2, *SMALL, "--batch-norm", "--sync-bn"), tmp_path, expect=None)
    assert r.returncode != 0
    assert r.stderr.count("ddp_train.py: error: --sync-bn needs CUDA") == 1, r


def test_compiled_ddp_saves_a_plain_state_dict(tmp_path):
    # torch.compile wraps the module in _orig_mod, DDP in module: neither may leak into model.pt.
    r = run(torchrun_cmd(2, *SMALL, "--compile"), tmp_path)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in r.weights)
    ddp_train.build_model(default_args()).load_state_dict(r.weights)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cpu_too(tmp_path, reference, amp):
    r = run(torchrun_cmd(2, *SMALL, "--amp", amp), tmp_path)
    exact = reference(torchrun_cmd(2, *SMALL))
    assert r.metrics[-1]["train_loss"] == pytest.approx(exact.metrics[-1]["train_loss"], rel=0.02)


def test_first_slurm_host_expands_node_lists():
    assert ddp_train.first_slurm_host("gpu[07-09,12],cpu1") == "gpu07"
    assert ddp_train.first_slurm_host("node3,node4") == "node3"
    assert ddp_train.first_slurm_host("a-b[1,3]") == "a-b1"


# ---------------------------------------------------------------------------
# Fault tolerance: checkpoints, resume, preemption
# ---------------------------------------------------------------------------

# Long enough epochs to stop mid-epoch: 2 processes x 16 take 256 steps per epoch, 1 x 16 take 512.
FT = ["--num-samples", "8192", "--eval-samples", "256", "--epochs", "2", "--batch-size", "16", "--save-every", "40"]


FT_TORCHRUN2, FT_PYTHON = torchrun_cmd(2, *FT), python_cmd(*FT)


def worker_pids(agent_pid: int) -> dict[int, int]:
    """{LOCAL_RANK: pid} of the worker processes a torchrun agent started."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == agent_pid:
                env = dict(kv.split("=", 1) for kv in (proc / "environ").read_text().split("\0") if "=" in kv)
                found[int(env["LOCAL_RANK"])] = int(proc.name)
        except (OSError, ValueError, IndexError, KeyError):
            continue
    return found


def resumed_at(stdout: str) -> tuple[int, int]:
    """(step within the epoch, optimizer steps done) from the 'resumed from' line."""
    m = re.search(r"resumed from .* at epoch \d+, step (\d+)/\d+ \((\d+) optimizer steps done", stdout)
    assert m, stdout
    return int(m.group(1)), int(m.group(2))


def wait_for_checkpoint(launch: Launch, out_dir: Path):
    launch.wait_for(lambda: (out_dir / "checkpoint.pt").exists(), "first checkpoint")


def test_killed_worker_is_restarted_and_ends_bit_identical(tmp_path, reference):
    out = tmp_path / "out"
    cmd = torchrun_cmd(2, *FT, "--out-dir", out, launcher_args=["--max-restarts=1"])
    with Launch(cmd, tmp_path) as launch:
        wait_for_checkpoint(launch, out)
        os.kill(worker_pids(launch.proc.pid)[1], signal.SIGKILL)  # rank 1 dies mid-epoch
        code = launch.wait()
    r = Result(launch, out)
    assert code == 0, r
    step_in_epoch, _ = resumed_at(r.stdout)
    assert step_in_epoch > 0  # it really was mid-epoch
    assert_same_weights(r.weights, reference(FT_TORCHRUN2).weights, exact=True)
    assert [m["epoch"] for m in r.metrics] == [1, 2]  # no epoch logged twice
    for a, b in zip(r.metrics, reference(FT_TORCHRUN2).metrics):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-9) and a["eval_accuracy"] == b["eval_accuracy"]


def test_sigterm_to_torchrun_checkpoints_on_every_rank_and_rerun_is_bit_identical(tmp_path, reference):
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
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == int(m.group(1))
    assert not (out / "model.pt").exists()
    again = run(cmd, tmp_path)
    assert resumed_at(again.stdout)[1] == int(m.group(1))
    assert_same_weights(again.weights, reference(FT_TORCHRUN2).weights, exact=True)


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


def test_four_ranks_stop_and_resume_bit_identical(tmp_path):
    # Beyond two ranks the all-reduce's rounding depends on DDP's bucket state: still bit-identical.
    four = ["--num-samples", "4096", "--eval-samples", "64", "--epochs", "1", "--batch-size", "16",
            "--save-every", "10", "--spawn", "4"]
    reference = run(python_cmd(*four), tmp_path, out="reference")
    out = tmp_path / "out"
    with Launch(python_cmd(*four, "--out-dir", out), tmp_path, "stopped") as launch:
        wait_for_checkpoint(launch, out)
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.wait() == 75, launch.stderr
    again = run(python_cmd(*four), tmp_path)
    assert resumed_at(again.stdout)[0] > 0
    assert_same_weights(again.weights, reference.weights, exact=True)


def test_truncated_checkpoint_falls_back_to_previous_one(tmp_path, reference):
    first = run(python_cmd(*FT), tmp_path)
    ckpt, prev = first.out_dir / "checkpoint.pt", first.out_dir / "checkpoint.prev.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # a torn write, a full disk, a bad copy
    (first.out_dir / "model.pt").unlink()
    r = run(python_cmd(*FT), tmp_path)
    assert "warning: " in r.stderr and "checkpoint.pt is unreadable" in r.stderr, r
    assert "resumed from" in r.stdout and "checkpoint.prev.pt" in r.stdout
    assert (first.out_dir / "checkpoint.pt.unreadable").exists()
    assert_same_weights(r.weights, reference(FT_PYTHON).weights, exact=True)
    # Rerunning a finished run changes nothing.
    done = run(python_cmd(*FT), tmp_path)
    assert "at the end of training" in done.stdout
    assert_same_weights(done.weights, r.weights, exact=True)


def test_unreadable_checkpoints_stop_with_one_line_and_stay_untouched(tmp_path):
    first = run(python_cmd(*SMALL), tmp_path)
    files = {p: p.read_bytes()[:500] for p in first.out_dir.glob("checkpoint*.pt")}
    for p, head in files.items():
        p.write_bytes(head)
    r = run(python_cmd(*SMALL), tmp_path, expect=2)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "checkpoint.pt is unreadable" in lines[0] and "Traceback" not in r.stderr, r
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
    with Launch(python_cmd(*big, "--resume", "never", "--out-dir", other.out_dir), tmp_path, "killed") as launch:
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

RUN_MULTI = str(ROOT / "run_multi_node.sh")
multinode = pytest.mark.multinode


class Host:
    """One "machine": a network namespace with its own address, interface, hostname and /etc/hosts."""

    def __init__(self, ns, addr, ifname, hostname):
        self.ns, self.addr, self.ifname, self.hostname = ns, addr, ifname, hostname

    def command(self, *argv, hostname=None):
        # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts; unshare gives a hostname of its own.
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                hostname or self.hostname, *map(str, argv)]

    def kill_all(self):
        pids = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def sh(*argv):
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def two_hosts():
    """Two hosts on this machine, joined by a veth pair: traffic stays between them. Deleted
    afterwards, also when a test fails. Skips where namespaces cannot be made (not root)."""
    if os.geteuid() != 0 or not all(map(shutil.which, ("ip", "unshare"))):
        pytest.skip("two hosts need root, iproute2 and unshare (network and UTS namespaces)")
    tag = f"{os.getpid() % 100000}{random.randrange(100)}"
    subnet = f"10.231.{random.randrange(1, 255)}"
    hosts = [Host(f"ddp{tag}n{i}", f"{subnet}.{i + 1}", f"vd{tag}n{i}", f"node{i}") for i in range(2)]
    try:
        for h in hosts:
            sh("ip", "netns", "add", h.ns)
            os.makedirs(f"/etc/netns/{h.ns}", exist_ok=True)
            Path(f"/etc/netns/{h.ns}/hosts").write_text(
                "127.0.0.1 localhost\n" + "".join(f"{x.addr} {x.hostname}\n" for x in hosts))
        sh("ip", "link", "add", hosts[0].ifname, "type", "veth", "peer", "name", hosts[1].ifname)
        for h in hosts:
            sh("ip", "link", "set", h.ifname, "netns", h.ns)
            sh("ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            sh("ip", "-n", h.ns, "link", "set", h.ifname, "up")
            sh("ip", "-n", h.ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        remove_hosts(hosts)
        pytest.skip(f"cannot create network namespaces here: {getattr(exc, 'stderr', None) or exc}")
    try:
        yield hosts
    finally:
        remove_hosts(hosts)


def remove_hosts(hosts):
    for h in hosts:
        h.kill_all()
        subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)
        shutil.rmtree(f"/etc/netns/{h.ns}", ignore_errors=True)


def node_env(hosts, node_rank, port, **extra):
    """run_multi_node.sh's settings for one of the two hosts; `extra` overrides them."""
    settings = dict(PYTHON=PY, NNODES=2, NODE_RANK=node_rank, MASTER_ADDR=hosts[0].addr, MASTER_PORT=port,
                    NPROC_PER_NODE=2, IFNAME=hosts[node_rank].ifname, TIMEOUT=30)
    return clean_env(**{**settings, **extra})


def start_nodes(hosts, tmp_path, args, port, name="node", hostname=None, **extra):
    return [Launch(hosts[i].command(RUN_MULTI, *args, hostname=hostname), tmp_path, f"{name}{i}",
                   env=node_env(hosts, i, port, **extra)) for i in range(2)]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


@multinode
@pytest.mark.parametrize("rdzv, hostname", [("c10d", None), ("static", None), ("c10d", "localhost")],
                         ids=["c10d", "static", "c10d-hostnames-on-loopback"])
def test_two_hosts_match_single_process_with_same_global_batch(two_hosts, tmp_path, rdzv, hostname):
    # With IFNAME set, nothing depends on hostnames resolving to the hosts' own addresses.
    out = tmp_path / "out"
    nodes = start_nodes(two_hosts, tmp_path, [*SMALL, "--out-dir", out], free_port(), RDZV=rdzv, hostname=hostname)
    assert finish(nodes) == [0, 0], nodes[0].stderr + nodes[1].stderr
    r = Result(nodes[0], out)
    assert "torchrun, world size 4 (2/node)" in r.stdout, r
    assert [m["world_size"] for m in r.metrics] == [4, 4] and r.metrics[-1]["effective_batch_size"] == 128
    one = run(python_cmd(*SMALL, "--batch-size", 128), tmp_path, out="one")
    assert_same_weights(r.weights, one.weights)


@multinode
def test_two_hosts_slurm_mode_takes_master_from_nodelist(two_hosts, tmp_path):
    # What sbatch + `srun ./run_multi_node.sh --slurm` gives each node: no MASTER_ADDR at all.
    out = tmp_path / "out"
    nodes = []
    for i, h in enumerate(two_hosts):
        # MASTER_PORT stays at its default (29500): each namespace has ports of its own.
        env = clean_env(PYTHON=PY, SLURM_JOB_ID=4242, SLURM_NODEID=i, SLURM_JOB_NUM_NODES=2, SLURM_PROCID=i,
                        SLURM_JOB_NODELIST="node[0-1]", NPROC_PER_NODE=2, IFNAME=h.ifname, TIMEOUT=30)
        nodes.append(Launch(h.command(RUN_MULTI, "--slurm", "--", *SMALL, "--out-dir", out), tmp_path, f"slurm{i}", env=env))
    assert finish(nodes) == [0, 0], nodes[0].stderr + nodes[1].stderr
    assert "world size 4 (2/node)" in nodes[0].stdout and (out / "model.pt").exists()


@multinode
def test_unreachable_master_is_one_line_within_timeout(two_hosts, tmp_path):
    env = node_env(two_hosts, 1, free_port(), TIMEOUT=5, MASTER_ADDR=two_hosts[0].addr.rsplit(".", 1)[0] + ".99")
    t0 = time.monotonic()
    with Launch(two_hosts[1].command(RUN_MULTI, *SMALL, "--out-dir", tmp_path / "out"), tmp_path, env=env) as node:
        code = node.wait(60)
    assert code != 0 and time.monotonic() - t0 < 25
    assert "cannot reach MASTER_ADDR" in last_line(node.stderr) and "Traceback" not in node.stderr, node.stderr


@multinode
def test_second_node_never_arriving_is_one_line_within_timeout(two_hosts, tmp_path):
    env = node_env(two_hosts, 0, free_port(), TIMEOUT=5)
    t0 = time.monotonic()
    with Launch(two_hosts[0].command(RUN_MULTI, *SMALL, "--out-dir", tmp_path / "out"), tmp_path, env=env) as node:
        code = node.wait(60)
    assert code != 0 and time.monotonic() - t0 < 30
    assert "not all 2 nodes joined within 5s" in last_line(node.stderr), node.stderr


@multinode
def test_taken_master_port_is_one_line(two_hosts, tmp_path):
    port = free_port()
    holder = [PY, "-c", f"import socket,time; s=socket.socket(); s.bind(({two_hosts[0].addr!r}, {port})); s.listen(); "
                        "print('listening', flush=True); time.sleep(60)"]
    with Launch(two_hosts[0].command(*holder), tmp_path, "holder") as listener:
        listener.wait_for(lambda: "listening" in listener.stdout, "the port to be taken")
        with Launch(two_hosts[0].command(RUN_MULTI, *SMALL), tmp_path, env=node_env(two_hosts, 0, port)) as node:
            code = node.wait(60)
    assert code == 2 and f"port {port} on {two_hosts[0].addr} is already in use" in last_line(node.stderr), node.stderr


@multinode
def test_hostname_on_loopback_without_interface_is_one_line(two_hosts, tmp_path):
    # The classic multi-NIC trap: the hostname resolves to 127.0.x.x, so gloo would advertise it.
    env = node_env(two_hosts, 0, free_port(), IFNAME="")
    with Launch(two_hosts[0].command(RUN_MULTI, *SMALL, hostname="localhost"), tmp_path, env=env) as node:
        code = node.wait(60)
    assert code == 2 and f"set IFNAME={two_hosts[0].ifname}" in last_line(node.stderr), node.stderr


@multinode
@pytest.mark.parametrize("how", ["killed", "left the network"])
def test_surviving_node_exits_with_a_message_when_the_other_dies(two_hosts, tmp_path, how):
    out = tmp_path / "out"
    long_run = ["--num-samples", "400000", "--eval-samples", "64", "--epochs", "1", "--save-every", "20"]
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
        subprocess.run(["ip", "-n", two_hosts[1].ns, "link", "set", two_hosts[1].ifname, "up"], capture_output=True)
        for n in nodes:
            n.kill()
    assert code != 0 and elapsed < 60, (code, elapsed)
    err = nodes[0].stderr
    assert "lost contact with another process" in err and "a worker on another node stopped" in last_line(err), err


@multinode
def test_restarted_node_rejoins_and_run_ends_bit_identical(two_hosts, tmp_path):
    args = ["--num-samples", "8192", "--eval-samples", "64", "--epochs", "2", "--batch-size", "16", "--save-every", "20"]
    reference = start_nodes(two_hosts, tmp_path, [*args, "--out-dir", tmp_path / "reference"], free_port(), name="ref")
    assert finish(reference) == [0, 0], reference[0].stderr
    out, port = tmp_path / "out", free_port()
    nodes = start_nodes(two_hosts, tmp_path, [*args, "--out-dir", out], port, MAX_RESTARTS=1)
    try:
        nodes[0].wait_for(lambda: (out / "checkpoint.pt").exists(), "a first checkpoint")
        nodes[1].kill()  # node 1 dies; node 0's torchrun restarts its workers and waits for it
        two_hosts[1].kill_all()
        again = Launch(two_hosts[1].command(RUN_MULTI, *args, "--out-dir", out), tmp_path, "node1-again",
                       env=node_env(two_hosts, 1, port, MAX_RESTARTS=1))
        codes = finish([nodes[0], again])
    finally:
        for n in nodes:
            n.kill()
    assert codes == [0, 0], nodes[0].stderr + again.stderr
    assert "resumed from" in nodes[0].stdout
    assert_same_weights(torch.load(out / "model.pt", weights_only=True),
                        torch.load(tmp_path / "reference" / "model.pt", weights_only=True), exact=True)


# ---------------------------------------------------------------------------
# Performance machinery (speed itself is measured by bench_ddp_train.py, never asserted here)
# ---------------------------------------------------------------------------


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
    ctx = ddp_train.DistContext()
    fast = list(ddp_train.batches(train_set, indices, 32, ctx))
    slow = list(ddp_train.batches(Wrapped(train_set), indices, 32, ctx, workers=0))
    assert [len(b[0]) for b in fast] == [32, 32, 32, 4]
    assert all(torch.equal(a, b) for fa, sl in zip(fast, slow) for a, b in zip(fa, sl)) and len(fast) == len(slow)


def test_bf16_gradient_compression_is_opt_in_and_changes_numerics(tmp_path, reference):
    exact = reference(torchrun_cmd(2, *SMALL))
    bf16 = run(torchrun_cmd(2, *SMALL, "--grad-compression", "bf16"), tmp_path)
    one = reference(python_cmd(*SMALL, "--batch-size", 64))
    assert_same_weights(exact.weights, one.weights)  # the default stays exact
    with pytest.raises(AssertionError):
        assert_same_weights(bf16.weights, one.weights)
    # ... but it is the same training, to bf16 rounding of the gradients (8 bits of mantissa).
    for k, v in bf16.weights.items():
        assert (v - one.weights[k]).norm() <= 1e-2 * one.weights[k].norm(), k
    assert bf16.metrics[-1]["train_loss"] == pytest.approx(one.metrics[-1]["train_loss"], rel=1e-2)


def test_gpu_peak_table_picks_the_precision_in_use():
    assert ddp_train.gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert ddp_train.gpu_peak_tflops("NVIDIA H100 PCIe", "off") == 51.2
    assert ddp_train.gpu_peak_tflops("NVIDIA L4", "bf16") == 121.0 and ddp_train.gpu_peak_tflops("NVIDIA L40S", "off") == 91.6
    assert ddp_train.gpu_peak_tflops("Some Future GPU", "bf16") is None


def test_benchmark_quick_runs_and_prints_its_table(tmp_path):
    with Launch([PY, ROOT / "bench_ddp_train.py", "--quick"], tmp_path, "bench") as launch:
        assert launch.wait(300) == 0, launch.stderr
    out = launch.stdout
    for label in ("ddp_train.py, 1 process", "ddp_train.py, torchrun 2x1", "hand-written loop, 1 process",
                  "tutorial DDP, torchrun 2x1", "launch->first step", "peak RSS/process", "ratio (per round)"):
        assert label in out, out
    assert re.search(r"ddp_train.py, 1 process / hand-written loop, 1 process\s+[\d.]+x\s+>= 0.95", out), out


# ---------------------------------------------------------------------------
# GPU: skipped cleanly where there is no CUDA
# ---------------------------------------------------------------------------


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_local_rank_beyond_visible_gpus_is_one_clear_line(tmp_path):
    env = clean_env(RANK=0, WORLD_SIZE=1, LOCAL_RANK=torch.cuda.device_count(), MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    r = run(python_cmd(*SMALL), tmp_path, env=env, expect=2)
    assert "CUDA_VISIBLE_DEVICES" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("extra", [["--amp", "bf16"], ["--compile"], ["--amp", "fp16"]])
def test_gpu_single_process_precisions_and_compile(tmp_path, extra):
    r = run(python_cmd(*SMALL, "--epochs", "3", *extra), tmp_path)
    assert "cuda:0" in r.stdout and r.metrics[-1]["eval_accuracy"] > 0.5
    assert r.metrics[-1]["peak_gpu_mem_mb"] > 0
    if ddp_train.gpu_peak_tflops(torch.cuda.get_device_name(), "bf16"):
        assert 0 < r.metrics[-1]["mfu"] < 1 and "MFU" in r.stdout
    ddp_train.build_model(default_args()).load_state_dict(r.weights)


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus_match_single_gpu_global_batch(tmp_path):
    two = run(torchrun_cmd(2, *SMALL), tmp_path, out="two")
    assert "nccl" in two.stdout
    one = run(python_cmd(*SMALL, "--batch-size", 64), tmp_path, out="one")
    for k, v in two.weights.items():
        assert torch.allclose(v, one.weights[k], rtol=1e-3, atol=1e-4)  # TF32 and reduction order
