"""This module holds the copy check that `make check` runs. It also holds the launch machinery that
the check shares with the tests.

The check runs the guarantees of ddp_train.py on a user's own script, with their flags, in real
processes on the CPU. It prints one line per guarantee with the figure that it measured. A line
says pass, or FAIL with the likely cause, or n/a where the task differs by design. The command
exits 0 when no guarantee fails, and 1 when one fails or the script is missing.

    python check_copy.py SCRIPT [--args="--batch-size 8"] [--checks=2,3] [--work=DIR]

The launches write into DIR, which is out/check/NAME unless the command gives another folder.
Each run replaces the last one. Every launch runs in a session of its own with a hard timeout, and
its process group is killed at the end. Inside the test suite, where DDP_TEST_SLOTS names the
suite's CPU slots, the check runs its launches one at a time. The tests import Launch, run and the
slots from here, and conftest.py holds their fixtures."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import re
import resource
import shlex
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

import torch

ROOT = Path(__file__).resolve().parent
SCRIPT = str(ROOT / "ddp_train.py")
PY = sys.executable
# This is the limit in seconds for any one launch. A hang then fails fast instead of using up the
# time of the CI.
TIMEOUT = 150
# A whole make check runs its launches one at a time inside the suite, and each one waits for CPU
# slots and has its own limit of TIMEOUT. So the limit for the whole check only backs those limits
# up, and it is long enough for a loaded machine.
CHECK_TIMEOUT = 900
# A launch that times out gets SIGABRT first, so that Python prints the stack of every thread,
# because PYTHONFAULTHANDLER is set. This line makes sure that no core file is written.
resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))

# ---------------------------------------------------------------------------
# The test processes of a session share the CPU load through process slots, which are lock files.
# ---------------------------------------------------------------------------

# The slots and the port counter live in a directory. The first pytest process of a session makes
# this directory. Its xdist workers, and the make check runs that it starts, inherit the directory
# through this variable.
SLOTS_ENV = "DDP_TEST_SLOTS"


def usable_cpus() -> int:
    """Return the number of CPUs that this process may use. os.cpu_count() counts the host's CPUs.
    The process may be pinned to fewer of them, and a container's cgroup may give it a quota of
    CPU time that is worth fewer. The smallest of the three counts."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for quota, period in cgroup_cpu_quotas():
        cpus = min(cpus, max(1, math.ceil(quota / period)))
    return cpus or 1


def cgroup_cpu_quotas() -> list[tuple[int, int]]:
    """Return the CPU quotas, as (quota, period) in microseconds, of this process's cgroup and of
    the cgroups above it. A limit on a parent cgroup holds for its children too. cgroup v2 keeps
    "quota period" in cpu.max, and cgroup v1 keeps cpu.cfs_quota_us and cpu.cfs_period_us."""
    quotas = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2
                roots, files = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"], ("cpu.max",)
            elif "cpu" in controllers.split(","):  # v1
                roots = list(dict.fromkeys(["/sys/fs/cgroup/cpu", f"/sys/fs/cgroup/{controllers}"]))
                files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
            else:
                continue
            for root in roots:
                cgroup = Path(root + path)
                for directory in (cgroup, *cgroup.parents):
                    if not directory.is_relative_to(root):
                        break
                    with contextlib.suppress(OSError, ValueError):
                        text = " ".join((directory / name).read_text() for name in files).split()
                        if text[0] not in ("max", "-1"):
                            quotas.append((int(text[0]), int(text[1])))
    return quotas


ALL_SLOTS = 2 * usable_cpus()  # Each usable core runs two busy processes at most.
# Every launch gets this --timeout. A lost peer then ends the run with the script's own line.
PEER_TIMEOUT = 60


def share_slots():
    """Make the directory of the slots and the port counter, unless this process inherits one from
    the process that started it."""
    if SLOTS_ENV not in os.environ:
        os.environ[SLOTS_ENV] = tempfile.mkdtemp(prefix="ddp-test-slots-")


class CpuSlots:
    """This class is a counting semaphore of process slots, and the slots are lock files. The
    pytest-xdist workers share the slots with the make check runs that the tests start. A launch
    takes one slot for each process that it starts. The kernel frees a lock file when its holder
    dies, so a crashed test never keeps a slot."""

    # This is the number of slots that this process holds for a whole test, through reserve_slots.
    reserved = 0

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
    """Take the slots for the launches inside the block, all at once. A test whose launches run side
    by side needs this, because two of its launches could otherwise each hold half of the slots and
    wait for the rest. A test whose processes time their peers takes all the slots. Keep-alives and
    a restart that waits for a node are such tests."""
    slots = CpuSlots(count)
    CpuSlots.reserved = count
    try:
        yield
    finally:
        CpuSlots.reserved = 0
        slots.release()


def free_port() -> int:
    """Return a port that no other test of the session takes. The port lies below Linux's ephemeral
    range, so the kernel never hands it out to anyone, and nobody can take it between now and its
    use."""
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


# ---------------------------------------------------------------------------
# Launches run in a session of their own with a hard timeout, and nothing they start outlives them
# ---------------------------------------------------------------------------


def clean_env(**extra) -> dict:
    """Return this environment without any launcher's variables, plus `extra`. A value of None in
    `extra` unsets that variable. Each process gets one thread, because two tests run at a time, and
    OpenMP threads that spin for a taken core slow a run 10x."""
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
    # With this variable, a SIGABRT prints the Python stack of every thread.
    env.update(PYTHONFAULTHANDLER="1")
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
    """Return the live processes whose DDP_TEST_LAUNCH holds the mark. They are a launch and all the
    processes that it started. A launch inside a launch, such as make check in a test, adds its own
    mark to the one that it inherits."""
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
    """Return how many processes a command of the script starts. The number is N under torchrun or
    with --spawn N, and 1 otherwise."""
    cmd = [str(c) for c in cmd]
    for i, arg in enumerate(cmd):
        m = re.fullmatch(r"--nproc[-_]per[-_]node=(\d+)", arg)
        if m:
            return int(m.group(1))
        if arg == "--spawn":
            return int(cmd[i + 1])
    return 1


class Result:
    """A Result object holds what a run left behind. That is its exit code, its output and its
    out-dir, which holds its records and its final weights."""

    def __init__(self, returncode, stdout, stderr, out_dir, seconds=None):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
        # The seconds count the time from the run's start to its exit.
        self.out_dir, self.seconds = out_dir, seconds

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


class LaunchFailed(AssertionError):
    """A launch hung, left a process behind or exited too early. The suite reports it as a failed
    test, and the copy check reports it as a failed check."""


class Launch:
    """A Launch runs a command in a session of its own and writes its output to files. When the
    code leaves the `with` block, everything that the command started is killed. wait() fails the
    test if the command hangs or leaves a process behind. A Launch holds a CPU slot for each process
    that it starts, from its start until it is killed. The argument slots gives that number where
    the command does not show it."""

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
        # A DataLoader worker may take a moment to follow its trainer and exit.
        deadline = time.monotonic() + 10
        while marked(self.mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = marked(self.mark)
        if left:
            self.kill()
            raise LaunchFailed(
                f"{len(left)} process(es) left behind by {' '.join(self.cmd)}\n{self.stderr}"
            )
        return code

    def wait_for(self, predicate, what: str, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise LaunchFailed(
                    f"exited ({self.proc.returncode}) before {what}\n{self.stdout}\n{self.stderr}"
                )
            if time.monotonic() > deadline:
                self.fail_with_stacks(f"no {what} within {timeout}s")
            time.sleep(0.01)

    def fail_with_stacks(self, why: str):
        """Fail the test with the stacks of every process of the launch, so that a hang shows where
        it waits. SIGABRT makes each Python process print all its threads, because
        PYTHONFAULTHANDLER is set."""
        for pid in marked(self.mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        deadline = time.monotonic() + 5
        while marked(self.mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.kill()
        raise LaunchFailed(
            f"{why}: {' '.join(self.cmd)}\n{self.stdout[-3000:]}\n{self.stderr[-12000:]}"
        )

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
    """Launch `cmd` with --out-dir tmp_path/out, wait for it, and check its exit code. An `expect`
    of None accepts any exit code."""
    with Launch([*cmd, "--out-dir", tmp_path / out], tmp_path, out, env=env, cwd=cwd) as launch:
        launch.wait(timeout)
    result = launch.result(tmp_path / out)
    assert expect is None or result.returncode == expect, result
    # This rejects the classic gloo abort at exit. That abort happens when a process group is torn
    # down under a live DDP model. torchrun's own abort after a signal is torch's, not the script's.
    aborts = result.stderr.count("terminate called") - launcher_aborted(result)
    assert aborts == 0, result
    return result


def launcher_aborted(result) -> bool:
    """Return whether torchrun's own process aborted at its exit after a signal. After a signal,
    torch's launch_agent() skips the rendezvous shutdown (launcher/api.py), so the rendezvous
    keep-alive thread still runs when the interpreter exits. That daemon thread can be cut off
    inside C++, and then torchrun aborts with "terminate called". Its workers have exited by then.
    It happened once in the project's CI runs so far, on a loaded machine, with torch 2.13."""
    return result.returncode == -signal.SIGABRT and "SignalException" in result.stderr


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


# ---------------------------------------------------------------------------
# Check your copy with make check. It tests the guarantees on a user's own script, in real
# processes. The wrapper runs as their script, with the check's pieces installed around its task
# functions. The launches that several checks compare are made once, two at a time.
# ---------------------------------------------------------------------------

GUARANTEES = {
    1: "every launch mode trains, and only rank 0 writes",
    2: "N x B trains the weights of 1 x N*B",
    3: "the logged loss is the mean over the items",
    4: "every rank sees the same data",
    5: "a stop resumes exactly",
    6: "evaluation counts each item once, on any world size",
    7: "model.pt loads into build_model()",
    8: "each rank reads its own share, in a new order each epoch",
}
# The tolerance is relative. It allows for float32 sums in another order.
TOLERANCE = 1e-5
# These are the check's own flags, and the user's ARGS do not change them. The user's --batch-size
# gives B.
CHECK_SETS = (
    "--batch-size", "--grad-accum", "--epochs", "--max-steps", "--out-dir", "--spawn",
    "--log-every", "--eval-only",
)  # fmt: skip


@dataclasses.dataclass
class Planned:
    """A Planned object is a launch of the user's script through the wrapper. It trains 2 epochs."""

    mode: str  # The mode is python, torchrun with 2 processes, or spawn with --spawn 2.
    # This is --batch-size in units of B. The global batch is 2B, except in the torchrun launches,
    # which accumulate 2 micro-batches of B on each of 2 ranks.
    batch: int
    grad_accum: int
    out_dir: str  # This is its own out-dir, or the one whose checkpoint it reads.
    env: dict  # These CHECK_* variables tell the wrapper what to install.
    eval_only: bool = False
    after: tuple = ()  # These launches finish before it starts, because it reads their files.


# They start in this order, two at a time. CHECK_SGD=k trains with plain SGD at k times the check's
# one rate, in place of the user's optimizer, because an adaptive optimizer trains a summed loss
# almost like a mean. Each process of these launches computes the rate and the BatchNorm
# statistics itself, from the same items, so that all of them get the same ones. grad_x2 is check
# 2's negative control.
NEUTRAL_SGD = {"CHECK_SGD": 1, "CHECK_NEUTRAL": 1}
LAUNCHES = {
    # Its last evaluation is check 6's evaluation on 1 process.
    "python": Planned("python", 2, 1, "python", dict(CHECK_DESCRIBE=1)),
    # The torchrun launches accumulate 2 micro-batches, so that a resume skips whole accumulated
    # steps. Each rank saves the checkpoint's parts as it holds them, for check 5.
    "torchrun": Planned("torchrun", 1, 2, "torchrun", dict(CHECK_DESCRIBE=1, CHECK_PARTS=1)),
    # This launch gets SIGTERM in step 2, at its fourth micro-batch. By then every rank has sent
    # its stop vote of step 2 without the signal, and rank 0 sends it in its vote of step 3. So
    # every rank stops after step 3, in the middle of an epoch, whenever the other ranks get it.
    "stopped": Planned("torchrun", 1, 2, "stopped", dict(CHECK_STOP_AT=4)),
    "spawn": Planned("spawn", 1, 1, "spawn", {}),
    # Check 2's launches are 1 x 2B, 2 x B, 1 x B x 2 accumulated, and the control at twice the
    # rate. They run the user's loop and loss, with BatchNorm, dropout, autocast and the Dataset's
    # draws neutralised. Check 3 recomputes the first step of the launch of 2 processes.
    "single": Planned("python", 2, 1, "single", NEUTRAL_SGD | {"CHECK_DESCRIBE": 1}),
    "pair": Planned("spawn", 1, 1, "pair", NEUTRAL_SGD | {"CHECK_INITIAL": 1, "CHECK_STEP_ONE": 1}),
    "accum": Planned("python", 1, 2, "accum", NEUTRAL_SGD),
    "grad_x2": Planned("python", 2, 1, "grad_x2", NEUTRAL_SGD | {"CHECK_SGD": 2}),
    # The resumed launch runs the same command as the stopped launch.
    "resumed": Planned("torchrun", 1, 2, "stopped", dict(CHECK_PARTS=1), after=("stopped",)),
    "eval_2": Planned("torchrun", 1, 1, "python", {}, eval_only=True, after=("python",)),
    # These evaluate python's checkpoint at --grad-accum 1 and 2. They draw the same random numbers,
    # so their eval losses must be the same, unless compute_loss reads --grad-accum.
    "eval_1": Planned("python", 2, 1, "python", {}, eval_only=True, after=("python",)),
    "eval_accum": Planned("python", 2, 2, "python", {}, eval_only=True, after=("python",)),
    # One process computes the figures alone. It uses the first step of pair, the final weights of
    # single, whose evaluation ran without autocast, and python's model.pt.
    "probe": Planned("python", 2, 1, "python", {}, after=("python", "pair", "single")),
    # This is single with other draws of the model's random numbers. Check 2 runs it only for a
    # model that draws them, to measure their noise.
    "reseeded": Planned("python", 2, 1, "reseeded", NEUTRAL_SGD | {"CHECK_RESEED": 1}),
}
# Each check reads these launches.
NEEDS = {
    1: ("python", "torchrun", "spawn"),
    # Check 2 reads torchrun and python to tell whether the data differ.
    2: ("single", "pair", "accum", "grad_x2", "eval_1", "eval_accum", "probe", "torchrun"),
    3: ("python", "torchrun", "single", "pair", "probe"),
    4: ("python", "torchrun"),
    5: ("python", "torchrun", "stopped", "resumed"),  # python tells whether the data differ.
    6: ("python", "torchrun", "eval_2", "probe"),  # torchrun tells whether the data differ.
    7: ("probe",),
    8: ("torchrun",),
}


@dataclasses.dataclass
class Verdict:
    number: int
    # The status is pass, FAIL, or n/a. It is n/a when the model differs by design, or when the
    # check cannot tell.
    status: str
    figure: str
    cause: str = ""

    def __str__(self):
        line = f"{self.status:<4}  {self.number}. {GUARANTEES[self.number]}: {self.figure}"
        return f"{line}. Likely cause: {self.cause}" if self.cause else line


def user_flags(args: list[str]) -> tuple[list[str], int]:
    """Return the user's ARGS without the flags that the check sets, and their --batch-size. The
    batch size is 4 where ARGS gives none."""
    kept, batch, i = [], 4, 0
    while i < len(args):
        name, has_value, value = args[i].partition("=")
        if name not in CHECK_SETS:
            kept.append(args[i])
        elif name != "--eval-only" and not has_value:  # Its value is the next argument.
            i += 1
            value = args[i] if i < len(args) else ""
        if name == "--batch-size":
            batch = int(value)
        i += 1
    return kept, batch


class CopyCheck:
    """A CopyCheck object is a user's script under check. It holds the launches and what each launch
    left in its records directory. These are run.out and run.err, and the wrapper's files such as
    reads.RANK, data.RANK, writes.RANK and records.jsonl."""

    def __init__(self, script, args: list[str], work: Path):
        self.script, self.work = Path(script).resolve(), work
        self.flags, self.b = user_flags(args)
        workers = re.findall(r"--workers[= ](\d+)", " ".join(args))  # The last one counts.
        self.workers = int(workers[-1]) if workers else 0
        # Every launch but torchrun's has this global batch, as 2 x B, 1 x 2B or 1 x B x 2.
        self.g = 2 * self.b
        # The B extra training items leave a partial global batch at each epoch's end. The one
        # extra eval item makes the eval shares uneven.
        self.train_items, self.eval_items = 4 * self.g + self.b, self.g + 1
        # The wrapper takes the script's name, so that name appears in its lines.
        self.wrapper = work / "wrapper" / self.script.name
        self.wrapper.parent.mkdir(parents=True, exist_ok=True)
        # It is a copy of check_wrapper.py, so that --spawn, which starts the script again by its
        # path, starts the wrapper too.
        shutil.copyfile(ROOT / "check_wrapper.py", self.wrapper)
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
        # The SGD rate and the BatchNorm statistics come from batches of the global batch.
        env.update(CHECK_GLOBAL_BATCH=self.g)
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
        """Run the named launches, each one after the launches whose files it reads. They run two
        at a time, and the CPU slots cap the load inside the test suite too. A launch that times
        out, leaves a process behind or cannot start goes into self.failed. A launch cannot start
        when a launch that it reads has failed."""
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
            except Exception as exc:  # Launch.wait raises LaunchFailed.
                self.failed[name] = one_line(str(exc))
            finally:
                done[name].set()

        threads, at_a_time = [], 2
        # The launches that it reads come before it in `order`, so they have started already.
        for name in order:
            while sum(t.is_alive() for t in threads) >= at_a_time:
                time.sleep(0.05)
            threads.append(threading.Thread(target=one, args=(name,)))
            threads[-1].start()
        for t in threads:
            t.join()

    def launch_problem(self, names) -> str:
        """Return why one of these launches did not run to its end, or '' when all of them did."""
        for name in names:
            if name in self.failed:
                return f"the {name} launch: {self.failed[name]}"
            result = self.results[name]
            if result.returncode != 0 and name != "stopped":
                return f"the {name} launch exited {result.returncode}: {script_said(result)}"
        return ""

    # ---- These methods read what the launches left. ----

    def lines(self, name, file) -> list[str]:
        path = self.records(name) / file
        return path.read_text().splitlines() if path.exists() else []

    def batches(self, name, rank, tag="train") -> list[list[int]]:
        """Return the batches that a rank of a launch trained or evaluated, in order. Each batch is
        a list of indices. For the eval tag, they are the batches of the last evaluation."""
        taken = [line.split() for line in self.lines(name, f"reads.{rank}")]
        if tag == "eval":  # A line "eval" alone starts each evaluation.
            starts = [i for i, batch in enumerate(taken) if batch == ["eval"]]
            taken = taken[starts[-1] :] if starts else []
        return [[int(i) for i in batch[1:]] for batch in taken if batch[0] == tag]

    def data(self, name, rank) -> dict:
        """Return what build_datasets gave a rank. That is each set's length and the hashes of 8 of
        its items."""
        return json.loads(self.lines(name, f"data.{rank}")[0])

    def probe_inputs(self) -> dict:
        if not self.batches("pair", 0):
            raise RuntimeError(
                "the wrapper saw no training batch: it follows a loop that makes its DataLoader "
                "as DataLoader(...), the name the script imports"
            )
        return {
            # The initial weights are rank 0's, because DDP sends those.
            "initial": str(self.records("pair") / "initial.pt"),
            "first_step": [self.batches("pair", rank)[0] for rank in range(2)],
            "final": str(self.work / "python/model.pt"),
            "evaluated": str(self.work / "single/model.pt"),
        }

    def eval_set_size(self):
        """Return the eval set's length as build_datasets gave it in python's launch. Return None
        when the length is unknown."""
        if not self.lines("python", "data.0"):
            return None
        described = self.data("python", 0)["eval"]
        return described["len"] if described else 0

    def probe(self) -> dict:
        return json.loads(self.lines("probe", "probe.json")[0])

    def saved_parts(self, name) -> list[dict]:
        """Return the checkpoint's parts as each rank held them at the launch's last save, with
        one key for each tensor or number. The list is empty where the script's save_checkpoint
        did not show its parts to the wrapper, as in older copies."""
        paths = [self.records(name) / f"parts.{rank}.pt" for rank in range(2)]
        if not all(path.exists() for path in paths):
            return []
        return [torch.load(path, weights_only=True) for path in paths]

    def numbers_that_restarted(self) -> list[str]:
        """Return a line for each plain number of the model's modules or the script's globals that
        differs between the uninterrupted run and the resumed run at their last save on rank 0."""
        paths = [self.records(name) / "numbers.0.json" for name in ("torchrun", "resumed")]
        if not all(path.exists() for path in paths):
            return []
        whole, resumed = (json.loads(path.read_text()) for path in paths)
        return [
            f"{key} is {whole[key]} in the uninterrupted run and {resumed[key]} after the resume"
            for key in sorted(whole.keys() & resumed.keys())
            if whole[key] != resumed[key]
        ]


def unlike(a: dict, b: dict) -> list[str]:
    """Return the keys of two saves of the checkpoint's parts whose values differ."""
    return [
        key
        for key in sorted(a.keys() | b.keys())
        if key not in a
        or key not in b
        or type(a[key]) is not type(b[key])
        or not (torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key])
    ]


def part_names(keys: list[str]) -> set[str]:
    """Return the names of the parts that the keys of unlike() belong to."""
    return {key.split(".")[0] for key in keys}


def script_said(result) -> str:
    """Return the line that the script stopped with, such as `NAME: error: ...`. Otherwise return
    the first exception line of a traceback, such as `OverflowError: math range error`, which names
    the first failure. Otherwise return the last line of stderr that is not a banner of torchrun."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    said = [line for line in lines if ": error: " in line]
    if said:
        return one_line(said[-1])
    exception = re.compile(r"^(\[rank\d+\]: ?)?([A-Za-z_][\w.]*(Error|Exception|Interrupt))(:|$)")
    raised = [line for line in lines if exception.match(line)]
    if raised:
        return one_line(raised[0])
    text = [line for line in lines if re.search(r"[A-Za-z]", line)]
    return one_line((text or ["nothing on stderr"])[-1])


def one_line(text) -> str:
    return " ".join(str(text).split())[:400]


def weights_gap(a: dict, b: dict) -> float:
    """Return the largest relative difference of any tensor, as assert_same_weights measures it."""
    gaps = [0.0]
    for k in b:
        x, y = a[k].double(), b[k].double()
        gaps.append(((x - y).norm() / y.norm()).item() if y.norm() else (x - y).norm().item())
    return max(gaps)


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


# ---- The eight checks. Each reads the launches that it NEEDS, which ran to their end. ----


def check_launch_modes(c: CopyCheck) -> Verdict:
    seconds = ", ".join(f"{name} {c.seconds[name]:.1f} s" for name in NEEDS[1])
    # This lists the files that rank 1 wrote. It leaves out torch's caches and torch's probes of the
    # temporary directory.
    written = []
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
            "every rank runs every line: write files from rank 0 only (if world.rank == 0), as the "
            "script writes its checkpoints and records",
        )  # fmt: skip
    return Verdict(1, "pass", figure)


def neutralised(p: dict, train: dict, autocast: bool, clipping: bool) -> str:
    """Return what check 2's launches neutralised, for the check's line."""
    n = p["neutral"]
    parts = [f"{kind} x {count} at fixed statistics" for kind, count in n["batch_norms"].items()]
    if n["dropouts"]:
        parts.append(f"Dropout x {n['dropouts']} off")
    parts += [f"the dropout of {kind} x {count} off" for kind, count in n["rnn_dropouts"].items()]
    if autocast:
        parts.append("autocast off")
    if clipping:
        parts.append("gradient clipping off")
    parts += [f"the dropout of {name} off" for name in n["functions"]]
    if train["random_reads"] and not train["own_draws"]:
        parts.append("the Dataset's draws seeded per item")
    if p["training_collate_mixes"] and not p["collate_mixes"]:
        parts.append("collate_fn's mixing off, as the eval loader calls it with training=False")
    return ", ".join(parts)


def differs_by_design(p: dict, train: dict) -> str:
    """Return why N x B and 1 x N*B still differ by design in check 2's launches, or ''."""
    n = p["neutral"]
    why = []
    if n["stateful"]:
        why.append(f"in training, your model's {n['stateful'][0]} keeps state that training moves")
    elif n["mixing"]:
        layer = f"{n['mixing_layer']}'s output" if n["mixing_layer"] else "output"
        why.append(
            f"in training, your model's {layer} for an item depends on the rest of its batch"
        )
    if n["random"]:
        call = f" ({n['random_call']})" if n["random_call"] else ""
        why.append(f"your model or compute_loss draws random numbers in training{call}")
    if p["collate_mixes"]:
        why.append("your collate_fn mixes the items of a batch, even with training=False")
    if train["own_draws"]:
        why.append("your Dataset draws from generators of its own, which the check cannot seed")
    return "; ".join(why) + (": each process its own, by design" if why else "")


def loss_mixes_items(p: dict) -> bool:
    """Return whether, in evaluation, a batch's loss differs from the count-weighted mean of its
    items' losses. A sum or a mean of means makes it differ. A collate_fn that mixes items even with
    training=False, or a compute_loss that draws random numbers in evaluation, makes it differ too,
    and then the check cannot tell."""
    if p["collate_mixes"] or p["eval_random"]:
        return False
    return relative(p["batch_over_items"], 1.0) > TOLERANCE


def eval_loss_of(c: CopyCheck, name) -> float:
    """Return the eval loss of an --eval-only launch, as its report() got it."""
    return json.loads(c.lines(name, "records.jsonl")[-1])["eval_loss"]


# Under random draws, a gap counts when it exceeds this many times the gap that other draws give.
NOISE_FACTOR = 10


def weights_tolerance(weights: dict) -> float:
    """Return the largest relative gap of the weights that rounding explains in a correct copy.
    Weights held in bfloat16 or float16 round at every step, so a correct copy's gaps grow to about
    their epsilon. Then a gap may reach twice the epsilon of the lowest precision among the saved
    tensors."""
    epsilons = [torch.finfo(w.dtype).eps for w in weights.values() if w.is_floating_point()]
    return max([TOLERANCE] + [2 * epsilon for epsilon in epsilons])


def check_equivalence(c: CopyCheck) -> Verdict:
    one_process = c.results["single"].weights
    gap = {name: weights_gap(c.results[name].weights, one_process) for name in ("pair", "accum")}
    tolerance = weights_tolerance(one_process)
    # The control must move the weights far beyond the tolerance, so that a wrong weight shows.
    control_needed = max(100 * TOLERANCE, 10 * tolerance)
    low = ", as the weights' precision is low" if tolerance > TOLERANCE else ""
    # The control trains the same way at 2 x the rate.
    control = weights_gap(c.results["grad_x2"].weights, one_process)
    p, train = c.probe(), c.data("single", 0)["train"]
    neutral = neutralised(
        p,
        train,
        autocast=bool(c.lines("single", "autocast.0")),
        clipping=bool(c.lines("single", "clipping.0")),
    )
    accum_1, accum_2 = eval_loss_of(c, "eval_1"), eval_loss_of(c, "eval_accum")
    figure = (
        f"2 x {c.b} and 1 x {c.g} differ by {gap['pair']:.1e}, 1 x {c.b} x 2 accumulated by "
        f"{gap['accum']:.1e} (relative, of the weights; tolerance {tolerance:.2g}{low}; at twice the "
        f"learning rate, as a loss summed over 2 ranks trains: {control:.1e}, which must exceed "
        f"{control_needed:.2g} to tell; plain SGD, installed by the check"
        + (f"; {neutral})" if neutral else ")")
        + f"; --eval-only of one checkpoint at --grad-accum 1 and 2: {accum_1:.7g} and {accum_2:.7g}"
    )
    # The same checkpoint and the same draws give the same eval loss, whatever the model draws.
    if relative(accum_2, accum_1) > TOLERANCE:
        return Verdict(
            2,
            "FAIL",
            figure,
            "compute_loss reads --grad-accum, so its loss changes with it (a "
            "loss divided by --grad-accum, which the loop does already?)",
        )
    limit = tolerance  # This is the largest gap that rounding or the model's design explains.
    design = differs_by_design(p, train)
    # A loss that mixes items does not do so by design.
    if design and not loss_mixes_items(p):
        n = p["neutral"]
        only_draws = n["random"] and not (n["stateful"] or p["collate_mixes"] or train["own_draws"])
        if not only_draws or max(gap.values()) <= tolerance:
            return Verdict(2, "n/a", f"{figure}: {design}")
        # Another seed of the same launch shows how far the draws alone move the weights.
        c.run_launches({"reseeded"})
        problem = c.launch_problem(["reseeded"])
        if problem:
            return Verdict(2, "n/a", f"{figure}: {design}; {problem}")
        noise = weights_gap(c.results["reseeded"].weights, one_process)
        limit = NOISE_FACTOR * max(noise, tolerance)
        figure += f"; other draws of the random numbers move 1 x {c.g} by {noise:.1e}"
        if max(gap.values()) <= limit:
            return Verdict(
                2, "n/a", f"{figure}, and the gaps are within {NOISE_FACTOR} times that: {design}"
            )
        figure += f", and a gap exceeds {NOISE_FACTOR} times that"
    if control < control_needed:
        return Verdict(2, "n/a", f"{figure}: the weights move too little to tell")
    if max(gap.values()) <= limit:
        return Verdict(2, "pass", figure)
    if check_same_data(c).status == "FAIL":
        cause = "the processes train on different data (see 4)"
    elif p["loss_2b_over_b"] > 1.5:
        cause = "compute_loss returns a sum, which grows with the batch (see 3)"
    elif loss_mixes_items(p):
        cause = "compute_loss's loss is not the mean over its count items (see 3)"
    elif gap["pair"] <= limit:
        cause = (
            "the loop weighs the micro-batches of an accumulated step wrongly: each mean weighs its "
            "count over the step's count (a loss divided by --grad-accum twice?)"
        )
    elif gap["accum"] <= limit:
        cause = (
            "the loop weighs the ranks wrongly, or their gradients are not averaged: each rank's "
            "mean weighs its count over the step's count, times the world size"
        )
    else:
        cause = (
            "the loop weighs the micro-batches and the ranks otherwise than by their counts: each "
            "mean weighs its count over the step's count (each mean weighed equally, as nanoGPT "
            "weighs its ranks' token means?)"
        )
    return Verdict(2, "FAIL", figure, cause)


def check_mean(c: CopyCheck) -> Verdict:
    p, figures, causes = c.probe(), [], []
    n = p["neutral"]
    ratio, per_item = p["loss_2b_over_b"], p["batch_over_items"]
    figures.append(f"in evaluation, {c.g} items' loss / their two halves' = {ratio:.3f} (a sum: 2)")
    if ratio > 1.5:
        causes.append(
            "compute_loss returns a sum, which grows with the batch: return the mean over its "
            "count items (F.cross_entropy's default reduction)"
        )
    checked = 0  # This counts the figures that tell a mean from other losses.
    if p["collate_mixes"]:
        figures.append("a batch not compared with its items: collate_fn mixes them")
    elif p["eval_random"]:
        figures.append("a batch not compared with its items: compute_loss draws random numbers")
    else:
        checked += 1
        figures.append(f"a batch's / the count-weighted mean of its items' = {per_item:.4f} (1)")
        if loss_mixes_items(p) and ratio <= 1.5:
            causes.append(
                "compute_loss weighs a batch's items otherwise than by their count (a mean of "
                "per-sample means?): return the mean over all the items its count counts"
            )
    own_draws = c.data("torchrun", 0)["train"]["own_draws"]
    not_recomputed = ""  # This says why step 1 cannot be recomputed item by item.
    step_one = None  # This is step 1's loss as the check computes it, and how it computes it.
    if n["random"]:
        call = f" ({n['random_call']})" if n["random_call"] else ""
        not_recomputed = f"training draws random numbers{call}"
    elif p["collate_mixes"]:
        not_recomputed = "collate_fn mixes the items"
    elif own_draws:
        not_recomputed = "the Dataset draws its own"
    elif check_same_data(c).status == "FAIL":
        not_recomputed = "the ranks' data differ (see 4)"
    else:
        # Check 2's launch of 2 processes trained with dropout off and each item read alone.
        how = "micro-batch by micro-batch" if n["mixing"] else "item by item"
        step_one = (n["step_1"], f"neutral as in 2, {how} in {n['precision']}")
    if not_recomputed:
        figures.append(f"step 1 not recomputed item by item: {not_recomputed}")
        # The losses that the ranks computed in step 1 give its logged loss, whatever they drew.
        ranks_losses = [
            json.loads(line) for r in range(2) for line in c.lines("pair", f"step_one.{r}")
        ]
        counted = [(loss, count) for loss, count in ranks_losses if count > 0]
        if counted:
            mean = sum(loss * count for loss, count in counted) / sum(count for _, count in counted)
            step_one = (mean, "the count-weighted mean of the losses that the ranks computed")
    if step_one is not None:
        checked += 1
        logged = c.results["pair"].records("progress")[0]["train_loss"]
        computed, how = step_one
        gap = relative(logged, computed)
        figures.append(
            f"step 1 of 2 x {c.b}: logged {logged:.7g}, {how} {computed:.7g} (relative gap "
            f"{gap:.1e})"
        )
        if gap > TOLERANCE:
            causes.append(
                "the logged loss is not the mean over the items of the step on all ranks (a loss "
                "all_reduce left out? a mean of per-sample means? padding in the mean? a count of "
                "other items?)"
            )
    # single evaluated its final weights with autocast off, and the probe recomputes that.
    evals = [record for record in c.results["single"].metrics if "eval_loss" in record]
    if p["eval_random"]:
        figures.append("eval not recomputed: compute_loss draws random numbers in evaluation")
    elif evals and p["eval_loss"] is not None:
        checked += 1
        logged, alone = evals[-1]["eval_loss"], p["eval_loss"]
        gap = relative(logged, alone)
        figures.append(
            f"last eval of 1 x {c.g}, neutral as in 2: logged {logged:.7g}, item by item "
            f"{alone:.7g} ({gap:.1e})"
        )
        if gap > TOLERANCE:
            causes.append("the eval loss is not the mean over the items its count counts")
    counts, unit = set(p["item_counts"]), p["count_unit"]
    if unit == "samples" and counts != {1.0}:
        causes.append(f"an item alone counts {max(counts):g}, but COUNT_UNIT is samples")
    if unit != "samples" and counts == {1.0}:
        causes.append(f"every item counts 1, a sample, but COUNT_UNIT is {unit}: count the {unit}")
    figure = "; ".join(figures)
    if causes:
        return Verdict(3, "FAIL", figure, causes[0])
    if not checked:
        return Verdict(3, "n/a", f"{figure}: the draws differ from launch to launch, by design")
    return Verdict(3, "pass", figure)


def check_same_data(c: CopyCheck) -> Verdict:
    # The check compares ranks 0 and 1 of one launch with rank 0 of another launch. A generator that
    # nobody seeds gives different data there.
    rank_0, rank_1, other = c.data("torchrun", 0), c.data("torchrun", 1), c.data("python", 0)
    verdicts = [
        same_set(part, rank_0[part], rank_1[part], other[part]) for part in ("train", "eval")
    ]
    verdicts = [v for v in verdicts if v]
    for status in ("FAIL", "n/a"):  # The worst verdict of the two sets wins.
        if any(v.status == status for v in verdicts):
            return next(v for v in verdicts if v.status == status)
    return Verdict(4, "pass", "; ".join(v.figure for v in verdicts))


def same_set(part, rank_0, rank_1, other):
    """Run check 4 for one of the sets. Return None where build_datasets gives no such set."""
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
    # Items that another launch of the same rank reproduces are not random to the check. Then a
    # difference between the ranks is a real one.
    if rank_0["random_reads"] and across_runs < n:
        return Verdict(
            4, "n/a", f"{figure}: its items are random as read, from generators the check cannot "
            "set, so another launch of the same rank cannot reproduce them; the lengths agree",
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
            "the loop's step sync, or its resume, was changed",
        )  # fmt: skip
    whole = c.results["torchrun"].weights
    differ = [k for k in whole if not torch.equal(whole[k], resumed.weights[k])]
    figure = (
        f"SIGTERM to torchrun in step 2: every rank stopped after step {m[1]} and saved (the "
        f"script's exit 75, torchrun's {stopped.returncode}); the rerun resumed there: {len(differ)} of "
        f"{len(whole)} tensors differ from the uninterrupted run's"
    )
    parts = {name: c.saved_parts(name) for name in ("torchrun", "resumed")}
    # The wrapper finds the parts through an argument of save_checkpoint() with a dict
    # stateful_parts. Where a copy shows none, as an older copy does, the line says so.
    unseen = ""
    if not parts["torchrun"]:
        unseen = (
            "; the parts of its checkpoint were not compared, because its save_checkpoint() "
            "gets no stateful_parts"
        )
    if parts["torchrun"]:
        names = sorted({key.split(".")[0] for key in parts["torchrun"][0]})
        # The ranks must hold the same parts after a step, whether the resume is bit-identical or
        # not, as under a Dataset that draws in DataLoader workers.
        unlike_ranks = unlike(parts["torchrun"][0], parts["torchrun"][1])
        ranks_figure = (
            f"of the {len(names)} parts that its last checkpoint holds ({', '.join(names)}), "
            f"{len(part_names(unlike_ranks))} differ between ranks 0 and 1"
        )
        if unlike_ranks:
            return Verdict(
                5,
                "FAIL",
                f"{figure}; {ranks_figure}: {unlike_ranks[0]}",
                "a part that rank 0 saves differs on "
                "rank 1 after a step, so the ranks evaluate and resume from different states (an "
                "EMA that only rank 0 updates?): update every part on every rank",
            )
    if not differ and parts["torchrun"]:
        unlike_resumed = unlike(parts["torchrun"][0], parts["resumed"][0])
        figure += (
            f" (bit-identical); {ranks_figure}, and {len(part_names(unlike_resumed))} differ "
            "after the resume"
        )
        if unlike_resumed:
            return Verdict(
                5,
                "FAIL",
                f"{figure}: {unlike_resumed[0]}",
                "a part that the checkpoint holds "
                "does not resume as it was saved: see restore_checkpoint()",
            )
        return Verdict(5, "pass", figure)
    if not differ:
        return Verdict(5, "pass", f"{figure} (bit-identical){unseen}")
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
            f"Dataset draws random numbers in DataLoader workers, which start afresh at a resume{unseen}",
        )  # fmt: skip
    counters = c.numbers_that_restarted()
    if counters:
        return Verdict(
            5,
            "FAIL",
            f"{figure}; the same batches in the same order; {counters[0]}",
            "a number that the checkpoint does not hold started again at the resume: keep it in a "
            "buffer of the model (register_buffer) or in a part that the checkpoint holds",
        )
    return Verdict(
        5, "FAIL", f"{figure}; the same batches in the same order",
        "state that the checkpoint does not hold, such as a generator of your own (a "
        "torch.Generator, random.Random or np.random.default_rng) or a counter in a module: draw "
        "from torch's, random's or numpy's global generators, which the script seeds per rank and "
        "checkpoints, and keep other state in a part that the checkpoint holds",
    )  # fmt: skip


def check_eval(c: CopyCheck) -> Verdict:
    # The python launch's last evaluation is of its final weights, which its checkpoint holds.
    # eval_2 evaluates that checkpoint on 2 processes.
    evaluations = [json.loads(line) for line in c.lines("python", "records.jsonl")]
    one = [record for record in evaluations if "eval_loss" in record][-1]
    two = json.loads(c.lines("eval_2", "records.jsonl")[-1])
    # The --eval-only of an older copy evaluates no averaged model, such as an EMA. So the figures
    # of an averaged model, eval_<name>_loss and the others of eval_<name>_, may be left out of it.
    # A figure of the model that is left out counts as a gap of inf.
    averaged = tuple(
        name.removesuffix("loss") for name in one if re.fullmatch(r"eval_\w+_loss", name)
    )
    left_out = [name for name in one if name.startswith(averaged) and name not in two]
    evaluated = [name for name in one if "eval_" in name and name not in left_out]
    gaps = {name: relative(two.get(name, math.inf), one[name]) for name in evaluated}
    worst = max(gaps, key=gaps.get)
    items = list(range(one["eval_samples"]))
    once = [
        sorted(i for rank in range(world) for b in c.batches(name, rank, "eval") for i in b)
        == items
        for name, world in (("python", 1), ("eval_2", 2))
    ]
    figure = (
        f"on 1 and 2 processes eval_loss {one['eval_loss']:.7g} and {two['eval_loss']:.7g}, every "
        f"figure within {gaps[worst]:.1e} ({worst}); each of the {len(items)} items evaluated "
        f"once: {'yes' if once[0] else 'no'} and {'yes' if once[1] else 'no'}"
    )
    if gaps[worst] <= TOLERANCE and all(once):
        return Verdict(6, "pass", figure)
    if check_same_data(c).status == "FAIL":
        return Verdict(6, "FAIL", figure, "the processes build different data (see 4)")
    if all(once) and c.probe()["eval_random"]:
        return Verdict(
            6,
            "n/a",
            f"{figure}: compute_loss draws random numbers in evaluation, and another "
            "world size gives each item other draws, by design",
        )
    if all(once) and gaps["eval_loss"] <= TOLERANCE:
        return Verdict(
            6,
            "FAIL",
            figure,
            f"{worst} is not a mean over the items: a figure of each rank's own "
            "items, such as an F1 of its predictions, changes with the world size. Return per-item "
            "means whose count-weighted mean is exact, and compute the figure from them",
        )
    return Verdict(
        6, "FAIL", figure, "a loss that is not the mean over its count; else the eval loader's "
        "sampler, or the sums over the ranks, were changed: rank r evaluates items r, r + world "
        "size..., and the ranks' sums (not means) are added",
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
    # A step of the torchrun launch trains 2 micro-batches of B on each of 2 ranks.
    steps = min(c.data("torchrun", 0)["train"]["len"], c.train_items) // (2 * c.g)
    share = steps * 2 * c.b  # This is the number of a rank's items in an epoch.
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


# The wrapper starts the line with this where the check cannot check a copy.
WRAPPER_REFUSED = "make check: error: "

CHECKS = {
    1: check_launch_modes, 2: check_equivalence, 3: check_mean, 4: check_same_data,
    5: check_resume, 6: check_eval, 7: check_model_file, 8: check_shares,
}  # fmt: skip


def check_copy(script, args: list[str], work: Path, only=()) -> list[Verdict]:
    """Check the guarantees that `only` names on a user's script with their ARGS, and print one line
    for each. An empty `only` checks all of them. The launches go into `work`."""
    numbers = sorted(only or GUARANTEES)
    c = CopyCheck(script, args, work)
    started = time.monotonic()
    print(
        f"checking {' '.join([str(script), *args])}: 2 x {c.b}, 1 x {c.g} and 1 x {c.b} x 2 "
        f"accumulated, torchrun 2 x {c.b} x 2 accumulated, on at most {c.train_items} training "
        f"and {c.eval_items} eval items, 2 epochs; the runs: {work}"
    )
    names = {name for n in numbers for name in NEEDS[n]}
    # Add the launches that they read, and in turn the launches that those read.
    while any(set(LAUNCHES[name].after) - names for name in names):
        names |= {before for name in names for before in LAUNCHES[name].after}
    c.run_launches(names)
    # The wrapper says why the check cannot check this copy, as for a stream. Then every check is n/a.
    said = [script_said(result) for result in c.results.values()]
    refused = next((line.split(WRAPPER_REFUSED)[1] for line in said if WRAPPER_REFUSED in line), "")
    verdicts = []
    for n in numbers:
        problem = c.launch_problem(NEEDS[n])
        try:
            # Here --eval-only refuses to run, as it should.
            if n == 6 and c.eval_set_size() == 0:
                verdict = Verdict(6, "n/a", "build_datasets gives no eval set")
            elif refused:
                verdict = Verdict(n, "n/a", refused)
            elif problem and n == 2 and "not finite" in problem:
                cause = (
                    "check 2's own plain SGD diverged at the rate that it chose, and your --lr "
                    "does not set that rate: run the other checks with CHECKS=1,3,4,5,6,7,8"
                )
                verdict = Verdict(n, "FAIL", problem, cause)
            elif problem:
                verdict = Verdict(n, "FAIL", problem, "its line names it")
            else:
                verdict = CHECKS[n](c)
        except Exception as exc:  # A launch left something other than what the check expects.
            figure = f"the check could not read its launches: {one_line(repr(exc))}"
            verdict = Verdict(n, "FAIL", figure, "a loop the wrapper cannot follow: see run.err")
        print(verdict)
        verdicts.append(verdict)
    # The weights of a large model take gigabytes. The verdicts are in, so only the logs stay.
    for path in work.rglob("*.pt*"):
        if path.name.endswith((".pt", ".pt.tmp")):
            path.unlink()
    counts = {
        status: sum(v.status == status for v in verdicts) for status in ("pass", "n/a", "FAIL")
    }
    seconds = time.monotonic() - started
    print(f"{counts['pass']} pass, {counts['n/a']} n/a, {counts['FAIL']} fail ({seconds:.0f} s)")
    return verdicts


# ---------------------------------------------------------------------------
# make check runs this command line with SCRIPT, ARGS and CHECKS.
# ---------------------------------------------------------------------------


def guarantee_numbers(text: str) -> list[int]:
    """Parse the numbers of --checks, such as 2,3. Each number names one of the guarantees. An
    empty list stands for all of them."""
    numbers = [n.strip() for n in text.split(",") if n.strip()]
    wrong = [n for n in numbers if not n.isdigit() or int(n) not in GUARANTEES]
    if wrong:
        raise argparse.ArgumentTypeError(f"{wrong[0]} is no guarantee (1 to {len(GUARANTEES)})")
    return [int(n) for n in numbers]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "script", help="your training script (a copy of ddp_train.py, or one that imports it)"
    )
    parser.add_argument(
        "--args", default="", help='its flags as one string, as --args="--batch-size 8"'
    )
    parser.add_argument(
        "--checks", type=guarantee_numbers, default=[], help="only these guarantees, as 2,3"
    )
    parser.add_argument(
        "--work", help="the folder of the launches, made anew (default out/check/NAME)"
    )
    options = parser.parse_args(argv)
    script = options.script
    if not script:  # This happens with make check SCRIPT= and no script.
        print('make check SCRIPT=mine.py ARGS="...": the guarantees, on your copy')
        return 0
    if not Path(script).is_file():
        print(f"make check: there is no {script}: SCRIPT=your script, as make train takes it")
        return 1
    work = Path(options.work or Path("out/check") / Path(script).stem).resolve()
    if work in (Path.cwd(), *Path.cwd().parents) or work in Path(script).resolve().parents:
        print(f"make check: {work} holds your files, and the check would replace it")
        return 2
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    share_slots()
    try:
        verdicts = check_copy(script, shlex.split(options.args), work, options.checks)
    except Exception as exc:
        print(f"make check: the check itself failed: {exc!r}")
        return 1
    return 1 if any(v.status == "FAIL" for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
