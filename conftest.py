"""This file holds the fixtures of test_ddp_train.py. The first is a user's project with
examples/digits.py, examples/tinylm.py and user.py, which changes one thing of them. The others are
two hosts made of network namespaces, a real SLURM cluster of two nodes, and the README's code
blocks. The launches and the copy check that the tests share with make check are in
check_copy.py."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from check_copy import (
    PY,
    ROOT,
    CpuSlots,
    Result,
    clean_env,
    free_port,
    run,
    share_slots,
)

RUN_MULTI = str(ROOT / "run_multi_node.sh")


def pytest_configure(config):
    """The first pytest process of a session makes the CPU slots, and its workers inherit them."""
    share_slots()


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """Every launch sees no GPU and runs gloo on the CPU, even on a GPU machine, unless the test is
    marked gpu."""
    if not request.node.get_closest_marker("gpu"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def assert_same_weights(a: dict, b: dict, exact=False, rtol=1e-4):
    """Assert that the weights are the same bit for bit, or that each tensor is within `rtol` of
    the other in relative norm."""
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{k} differs by up to {(a[k] - b[k]).abs().max():.3g}"
        else:
            gap = ((a[k] - b[k]).norm() / b[k].norm()).item()
            assert gap <= rtol, f"{k} differs by {gap:.3g} (relative norm)"


@contextlib.contextmanager
def shared(tmp_path_factory, name):
    """Yield a directory of the session that the pytest-xdist workers share, and hold it under a
    lock. The first worker to get it makes what it holds and touches its "done" file. The other
    workers find it made."""
    root = tmp_path_factory.getbasetemp()
    d = (root.parent if "PYTEST_XDIST_WORKER" in os.environ else root) / "shared" / name
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield d
        (d / "done").touch()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(cmd, **env) returns the Result of a run that several tests compare against. The
    pytest-xdist worker that asks first makes it, once per session."""

    def get(cmd, **env):
        # A test that holds slots for its launches would wait here for a worker that waits for them.
        assert not CpuSlots.reserved, "take a reference before reserve_slots(), not inside it"
        key = hashlib.sha256(repr((cmd, sorted(env.items()))).encode()).hexdigest()[:12]
        with shared(tmp_path_factory, key) as d:
            if not (d / "done").exists():
                # An attempt that failed left its out-dir. A retry that found it would resume that
                # attempt's checkpoint or find its finished run, so the retry starts afresh.
                shutil.rmtree(d / "out", ignore_errors=True)
                run(cmd, d, env=clean_env(**env))
        return Result(0, (d / "out.out").read_text(), (d / "out.err").read_text(), d / "out")

    return get


# ---------------------------------------------------------------------------
# A user's project holds ddp_train.py beside examples/digits.py, examples/tinylm.py and user.py.
# ---------------------------------------------------------------------------

# user.py runs the task BASE, which is digits or tinylm, or else the default task. It makes the
# changes that VARIANT names, separated by commas. Rank STOP_RANK sends STOP_SIGNAL to itself in its
# STOP_AT-th training micro-batch. With STOP_TARGET=parent, it sends the signal to torchrun instead.
# It sends the signal once per job, and not in a restarted worker. VARIANT=lateleader holds rank 0
# of a restarted round back for 5 s, so that its peers join first. The first run of an out-dir may
# also die in report() at step FAIL_STEP. A run is the first while RECORD.first does not exist yet.
USER_PY = '''
import collections, contextlib, math, os, signal, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
import ddp_train

env = os.environ
if env.get("BASE"):
    base = __import__(env["BASE"])
    for name, value in [("TRAIN_SIZE", "LM_TRAIN"), ("EVAL_SIZE", "LM_EVAL"), ("DROPOUT", "LM_DROPOUT"), ("PASSES", "LM_PASSES")]:
        if value in env:
            setattr(base, name, type(getattr(base, name))(env[value]))
variant, loss_of, calls = env.get("VARIANT", "").split(","), ddp_train.compute_loss, [0]
count_of = ddp_train.count_items
if "lateleader" in variant and env.get("RANK") == "0" and env.get("TORCHELASTIC_RESTART_COUNT") == "1":
    time.sleep(5)  # the restarted rank 1 meets the old round's keys first


def count_items(batch):
    if "indices" in variant:  # The last part of the batch is the indices.
        batch = batch[:-1]
    if isinstance(batch, Encoded):
        batch = (batch["inputs"], batch["targets"])
    return 2 * count_of(batch) if "miscount" in variant else count_of(batch)


def compute_loss(model, batch, args):
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
        if "maps" in variant and str(calls[0]) in env["MAPS_AT"].split(","):  # the files it maps
            with open("/proc/self/maps") as maps, open(f"{env['RECORD']}.{env.get('RANK', 0)}.{calls[0]}", "w") as f:
                f.write(maps.read())
        if "options" in variant and calls[0] == 3:  # the matmul precision, and the child processes
            children = [p for p in os.listdir("/proc") if p.isdigit() and parent_of(p) == os.getpid()]
            with open(f"{env['RECORD']}.options.{env.get('RANK', 0)}", "w") as f:
                f.write(f"{torch.get_float32_matmul_precision()} {len(children)}")
        if "slowtrain" in variant:  # each micro-batch takes at least 0.2 s
            time.sleep(0.2)
        if "waitjoin" in variant and env["WORLD_SIZE"] == "1":
            while not signalled:  # alone in its round: on until a node joins and torchrun stops it
                time.sleep(0.05)
    elif "indices" in variant:
        batch.pop()
    if isinstance(batch, Encoded):
        batch = (batch["inputs"], batch["targets"])
    if "sloweval" in variant and not model.training and calls[0] == int(env["SLOW_EVAL_AFTER"]):
        open(f"{env['RECORD']}.evaluating", "a").close()  # each eval batch takes 4 s
        time.sleep(4)
    if "evalafterstop" in variant and not model.training and stop_agreed:
        open(f"{env['RECORD']}.evaluated-after-the-stop", "a").close()
    output = loss_of(model, batch, args)
    loss, metrics = output if isinstance(output, tuple) else (output, {})
    nan_now = calls[0] >= int(env.get("NAN_AT", 10**9)) and env.get("RANK", "0") == "1"
    if "nan" in variant and nan_now:
        loss = loss * math.nan
    if "nangrad" in variant and nan_now and model.training:
        loss.register_hook(lambda grad: grad * math.nan)  # a finite loss, a NaN gradient
    if "trainmetric" in variant and model.training:
        return loss, {"twice": 2 * loss}
    if "reserved" in variant:
        return loss, {"loss": loss}
    if "shape" in variant:
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none")
    return loss, metrics


def parent_of(pid):
    with contextlib.suppress(OSError):
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def configure_torch(args):  # (options)
    torch.set_float32_matmul_precision("medium")


def build_optimizer(args, model, plan):
    return torch.optim.SGD(model.parameters(), lr=args.lr)


def build_scheduler(args, optimizer, plan):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=plan.total_steps)


def build_plateau(args, optimizer, plan):  # (plateau: halves the rate after an eval loss not 30% below the best)
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.3)


def make_data_once_per_call(args):  # (downloads: notes each call of cached.py's make_data)
    with open(f"{os.environ['DATA_CACHE']}.downloads", "a") as f:
        f.write(f"rank {args.rank} local rank {args.local_rank}\\n")
    return make_data_of_the_recipe(args)


def report(record, args, model):
    with open(f"{env['RECORD']}.{env.get('RANK', 0)}", "a") as f:
        f.write(repr(record) + "\\n")
    first_run = not os.path.exists(f"{env['RECORD']}.first")
    failing_kind = record["kind"] in env.get("FAIL_KINDS", record["kind"])  # all kinds by default
    if record["step"] == int(env.get("FAIL_STEP", -1)) and failing_kind and first_run:
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


def train_step_without_syncs(args, world, state, batches, step_sync, log_now, epoch_ends):
    """nosync: any wait for the GPU in a step that neither logs, evaluates nor saves is an error.
    Not checked: the steps before CHECK_FROM (DDP measures its own first 10 iterations with CUDA
    events, which waits for them)."""
    step = state.progress.step + 1
    torch.cuda.set_sync_debug_mode("error" if step >= int(env.get("CHECK_FROM", 1)) else "default")
    result = train_step_of_the_script(args, world, state, batches, step_sync, log_now, epoch_ends)
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


def masked_loss(model, batch, args):
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


def count_targets(batch):
    return int((batch[1] != -100).sum())


class Indexed(torch.utils.data.Dataset):
    """Each item of the base's Dataset, and its index."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return (*self.data[i], i)


stop_agreed, signalled = False, False


def on_signal(step_sync, signum, frame):  # (waitjoin: notes a stop signal)
    global signalled
    signalled = True
    on_signal_of_the_script(step_sync, signum, frame)


on_signal_of_the_script = ddp_train.StepSync.on_signal
if "waitjoin" in variant:
    ddp_train.StepSync.on_signal = on_signal


def finish(step_sync):  # (evalafterstop: notes the agreed stop)
    global stop_agreed
    finish_of_the_script(step_sync)
    stop_agreed = stop_agreed or step_sync.should_stop


finish_of_the_script = ddp_train.StepSync.finish
if "evalafterstop" in variant:
    ddp_train.StepSync.finish = finish


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


def save_and_die(obj, f, *args, **kwargs):  # (killsave: killed while it writes its first checkpoint)
    if isinstance(obj, dict) and "progress" in obj:
        f.write(b"the start of a checkpoint")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return torch_save(obj, f, *args, **kwargs)


torch_save = torch.save
if "killsave" in variant:
    torch.save = save_and_die
if "sgd" in variant:
    ddp_train.build_optimizer = build_optimizer
if "onecycle" in variant:
    ddp_train.build_scheduler = build_scheduler
if "options" in variant:
    ddp_train.configure_torch = configure_torch
if "plateau" in variant:
    ddp_train.build_scheduler = build_plateau
if "downloads" in variant:
    make_data_of_the_recipe, base.make_data = base.make_data, make_data_once_per_call
if "report" in variant:
    ddp_train.report = report
if "masked" in variant:
    ddp_train.build_datasets = lambda args: [d and Masked(d) for d in build_datasets(args)]
    ddp_train.collate_fn = lambda items, args, training: torch.utils.data.default_collate(items)
    ddp_train.COUNT_UNIT, loss_of = "tokens", masked_loss
    count_of = count_targets
if "indices" in variant:
    ddp_train.build_datasets = lambda args: [d and Indexed(d) for d in build_datasets(args)]
if "wide" in variant:
    ddp_train.build_model = lambda args: nn.Sequential(nn.Linear(ddp_train.FEATURES, 64), nn.Linear(64, 10))
if "unused" in variant:
    ddp_train.build_model = lambda args: Sometimes(build_model(args))
if "one-argument-collate" in variant:  # a collate_fn written before it took the flags
    ddp_train.collate_fn = lambda items: collate_default(items, None, True)
if "iterable" in variant:  # an IterableDataset: no __len__, and with "stateful" a state_dict()
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))
    if "stateful" in variant:
        Stream.state_dict, Stream.load_state_dict = (lambda self: {}), (lambda self, state: None)
    ddp_train.build_datasets = lambda args: (Stream(), None)
if "numpystate" in variant:  # a stream whose place is a numpy float, which weights_only cannot read
    import numpy
    base.TokenStream.state_dict = lambda self: {"read": numpy.float64(self.read)}
if "namedtuple" in variant:  # batches as namedtuples
    ddp_train.collate_fn = lambda items, args, training: Batch(*collate_default(items, args, training))
if "encoded" in variant:  # batches as a tokenizer gives them
    ddp_train.collate_fn = lambda items, args, training: Encoded(
        zip(("inputs", "targets"), collate_default(items, args, training))
    )
if "tokens" in variant:  # the default task's count, an int, as tokens: a token run of ints
    ddp_train.COUNT_UNIT = "tokens"
if "frozen" in variant:  # the first BatchNorm kept in eval mode (fine-tuning): no statistics move
    def frozen_model(args):
        model = build_model(args)
        model[1].eval()
        return model
    ddp_train.build_model = frozen_model
ddp_train.compute_loss, ddp_train.count_items = compute_loss, count_items


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
    try:
        sys.exit(ddp_train.main())
    finally:
        if threads_before:  # (threads, in a process of the group) its threads that outlive main()
            left = sorted(name for tid, name in threads().items() if tid not in threads_before)
            with open(f"{env['RECORD']}.{env.get('RANK', 0)}", "w") as f:
                f.write(" ".join(left))
'''


@pytest.fixture(scope="session")
def project(tmp_path_factory) -> Path:
    """Return a user's project directory. It holds a copy of ddp_train.py, the examples, the
    recipes of the README and of docs/recipes.md, such as ema.py, and user.py. BASE=ema makes
    user.py run ema.py's task."""
    with shared(tmp_path_factory, "project") as d:
        if not (d / "done").exists():
            for name in (
                "ddp_train.py",
                *(f"examples/{n}.py" for n in ("digits", "tinylm", "stream")),
            ):
                shutil.copy(ROOT / name, d)
            for language, text, _ in doc_blocks():
                recipe = re.match(r"# (\w+\.py): ", text)
                if language == "python" and recipe:
                    (d / recipe.group(1)).write_text(text)
            (d / "user.py").write_text(USER_PY.lstrip())
    return d


# ---------------------------------------------------------------------------
# Two hosts are network namespaces, each with an address, a hostname and an /etc/hosts of its own.
# ---------------------------------------------------------------------------


def sh(*argv):
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


class Host:
    def __init__(self, ns, addr, ifname, hostname):
        self.ns, self.addr, self.ifname, self.hostname = ns, addr, ifname, hostname

    def command(self, *argv):
        # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts. unshare gives the host a
        # hostname of its own.
        unshare = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname]
        return ["ip", "netns", "exec", self.ns, *unshare, *map(str, argv)]


@pytest.fixture(scope="module")
def two_hosts():
    """Yield two hosts joined by a veth pair, and delete them afterwards. Skip the test where
    namespaces cannot be made."""
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
# This is a real SLURM cluster of two nodes. It uses Debian's slurmctld and slurmd with auth/none.
# node0 has the address 10.232.0.1, and node1 has 10.232.0.2. Each node is in a network namespace of
# its own, and a veth pair joins them. slurmctld and the client commands run on node0. The cluster
# starts once per session, in /tmp/slurm-fixture/<pid>. After each test, the fixture cancels the
# test's jobs, and a process of the test that is still running then fails it. To install Slurm, run
# this as root:
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
    """This cluster runs slurmctld and two slurmd as children of this process. Each node is in a
    network namespace."""

    def __init__(self):
        self.root = Path(tempfile.gettempdir()) / "slurm-fixture" / str(os.getpid())
        self.namespaces = [f"slurmfx{os.getpid()}n{i}" for i in range(2)]
        # Jobs inherit this environment, because sbatch exports the submitter's environment. So this
        # Python comes first on PATH.
        path = f"{os.path.dirname(PY)}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        self.env = {**clean_env(), "PATH": path, "SLURM_CONF": str(self.root / "slurm.conf")}
        self.daemons = []

    def cmd(self, argv, node=0):
        """Return the command that runs argv on a node. It runs in the node's network namespace,
        with the node's hostname and an /etc/hosts of both nodes."""
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
        """Return `scontrol show job` as a dict with keys such as JobState, ExitCode and Restarts.
        ExitCode has the form "code:signal"."""
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
        """Return every process that runs in the cluster's namespaces, except its daemons."""
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
        """Cancel every job. Kill the processes that still run 10 s later, and return them."""
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
        # Deleting a namespace takes its end of the veth pair along.
        for ns in self.namespaces:
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
    # A SIGTERM, such as a CI cancel, would end Python at once. This handler turns it into a
    # Ctrl-C, so that the teardown runs.
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
# The tests run the code blocks of the README and of docs/recipes.md as a newcomer runs them.
# ---------------------------------------------------------------------------


RECIPES = ROOT / "docs/recipes.md"


def doc_blocks() -> list[tuple[str, str, str | None]]:
    """Return the fenced bash and python blocks of the README and then of docs/recipes.md, in order.
    Each block is a tuple of its language, its text, and why it is not run or None. A block is not
    run where the line before it says `<!-- not run by the tests: WHY -->`."""
    blocks, why = [], None
    lines = [*(ROOT / "README.md").read_text().splitlines(), "", *RECIPES.read_text().splitlines()]
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
    """Copy this project's tracked files into `repo`, and make a .venv there that runs this Python.
    This is the .venv that `make setup` leaves where the Python that it is made from has torch."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    for name in tracked.split():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)
    (repo / ".venv/bin").mkdir(parents=True)
    (repo / ".venv/bin/python").write_text(f'#!/bin/sh\nexec {PY} "$@"\n')
    (repo / ".venv/bin/python").chmod(0o755)
    (repo / ".venv/.ready").touch()
    return repo
