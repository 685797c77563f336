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
    # down under a live DDP model.
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
    """A Planned object is a launch of the user's script through the wrapper. It trains 2 epochs of
    at most 4 global batches."""

    mode: str  # The mode is python, torchrun with 2 processes, or spawn with --spawn 2.
    batch: int  # This is --batch-size in units of B. Every launch's global batch is 2B.
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
    "torchrun": Planned("torchrun", 1, 1, "torchrun", dict(CHECK_DESCRIBE=1, CHECK_INITIAL=1)),
    # This launch gets SIGTERM in step 2. Then every rank is in the loop, because step 1's
    # all-reduce waited for all of them.
    "stopped": Planned("torchrun", 1, 1, "stopped", dict(CHECK_STOP_AT=2)),
    "spawn": Planned("spawn", 1, 1, "spawn", {}),
    # Check 2's launches are 1 x 2B, 2 x B, 1 x B x 2 accumulated, and the control at twice the
    # rate. They run the user's loop and loss, with BatchNorm, dropout and the Dataset's draws
    # neutralised.
    "single": Planned("python", 2, 1, "single", NEUTRAL_SGD | {"CHECK_DESCRIBE": 1}),
    "pair": Planned("spawn", 1, 1, "pair", NEUTRAL_SGD),
    "accum": Planned("python", 1, 2, "accum", NEUTRAL_SGD),
    "grad_x2": Planned("python", 2, 1, "grad_x2", NEUTRAL_SGD | {"CHECK_SGD": 2}),
    # The resumed launch runs the same command as the stopped launch.
    "resumed": Planned("torchrun", 1, 1, "stopped", {}, after=("stopped",)),
    "eval_2": Planned("torchrun", 1, 1, "python", {}, eval_only=True, after=("python",)),
    # One process computes the figures alone. It uses torchrun's first step and python's weights.
    "probe": Planned("python", 2, 1, "python", {}, after=("python", "torchrun")),
}
# Each check reads these launches.
NEEDS = {
    1: ("python", "torchrun", "spawn"),
    2: ("single", "pair", "accum", "grad_x2", "probe"),
    3: ("python", "torchrun", "probe"),
    4: ("python", "torchrun"),
    5: ("python", "torchrun", "stopped", "resumed"),  # python tells whether the data differ.
    6: ("python", "torchrun", "eval_2"),  # torchrun tells whether the data differ.
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
        # Every launch has this global batch, as 2 x B, 1 x 2B or 1 x B x 2.
        self.g = 2 * self.b
        # The one extra eval item makes the eval shares uneven.
        self.train_items, self.eval_items = 4 * self.g, self.g + 1
        # The wrapper takes the script's name, so that name appears in its lines.
        self.wrapper = work / "wrapper" / self.script.name
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
        if not self.batches("torchrun", 0):
            raise RuntimeError(
                "the wrapper saw no training batch: it follows a loop that makes its DataLoader "
                "as DataLoader(...), the name the script imports"
            )
        return {
            # The initial weights are rank 0's, because DDP sends those.
            "initial": str(self.records("torchrun") / "initial.pt"),
            "first_step": [self.batches("torchrun", rank)[0] for rank in range(2)],
            "final": str(self.work / "python/model.pt"),
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


def script_said(result) -> str:
    """Return the line that the script stopped with, such as `NAME: error: ...`. Otherwise return
    the last line of its stderr."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    said = [line for line in lines if ": error: " in line]
    return one_line((said or lines or ["nothing on stderr"])[-1])


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


def neutralised(n: dict, train: dict) -> str:
    """Return what check 2's launches neutralised, for the check's line."""
    parts = [f"{kind} x {count} at fixed statistics" for kind, count in n["batch_norms"].items()]
    if n["dropouts"]:
        parts.append(f"Dropout x {n['dropouts']} off")
    parts += [f"the dropout of {name} off" for name in n["functions"]]
    if train["random_reads"] and not train["own_draws"]:
        parts.append("the Dataset's draws seeded per item")
    return ", ".join(parts)


def differs_by_design(n: dict, train: dict) -> str:
    """Return why N x B and 1 x N*B still differ by design in check 2's launches, or ''."""
    why = []
    if n["stateful"]:
        why.append(f"in training, your model's {n['stateful'][0]} keeps state that training moves")
    elif n["mixing"]:
        layer = f"{n['mixing_layer']}'s output" if n["mixing_layer"] else "output"
        why.append(
            f"in training, your model's {layer} for an item depends on the rest of its batch"
        )
    if n["random"]:
        why.append("your model draws random numbers in training, outside dropout")
    if train["own_draws"]:
        why.append("your Dataset draws from generators of its own, which the check cannot seed")
    return "; ".join(why) + (": each process its own, by design" if why else "")


def loss_mixes_items(p: dict) -> bool:
    """Return whether, in evaluation, a batch's loss differs from the count-weighted mean of its
    items' losses. A sum or a mean of means makes it differ."""
    return relative(p["batch_over_items"], 1.0) > TOLERANCE


def check_equivalence(c: CopyCheck) -> Verdict:
    one_process = c.results["single"].weights
    gap = {name: weights_gap(c.results[name].weights, one_process) for name in ("pair", "accum")}
    # The control trains the same way at 2 x the rate.
    control = weights_gap(c.results["grad_x2"].weights, one_process)
    p, train = c.probe(), c.data("single", 0)["train"]
    neutral = neutralised(p["neutral"], train)
    figure = (
        f"2 x {c.b} and 1 x {c.g} differ by {gap['pair']:.1e}, 1 x {c.b} x 2 accumulated by "
        f"{gap['accum']:.1e} (relative, of the weights; tolerance {TOLERANCE:g}; at twice the "
        f"learning rate, as a loss summed over 2 ranks trains: {control:.1e}, which must exceed "
        f"{100 * TOLERANCE:g} to tell; plain SGD, installed by the check"
        + (f"; {neutral})" if neutral else ")")
    )
    design = differs_by_design(p["neutral"], train)
    # A loss that mixes items does not do so by design.
    if design and not loss_mixes_items(p):
        return Verdict(2, "n/a", f"{figure}: {design}")
    if control < 100 * TOLERANCE:
        return Verdict(2, "n/a", f"{figure}: the weights move too little to tell")
    if max(gap["pair"], gap["accum"]) <= TOLERANCE:
        return Verdict(2, "pass", figure)
    if check_same_data(c).status == "FAIL":
        cause = "the processes train on different data (see 4)"
    elif p["loss_2b_over_b"] > 1.5:
        cause = "compute_loss returns a sum, which grows with the batch (see 3)"
    elif loss_mixes_items(p):
        cause = "compute_loss's loss is not the mean over its count items (see 3)"
    elif gap["pair"] <= TOLERANCE:
        cause = (
            "the loop weighs the micro-batches of an accumulated step wrongly: each mean weighs its "
            "count over the step's count (a loss divided by --grad-accum twice?)"
        )
    elif gap["accum"] <= TOLERANCE:
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
    # The python launch's last evaluation is of its final weights, which its checkpoint holds.
    # eval_2 evaluates that checkpoint on 2 processes.
    evaluations = [json.loads(line) for line in c.lines("python", "records.jsonl")]
    one = [record for record in evaluations if "eval_loss" in record][-1]
    two = json.loads(c.lines("eval_2", "records.jsonl")[-1])
    gaps = {name: relative(two[name], value) for name, value in one.items() if "eval_" in name}
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
    share = steps * c.b  # This is the number of a rank's items in an epoch.
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
    """Check the guarantees that `only` names on a user's script with their ARGS, and print one line
    for each. An empty `only` checks all of them. The launches go into `work`."""
    numbers = sorted(only or GUARANTEES)
    c = CopyCheck(script, args, work)
    started = time.monotonic()
    print(
        f"checking {' '.join([str(script), *args])}: 2 x {c.b}, 1 x {c.g} and 1 x {c.b} x 2 "
        f"accumulated, on at most {c.train_items} training and {c.eval_items} eval items, 2 "
        f"epochs; the runs: {work}"
    )
    names = {name for n in numbers for name in NEEDS[n]}
    # Add the launches that they read, and in turn the launches that those read.
    while any(set(LAUNCHES[name].after) - names for name in names):
        names |= {before for name in names for before in LAUNCHES[name].after}
    c.run_launches(names)
    verdicts = []
    for n in numbers:
        problem = c.launch_problem(NEEDS[n])
        try:
            # Here --eval-only refuses to run, as it should.
            if n == 6 and c.eval_set_size() == 0:
                verdict = Verdict(6, "n/a", "build_datasets gives no eval set")
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


CHECK_WRAPPER = r'''
"""This is make check's hidden wrapper. It runs as the user's script, with its name, flags and task
functions. What the CHECK_* variables ask for is installed around the task functions. The wrapper's
own files go to CHECK_RECORDS."""

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
# Check 2's launches run the user's loop and loss with BatchNorm at fixed statistics, dropout off
# and the Dataset's draws seeded per item, so that N x B and 1 x N*B must train the same weights.
NEUTRAL = "CHECK_NEUTRAL" in env
# This is True while the wrapper writes its records, so that the audit leaves them out.
own_write = False


def record(name, line):
    global own_write
    own_write = True
    try:
        with open(os.path.join(RECORDS, name), "a") as f:
            f.write(line + "\n")
    finally:
        own_write = False


def audit(event, args):
    """Record the writes of a non-zero rank, anywhere, because rank 0 alone writes."""
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
    elif event in ("os.rename", "os.remove", "os.truncate"):  # A new directory is not a file.
        # shutil.rmtree removes a directory's files by their names, relative to its descriptor.
        path, dir_fd = args[0], -1  # A dir_fd of -1 means the path alone.
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
    """Return the user's script as a module, which is what `python SCRIPT` defines, and the module
    that trains. The module that trains is the script itself where it is a copy of ddp_train.py
    with its own train() and task functions. Otherwise it is the ddp_train that the script imports
    and sets the task functions of."""
    # The script's imports then resolve as they would in its own run.
    sys.path[0] = os.path.dirname(os.path.abspath(path))
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
    """Return a hash of an item's values. The values may be tensors, arrays, numbers, strings, and
    any nesting of them."""
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
    """Return the Dataset's length and the hashes of 8 of its items, spread over it. Each item is
    read from a random state of its index, and this also holds for an augmenting Dataset. Then the
    item is read again from another state. Where the two reads differ, the Dataset draws random
    numbers as it reads. A third read from the first state tells whether the draws come from
    generators of the Dataset's own, which no seed outside reaches."""
    if dataset is None or not hasattr(dataset, "__len__"):
        return None
    n = len(dataset)
    picked = sorted({i * (n - 1) // 7 for i in range(8)}) if n else []
    states = random_states()
    digests, random_reads, own_draws = [], False, False
    for i in picked:
        reads = []
        for seed in (i, i + 1, i):
            seed_all(seed)
            reads.append(item_digest(dataset[i]))
        digests.append(reads[0])
        random_reads |= reads[0] != reads[1]
        own_draws |= reads[0] != reads[2]
    set_random_states(states)
    described = {"len": n, "picked": picked, "digests": digests, "random_reads": random_reads}
    return described | {"own_draws": own_draws}


class Recorded(torch.utils.data.Dataset):
    """A Recorded set holds the first `size` items of a Dataset for RecordedLoader. The tag is train
    or eval."""

    def __init__(self, dataset, tag, size):
        self.dataset, self.tag, self.size = dataset, tag, min(size, len(dataset))
        # The probe keeps each item that it reads here, and read_items explains why.
        self.kept = None

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return read_item(self.dataset, i) if NEUTRAL else self.dataset[i]

    def __getitems__(self, indices):
        if NEUTRAL:
            return read_items(self.dataset, indices)
        if callable(getattr(self.dataset, "__getitems__", None)):
            return self.dataset.__getitems__(indices)
        return [self.dataset[i] for i in indices]

    def __getattr__(self, name):  # Code that reads the Dataset's own attributes gets them here.
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class TakenBatches:
    """This puts a batch sampler's batches in a queue as the DataLoader takes them. The DataLoader
    takes them ahead of the loop."""

    def __init__(self, batches):
        self.batches, self.taken = batches, collections.deque()

    def __iter__(self):
        # A new pass starts with an empty queue, because a pass that was left early loaded some
        # batches ahead.
        self.taken = collections.deque()
        for indices in self.batches:
            self.taken.append(indices)
            yield indices

    def __len__(self):
        return len(self.batches)


class RecordedLoader(DataLoader):
    """This is the script's DataLoader. For a Recorded set, it records each batch's indices when
    the loop gets the batch. So the records hold the batches that the loop trained or evaluated, in
    order, with DataLoader workers or without them."""

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(DataLoader).bind(*args, **kwargs).arguments
        dataset = bound["dataset"]
        self.tag = dataset.tag if isinstance(dataset, Recorded) else None
        # With a tag, its batch sampler, or the one that DataLoader would make, goes into a
        # TakenBatches.
        if self.tag:
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
        # This calls it now, because iter() starts the workers, as the script expects.
        iterator = super().__iter__()
        return self.recorded(iterator) if self.tag else iterator

    def recorded(self, iterator):
        if self.tag == "eval":  # This line starts an evaluation, and check 6 reads the last one.
            record(f"reads.{RANK}", "eval")
        for batch in iterator:
            indices = self.batch_sampler.taken.popleft()
            record(f"reads.{RANK}", f"{self.tag} {' '.join(map(str, indices))}")
            yield batch


def stop_torchrun():
    """Send SIGTERM to torchrun, as a scheduler does when it stops a job. Return once torchrun has
    passed the signal on to this process."""
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
    # The script's loop handles no signal, so the signal takes its default action.
    if not callable(script_handler):
        os.kill(os.getpid(), signal.SIGTERM)


def install(target):
    """Install the check's pieces around the task functions that the run calls."""
    # These are the user's functions. A copy of today's script counts a batch's items with
    # count_items(), and an older copy's compute_loss returns the count.
    names = ("build_datasets", "build_model", "compute_loss", "report", "count_items")
    task = {name: getattr(target, name) for name in names if hasattr(target, name)}
    training_calls = [0]
    built = {}  # This keeps the user's Datasets as build_datasets gave them.
    neutral = {}  # This keeps the SGD rate and the BatchNorm statistics of check 2's launches.

    def neutral_settings():
        """Compute the check's SGD rate and BatchNorm statistics once in this process. They come
        from the same items at the initial weights in every process, so they are the same. The
        task code runs as in one plain process, without a rank, so that a model whose initial
        weights depend on the rank gives every process rank 0's, as DDP does."""
        if not neutral:
            states, kept = random_states(), dict(built)
            launcher = {name: env.pop(name) for name in ("RANK", "LOCAL_RANK") if name in env}
            try:
                neutral["rate"] = sgd_rate(target, task, sys.argv[1:])
                neutral["statistics"] = calibrate_batch_norms(target, task, sys.argv[1:])
            finally:
                env.update(launcher)
                built.update(kept)
                set_random_states(states)
        return neutral

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
        if NEUTRAL and batch_norms(model):
            freeze_batch_norms(model, neutral_settings()["statistics"])
        # Rank 0 saves its weights, because DDP sends rank 0's weights to all ranks.
        if "CHECK_INITIAL" in env and RANK == "0":
            torch.save(model.state_dict(), os.path.join(RECORDS, "initial.pt"))
        return model

    # The wrappers take the arguments of the script's calls, which older copies make with fewer.
    def compute_loss(model, batch, *args):
        if model.training:
            training_calls[0] += 1
            # Describe the sets once this rank trains. By then the script has seeded each rank and
            # made its first reads.
            if training_calls[0] == 1 and "CHECK_DESCRIBE" in env:
                sets = {part: describe(dataset) for part, dataset in built.items()}
                record(f"data.{RANK}", json.dumps(sets))
            first_run = env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if RANK == "0" and first_run and training_calls[0] == int(env.get("CHECK_STOP_AT", 0)):
                stop_torchrun()
        return call_task(task["compute_loss"], model, batch, *args or [None])

    def report(record_, args, model):
        record("records.jsonl", json.dumps(record_))
        task["report"](record_, args, model)

    target.build_datasets, target.build_model = build_datasets, build_model
    target.compute_loss, target.report = compute_loss, report
    target.DataLoader = RecordedLoader
    if NEUTRAL:
        switch_off_dropout()
    # Plain SGD at the check's rate times CHECK_SGD lets the scale of a gradient show.
    if "CHECK_SGD" in env:

        def build_optimizer(args, model, *plan):
            rate = neutral_settings()["rate"] * float(env["CHECK_SGD"])
            return torch.optim.SGD(model.parameters(), lr=rate)

        def build_scheduler(args, optimizer, *plan):
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

        target.build_optimizer, target.build_scheduler = build_optimizer, build_scheduler
    return task


def loss_and_count(task, model, batch, args):
    """Return the loss of a batch and the count of its items, from a copy of today's script or an
    older one."""
    output = call_task(task["compute_loss"], model, batch, args)
    if "count_items" not in task:  # An older copy's compute_loss returns (loss, count, ...).
        return output[0], output[1]
    loss = output
    if isinstance(output, tuple):  # Today's compute_loss may return (loss, metrics).
        loss = output[0]
    return loss, task["count_items"](batch)


def call_task(function, *arguments):
    """Call a task function with as many of the arguments as it takes, as older copies of the
    script did. A copy older than that passes no args to compute_loss, and then args is None."""
    parameters = inspect.signature(function).parameters
    return function(*arguments[: len(parameters)])


def to_float64(batch):
    """Return a batch with its floating tensors in float64, for the check's independent figures."""
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
    """Read items of a Recorded set, as read_items reads them."""
    return read_items(dataset.dataset, indices, dataset.kept)


def seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)


def random_states():
    numpy = sys.modules.get("numpy")
    return torch.get_rng_state(), random.getstate(), numpy and numpy.random.get_state()


def set_random_states(states):
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    if states[2] is not None:
        sys.modules["numpy"].random.set_state(states[2])


def read_items(dataset, indices, kept=None):
    """Read items as the DataLoader fetches them. Each item is read from a random state of its own
    index, so a Dataset that draws random numbers gives an item the same values each time, alone
    or in a batch, in any process. A Dataset with __getitems__, such as torch's Subset, reads one
    index at a time, and the parts are joined into the batch that it would give. The global
    random state is put back afterwards. Where `kept` is a dict, an item is read only once and
    kept there by its index. The probe compares losses over the same items in several batches,
    and a Dataset that draws from generators of its own gives new values at every read."""
    states = random_states()
    try:
        reads_batches = callable(getattr(dataset, "__getitems__", None))
        parts = []
        for i in indices:
            if kept is not None and i in kept:
                parts.append(kept[i])
                continue
            seed_all(i)
            parts.append(dataset.__getitems__([i]) if reads_batches else dataset[i])
            if kept is not None:
                kept[i] = parts[-1]
        if not reads_batches:
            return parts
        if all(isinstance(part, list) for part in parts):  # Subset gives a list of items.
            return [item for part in parts for item in part]
        if all(isinstance(part, tuple) and all(map(torch.is_tensor, part)) for part in parts):
            # This is a batch of tensors.
            return tuple(torch.cat(fields) for fields in zip(*parts))
        values = [value for part in parts if isinstance(part, dict) for value in part.values()]
        if all(isinstance(part, dict) for part in parts) and all(map(torch.is_tensor, values)):
            # This is a dict of tensors.
            return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
        # A batch of another kind is read at once, from one random state.
        seed_all(indices[0])
        return dataset.__getitems__(indices)
    finally:
        set_random_states(states)


def read_item(dataset, i):
    """Read one item from the random state of its index, as read_items reads it."""
    states = random_states()
    try:
        seed_all(i)
        return dataset[i]
    finally:
        set_random_states(states)


F = torch.nn.functional
DROPOUT_FUNCTIONS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout")
DROPOUT_FUNCTIONS += ("feature_alpha_dropout",)
DROPOUT_MODULES = (torch.nn.modules.dropout._DropoutNd,)
# This set collects the dropout functions that the model called with a rate above 0.
dropouts_seen = set()


def switch_off_dropout():
    """Make every dropout an identity. This covers torch's dropout functions, which nn.Dropout calls
    and a model may call itself, and the dropout_p of F.scaled_dot_product_attention. It returns a
    function that puts them back."""
    originals = {name: getattr(F, name) for name in DROPOUT_FUNCTIONS}
    originals["scaled_dot_product_attention"] = F.scaled_dot_product_attention

    def identity(name):
        def dropout(input, p=0.5, *args, **kwargs):
            if p:
                dropouts_seen.add(name)
            return input

        return dropout

    def attention(*args, **kwargs):
        args = list(args)
        if len(args) > 4:  # dropout_p is the fifth parameter.
            rate, args[4] = args[4], 0.0
        else:
            rate, kwargs["dropout_p"] = kwargs.get("dropout_p", 0.0), 0.0
        if rate:
            dropouts_seen.add("scaled_dot_product_attention")
        return originals["scaled_dot_product_attention"](*args, **kwargs)

    for name in DROPOUT_FUNCTIONS:
        setattr(F, name, identity(name))
    F.scaled_dot_product_attention = attention
    return lambda: [setattr(F, name, function) for name, function in originals.items()]


def batch_norms(model):
    """Return the BatchNorm layers that keep running statistics, by name."""
    kind = torch.nn.modules.batchnorm._BatchNorm
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, kind) and module.running_mean is not None
    }


def freeze_batch_norms(model, statistics):
    """Make each BatchNorm normalise with the calibrated statistics, as in eval mode, for good. Even
    an edited loop's model.train() leaves it in eval mode."""
    for name, module in batch_norms(model).items():
        module.running_mean.copy_(statistics[f"{name}.running_mean"])
        module.running_var.copy_(statistics[f"{name}.running_var"])
        module.eval()
        module.train = lambda mode=True, module=module: module


def initial_task(target, task, argv):
    """Return the flags, the training set and the model at its initial weights. They are built and
    seeded as the script builds them."""
    args = target.parse_args(argv)
    seed = getattr(target, "seed_everything", torch.manual_seed)
    # The script seeds before build_datasets and again before build_model, and so does this code.
    seed(args.seed)
    train_set, _ = target.build_datasets(args)
    seed(args.seed)
    return args, train_set, task["build_model"](args)


def calibrate_batch_norms(target, task, argv):
    """Compute the statistics of each BatchNorm at the initial weights, over the first training
    items that the launches train, with dropout off. They are an average over all those items, so
    they normalise as well as batch statistics, and every launch gets the same ones."""
    args, train_set, model = initial_task(target, task, argv)
    norms = batch_norms(model)
    if not norms:
        return {}
    batch_size = int(env["CHECK_GLOBAL_BATCH"])
    for module in norms.values():
        module.reset_running_stats()
        module.momentum = None  # None gives a cumulative average over the batches.
    model.train()
    restore = switch_off_dropout()
    try:
        with torch.no_grad():
            for start in range(0, len(train_set), batch_size):
                indices = list(range(start, min(start + batch_size, len(train_set))))
                batch = target.collate_fn(read_items(train_set.dataset, indices))
                call_task(task["compute_loss"], model, batch, args)
    finally:
        restore()
    return {
        f"{name}.{buffer}": getattr(module, buffer).clone()
        for name, module in norms.items()
        for buffer in ("running_mean", "running_var")
    }


class Losses:
    """Losses computes compute_loss over batches of a Dataset at given weights. Each batch gets a
    model of its own, made afresh, as a fresh process computes it. So a layer with state starts from
    the state in the weights."""

    def __init__(self, args, task, collate_fn, statistics=None):
        self.args, self.task, self.collate_fn = args, task, collate_fn
        # These are BatchNorm's calibrated statistics, as check 2 fixes them.
        self.statistics = statistics

    def model(self, weights, train, float64=False):
        model = self.task["build_model"](self.args)
        model.load_state_dict(torch.load(weights, weights_only=True))
        model.train(train)
        if self.statistics is not None:
            freeze_batch_norms(model, self.statistics)
        return model.double() if float64 else model

    def mean(self, weights, train, dataset, batches, float64=False, seed=0):
        """Return the count-weighted mean of compute_loss over batches, and the count. Each batch
        is a list of indices. `train` sets training mode or not. The model's random draws, such as
        dropout, come from `seed`."""
        total, count = 0.0, 0.0
        for indices in batches:
            model = self.model(weights, train, float64)
            batch = self.collate_fn(read(dataset, indices))
            seed_all(seed)
            batch = to_float64(batch) if float64 else batch
            loss, n = loss_and_count(self.task, model, batch, self.args)
            total += float(loss) * float(n)
            count += float(n)
        return (total / count if count else 0.0), count

    def mean_float64(self, weights, train, dataset, batches):
        """Return (mean, count) and the precision. The precision is float64 where the model and
        compute_loss allow it."""
        try:
            return self.mean(weights, train, dataset, batches, float64=True), "float64"
        except Exception:
            return self.mean(weights, train, dataset, batches), "float32"


def probe(target, task, argv, inputs):
    """Compute the figures that checks 2, 3 and 7 compare the launches with. This runs in one
    process, without a process group. The inputs are the initial weights from torchrun's rank 0,
    each rank's first micro-batch there, and the final weights from the python launch."""
    args = target.parse_args(argv)
    # The script seeds like this before build_datasets.
    getattr(target, "seed_everything", torch.manual_seed)(args.seed)
    # The Datasets are as the launches had them, because install()'s build_datasets gives their
    # first items. The model and compute_loss are the user's own, from task.
    train_set, eval_set = target.build_datasets(args)
    train_set.kept = {}  # Each figure below compares losses over the same items, read once.
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
        # One micro-batch from two random states gives the same loss, unless training draws
        # random numbers.
        draws = [
            losses.mean(initial, True, train_set, micro_batches[:1], seed=s)[0] for s in (1, 2)
        ]
        found["random_in_training"] = draws[0] != draws[1]
        # In evaluation there is no dropout and there are no batch statistics. Then a mean over a
        # batch's count is the count-weighted mean of its items' losses, each computed alone. A sum
        # is B times that mean.
        alone = losses.mean(initial, False, train_set, each)[0]
        found["batch_over_items"] = losses.mean(initial, False, train_set, micro_batches)[0] / alone
        found["item_counts"] = [losses.mean(initial, False, train_set, [i])[1] for i in each]
        # A mean of 2B items is the count-weighted mean of its halves' means. A sum of 2B items is
        # the sum of its halves' sums.
        both = losses.mean(initial, False, train_set, [items])[0]
        halves = losses.mean(
            initial, False, train_set, [items[: len(items) // 2], items[len(items) // 2 :]]
        )[0]
        found["loss_2b_over_b"] = both / halves if halves else 1.0
        # In training, this tells whether a layer's output depends on the rest of the batch, as
        # with BatchNorm.
        try:
            batched = losses.mean(initial, True, train_set, micro_batches)[0]
            found["batch_dependent"] = abs(
                losses.mean(initial, True, train_set, each)[0] - batched
            ) > 1e-5 * abs(batched)
        except Exception:  # BatchNorm of one item in training raises an error.
            found["batch_dependent"] = True
        found["stateful"] = stateful_layers(losses, initial, train_set, micro_batches[0])
        # Compute step 1 item by item, or as each rank's micro-batch.
        if not found["random_in_training"]:
            per = micro_batches if found["batch_dependent"] else each
            (found["step_1"], _), found["precision"] = losses.mean_float64(
                initial, True, train_set, per
            )
        # The eval loss uses the final weights, with each eval item alone.
        if eval_set is not None and len(eval_set):
            per_item = [[i] for i in range(len(eval_set))]
            (found["eval_loss"], _), _ = losses.mean_float64(final, False, eval_set, per_item)
    found["load_error"] = load_error(task["build_model"](args), final)
    statistics = calibrate_batch_norms(target, task, argv)
    found["neutral"] = neutral_figures(losses, inputs, train_set, statistics)
    return found


def neutral_figures(losses, inputs, train_set, statistics):
    """Return what check 2's launches neutralise, and what still differs from process to process
    there. The launches hold BatchNorm at the calibrated statistics, switch dropout off, and read
    each item from its own random state."""
    neutral = Losses(losses.args, losses.task, losses.collate_fn, statistics)
    initial, micro_batch = inputs["initial"], inputs["first_step"][0]
    model = neutral.model(initial, True)
    found = {
        "batch_norms": collections.Counter(type(m).__name__ for m in batch_norms(model).values()),
        "dropouts": sum(isinstance(m, DROPOUT_MODULES) for m in model.modules()),
    }
    dropouts_seen.clear()
    restore = switch_off_dropout()
    try:
        with torch.no_grad():
            draws = [
                neutral.mean(initial, True, train_set, [micro_batch], seed=s)[0] for s in (1, 2)
            ]
            found["random"] = draws[0] != draws[1]
            try:
                alone = neutral.mean(initial, True, train_set, [[i] for i in micro_batch])[0]
                found["mixing"] = abs(alone - draws[0]) > 1e-5 * abs(draws[0])
            except Exception:  # A layer that mixes items may refuse a batch of one.
                found["mixing"] = True
            found["mixing_layer"] = None
            if found["mixing"]:
                found["mixing_layer"] = mixing_layer(neutral, initial, train_set, micro_batch)
            found["stateful"] = stateful_layers(neutral, initial, train_set, micro_batch)
    finally:
        restore()
    implied = {"dropout"} if found["dropouts"] else set()  # nn.Dropout calls F.dropout.
    found["functions"] = sorted(dropouts_seen - implied)
    return found


def mixing_layer(losses, weights, dataset, items):
    """Return the first layer, in the order that the forward calls them, whose output for the first
    item changes when the rest of its batch is there. Return None when no layer does."""
    outputs = {}
    for run, indices in (("batch", items), ("alone", items[:1])):
        model, outputs[run] = losses.model(weights, True), []
        leaves = [m for m in model.modules() if not list(m.children())]
        hooks = [
            m.register_forward_hook(lambda m, i, o, run=run: outputs[run].append((m, o)))
            for m in leaves
        ]
        seed_all(0)
        try:
            batch = losses.collate_fn(read(dataset, indices))
            call_task(losses.task["compute_loss"], model, batch, losses.args)
        except Exception:
            return None
        finally:
            for hook in hooks:
                hook.remove()
    for (module, together), (_, alone) in zip(outputs["batch"], outputs["alone"]):
        if not (torch.is_tensor(together) and torch.is_tensor(alone)) or together.dim() == 0:
            continue
        if together.dim() != alone.dim():
            continue
        first = together[tuple(slice(0, size) for size in alone.shape)]
        if first.shape == alone.shape and not torch.allclose(first, alone, rtol=1e-4, atol=1e-5):
            return type(module).__name__
    return None


def sgd_rate(target, task, argv):
    """Find the one learning rate of the check's plain SGD. A step at the initial weights moves them
    by 1% of their norm, so SGD cannot diverge where the user's --lr suits another optimizer, such
    as Adadelta's 1.0. Every launch gets the same rate, so a loss summed over the ranks still trains
    twice as fast as a mean."""
    args, train_set, model = initial_task(target, task, argv)
    model.train()
    items = min(len(train_set), int(env["CHECK_GLOBAL_BATCH"]))
    batch = target.collate_fn(read(train_set, list(range(items))))
    output = call_task(task["compute_loss"], model, batch, args)
    (output[0] if isinstance(output, tuple) else output).backward()
    weights = torch.cat([p.detach().double().flatten() for p in model.parameters()]).norm()
    grads = [p.grad.double().flatten() for p in model.parameters() if p.grad is not None]
    gradient = torch.cat(grads).norm() if grads else torch.tensor(0.0)
    if not (gradient > 0 and gradient.isfinite() and weights > 0):
        return args.lr  # There is nothing to scale by, so the user's own rate stays.
    return float(0.01 * weights / gradient)


def stateful_layers(losses, weights, dataset, micro_batch):
    """Return the kinds of layers whose buffers a forward in training moves, such as BatchNorm's
    statistics or a running normalizer's. Their state is per process."""
    model = losses.model(weights, True)
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    batch = losses.collate_fn(read(dataset, micro_batch))
    call_task(losses.task["compute_loss"], model, batch, losses.args)
    moved = [
        name for name, buffer in model.named_buffers() if not torch.equal(buffer, before[name])
    ]
    return sorted({type(model.get_submodule(name.rpartition(".")[0])).__name__ for name in moved})


def load_error(model, path):
    """Return why model.pt does not load into build_model() with a strict load_state_dict, or
    None."""
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

        # torch.save writes a path from C++, so it raises no audit event. A script that does
        # `from torch import save` escapes this.
        def save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)):
                audit("open", (f, "wb", None))
            return torch_save(obj, f, *args, **kwargs)

        torch.save = save
    sys.exit(getattr(user, "main", target.main)())  # This runs it as `python SCRIPT` does.
'''

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
