"""The launch harness for test_ddp_train.py: real processes, each in its own session with a hard
timeout that kills its whole process group; two hosts made of network namespaces; a user's
project directory (ddp_train.py beside examples/digits.py and a few variants of it); and a real
SLURM cluster (slurmctld and slurmd) on this machine."""

from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import ddp_train

ROOT = Path(__file__).resolve().parent
SCRIPT = str(ROOT / "ddp_train.py")
RUN_MULTI = str(ROOT / "run_multi_node.sh")
PY = sys.executable
TIMEOUT = 150  # seconds for any one launch; a hang fails fast instead of eating CI
HAS_CUDA = torch.cuda.is_available()
CORES = len(os.sched_getaffinity(0))


# ---------------------------------------------------------------------------
# Launching the script
# ---------------------------------------------------------------------------


def pytest_collection_modifyitems(items):
    """The two-host and SLURM tests first: they are the longest and wait the most, so that under
    pytest-xdist they overlap with the rest instead of leaving one worker running them at the end."""
    items.sort(
        key=lambda item: not (
            item.get_closest_marker("multinode") or item.get_closest_marker("slurm")
        )
    )


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """The suite trains on the CPU (gloo) wherever it runs, a GPU machine too: every process a test launches sees
    no GPU (CUDA_VISIBLE_DEVICES=""), unless the test is marked gpu. (On a GPU machine the script would otherwise
    take NCCL and a GPU per process, and torchrun's 2 processes on a 1-GPU machine stop with one line.)"""
    if not request.node.get_closest_marker("gpu"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def clean_env(**extra) -> dict:
    """The test's environment without any launcher's variables, plus `extra` (None: unset it).
    One thread per process unless a test says otherwise: the suite runs two tests at a time, and
    OpenMP threads that spin-wait for a core another test holds make a run 10x slower."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_"))
        and k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    }
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
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
        self.cmd, self.out_path, self.err_path = (
            [str(c) for c in cmd],
            log_dir / f"{name}.out",
            log_dir / f"{name}.err",
        )
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=err,
                env=env or clean_env(),
                cwd=cwd or ROOT,
                start_new_session=True,
            )

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
            pytest.fail(
                f"timed out after {timeout}s: {' '.join(self.cmd)}\n{self.stdout}\n{self.stderr}"
            )

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
                pytest.fail(
                    f"exited ({self.proc.returncode}) before {what}\n{self.stdout}\n{self.stderr}"
                )
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
    """What a run left: its exit code, output and out_dir (metrics and final weights read on demand)."""

    def __init__(self, returncode: int, stdout: str, stderr: str, out_dir: Path):
        self.returncode, self.stdout, self.stderr, self.out_dir = (
            returncode,
            stdout,
            stderr,
            out_dir,
        )

    @classmethod
    def of(cls, launch: Launch, out_dir: Path) -> "Result":
        return cls(launch.proc.returncode, launch.stdout, launch.stderr, out_dir)

    @property
    def metrics(self) -> list[dict]:
        return [
            json.loads(line) for line in (self.out_dir / "metrics.jsonl").read_text().splitlines()
        ]

    @property
    def weights(self) -> dict:
        return torch.load(self.out_dir / "model.pt", weights_only=True)

    def __repr__(self):
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def python_cmd(*args, script=SCRIPT):
    return [PY, script, *args]


def torchrun_cmd(nproc, *args, launcher_args=(), script=SCRIPT):
    return [
        PY,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0",
        *launcher_args,
        script,
        *args,
    ]


def run(
    cmd, tmp_path: Path, out="out", name=None, env=None, cwd=None, timeout=TIMEOUT, expect=0
) -> Result:
    """Launch `cmd` (ddp_train.py's args get --out-dir tmp_path/out), wait, check the exit code."""
    out_dir = tmp_path / out
    name = name or out
    with Launch([*cmd, "--out-dir", out_dir], tmp_path, name, env=env, cwd=cwd) as launch:
        launch.wait(timeout)
    result = Result.of(launch, out_dir)
    if expect is not None:
        assert result.returncode == expect, result
    # The classic gloo abort at exit (the process group torn down before the DDP model) must never show.
    assert "terminate called" not in result.stderr, result
    return result


def assert_same_weights(a: dict, b: dict, exact=False):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{k} differs (max {(a[k] - b[k]).abs().max():.3g})"
        else:
            assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), (
                f"{k} differs by up to {(a[k] - b[k]).abs().max():.3g}"
            )


def assert_same_run(a: dict, b: dict):
    """The same training run up to float rounding, for long runs that change how the global batch
    is split: AdamW amplifies rounding on units whose gradients are nearly zero, so single elements
    may drift by ~1e-4 while every tensor stays within 1e-4 relative norm. A resume that is one
    batch off lands near 3e-2."""
    for k in a:
        assert (a[k] - b[k]).norm() <= 1e-3 * b[k].norm(), (
            f"{k} differs by {(a[k] - b[k]).norm() / b[k].norm():.2g} (relative norm)"
        )


@contextlib.contextmanager
def shared(tmp_path_factory, name: str):
    """A directory of this session that pytest-xdist's workers share, held under a lock: the first
    worker to get it makes what is in it, the others find it made."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # the session's directory, which holds every worker's own
    d = root / "shared" / name
    d.mkdir(parents=True, exist_ok=True)
    with open(d.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield d


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(cmd, **env): the Result of a run (with these environment variables) that several
    tests compare against, made once per session (by whichever xdist worker asks first)."""

    def get(cmd, **env):
        key = hashlib.sha256(
            "\0".join(map(str, [*cmd, *sorted(env.items())])).encode()
        ).hexdigest()[:12]
        with shared(tmp_path_factory, f"reference-{key}") as d:
            if not (d / "done").exists():
                run(cmd, d, env=clean_env(**env))
                (d / "done").touch()
        return Result(0, (d / "out.out").read_text(), (d / "out.err").read_text(), d / "out")

    return get


def default_args(*argv):
    return ddp_train.parse_args(list(argv))


def assert_only_rank0_files(out_dir: Path):
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        ["checkpoint.pt", "checkpoint.prev.pt", "metrics.jsonl", "model.pt"]
    )


def fresh_clone(directory: Path) -> Path:
    """directory/repo: what a fresh clone holds to train (the Makefile, the scripts, examples/), its .venv
    set up for make: this interpreter, and .ready newer than the Makefile. Launch commands with cwd=repo."""
    repo = directory / "repo"
    shutil.copytree(
        ROOT / "examples", repo / "examples", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("Makefile", "ddp_train.py", "run_single.sh", "run_multi_node.sh"):
        shutil.copy(ROOT / name, repo)
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(PY)} "$@"\n')
    python.chmod(0o755)
    (repo / ".venv" / ".ready").touch()
    return repo


# ---------------------------------------------------------------------------
# Fault tolerance helpers
# ---------------------------------------------------------------------------


def worker_pids(agent_pid: int) -> dict[int, int]:
    """{LOCAL_RANK: pid} of the worker processes a torchrun agent started."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == agent_pid:
                env = dict(
                    kv.split("=", 1)
                    for kv in (proc / "environ").read_text().split("\0")
                    if "=" in kv
                )
                found[int(env["LOCAL_RANK"])] = int(proc.name)
        except (OSError, ValueError, IndexError, KeyError):
            continue
    return found


def resumed_at(stdout: str) -> tuple[int, int]:
    """(step within the epoch, optimizer steps done) from the 'resumed from' line."""
    m = re.search(
        r"resumed from .* at epoch \d+, step (\d+)/\d+ \((\d+) optimizer steps done", stdout
    )
    assert m, stdout
    return int(m.group(1)), int(m.group(2))


def wait_for_checkpoint(launch: Launch, out_dir: Path):
    launch.wait_for(lambda: (out_dir / "checkpoint.pt").exists(), "first checkpoint")


# ---------------------------------------------------------------------------
# Two hosts: network namespaces with their own address, hostname and /etc/hosts
# ---------------------------------------------------------------------------


class Host:
    """One "machine": a network namespace with its own address, interface, hostname and /etc/hosts."""

    def __init__(self, ns, addr, ifname, hostname):
        self.ns, self.addr, self.ifname, self.hostname = ns, addr, ifname, hostname

    def command(self, *argv, hostname=None):
        # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts; unshare gives a hostname of its own.
        return [
            "ip",
            "netns",
            "exec",
            self.ns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            hostname or self.hostname,
            *map(str, argv),
        ]

    def kill_all(self):
        send(
            subprocess.run(
                ["ip", "netns", "pids", self.ns], capture_output=True, text=True
            ).stdout.split()
        )


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
    hosts = [
        Host(f"ddp{tag}n{i}", f"{subnet}.{i + 1}", f"vd{tag}n{i}", f"node{i}") for i in range(2)
    ]
    try:
        for h in hosts:
            sh("ip", "netns", "add", h.ns)
            os.makedirs(f"/etc/netns/{h.ns}", exist_ok=True)
            Path(f"/etc/netns/{h.ns}/hosts").write_text(
                "127.0.0.1 localhost\n" + "".join(f"{x.addr} {x.hostname}\n" for x in hosts)
            )
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
    settings = dict(
        PYTHON=PY,
        NNODES=2,
        NODE_RANK=node_rank,
        MASTER_ADDR=hosts[0].addr,
        MASTER_PORT=port,
        NPROC_PER_NODE=2,
        IFNAME=hosts[node_rank].ifname,
        TIMEOUT=30,
    )
    return clean_env(**{**settings, **extra})


def start_nodes(hosts, tmp_path, args, port, name="node", hostname=None, **extra):
    return [
        Launch(
            hosts[i].command(RUN_MULTI, *args, hostname=hostname),
            tmp_path,
            f"{name}{i}",
            env=node_env(hosts, i, port, **extra),
        )
        for i in range(2)
    ]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


# ---------------------------------------------------------------------------
# A user's project: ddp_train.py beside their own script, as they would have it
# ---------------------------------------------------------------------------

# Variants of examples/digits.py that tests need, written beside it. Each plugs in as a user
# would: import ddp_train, replace a function, call ddp_train.main().
VARIANTS = {
    # No BatchNorm, no Dropout: a deterministic model, for N x B == 1 x N*B. With stopper.py's tripwire.
    "plain.py": """
import sys
import torch.nn as nn
import ddp_train
import stopper


def build_model(args):
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1, stride=2),
                          nn.ReLU(), nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
    model.register_forward_pre_hook(stopper.tripwire)
    return model


ddp_train.build_model = build_model
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # A Dataset that draws from numpy only now and then (about one sample in 150) and never from
    # Python's random: each loading process finds out mid-epoch, at a batch of its own.
    "now_and_then.py": """
import sys
import numpy as np
import torch
import ddp_train
import digits


class NowAndThen(torch.utils.data.Dataset):
    def __init__(self, plain):
        self.plain = plain

    def __len__(self):
        return len(self.plain)

    def __getitem__(self, i):
        image, label = self.plain[i]
        if torch.rand(()) < 1 / 150:
            image = image * float(np.random.uniform(0.5, 1.5))
        return image, label


def build_datasets(args):
    train_set, eval_set = digits.build_datasets(args)
    train_set.augment = False
    return NowAndThen(train_set), eval_set


ddp_train.build_datasets = build_datasets
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # digits.py (its Dataset augments with torch, Python's random and numpy; stopper.py's tripwire) with
    # mixup in compute_loss: a lambda from Python's random, a pairing from numpy, drawn in the training
    # process. MIXUP_LOG=path: each rank appends every training step's (lambda, pairing) to path.RANK
    # (not those of ddp_train's passes over the first batch before training).
    "mixup.py": """
import json
import os
import random
import sys
import numpy as np
import torch
import torch.nn.functional as F
import ddp_train
import stopper  # digits' data and model, with the tripwire


def compute_loss(model, batch):
    images, labels = batch
    if not model.training:
        logits = model(images)
        return F.cross_entropy(logits, labels), len(labels), {"accuracy": (logits.argmax(1) == labels).float().mean()}
    lam = random.random()
    perm = np.random.permutation(len(labels))
    if "MIXUP_LOG" in os.environ and not stopper.before_training():
        with open(f"{os.environ['MIXUP_LOG']}.{os.environ.get('RANK', 0)}", "a") as f:
            f.write(json.dumps([lam, perm.tolist()]) + "\\n")
    pair = torch.from_numpy(perm)
    logits = model(lam * images + (1 - lam) * images[pair])
    loss = lam * F.cross_entropy(logits, labels) + (1 - lam) * F.cross_entropy(logits, labels[pair])
    return loss, len(labels)


ddp_train.compute_loss = compute_loss
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # digits.py with a tripwire: at its STOP_AT-th training forward, rank STOP_RANK sends STOP_SIGNAL
    # to itself, its process group or its parent (STOP_TARGET); STOP_AGAIN_AFTER seconds later, again.
    # First launches only (not after a torchrun restart). RECORD_RNG=path: each rank writes its
    # model stream's first draw to path.RANK. POISON_AT=N: from the Nth training forward on, nan inputs.
    # LATE_RANK=R: rank R starts its first training step LATE_SECONDS late.
    # HOLD_AT=N: rank 0 touches HOLD_FILE at its Nth training forward and waits there (60 s at most)
    # for a SIGTERM from outside, so that the stop surely comes mid-run; not in a requeued SLURM job.
    "stopper.py": """
import os
import signal
import sys
import time
import torch
import ddp_train
import digits

calls = 0


def before_training():  # ddp_train's pass over the first batch (warm_up) does not count
    frame = sys._getframe()
    while frame and frame.f_code.co_name != "warm_up":
        frame = frame.f_back
    return frame is not None


def tripwire(module, inputs):
    global calls
    if not module.training or before_training():  # evaluation, the warm-up
        return
    calls += 1
    rank = int(os.environ.get("RANK", 0))
    if calls == 1 and "RECORD_RNG" in os.environ:
        torch.save(torch.rand(8), f"{os.environ['RECORD_RNG']}.{rank}")
    if calls >= int(os.environ.get("POISON_AT", 1 << 30)):  # a diverging run: the inputs turn to nan
        return (inputs[0] * float("nan"),)
    if calls == 1 and rank == int(os.environ.get("LATE_RANK", -1)):  # a slow first step (a cold compile)
        time.sleep(float(os.environ["LATE_SECONDS"]))
    if calls == int(os.environ.get("HOLD_AT", 0)) and rank == 0 and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        hold_for_sigterm()
    if (calls != int(os.environ.get("STOP_AT", 0)) or rank != int(os.environ.get("STOP_RANK", 0))
            or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"):
        return
    sig = getattr(signal, "SIG" + os.environ["STOP_SIGNAL"])
    for attempt in range(2 if "STOP_AGAIN_AFTER" in os.environ else 1):
        if attempt:
            time.sleep(float(os.environ["STOP_AGAIN_AFTER"]))
        target = os.environ.get("STOP_TARGET", "self")
        if target == "group":  # what a terminal or scancel does: every process of the group
            os.killpg(os.getpgid(0), sig)
        else:
            os.kill(os.getppid() if target == "parent" else os.getpid(), sig)


def hold_for_sigterm():
    got, handler = [], signal.getsignal(signal.SIGTERM)  # ddp_train's: it still gets the signal
    signal.signal(signal.SIGTERM, lambda *a: (got.append(True), handler(*a)))
    open(os.environ["HOLD_FILE"], "w").close()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    signal.signal(signal.SIGTERM, handler)


def build_model(args):
    model = digits.build_model(args)
    model.register_forward_pre_hook(tripwire)
    return model


ddp_train.build_model = build_model
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # The default task (ddp_train's own data and MLP), held for a node to join: at world size 1, rank 0
    # touches HOLD_FILE at its HOLD_AT-th training forward and waits there (stopper.py's hold, 60 s at
    # most) for the SIGTERM with which torchrun stops its worker once another node has joined. Never at
    # another world size: a membership change restarts the worker with the same TORCHELASTIC_RESTART_COUNT.
    "alone.py": """
import os
import sys
import ddp_train

default_task = ddp_train.build_datasets, ddp_train.build_model
import stopper  # its hold (importing it plugs in digits: the default task comes back below)

calls = 0


def hold_while_alone(module, inputs):
    global calls
    if not module.training or stopper.before_training() or os.environ.get("WORLD_SIZE") != "1":
        return
    calls += 1
    if calls == int(os.environ.get("HOLD_AT", 0)):
        stopper.hold_for_sigterm()


def build_model(args):
    model = default_task[1](args)
    model.register_forward_pre_hook(hold_while_alone)
    return model


ddp_train.build_datasets, ddp_train.build_model = default_task[0], build_model
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # No evaluation set.
    "noeval.py": """
import sys
import ddp_train
import digits


def build_datasets(args):
    return digits.build_datasets(args)[0], None


ddp_train.build_datasets = build_datasets
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # Rank 1 builds other data than rank 0 (a path that differs per node, say).
    "uneven.py": """
import os
import sys
from torch.utils.data import Subset
import ddp_train
import digits


def build_datasets(args):
    train_set, eval_set = digits.build_datasets(args)
    if os.environ.get("RANK") == "1":
        train_set = Subset(train_set, range(len(train_set) - 7))
    return train_set, eval_set


ddp_train.build_datasets = build_datasets
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # HF-style dict items (with a string field), a model that returns a tuple, and an auxiliary head
    # that only training uses.
    "aux.py": """
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
import ddp_train
import digits


class AsDicts(torch.utils.data.Dataset):
    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        image, label = self.inner[i]
        return {"image": image, "label": label, "id": f"digit-{i}"}


class WithAuxHead(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.body = digits.build_model(args)
        self.aux = nn.Linear(self.body[-1].in_features, 10)

    def forward(self, images):
        features = self.body[:-1](images)
        return self.body[-1](features), self.aux(features) if self.training else None


def build_datasets(args):
    return tuple(AsDicts(d) for d in digits.build_datasets(args))


def compute_loss(model, batch):
    logits, aux = model(batch["image"])
    labels = batch["label"]
    loss = F.cross_entropy(logits, labels)
    if aux is not None:
        loss = loss + 0.3 * F.cross_entropy(aux, labels)
    return loss, len(labels), {"accuracy": (logits.argmax(dim=1) == labels).float().mean()}


ddp_train.build_datasets, ddp_train.build_model, ddp_train.compute_loss = build_datasets, WithAuxHead, compute_loss
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # A parameter the forward never uses.
    "unused.py": """
import sys
import torch.nn as nn
import ddp_train
import digits


class WithSpare(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.net, self.spare = digits.build_model(args), nn.Linear(10, 10)

    def forward(self, images):
        return self.net(images)


ddp_train.build_model = WithSpare
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # A head that only every third training forward uses: every rank leaves its parameters without a
    # gradient in two steps of three (ddp_train's passes over the first batch and evaluation: never).
    "sometimes.py": """
import sys
import torch.nn as nn
import ddp_train
import digits
import stopper


class SometimesHead(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.body, self.forwards = digits.build_model(args), 0
        self.extra = nn.Linear(self.body[-1].in_features, 10)

    def forward(self, images):
        features = self.body[:-1](images)
        logits = self.body[-1](features)
        if self.training and not stopper.before_training():
            self.forwards += 1
            if self.forwards % 3 == 0:
                logits = logits + self.extra(features)
        return logits


ddp_train.build_model = SometimesHead
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # Another train/eval split of the same data.
    "split.py": """
import sys
import ddp_train
import digits

digits.TRAIN_SIZE = 1400
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # Mistakes: per-sample losses instead of their mean (BAD=loss); items that do not batch (BAD=items);
    # a bug in __getitem__ (BAD=getitem); a collate_fn that raises (BAD=collate); a streaming
    # IterableDataset (BAD=iterable), a count of samples that turns into something else (BAD=count).
    "bad.py": """
import os
import sys
import torch
import torch.nn.functional as F
import ddp_train
import digits


def collate_fn(items):
    images, labels = zip(*items)
    return torch.stack(images), torch.tensor(labels.tolist())  # a tuple has no tolist()


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return (self.inner[i] for i in range(len(self.inner)))


def compute_loss(model, batch):
    images, labels = batch
    return F.cross_entropy(model(images), labels, reduction="none"), len(labels)


calls = 0


def miscounting_loss(model, batch):  # right on the first batch (the warm-up), then twice the samples (tokens, say)
    global calls
    calls += 1
    images, labels = batch
    return F.cross_entropy(model(images), labels), len(labels) * (1 if calls <= 1 else 2)


class Odd:
    pass


class OddItems(digits.Digits):
    def __getitem__(self, i):
        return super().__getitem__(i) + (Odd(),)


class Buggy(digits.Digits):
    def __getitem__(self, i):
        if i == 700:  # (not in the first batch, which the warm-up loads in the training process)
            raise ValueError("sample 700 is broken")
        return super().__getitem__(i)


def build_datasets(args):
    train_set, eval_set = digits.build_datasets(args)
    kind = OddItems if os.environ["BAD"] == "items" else Buggy
    return kind(train_set.images, train_set.labels, augment=True), eval_set


if os.environ["BAD"] == "loss":
    ddp_train.compute_loss = compute_loss
elif os.environ["BAD"] == "count":
    ddp_train.compute_loss = miscounting_loss
elif os.environ["BAD"] == "collate":
    ddp_train.collate_fn = collate_fn
elif os.environ["BAD"] == "iterable":
    ddp_train.build_datasets = lambda args: (Stream(digits.build_datasets(args)[0]), None)
else:
    ddp_train.build_datasets = build_datasets
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # Rank 0 prepares the data first while the others wait longer than --timeout; checkpoint writes
    # slower than --timeout (a slow shared filesystem).
    "patient.py": """
import os
import sys
import time
import ddp_train
import digits


def build_datasets(args):
    mark = os.path.join(os.path.dirname(os.path.abspath(args.out_dir)), "prepared")
    with ddp_train.rank0_first():
        if os.environ["RANK"] == "0":
            time.sleep(float(os.environ["PREP_SECONDS"]))
            open(mark, "w").close()
        elif not os.path.exists(mark):
            raise SystemExit("rank 0 has not prepared the data")
    return digits.build_datasets(args)


def slow_save(obj, path, *rest, save=ddp_train.atomic_save, **kwargs):
    if path.endswith("checkpoint.pt"):  # the other rank waits for it, past --timeout
        time.sleep(float(os.environ["SAVE_SECONDS"]))
    save(obj, path, *rest, **kwargs)


ddp_train.build_datasets, ddp_train.atomic_save = build_datasets, slow_save
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # stopper.py (HOLD_AT and HOLD_FILE hold rank 0 until a SIGTERM comes) on a slow disk: each write of
    # checkpoint.pt takes SAVE_SECONDS longer, as a big model's would.
    "slow_stop.py": """
import os
import sys
import time
import ddp_train
import stopper  # digits with its tripwire


def slow_save(obj, path, *rest, save=ddp_train.atomic_save, **kwargs):
    if path.endswith("checkpoint.pt"):
        time.sleep(float(os.environ["SAVE_SECONDS"]))
    save(obj, path, *rest, **kwargs)


ddp_train.atomic_save = slow_save
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # examples/tinylm.py (a language model on variable-length token batches) with stopper.py's tripwire;
    # LM_<CONSTANT>=value overrides its sizes (LM_TRAIN_SIZE=48, LM_DROPOUT=0).
    "lm.py": """
import os
import sys
import ddp_train
import stopper  # its tripwire (importing it plugs in digits: tinylm replaces that below)
import tinylm

for name in ("TRAIN_SIZE", "EVAL_SIZE", "MAX_LEN", "DIM", "LAYERS", "HEADS", "DROPOUT"):
    if "LM_" + name in os.environ:
        setattr(tinylm, name, type(getattr(tinylm, name))(os.environ["LM_" + name]))


def build_model(args):
    model = tinylm.build_model(args)
    model.register_forward_pre_hook(stopper.tripwire)
    return model


ddp_train.build_datasets, ddp_train.build_model = tinylm.build_datasets, build_model
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # An LSTM over the digit images' rows: an op torch's FLOP counter has no formula for on the CPU.
    "rnn.py": """
import sys
import torch.nn as nn
import ddp_train
import digits


class RowLSTM(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.lstm, self.head = nn.LSTM(8, 32, batch_first=True), nn.Linear(32, 10)

    def forward(self, images):
        return self.head(self.lstm(images.squeeze(1))[0][:, -1])


ddp_train.build_model = RowLSTM
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # Gradients that overflow: every OVERFLOW_EVERY-th backward, the head's weight gradient turns inf.
    "overflow.py": """
import os
import sys
import ddp_train
import digits

backwards = 0


def poison(grad):
    global backwards
    backwards += 1
    return grad * float("inf") if backwards % int(os.environ["OVERFLOW_EVERY"]) == 0 else grad


def build_model(args):
    model = digits.build_model(args)
    model[-1].weight.register_hook(poison)
    return model


ddp_train.build_model = build_model
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # Records every torch.load call (its map_location and mmap) in LOAD_LOG.RANK.
    "spy_load.py": """
import os
import sys
import torch
import ddp_train

load = torch.load


def recording_load(path, *args, **kwargs):
    if not isinstance(path, (str, os.PathLike)):  # (torch's own loads from memory: all_gather_object)
        return load(path, *args, **kwargs)
    with open(f"{os.environ['LOAD_LOG']}.{os.environ.get('RANK', 0)}", "a") as f:
        f.write(f"{os.path.basename(str(path))} map_location={kwargs.get('map_location')} mmap={kwargs.get('mmap')}\\n")
    return load(path, *args, **kwargs)


torch.load = recording_load
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # A model that runs its layers in the reverse of the order it registers them, with over 1 MiB of
    # parameters (DDP's first bucket holds 1 MiB); at the end, DDP's bucket layout goes to BUCKETS.RANK.
    "reversed.py": """
import json
import os
import sys
import torch.nn as nn
import ddp_train

wrapped = {}


class Reversed(nn.Module):
    def __init__(self, args):
        super().__init__()
        sizes = [512, 512, 512, 512, ddp_train.IN_FEATURES]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[1:], sizes))  # registered last-first
        self.head = nn.Linear(512, ddp_train.NUM_CLASSES)

    def forward(self, x):
        for layer in reversed(self.layers):
            x = layer(x).relu()
        return self.head(x)


class Recorded(ddp_train.DDP):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        wrapped["ddp"] = self


def save_model(trainer, save=ddp_train.Trainer.save_model):
    data = wrapped["ddp"]._get_ddp_logging_data()
    with open(f"{os.environ['BUCKETS']}.{trainer.ctx.rank}", "w") as f:
        json.dump({k: v for k, v in data.items() if "bucket" in k}, f)
    save(trainer)


ddp_train.build_model, ddp_train.DDP, ddp_train.Trainer.save_model = Reversed, Recorded, save_model
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # The default task's MLP with a buffer of its own, which DDP broadcasts in every forward. Its DDP does first
    # what DDP's forward does with device_ids (CUDA: nn/parallel/distributed.py, _pre_forward): move the inputs
    # with torch's own _to_kwargs and take the first, which raises IndexError for a call with no input.
    "buffered.py": """
import sys
import torch
from torch.distributed.utils import _to_kwargs
import ddp_train

build_mlp = ddp_train.build_model


class AsOnCuda(ddp_train.DDP):
    def forward(self, *inputs, **kwargs):
        moved_inputs, moved_kwargs = _to_kwargs(inputs, kwargs, torch.device("cpu"), False)
        moved_inputs[0], moved_kwargs[0]
        return super().forward(*inputs, **kwargs)


class Buffered(torch.nn.Module):
    def __init__(self, args):
        super().__init__()
        self.mlp = build_mlp(args)
        self.register_buffer("temperature", torch.ones(()))

    def forward(self, x):
        return self.mlp(x) / self.temperature


ddp_train.build_model, ddp_train.DDP = Buffered, AsOnCuda
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # The default task with every training step after the second run under CUDA's sync debug mode "error":
    # any host-device synchronisation inside a step raises (the first steps warm up and time the start).
    "nosync.py": """
import sys
import torch
import ddp_train

steps = 0


def step(trainer, data, n_micro, samples, original=ddp_train.Trainer.step):
    global steps
    steps += 1
    if steps <= 2:
        return original(trainer, data, n_micro, samples)
    torch.cuda.set_sync_debug_mode("error")
    try:
        return original(trainer, data, n_micro, samples)
    finally:
        torch.cuda.set_sync_debug_mode("default")


ddp_train.Trainer.step = step
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # digits.py with a slow Dataset: SLOW_MS milliseconds per sample on the ranks in SLOW_RANKS ("0,1").
    "slow.py": """
import os
import sys
import time
import ddp_train
import digits


class Slow(digits.Digits):
    def __getitem__(self, i):
        if os.environ.get("RANK", "0") in os.environ.get("SLOW_RANKS", "0").split(","):
            time.sleep(float(os.environ.get("SLOW_MS", 0)) / 1000)
        return super().__getitem__(i)


def build_datasets(args):
    train_set, eval_set = digits.build_datasets(args)
    return Slow(train_set.images, train_set.labels, augment=True), eval_set


ddp_train.build_datasets = build_datasets
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # Rank 1's compute_loss takes SLOW_COMPUTE_MS longer in training, after its model's forward (a slow loss), on
    # the project SLOW_PROJECT names: digits (BatchNorm) or lm (tinylm), each of which plugs itself in on import.
    "slow_compute.py": """
import importlib
import os
import sys
import time
import ddp_train

importlib.import_module(os.environ.get("SLOW_PROJECT", "digits"))
users_loss = ddp_train.compute_loss


def compute_loss(model, batch):
    out = users_loss(model, batch)
    if model.training and os.environ["RANK"] == "1":
        time.sleep(float(os.environ["SLOW_COMPUTE_MS"]) / 1000)
    return out


ddp_train.compute_loss = compute_loss
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # One process evaluates a saved model.pt over the whole eval set: python evaluate_saved.py MODEL ARGS...
    "evaluate_saved.py": """
import contextlib
import json
import sys
import types
import torch
import ddp_train
import digits

args = ddp_train.parse_args(sys.argv[2:])
ddp_train.seed_everything(args.seed)
_, eval_set = ddp_train.build_datasets(args)
model = ddp_train.build_model(args)
model.load_state_dict(torch.load(sys.argv[1], weights_only=True))
one_process = types.SimpleNamespace(args=args, ctx=ddp_train.Context(), eval_set=eval_set,
                                autocast=contextlib.nullcontext)
print(json.dumps(ddp_train.evaluate(model, one_process)))
""",
    # Your recipe (build_optimizer): a deterministic CNN (plain.py's) on digits, trained by two optimizers:
    # SGD with Nesterov momentum over the convolutions, in two parameter groups of their own lrs, and AdamW over
    # the head. SCALE_ONLY_FIRST=1 plants a bug: DDP's averaging over the ranks reaches the first optimizer's
    # parameters only (the second's gradients are multiplied by the world size after backward).
    "recipe_two_optimizers.py": """
import os
import sys
import torch
import torch.nn as nn
import ddp_train
import plain  # digits' data and plain.py's CNN


def build_optimizer(args, model):
    convs = [m for m in model if isinstance(m, nn.Conv2d)]
    sgd = torch.optim.SGD([{"params": [c.weight for c in convs]},
                           {"params": [c.bias for c in convs], "lr": 5 * args.lr}],
                          lr=20 * args.lr, momentum=0.9, nesterov=True)
    return [sgd, torch.optim.AdamW(model[-1].parameters(), lr=args.lr)]


def finish(count, finish=ddp_train.StepCount.finish):
    for group in count.t.optimizers[1].param_groups:
        for p in group["params"]:
            p.grad.mul_(count.t.ctx.world_size)
    finish(count)


ddp_train.build_optimizer = build_optimizer
if os.environ.get("SCALE_ONLY_FIRST"):
    ddp_train.StepCount.finish = finish
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # The default task (ddp_train's data and MLP) with stopper.py's tripwire (STOP_AT, STOP_SIGNAL...).
    "recipe_mlp.py": """
import sys
import ddp_train

default_task = ddp_train.build_datasets, ddp_train.build_model
import stopper  # its tripwire (importing it plugs in digits: the default task comes back below)


def build_model(args):
    model = default_task[1](args)
    model.register_forward_pre_hook(stopper.tripwire)
    return model


ddp_train.build_datasets, ddp_train.build_model = default_task[0], build_model
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # recipe_mlp.py trained by Muon (torch.optim.Muon: matrices only) on the hidden layers' weights and AdamW on
    # the rest, in two parameter groups (the head's weight decays, the biases do not).
    "recipe_muon.py": """
import sys
import torch
import torch.nn as nn
import ddp_train
import recipe_mlp  # the default task, with the tripwire


def build_optimizer(args, model):
    *hidden, head = [m for m in model if isinstance(m, nn.Linear)]
    muon = torch.optim.Muon([m.weight for m in hidden], lr=args.lr, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [head.weight], "weight_decay": args.weight_decay},
                               {"params": [m.bias for m in (*hidden, head)], "weight_decay": 0.0}], lr=args.lr)
    return [muon, adamw]


ddp_train.build_optimizer = build_optimizer
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # The default task trained by an AdamW subclass whose step() appends every parameter group's lr, as JSON, to
    # LR_LOG (rank 0); two groups: the weights at --lr, the biases at a quarter of it.
    "recipe_lr_log.py": """
import json
import os
import sys
import torch
import ddp_train


class LoggedAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        if os.environ.get("RANK", "0") == "0":
            with open(os.environ["LR_LOG"], "a") as f:
                f.write(json.dumps([group["lr"] for group in self.param_groups]) + "\\n")
        return super().step(closure)


def build_optimizer(args, model):
    params = list(model.parameters())
    return LoggedAdamW([{"params": [p for p in params if p.dim() >= 2]},
                        {"params": [p for p in params if p.dim() < 2], "lr": args.lr / 4}], lr=args.lr)


ddp_train.build_optimizer = build_optimizer
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # A build_optimizer that forgets digits' head (ODD=none), or gives it to two optimizers (ODD=twice).
    "recipe_odd_optimizer.py": """
import os
import sys
import torch
import ddp_train
import digits


def build_optimizer(args, model):
    body = [p for name, p in model.named_parameters() if not name.startswith("8.")]
    optimizers = [torch.optim.AdamW(body, lr=args.lr)]
    if os.environ["ODD"] == "twice":
        optimizers += [torch.optim.SGD(model[8].parameters(), lr=args.lr),
                       torch.optim.AdamW(model[8].parameters(), lr=args.lr)]
    return optimizers


ddp_train.build_optimizer = build_optimizer
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # digits.py with rank STALL_RANK (default 1) stuck for good (an hour's sleep) at the STALL_AT-th call of
    # STALL_IN: compute_loss (in training), getitem (the samples of one loading process, a DataLoader worker's),
    # collate (collate_fn, in training), backward (a gradient hook of the user's, in training) or fsync (of
    # checkpoint.pt's writes, before the rename: a filesystem that stopped answering). ddp_train's passes over
    # the first batch before training do not count (but as getitem's samples). It touches STALL_FILE as it
    # gets stuck; first launches only (not after a torchrun restart). STALL_MODEL=plain: no BatchNorm, Dropout.
    "stall_stuck.py": """
import os
import sys
import time
import torch
import ddp_train
import digits
import stopper  # for its before_training()

STUCK = (os.environ.get("RANK", "0") == os.environ.get("STALL_RANK", "1")
         and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")
PLACE, AT = os.environ.get("STALL_IN", "compute_loss"), int(os.environ.get("STALL_AT", 8))
calls = 0
default_loss, fsync = ddp_train.compute_loss, os.fsync


def due(place):  # this call is the one to get stuck at
    global calls
    if not STUCK or PLACE != place:
        return False
    calls += 1
    if calls == AT:
        open(os.environ["STALL_FILE"], "w").close()
    return calls == AT


def compute_loss(model, batch):
    if model.training and not stopper.before_training() and due("compute_loss"):
        time.sleep(3600)  # stuck in compute_loss
    return default_loss(model, batch)


class Stuck(digits.Digits):
    def __getitem__(self, i):
        if due("getitem"):
            time.sleep(3600)  # stuck in __getitem__
        return super().__getitem__(i)


def build_datasets(args):
    train_set, eval_set = digits.build_datasets(args)
    return Stuck(train_set.images, train_set.labels, augment=True), eval_set


def collate_fn(items):
    if not stopper.before_training() and due("collate"):
        time.sleep(3600)  # stuck in collate_fn
    return torch.utils.data.default_collate(items)


def gradient_hook(grad):
    if not stopper.before_training() and due("backward"):
        time.sleep(3600)  # stuck in a gradient hook
    return grad


def build_model(args):  # STALL_MODEL=plain: without BatchNorm, whose buffers DDP broadcasts in every forward
    model = digits.build_model(args)
    if os.environ.get("STALL_MODEL") == "plain":
        model = torch.nn.Sequential(*(m for m in model if not isinstance(m, (torch.nn.BatchNorm2d, torch.nn.Dropout))))
    model[-1].weight.register_hook(gradient_hook)
    return model


def stuck_fsync(fd):
    if os.readlink(f"/proc/self/fd/{fd}").endswith("checkpoint.pt.tmp") and due("fsync"):
        time.sleep(3600)  # stuck in fsync
    fsync(fd)


ddp_train.compute_loss, ddp_train.build_datasets, ddp_train.collate_fn = compute_loss, build_datasets, collate_fn
ddp_train.build_model, os.fsync = build_model, stuck_fsync
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # Plain SGD (no momentum, no weight decay) on the project that SGD_PROJECT names and plugs in on import: lm
    # (tinylm, tokens) or, unset, the default task. One step of it is w0 - lr x the gradient of the step's loss.
    "sgd.py": """
import importlib
import os
import sys
import torch
import ddp_train

if os.environ.get("SGD_PROJECT"):
    importlib.import_module(os.environ["SGD_PROJECT"])


def build_optimizer(args, model):
    return torch.optim.SGD(model.parameters(), lr=args.lr)


ddp_train.build_optimizer = build_optimizer
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # The default task as a token task in which most samples carry no target (ignore_index), so that many
    # micro-batches, the warm-up's first one included, hold no token at all: sgd.py with SGD_PROJECT=masked.
    "masked.py": """
import torch
import torch.nn.functional as F
import ddp_train

default_datasets = ddp_train.build_datasets


def build_datasets(args):
    train_set, eval_set = default_datasets(args)
    x, y = train_set.tensors
    y = torch.where(torch.arange(len(y)) % 10 == 9, y, -100)  # samples 9, 19, 29, ... alone count
    return torch.utils.data.TensorDataset(x, y), eval_set


def compute_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, ignore_index=-100), (y != -100).sum()


ddp_train.build_datasets, ddp_train.compute_loss, ddp_train.COUNT_UNIT = build_datasets, compute_loss, "tokens"
""",
    # A user's own scheduler: torch's OneCycleLR over the run's steps, on the default task with stopper.py's
    # tripwire (recipe_mlp.py); every record report() gets goes, as a JSON line, to REPORT_TO.
    "onecycle.py": """
import json
import os
import sys
import torch
import ddp_train
import recipe_mlp  # the default task, with the tripwire


def build_scheduler(args, optimizer, total_steps):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)


def report(record):
    with open(os.environ["REPORT_TO"], "a") as f:
        f.write(json.dumps(record) + "\\n")


ddp_train.build_scheduler, ddp_train.report = build_scheduler, report
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # onecycle.py's OneCycleLR and report() on digits.py (its augmenting Dataset, BatchNorm, Dropout) with stopper.py's
    # tripwire (STOP_AT, STOP_SIGNAL...).
    "onecycle_digits.py": """
import sys
import ddp_train
import onecycle  # its build_scheduler and report() (and the default task, which digits replaces below)
import stopper  # digits, with the tripwire

ddp_train.build_datasets, ddp_train.build_model = stopper.digits.build_datasets, stopper.build_model
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
    # Every rank says on stderr, once, the debug level torch.distributed runs at.
    "stall_debug.py": """
import os
import sys
import torch.distributed as dist
import ddp_train
import digits


def build_model(args):
    print(f"rank {os.environ.get('RANK', 0)}: debug level {dist.get_debug_level().name}", file=sys.stderr, flush=True)
    return digits.build_model(args)


ddp_train.build_model = build_model
if __name__ == "__main__":
    sys.exit(ddp_train.main())
""",
}


MSE_LOSS = """def compute_loss(model, batch):
    images, labels = batch
    outputs = model(images).float()
    return F.mse_loss(outputs, F.one_hot(labels, 10).float()), len(labels)"""


def edited_copy(directory: Path) -> Path:
    """The other way to plug a project in: a copy of ddp_train.py with its three task functions
    edited, here into digits.py's data and model and a mean-squared-error loss (a regression onto
    one-hot targets). Returns the copy's path."""
    script, digits_py = Path(SCRIPT).read_text(), (ROOT / "examples" / "digits.py").read_text()
    named = {}
    for node in ast.parse(digits_py).body:
        name = getattr(node, "name", None) or (
            isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None)
        )
        named[name or None] = ast.get_source_segment(digits_py, node)
    ours = "\n\n\n".join(
        named[k]
        for k in ("GLYPHS", "TORCH_ONLY", "render", "Digits", "build_datasets", "build_model")
    )
    ours = "NUM_DIGITS, TRAIN_SIZE = 1797, 1437\n" + ours
    lines = script.splitlines()
    spans = sorted(
        (n.lineno, n.end_lineno)
        for n in ast.parse(script).body
        if isinstance(n, ast.FunctionDef)
        and n.name in ("build_datasets", "build_model", "compute_loss")
    )
    text = (
        "\n".join(lines[: spans[0][0] - 1] + [ours, "", "", MSE_LOSS] + lines[spans[-1][1] :])
        + "\n"
    )
    text = text.replace(
        "import torch\n",
        "import numpy as np\nimport torch\nfrom torch.utils.data import random_split\n",
        1,
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ddp_train.py").write_text(text)
    return directory / "ddp_train.py"


@pytest.fixture(scope="session")
def project(tmp_path_factory) -> Path:
    """A user's project directory: a copy of ddp_train.py, examples/digits.py and the VARIANTS."""
    with shared(tmp_path_factory, "project") as d:
        if not (d / "digits.py").exists():  # written once: another worker may be running it
            shutil.copy(SCRIPT, d)
            for name, text in VARIANTS.items():
                (d / name).write_text(text.lstrip())
            shutil.copy(ROOT / "examples" / "tinylm.py", d)
            shutil.copy(ROOT / "examples" / "digits.py", d)  # last: it marks the copy complete
    return d


# ---------------------------------------------------------------------------
# A real SLURM cluster (Debian 12's slurmctld/slurmd 22.05) on this machine, for tests. As root:
#
#     apt-get install -y --no-install-recommends slurmctld slurmd slurm-client
#
# Fixtures (skipped without root or without Slurm):
#   slurm_cluster   one node, named after this host, on the host network (127.0.0.1)
#   slurm_cluster2  two nodes, node0 (10.232.0.1) and node1 (10.232.0.2), each in a network namespace of its
#                   own, joined by a veth pair; slurmctld runs on node0, and so do client commands
# Each test gets a started cluster; afterwards its jobs are cancelled, and processes still running are killed
# and reported as an error of that test. Parametrize indirectly with the proctrack plugin or a dict of
# SlurmCluster options: @pytest.mark.parametrize("slurm_cluster", ["pgid"], indirect=True). A cluster starts
# once per session and configuration (0.1 s; 0.3 s for two nodes) and stops at its end, also on Ctrl-C or
# SIGTERM; what a SIGKILLed session left is reaped by the next one. Config, state and daemon logs are in
# /tmp/slurm-fixture/<pid of the session>x<n>/; no munged, nothing of /etc/slurm.
# ---------------------------------------------------------------------------

# short: slurmd's socket paths must fit 108 bytes
SLURM_BASE = Path(tempfile.gettempdir()) / "slurm-fixture"
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
_clusters_made = itertools.count()

SLURM_CONF_TEMPLATE = """\
ClusterName=fixture
# Job ids of this cluster's own, so that concurrent clusters' --slurm jobs do not share ports.
FirstJobId={first_job_id}
SlurmctldHost={nodes[0]}({addrs[0]})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
# No munged: nothing is signed, fine for a cluster that only this machine can reach.
AuthType=auth/none
CredType=cred/none
# A requeued job is held for cred_expire + 1 s (default: 20 min); 5 is the smallest value accepted.
AuthInfo=cred_expire=5
ProctrackType=proctrack/{proctrack}
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
SlurmdTimeout=30
MessageTimeout=10
# Finished jobs stay in `scontrol show job` (no sacct without accounting).
MinJobAge=300
KillWait=2
InactiveLimit=0
JobRequeue=1
# Start pending and requeued jobs within a second, not at the default 60 s scheduling pass.
SchedulerParameters=sched_interval=1
# Each node declares `cpus` CPUs whatever this machine has (config_overrides: else the node is INVAL).
# With 2, -N2 -n4 puts 2 tasks on each node; with more, SLURM fills node0 first.
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _run_group(argv, timeout, **kw):
    """subprocess.run in a session of its own; on timeout its whole process group is killed."""
    with subprocess.Popen(
        argv,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def send(pids, sig=signal.SIGKILL):
    """Signal every process of `pids` that still exists."""
    for pid in pids:
        try:
            os.kill(int(pid), sig)
        except ProcessLookupError:
            pass


def _stat(pid):
    """(state, ppid) of a process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _describe(pid):
    try:
        return f"{pid} " + Path(f"/proc/{pid}/cmdline").read_bytes().decode(
            errors="replace"
        ).replace("\0", " ")
    except OSError:
        return str(pid)


def _pids_of(root, namespaces=()):
    """Running processes of the cluster in `root` (zombies hold nothing): all those in its network
    namespaces; those whose environment names a slurm.conf under root (daemons, jobs, tasks, sruns); those
    with a file under root open (slurmstepd: its title overwrites its environment, not its open log)."""
    pids = set()
    for ns in namespaces:
        pids.update(
            map(
                int,
                subprocess.run(
                    ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10
                ).stdout.split(),
            )
        )
    marker, prefix = f"SLURM_CONF={root}/".encode(), f"{root}/"
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            if any(v.startswith(marker) for v in (p / "environ").read_bytes().split(b"\0")) or any(
                os.readlink(fd).startswith(prefix) for fd in (p / "fd").iterdir()
            ):
                pids.add(int(p.name))
        except OSError:
            pass
    return {pid for pid in pids if (_stat(pid) or ("Z",))[0] != "Z"}


class SlurmCluster:
    """slurmctld and one slurmd per node, as children of this process; see the module docstring."""

    def __init__(self, nodes=1, proctrack="linuxproc", cpus=2):
        self.proctrack, self.cpus = proctrack, cpus
        self.name = f"{os.getpid()}x{next(_clusters_made)}"
        self.root = SLURM_BASE / self.name
        self.conf = self.root / "slurm.conf"
        # Jobs inherit this (sbatch exports the submitter's environment): the config, and this Python's bin
        # first on PATH, so that `python` in a job script is the test's.
        path = os.pathsep.join(
            [
                os.path.dirname(sys.executable),
                "/usr/local/sbin",
                "/usr/local/bin",
                "/usr/sbin",
                "/usr/bin",
                "/sbin",
                "/bin",
            ]
        )
        # as clean_env()
        self.env = {
            "PATH": path,
            "SLURM_CONF": str(self.conf),
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }
        self.namespaces = []
        if nodes == 1:
            # named after this host, so that the names jobs get (SLURM_JOB_NODELIST...) resolve
            self.nodes, self.addrs = [socket.gethostname().split(".")[0]], ["127.0.0.1"]
        else:  # a subnet only the namespaces see (the project's own are 10.231.*)
            assert nodes == 2, "a veth pair joins two namespaces; more nodes would need a bridge"
            self.nodes, self.addrs = ["node0", "node1"], ["10.232.0.1", "10.232.0.2"]
            self.namespaces = [f"slurmfx{self.name}n{i}" for i in range(nodes)]
            self._veths = [f"vf{self.name}n{i}" for i in range(nodes)]  # at most 15 characters
        self._daemons, self._outputs = [], {}
        self.started_at = None

    def cmd(self, argv, node=0):
        """argv running `argv` on a node: as is on one node; else in the node's network namespace, with its
        hostname and an /etc/hosts naming all nodes (not `ip netns exec`: it remounts /sys, which slurmd
        does not survive). All else is shared: files under /tmp, and one pid namespace."""
        argv = [str(a) for a in argv]
        if not self.namespaces:
            return argv
        return [
            "nsenter",
            f"--net=/run/netns/{self.namespaces[node]}",
            "unshare",
            "--uts",
            "--mount",
            "sh",
            "-c",
            'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"',
            "sh",
            self.root / "hosts",
            self.nodes[node],
            *argv,
        ]

    def run(self, argv, timeout=30, check=False, node=0, env=None, **kw):
        """Run a command on a node (default node0, where slurmctld is) in the cluster's environment plus
        `env`; return its CompletedProcess (text)."""
        r = _run_group(self.cmd(argv, node), timeout, env={**self.env, **(env or {})}, **kw)
        if check and r.returncode:
            raise AssertionError(
                f"{shlex.join(map(str, argv))} exited {r.returncode}:\n{r.stdout}{r.stderr}"
            )
        return r

    def sbatch(self, script, *args, cwd=None, env=None, output=None, timeout=30):
        """Submit a batch script (its text; #!/bin/bash unless it has a #! line) with sbatch options `args`,
        from `cwd`, with the cluster's environment plus `env`; return the job id. Its stdout and stderr go
        to `output` (default: cwd/slurm-%j.out); see output()."""
        cwd = Path(cwd or self.root / "jobs")
        path = self.root / "jobs" / f"script{len(self._outputs)}.sh"
        path.write_text(script if script.startswith("#!") else "#!/bin/bash\n" + script)
        output = str(output or cwd / "slurm-%j.out")
        r = self.run(
            ["sbatch", "--parsable", f"--chdir={cwd}", f"--output={output}", *args, path],
            timeout,
            check=True,
            env=env,
        )
        job_id = r.stdout.strip().split(";")[0]
        self._outputs[job_id] = output.replace("%j", job_id)
        return job_id

    def output(self, job_id):
        path = Path(self._outputs[str(job_id)])
        return path.read_text() if path.exists() else ""

    def job_info(self, job_id):
        """`scontrol show job` as a dict: JobState, ExitCode ("code:signal"), Restarts, Reason...; empty
        once slurmctld has forgotten the job (MinJobAge, 300 s after its end)."""
        r = self.run(["scontrol", "show", "job", "-o", job_id])
        return (
            dict(re.findall(r"(\S+?)=(.*?)(?= \S+?=|$)", r.stdout.strip()))
            if r.returncode == 0
            else {}
        )

    def wait(self, job_id, timeout=60, states=FINAL_STATES):
        """Poll until the job is in one of `states` (default: ended, its processes gone; until then it is
        COMPLETING); return its job_info()."""
        deadline = time.monotonic() + timeout
        while (info := self.job_info(job_id)).get("JobState") not in states:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} not {'/'.join(sorted(states))} after {timeout} s: {info}\n"
                    f"output:\n{self.output(job_id) if str(job_id) in self._outputs else ''}"
                )
            time.sleep(0.2)
        return info

    def scancel(self, job_id, *options, signal=None):
        """Cancel the job, or send `signal` (USR1, TERM...) to the processes of its steps, not to the batch
        shell (options: "--batch": the batch shell's process only; "--full": both)."""
        return self.run(
            ["scancel", *([f"--signal={signal}"] if signal else []), *options, job_id], check=True
        )

    def requeue(self, job_id):
        return self.run(["scontrol", "requeue", job_id], check=True)

    def update(self, job_id, **fields):
        """scontrol update JobId=job_id Field=value...: e.g. TimeLimit=2 (minutes), also of a running job."""
        return self.run(
            ["scontrol", "update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items())],
            check=True,
        )

    def start(self, timeout=30):
        t0 = time.monotonic()
        if self.root.exists():  # left by a dead session that had our pid
            _reap(self.root)
        for d in ("state", "log", "jobs", *(f"spool/{n}" for n in self.nodes)):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "plugstack.conf").write_text("")
        self.conf.write_text(
            SLURM_CONF_TEMPLATE.format(
                root=self.root,
                nodes=self.nodes,
                addrs=self.addrs,
                ctld_port=_free_port(),
                slurmd_port=_free_port(),
                proctrack=self.proctrack,
                first_job_id=random.randrange(1, 10**6),
                node_lines="\n".join(
                    f"NodeName={n} NodeAddr={a} CPUs={self.cpus}"
                    for n, a in zip(self.nodes, self.addrs)
                ),
            )
        )
        if self.namespaces:
            self._make_namespaces()
        # slurmctld checks time limits (and sends --signal) every 30 s from here
        self.started_at = time.time()
        # -D: our child, waited for; no pid file to trust
        self._daemon(["slurmctld", "-D"], 0, "slurmctld")
        while (
            "UP" not in self.run(["scontrol", "ping"], timeout=10).stdout
        ):  # a slurmd that finds no
            self._check_start(t0, timeout)  # slurmctld retries 1 s later
        for i, n in enumerate(self.nodes):
            self._daemon(["slurmd", "-D", "-N", n], i, f"slurmd-{n}")
        while self.run(["sinfo", "-h", "-N", "-o", "%t"], timeout=10).stdout.split() != [
            "idle"
        ] * len(self.nodes):
            self._check_start(t0, timeout)
        return self

    def _check_start(self, t0, timeout):
        dead = [d.name for d in self._daemons if d.poll() is not None]
        if dead or time.monotonic() - t0 > timeout:
            raise RuntimeError(f"Slurm did not start (exited: {dead}):\n{self.logs()}")
        time.sleep(0.05)

    def _daemon(self, argv, node, name):
        with open(
            self.root / "log" / f"{name}.out", "w"
        ) as out:  # errors from before its log file opens
            self._daemons.append(
                subprocess.Popen(
                    self.cmd(argv, node),
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        self._daemons[-1].name = name

    def _make_namespaces(self):
        (self.root / "hosts").write_text(
            "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in zip(self.nodes, self.addrs))
        )

        def sh(*argv):
            subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)

        for ns in self.namespaces:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", self._veths[0], "type", "veth", "peer", "name", self._veths[1])
        for ns, veth, addr in zip(self.namespaces, self._veths, self.addrs):
            sh("ip", "link", "set", veth, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            sh("ip", "-n", ns, "link", "set", veth, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def processes(self):
        """Pids of everything of this cluster still running but its daemons (and slurmctld's helper)."""
        daemons = {d.pid for d in self._daemons}
        pids = _pids_of(self.root, self.namespaces)
        return {
            pid for pid in pids if pid not in daemons and (_stat(pid) or ("", 0))[1] not in daemons
        }

    def reset(self, timeout=15):
        """Cancel every job, wait (up to `timeout` s) until they are gone and give their last processes a
        second, then kill whatever still runs but the daemons. Returns descriptions of those killed: leaks
        (a process that left its parent for a session of its own escapes proctrack)."""
        jobs = self.run(["squeue", "-h", "-o", "%A"], timeout=10).stdout.split()
        if jobs:  # SIGTERM, SIGKILL KillWait s later
            self.run(["scancel", *jobs], timeout=10)
        deadline = time.monotonic() + timeout
        while jobs and self.run(["squeue", "-h", "-o", "%A"], timeout=10).stdout.split():
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        # a job's slurmstepd exits a moment after squeue drops the job
        deadline = time.monotonic() + 1
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        strays = self.processes()
        found = [_describe(p) for p in sorted(strays)]
        send(strays)
        # A node drained by a step that could not be killed would fail every later test.
        for line in self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10).stdout.splitlines():
            name, state = line.split()
            if state.rstrip("*~#") not in ("idle", "alloc", "mix", "comp"):
                self.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], timeout=10)
        return found

    def stop(self):
        """Stop everything, also after a failed start. The directory (logs) stays until the next session."""
        try:
            if self._daemons and all(d.poll() is None for d in self._daemons):
                self.reset(timeout=5)
        except (subprocess.SubprocessError, OSError, ValueError):
            pass
        for d in reversed(self._daemons):  # slurmds first
            d.terminate()
        for d in self._daemons:
            try:
                d.wait(5)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait(5)
        _reap(self.root, self.namespaces, remove=False)
        for veth in getattr(
            self, "_veths", []
        ):  # still on the host if start failed before moving it
            subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)

    def logs(self, lines=30):
        """The last lines of the daemons' logs, for error messages."""
        return "".join(
            f"--- {p.name}\n" + "".join(p.read_text(errors="replace").splitlines(True)[-lines:])
            for p in sorted((self.root / "log").glob("*"))
        )


def _reap(root, namespaces=None, remove=True):
    """Kill every process of the cluster in `root` and delete its namespaces (default: all those named
    after it); with `remove`, its directory too."""
    if namespaces is None:
        listed = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True
        ).stdout.split()
        namespaces = [ns for ns in listed if re.fullmatch(f"slurmfx{root.name}n\\d+", ns)]
    for _ in range(3):  # again for what the killed ones' children became
        send(_pids_of(root, namespaces))
        time.sleep(0.05)
    for ns in namespaces:  # takes its end of the veth pair along
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    if remove:
        shutil.rmtree(root, ignore_errors=True)


def reap_dead_sessions():
    """What sessions killed without a chance to clean up (SIGKILL) left: processes, namespaces, directories."""
    for root in SLURM_BASE.glob("*x*"):
        pid = root.name.split("x")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            _reap(root)


def _slurm_skip_reason(nodes):
    if os.geteuid() != 0:
        return "a SLURM cluster needs root (slurmd runs jobs as root here)"
    tools = ["slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo"]
    missing = [
        t
        for t in tools + (["ip", "nsenter", "unshare", "mount"] if nodes > 1 else [])
        if not shutil.which(t)
    ]
    if missing:
        return f"missing {' '.join(missing)} (apt-get install --no-install-recommends slurmctld slurmd slurm-client)"
    return None


def _sigterm_to_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def slurm_clusters():
    """get(nodes=1, proctrack="linuxproc", cpus=2): a started SlurmCluster, one per configuration and
    session; all stopped at its end."""
    clusters = {}
    # SIGTERM (`timeout`, a CI cancel) would end Python at once: as Ctrl-C, it runs the teardowns.
    restore = (
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        and threading.current_thread() is threading.main_thread()
    )
    if restore:
        signal.signal(signal.SIGTERM, _sigterm_to_keyboard_interrupt)

    def get(nodes=1, **options):
        key = (nodes, *sorted(options.items()))
        if key not in clusters:
            reason = _slurm_skip_reason(nodes)
            if reason:
                pytest.skip(reason)
            if not clusters:
                reap_dead_sessions()
            cluster = SlurmCluster(nodes, **options)
            try:
                cluster.start()
            except subprocess.CalledProcessError as exc:  # from `ip`: root without CAP_NET_ADMIN...
                cluster.stop()
                pytest.skip(f"cannot create network namespaces here: {exc.stderr or exc}")
            except BaseException:
                cluster.stop()
                raise
            clusters[key] = cluster
        return clusters[key]

    try:
        yield get
    finally:
        for cluster in clusters.values():
            cluster.stop()
        if restore:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _cluster_fixture(request, slurm_clusters, nodes):
    param = getattr(request, "param", {})
    cluster = slurm_clusters(nodes, **({"proctrack": param} if isinstance(param, str) else param))
    yield cluster
    leaked = cluster.reset()
    if leaked and getattr(request.session, "exitstatus", None) != pytest.ExitCode.INTERRUPTED:
        pytest.fail("processes left running after the test (killed):\n" + "\n".join(leaked))


@pytest.fixture
def slurm_cluster(request, slurm_clusters):
    """A 1-node cluster; parametrize indirectly with "linuxproc" or "pgid", or a dict of SlurmCluster options."""
    yield from _cluster_fixture(request, slurm_clusters, 1)


@pytest.fixture
def slurm_cluster2(request, slurm_clusters):
    """A 2-node cluster (node0, node1); parametrized like slurm_cluster."""
    yield from _cluster_fixture(request, slurm_clusters, 2)
