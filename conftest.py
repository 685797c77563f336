"""The harness of test_ddp_train.py: real processes, each launch in a session of its own with a hard
timeout that kills its process group, and a check that nothing it started is left behind; a user's
project (examples/digits.py, examples/tinylm.py, and user.py, which changes one thing of them); two hosts
made of network namespaces; a real SLURM cluster of two nodes."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent
SCRIPT = str(ROOT / "ddp_train.py")
RUN_MULTI = str(ROOT / "run_multi_node.sh")
PY = sys.executable
TIMEOUT = 150  # seconds for any one launch: a hang fails fast instead of eating CI
# A launch that times out gets SIGABRT first, so that Python prints every thread's stack
# (PYTHONFAULTHANDLER). No core file is written.
resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))

# ---------------------------------------------------------------------------
# The CPU load: process slots that every test process of a session shares through lock files
# ---------------------------------------------------------------------------

# The slots and the port counter live in a directory that the first pytest process of a session makes
# and that its xdist workers and the make check runs it starts inherit through this variable.
SLOTS_ENV = "DDP_TEST_SLOTS"
INSIDE_A_SUITE = (
    SLOTS_ENV in os.environ
)  # True in an xdist worker and in a make check that a test runs
ALL_SLOTS = 2 * (os.cpu_count() or 1)  # two busy processes per core at most
PEER_TIMEOUT = 60  # every launch's --timeout: a lost peer ends in the script's own line


def pytest_configure(config):
    if SLOTS_ENV not in os.environ:
        os.environ[SLOTS_ENV] = tempfile.mkdtemp(prefix="ddp-test-slots-")


class CpuSlots:
    """A counting semaphore of process slots, made of lock files, which the pytest-xdist workers
    and the make check runs that the tests start share. A launch takes one slot for each process
    that it starts. A lock file is freed by the kernel when its holder dies, so a crashed test never
    keeps a slot."""

    reserved = 0  # the slots that this process holds for a whole test (see reserve_slots)

    def __init__(self, count: int):
        directory = Path(os.environ[SLOTS_ENV])
        self.files = []
        if count == 0 or CpuSlots.reserved:
            return
        assert count <= ALL_SLOTS, f"{count} slots asked for; there are {ALL_SLOTS}"
        # One taker at a time holds the gate until it has all its slots, so a test that needs every
        # slot is not starved by small launches.
        with open(directory / "gate", "w") as gate:
            fcntl.flock(gate, fcntl.LOCK_EX)
            while len(self.files) < count:
                for i in range(ALL_SLOTS):
                    if len(self.files) == count:
                        break
                    f = open(directory / f"slot{i}", "w")
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        self.files.append(f)
                    except BlockingIOError:
                        f.close()
                if len(self.files) < count:
                    time.sleep(0.05)

    def release(self):
        for f in self.files:
            f.close()
        self.files = []


@contextlib.contextmanager
def reserve_slots(count=ALL_SLOTS):
    """Slots for the launches inside the block, taken at once: for a test whose launches run side by
    side (two of them could otherwise each hold half and wait for the rest), and all of them for a
    test whose processes time their peers (keep-alives, a restart that waits for a node)."""
    slots = CpuSlots(count)
    CpuSlots.reserved = count
    try:
        yield
    finally:
        CpuSlots.reserved = 0
        slots.release()


def free_port() -> int:
    """A port that no other test of the session takes and that the kernel never hands out to anyone
    (it lies below Linux's ephemeral range), so that it cannot be taken between now and its use."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    with open(Path(os.environ[SLOTS_ENV]) / "ports", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        port = int(f.read() or low - 10000)
        while not bindable(port):
            port += 1
        f.seek(0)
        f.truncate()
        f.write(str(port + 1))
    return port


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """Every launch sees no GPU (gloo on the CPU), a GPU machine's too, unless the test is marked gpu."""
    if not request.node.get_closest_marker("gpu"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def clean_env(**extra) -> dict:
    """This environment without any launcher's variables, plus `extra` (None: unset). One thread per
    process: two tests run at a time, and OpenMP threads spinning for a taken core slow a run 10x."""
    launcher = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "PET_")) and k not in launcher
    }
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.update(PYTHONFAULTHANDLER="1")  # a SIGABRT prints every thread's Python stack
    for k, v in extra.items():
        env.pop(k, None) if v is None else env.__setitem__(k, str(v))
    return env


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def marked(mark: str) -> list[int]:
    """The live processes whose DDP_TEST_LAUNCH holds mark: a launch and all it started. A launch
    inside a launch (make check in a test) adds its own mark to the one it inherits."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            for variable in (proc / "environ").read_bytes().split(b"\0"):
                name, _, marks = variable.decode(errors="replace").partition("=")
                if name == "DDP_TEST_LAUNCH" and mark in marks.split():
                    if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                        pids.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return pids


def processes(cmd) -> int:
    """The processes that a command of the script starts: N under torchrun or --spawn N, else 1."""
    cmd = [str(c) for c in cmd]
    for i, arg in enumerate(cmd):
        m = re.fullmatch(r"--nproc[-_]per[-_]node=(\d+)", arg)
        if m:
            return int(m.group(1))
        if arg == "--spawn":
            return int(cmd[i + 1])
    return 1


class Result:
    """What a run left: its exit code, output and out-dir (its records and final weights)."""

    def __init__(self, returncode, stdout, stderr, out_dir, seconds=None):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
        self.out_dir, self.seconds = out_dir, seconds  # seconds: from its start to its exit

    @property
    def metrics(self) -> list[dict]:
        text = (self.out_dir / "metrics.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]

    def records(self, kind) -> list[dict]:
        return [m for m in self.metrics if m["kind"] == kind]

    @property
    def weights(self) -> dict:
        return torch.load(self.out_dir / "model.pt", weights_only=True)

    def __repr__(self):
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


class Launch:
    """A command in a session of its own, its output in files. On leaving the `with`, everything it
    started is killed; wait() fails the test if the command hangs, or leaves a process behind. It
    holds a CPU slot for each process it starts (slots: that number, where the command does not
    show it), from its start until it is killed."""

    def __init__(self, cmd, log_dir: Path, name="run", env=None, cwd=None, slots=None):
        self.cmd, self.mark = [str(c) for c in cmd], uuid.uuid4().hex
        self.out, self.err = log_dir / f"{name}.out", log_dir / f"{name}.err"
        env = env or clean_env()
        marks = f"{env.get('DDP_TEST_LAUNCH', '')} {self.mark}".strip()
        self.slots = CpuSlots(processes(self.cmd) if slots is None else slots)
        self.started, self.seconds = time.monotonic(), None
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=err,
                env={**env, "DDP_TEST_LAUNCH": marks},
                cwd=cwd or ROOT,
                start_new_session=True,
            )

    stdout = property(lambda self: self.out.read_text())
    stderr = property(lambda self: self.err.read_text())

    def wait(self, timeout=TIMEOUT) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            self.fail_with_stacks(f"timed out after {timeout}s")
        self.seconds = time.monotonic() - self.started
        # a DataLoader worker may take a moment to follow its trainer
        deadline = time.monotonic() + 10
        while marked(self.mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = marked(self.mark)
        if left:
            self.kill()
            pytest.fail(
                f"{len(left)} process(es) left behind by {' '.join(self.cmd)}\n{self.stderr}"
            )
        return code

    def wait_for(self, predicate, what: str, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                pytest.fail(
                    f"exited ({self.proc.returncode}) before {what}\n{self.stdout}\n{self.stderr}"
                )
            if time.monotonic() > deadline:
                self.fail_with_stacks(f"no {what} within {timeout}s")
            time.sleep(0.01)

    def fail_with_stacks(self, why: str):
        """Fail the test with the stacks of every process of the launch, so that a hang says where
        it waits: SIGABRT makes each Python process print all its threads (PYTHONFAULTHANDLER)."""
        for pid in marked(self.mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        deadline = time.monotonic() + 5
        while marked(self.mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"{why}: {' '.join(self.cmd)}\n{self.stdout[-3000:]}\n{self.stderr[-12000:]}")

    def kill(self):
        for pid in marked(self.mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        self.slots.release()

    def result(self, out_dir: Path) -> Result:
        return Result(self.proc.returncode, self.stdout, self.stderr, out_dir, self.seconds)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def run(cmd, tmp_path: Path, out="out", expect=0, env=None, cwd=None, timeout=TIMEOUT) -> Result:
    """Launch `cmd` with --out-dir tmp_path/out, wait for it, check its exit code (None: any)."""
    with Launch([*cmd, "--out-dir", tmp_path / out], tmp_path, out, env=env, cwd=cwd) as launch:
        launch.wait(timeout)
    result = launch.result(tmp_path / out)
    assert expect is None or result.returncode == expect, result
    # the classic gloo abort at exit, of a process group torn down under a live DDP model
    assert "terminate called" not in result.stderr, result
    return result


def python_cmd(*args, script=SCRIPT):
    return [PY, script, "--timeout", PEER_TIMEOUT, *args]


def torchrun_cmd(nproc, *args, script=SCRIPT, launcher=()):
    endpoint = ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0"]
    return [
        PY,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        *endpoint,
        *launcher,
        script,
        "--timeout",
        PEER_TIMEOUT,
        *args,
    ]


def assert_same_weights(a: dict, b: dict, exact=False, rtol=1e-4):
    """Bit for bit, or each tensor within `rtol` of the other in relative norm."""
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{k} differs by up to {(a[k] - b[k]).abs().max():.3g}"
        else:
            gap = ((a[k] - b[k]).norm() / b[k].norm()).item()
            assert gap <= rtol, f"{k} differs by {gap:.3g} (relative norm)"


@contextlib.contextmanager
def shared(tmp_path_factory, name):
    """A directory of the session that the pytest-xdist workers share, held under a lock: the first to
    get it makes what it holds (and touches its "done"), the others find it made."""
    root = tmp_path_factory.getbasetemp()
    d = (root.parent if "PYTEST_XDIST_WORKER" in os.environ else root) / "shared" / name
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield d
        (d / "done").touch()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(cmd, **env): the Result of a run that several tests compare against, made once per
    session by whichever pytest-xdist worker asks first."""

    def get(cmd, **env):
        # A test that holds slots for its launches would wait here for a worker that waits for them.
        assert not CpuSlots.reserved, "take a reference before reserve_slots(), not inside it"
        key = hashlib.sha256(repr((cmd, sorted(env.items()))).encode()).hexdigest()[:12]
        with shared(tmp_path_factory, key) as d:
            if not (d / "done").exists():
                run(cmd, d, env=clean_env(**env))
        return Result(0, (d / "out.out").read_text(), (d / "out.err").read_text(), d / "out")

    return get


# ---------------------------------------------------------------------------
# A user's project: ddp_train.py beside examples/digits.py, examples/tinylm.py and user.py
# ---------------------------------------------------------------------------

# user.py: BASE (digits, tinylm; else the default task), with the changes VARIANT names (comma-separated),
# and STOP_SIGNAL sent by rank STOP_RANK to itself (STOP_TARGET=parent: to torchrun) in its STOP_AT-th
# training micro-batch, once per job (not in a restarted worker). The first run of an out-dir
# (RECORD.first does not exist yet) may also die in report() at step FAIL_STEP.
USER_PY = '''
import collections, contextlib, math, os, signal, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
import ddp_train

env = os.environ
if env.get("BASE"):
    base = __import__(env["BASE"])
    for name, value in [("TRAIN_SIZE", "LM_TRAIN"), ("EVAL_SIZE", "LM_EVAL"), ("DROPOUT", "LM_DROPOUT")]:
        if value in env:
            setattr(base, name, type(getattr(base, name))(env[value]))
variant, loss_of, calls = env.get("VARIANT", "").split(","), ddp_train.compute_loss, [0]


def compute_loss(model, batch):
    if model.training:
        calls[0] += 1
        if "indices" in variant:  # the samples this rank trains, in order
            with open(f"{env['RECORD']}.{env.get('RANK', 0)}", "a") as f:
                f.write(" ".join(map(str, batch.pop().tolist())) + "\\n")
        first = env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if calls[0] == int(env.get("STOP_AT", 0)) and env.get("RANK", "0") == env.get("STOP_RANK", "0") and first:
            target = os.getppid() if env.get("STOP_TARGET") == "parent" else os.getpid()
            os.kill(target, getattr(signal, env["STOP_SIGNAL"]))
        if "busy" in variant and calls[0] == int(env.get("STOP_AT", 0)) and env.get("RANK") == "0":
            time.sleep(5)  # rank 0 computes on while its peer dies
        if "maps" in variant and calls[0] == 1:  # the files that this rank maps, as it trains
            with open("/proc/self/maps") as maps, open(f"{env['RECORD']}.{env.get('RANK', 0)}", "w") as f:
                f.write(maps.read())
        if "waitjoin" in variant and env["WORLD_SIZE"] == "1":
            while not signalled:  # alone in its round: on until a node joins and torchrun stops it
                time.sleep(0.05)
    elif "indices" in variant:
        batch.pop()
    if isinstance(batch, Encoded):
        batch = (batch["inputs"], batch["targets"])
    if "evalafterstop" in variant and not model.training and stop_agreed:
        open(f"{env['RECORD']}.evaluated-after-the-stop", "a").close()
    loss, count, *metrics = loss_of(model, batch)
    nan_now = calls[0] >= int(env.get("NAN_AT", 10**9)) and env.get("RANK", "0") == "1"
    if "nan" in variant and nan_now:
        loss = loss * math.nan
    if "nangrad" in variant and nan_now and model.training:
        loss.register_hook(lambda grad: grad * math.nan)  # a finite loss, a NaN gradient
    if "trainmetric" in variant and model.training:
        return loss, count, {"twice": 2 * loss}
    if "reserved" in variant:
        return loss, count, {"loss": loss}
    if "shape" in variant:
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none"), count
    if "miscount" in variant:
        return loss, 2 * count
    return (loss, count, *metrics)


def build_optimizer(args, model):
    return torch.optim.SGD(model.parameters(), lr=args.lr)


def build_scheduler(args, optimizer, total_steps):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)


def report(record, args, model):
    with open(f"{env['RECORD']}.{env.get('RANK', 0)}", "a") as f:
        f.write(repr(record) + "\\n")
    first_run = not os.path.exists(f"{env['RECORD']}.first")
    if record["step"] == int(env.get("FAIL_STEP", -1)) and first_run:
        open(f"{env['RECORD']}.first", "w").close()
        if "killreport" in variant:  # killed between the step's checkpoint and its other records
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("report() failed")  # (failreport)
    if "weights" in variant:  # the model of each record, and the checkpoint's step then
        torch.save(model.state_dict(), f"{env['RECORD']}.{record['kind']}.{record['step']}.pt")
        path = f"{args.out_dir}/checkpoint.pt"
        saved = os.path.exists(path) and torch.load(path, weights_only=True)["progress"]["step"]
        with open(f"{env['RECORD']}.saved", "a") as f:
            f.write(f"{record['step']} {saved}\\n")


Batch = collections.namedtuple("Batch", "inputs targets")


class Encoded(collections.UserDict):
    """A batch as a tokenizer's BatchEncoding holds it: a dict with a .to() of its own."""

    def to(self, device, non_blocking=False):
        return Encoded({k: v.to(device, non_blocking=non_blocking) for k, v in self.items()})


def train_step_without_syncs(state, world, args, micro_batches, want_norm):
    """nosync: any wait for the GPU in a step that neither logs, evaluates nor saves is an error.
    Not checked: a token run's first step, and the steps before CHECK_FROM (DDP measures its own
    first 10 iterations with CUDA events, which waits for them)."""
    step = state.progress.step + 1
    checked = step >= int(env.get("CHECK_FROM", 1)) and state.progress.expected_count is not None
    torch.cuda.set_sync_debug_mode("error" if checked else "default")
    result = train_step_of_the_script(state, world, args, micro_batches, want_norm)
    periodic = [args.log_every, args.save_every, args.eval_every, state.plan.steps_per_epoch]
    if any(every and step % every == 0 for every in periodic) or step == state.plan.total_steps:
        torch.cuda.set_sync_debug_mode("default")
    return result


train_step_of_the_script = ddp_train.train_step
if "nosync" in variant:
    ddp_train.train_step = train_step_without_syncs


class Masked(torch.utils.data.Dataset):
    """The default task's samples; only every tenth (9, 19, ...) has a target, the rest -100."""

    def __init__(self, data):
        self.x, y = data.tensors
        self.y = torch.where(torch.arange(len(y)) % 10 == 9, y, -100)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def masked_loss(model, batch):
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets), (targets != -100).sum()


class Indexed(torch.utils.data.Dataset):
    """Each item of the base's Dataset, and its index."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return (*self.data[i], i)


stop_agreed, signalled = False, False


def note(agreement, signum, frame):  # (waitjoin: notes a stop signal)
    global signalled
    signalled = True
    note_of_the_script(agreement, signum, frame)


note_of_the_script = ddp_train.StopAgreement.note
if "waitjoin" in variant:
    ddp_train.StopAgreement.note = note


def collect(agreement):  # (evalafterstop: notes the step at which the ranks agree to stop)
    global stop_agreed
    collect_of_the_script(agreement)
    stop_agreed = stop_agreed or agreement.should_stop


collect_of_the_script = ddp_train.StopAgreement.collect
if "evalafterstop" in variant:
    ddp_train.StopAgreement.collect = collect


class Sometimes(nn.Module):
    """The default model, and a head that only every other step uses."""

    def __init__(self, model):
        super().__init__()
        self.model, self.head, self.calls = model, nn.Linear(ddp_train.CLASSES, ddp_train.CLASSES), 0

    def forward(self, x):
        self.calls += 1
        y = self.model(x)
        return self.head(y) if self.calls % 2 else y


build_datasets, build_model = ddp_train.build_datasets, ddp_train.build_model
collate_default = ddp_train.collate_fn
if "sgd" in variant:
    ddp_train.build_optimizer = build_optimizer
if "onecycle" in variant:
    ddp_train.build_scheduler = build_scheduler
if "report" in variant:
    ddp_train.report = report
if "masked" in variant:
    ddp_train.build_datasets = lambda args: [d and Masked(d) for d in build_datasets(args)]
    ddp_train.collate_fn, ddp_train.COUNT_UNIT, loss_of = torch.utils.data.default_collate, "tokens", masked_loss
if "indices" in variant:
    ddp_train.build_datasets = lambda args: [d and Indexed(d) for d in build_datasets(args)]
if "wide" in variant:
    ddp_train.build_model = lambda args: nn.Sequential(nn.Linear(ddp_train.FEATURES, 64), nn.Linear(64, 10))
if "unused" in variant:
    ddp_train.build_model = lambda args: Sometimes(build_model(args))
if "iterable" in variant:  # an IterableDataset: no __len__
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))
    ddp_train.build_datasets = lambda args: (Stream(), None)
if "namedtuple" in variant:  # batches as namedtuples
    ddp_train.collate_fn = lambda items: Batch(*collate_default(items))
if "encoded" in variant:  # batches as a tokenizer gives them
    ddp_train.collate_fn = lambda items: Encoded(zip(("inputs", "targets"), collate_default(items)))
if "tokens" in variant:  # the default task's count, an int, as tokens: a token run of ints
    ddp_train.COUNT_UNIT = "tokens"
if "frozen" in variant:  # the first BatchNorm kept in eval mode (fine-tuning): no statistics move
    def frozen_model(args):
        model = build_model(args)
        model[1].eval()
        return model
    ddp_train.build_model = frozen_model
ddp_train.compute_loss = compute_loss


def threads():
    """This process's threads, by id: their names."""
    names = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            names[tid] = open(f"/proc/self/task/{tid}/comm").read().strip()
    return names


def init_distributed(timeout_s):  # (threads: notes the threads there were before the group)
    threads_before.update(threads())
    return init_distributed_of_the_script(timeout_s)


threads_before, init_distributed_of_the_script = {}, ddp_train.init_distributed
if "threads" in variant:
    ddp_train.init_distributed = init_distributed

if __name__ == "__main__":
    exit_code = ddp_train.main()
    if threads_before:  # (threads, in a process of the group) its threads that outlive main()
        left = sorted(name for tid, name in threads().items() if tid not in threads_before)
        with open(f"{env['RECORD']}.{env.get('RANK', 0)}", "w") as f:
            f.write(" ".join(left))
    sys.exit(exit_code)
'''


@pytest.fixture(scope="session")
def project(tmp_path_factory) -> Path:
    """A user's project directory: a copy of ddp_train.py, the two examples and user.py."""
    with shared(tmp_path_factory, "project") as d:
        if not (d / "done").exists():
            for name in ("ddp_train.py", "examples/digits.py", "examples/tinylm.py"):
                shutil.copy(ROOT / name, d)
            (d / "user.py").write_text(USER_PY.lstrip())
    return d


# ---------------------------------------------------------------------------
# Two hosts: network namespaces with an address, hostname and /etc/hosts of their own
# ---------------------------------------------------------------------------


def sh(*argv):
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


class Host:
    def __init__(self, ns, addr, ifname, hostname):
        self.ns, self.addr, self.ifname, self.hostname = ns, addr, ifname, hostname

    def command(self, *argv):
        # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts; unshare gives a hostname of its own
        unshare = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname]
        return ["ip", "netns", "exec", self.ns, *unshare, *map(str, argv)]


@pytest.fixture(scope="module")
def two_hosts():
    """Two hosts joined by a veth pair, deleted afterwards; skips where namespaces cannot be made."""
    if os.geteuid() != 0 or not all(map(shutil.which, ("ip", "unshare"))):
        pytest.skip("two hosts need root, iproute2 and unshare (network and UTS namespaces)")
    tag, subnet = f"{os.getpid() % 100000}", f"10.231.{random.randrange(1, 255)}"
    hosts = [
        Host(f"ddp{tag}n{i}", f"{subnet}.{i + 1}", f"vd{tag}n{i}", f"node{i}") for i in range(2)
    ]
    try:
        for h in hosts:
            sh("ip", "netns", "add", h.ns)
            os.makedirs(f"/etc/netns/{h.ns}", exist_ok=True)
            names = "".join(f"{x.addr} {x.hostname}\n" for x in hosts)
            Path(f"/etc/netns/{h.ns}/hosts").write_text(f"127.0.0.1 localhost\n{names}")
        sh("ip", "link", "add", hosts[0].ifname, "type", "veth", "peer", "name", hosts[1].ifname)
        for h in hosts:
            sh("ip", "link", "set", h.ifname, "netns", h.ns)
            sh("ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            sh("ip", "-n", h.ns, "link", "set", h.ifname, "up")
            sh("ip", "-n", h.ns, "link", "set", "lo", "up")
        yield hosts
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create network namespaces here: {getattr(exc, 'stderr', None) or exc}")
    finally:
        for h in hosts:
            pids = subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{h.ns}", ignore_errors=True)


# ---------------------------------------------------------------------------
# A real SLURM cluster (Debian's slurmctld and slurmd, auth/none) of two nodes, node0 (10.232.0.1) and
# node1 (10.232.0.2), each in a network namespace of its own, joined by a veth pair; slurmctld and the
# client commands run on node0. Started once per session, in /tmp/slurm-fixture/<pid>; a test's jobs are
# cancelled after it, and a process of its still running then fails it. As root:
#     apt-get install -y --no-install-recommends slurmctld slurmd slurm-client
# ---------------------------------------------------------------------------

SLURM_CONF = """\
ClusterName=fixture
FirstJobId={first_job}
SlurmctldHost=node0(10.232.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
PlugStackConfig={root}/plugstack.conf
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ReturnToService=2
MinJobAge=300
KillWait=5
InactiveLimit=0
JobRequeue=1
SchedulerParameters=sched_interval=1
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
NodeName=node0 NodeAddr=10.232.0.1 CPUs=2
NodeName=node1 NodeAddr=10.232.0.2 CPUs=2
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}


class SlurmCluster:
    """slurmctld and two slurmd, children of this process, each node in a network namespace."""

    def __init__(self):
        self.root = Path(tempfile.gettempdir()) / "slurm-fixture" / str(os.getpid())
        self.namespaces = [f"slurmfx{os.getpid()}n{i}" for i in range(2)]
        # jobs inherit this (sbatch exports the submitter's environment): this Python first on PATH
        path = f"{os.path.dirname(PY)}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        self.env = {**clean_env(), "PATH": path, "SLURM_CONF": str(self.root / "slurm.conf")}
        self.daemons = []

    def cmd(self, argv, node=0):
        """argv on a node: in its network namespace, with its hostname and an /etc/hosts of both."""
        mount = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
        ns = f"--net=/run/netns/{self.namespaces[node]}"
        inside = [
            "unshare",
            "--uts",
            "--mount",
            "sh",
            "-c",
            mount,
            "sh",
            self.root / "hosts",
            f"node{node}",
        ]
        return ["nsenter", ns, *inside, *map(str, argv)]

    def run(self, argv, timeout=30, check=True, **kw):
        r = subprocess.run(
            self.cmd(argv), env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )
        assert not check or r.returncode == 0, f"{argv} exited {r.returncode}: {r.stdout}{r.stderr}"
        return r

    def sbatch(self, script, *options, output):
        path = output.with_suffix(".sh")
        path.write_text(f"#!/bin/bash\n{script}")
        argv = ["sbatch", "--parsable", f"--chdir={ROOT}", f"--output={output}", *options, path]
        return self.run(argv).stdout.strip().split(";")[0]

    def job(self, job_id) -> dict:
        """`scontrol show job` as a dict: JobState, ExitCode ("code:signal"), Restarts..."""
        r = self.run(["scontrol", "show", "job", "-o", job_id], check=False)
        return (
            dict(re.findall(r"(\S+?)=(.*?)(?= \S+?=|$)", r.stdout.strip()))
            if r.returncode == 0
            else {}
        )

    def wait(self, job_id, timeout=120) -> dict:
        deadline = time.monotonic() + timeout
        while (info := self.job(job_id)).get("JobState") not in FINAL:
            assert time.monotonic() < deadline, f"job {job_id} not done after {timeout} s: {info}"
            time.sleep(0.2)
        return info

    def start(self):
        shutil.rmtree(self.root, ignore_errors=True)
        for d in ("state", "log", "spool/node0", "spool/node1"):
            (self.root / d).mkdir(parents=True)
        (self.root / "plugstack.conf").write_text("")
        (self.root / "hosts").write_text(
            "127.0.0.1 localhost\n10.232.0.1 node0\n10.232.0.2 node1\n"
        )
        ports = dict(
            ctld_port=free_port(), slurmd_port=free_port(), first_job=random.randrange(10**6)
        )
        (self.root / "slurm.conf").write_text(SLURM_CONF.format(root=self.root, **ports))
        veths = [f"vf{os.getpid()}n{i}" for i in range(2)]
        for ns in self.namespaces:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for i, (ns, veth) in enumerate(zip(self.namespaces, veths)):
            sh("ip", "link", "set", veth, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"10.232.0.{i + 1}/24", "dev", veth)
            sh("ip", "-n", ns, "link", "set", veth, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        for node, argv in (
            (0, ["slurmctld", "-D"]),
            (0, ["slurmd", "-D", "-N", "node0"]),
            (1, ["slurmd", "-D", "-N", "node1"]),
        ):
            log = open(self.root / "log" / f"{argv[0]}-{node}.out", "w")
            self.daemons.append(
                subprocess.Popen(self.cmd(argv, node), env=self.env, stdout=log, stderr=log)
            )
        deadline = time.monotonic() + 30
        while (
            self.run(["sinfo", "-h", "-N", "-o", "%t"], check=False).stdout.split() != ["idle"] * 2
        ):
            if time.monotonic() > deadline or any(d.poll() is not None for d in self.daemons):
                logs = "".join(p.read_text() for p in (self.root / "log").iterdir())
                raise RuntimeError(f"Slurm did not start:\n{logs[-3000:]}")
            time.sleep(0.1)
        return self

    def processes(self) -> list[int]:
        """Everything running in the cluster's namespaces but its daemons."""
        pids = []
        for ns in self.namespaces:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            pids += [int(p) for p in r.stdout.split()]
        daemons = {d.pid for d in self.daemons}
        return [p for p in pids if p not in daemons and not self._child_of_daemon(p, daemons)]

    @staticmethod
    def _child_of_daemon(pid, daemons):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return int(stat[1]) in daemons or stat[0] == "Z"
        return True

    def reset(self) -> list[int]:
        """Cancel every job; return the processes still running 10 s later (killed)."""
        jobs = self.run(["squeue", "-h", "-o", "%A"], check=False).stdout.split()
        if jobs:
            self.run(["scancel", *jobs], check=False)
        deadline = time.monotonic() + 10
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = self.processes()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left

    def stop(self):
        for d in self.daemons:
            d.terminate()
        for d in self.daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                d.wait(5)
            d.kill()
        for ns in self.namespaces:  # (takes its end of the veth pair along)
            for pid in subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True
            ).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="session")
def slurm_session():
    missing = [
        t for t in ("slurmctld", "slurmd", "sbatch", "srun", "nsenter", "ip") if not shutil.which(t)
    ]
    if os.geteuid() != 0 or missing:
        pytest.skip(f"a SLURM cluster needs root and {' '.join(missing) or 'Slurm'}")
    cluster = SlurmCluster()
    # SIGTERM (a CI cancel) would end Python at once: as Ctrl-C, it runs the teardown.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def slurm_cluster(slurm_session):
    yield slurm_session
    left = slurm_session.reset()
    assert not left, f"processes left running after the test (killed): {left}"


# ---------------------------------------------------------------------------
# The README's code blocks, as a newcomer runs them
# ---------------------------------------------------------------------------


def readme_blocks(path=ROOT / "README.md") -> list[tuple[str, str, str | None]]:
    """The README's fenced bash and python blocks in order: (language, text, why it is not run or None).
    A block is not run where the line before it says `<!-- not run by the tests: WHY -->`."""
    blocks, why, lines = [], None, path.read_text().splitlines()
    i = 0
    while i < len(lines):
        marker = re.fullmatch(r"<!-- not run by the tests: (.*) -->", lines[i])
        if marker:
            why = marker.group(1)
        elif lines[i] in ("```bash", "```python"):
            end = lines.index("```", i + 1)
            blocks.append((lines[i][3:], "\n".join(lines[i + 1 : end]), why))
            why, i = None, end
        i += 1
    return blocks


def fresh_checkout(repo: Path) -> Path:
    """This project's tracked files in `repo`, with a .venv made (this Python, as `make setup` would
    leave it where the Python it is made from has torch)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    for name in tracked.split():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)
    (repo / ".venv/bin").mkdir(parents=True)
    (repo / ".venv/bin/python").write_text(f'#!/bin/sh\nexec {PY} "$@"\n')
    (repo / ".venv/bin/python").chmod(0o755)
    (repo / ".venv/.ready").touch()
    return repo


# ---------------------------------------------------------------------------
# Check your copy (make check): the guarantees, on a user's own script, in real processes. The
# wrapper runs as their script, with the check's pieces installed around its task functions; the
# launches that several checks compare are made once, two at a time.
# ---------------------------------------------------------------------------

GUARANTEES = {
    1: "every launch mode trains; only rank 0 writes",
    2: "N x B trains the weights of 1 x N*B",
    3: "the logged loss is the mean over the items",
    4: "every rank sees the same data",
    5: "a stop resumes exactly",
    6: "evaluation counts each item once, on any world size",
    7: "model.pt loads into build_model()",
    8: "each rank reads its own share, in a new order each epoch",
}
TOLERANCE = 1e-5  # relative: float32 sums in another order
CHECK_SETS = (  # the check's own flags: the user's ARGS do not move them (their --batch-size is B)
    "--batch-size", "--grad-accum", "--epochs", "--max-steps", "--out-dir", "--spawn",
    "--log-every", "--eval-only",
)  # fmt: skip


@dataclasses.dataclass
class Planned:
    """A launch of the user's script (through the wrapper), 2 epochs of at most 4 global batches."""

    mode: str  # python, torchrun (2 processes) or spawn (--spawn 2)
    batch: int  # --batch-size, in B: every launch's global batch is 2B
    grad_accum: int
    out_dir: str  # its own, or the one whose checkpoint it reads
    env: dict  # what the wrapper installs (CHECK_*)
    eval_only: bool = False
    after: tuple = ()  # the launches whose files it reads, done before it starts


# In the order they start, two at a time. SGD=k: plain SGD at k x --lr in place of the user's
# optimizer (an adaptive one trains a summed loss almost like a mean); grad_x2: check 2's negative
# control.
LAUNCHES = {
    "python": Planned("python", 2, 1, "python", dict(CHECK_SGD=1, CHECK_DESCRIBE=1)),
    "torchrun": Planned("torchrun", 1, 1, "torchrun", dict(CHECK_DESCRIBE=1, CHECK_INITIAL=1)),
    # SIGTERM in step 2, when every rank is in the loop (step 1's all-reduce waited for them)
    "stopped": Planned("torchrun", 1, 1, "stopped", dict(CHECK_STOP_AT=2)),
    "spawn": Planned("spawn", 1, 1, "spawn", dict(CHECK_SGD=1)),
    "accum": Planned("python", 1, 2, "accum", dict(CHECK_SGD=1)),
    "grad_x2": Planned("python", 2, 1, "grad_x2", dict(CHECK_SGD=2)),
    "eval_1": Planned("python", 2, 1, "python", {}, eval_only=True, after=("python",)),
    "resumed": Planned("torchrun", 1, 1, "stopped", {}, after=("stopped",)),  # the same command
    "eval_2": Planned("torchrun", 1, 1, "python", {}, eval_only=True, after=("python",)),
    # one process that computes the figures alone: from torchrun's first step, python's weights
    "probe": Planned("python", 2, 1, "python", {}, after=("python", "torchrun")),
}
NEEDS = {  # the launches each check reads
    1: ("python", "torchrun", "spawn"),
    2: ("python", "spawn", "accum", "grad_x2", "probe"),
    3: ("python", "torchrun", "probe"),
    4: ("python", "torchrun"),
    5: ("python", "torchrun", "stopped", "resumed"),  # (python: to tell if the data differ)
    6: ("python", "eval_1", "eval_2"),
    7: ("probe",),
    8: ("torchrun",),
}


@dataclasses.dataclass
class Verdict:
    number: int
    status: str  # pass, FAIL, or n/a (the model differs by design, or the check cannot tell)
    figure: str
    cause: str = ""

    def __str__(self):
        line = f"{self.status:<4}  {self.number}. {GUARANTEES[self.number]}: {self.figure}"
        return f"{line}. Likely cause: {self.cause}" if self.cause else line


def user_flags(args: list[str]) -> tuple[list[str], int]:
    """The user's ARGS without the flags the check sets, and their --batch-size (4 where none)."""
    kept, batch, i = [], 4, 0
    while i < len(args):
        name, has_value, value = args[i].partition("=")
        if name not in CHECK_SETS:
            kept.append(args[i])
        elif name != "--eval-only" and not has_value:  # (its value is the next argument)
            i += 1
            value = args[i] if i < len(args) else ""
        if name == "--batch-size":
            batch = int(value)
        i += 1
    return kept, batch


class CopyCheck:
    """A user's script under check: its launches, and what each left in its records directory
    (run.out and run.err; the wrapper's reads.RANK, data.RANK, writes.RANK, records.jsonl...)."""

    def __init__(self, script, args: list[str], work: Path):
        self.script, self.work = Path(script).resolve(), work
        self.flags, self.b = user_flags(args)
        workers = re.findall(r"--workers[= ](\d+)", " ".join(args))  # (the last one counts)
        self.workers = int(workers[-1]) if workers else 0
        self.g = 2 * self.b  # every launch's global batch: 2 x B, 1 x 2B, 1 x B x 2
        self.train_items, self.eval_items = 4 * self.g, self.g + 1  # (an uneven eval share)
        self.wrapper = work / "wrapper" / self.script.name  # the script's name, in its lines
        self.wrapper.parent.mkdir(parents=True, exist_ok=True)
        self.wrapper.write_text(CHECK_WRAPPER)
        self.results, self.seconds, self.failed = {}, {}, {}

    def records(self, name) -> Path:
        return self.work / "records" / name

    def command(self, planned: Planned) -> list:
        flags = ["--workers", 0, *self.flags, "--epochs", 2, "--log-every", 1]
        flags += ["--batch-size", planned.batch * self.b, "--grad-accum", planned.grad_accum]
        flags += ["--eval-only"] * planned.eval_only + ["--out-dir", self.work / planned.out_dir]
        if planned.mode == "torchrun":
            return torchrun_cmd(2, *flags, script=self.wrapper)
        spawn = ["--spawn", 2] if planned.mode == "spawn" else []
        return python_cmd(*spawn, *flags, script=self.wrapper)

    def launch(self, name) -> Result:
        planned, records = LAUNCHES[name], self.records(name)
        records.mkdir(parents=True)
        env = dict(CHECK_SCRIPT=self.script, CHECK_RECORDS=records, **planned.env)
        env.update(CHECK_TRAIN_ITEMS=self.train_items, CHECK_EVAL_ITEMS=self.eval_items)
        if name == "probe":
            (records / "inputs.json").write_text(json.dumps(self.probe_inputs()))
            env["CHECK_PROBE"] = records / "inputs.json"
        started = time.monotonic()
        env = clean_env(PYTHONDONTWRITEBYTECODE=1, **env)
        with Launch(self.command(planned), records, "run", env=env, cwd=self.work) as running:
            running.wait()
        self.seconds[name] = time.monotonic() - started
        return running.result(self.work / planned.out_dir)

    def run_launches(self, names: set):
        """The launches named, each after those it reads: two at a time, or one at a time inside
        the test suite, which runs two tests at a time. One that times out, leaves a process behind
        or cannot start (a launch it reads failed) is in self.failed."""
        order = [name for name in LAUNCHES if name in names]
        done = {name: threading.Event() for name in order}

        def one(name):
            try:
                for before in LAUNCHES[name].after:
                    done[before].wait()
                missing = [b for b in LAUNCHES[name].after if b not in self.results]
                if missing:
                    self.failed[name] = f"it needs {' and '.join(missing)}, which failed"
                else:
                    self.results[name] = self.launch(name)
            except (Exception, pytest.fail.Exception) as exc:  # (Launch.wait fails the test)
                self.failed[name] = one_line(str(exc))
            finally:
                done[name].set()

        threads, at_a_time = [], 1 if INSIDE_A_SUITE else 2
        for name in order:  # (those it reads are in `order` before it: started already)
            while sum(t.is_alive() for t in threads) >= at_a_time:
                time.sleep(0.05)
            threads.append(threading.Thread(target=one, args=(name,)))
            threads[-1].start()
        for t in threads:
            t.join()

    def launch_problem(self, names) -> str:
        """Why one of these launches did not run to its end, or ''."""
        for name in names:
            if name in self.failed:
                return f"the {name} launch: {self.failed[name]}"
            result = self.results[name]
            if result.returncode != 0 and name != "stopped":
                return f"the {name} launch exited {result.returncode}: {script_said(result)}"
        return ""

    # ---- what the launches left ----

    def lines(self, name, file) -> list[str]:
        path = self.records(name) / file
        return path.read_text().splitlines() if path.exists() else []

    def batches(self, name, rank, tag="train") -> list[list[int]]:
        """The batches (their indices) that a rank of a launch trained, or evaluated, in order."""
        taken = [line.split() for line in self.lines(name, f"reads.{rank}")]
        return [[int(i) for i in batch[1:]] for batch in taken if batch[0] == tag]

    def data(self, name, rank) -> dict:
        """What build_datasets gave a rank: each set's length, and hashes of 8 of its items."""
        return json.loads(self.lines(name, f"data.{rank}")[0])

    def probe_inputs(self) -> dict:
        if not self.batches("torchrun", 0):
            raise RuntimeError(
                "the wrapper saw no training batch: it follows a loop that makes its DataLoader "
                "as DataLoader(...), the name the script imports"
            )
        return {
            "initial": str(self.records("torchrun") / "initial.pt"),  # rank 0's, which DDP sends
            "first_step": [self.batches("torchrun", rank)[0] for rank in range(2)],
            "final": str(self.work / "python/model.pt"),
        }

    def eval_set_size(self):
        """The eval set's length, as build_datasets gave it (python's launch); None: unknown."""
        if not self.lines("python", "data.0"):
            return None
        described = self.data("python", 0)["eval"]
        return described["len"] if described else 0

    def probe(self) -> dict:
        return json.loads(self.lines("probe", "probe.json")[0])


def script_said(result) -> str:
    """The line the script stopped with (`NAME: error: ...`), or the last line of its stderr."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    said = [line for line in lines if ": error: " in line]
    return one_line((said or lines or ["nothing on stderr"])[-1])


def one_line(text) -> str:
    return " ".join(str(text).split())[:400]


def weights_gap(a: dict, b: dict) -> float:
    """The largest relative difference of a tensor, as assert_same_weights measures it."""
    gaps = [0.0]
    for k in b:
        x, y = a[k].double(), b[k].double()
        gaps.append(((x - y).norm() / y.norm()).item() if y.norm() else (x - y).norm().item())
    return max(gaps)


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


# ---- the eight checks: each reads the launches it NEEDS (which ran to their end) ----


def check_launch_modes(c: CopyCheck) -> Verdict:
    seconds = ", ".join(f"{name} {c.seconds[name]:.1f} s" for name in NEEDS[1])
    written = []  # by rank 1; not torch's caches, nor its probes of the temporary directory
    caches = (tempfile.gettempdir(), os.path.expanduser("~/.cache"))
    for name in ("torchrun", "spawn"):
        for line in c.lines(name, "writes.1"):
            path = json.loads(line)[1]
            if path.startswith(str(c.work)) or not path.startswith(caches):
                written.append(path)
    figure = f"exit 0 each ({seconds}); rank 1 wrote {len(set(written)) or 'nothing'}"
    figure += " files" if written else ""
    if written:
        return Verdict(
            1, "FAIL", f"{figure}: {written[0]}",
            "every rank runs every line: write files from rank 0 only (if ctx.rank == 0), as the "
            "script writes its checkpoints and records",
        )  # fmt: skip
    return Verdict(1, "pass", figure)


def by_design(p: dict, random_reads: bool) -> str:
    """Why N x B and 1 x N*B differ for this model and data by design, or ''."""
    why = []
    batch_norms = [m for m in p["modules"] if "BatchNorm" in m]
    if batch_norms:
        why.append(
            f"your model has {batch_norms[0]}: its statistics are per process's batch, so N x B "
            "and 1 x N*B differ by design (--sync-bn on GPUs)"
        )
    elif p["stateful"] or (p["batch_dependent"] and not p["random_in_training"]):
        what = "output for an item depends on the rest of its batch"
        if p["stateful"]:
            what = f"{p['stateful'][0]} keeps state that training moves"
        why.append(f"in training, your model's {what}: per process, by design")
    if p["random_in_training"]:
        names = [m for m in p["modules"] if "Dropout" in m] or ["random draws in training"]
        why.append(f"it has {names[0]}: each process draws its own random numbers")
    if random_reads:
        why.append("your Dataset draws random numbers as it reads: each process its own")
    return "; ".join(why)


def loss_mixes_items(p: dict) -> bool:
    """In evaluation, a batch's loss is not the count-weighted mean of its items' (a sum, or a
    mean of means)."""
    return relative(p["batch_over_items"], 1.0) > TOLERANCE


def check_equivalence(c: CopyCheck) -> Verdict:
    one_process = c.results["python"].weights
    gap = {name: weights_gap(c.results[name].weights, one_process) for name in ("spawn", "accum")}
    control = weights_gap(c.results["grad_x2"].weights, one_process)  # (the same, at 2 x --lr)
    figure = (
        f"2 x {c.b} and 1 x {c.g} differ by {gap['spawn']:.1e}, 1 x {c.b} x 2 accumulated by "
        f"{gap['accum']:.1e} (relative, of the weights; tolerance {TOLERANCE:g}; at twice the "
        f"learning rate, as a loss summed over 2 ranks trains: {control:.1e}, which must exceed "
        f"{100 * TOLERANCE:g} to tell; plain SGD, installed by the check)"
    )
    p = c.probe()
    design = by_design(p, c.data("python", 0)["train"]["random_reads"])
    if design and not loss_mixes_items(p):  # (a loss that mixes items does so by no design)
        return Verdict(2, "n/a", f"{figure}: {design}")
    if control < 100 * TOLERANCE:
        return Verdict(2, "n/a", f"{figure}: the weights move too little to tell: raise --lr")
    if max(gap["spawn"], gap["accum"]) <= TOLERANCE:
        return Verdict(2, "pass", figure)
    if p["loss_2b_over_b"] > 1.5:
        cause = "compute_loss returns a sum, which grows with the batch (see 3)"
    elif loss_mixes_items(p):
        cause = "compute_loss's loss is not the mean over its count items (see 3)"
    elif gap["accum"] <= TOLERANCE:
        cause = "the processes train on different data (see 4), or their gradients are not averaged"
    else:
        cause = "the loss is not the mean over its count items (see 3)"
    return Verdict(2, "FAIL", figure, cause)


def check_mean(c: CopyCheck) -> Verdict:
    p, figures, causes = c.probe(), [], []
    ratio, per_item = p["loss_2b_over_b"], p["batch_over_items"]
    figures.append(
        f"in evaluation, a batch's loss / the count-weighted mean of its items' = {per_item:.4f} "
        f"(a mean: 1); {c.g} items' / their two halves' = {ratio:.3f} (a sum: 2)"
    )
    if ratio > 1.5:
        causes.append(
            "compute_loss returns a sum, which grows with the batch: return the mean over its "
            "count items (F.cross_entropy's default reduction)"
        )
    elif loss_mixes_items(p):
        causes.append(
            "compute_loss weighs a batch's items otherwise than by their count (a mean of "
            "per-sample means?): return the mean over all the items its count counts"
        )
    if p["random_in_training"] or c.data("torchrun", 0)["train"]["random_reads"]:
        what = "training" if p["random_in_training"] else "the Dataset, as it reads,"
        figures.append(f"step 1 not recomputed: {what} draws random numbers")
    elif check_same_data(c).status == "FAIL":
        figures.append("step 1 not recomputed: the ranks' data differ (see 4)")
    else:
        logged, alone = c.results["torchrun"].records("progress")[0]["train_loss"], p["step_1"]
        how = "micro-batch by micro-batch" if p["batch_dependent"] else "item by item"
        gap = relative(logged, alone)
        figures.append(
            f"step 1: logged {logged:.7g}, {how} in {p['precision']} {alone:.7g} (relative gap "
            f"{gap:.1e})"
        )
        if gap > TOLERANCE:
            causes.append(
                "the loss is not the mean over the items its count counts (padding in the mean? "
                "a count of other items?)"
            )
    evals = [record for record in c.results["python"].metrics if "eval_loss" in record]
    if evals and p["eval_loss"] is not None:
        logged, alone = evals[-1]["eval_loss"], p["eval_loss"]
        gap = relative(logged, alone)
        figures.append(f"eval: logged {logged:.7g}, item by item {alone:.7g} ({gap:.1e})")
        if gap > TOLERANCE:
            causes.append("the eval loss is not the mean over the items its count counts")
    counts, unit = set(p["item_counts"]), p["count_unit"]
    if unit == "samples" and counts != {1.0}:
        causes.append(f"an item alone counts {max(counts):g}, but COUNT_UNIT is samples")
    if unit != "samples" and counts == {1.0}:
        causes.append(f"every item counts 1, a sample, but COUNT_UNIT is {unit}: count the {unit}")
    return Verdict(3, "FAIL" if causes else "pass", "; ".join(figures), (causes or [""])[0])


def check_same_data(c: CopyCheck) -> Verdict:
    # ranks 0 and 1 of one launch, and rank 0 of another: a generator nobody seeds differs there
    rank_0, rank_1, other = c.data("torchrun", 0), c.data("torchrun", 1), c.data("python", 0)
    verdicts = [
        same_set(part, rank_0[part], rank_1[part], other[part]) for part in ("train", "eval")
    ]
    verdicts = [v for v in verdicts if v]
    for status in ("FAIL", "n/a"):  # the worst of the two sets'
        if any(v.status == status for v in verdicts):
            return next(v for v in verdicts if v.status == status)
    return Verdict(4, "pass", "; ".join(v.figure for v in verdicts))


def same_set(part, rank_0, rank_1, other):
    """Check 4 for one of the sets (None where build_datasets gives none)."""
    if not rank_0 or not rank_0["len"]:
        return None
    size = rank_0["len"]
    if not size == rank_1["len"] == other["len"]:
        return Verdict(
            4, "FAIL", f"the {part} set has {size} items on rank 0, {rank_1['len']} on rank 1, "
            f"{other['len']} in another launch",
            "build_datasets depends on the rank, or on a generator it does not seed",
        )  # fmt: skip
    n = len(rank_0["digests"])
    across_ranks = sum(map(str.__eq__, rank_0["digests"], rank_1["digests"]))
    across_runs = sum(map(str.__eq__, rank_0["digests"], other["digests"]))
    figure = (
        f"build_datasets' {part} set: {size} items on each rank; of 8 spread over it, {across_ranks}"
        f" of {n} the same on ranks 0 and 1, {across_runs} of {n} in another launch"
    )
    if rank_0["random_reads"] and min(across_ranks, across_runs) < n:
        return Verdict(
            4, "n/a", f"{figure}: its items are random as read, from generators the check cannot "
            "set; the lengths agree",
        )  # fmt: skip
    if across_runs < n:
        return Verdict(
            4, "FAIL", figure, "build_datasets draws from a generator it does not seed, so each "
            "process builds another set: seed it from args.seed, or draw from torch's global "
            "generator (the script seeds it first)",
        )  # fmt: skip
    if across_ranks < n:
        return Verdict(
            4, "FAIL", figure, "build_datasets depends on the rank (RANK, LOCAL_RANK, "
            "dist.get_rank(), or random numbers drawn at a first read, after the script seeds each "
            "rank its own): every rank builds the whole set, and DistributedSampler gives each its "
            "share",
        )  # fmt: skip
    return Verdict(4, "pass", figure)


def check_resume(c: CopyCheck) -> Verdict:
    stopped, resumed = c.results["stopped"], c.results["resumed"]
    m = re.search(r"stopped by a signal at step (\d+)", stopped.stdout)
    if not m or "exit 75" not in stopped.stdout or f"at step {m[1]}," not in resumed.stdout:
        return Verdict(
            5, "FAIL", f"the stopped launch exited {stopped.returncode}: {script_said(stopped)}",
            "the loop's stop agreement, or its resume, was changed",
        )  # fmt: skip
    whole = c.results["torchrun"].weights
    differ = [k for k in whole if not torch.equal(whole[k], resumed.weights[k])]
    figure = (
        f"SIGTERM to torchrun in step 2: every rank stopped after step {m[1]} and saved (the "
        f"script's exit 75, torchrun's {stopped.returncode}); the rerun resumed there: {len(differ)} of "
        f"{len(whole)} tensors differ from the uninterrupted run's"
    )
    if not differ:
        return Verdict(5, "pass", f"{figure} (bit-identical)")
    same_batches = all(
        c.batches("stopped", r) + c.batches("resumed", r) == c.batches("torchrun", r)
        for r in range(2)
    )
    if not same_batches:
        return Verdict(
            5, "FAIL", f"{figure}; the two runs trained other batches",
            "the sampler, or the loop's skipping of the steps an epoch trained, was changed",
        )  # fmt: skip
    if check_same_data(c).status == "FAIL":
        return Verdict(5, "FAIL", figure, "the data differ from process to process (see 4)")
    if c.workers and c.data("torchrun", 0)["train"]["random_reads"]:
        return Verdict(
            5, "pass", f"{figure}: the same batches in the same order; not bit-identical, as the "
            "Dataset draws random numbers in DataLoader workers, which start afresh at a resume",
        )  # fmt: skip
    return Verdict(
        5, "FAIL", f"{figure}; the same batches in the same order",
        "random numbers drawn from a generator the checkpoint does not hold (a torch.Generator, "
        "random.Random or np.random.default_rng of your own): draw from torch's, random's or "
        "numpy's global generators, which the script seeds per rank and checkpoints",
    )  # fmt: skip


def check_eval(c: CopyCheck) -> Verdict:
    one, two = (json.loads(c.lines(name, "records.jsonl")[-1]) for name in ("eval_1", "eval_2"))
    gaps = {name: relative(two[name], value) for name, value in one.items() if "eval_" in name}
    worst = max(gaps, key=gaps.get)
    items = list(range(one["eval_samples"]))
    once = [
        sorted(i for rank in range(world) for b in c.batches(name, rank, "eval") for i in b)
        == items
        for name, world in (("eval_1", 1), ("eval_2", 2))
    ]
    figure = (
        f"on 1 and 2 processes eval_loss {one['eval_loss']:.7g} and {two['eval_loss']:.7g}, every "
        f"figure within {gaps[worst]:.1e} ({worst}); each of the {len(items)} items evaluated "
        f"once: {'yes' if once[0] else 'no'} and {'yes' if once[1] else 'no'}"
    )
    if gaps[worst] <= TOLERANCE and all(once):
        return Verdict(6, "pass", figure)
    return Verdict(
        6, "FAIL", figure, "a loss that is not the mean over its count (see 3); else the eval "
        "loader's sampler, or the sums over the ranks, were changed: rank r evaluates items r, "
        "r + world size..., and the ranks' sums (not means) are added",
    )  # fmt: skip


def check_model_file(c: CopyCheck) -> Verdict:
    error = c.probe()["load_error"]
    if error is None:
        return Verdict(7, "pass", "build_model(args).load_state_dict(torch.load(...)) loads it all")
    prefix = next((p for p in ("module.", "_orig_mod.") if p in error), None)
    cause = "the saved state_dict is not build_model()'s"
    if prefix:
        cause = f"its keys start with {prefix!r}: save the raw module's, not DDP's or compile's"
    return Verdict(7, "FAIL", f"load_state_dict: {error}", cause)


def check_shares(c: CopyCheck) -> Verdict:
    steps = min(c.data("torchrun", 0)["train"]["len"], c.train_items) // c.g
    share = steps * c.b  # a rank's items in an epoch
    trained = [[i for b in c.batches("torchrun", rank) for i in b] for rank in range(2)]
    epochs = [[items[e * share : (e + 1) * share] for items in trained] for e in range(2)]
    figures, causes = [], []
    for e, (rank_0, rank_1) in enumerate(epochs, 1):
        figures.append(
            f"epoch {e}: {len(rank_0)} + {len(rank_1)} items, {len(set(rank_0 + rank_1))} distinct"
        )
        if set(rank_0) & set(rank_1):
            causes.append(
                "the ranks train the same items: each needs its share (a DistributedSampler "
                "with its rank and the world size)"
            )
        if len(set(rank_0 + rank_1)) != 2 * share:
            causes.append("an epoch trains items twice, or leaves some of its steps' out")
    same_order = epochs[0] == epochs[1]
    figures.append("epoch 2 in epoch 1's order" if same_order else "epoch 2 in another order")
    if same_order:
        causes.append(
            "every epoch repeats the first one's order: call sampler.set_epoch(epoch) at each "
            "epoch's start"
        )
    return Verdict(8, "FAIL" if causes else "pass", "; ".join(figures), (causes or [""])[0])


CHECKS = {
    1: check_launch_modes, 2: check_equivalence, 3: check_mean, 4: check_same_data,
    5: check_resume, 6: check_eval, 7: check_model_file, 8: check_shares,
}  # fmt: skip


def check_copy(script, args: list[str], work: Path, only=()) -> list[Verdict]:
    """The guarantees `only` names (all where empty) on a user's script with their ARGS, one line
    each; the launches in `work`."""
    numbers = sorted(only or GUARANTEES)
    c = CopyCheck(script, args, work)
    started = time.monotonic()
    print(
        f"checking {' '.join([str(script), *args])}: 2 x {c.b}, 1 x {c.g} and 1 x {c.b} x 2 "
        f"accumulated, on at most {c.train_items} training and {c.eval_items} eval items, 2 "
        f"epochs; the runs: {work}"
    )
    names = {name for n in numbers for name in NEEDS[n]}
    names |= {before for name in names for before in LAUNCHES[name].after}
    c.run_launches(names)
    verdicts = []
    for n in numbers:
        problem = c.launch_problem(NEEDS[n])
        try:
            if n == 6 and c.eval_set_size() == 0:  # (--eval-only refuses to run, as it should)
                verdict = Verdict(6, "n/a", "build_datasets gives no eval set")
            elif problem:
                verdict = Verdict(n, "FAIL", problem, "its line names it")
            else:
                verdict = CHECKS[n](c)
        except Exception as exc:  # (a launch left something else than the check expects)
            figure = f"the check could not read its launches: {one_line(repr(exc))}"
            verdict = Verdict(n, "FAIL", figure, "a loop the wrapper cannot follow: see run.err")
        print(verdict)
        verdicts.append(verdict)
    counts = {
        status: sum(v.status == status for v in verdicts) for status in ("pass", "n/a", "FAIL")
    }
    seconds = time.monotonic() - started
    print(f"{counts['pass']} pass, {counts['n/a']} n/a, {counts['FAIL']} fail ({seconds:.0f} s)")
    return verdicts


CHECK_WRAPPER = r'''
"""make check's hidden wrapper: it runs as the user's script (its name, flags and task functions),
with what the CHECK_* variables ask for installed around them. Its own files go to CHECK_RECORDS."""

import collections
import hashlib
import importlib.util
import inspect
import json
import os
import random
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader

env = os.environ
RANK = env.get("RANK", "0")
RECORDS = env["CHECK_RECORDS"]
own_write = False  # True while the wrapper writes its records: the audit leaves them out


def record(name, line):
    global own_write
    own_write = True
    try:
        with open(os.path.join(RECORDS, name), "a") as f:
            f.write(line + "\n")
    finally:
        own_write = False


def audit(event, args):
    """A non-zero rank's writes, anywhere (rank 0 alone writes)."""
    if own_write:
        return
    if event == "open":
        path, mode, flags = args
        writing = (
            any(c in mode for c in "wax+")
            if isinstance(mode, str)
            else bool((flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        )
        if not writing or not isinstance(path, (str, bytes, os.PathLike)):
            return
    elif event in ("os.rename", "os.remove", "os.truncate"):  # (a directory made is no file)
        # shutil.rmtree removes a directory's files by their names, relative to its descriptor
        path, dir_fd = args[0], -1  # (-1: the path alone)
        if event == "os.remove":
            dir_fd = args[1]
        elif event == "os.rename":
            dir_fd = args[2]
        if dir_fd != -1 and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), os.fsdecode(path))
    else:
        return
    path = os.fsdecode(path)
    if "__pycache__" not in path and not path.startswith(("/dev/", "/proc/")):
        record(f"writes.{RANK}", json.dumps([event, os.path.abspath(path)]))


def load_user_script(path):
    """The user's script as a module (what `python SCRIPT` defines), and the module that trains:
    the script itself where it is a copy of ddp_train.py (its own train() and task functions),
    else the ddp_train it imports (and sets the task functions of)."""
    sys.path[0] = os.path.dirname(os.path.abspath(path))  # its imports resolve as its own would
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    user = importlib.util.module_from_spec(spec)
    sys.modules[name] = user
    spec.loader.exec_module(user)
    copy = getattr(getattr(user, "train", None), "__module__", None) == name
    target = user if copy else sys.modules.get("ddp_train")
    if target is None or not callable(getattr(user, "main", None) or getattr(target, "main", None)):
        sys.exit(f"{path}: make check runs a copy of ddp_train.py, or a script that imports it")
    return user, target


def item_digest(item):
    """A hash of an item's values: tensors, arrays, numbers, strings, and any nesting of them."""
    h = hashlib.sha256()

    def feed(x):
        if torch.is_tensor(x):
            x = x.detach().cpu().contiguous()
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif hasattr(x, "tobytes"):
            h.update(x.tobytes())
        elif isinstance(x, dict):
            for k in x:
                feed(k)
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                feed(v)
        else:
            h.update(repr(x).encode())

    feed(item)
    return h.hexdigest()[:16]


def describe(dataset):
    """Its length, and hashes of 8 of its items spread over it, each read from a random state of
    its index (an augmenting Dataset's too), and again from another (where the two differ, the
    Dataset draws random numbers as it reads)."""
    if dataset is None or not hasattr(dataset, "__len__"):
        return None
    n = len(dataset)
    picked = sorted({i * (n - 1) // 7 for i in range(8)}) if n else []
    numpy = sys.modules.get("numpy")
    states = torch.get_rng_state(), random.getstate(), numpy and numpy.random.get_state()
    digests, random_reads = [], False
    for i in picked:
        twice = []
        for seed in (i, i + 1):
            seed_all(seed)
            twice.append(item_digest(dataset[i]))
        digests.append(twice[0])
        random_reads |= twice[0] != twice[1]
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    if numpy:
        numpy.random.set_state(states[2])
    return {"len": n, "picked": picked, "digests": digests, "random_reads": random_reads}


class Recorded(torch.utils.data.Dataset):
    """The first `size` items of a Dataset (tag: train or eval), for RecordedLoader."""

    def __init__(self, dataset, tag, size):
        self.dataset, self.tag, self.size = dataset, tag, min(size, len(dataset))

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return self.dataset[i]

    def __getitems__(self, indices):
        if callable(getattr(self.dataset, "__getitems__", None)):
            return self.dataset.__getitems__(indices)
        return [self.dataset[i] for i in indices]

    def __getattr__(self, name):  # the Dataset's own attributes, for code that reads them
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class TakenBatches:
    """A batch sampler's batches, in a queue as the DataLoader takes them (ahead of the loop)."""

    def __init__(self, batches):
        self.batches, self.taken = batches, collections.deque()

    def __iter__(self):
        self.taken = collections.deque()  # a new pass (a pass left early loaded some ahead)
        for indices in self.batches:
            self.taken.append(indices)
            yield indices

    def __len__(self):
        return len(self.batches)


class RecordedLoader(DataLoader):
    """The script's DataLoader: of a Recorded set, each batch's indices are recorded as the loop
    gets the batch: those it trained or evaluated, in order (DataLoader workers or not)."""

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(DataLoader).bind(*args, **kwargs).arguments
        dataset = bound["dataset"]
        self.tag = dataset.tag if isinstance(dataset, Recorded) else None
        if self.tag:  # its batch sampler, or the one DataLoader would make, in a TakenBatches
            batches = bound.pop("batch_sampler", None)
            if batches is None:
                sampler = bound.pop("sampler", None)
                if sampler is None and bound.pop("shuffle", False):
                    sampler = torch.utils.data.RandomSampler(
                        dataset, generator=bound.get("generator")
                    )
                sampler = sampler or torch.utils.data.SequentialSampler(dataset)
                size, drop_last = bound.pop("batch_size", 1), bound.pop("drop_last", False)
                batches = torch.utils.data.BatchSampler(sampler, size, drop_last)
            bound["batch_sampler"] = TakenBatches(batches)
        super().__init__(**bound)

    def __iter__(self):
        iterator = super().__iter__()  # (now: iter() starts the workers, as the script expects)
        return self.recorded(iterator) if self.tag else iterator

    def recorded(self, iterator):
        for batch in iterator:
            indices = self.batch_sampler.taken.popleft()
            record(f"reads.{RANK}", f"{self.tag} {' '.join(map(str, indices))}")
            yield batch


def stop_torchrun():
    """SIGTERM to torchrun, as a scheduler stops a job; back once torchrun has passed it on here."""
    script_handler, got = signal.getsignal(signal.SIGTERM), []

    def note(signum, frame):
        got.append(signum)
        if callable(script_handler):
            script_handler(signum, frame)

    signal.signal(signal.SIGTERM, note)
    os.kill(os.getppid(), signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    signal.signal(signal.SIGTERM, script_handler)
    if not callable(script_handler):  # (the script's loop handles no signal: its default action)
        os.kill(os.getpid(), signal.SIGTERM)


def install(target):
    """The check's pieces around the task functions that the run calls."""
    names = ("build_datasets", "build_model", "compute_loss", "report")
    task = {name: getattr(target, name) for name in names}  # the user's
    training_calls = [0]
    built = {}  # the user's Datasets, as build_datasets gave them

    def build_datasets(args):
        train_set, eval_set = task["build_datasets"](args)
        built.update(train=train_set, eval=eval_set)
        if hasattr(train_set, "__len__"):
            train_set = Recorded(train_set, "train", int(env["CHECK_TRAIN_ITEMS"]))
        if eval_set is not None and hasattr(eval_set, "__len__"):
            eval_set = Recorded(eval_set, "eval", int(env["CHECK_EVAL_ITEMS"]))
        return train_set, eval_set

    def build_model(args):
        model = task["build_model"](args)
        if "CHECK_INITIAL" in env and RANK == "0":  # (rank 0's: the weights DDP sends to all)
            torch.save(model.state_dict(), os.path.join(RECORDS, "initial.pt"))
        return model

    def compute_loss(model, batch):
        if model.training:
            training_calls[0] += 1
            # the sets, once this rank trains (past the script's seeds per rank, its first reads)
            if training_calls[0] == 1 and "CHECK_DESCRIBE" in env:
                sets = {part: describe(dataset) for part, dataset in built.items()}
                record(f"data.{RANK}", json.dumps(sets))
            first_run = env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if RANK == "0" and first_run and training_calls[0] == int(env.get("CHECK_STOP_AT", 0)):
                stop_torchrun()
        return task["compute_loss"](model, batch)

    def report(record_, args, model):
        record("records.jsonl", json.dumps(record_))
        task["report"](record_, args, model)

    target.build_datasets, target.build_model = build_datasets, build_model
    target.compute_loss, target.report = compute_loss, report
    target.DataLoader = RecordedLoader
    if "CHECK_SGD" in env:  # plain SGD at a constant --lr (x CHECK_SGD): a gradient's scale shows
        scale = float(env["CHECK_SGD"])

        def build_optimizer(args, model):
            return torch.optim.SGD(model.parameters(), lr=args.lr * scale)

        def build_scheduler(args, optimizer, total_steps):
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

        target.build_optimizer, target.build_scheduler = build_optimizer, build_scheduler
    return task


def to_float64(batch):
    """A batch with its floating tensors in float64 (the check's independent figures)."""
    if torch.is_tensor(batch):
        return batch.double() if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: to_float64(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*map(to_float64, batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map(to_float64, batch))
    return batch


def read(dataset, indices):
    """Items as the DataLoader fetches them; each from a random state of its own index (a Dataset
    that draws random numbers gives an item the same values each time)."""
    if callable(getattr(dataset.dataset, "__getitems__", None)):
        return dataset.__getitems__(indices)
    items = []
    for i in indices:
        seed_all(i)
        items.append(dataset[i])
    return items


def seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)


class Losses:
    """compute_loss over batches of a Dataset at given weights: each batch in a model of its own,
    made afresh, as a fresh process computes it (a layer with state starts from the weights')."""

    def __init__(self, args, task, collate_fn):
        self.args, self.task, self.collate_fn = args, task, collate_fn

    def model(self, weights, train, float64=False):
        model = self.task["build_model"](self.args)
        model.load_state_dict(torch.load(weights, weights_only=True))
        model.train(train)
        return model.double() if float64 else model

    def mean(self, weights, train, dataset, batches, float64=False, seed=0):
        """The count-weighted mean of compute_loss over batches (lists of indices), and the
        count; in training mode or not; the model's random draws (dropout) from `seed`."""
        total, count = 0.0, 0.0
        for indices in batches:
            model = self.model(weights, train, float64)
            batch = self.collate_fn(read(dataset, indices))
            seed_all(seed)
            loss, n = self.task["compute_loss"](model, to_float64(batch) if float64 else batch)[:2]
            total += float(loss) * float(n)
            count += float(n)
        return (total / count if count else 0.0), count

    def mean_float64(self, weights, train, dataset, batches):
        """(mean, count), and the precision: float64 where the model and compute_loss allow."""
        try:
            return self.mean(weights, train, dataset, batches, float64=True), "float64"
        except Exception:
            return self.mean(weights, train, dataset, batches), "float32"


def probe(target, task, argv, inputs):
    """One process, no process group: the figures that checks 2, 3 and 7 compare the launches
    with. inputs: the initial weights (torchrun's rank 0's), each rank's first micro-batch there,
    and the final weights (the python launch's)."""
    args = target.parse_args(argv)
    getattr(target, "seed_everything", torch.manual_seed)(args.seed)  # as before build_datasets
    # the Datasets as the launches had them (install()'s build_datasets: their first items); the
    # model and compute_loss the user's own (task)
    train_set, eval_set = target.build_datasets(args)
    losses = Losses(args, task, target.collate_fn)
    initial, final, micro_batches = inputs["initial"], inputs["final"], inputs["first_step"]
    items = [i for batch in micro_batches for i in batch]
    each = [[i] for i in items]
    kinds = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.Dropout)
    layers = task["build_model"](args).modules()
    found = {"count_unit": target.COUNT_UNIT, "step_1": None, "eval_loss": None}
    found["modules"] = sorted(
        {type(m).__name__ for m in layers if isinstance(m, kinds) and m.training}
    )
    with torch.no_grad():
        # one micro-batch from two random states: the same loss unless training draws randomly
        draws = [
            losses.mean(initial, True, train_set, micro_batches[:1], seed=s)[0] for s in (1, 2)
        ]
        found["random_in_training"] = draws[0] != draws[1]
        # in evaluation (no dropout, no batch statistics) a mean over a batch's count is the
        # count-weighted mean of its items' losses, each alone; a sum is B times it
        alone = losses.mean(initial, False, train_set, each)[0]
        found["batch_over_items"] = losses.mean(initial, False, train_set, micro_batches)[0] / alone
        found["item_counts"] = [losses.mean(initial, False, train_set, [i])[1] for i in each]
        # a mean of 2B items is the count-weighted mean of its halves' means; a sum is their sum
        both = losses.mean(initial, False, train_set, [items])[0]
        halves = losses.mean(
            initial, False, train_set, [items[: len(items) // 2], items[len(items) // 2 :]]
        )[0]
        found["loss_2b_over_b"] = both / halves if halves else 1.0
        # in training: whether a layer's output depends on the rest of the batch (BatchNorm)
        try:
            batched = losses.mean(initial, True, train_set, micro_batches)[0]
            found["batch_dependent"] = abs(
                losses.mean(initial, True, train_set, each)[0] - batched
            ) > 1e-5 * abs(batched)
        except Exception:  # (BatchNorm of one item in training: an error)
            found["batch_dependent"] = True
        found["stateful"] = stateful_layers(losses, initial, train_set, micro_batches[0])
        if not found["random_in_training"]:  # step 1 item by item, or as each rank's micro-batch
            per = micro_batches if found["batch_dependent"] else each
            (found["step_1"], _), found["precision"] = losses.mean_float64(
                initial, True, train_set, per
            )
        if eval_set is not None and len(eval_set):  # the final weights, each eval item alone
            per_item = [[i] for i in range(len(eval_set))]
            (found["eval_loss"], _), _ = losses.mean_float64(final, False, eval_set, per_item)
    found["load_error"] = load_error(task["build_model"](args), final)
    return found


def stateful_layers(losses, weights, dataset, micro_batch):
    """The kinds of layers whose buffers a forward in training moves (BatchNorm's statistics, a
    running normalizer's): their state is per process."""
    model = losses.model(weights, True)
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    losses.task["compute_loss"](model, losses.collate_fn(read(dataset, micro_batch)))
    moved = [
        name for name, buffer in model.named_buffers() if not torch.equal(buffer, before[name])
    ]
    return sorted({type(model.get_submodule(name.rpartition(".")[0])).__name__ for name in moved})


def load_error(model, path):
    """Why model.pt does not load into build_model() with a strict load_state_dict, or None."""
    try:
        model.load_state_dict(torch.load(path, weights_only=True))
    except Exception as exc:
        return " ".join(str(exc).split())[:300]
    return None


if __name__ == "__main__":
    user, target = load_user_script(env["CHECK_SCRIPT"])
    task = install(target)
    if "CHECK_PROBE" in env:
        with open(env["CHECK_PROBE"]) as f:
            found = probe(target, task, sys.argv[1:], json.load(f))
        record("probe.json", json.dumps(found))
        sys.exit(0)
    if RANK != "0":
        sys.addaudithook(audit)
        torch_save = torch.save

        # torch.save writes a path from C++: no audit event (a `from torch import save` escapes)
        def save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)):
                audit("open", (f, "wb", None))
            return torch_save(obj, f, *args, **kwargs)

        torch.save = save
    sys.exit(getattr(user, "main", target.main)())  # as `python SCRIPT` runs it
'''


def pytest_addoption(parser):
    parser.addoption("--copy", help="make check: the script to check (yours)")
    parser.addoption("--copy-args", default="", help="make check: its flags, as one string")
    parser.addoption("--copy-checks", default="", help="make check: only these, as 2,3")
