"""This file tests ddp_train.py. The tests run the real script in real processes, with gloo on the
CPU, and each test checks one guarantee. The launch helpers and the copy check that make check runs
are in check_copy.py. conftest.py holds the fixtures, which are the user's project, two hosts, a
SLURM cluster and the blocks of the README and docs/recipes.md."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import math
import os
import signal
import random
import re
import shlex
import shutil
import socket
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import check_copy
import ddp_train
from check_copy import (
    CHECK_TIMEOUT,
    GUARANTEES,
    PY,
    ROOT,
    SCRIPT,
    PEER_TIMEOUT,
    Launch,
    Result,
    bindable,
    clean_env,
    free_port,
    launcher_aborted,
    processes,
    python_cmd,
    reserve_slots,
    run,
    torchrun_cmd,
)
from conftest import RUN_MULTI, assert_same_weights, doc_blocks, fresh_checkout

# These are ddp_train's own task functions. The tests keep them here before they import an example
# that replaces them.
build_datasets, build_model = ddp_train.build_datasets, ddp_train.build_model
# The run has 1000 samples, so a step of 32 or 64 leaves a partial global batch out. The 301 eval
# samples do not split evenly.
SMALL = ["--num-samples", 1000, "--eval-samples", 301, "--epochs", 2, "--batch-size", 32]
SMALL += ["--log-every", 0]
# With torchrun 2 x 16, or with 1 process x 32, an epoch has 64 steps. The run saves a checkpoint
# every 10 steps.
RESUME = ["--num-samples", 2048, "--eval-samples", 100, "--epochs", 2, "--save-every", 10]
RESUME += ["--log-every", 20, "--batch-size", 16]
DIGITS = ["--epochs", 2, "--batch-size", 16, "--save-every", 10, "--log-every", 20]
# These settings shrink tinylm. It then trains on 64 functions and evaluates on 8.
LM = dict(BASE="tinylm", LM_TRAIN=64, LM_EVAL=8)
gpu, long, multinode, slurm, tier = (
    getattr(pytest.mark, m) for m in ("gpu", "long", "multinode", "slurm", "tier")
)


def example(name):
    """Import examples/NAME.py as a module, and leave ddp_train's own task functions in place."""
    saved = dict(vars(ddp_train))
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    vars(ddp_train).update(saved)
    return module


def args_of(*argv):
    return ddp_train.parse_args([str(a) for a in argv])


def user_cmd(project, launch, *args):
    """Return the command that runs the project's user.py. The launch is "python", "spawn N" for
    python --spawn N, or "torchrun N"."""
    script = str(project / "user.py")
    if launch == "python":
        return python_cmd(*args, script=script)
    if launch.startswith("spawn"):
        return python_cmd(*args, "--spawn", launch.split()[1], script=script)
    return torchrun_cmd(int(launch.split()[1]), *args, script=script)


def shuffle(n, epoch, seed=0):
    """Return the epoch's shuffle of n samples, as DistributedSampler draws it. Every world size
    shares this shuffle."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def last_line(text):
    return text.strip().splitlines()[-1] if text.strip() else ""


def steady(records):
    """Return the records without their timings. An interrupted run and an uninterrupted one share
    these."""
    return [
        {k: v for k, v in r.items() if not k.endswith(("_per_s", "eta_s", "epoch_s"))}
        for r in records
    ]


# ---------------------------------------------------------------------------
# Every launch mode trains the same run, and only rank 0 speaks and writes.
# ---------------------------------------------------------------------------

MODES = {
    "python": (python_cmd, 1),
    "torchrun-1": (lambda *a: torchrun_cmd(1, *a), 1),
    "torchrun-2": (lambda *a: torchrun_cmd(2, *a), 2),
    "spawn-2": (lambda *a: python_cmd(*a, "--spawn", 2), 2),
    "python-m-spawn-2": (lambda *a: [PY, "-m", "ddp_train", *a, "--spawn", 2], 2),
    "legacy-launcher-2": (
        lambda *a: [PY, "-m", "torch.distributed.launch", "--nproc_per_node=2", SCRIPT, *a],
        2,
    ),
}


@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=[] if "1" in m or "-m" in m else [tier]) for m in MODES]
)
def test_every_launch_mode_trains_the_same_run_and_only_rank_0_writes(reference, mode):
    # Each mode's run is a reference run, because other tests compare against the runs of python
    # and torchrun 2.
    cmd, world = MODES[mode]
    r = reference(cmd(*SMALL[:-3], 32 // world, "--log-every", 0))
    assert f"world size {world}," in r.stdout and r.stdout.count("saved ") == 1, r
    assert [m["world_size"] for m in r.records("epoch")] == [world, world]
    files = ["checkpoint.pt", "checkpoint.prev.pt", "metrics.jsonl", "model.pt"]
    assert sorted(p.name for p in r.out_dir.iterdir()) == sorted(files)
    # The load is strict, so the weights have no "module." or "_orig_mod." prefix.
    build_model(args_of()).load_state_dict(r.weights)
    # N processes x 32 / N have the same global batch as one process x 32, so they train the same
    # run. The python mode's run is that one process's run.
    if mode != "python":
        one = reference(python_cmd(*SMALL))
        assert_same_weights(r.weights, one.weights, exact=world == 1)
    # The same world size, started in any way, trains the same run bit for bit.
    if world == 2 and mode != "torchrun-2":
        two = reference(MODES["torchrun-2"][0](*SMALL[:-3], 16, "--log-every", 0))
        assert_same_weights(r.weights, two.weights, exact=True)


def test_srun_variables_are_translated_into_torchruns(tmp_path, reference):
    # This test imitates a bare `srun -n2 python ddp_train.py` by hand. MASTER_ADDR is the first
    # host of the step's node list, and it keeps its suffix, so it is 127.0.0.1. The port comes from
    # the job and step ids, as run_multi_node.sh picks it. The test
    # test_srun_tasks_are_the_processes_of_one_run does the same on a real cluster.
    jobs = (random.randrange(10**6) for _ in range(100))
    job = next(j for j in jobs if bindable(61000 + (j * 11 + 3) % 4500))
    slurm = dict(
        SLURM_STEP_NUM_TASKS=2, SLURM_STEP_NODELIST="127.0.[0-3].1,node7", SLURM_JOB_ID=job
    )
    slurm |= dict(SLURM_STEP_ID=3)
    args = [*SMALL[:-3], 16, "--log-every", 0, "--out-dir", tmp_path / "out"]
    two = reference(torchrun_cmd(2, *SMALL[:-3], 16, "--log-every", 0))
    with reserve_slots(2):
        tasks = [
            Launch(
                python_cmd(*args),
                tmp_path,
                f"task{i}",
                env=clean_env(SLURM_PROCID=i, SLURM_LOCALID=i, **slurm),
            )
            for i in range(2)
        ]
        with tasks[0], tasks[1]:
            assert [t.wait() for t in tasks] == [0, 0], tasks[0].stderr + tasks[1].stderr
    r = tasks[0].result(tmp_path / "out")
    assert "world size 2," in r.stdout and not tasks[1].stdout, r
    assert_same_weights(r.weights, two.weights, exact=True)


# ---------------------------------------------------------------------------
# The means are exact. N x B equals 1 x N*B, one SGD step is w0 - lr x the gradient of the mean,
# and the evaluation is exact.
# ---------------------------------------------------------------------------


@tier
def test_n_processes_x_b_with_accumulation_equal_one_process_x_n_times_b(tmp_path, reference):
    # 2 processes x 8 x 2 micro-batches equal 1 process x 32. An epoch has 31 full steps and leaves
    # 8 samples out. The run clips the global gradient at every step.
    clip = ["--clip-grad-norm", 0.5]
    two = run(torchrun_cmd(2, *SMALL[:-3], 8, "--grad-accum", 2, *clip), tmp_path, "two")
    one = run(python_cmd(*SMALL, *clip), tmp_path, "one")
    assert (
        "global batch 32 = 8/process x 2 x 2 accum, 31 steps/epoch (each leaves out 8" in two.stdout
    )
    assert_same_weights(two.weights, one.weights)
    # The tolerance tells apart a learning rate that is 1% off.
    other = run(python_cmd(*SMALL, *clip, "--lr", 0.00099), tmp_path, "other")
    with pytest.raises(AssertionError):
        assert_same_weights(two.weights, other.weights)


def gap(got: dict, want: dict) -> float:
    """Return the largest relative distance of one update from another, over all the tensors."""
    return max(((got[k].double() - want[k]).norm() / want[k].norm()).item() for k in want)


def sgd_step(model, loss_of, lr=0.5):
    """Take one step by hand. Return w0 - lr x the gradient of loss_of(model) in float64, and
    return that loss."""
    model = model.double()
    loss = loss_of(model)
    loss.backward()
    return {k: (p - lr * p.grad).detach() for k, p in model.named_parameters()}, loss.item()


ONE_STEP = ["--max-steps", 1, "--lr", 0.5, "--eval-samples", 0, "--log-every", 0]


@pytest.mark.parametrize("launch", ["python", "torchrun 2"])
def test_one_sgd_step_over_samples_is_w0_minus_lr_times_the_gradient_of_their_mean(
    project, tmp_path, launch
):
    # There are 50 samples and a global batch of 48 in micro-batches of 12. Under python, the one
    # process runs 4 of them, and under torchrun, each rank runs 2. The step trains the first 48
    # samples of epoch 0's shuffle, and it leaves the other 2 out.
    split = ["--batch-size", 12, "--grad-accum", 4 if launch == "python" else 2]
    r = run(
        user_cmd(project, launch, "--num-samples", 50, *ONE_STEP, *split),
        tmp_path,
        env=clean_env(VARIANT="sgd"),
    )
    torch.manual_seed(0)
    model = build_model(args_of())
    x, y = build_datasets(args_of("--num-samples", 50))[0].tensors
    step = shuffle(50, 0)[:48]
    want, loss = sgd_step(model, lambda m: F.cross_entropy(m(x[step].double()), y[step]))
    assert gap(r.weights, want) < 1e-5, gap(r.weights, want)
    assert r.records("epoch")[0]["train_loss"] == pytest.approx(loss, rel=1e-6)
    # These are the negative controls. The first uses the gradient of the sum, as when a mean is
    # taken for a sum. The second uses all 50 samples.
    torch.manual_seed(0)
    summed, _ = sgd_step(
        build_model(args_of()),
        lambda m: F.cross_entropy(m(x[step].double()), y[step], reduction="sum"),
    )
    torch.manual_seed(0)
    every, _ = sgd_step(build_model(args_of()), lambda m: F.cross_entropy(m(x.double()), y))
    assert gap(r.weights, summed) > 1e-2 and gap(r.weights, every) > 10 * gap(r.weights, want)


@pytest.mark.parametrize("launch", ["python", "torchrun 2"])
def test_one_sgd_step_over_tokens_is_w0_minus_lr_times_the_gradient_of_their_mean(
    project, tmp_path, launch
):
    # In user.py's "masked" task, only every tenth sample has a target token. A global batch of 96
    # of the 100 samples comes in micro-batches of 4. Most micro-batches hold no token, so their
    # mean is 0/0, and they must weigh nothing.
    split = ["--batch-size", 4, "--grad-accum", 24 if launch == "python" else 12]
    cmd = user_cmd(project, launch, "--num-samples", 100, *ONE_STEP, *split)
    r = run(cmd, tmp_path, env=clean_env(VARIANT="sgd,masked"))
    torch.manual_seed(0)
    model = build_model(args_of())
    x, y = build_datasets(args_of("--num-samples", 100))[0].tensors
    tokens = [i for i in shuffle(100, 0)[:96] if i % 10 == 9]
    want, loss = sgd_step(model, lambda m: F.cross_entropy(m(x[tokens].double()), y[tokens]))
    assert gap(r.weights, want) < 1e-5, gap(r.weights, want)
    epoch = r.records("epoch")[0]
    assert epoch["train_loss"] == pytest.approx(loss, rel=1e-6) and epoch["train_tokens"] == len(
        tokens
    )
    torch.manual_seed(0)
    summed, _ = sgd_step(
        build_model(args_of()),
        lambda m: F.cross_entropy(m(x[tokens].double()), y[tokens], reduction="sum"),
    )
    assert gap(r.weights, summed) > 1e-2


def test_a_step_without_a_single_token_changes_nothing(project, tmp_path):
    # The "masked" task takes 2 samples a step. Steps 1 and 3 hold one token each, which are the
    # samples 19 and 69, and step 2 holds none. With SGD, w3 = w0 - lr x the two tokens' gradients
    # in turn, at the cosine's lr of steps 1 and 3, which is lr x 1 and lr x 0.25. The empty step
    # neither moves the weights nor poisons them. The run writes a line at every step. The line of
    # step 2 has no train_loss, because that would be a mean over no token, and the run does not
    # divide by zero. The epoch's metric train_twice is exact too.
    args = ["--num-samples", 100, *ONE_STEP[2:], "--max-steps", 3, "--batch-size", 2]
    args += ["--log-every", 1]
    env = clean_env(VARIANT="sgd,masked,trainmetric")
    r = run(user_cmd(project, "python", *args), tmp_path, env=env)
    x, y = build_datasets(args_of("--num-samples", 100))[0].tensors
    assert [i for i in shuffle(100, 0)[:6] if i % 10 == 9] == [19, 69]
    torch.manual_seed(0)
    model, losses = build_model(args_of()), []
    for i, lr in ((19, 0.5), (69, 0.125)):
        weights, loss = sgd_step(model, lambda m: F.cross_entropy(m(x[[i]].double()), y[[i]]), lr)
        model.load_state_dict(weights)
        model.zero_grad()
        losses.append(loss)
    assert gap(r.weights, weights) < 1e-5, gap(r.weights, weights)
    epoch = r.records("epoch")[0]
    assert epoch["train_tokens"] == 2 and epoch["train_loss"] == pytest.approx(
        sum(losses) / 2, rel=1e-6
    )
    # A metric's mean over no token weighs nothing too, as the loss's mean does. The file holds no
    # NaN.
    assert epoch["train_twice"] == pytest.approx(2 * epoch["train_loss"], rel=1e-12), epoch
    assert "NaN" not in (r.out_dir / "metrics.jsonl").read_text()
    lines = r.records("progress")
    assert [("train_loss" in line) for line in lines] == [True, False, True], lines
    assert lines[0]["train_loss"] == pytest.approx(losses[0], rel=1e-6)


@tier
@long
def test_one_sgd_step_of_a_language_model_is_w0_minus_lr_times_the_gradient_of_its_token_mean(
    project, tmp_path
):
    # This runs tinylm with dropout off. 2 ranks x 4 sequences x 3 micro-batches make 24 of its 26
    # functions, and each function is padded in its own micro-batch. Every real target token weighs
    # the same, whatever the length of its sequence.
    env = clean_env(VARIANT="sgd", **{**LM, "LM_TRAIN": 26, "LM_EVAL": 4, "LM_DROPOUT": 0.0})
    r = run(
        user_cmd(project, "torchrun 2", *ONE_STEP, "--batch-size", 4, "--grad-accum", 3),
        tmp_path,
        env=env,
    )
    tinylm = example("tinylm")
    tinylm.TRAIN_SIZE, tinylm.EVAL_SIZE, tinylm.DROPOUT = 26, 4, 0.0
    torch.manual_seed(0)
    model = tinylm.build_model(None)
    w0 = {k: v.double() for k, v in model.state_dict().items()}
    train_set, _ = tinylm.build_datasets(None)
    batch = tinylm.collate_fn([train_set[i] for i in shuffle(26, 0)[:24]], None, True)
    inputs, targets = batch["inputs"], batch["targets"]
    want, loss = sgd_step(
        model, lambda m: F.cross_entropy(m(inputs).flatten(0, 1), targets.flatten())
    )
    update = lambda weights: {k: v.double() - w0[k] for k, v in weights.items()}  # noqa: E731
    g = gap(update(r.weights), update(want))
    # The test compares the updates themselves, because float32 through a transformer is compared
    # against float64.
    assert g < 1e-3, g
    epoch = r.records("epoch")[0]
    assert epoch["train_loss"] == pytest.approx(loss, rel=1e-5)
    assert epoch["train_tokens"] == int((targets != -100).sum())
    # The negative control takes the mean of the sequences' own means. In it, the tokens of a short
    # function weigh more.
    model.load_state_dict(w0)

    def per_sequence(m):
        losses = F.cross_entropy(m(inputs).transpose(1, 2), targets, reduction="none")
        return (losses.sum(1) / (targets != -100).sum(1)).mean()

    other, _ = sgd_step(model, per_sequence)
    assert gap(update(other), update(want)) > 10 * g


def test_evaluation_counts_each_sample_once_on_a_size_the_world_does_not_divide(reference):
    # The 301 eval samples split over 2 ranks as 151 and 150. The script never pads them to 302, as
    # DistributedSampler does.
    r = reference(torchrun_cmd(2, *SMALL[:-3], 16, "--log-every", 0))
    model = build_model(args_of()).double()
    model.load_state_dict(r.weights)
    x, y = build_datasets(args_of(*SMALL))[1].tensors
    with torch.no_grad():
        losses = F.cross_entropy(model(x.double()), y, reduction="none")
        right = (model(x.double()).argmax(1) == y).double()
    last = r.records("epoch")[-1]
    assert last["eval_samples"] == 301 and last["eval_loss"] == pytest.approx(
        losses.mean().item(), rel=1e-6
    )
    assert last["eval_accuracy"] == pytest.approx(right.mean().item(), rel=1e-9)
    padded = torch.cat([losses, losses[:1]]).mean().item()  # This is the negative control.
    assert last["eval_loss"] != pytest.approx(padded, rel=1e-5)


def macro_f1(logits, labels):
    """Return the mean over the classes of each class's F1, from the confusion matrix."""
    confusion = torch.zeros(10, 10, dtype=torch.float64)
    confusion.index_put_(
        (labels, logits.argmax(1)), torch.ones(len(labels)).double(), accumulate=True
    )
    tp = confusion.diag()
    f1 = 2 * tp / (confusion.sum(0) + confusion.sum(1))
    return f1.nan_to_num().mean().item()


def auc_of_class_0(logits, labels):
    """Return the share of (positive, negative) pairs where the positive scores higher. A tie
    counts half."""
    scores = logits[:, 0].double()
    positive = labels == 0
    higher = scores[positive][:, None] > scores[~positive][None, :]
    tied = scores[positive][:, None] == scores[~positive][None, :]
    return (higher.double() + 0.5 * tied.double()).mean().item()


@long
@pytest.mark.parametrize("task", ["digits", "auc"])
def test_a_metric_of_the_whole_eval_set_equals_its_recomputation_from_model_pt(
    project, tmp_path, task
):
    # digits logs a macro-F1 through eval_metrics, and the auc.py of docs/recipes.md gathers every
    # prediction there. Each logged figure equals its recomputation over the whole eval set from
    # model.pt, in float64, at 1 and at 2 processes.
    if task == "digits":
        module, name, recompute = example("digits"), "eval_macro_f1", macro_f1
        args = ["--epochs", 1, "--log-every", 0]
    else:
        module, name, recompute = ddp_train, "eval_auc", auc_of_class_0
        args = [*SMALL[:-4], "--log-every", 0]
    for launch, batch in ("python", 16), ("torchrun 2", 8):
        cmd = user_cmd(project, launch, *args, "--batch-size", batch)
        r = run(cmd, tmp_path, launch.replace(" ", ""), env=clean_env(BASE=task))
        flags = args_of(*args)
        ddp_train.seed_everything(flags.seed)  # The script seeds before build_datasets.
        eval_set = module.build_datasets(flags)[1]
        model = module.build_model(flags).double().eval()
        model.load_state_dict(r.weights)
        inputs, labels = (
            torch.stack(part) for part in zip(*(eval_set[i] for i in range(len(eval_set))))
        )
        with torch.no_grad():
            logits = model(inputs.double())
        logged = r.records("epoch")[-1][name]
        assert logged == pytest.approx(recompute(logits, labels), rel=1e-9), (launch, logged)


@long
def test_eval_only_evaluates_the_checkpoint_the_same_on_any_world_size(
    project, tmp_path, reference
):
    # The finished run's checkpoint holds model.pt's weights. So --eval-only on 1 and 2 processes
    # gives the figures of its last epoch record. Each of the 301 samples counts once, whatever the
    # world size.
    done = reference(user_cmd(project, "torchrun 2", *SMALL[:-3], 16, "--log-every", 0))
    want = {k: v for k, v in done.records("epoch")[-1].items() if k.startswith("eval_")}
    for launch in ("python", "torchrun 2"):
        out = tmp_path / launch.replace(" ", "")
        shutil.copytree(done.out_dir, out)
        env = clean_env(VARIANT="report", RECORD=tmp_path / launch.replace(" ", ""))
        args = [*SMALL[:-3], 16, "--eval-only", "--out-dir", out]
        with Launch(user_cmd(project, launch, *args), tmp_path, launch, env=env) as evaluation:
            assert evaluation.wait() == 0, evaluation.stderr
        (got,) = [eval(line) for line in Path(f"{env['RECORD']}.0").read_text().splitlines()]
        assert got["kind"] == "eval" and got["step"] == 62 and got.keys() >= want.keys(), got
        # The batches differ, so the figures differ by rounding.
        assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-6)
        assert (out / "metrics.jsonl").read_text() == (done.out_dir / "metrics.jsonl").read_text()


@long
def test_training_metrics_are_exact_means_and_report_gets_the_model_after_the_steps_save(
    project, tmp_path
):
    # In training, compute_loss returns {"twice": 2 x loss}, so train_twice is 2 x train_loss, mean
    # for mean. report(record, args, model) gets the raw module at the record's step. Where the step
    # saves, report() gets it after that step's checkpoint. The weights that it is given are the
    # ones that --eval-every evaluated.
    args = [*RESUME, "--eval-every", 7, "--save-every", 14]
    env = clean_env(VARIANT="trainmetric,report,weights", RECORD=tmp_path / "report")
    r = run(user_cmd(project, "torchrun 2", *args), tmp_path, env=env)
    for record in r.records("progress") + r.records("epoch"):
        assert record["train_twice"] == pytest.approx(2 * record["train_loss"], rel=1e-12), record
    lines = (tmp_path / "report.saved").read_text().splitlines()
    # Each line maps a record's step to the checkpoint's step at that time.
    saved = dict(line.split() for line in lines)
    assert all(saved[s] == s for s in saved if int(s) % 14 == 0 or int(s) % 64 == 0), saved
    x, y = build_datasets(args_of("--num-samples", 2048, "--eval-samples", 100))[1].tensors
    for record in r.records("eval")[:2]:
        model = build_model(args_of()).double()
        model.load_state_dict(torch.load(tmp_path / f"report.eval.{record['step']}.pt"))
        with torch.no_grad():
            loss = F.cross_entropy(model(x.double()), y).item()
        assert record["eval_loss"] == pytest.approx(loss, rel=1e-6), record
    last = torch.load(tmp_path / "report.epoch.128.pt")
    assert_same_weights(last, r.weights, exact=True)


def test_a_frozen_batchnorm_stays_in_eval_mode_through_evaluations(project, tmp_path):
    # build_model puts the first BatchNorm of digits in eval mode, as when fine-tuning. The
    # evaluations every 5 steps leave it in eval mode, and its statistics never move.
    env = clean_env(BASE="digits", VARIANT="frozen")
    r = run(
        user_cmd(project, "python", *DIGITS, "--epochs", 1, "--eval-every", 5), tmp_path, env=env
    )
    assert r.records("eval"), r
    w = r.weights
    assert (
        torch.equal(w["1.running_mean"], torch.zeros(16)) and int(w["1.num_batches_tracked"]) == 0
    )
    assert int(w["4.num_batches_tracked"]) > 0  # The other BatchNorm trained.


def test_namedtuple_batches_train_the_same_run(project, tmp_path, reference):
    r = run(user_cmd(project, "python", *SMALL), tmp_path, env=clean_env(VARIANT="namedtuple"))
    assert_same_weights(
        r.weights, reference(user_cmd(project, "python", *SMALL)).weights, exact=True
    )


# ---------------------------------------------------------------------------
# Only rank 0 logs. It logs every --log-every steps, and it logs the exact global mean since the
# last line.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["samples", pytest.param("tokens", marks=long)])
def test_log_every_gives_rank_0_alone_the_exact_mean_since_the_last_line(project, tmp_path, task):
    # With lr 0 the weights stay w0. So the test computes each line's loss by hand, as the mean at
    # w0 over the items of its steps.
    args = ["--epochs", 1, "--batch-size", 4, "--lr", 0, "--log-every", 3, "--eval-samples", 0]
    env = dict(VARIANT="report", RECORD=tmp_path / "report")
    if task == "tokens":
        env |= {**LM, "LM_DROPOUT": 0.0}
    else:
        args += ["--num-samples", 100]
    r = run(user_cmd(project, "torchrun 2", *args), tmp_path, env=clean_env(**env))
    reported = [eval(line) for line in (tmp_path / "report.0").read_text().splitlines()]
    # report() gets every record, and then the end of the run.
    assert reported == [*r.metrics, {"kind": "end", "step": r.metrics[-1]["step"]}]
    assert not (tmp_path / "report.1").exists()
    assert (
        r.stdout.count("progress") == len(r.records("progress")) == (2 if task == "tokens" else 4)
    )
    if task == "tokens":
        tinylm = example("tinylm")
        tinylm.TRAIN_SIZE, tinylm.EVAL_SIZE, tinylm.DROPOUT = 64, 8, 0.0
        torch.manual_seed(0)
        model, (data, _) = tinylm.build_model(None).double(), tinylm.build_datasets(None)

        def mean_loss(indices):
            batch = tinylm.collate_fn([data[i] for i in indices], None, True)
            targets = batch["targets"].flatten()
            return F.cross_entropy(model(batch["inputs"]).flatten(0, 1), targets), (
                targets != -100
            ).sum()
    else:
        torch.manual_seed(0)
        model, (data, _) = (
            build_model(args_of()).double(),
            build_datasets(args_of("--num-samples", 100)),
        )

        def mean_loss(indices):
            x, y = data.tensors
            return F.cross_entropy(model(x[indices].double()), y[indices]), len(indices)

    order = shuffle(len(data), 0)
    with torch.no_grad():
        for record in r.records("progress"):
            loss, count = mean_loss(order[(record["step"] - 3) * 8 : record["step"] * 8])
            assert record["train_loss"] == pytest.approx(loss.item(), rel=1e-6), record
            assert record[f"{task}_per_s"] > 0 and record["lr"] == 0


# ---------------------------------------------------------------------------
# These tests cover preemption and crashes. Every rank stops at one step and saves, and the rerun
# resumes bit for bit.
# ---------------------------------------------------------------------------


def stopped_and_resumed(cmd, tmp_path, stop, expect, **env):
    """Run the command, which user.py's STOP_* settings stop, and then run the same command again.
    Return both Results."""
    first = run(cmd, tmp_path, expect=expect, env=clean_env(**stop, **env))
    m = re.search(r"stopped by a signal at step (\d+)", first.stdout)
    assert m and (tmp_path / "out" / "checkpoint.pt").exists(), first
    again = run(cmd, tmp_path, env=clean_env(**env))
    assert f"resumed from {tmp_path}/out/checkpoint.pt at step {m.group(1)}," in again.stdout, again
    return first, again


@pytest.mark.parametrize("launch", [pytest.param("torchrun 2", marks=[tier, long]), "spawn 2"])
def test_sigterm_to_the_launcher_stops_every_rank_and_the_rerun_ends_bit_identical(
    project, tmp_path, reference, launch
):
    # The test sends SIGTERM only to torchrun or to --spawn's process, as a scheduler stops a job.
    # That process passes the signal on. --spawn returns the workers' 75, and torchrun returns 1,
    # or it aborts at its own exit, as launcher_aborted() says.
    stop = dict(STOP_AT=40, STOP_SIGNAL="SIGTERM", STOP_TARGET="parent")
    first, again = stopped_and_resumed(user_cmd(project, launch, *RESUME), tmp_path, stop, None)
    if launch == "spawn 2":
        assert first.returncode == 75 and "exit 75" in first.stdout, first
    else:
        assert first.returncode == 1 or launcher_aborted(first), first
        assert "exit 75" in first.stdout, first
    whole = reference(user_cmd(project, "torchrun 2", *RESUME))
    assert_same_weights(again.weights, whole.weights, exact=True)
    # Every record appears once, as the uninterrupted run wrote it, except for the timings.
    assert steady(again.metrics) == steady(whole.metrics)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1", "SIGHUP"])
@long
def test_a_signal_to_one_rank_stops_every_rank_at_one_step_and_the_rerun_ends_bit_identical(
    project, tmp_path, reference, sig
):
    stop = dict(STOP_AT=40, STOP_SIGNAL=sig, STOP_RANK=1)
    first, again = stopped_and_resumed(
        user_cmd(project, "torchrun 2", *RESUME), tmp_path, stop, None
    )
    # Rank 1 took the signal. Rank 0 never got one, but it stopped at the same step, and it says so.
    assert "exit 75" in first.stdout, first
    whole = reference(user_cmd(project, "torchrun 2", *RESUME))
    assert_same_weights(again.weights, whole.weights, exact=True)


@long
def test_a_worker_that_fails_under_spawn_ends_the_run_with_its_exit_code(tmp_path):
    # Rank 1 exits 3 before it joins the process group. Rank 0 would wait for it for --timeout, an
    # hour, and run() gives the launch far less. --spawn kills rank 0 and returns the 3.
    script = tmp_path / "fails_on_rank_1.py"
    script.write_text(
        f"import os, sys\nsys.path.insert(0, {str(ROOT)!r})\nimport ddp_train\n"
        "if os.environ.get('RANK') == '1':\n    sys.exit(3)\nsys.exit(ddp_train.main())\n"
    )
    run([PY, script, "--spawn", 2, "--timeout", 3600], tmp_path, expect=3)


@long
def test_a_worker_killed_under_max_restarts_is_restarted_and_the_run_ends_bit_identical(
    project, tmp_path, reference
):
    # The run writes a progress record at every step. It writes the records of steps 71 to 75 before
    # the kill. The resume from step 70 drops them and writes them again. So every record appears
    # once, as the uninterrupted run wrote it. Rank 0 of the new round starts 5 s late, so rank 1
    # reaches torchrun's store first, where the old round's keys are still there.
    args = [*RESUME, "--log-every", 1]
    cmd = torchrun_cmd(2, *args, script=str(project / "user.py"), launcher=["--max-restarts=1"])
    env = clean_env(STOP_AT=75, STOP_SIGNAL="SIGKILL", STOP_RANK=1, VARIANT="lateleader")
    r = run(cmd, tmp_path, env=env)
    assert f"resumed from {tmp_path}/out/checkpoint.pt at step 70," in r.stdout, r
    whole = reference(user_cmd(project, "torchrun 2", *args))
    assert_same_weights(r.weights, whole.weights, exact=True)
    assert steady(r.metrics) == steady(whole.metrics)


@pytest.mark.parametrize(
    "launch",
    ["python", pytest.param("torchrun 2", marks=long), pytest.param("spawn 2", marks=long)],
)
def test_ctrl_c_stops_every_rank_after_one_step_and_the_rerun_ends_bit_identical(
    project, tmp_path, reference, launch
):
    # The test sends Ctrl-C as a terminal sends it. SIGINT goes to the whole process group, which is
    # the launcher and its workers.
    cmd = user_cmd(project, launch, *RESUME)
    with Launch([*cmd, "--out-dir", tmp_path / "out"], tmp_path, "first") as first:
        first.wait_for(lambda: (tmp_path / "out/checkpoint.pt").exists(), "a checkpoint")
        os.killpg(first.proc.pid, signal.SIGINT)
        code = first.wait()
    assert "stopped by a signal at step" in first.stdout and "exit 75" in first.stdout, first.stdout
    assert "KeyboardInterrupt" not in first.stderr, first.stderr
    # The exit code is the script's own, except under torchrun, which returns 1 and writes its
    # traceback.
    assert code == (1 if launch.startswith("torchrun") else 75), first.stderr
    assert launch.startswith("torchrun") or "Traceback" not in first.stderr, first.stderr
    again = run(cmd, tmp_path)
    assert "resumed from" in again.stdout, again
    whole = reference(user_cmd(project, "torchrun 2" if "2" in launch else "python", *RESUME))
    assert_same_weights(again.weights, whole.weights, exact=True)


@long
def test_a_stop_saves_before_it_evaluates_and_the_rerun_writes_the_evaluation_first(
    project, tmp_path, reference
):
    # With --eval-every 1 every step evaluates, so the stop's step does too. After the ranks agree
    # to stop, the stopped run writes the step's progress record, saves and exits without
    # evaluating. So the grace period after a SIGTERM goes to the save. The rerun evaluates that
    # step first, and it writes every record once, as the uninterrupted run wrote it.
    args = [*RESUME, "--eval-every", 1, "--log-every", 1, "--max-steps", 50]
    cmd = user_cmd(project, "torchrun 2", *args)
    stop = dict(STOP_AT=40, STOP_SIGNAL="SIGTERM", STOP_RANK=1)
    env = dict(VARIANT="evalafterstop", RECORD=tmp_path / "record")
    whole = reference(cmd)
    first = run(cmd, tmp_path, expect=None, env=clean_env(**stop, **env))
    stopped_at = int(re.search(r"stopped by a signal at step (\d+)", first.stdout).group(1))
    assert not (tmp_path / "record.evaluated-after-the-stop").exists(), first
    last_records = [(m["kind"], m["step"]) for m in first.metrics[-2:]]
    assert last_records == [("eval", stopped_at - 1), ("progress", stopped_at)], last_records
    again = run(cmd, tmp_path, env=clean_env(**env))
    assert f"resumed from {tmp_path}/out/checkpoint.pt at step {stopped_at}," in again.stdout
    assert steady(again.metrics) == steady(whole.metrics)
    assert_same_weights(again.weights, whole.weights, exact=True)
    # A stop that the ranks agree on at the last step ends a run that is done. The run writes the
    # step's records and model.pt, and it exits 0.
    last_stop = dict(STOP_AT=49, STOP_SIGNAL="SIGTERM", STOP_RANK=1)
    last = run(cmd, tmp_path, "last", env=clean_env(**last_stop))
    assert "saved" in last.stdout and steady(last.metrics) == steady(whole.metrics), last


@long
def test_a_sigkill_10_s_after_a_sigterm_in_an_evaluation_loses_no_step(
    project, tmp_path, reference
):
    # The run saves every 20 steps and evaluates at step 25. Each eval batch after step 25 takes 4 s,
    # so that evaluation outlasts a scheduler's grace period of 10 s. A SIGTERM to torchrun lands in
    # it, and every process gets a SIGKILL 10 s later. The run saved step 25 before it evaluated,
    # so no step that it trained before the SIGTERM is lost. The rerun runs that evaluation first,
    # and it ends as the uninterrupted run.
    cmd = user_cmd(project, "torchrun 2", *RESUME, "--save-every", 20, "--eval-every", 25)
    env = clean_env(VARIANT="sloweval", SLOW_EVAL_AFTER=25, RECORD=tmp_path / "record")
    with Launch([*cmd, "--out-dir", tmp_path / "out"], tmp_path, "first", env=env) as first:
        first.wait_for(lambda: (tmp_path / "record.evaluating").exists(), "the evaluation")
        os.kill(first.proc.pid, signal.SIGTERM)
        time.sleep(10)
    # The end of the block kills every process of the launch, as the scheduler's SIGKILL does.
    saved = torch.load(tmp_path / "out/checkpoint.pt", weights_only=True)["progress"]["step"]
    assert saved == 25, first.stdout
    again = run(cmd, tmp_path)
    assert f"resumed from {tmp_path}/out/checkpoint.pt at step 25," in again.stdout, again
    whole = reference(cmd)
    assert steady(again.metrics) == steady(whole.metrics)
    assert_same_weights(again.weights, whole.weights, exact=True)


@long
def test_an_ema_resumes_bit_for_bit_and_is_evaluated_and_saved(project, tmp_path, reference):
    # The ema.py of docs/recipes.md keeps an EMA through build_averaged_models. torchrun gets a
    # SIGTERM in step 40, and the rerun ends with the weights, the ema.pt and the records of the
    # uninterrupted run. The logged eval_ema_loss is the loss of ema.pt over the eval set, computed in float64.
    cmd = user_cmd(project, "torchrun 2", *RESUME)
    stop = dict(STOP_AT=40, STOP_SIGNAL="SIGTERM", STOP_TARGET="parent")
    _, again = stopped_and_resumed(cmd, tmp_path, stop, None, BASE="ema")
    whole = reference(cmd, BASE="ema")
    assert_same_weights(again.weights, whole.weights, exact=True)
    ema = torch.load(again.out_dir / "ema.pt", weights_only=True)
    assert_same_weights(ema, torch.load(whole.out_dir / "ema.pt", weights_only=True), exact=True)
    assert steady(again.metrics) == steady(whole.metrics)
    model = build_model(args_of()).double()
    model.load_state_dict(ema)
    x, y = build_datasets(args_of(*RESUME))[1].tensors
    with torch.no_grad():
        loss = F.cross_entropy(model(x.double()), y).item()
    last = whole.records("epoch")[-1]
    assert last["eval_ema_loss"] == pytest.approx(loss, rel=1e-6), last
    assert last["eval_loss"] != pytest.approx(loss, rel=1e-3), last  # The EMA is not the model.
    # --eval-only evaluates the checkpoint's EMA too, and report() gets its figures.
    env = clean_env(BASE="ema", VARIANT="report", RECORD=tmp_path / "eval-only")
    args = [*RESUME, "--eval-only", "--out-dir", again.out_dir]
    with Launch(user_cmd(project, "python", *args), tmp_path, "eval-only", env=env) as evaluation:
        assert evaluation.wait() == 0, evaluation.stderr
    (got,) = [eval(line) for line in Path(f"{env['RECORD']}.0").read_text().splitlines()]
    assert got["eval_ema_loss"] == pytest.approx(loss, rel=1e-6), got


def plateau_rates(records, lr, factor=0.5, threshold=0.3):
    """Return {step: the rate of the step} as a ReduceLROnPlateau with patience 0 sets it after
    each evaluation in the records, and the steps of the evaluations that lowered it."""
    best = math.inf
    rates = {}
    lowered = []
    for record in records:
        if record["kind"] == "progress":
            rates[record["step"]] = lr
        if "eval_loss" in record:
            if record["eval_loss"] < best * (1 - threshold):
                best = record["eval_loss"]
            else:
                lr *= factor
                lowered.append((record["kind"], record["step"]))
    return rates, lowered


@long
def test_a_plateau_schedule_steps_after_each_evaluation_and_resumes_after_a_crash_in_one(
    project, tmp_path, reference
):
    # build_scheduler returns a ReduceLROnPlateau that halves the rate after an eval loss that is
    # not 30% below the best. Every logged rate is the one that the eval losses give. Then rank 0
    # dies in report() after an eval record that lowered the rate. The checkpoint of that step was
    # saved before the evaluation, so it predates the plateau's step. The rerun steps the plateau
    # with the loss that the record holds, and it ends as the uninterrupted run.
    args = [*RESUME, "--eval-every", 25, "--log-every", 1]
    cmd = user_cmd(project, "torchrun 2", *args)
    whole = reference(cmd, VARIANT="plateau")
    rates, lowered = plateau_rates(whole.metrics, lr=1e-3)
    assert {r["step"]: r["lr"] for r in whole.records("progress")} == rates
    crash_step = next(step for kind, step in lowered if kind == "eval")
    env = dict(VARIANT="plateau,report,killreport", FAIL_STEP=crash_step, FAIL_KINDS="eval")
    env = clean_env(RECORD=tmp_path / "report", **env)
    crashed = run(cmd, tmp_path, expect=None, env=env)
    assert crashed.returncode != 0 and crashed.metrics[-1]["kind"] == "eval", crashed
    again = run(cmd, tmp_path, env=env)
    assert f"resumed from {tmp_path}/out/checkpoint.pt at step {crash_step}," in again.stdout
    assert steady(again.metrics) == steady(whole.metrics)
    assert_same_weights(again.weights, whole.weights, exact=True)
    # The last call of report() comes after model.pt, with the record of kind end.
    last_report = (tmp_path / "report.0").read_text().splitlines()[-1]
    assert eval(last_report) == {"kind": "end", "step": 128}, last_report


@long
def test_after_a_resume_the_throughput_counts_the_reruns_steps_and_epoch_s_the_whole_epoch(
    project, tmp_path
):
    # Each micro-batch takes at least 0.2 s, and the run logs at step 10. The first run stops in the
    # middle of that window. The rerun trains the steps after the stop at 0.2 s or more each, so its
    # record of step 10 can give at most 32 / 0.2 = 160 samples a second. A count that took in the
    # steps before the stop, with the seconds since the restart, gives more than twice as many.
    args = ["--num-samples", 1000, "--eval-samples", 0, "--batch-size", 32, "--max-steps", 10]
    cmd = user_cmd(project, "python", *args, "--log-every", 10)
    stop = dict(STOP_AT=5, STOP_SIGNAL="SIGTERM")
    _, again = stopped_and_resumed(cmd, tmp_path, stop, 75, VARIANT="slowtrain")
    (record,) = again.records("progress")
    assert record["step"] == 10 and 0 < record["samples_per_s"] <= 32 / 0.2, record
    # The epoch record of step 10 counts the seconds of all 10 steps, before and after the stop.
    # Those are at least 10 x 0.2 s. A count from the restart alone would hold only the last 5.
    (epoch,) = again.records("epoch")
    assert epoch["step"] == 10 and epoch["epoch_s"] >= 10 * 0.2, epoch


@long
def test_a_crash_between_a_checkpoint_and_its_records_loses_no_record(project, tmp_path, reference):
    # Step 20 saves, and then it logs a progress record and an eval record. Rank 0 dies in report()
    # after the progress record. The rerun resumes from step 20 and writes its eval record first.
    # The crash also cut the file just after the progress record, before its newline.
    args = [*RESUME, "--eval-every", 20]
    cmd = user_cmd(project, "torchrun 2", *args)
    env = clean_env(VARIANT="report,killreport", FAIL_STEP=20, RECORD=tmp_path / "report")
    crashed = run(cmd, tmp_path, expect=None, env=env)
    written = [(m["kind"], m["step"]) for m in crashed.metrics]
    assert crashed.returncode != 0 and written == [("progress", 20)], crashed
    metrics_file = tmp_path / "out/metrics.jsonl"
    metrics_file.write_text(metrics_file.read_text().removesuffix("\n"))
    r = run(cmd, tmp_path, env=env)
    assert f"resumed from {tmp_path}/out/checkpoint.pt at step 20," in r.stdout, r
    whole = reference(cmd)
    assert steady(r.metrics) == steady(whole.metrics)
    assert_same_weights(r.weights, whole.weights, exact=True)


def test_a_closed_standard_output_does_not_stop_the_run(tmp_path, reference):
    # `| head -n 1` closes the pipe after the first line. The run goes on and saves everything.
    cmd = shlex.join(map(str, python_cmd(*SMALL, "--out-dir", tmp_path / "out")))
    shell = f"set -o pipefail; {cmd} | head -n 1"
    with Launch(["bash", "-c", shell], tmp_path, "piped") as piped:
        assert piped.wait() == 0, piped.stderr
    assert (
        piped.stdout.startswith("ddp_train.py: world size 1,")
        and len(piped.stdout.splitlines()) == 1
    )
    assert "Error" not in piped.stderr, piped.stderr
    one = reference(python_cmd(*SMALL))
    assert_same_weights(torch.load(tmp_path / "out/model.pt"), one.weights, exact=True)
    assert steady(Result(0, "", "", tmp_path / "out").metrics) == steady(one.metrics)


@long
def test_a_resume_names_every_flag_unlike_its_checkpoints_run(tmp_path, reference):
    shutil.copytree(reference(python_cmd(*SMALL)).out_dir, tmp_path / "out")
    r = run(python_cmd(*SMALL, "--epochs", 3, "--lr", 0.01), tmp_path)
    says = "flags unlike the checkpoint's run: --epochs 3 (it had 2), --lr 0.01 (it had 0.001). Its"
    assert says in r.stdout, r
    assert [m["step"] for m in r.records("epoch")] == [31, 62, 93]
    # A raised --max-steps resumes in the middle of an epoch. The record of step 50 covers the
    # steps 32 to 50 of its epoch, its loss as well as its samples. Each progress record holds the
    # loss of one step, and each step has 32 samples.
    run(python_cmd(*SMALL, "--max-steps", 40, "--log-every", 1), tmp_path, "steps")
    r = run(python_cmd(*SMALL, "--max-steps", 50, "--log-every", 1), tmp_path, "steps")
    assert "--max-steps 50 (it had 40)" in r.stdout, r
    assert [m["step"] for m in r.records("epoch")] == [31, 40, 50]
    losses = [m["train_loss"] for m in r.records("progress") if m["step"] >= 32]
    epoch = r.records("epoch")[-1]
    assert len(losses) == 19 and epoch["train_samples"] == 19 * 32, epoch
    assert epoch["train_loss"] == pytest.approx(sum(losses) / 19, rel=1e-9), epoch


@pytest.mark.parametrize("workers", [0, 2])
@long
def test_a_dataset_with_random_augmentation_resumes_with_the_same_samples_in_the_same_order(
    project, tmp_path, reference, workers
):
    # digits augments with torch, random and numpy. With --workers 0 the training process loads the
    # data, and its draws come from the rank's own generators, which the checkpoint holds. So the
    # rerun ends bit-identical. In DataLoader workers the draws come from the workers' generators,
    # which start afresh. Then the rerun gets the same samples in the same order.
    cmd = user_cmd(project, "torchrun 2", *DIGITS, "--workers", workers)
    stop = dict(STOP_AT=30, STOP_SIGNAL="SIGTERM", STOP_TARGET="parent")
    env = dict(BASE="digits", VARIANT="indices")
    _, again = stopped_and_resumed(cmd, tmp_path, stop, None, RECORD=tmp_path / "seen", **env)
    whole = run(cmd, tmp_path, "whole", env=clean_env(RECORD=tmp_path / "whole", **env))
    for rank in range(2):
        assert (
            Path(f"{tmp_path}/seen.{rank}").read_text()
            == Path(f"{tmp_path}/whole.{rank}").read_text()
        )
    if workers == 0:
        assert_same_weights(again.weights, whole.weights, exact=True)


@tier
@long
def test_a_language_model_with_dropout_and_workers_resumes_bit_identical(
    project, tmp_path, reference
):
    cmd = user_cmd(
        project, "torchrun 2", "--epochs", 2, "--batch-size", 4, "--workers", 2, "--log-every", 5
    )
    stop = dict(STOP_AT=10, STOP_SIGNAL="SIGTERM", STOP_TARGET="parent")
    _, again = stopped_and_resumed(cmd, tmp_path, stop, None, **LM)
    assert_same_weights(again.weights, reference(cmd, **LM).weights, exact=True)


# These settings shrink stream.py to 100 training windows and 8 eval windows. A step of 2 x 4
# windows reads 8 of them, so a run of 40 steps goes about three times through the stream.
STREAM = dict(BASE="stream", LM_TRAIN=100, LM_EVAL=8)
STREAM_RUN = ["--max-steps", 40, "--batch-size", 4, "--save-every", 10, "--log-every", 5]


@long
def test_a_stream_resumes_bit_identical_after_a_sigterm(project, tmp_path, reference):
    cmd = user_cmd(project, "torchrun 2", *STREAM_RUN, "--eval-every", 20)
    stop = dict(STOP_AT=25, STOP_SIGNAL="SIGTERM", STOP_TARGET="parent")
    _, again = stopped_and_resumed(cmd, tmp_path, stop, None, **STREAM)
    whole = reference(cmd, **STREAM)
    assert_same_weights(again.weights, whole.weights, exact=True)
    assert steady(again.metrics) == steady(whole.metrics)


@long
def test_a_stream_on_2_processes_x_4_trains_the_weights_of_1_process_x_8(project, tmp_path):
    # Rank r of 2 reads the windows r, r + 2, r + 4 and so on. So in each step both runs read the
    # same 8 windows, also after the stream starts again at step 13. Dropout is off, and SGD moves
    # each weight by its gradient.
    env = clean_env(**STREAM, LM_DROPOUT=0, VARIANT="sgd")
    steps = ["--max-steps", 15, "--lr", 0.5, "--log-every", 0, "--eval-every", 0]
    two = run(user_cmd(project, "torchrun 2", *steps, "--batch-size", 4), tmp_path, "two", env=env)
    one = run(user_cmd(project, "python", *steps, "--batch-size", 8), tmp_path, "one", env=env)
    assert_same_weights(two.weights, one.weights)
    # The tolerance tells apart a learning rate that is 1% off.
    other = run(
        user_cmd(project, "python", *steps, "--batch-size", 8, "--lr", 0.495),
        tmp_path,
        "other",
        env=env,
    )
    with pytest.raises(AssertionError):
        assert_same_weights(two.weights, other.weights)


def test_ranks_whose_streams_end_at_different_steps_stop_together_with_one_line(project, tmp_path):
    # The stream has 31 windows and makes one pass. Rank 0 reads 16 of them and rank 1 reads 15. So
    # with 4 windows a batch, rank 1 has no batch for step 4, and rank 0 has one.
    cmd = user_cmd(project, "torchrun 2", *STREAM_RUN, "--log-every", 1)
    env = clean_env(**{**STREAM, "LM_TRAIN": 31, "LM_PASSES": 1})
    r = run(cmd, tmp_path, expect=None, env=env)
    assert r.returncode != 0 and r.seconds < PEER_TIMEOUT, r
    says = "ended before step 4 of 40: pass --max-steps 3, or let the stream repeat"
    assert says in r.stderr and len(re.findall("user.py: error:", r.stderr)) == 1, r
    assert "progress  step 3/40" in r.stdout and "step 4/40" not in r.stdout, r


@long
def test_a_stream_state_that_no_checkpoint_can_hold_stops_every_rank_at_its_first_save(
    project, tmp_path
):
    # numpy's float64 saves, and it even passes for a float in JSON. But a weights_only torch.load
    # refuses it, so the checkpoint would be lost.
    cmd = user_cmd(project, "torchrun 2", *STREAM_RUN)
    r = run(cmd, tmp_path, expect=None, env=clean_env(**STREAM, VARIANT="numpystate"))
    assert r.returncode != 0 and r.seconds < PEER_TIMEOUT, r
    says = "the stream's state_dict() holds values other than ints, floats, strings, bools, None"
    assert says in r.stderr and len(re.findall("user.py: error:", r.stderr)) == 1, r
    assert not list((tmp_path / "out").glob("checkpoint*")), r


@long
def test_a_users_onecyclelr_gets_every_step_and_resumes_bit_identical(project, tmp_path, reference):
    cmd = user_cmd(project, "python", *RESUME[:-1], 32, "--log-every", 1)
    stop = dict(STOP_AT=50, STOP_SIGNAL="SIGTERM")
    _, again = stopped_and_resumed(cmd, tmp_path, stop, 75, VARIANT="onecycle")
    whole = reference(cmd, VARIANT="onecycle")
    assert_same_weights(again.weights, whole.weights, exact=True)
    # Each step's lr is OneCycleLR's own. The scheduler steps once per optimizer step, across the
    # stop too.
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    sched, lrs = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=128), []
    for _ in range(128):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [m["lr"] for m in again.records("progress")] == pytest.approx(lrs, rel=1e-12)


@long
def test_a_truncated_checkpoint_falls_back_to_the_one_before_or_stops_with_one_line(
    project, tmp_path, reference
):
    cmd = user_cmd(project, "python", *RESUME[:-1], 32)
    # The signal comes in step 44, after that step's stop vote, so the run stops after step 45.
    run(cmd, tmp_path, expect=75, env=clean_env(STOP_AT=44, STOP_SIGNAL="SIGTERM"))
    out = tmp_path / "out"
    shutil.copytree(out, tmp_path / "spare")
    # A crash in the middle of a write leaves a torn checkpoint.pt. The file checkpoint.prev.pt of
    # step 40 is whole.
    (out / "checkpoint.pt").write_bytes((out / "checkpoint.pt").read_bytes()[:1000])
    r = run(cmd, tmp_path)
    assert "checkpoint.pt is unreadable" in r.stdout and "resuming from" in r.stdout, r
    assert f"resumed from {out}/checkpoint.prev.pt at step 40," in r.stdout, r
    assert_same_weights(r.weights, reference(cmd).weights, exact=True)
    # A crash between the two renames leaves checkpoint.pt moved to .prev and the new one still
    # .tmp.
    shutil.rmtree(out)
    shutil.copytree(tmp_path / "spare", out)
    (out / "checkpoint.pt").rename(out / "checkpoint.pt.tmp")
    r = run(cmd, tmp_path)
    assert f"resumed from {out}/checkpoint.pt.tmp at step 45," in r.stdout, r
    assert_same_weights(r.weights, reference(cmd).weights, exact=True)
    # The same crash again, and then a kill while the resumed run writes its first checkpoint. The
    # newest checkpoint, of step 45, took its place as checkpoint.pt before that save began.
    shutil.rmtree(out)
    shutil.copytree(tmp_path / "spare", out)
    (out / "checkpoint.pt").rename(out / "checkpoint.pt.tmp")
    killed = run(cmd, tmp_path, expect=-signal.SIGKILL, env=clean_env(VARIANT="killsave"))
    assert f"resumed from {out}/checkpoint.pt.tmp at step 45," in killed.stdout, killed
    r = run(cmd, tmp_path)
    assert f"resumed from {out}/checkpoint.pt at step 45," in r.stdout, r
    assert_same_weights(r.weights, reference(cmd).weights, exact=True)
    # When neither file is readable, the script writes one line and leaves both files as they were.
    shutil.rmtree(out)
    shutil.copytree(tmp_path / "spare", out)
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        (out / name).write_bytes(b"not a checkpoint")
    r = run(cmd, tmp_path, expect=2)
    assert "is unreadable" in last_line(r.stderr) and "Traceback" not in r.stderr, r
    assert (
        (out / "checkpoint.pt").read_bytes()
        == (out / "checkpoint.prev.pt").read_bytes()
        == b"not a checkpoint"
    )
    # Here the first save was cut short. A torn checkpoint.pt.tmp alone was never published. Every
    # restart starts afresh with one line, and it trains the run.
    shutil.rmtree(out)
    out.mkdir()
    # The torn file has no zip directory at its end.
    torn = (tmp_path / "spare/checkpoint.pt").read_bytes()[:-100]
    (out / "checkpoint.pt.tmp").write_bytes(torn)
    r = run(cmd, tmp_path)
    assert "checkpoint.pt.tmp was cut short while it was written" in r.stdout, r
    assert "resumed" not in r.stdout and "Traceback" not in r.stderr, r
    assert_same_weights(r.weights, reference(cmd).weights, exact=True)
    # A whole file that does not load is another matter. The script writes one line and leaves the
    # file as it was.
    shutil.rmtree(out)
    out.mkdir()
    with zipfile.ZipFile(out / "checkpoint.pt.tmp", "w") as whole:
        whole.writestr("not-a-checkpoint/data.pkl", b"junk")
    before = (out / "checkpoint.pt.tmp").read_bytes()
    r = run(cmd, tmp_path, expect=2)
    assert "checkpoint.pt.tmp is unreadable" in last_line(r.stderr), r
    assert (out / "checkpoint.pt.tmp").read_bytes() == before


@pytest.mark.parametrize(
    "launch,ending",
    [
        pytest.param("torchrun 2", "done", marks=[tier, long]),
        ("spawn 2", "done"),
        pytest.param("spawn 2", "error", marks=long),
    ],
)
def test_no_thread_of_the_process_group_outlives_main(project, tmp_path, launch, ending):
    # A gloo thread can be alive when Python finalizes and take the GIL to free a tensor. Then it
    # aborts the exit with "terminate called without an active exception". So no such thread may
    # outlive main(). Every thread that the process group started, gloo's and the store's, is joined
    # before main() returns, and also where an error ends the run. There rank 1's loss turns NaN.
    variant = "threads" if ending == "done" else "threads,nan"
    env = clean_env(VARIANT=variant, NAN_AT=5, RECORD=tmp_path / "threads")
    cmd = user_cmd(project, launch, *SMALL[:-3], 16, "--epochs", 1, "--log-every", 1)
    run(cmd, tmp_path, expect=0 if ending == "done" else 1, env=env)
    left = [(tmp_path / f"threads.{rank}").read_text() for rank in range(2)]
    assert left == ["", ""], left


@long
def test_the_ranks_of_a_node_share_the_pages_of_the_checkpoint_they_resume_and_let_go_of_them(
    project, tmp_path, reference
):
    # Each rank maps the checkpoint with torch.load's mmap instead of reading it into memory of its
    # own. So the page cache holds it once for the node, and the mapping is still there at the
    # first step. The resumed run saves at steps 70 and 80. The save at 70 renames the checkpoint
    # that the ranks resumed from, and the save at 80 deletes it. By then no rank maps it, so the
    # deleted file holds no disk space. Micro-batch 25 is step 87.
    cmd = user_cmd(project, "torchrun 2", *SMALL[:-3], 16, "--log-every", 0)
    shutil.copytree(reference(cmd).out_dir, tmp_path / "out")
    env = clean_env(VARIANT="maps", MAPS_AT="1,25", RECORD=tmp_path / "maps")
    r = run([*cmd, "--epochs", 3, "--save-every", 10], tmp_path, env=env)
    assert "resumed from" in r.stdout, r
    for rank in range(2):
        assert f"{tmp_path}/out/checkpoint.pt" in (tmp_path / f"maps.{rank}.1").read_text()
        later = (tmp_path / f"maps.{rank}.25").read_text().splitlines()
        assert not [line for line in later if "checkpoint" in line], later


def test_a_finished_run_rerun_trains_nothing_and_writes_model_pt_from_its_checkpoint(
    tmp_path, reference
):
    # The finished run's model.pt is gone. The rerun trains nothing, and it writes model.pt again
    # from the final checkpoint, with the weights of the whole run. metrics.jsonl stays as it was.
    done = reference(python_cmd(*SMALL))
    shutil.copytree(done.out_dir, tmp_path / "out")
    (tmp_path / "out/model.pt").unlink()
    r = run(python_cmd(*SMALL), tmp_path)
    assert "holds a finished run (62 steps): nothing to train" in r.stdout, r
    assert f"saved {tmp_path}/out/model.pt after 62 steps" in r.stdout, r
    assert_same_weights(r.weights, done.weights, exact=True)
    assert r.metrics == done.metrics


@long
def test_a_rerun_takes_model_pt_from_the_finished_checkpoint_and_not_from_a_shorter_run(
    project, tmp_path, reference
):
    # A run of 20 steps writes model.pt. The same out-dir trains on to 25 steps, and report() fails
    # after the final checkpoint. The rerun finds a finished run of 25 steps, and its model.pt holds
    # the weights of the final checkpoint, and not those of the 20 steps.
    cmd = user_cmd(project, "python", *SMALL)
    env = dict(VARIANT="report", RECORD=tmp_path / "report")
    shorter = run([*cmd, "--max-steps", 20], tmp_path, env=clean_env(**env)).weights
    failed = run([*cmd, "--max-steps", 25], tmp_path, expect=1, env=clean_env(FAIL_STEP=25, **env))
    assert "report() failed" in failed.stderr, failed
    r = run([*cmd, "--max-steps", 25], tmp_path, env=clean_env(**env))
    assert "holds a finished run (25 steps)" in r.stdout, r
    final = torch.load(tmp_path / "out/checkpoint.pt", weights_only=True)
    assert final["progress"]["step"] == 25
    assert_same_weights(r.weights, final["parts"]["model"], exact=True)
    assert not torch.equal(r.weights["0.weight"], shorter["0.weight"])
    assert [(m["kind"], m["step"]) for m in r.metrics] == [("epoch", 20), ("epoch", 25)]


@pytest.mark.parametrize("where", ["loss", "gradient"])
@long
def test_a_non_finite_loss_or_gradient_stops_every_rank_with_one_line_and_writes_nothing(
    project, tmp_path, where
):
    # Rank 1's loss turns NaN in its 25th micro-batch, or only its gradient does while the loss
    # stays finite. The sums before the evaluation of step 25 show it on every rank. The checkpoint
    # of step 20 stays, and no record or model.pt holds a NaN.
    r = run(
        user_cmd(project, "torchrun 2", *RESUME, "--eval-every", 5),
        tmp_path,
        expect=1,
        env=clean_env(VARIANT="nan" if where == "loss" else "nangrad", NAN_AT=25),
    )
    says = "the training loss is nan" if where == "loss" else "the weights are not finite"
    assert f"{says} at step 25" in r.stderr and "the run diverged" in r.stderr, r
    assert len(re.findall("user.py: error:", r.stderr)) == 1, r
    assert torch.load(tmp_path / "out/checkpoint.pt", weights_only=True)["progress"]["step"] == 20
    assert (
        not (tmp_path / "out/model.pt").exists()
        and "NaN" not in (tmp_path / "out/metrics.jsonl").read_text()
    )


# ---------------------------------------------------------------------------
# For bad input, each classic mistake gets one line that names the fix, and a non-zero exit. The
# mistake costs nothing.
# ---------------------------------------------------------------------------

# This is one epoch of 1000 samples on 1 process x 64. It writes a progress line at every step, so
# it also folds at every step.
MISTAKE = ["--num-samples", 1000, "--eval-samples", 0, "--epochs", 1, "--log-every", 1]
MISTAKES = {
    "no full step": (
        ["--num-samples", 10],
        {},
        "do not fill one global batch of 64: lower --batch-size",
    ),
    "bad value": (["--workers", -1], {}, "--workers must be at least 0, not -1"),
    "a negative size of the default task": (
        ["--num-samples", -5],
        {},
        "--num-samples must be at least 0, not -5",
    ),
    "a switch given a value": (["--compile", "False"], {}, "unrecognized arguments: False"),
    "--sync-bn on CPUs": (["--sync-bn"], {}, "--sync-bn needs GPUs"),
    "not a number": (
        ["--lr", "fast"],
        {},
        "argument --lr: invalid float value: 'fast' (see --help)",
    ),
    "unknown flag": (["--epoch", 3], {}, "unrecognized arguments: --epoch 3 (see --help)"),
    "loss not a mean": ([], dict(VARIANT="shape"), "a loss of shape [64]: its mean"),
    "count not samples": (
        [],
        dict(VARIANT="miscount"),
        "count_items counted 128 items in a step of 64 samples, but COUNT_UNIT is samples",
    ),
    "metric named loss": ([], dict(VARIANT="reserved"), "['loss'] are the script's own names"),
    "a stream without a state_dict()": (
        [],
        dict(VARIANT="iterable"),
        "the training stream has no state_dict() and load_state_dict(): add them",
    ),
    "a stream without --max-steps": (
        [],
        dict(VARIANT="iterable,stateful"),
        "the training set is a stream of unknown length: pass --max-steps",
    ),
    "a stream with workers": (
        ["--max-steps", 5, "--workers", 1],
        dict(VARIANT="iterable,stateful"),
        "a stream keeps its place in the workers: pass --workers 0",
    ),
    "a collate_fn of the items alone": (
        [],
        dict(VARIANT="one-argument-collate"),
        "collate_fn takes (items), and the loaders call it with the keywords args and training",
    ),
    "older checkpoint": ([], {}, "is of another ddp_train.py (checkpoint format 1, this one"),
    "eval-only without a checkpoint": (["--eval-only"], {}, "--eval-only: there is no checkpoint"),
    "eval-only of another run, which had no ema": (
        ["--eval-only", "--eval-samples", 64],
        dict(BASE="ema"),
        "was trained without ema: pass the flags of its training",
    ),
    "another model": (
        [],
        dict(VARIANT="wide"),
        "is of another model, optimizer or --amp: Error(s) in loading",
    ),
    "another set of parts, with an ema": (
        [],
        dict(BASE="ema"),
        "'scheduler0'], and this run has ['ema', 'model', 'optimizer0', 'scaler', 'scheduler0']",
    ),
    "another global batch": (
        ["--batch-size", 16],
        {},
        "trained with a global batch of 64, this run's is 16",
    ),
    "no whole accumulation": (["--batch-size", 48], {}, "pass a --batch-size that divides 128"),
    "port in use": (
        [],
        dict(RANK=0, WORLD_SIZE=2),
        "rank 0 could not join the others at 127.0.0.1:",
    ),
    "unreachable master": (
        ["--timeout", 3],
        dict(RANK=1, WORLD_SIZE=2),
        "is MASTER_ADDR node 0's address",
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_classic_mistake_is_one_line_naming_the_fix_and_costs_nothing(
    project, tmp_path, reference, mistake
):
    args, env, says = MISTAKES[mistake]
    out, cmd = tmp_path / "out", user_cmd(project, "python", *MISTAKE)
    if "another" in mistake:  # The out-dir holds a checkpoint of 1 process x 64.
        shutil.copytree(reference(cmd).out_dir, out)
    # Here the out-dir holds a checkpoint of torchrun 2 x 64, so one process resumes it at 128 a
    # step.
    if "accumulation" in mistake:
        shutil.copytree(reference(user_cmd(project, "torchrun 2", *MISTAKE)).out_dir, out)
    # ddp_train.py wrote checkpoints like this one before its checkpoints had a format.
    if "older" in mistake:
        out.mkdir()
        torch.save({"model": [], "progress": {"step": 3}, "rng": []}, out / "checkpoint.pt")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        if "RANK" in env:
            port = taken.getsockname()[1] if mistake == "port in use" else free_port()
            env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        before = {p.name: p.read_bytes() for p in out.glob("*")}
        r = run([*cmd, *map(str, args)], tmp_path, expect=None, env=clean_env(**env))
    # The run fails at once. It never waits out the --timeout for a peer.
    assert r.returncode != 0 and r.seconds < PEER_TIMEOUT, r
    assert says in last_line(r.stderr) and last_line(r.stderr).startswith("user.py: error: "), r
    assert "Traceback" not in r.stderr and r.stderr.count("user.py: error:") == 1, r
    assert {p.name: p.read_bytes() for p in out.glob("*")} == before


# A script that imports ddp_train adds its flags with add_task_flags(parser). There it can also give
# the script's flags its own defaults.
TASK_FLAGS = """
import argparse, ddp_train


def add_task_flags(parser):
    parser.add_argument("--augment", action=argparse.BooleanOptionalAction, default=True)
    parser.set_defaults(lr=0.5, epochs=14, compile=True)


ddp_train.add_task_flags = add_task_flags
for argv in ([], ["--no-augment", "--lr", "2", "--epochs", "1", "--no-compile"]):
    args = ddp_train.parse_args(argv)
    print(args.augment, args.lr, args.epochs, args.compile, args.batch_size)
"""


def test_a_task_adds_its_flags_and_its_defaults_and_the_command_line_overrides_them(tmp_path):
    # The task's switch is on by default, and --no-augment turns it off. The task's defaults of
    # --lr, --epochs and --compile hold, and the command line overrides each.
    with Launch([PY, "-c", TASK_FLAGS], tmp_path, "flags") as flags:
        assert flags.wait() == 0, flags.stderr
    assert flags.stdout.splitlines() == ["True 0.5 14 True 64", "False 2.0 1 False 64"], (
        flags.stdout
    )


SEAMS_TASK = """
import argparse
import sys
sys.path.insert(0, {root!r})
import torch
import torch.nn.functional as F
import ddp_train


def add_task_flags(parser):
    add_flags_of_the_default_task(parser)
    parser.add_argument("--label-smoothing", type=float, default=0.0, help="the labels' smoothing")
    parser.add_argument("--per-epoch", action=argparse.BooleanOptionalAction, help="per epoch")


add_flags_of_the_default_task = ddp_train.add_task_flags


def build_optimizer(args, model, plan):
    return torch.optim.SGD(model.parameters(), lr=args.lr * plan.global_batch / 256)


def build_scheduler(args, optimizer, plan):
    if not args.per_epoch:
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=plan.steps_per_epoch, gamma=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scheduler.per_epoch = True
    return scheduler


def collate_fn(items, args, training):
    inputs, targets = collate_default(items, args, training)
    return inputs, targets, args.label_smoothing, training


def count_items(batch):
    return len(batch[1])


def compute_loss(model, batch, args):
    inputs, targets, smoothing, training = batch
    loss = F.cross_entropy(model(inputs), targets, label_smoothing=smoothing)
    collated_for_training = torch.tensor(float(training))
    return loss, {{"smoothing": torch.tensor(smoothing), "collated_for_training": collated_for_training}}


collate_default = ddp_train.collate_fn
ddp_train.build_optimizer, ddp_train.build_scheduler = build_optimizer, build_scheduler
ddp_train.collate_fn, ddp_train.count_items = collate_fn, count_items
ddp_train.compute_loss, ddp_train.add_task_flags = compute_loss, add_task_flags
if __name__ == "__main__":
    sys.exit(ddp_train.main())
"""


@long
def test_the_task_functions_see_the_plan_and_the_flags(tmp_path):
    # The optimizer scales its rate with the global batch, the schedule halves the rate after each
    # epoch, and collate_fn reads a flag of the task and whether its loader trains. The schedule
    # counts its epochs in steps, or it is a StepLR of one epoch that is marked per_epoch.
    script = tmp_path / "seams.py"
    script.write_text(SEAMS_TASK.format(root=str(ROOT)))
    args = ["--num-samples", 256, "--eval-samples", 48, "--epochs", 2, "--batch-size", 16]
    args += ["--grad-accum", 2, "--log-every", 1, "--lr", 0.1, "--label-smoothing", 0.25]
    for schedule in ("--no-per-epoch", "--per-epoch"):
        cmd = torchrun_cmd(2, *args, schedule, script=script)
        r = run(cmd, tmp_path, schedule.strip("-"))
        progress, epochs = r.records("progress"), r.records("epoch")
        # Two ranks of 2 micro-batches of 16 make a global batch of 64, and 4 steps an epoch.
        assert [record["lr"] for record in progress] == [0.025] * 4 + [0.0125] * 4, progress
        assert {record["train_smoothing"] for record in progress} == {0.25}, progress
        assert {record["train_collated_for_training"] for record in progress} == {1.0}, progress
        assert [record["eval_collated_for_training"] for record in epochs] == [0.0, 0.0], epochs


@long
def test_configure_torch_runs_on_every_rank_and_the_eval_loader_keeps_no_idle_worker(
    project, tmp_path
):
    # configure_torch sets the matmul precision, which every rank sees in training. With
    # --workers 2, each rank has 2 child processes while it trains, and --eval-workers 1 adds one.
    args = ["--num-samples", 512, "--eval-samples", 64, "--epochs", 1, "--batch-size", 16]
    for eval_workers, children in (0, 2), (1, 3):
        record = tmp_path / f"eval-workers-{eval_workers}"
        cmd = user_cmd(project, "torchrun 2", *args, "--workers", 2, "--eval-workers", eval_workers)
        run(cmd, tmp_path, f"out{eval_workers}", env=clean_env(VARIANT="options", RECORD=record))
        for rank in range(2):
            seen = Path(f"{record}.options.{rank}").read_text()
            assert seen == f"medium {children}", (eval_workers, rank, seen)


@long
def test_a_checkpoint_that_only_one_node_sees_is_one_line(tmp_path, reference):
    # The test starts two processes by hand as two nodes without shared storage. Each runs in a
    # directory of its own with a relative --out-dir. Rank 0's directory holds a checkpoint, and
    # rank 1's holds none. They would train different steps and hang at the end. So both stop at
    # once, and rank 0 says why.
    env = dict(WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    shutil.copytree(reference(python_cmd(*SMALL)).out_dir, tmp_path / "node0/out")
    (tmp_path / "node1").mkdir()
    before = {p.name: p.read_bytes() for p in (tmp_path / "node0/out").iterdir()}
    with reserve_slots(2):
        nodes = [
            Launch(
                python_cmd(*SMALL[:-3], 16, "--log-every", 0, "--out-dir", "out"),
                tmp_path,
                f"node{i}",
                env=clean_env(RANK=i, LOCAL_RANK=i, **env),
                cwd=tmp_path / f"node{i}",
            )
            for i in range(2)
        ]
        with nodes[0], nodes[1]:
            assert [n.wait() for n in nodes] == [2, 2], nodes[0].stderr + nodes[1].stderr
    says = (
        "ddp_train.py: error: the ranks start at steps [62, 0]: pass an --out-dir on a disk that "
        "all nodes share"
    )
    assert last_line(nodes[0].stderr) == says and not nodes[1].stderr, nodes[0].stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "node0/out").iterdir()} == before
    assert not (tmp_path / "node1/out").exists()


# ---------------------------------------------------------------------------
# These tests cover DDP's options.
# ---------------------------------------------------------------------------


@long
def test_a_head_that_sits_out_some_steps_trains_with_find_unused_parameters(project, tmp_path):
    cmd = user_cmd(project, "torchrun 2", *SMALL[:-3], 16, "--epochs", 1)
    without = run(cmd, tmp_path, "without", expect=None, env=clean_env(VARIANT="unused"))
    assert without.returncode != 0 and "find_unused_parameters" in without.stderr, without
    r = run([*cmd, "--find-unused-parameters"], tmp_path, env=clean_env(VARIANT="unused"))
    assert r.records("epoch")[0]["world_size"] == 2


@tier
def test_bf16_autocast_trains_on_the_cpu_too(tmp_path, reference):
    r = run(python_cmd(*SMALL, "--amp", "bf16"), tmp_path)
    fp32 = reference(python_cmd(*SMALL)).records("epoch")[-1]["eval_loss"]
    assert 0 < abs(r.records("epoch")[-1]["eval_loss"] - fp32) < 0.1 * fp32


@long
def test_a_compiled_ddp_model_trains_the_same_run_and_saves_a_plain_state_dict(tmp_path, reference):
    # The test compares a compiled run of torchrun 2 x 16 against one eager process x 32. The
    # compiled model is the DDP model, so DDPOptimizer splits the graph at its buckets.
    args = [*SMALL[:-5], 1, "--log-every", 0, "--batch-size"]
    r = run(torchrun_cmd(2, *args, 16, "--compile"), tmp_path, timeout=300)
    # The load is strict, so the weights have no "_orig_mod." or "module." prefix.
    build_model(args_of()).load_state_dict(r.weights)
    assert_same_weights(r.weights, reference(python_cmd(*args, 32)).weights)


# ---------------------------------------------------------------------------
# These tests cover the launch helpers and the Makefile.
# ---------------------------------------------------------------------------


@tier
@long
def test_make_train_and_train_cpu_run_a_script_of_yours_each_in_its_own_out_dir(tmp_path):
    # The test makes a fresh checkout with its .venv, which runs this Python. digits.py is the
    # user's script.
    repo = fresh_checkout(tmp_path / "repo")
    for target, world in (("train", 1), ("train-cpu", 2)):
        make = ["make", "-s", target, "SCRIPT=examples/digits.py", "ARGS=--epochs 1 --log-every 0"]
        env = clean_env(PYTHONPATH=None)
        with Launch(make, tmp_path, target, env=env, cwd=repo, slots=world) as launch:
            assert launch.wait() == 0, launch.stderr
        out = repo / "out" / target / "digits"
        assert f"world size {world}," in launch.stdout and (out / "model.pt").exists(), (
            launch.stdout
        )


DOC_BLOCKS = doc_blocks()

# The tests do not install wandb. This stand-in writes each call of wb.py to wandb_calls.jsonl.
FAKE_WANDB = """
import json
import secrets


class util:
    generate_id = staticmethod(lambda: secrets.token_hex(4))


def write(call, **fields):
    with open("wandb_calls.jsonl", "a") as f:
        f.write(json.dumps({"call": call, **fields}) + "\\n")


class Run:
    def log(self, numbers, step):
        write("log", step=step, names=sorted(numbers))

    def finish(self):
        write("finish")


def init(project, id, resume, config):
    write("init", id=id, out_dir=config["out_dir"])
    return Run()
"""


@long
def test_every_block_of_the_readme_and_the_recipes_works_as_written(tmp_path):
    # The test works in a fresh checkout and follows the order of the README and then of
    # docs/recipes.md. Each bash line runs and exits 0. A python block whose first line names a
    # file, as "# tb.py: ..." does, is that file, and a later bash line runs it. Any other python
    # block runs as it stands. Then the test checks the recipes by what they wrote.
    pytest.importorskip(
        "tensorboard", reason="the TensorBoard recipe needs tensorboard (make setup)"
    )
    repo = fresh_checkout(tmp_path / "repo")
    (repo / "wandb.py").write_text(FAKE_WANDB)
    ran = 0
    for language, text, why in DOC_BLOCKS:
        name = re.match(r"# (\S+\.py):", text)
        if why or (language == "python" and name):
            if name:
                (repo / name.group(1)).write_text(text + "\n")
            continue
        lines = [text] if language == "python" else [x for x in text.splitlines() if x.strip()]
        for line in lines:
            cmd = [".venv/bin/python", "-c", line] if language == "python" else ["bash", "-c", line]
            # The launches of make check take their own slots, so this line takes none.
            slots = 0 if "make check" in line else processes(line.split())
            env = clean_env(PYTHONPATH=None)
            with Launch(cmd, tmp_path, f"block{ran}", env=env, cwd=repo, slots=slots) as r:
                limit = CHECK_TIMEOUT if "make check" in line else 240
                assert r.wait(limit) == 0, f"{line}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
            ran += 1
    assert ran >= 8, ran
    # Rank 0 alone made one W&B run, with the id that it kept in the out-dir. It logged each record
    # of metrics.jsonl once, in the order of the file, and the record of kind end finished the run.
    calls = [json.loads(x) for x in (repo / "wandb_calls.jsonl").read_text().splitlines()]
    records = [json.loads(x) for x in (repo / "out/wb/metrics.jsonl").read_text().splitlines()]
    run_id = (repo / "out/wb/wandb_id.txt").read_text()
    assert calls[0] == {"call": "init", "id": run_id, "out_dir": "out/wb"}, calls[0]
    assert calls[-1] == {"call": "finish"} and len(calls) == len(records) + 2, calls
    logged = [(call["step"], call["names"]) for call in calls[1:-1]]
    want = [
        (r["step"], sorted(f"{r['kind']}/{name}" for name in r if name != "kind")) for r in records
    ]
    assert logged == want and "epoch/eval_loss" in logged[-1][1], logged
    # TensorBoard has a scalar for every number of every record kind. Only one writer wrote them,
    # and it is rank 0's.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(repo.rglob("events.out.tfevents*"))
    assert len(events) == 1 and events[0].parent == repo / "out/tb", events
    tags = EventAccumulator(str(events[0])).Reload().Tags()["scalars"]
    records = [json.loads(x) for x in (repo / "out/tb/metrics.jsonl").read_text().splitlines()]
    want = {f"{r['kind']}/{k}" for r in records for k in r if k not in ("kind", "step", "epoch")}
    assert {"progress/train_loss", "eval/eval_loss", "epoch/eval_accuracy"} <= want == set(tags)
    # The best weights are those of the record with the lowest eval_loss, and they load as the
    # README says.
    records = [json.loads(x) for x in (repo / "out/best/metrics.jsonl").read_text().splitlines()]
    best = min((r for r in records if "eval_loss" in r), key=lambda r: r["eval_loss"])
    model = build_model(args_of()).double()
    model.load_state_dict(torch.load(repo / "out/best/best.pt", map_location="cpu"))
    x, y = build_datasets(args_of())[1].tensors
    with torch.no_grad():
        assert F.cross_entropy(model(x.double()), y).item() == pytest.approx(
            best["eval_loss"], rel=1e-6
        )


@pytest.mark.parametrize("block", [b for b in DOC_BLOCKS if b[2]], ids=lambda b: b[2][:30])
def test_readme_lines_the_tests_do_not_run(block):
    language, text, why = block
    pytest.skip(f"README {language} block not run ({why}): {' | '.join(text.splitlines())}")


def test_make_help_lists_every_target_once():
    text = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True).stdout
    targets = re.findall(r"^  make (\S+)", text, re.M)
    want = [
        "help",
        "setup",
        "train",
        "train-cpu",
        "train-Ngpu",
        "train-multinode",
        "test",
        "test-long",
        "check",
        "test-gpu",
        "test-torch",
        "lint",
        "bench",
        "clean",
    ]
    assert sorted(targets) == sorted(want), text


# ---------------------------------------------------------------------------
# The harness cannot pass by accident. A reference run that failed is retried afresh, and the CPU
# slots follow the CPUs that the test processes may use.
# ---------------------------------------------------------------------------

# The command writes a file into its out-dir, and its first attempt fails. A later attempt prints
# the files that it found in the out-dir when it started.
FAILS_FIRST = """
import os, sys
flag, out = sys.argv[1], sys.argv[-1]
found = sorted(os.listdir(out)) if os.path.isdir(out) else []
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "left-by-an-attempt"), "w").close()
if not os.path.exists(flag):
    open(flag, "w").close()
    sys.exit(3)
print("found", found)
"""


def test_a_reference_run_that_failed_is_retried_in_a_clean_out_dir(reference, tmp_path):
    # A retry in the failed attempt's out-dir would resume its checkpoint or find its finished run.
    cmd = [PY, "-c", FAILS_FIRST, tmp_path / "tried"]
    with pytest.raises(AssertionError):
        reference(cmd)
    assert reference(cmd).stdout == "found []\n"


@contextlib.contextmanager
def cpu_limit(kind):
    """Yield a command prefix that runs a command on one CPU, by its affinity, or under a cgroup
    whose quota is half a CPU. Skip where such a cgroup cannot be made."""
    if kind == "affinity":
        yield ["taskset", "--cpu-list", str(min(os.sched_getaffinity(0)))]
        return
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    name = f"ddp-test-{os.getpid()}"
    cgroup, quota = (v1 / name, "cpu.cfs_quota_us") if v1.is_dir() else (v2 / name, "cpu.max")
    try:
        cgroup.mkdir()
        (cgroup / quota).write_text("50000" if quota == "cpu.cfs_quota_us" else "50000 100000")
    except OSError as exc:
        with contextlib.suppress(OSError):
            cgroup.rmdir()
        pytest.skip(f"cannot make a cgroup with a CPU quota here: {exc}")
    try:
        yield ["sh", "-c", 'echo $$ > "$0" && exec "$@"', cgroup / "cgroup.procs"]
    finally:
        cgroup.rmdir()


@pytest.mark.parametrize("kind", ["affinity", "quota"])
def test_the_cpu_slots_follow_the_cpus_that_the_process_may_use(tmp_path, kind):
    # Each usable CPU gives two slots. os.cpu_count() counts the host's CPUs, so a process that is
    # pinned to one CPU, or held to half a CPU by a container's quota, would get too many.
    if check_copy.usable_cpus() < 2:
        pytest.skip("this process may use one CPU, so no limit can lower the count")
    code = "import check_copy; print(check_copy.ALL_SLOTS)"
    with cpu_limit(kind) as prefix, Launch([*prefix, PY, "-c", code], tmp_path, kind) as launch:
        assert launch.wait() == 0, launch.stderr
    assert launch.stdout == "2\n", launch.stdout


# This guards against regrowth. The budget counts every formatted line of the file, comments
# included, and the lines of its longest function. No line may ask ruff to skip its formatting. The
# line budget is the count of the file when it was set.
BUDGET = {"lines": 1870, "function lines": 60}


def test_the_script_stays_within_its_budget():
    source = Path(SCRIPT).read_text()
    assert len(source.splitlines()) <= BUDGET["lines"], len(source.splitlines())
    longest = max(
        f.end_lineno - f.lineno + 1
        for f in ast.walk(ast.parse(source))
        if isinstance(f, ast.FunctionDef)
    )
    assert longest <= BUDGET["function lines"], longest
    assert "fmt: skip" not in source and "fmt: off" not in source
    # ruff format leaves comments and docstrings as they are written, so this checks their width.
    widest = max(source.splitlines(), key=len)
    assert len(widest) <= 100, widest
    # A call that ruff split only to fit the comment at its end reads badly. Such a comment goes
    # on the line above the call.
    split = [line for line in source.splitlines() if re.match(r"\s*\)  #", line)]
    assert not split, split


# ---------------------------------------------------------------------------
# These tests run on two hosts and on a real SLURM cluster.
# ---------------------------------------------------------------------------


@multinode
def test_two_hosts_train_the_run_of_one_process_with_their_global_batch(
    two_hosts, tmp_path, reference
):
    out, port = tmp_path / "out", free_port()
    one = reference(python_cmd(*SMALL))
    settings = dict(
        PYTHON=PY, NNODES=2, MASTER_ADDR=two_hosts[0].addr, MASTER_PORT=port, NPROC_PER_NODE=1
    )
    with reserve_slots():  # The nodes wait for each other, so no other test runs beside them.
        nodes = [
            Launch(
                h.command(RUN_MULTI, *SMALL[:-3], 16, "--out-dir", out),
                tmp_path,
                f"node{i}",
                env=clean_env(NODE_RANK=i, IFNAME=h.ifname, TIMEOUT=PEER_TIMEOUT, **settings),
            )
            for i, h in enumerate(two_hosts)
        ]
        with nodes[0], nodes[1]:
            assert [n.wait() for n in nodes] == [0, 0], nodes[0].stderr + nodes[1].stderr
    r = nodes[0].result(out)
    assert "world size 2," in r.stdout + nodes[1].stdout
    assert_same_weights(r.weights, one.weights)


def torchrun_on(host, *launcher, name, endpoint, args, tmp_path, **env):
    """Launch torchrun with one process on one of the two hosts, as a user types it. It goes
    through torchrun's shared store. --local-addr names the host, so that the host of the lower
    address is node 0 of each round."""
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--local-addr={host.addr}"]
    cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node=1", *rdzv, *launcher, *args]
    return Launch(
        host.command(*cmd), tmp_path, name, env=clean_env(GLOO_SOCKET_IFNAME=host.ifname, **env)
    )


@multinode
def test_the_local_rank_0_of_each_node_makes_the_data_once(two_hosts, project, tmp_path):
    # Each host runs torchrun with 2 processes of the cached.py of docs/recipes.md, and each host has
    # a cache of its own. Only the local rank 0 of each node makes the data, while its peer waits.
    endpoint = f"{two_hosts[0].addr}:{free_port()}"
    args = [project / "user.py", "--timeout", PEER_TIMEOUT, *SMALL[:-3], 8]
    args += ["--out-dir", tmp_path / "out"]
    with reserve_slots():  # The nodes wait for each other, so no other test runs beside them.
        nodes = [
            torchrun_on(
                h,
                "--nnodes=2",
                "--nproc_per_node=2",
                "--rdzv-id=cache",
                name=f"node{i}",
                endpoint=endpoint,
                args=args,
                tmp_path=tmp_path,
                BASE="cached",
                VARIANT="downloads",
                DATA_CACHE=tmp_path / f"cache{i}",
            )
            for i, h in enumerate(two_hosts)
        ]
        with nodes[0], nodes[1]:
            codes = [n.wait(240) for n in nodes]
            assert codes == [0, 0], nodes[0].stderr + nodes[1].stderr
    assert "world size 4," in nodes[0].stdout + nodes[1].stdout
    calls = [(tmp_path / f"cache{i}.downloads").read_text().splitlines() for i in range(2)]
    assert sorted(calls) == [["rank 0 local rank 0"], ["rank 2 local rank 0"]], calls


@multinode
def test_two_node_restarts_resume_bit_identical(two_hosts, project, tmp_path, reference):
    # The test runs torchrun --nnodes=2 --max-restarts=1 as a user types it, with its store shared
    # across rounds. Node 1's worker dies while node 0's worker computes. Node 1 counts a restart
    # and node 0 does not. Both restart in a new round, which finds the old round's keys in that
    # store. The run resumes on both nodes and ends bit-identical to the uninterrupted run.
    endpoint = f"{two_hosts[0].addr}:{free_port()}"
    whole = reference(user_cmd(project, "torchrun 2", *RESUME))
    args = [project / "user.py", "--timeout", PEER_TIMEOUT, *RESUME, "--out-dir", tmp_path / "out"]
    stop = dict(STOP_AT=75, STOP_SIGNAL="SIGKILL", STOP_RANK=1, VARIANT="busy")
    with reserve_slots():  # The nodes wait for each other, so no other test runs beside them.
        launcher = ["--nnodes=2", "--max-restarts=1", "--rdzv-id=restarts"]
        nodes = [
            torchrun_on(
                h,
                *launcher,
                name=f"node{i}",
                endpoint=endpoint,
                args=args,
                tmp_path=tmp_path,
                **stop,
            )
            for i, h in enumerate(two_hosts)
        ]
        with nodes[0], nodes[1]:
            codes = [n.wait(240) for n in nodes]
            assert codes == [0, 0], nodes[0].stderr + nodes[1].stderr
    r = nodes[0].result(tmp_path / "out")
    assert "resumed from" in r.stdout and "at step 70," in r.stdout, r
    assert_same_weights(r.weights, whole.weights, exact=True)


@multinode
def test_a_node_that_leaves_and_joins_again_resumes_the_run_with_its_global_batch(
    two_hosts, project, tmp_path, reference
):
    # This is an elastic job of 1 to 2 nodes with one process each. Node 1 dies once both nodes
    # have trained to a checkpoint. Node 0's worker loses its peer, and node 0 restarts it alone
    # with 2 micro-batches a step, which keeps the same global batch of 32. Then node 1 joins again.
    # Node 0's worker stops and saves, and both nodes resume at world size 2. Node 0 resumes at its
    # restart count 1, and node 1 resumes at 0. The run ends as the uninterrupted one at world size
    # 2, up to float rounding. A joining node needs a store of its own round, so the test sets
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as run_multi_node.sh sets it for elastic jobs. In
    # torch's shared store, the torchrun of a new node waits for an address that no node writes.
    out, endpoint = tmp_path / "out", f"{two_hosts[0].addr}:{free_port()}"
    whole = reference(user_cmd(project, "torchrun 2", *RESUME))
    conf = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
    args = [project / "user.py", "--timeout", PEER_TIMEOUT, *RESUME, "--out-dir", out]

    def node(i, name):
        elastic = ["--nnodes=1:2", "--max-restarts=3", "--rdzv-id=elastic"]
        elastic.append(f"--rdzv-conf=is_host={int(i == 0)},{conf}")
        host = two_hosts[i]
        return torchrun_on(
            host,
            *elastic,
            name=name,
            endpoint=endpoint,
            args=args,
            tmp_path=tmp_path,
            VARIANT="waitjoin",
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
        )

    with reserve_slots(), node(0, "a") as a:
        with node(1, "b") as b:
            a.wait_for(
                lambda: "world size 2" in a.stdout and (out / "checkpoint.pt").exists(),
                "a checkpoint of two",
            )
            b.kill()
        # Node 0's worker is alone now, so it waits in its first step until a node joins.
        a.wait_for(lambda: "world size 1," in a.stdout, "node 0 alone")
        with node(1, "b_again") as b_again:
            assert [a.wait(240), b_again.wait(240)] == [0, 0], a.stderr + b_again.stderr
    r = a.result(out)
    assert "global batch 32 = 16/process x 1 x 2 accum" in r.stdout, r
    rounds = re.findall(r"world size (\d)", r.stdout)
    assert rounds == ["2", "1", "2"] and r.stdout.count("saved by 1 process(es)") == 1, r
    assert r.records("epoch")[-1]["world_size"] == 2
    assert_same_weights(r.weights, whole.weights)


def slurm_job(cluster, tmp_path, script, *options):
    """Submit `script` with sbatch, and wait for the job to COMPLETE. Return the job, its info
    and its output."""
    output = tmp_path / "job.out"
    job = cluster.sbatch(script, *options, output=output)
    info = cluster.wait(job)
    text = output.read_text() if output.exists() else ""
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (info, text)
    return job, info, text


@slurm
def test_srun_tasks_are_the_processes_of_one_run(slurm_cluster, tmp_path, reference):
    # The job runs `srun -N2 -n2 python ddp_train.py`. MASTER_ADDR comes from the step's node
    # list, so node[0-1] gives node0.
    out = tmp_path / "out"
    two = reference(torchrun_cmd(2, *SMALL[:-3], 16, "--log-every", 0))
    args = [*SMALL[:-3], 16, "--log-every", 0, "--timeout", PEER_TIMEOUT, "--out-dir", out]
    job = f"srun -N2 -n2 {PY} {SCRIPT} {' '.join(map(str, args))}\n"
    with reserve_slots():  # The tasks wait for each other, so no other test runs beside them.
        _, _, text = slurm_job(slurm_cluster, tmp_path, job, "-N2", "-n2")
    assert "world size 2," in text, text
    assert_same_weights(torch.load(out / "model.pt"), two.weights, exact=True)


@slurm
def test_a_signalled_slurm_job_is_requeued_by_run_multi_node_and_resumes_bit_identical(
    slurm_cluster, project, tmp_path, reference
):
    # The test runs the batch script of run_multi_node.sh's header on 2 nodes, with one process
    # each. scancel sends USR1 to the job's steps, as --signal=USR1@120 does before the time limit.
    # Every worker saves and stops. The script finds no model.pt, so it requeues the job, and the
    # job's second run resumes.
    header = [
        line[4:] for line in Path(RUN_MULTI).read_text().splitlines() if line.startswith("#   ")
    ]
    script = "\n".join(header[header.index("#!/bin/bash") + 1 :]) + "\n"
    args = " ".join(map(str, [*RESUME, "--timeout", PEER_TIMEOUT]))
    script = script.replace("/shared/runs", str(tmp_path))
    script = script.replace("--slurm -- ", f"--slurm --script {project}/user.py -- {args} ")
    output = tmp_path / "job.out"
    whole = reference(user_cmd(project, "torchrun 2", *RESUME))
    with reserve_slots():  # The nodes wait for each other, so no other test runs beside them.
        job = slurm_cluster.sbatch(script, output=output)
        out = tmp_path / job
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pt").exists():
            assert time.monotonic() < deadline, output.read_text()
            time.sleep(0.1)
        slurm_cluster.run(["scancel", "--signal=USR1", job])
        info = slurm_cluster.wait(job, 180)
    text = output.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), (
        info,
        text,
    )
    assert "stopped by a signal at step" in text and "resumed from" in text, text
    assert_same_weights(torch.load(out / "model.pt"), whole.weights, exact=True)


# ---------------------------------------------------------------------------
# These tests need GPUs. make test-gpu runs them, and they are skipped without CUDA.
# ---------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("extra", [[], ["--amp", "bf16"], ["--amp", "fp16"], ["--compile"]])
def test_one_gpu_trains_in_every_precision_and_compiled(tmp_path, extra):
    r = run(python_cmd(*SMALL, *extra), tmp_path, timeout=300)
    assert "cuda:0" in r.stdout and r.records("epoch")[-1]["eval_accuracy"] > 0.5, r
    build_model(args_of()).load_state_dict(r.weights)


@gpu
@needs_cuda
def test_more_processes_than_gpus_is_one_line(tmp_path):
    n = torch.cuda.device_count() + 1
    r = run(torchrun_cmd(n, *SMALL), tmp_path, expect=None)
    assert r.returncode != 0 and "NCCL needs one per process" in r.stderr, r
    assert "[rank0]: Traceback" not in r.stderr, r


@gpu
@needs_cuda
def test_a_gpu_run_stopped_by_sigterm_resumes_bit_identical(project, tmp_path, reference):
    n = torch.cuda.device_count()
    stop = dict(STOP_AT=40, STOP_SIGNAL="SIGTERM", STOP_TARGET="parent")
    _, again = stopped_and_resumed(
        user_cmd(project, f"torchrun {n}", *RESUME), tmp_path, stop, None
    )
    # With one GPU there is no process group, so the run names cuda:0 instead of nccl.
    assert ("nccl" if n > 1 else "cuda:0") in again.stdout, again
    assert_same_weights(
        again.weights, reference(user_cmd(project, f"torchrun {n}", *RESUME)).weights, exact=True
    )


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "variant,extra",
    [
        ("", []),  # The count is of samples.
        ("", ["--grad-accum", 2]),
        ("tokens", []),  # The count is of tokens, as len(y) gives it.
        ("tokens", ["--grad-accum", 2]),
        ("masked", []),  # The count of tokens is a sum of the batch, (y != -100).sum().
        ("masked", ["--grad-accum", 2]),
        # The batches have a .to() of their own, as a BatchEncoding has.
        ("encoded", ["--amp", "bf16"]),
        ("", ["--amp", "fp16"]),  # This uses the GradScaler with the fused AdamW.
    ],
)
def test_no_step_waits_for_the_gpu_but_those_that_log_evaluate_or_save(
    project, tmp_path, variant, extra
):
    # user.py's nosync sets torch.cuda.set_sync_debug_mode("error") in every step that neither
    # logs, evaluates nor saves. A wait for the GPU in such a step fails the run and names the line
    # that waited. Under DDP the first 10 iterations may wait, because DDP measures them with CUDA
    # events.
    n = torch.cuda.device_count()
    launch = "python" if n == 1 else f"torchrun {n}"
    args = ["--num-samples", 4096, "--max-steps", 40, "--log-every", 10, *extra]
    env = clean_env(VARIANT=f"nosync,{variant}", CHECK_FROM=1 if n == 1 else 12)
    r = run(user_cmd(project, launch, *args), tmp_path, env=env)
    assert "cuda:0" in r.stdout or "nccl" in r.stdout, r
    assert "called a synchronizing CUDA operation" not in r.stderr, r.stderr


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_with_sync_bn_train_like_one_with_their_global_batch(project, tmp_path):
    two = run(
        torchrun_cmd(2, *SMALL[:-3], 16, "--sync-bn", script=str(project / "digits.py")),
        tmp_path,
        "two",
    )
    one = run(python_cmd(*SMALL, script=str(project / "digits.py")), tmp_path, "one")
    assert "nccl" in two.stdout and two.records("epoch")[-1]["eval_accuracy"] > 0.5
    assert (
        abs(two.records("epoch")[-1]["train_loss"] - one.records("epoch")[-1]["train_loss"]) < 0.1
    )


# ---------------------------------------------------------------------------
# make check checks your copy. These tests run it on the shipped tasks, and on copies of a task
# that break a guarantee.
# ---------------------------------------------------------------------------


# These are copies of a task, each as a user would write it. Each entry holds the changes to the
# default task or to tinylm. For a broken copy, the entry also names the guarantees that the check
# must fail, each with a word that its cause must say.
COPY_HEAD = """import argparse, os, random, sys
import torch, torch.nn as nn, torch.nn.functional as F
import ddp_train
from ddp_train import CLASSES, FEATURES
build_default, model_default = ddp_train.build_datasets, ddp_train.build_model
loss_default, add_flags_default = ddp_train.compute_loss, ddp_train.add_task_flags


class Noisy(torch.utils.data.Dataset):  # It adds noise from torch's generator to each read.
    def __init__(self, dataset):
        self.dataset = dataset
    def __len__(self):
        return len(self.dataset)
    def __getitem__(self, i):
        inputs, target = self.dataset[i]
        return inputs + 0.1 * torch.randn(inputs.shape), target
"""
# A denoiser draws its noise in compute_loss, in training and in evaluation, by design.
NOISY_LOSS = """
def compute_loss(model, batch, args):
    inputs, targets = batch
    logits = model(inputs + 0.1 * torch.randn(inputs.shape)).float()
    return F.cross_entropy(logits, targets)
ddp_train.compute_loss = compute_loss
"""
COPY_TAIL = """
if __name__ == "__main__":
    sys.exit(ddp_train.main())
"""
BROKEN_COPIES = {
    "summed-loss": (
        {2: "a sum", 3: "a sum"},
        """
def compute_loss(model, batch, args):
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets, reduction="sum")
ddp_train.compute_loss = compute_loss
""",
    ),
    "rank-dependent-dataset": (
        {4: "depends on the rank", 2: "different data"},
        """
def build_datasets(args):  # each rank its own samples
    rank = int(os.environ.get("RANK", 0))
    return build_default(argparse.Namespace(**{**vars(args), "seed": args.seed + rank}))
ddp_train.build_datasets = build_datasets
""",
    ),
    "rank-split-augmented": (
        {4: "depends on the rank", 6: "(see 4)"},
        """
def build_datasets(args):  # Each rank builds a split of its own.
    rank = int(os.environ.get("RANK", 0))
    seeded = argparse.Namespace(**{**vars(args), "seed": args.seed + rank})
    return tuple(Noisy(dataset) for dataset in build_default(seeded))
ddp_train.build_datasets = build_datasets
""",
    ),
    "unseeded-split": (
        {4: "does not seed"},
        """
def build_datasets(args):  # a split drawn by a generator that seeds itself from the OS
    train_set, eval_set = build_default(args)
    order = list(range(len(train_set)))
    random.Random().shuffle(order)
    return torch.utils.data.Subset(train_set, order[: len(order) // 2]), eval_set
ddp_train.build_datasets = build_datasets
""",
    ),
    "tokens-under-samples": (
        {1: "COUNT_UNIT is samples"},
        """
import tinylm  # a language model, its COUNT_UNIT = "tokens" left out
ddp_train.COUNT_UNIT = "samples"
""",
    ),
    "mean-of-means": (
        {2: "not the mean", 3: "a mean of per-sample means"},
        """
import tinylm
def compute_loss(model, batch, args):  # the mean of each sequence's token mean: not over the tokens
    targets = batch["targets"]
    logits = model(batch["inputs"]).float()
    per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    real = targets != tinylm.IGNORE
    per_sequence = (per_token * real).sum(1) / real.sum(1)
    return per_sequence.mean()
ddp_train.compute_loss = compute_loss
""",
    ),
    # These copies are ddp_train.py itself with one line of its loop edited. They run alone or under
    # an example.
    "no-set-epoch": (
        {8: "set_epoch"},
        ("        state.sampler.set_epoch(epoch)", "        pass  # (no set_epoch)"),
    ),
    # This runs digits, with BatchNorm, dropout and augmentation, on a loop that divides by
    # --grad-accum twice.
    "double-accum": (
        {2: "--grad-accum twice"},
        (
            "            weight = count * world.world_size / global_items",
            "            weight = count * world.world_size / global_items / state.plan.grad_accum",
            "digits.py",
        ),
    ),
    # This runs tinylm on a ddp_train.py whose loop weighs each micro-batch's token mean the same.
    "equal-token-means": (
        {2: "weighed equally"},
        (
            "            weight = count * world.world_size / global_items",
            "            weight = 1 / state.plan.grad_accum",
            "tinylm.py",
        ),
    ),
    # digits' own compute_loss, whose loss is summed over the batch. Its metrics stay, because
    # digits' eval_metrics makes the macro-F1 from them.
    "digits-summed-loss": (
        {2: "a sum"},
        """
import digits
def compute_loss(model, batch, args):
    output = digits.compute_loss(model, batch, args)
    loss, metrics = output if isinstance(output, tuple) else (output, None)
    summed = loss * len(batch[1])  # the sum over the batch, where the mean belongs
    return summed if metrics is None else (summed, metrics)
ddp_train.compute_loss = compute_loss
""",
    ),
    "own-generator": (
        {5: "does not hold"},
        """
noise = torch.Generator().manual_seed(0)  # a generator of its own: no checkpoint holds it
def compute_loss(model, batch, args):
    inputs, targets = batch
    if model.training:
        inputs = inputs + 0.1 * torch.randn(inputs.shape, generator=noise)
    return loss_default(model, (inputs, targets), args)
ddp_train.compute_loss = compute_loss
""",
    ),
    # The model counts its training forwards in a plain attribute, which no checkpoint holds.
    "module-counter": (
        {5: "model.calls is 8 in the uninterrupted run"},
        """
class Annealed(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.calls = 0
    def forward(self, x):
        if self.training:
            self.calls += 1
        return self.model(x) * min(1.0, 0.5 + self.calls / 20)
ddp_train.build_model = lambda args: Annealed(model_default(args))
""",
    ),
    # This copy draws noise in compute_loss and divides its loss by --grad-accum, which the loop
    # does already. The draws cannot explain the gap, and --eval-only at two --grad-accum names it.
    "noisy-loss-double-accum": (
        {2: "compute_loss reads --grad-accum"},
        NOISY_LOSS.replace("targets)\n", "targets) / args.grad_accum\n", 1),
    ),
    # This runs tinylm, with dropout, on a ddp_train.py that logs rank 0's own loss.
    "no-loss-all-reduce": (
        {3: "all_reduce left out"},
        (
            "        dist.all_reduce(values)  # DDP: Add up the sums and the counts of all ranks.",
            "        pass  # (no all_reduce)",
            "tinylm.py",
        ),
    ),
    # This runs imagefolder, whose mixup mixes the items of a batch, on the same ddp_train.py. Check
    # 2's launches turn the mixup off, so step 1 is recomputed item by item.
    "no-loss-all-reduce-mixup": (
        {3: "all_reduce left out"},
        (
            "        dist.all_reduce(values)  # DDP: Add up the sums and the counts of all ranks.",
            "        pass  # (no all_reduce)",
            "imagefolder.py",
        ),
    ),
    # A loss that draws noise cannot be recomputed item by item. The losses that the ranks computed
    # in step 1 still give its mean.
    "no-loss-all-reduce-noisy": (
        {3: "all_reduce left out"},
        (
            "        dist.all_reduce(values)  # DDP: Add up the sums and the counts of all ranks.",
            "        pass  # (no all_reduce)",
            NOISY_LOSS,
        ),
    ),
    # A report() that fails names its exception, and not torchrun's banner.
    "report-overflow": (
        {8: "OverflowError: math range error"},
        """
import math
def report(record, args, model):
    print(math.exp(1000 * record.get("train_loss", 1.0)))
ddp_train.report = report
""",
    ),
    # Each batch's own F1 changes with the batches, so the mean of them changes with the world size.
    "batch-f1": (
        {6: "eval_f1 is not a mean over the items"},
        """
def compute_loss(model, batch, args):
    inputs, targets = batch
    logits = model(inputs).float()
    loss = F.cross_entropy(logits, targets)
    if model.training:
        return loss
    predicted = logits.argmax(dim=1)
    scores = []
    for c in range(CLASSES):
        hits = ((predicted == c) & (targets == c)).sum()
        claimed, actual = (predicted == c).sum(), (targets == c).sum()
        scores.append(2 * hits / (claimed + actual).clamp(min=1))
    return loss, {"f1": torch.stack(scores).float().mean()}
ddp_train.compute_loss = compute_loss
""",
    ),
    # An EMA of the weights that only rank 0 updates. Rank 0 saves it, but rank 1 evaluates and
    # resumes with an EMA that never moved.
    "ema-on-rank-0": (
        {5: "EMA that only rank 0 updates"},
        """
class RankZeroEMA(torch.optim.swa_utils.AveragedModel):
    def update_parameters(self, model):
        if os.environ.get("RANK", "0") == "0":  # only rank 0 updates its EMA
            super().update_parameters(model)
ddp_train.build_averaged_models = lambda args, model: {"ema": RankZeroEMA(model)}
""",
    ),
    # A resume that skips the micro-batches of the trained steps as if each step were one.
    "resume-skips-micro-batches": (
        {5: "the two runs trained other batches"},
        (
            "        for start in range(self.skip_steps * self.per_step, end, self.batch_size):",
            "        for start in range(self.skip_steps * self.batch_size, end, self.batch_size):",
        ),
    ),
    # A plan that keeps the partial last global batch of each epoch as a step of its own. The
    # sampler's shares hold no items for that step, so the copy fails there.
    "partial-step-kept": (
        {8: "the torchrun launch exited 1"},
        (
            "        steps_per_epoch = len(train_set) // global_batch",
            "        steps_per_epoch = -(-len(train_set) // global_batch)  # (the partial step kept)",
        ),
    ),
    "every-rank-writes": (
        {1: "rank 1 wrote"},
        """
def compute_loss(model, batch, args):
    path = f"debug_batch_rank{os.environ.get('RANK', 0)}.pt"
    if not os.path.exists(path):
        torch.save(batch, path)  # every rank writes its own first batch
    return loss_default(model, batch, args)
ddp_train.compute_loss = compute_loss
""",
    ),
}
# This is a small ResNet with convolutions, BatchNorm and residual blocks. It trains on images that
# the Dataset augments with torch, random and numpy as it reads them.
RESNET = """
import numpy
class Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))
class Images(torch.utils.data.Dataset):
    def __init__(self, size, augment):
        generator = torch.Generator().manual_seed(size)
        self.images = torch.randn(size, 3, 8, 8, generator=generator)
        self.labels = torch.randint(0, CLASSES, (size,), generator=generator)
        self.augment = augment
    def __len__(self):
        return len(self.labels)
    def __getitem__(self, i):
        image = self.images[i]
        if self.augment:
            image = image.flip(2) if random.random() < 0.5 else image
            image = image * float(numpy.random.uniform(0.8, 1.2)) + 0.1 * torch.randn(image.shape)
        return image, self.labels[i]
def build_datasets(args):
    return Images(256, augment=True), Images(64, augment=False)
def build_model(args):
    stem = [nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, CLASSES)]
    return nn.Sequential(*stem, Block(16), Block(16), *head)
ddp_train.build_datasets, ddp_train.build_model = build_datasets, build_model
"""
COPY_ARGS = {"resnet-workers": ["--workers", 2], "bf16": ["--amp", "bf16"]}
COPY_ARGS["double-accum-bf16"] = ["--amp", "bf16"]
BROKEN_COPIES["double-accum-bf16"] = BROKEN_COPIES["double-accum"]
# Weights in bfloat16 round at every step, so check 2 allows for their precision. A loss divided by
# --grad-accum twice in the loop still moves them far beyond it.
BF16_WEIGHTS = """
def build_model(args):
    return model_default(args).to(torch.bfloat16)
def compute_loss(model, batch, args):
    inputs, targets = batch
    return F.cross_entropy(model(inputs.to(torch.bfloat16)).float(), targets)
ddp_train.build_model, ddp_train.compute_loss = build_model, compute_loss
"""
BROKEN_COPIES["double-accum-bf16-weights"] = (
    {2: "--grad-accum twice"},
    BROKEN_COPIES["double-accum"][1][:2] + (BF16_WEIGHTS,),
)
# A clipped update has the same size whatever the gradient's scale. So check 2 switches clipping off,
# and it still finds the loss that is divided twice.
COPY_ARGS["double-accum-clipped"] = ["--clip-grad-norm", 1]
BROKEN_COPIES["double-accum-clipped"] = BROKEN_COPIES["double-accum"]
# The Dataset draws in DataLoader workers, so the resume is not bit-identical. The check must still
# compare the ranks' parts, and find the EMA that only rank 0 updates.
COPY_ARGS["resnet-ema-on-rank-0"] = ["--workers", 2]
BROKEN_COPIES["resnet-ema-on-rank-0"] = (
    {5: "EMA that only rank 0 updates"},
    RESNET + BROKEN_COPIES["ema-on-rank-0"][1],
)
# These correct copies differ from the default task by design, and the check passes them. A correct
# copy runs the checks that it is about, or all of them where none are named. The shipped tasks
# cover BatchNorm and dropout in every check, because digits has both and tinylm has dropout.
CORRECT_COPIES = {
    "running-norm": (
        (),
        """
class RunningNorm(nn.Module):  # a running normalizer of its inputs: state that training moves
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(FEATURES))
    def forward(self, x):
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean
def build_model(args):
    return nn.Sequential(RunningNorm(), model_default(args))
ddp_train.build_model = build_model
""",
    ),
    "adadelta": (
        (1, 2),
        """
def add_task_flags(parser):
    add_flags_default(parser)
    parser.set_defaults(lr=1.0)  # This is Adadelta's usual rate. Plain SGD diverges at it here.
def build_datasets(args):  # The inputs are not normalised, as raw pixel values are not.
    train_set, eval_set = build_default(args)
    for dataset in (train_set, eval_set):
        dataset.tensors = (10 * dataset.tensors[0], dataset.tensors[1])
    return train_set, eval_set
def build_optimizer(args, model, plan):
    return torch.optim.Adadelta(model.parameters(), lr=args.lr)
ddp_train.build_datasets, ddp_train.build_optimizer = build_datasets, build_optimizer
ddp_train.add_task_flags = add_task_flags
""",
    ),
    "augmented-subset": (
        (2, 3),
        """
def build_datasets(args):  # random_split gives a Subset, which reads a batch with __getitems__.
    train_set, eval_set = build_default(args)
    train_part, _ = torch.utils.data.random_split(Noisy(train_set), [0.75, 0.25])
    return train_part, eval_set
ddp_train.build_datasets = build_datasets
""",
    ),
    "augmented-dict-batches": (
        (2, 3),
        """
class DictBatches(Noisy):  # It reads a whole batch as a dict of tensors, and it can add noise.
    def __init__(self, dataset, noise):
        self.dataset, self.noise = dataset, noise
    def __getitems__(self, indices):
        inputs, targets = self.dataset.__getitems__(indices)
        return {"inputs": inputs + self.noise * torch.randn(inputs.shape), "targets": targets}
def build_datasets(args):
    train_set, eval_set = build_default(args)
    return DictBatches(train_set, noise=0.1), DictBatches(eval_set, noise=0.0)
def collate_fn(batch, args, training):
    return batch
def count_items(batch):
    return len(batch["targets"])
def compute_loss(model, batch, args):
    return loss_default(model, (batch["inputs"], batch["targets"]), args)
ddp_train.build_datasets, ddp_train.collate_fn = build_datasets, collate_fn
ddp_train.compute_loss, ddp_train.count_items = compute_loss, count_items
""",
    ),
    "batch-mixer-and-own-draws": (
        (2,),
        """
class BatchCentre(nn.Module):  # It centres each feature over the batch, a normaliser of its own.
    def forward(self, x):
        return x - x.mean(0) if self.training else x
class OwnDraws(Noisy):  # It draws its noise from a generator of its own, which no seed reaches.
    generator = torch.Generator().manual_seed(0)
    def __getitem__(self, i):
        inputs, target = self.dataset[i]
        return inputs + 0.1 * torch.randn(inputs.shape, generator=self.generator), target
def build_datasets(args):
    train_set, eval_set = build_default(args)
    return OwnDraws(train_set), eval_set
def build_model(args):
    return nn.Sequential(BatchCentre(), model_default(args))
ddp_train.build_datasets, ddp_train.build_model = build_datasets, build_model
""",
    ),
    "resnet": ((2,), RESNET),
    "resnet-workers": ((), RESNET),
    "noisy-loss": ((), NOISY_LOSS),
    # This copy builds its autocast from a name that it imported before the check's wrapper ran.
    # Check 2 must switch that autocast off too.
    "bf16": (
        (),
        """
from torch import autocast
def make_autocast(args, device):
    return autocast(device.type, torch.bfloat16)
ddp_train.make_autocast = make_autocast
""",
    ),
    "bf16-weights": ((), BF16_WEIGHTS),
    # The dropout between an LSTM's layers is an attribute of the module.
    "lstm-dropout": (
        (2,),
        """
class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 32, num_layers=2, dropout=0.3, batch_first=True)
        self.head = nn.Linear(32, CLASSES)
    def forward(self, x):
        output, _ = self.lstm(x.view(len(x), -1, 8))
        return self.head(output[:, -1])
ddp_train.build_model = lambda args: Recurrent()
""",
    ),
    # Mixup mixes the items of a training batch in collate_fn. The eval loader's batches stay.
    "mixup-collate": (
        (2, 3, 6),
        """
def collate_fn(items, args, training):
    if isinstance(items, tuple):
        items = list(zip(*items))
    inputs = torch.stack([item[0] for item in items])
    targets = F.one_hot(torch.stack([torch.as_tensor(item[1]) for item in items]), CLASSES).float()
    if training:
        mix = float(torch.distributions.Beta(0.4, 0.4).sample())
        inputs = mix * inputs + (1 - mix) * inputs.roll(1, 0)
        targets = mix * targets + (1 - mix) * targets.roll(1, 0)
    return inputs, targets
def compute_loss(model, batch, args):  # The targets are probabilities.
    inputs, targets = batch
    return F.cross_entropy(model(inputs).float(), targets)
ddp_train.collate_fn, ddp_train.compute_loss = collate_fn, compute_loss
""",
    ),
    # A learnable temperature that starts at 1000 makes up most of the weights' norm. A step that
    # moves the weights by 1% of their norm then throws the classifier far.
    "large-temperature": (
        (2,),
        """
class Tempered(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.net = model_default(args)
        self.temperature = nn.Parameter(torch.tensor(1000.0))
    def forward(self, x):
        return self.net(x) * (self.temperature / 1000)
ddp_train.build_model = Tempered
""",
    ),
    # An EMA of the weights that every rank updates after each optimizer step.
    "ema-every-rank": (
        (5,),
        """
ema_of = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
ddp_train.build_averaged_models = lambda args, model: {
    "ema": torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=ema_of)
}
""",
    ),
    "per-rank-init": (
        (),
        """
def build_model(args):
    torch.manual_seed(1000 + int(os.environ.get("RANK", 0)))  # each rank its own initial weights
    return model_default(args)
ddp_train.build_model = build_model
""",
    ),
}
# Check 2's launches call collate_fn with training=False, so the mixup is off there. Then the loop that
# divides by --grad-accum twice fails, as it does without mixup.
BROKEN_COPIES["double-accum-mixup"] = (
    {2: "--grad-accum twice"},
    BROKEN_COPIES["double-accum"][1][:2] + (CORRECT_COPIES["mixup-collate"][1],),
)


def write_copy(directory: Path, name: str, body: str | tuple) -> Path:
    """Write a copy of a task in a project directory of its own, as NAME.py beside the examples
    tinylm.py, digits.py and imagefolder.py. A body of text imports ddp_train.py from the
    repository. A body of (line, new line) is a copy of ddp_train.py itself, with that line of its
    loop edited. A third item names an example, or it is the text of a task. Either then runs on
    the edited copy as the project's ddp_train.py."""
    directory.mkdir()
    for example in ("tinylm.py", "digits.py", "imagefolder.py"):
        shutil.copy(ROOT / "examples" / example, directory)
    script = directory / f"{name.replace('-', '_')}.py"
    if isinstance(body, tuple):
        source = Path(SCRIPT).read_text()
        line, new_line, *example = body
        found = source.count(line)
        assert found == 1, f"{name}: ddp_train.py holds {line!r} {found} times"
        if example and example[0].endswith(".py"):
            script = directory / example[0]
            (directory / "ddp_train.py").write_text(source.replace(line, new_line))
        elif example:
            script.write_text(COPY_HEAD + example[0] + COPY_TAIL)
            (directory / "ddp_train.py").write_text(source.replace(line, new_line))
        else:
            script.write_text(source.replace(line, new_line))
    else:
        script.write_text(COPY_HEAD + body + COPY_TAIL)
    return script


def make_check(tmp_path, script, args=(), checks=()) -> tuple[int, dict, str]:
    """Run make check's command on a script. Return its exit code, its lines by guarantee, and its
    output."""
    cmd = [PY, ROOT / "check_copy.py", script, f"--args={shlex.join(map(str, args))}"]
    cmd += [f"--checks={','.join(map(str, checks))}", f"--work={tmp_path / 'check'}"]
    # The launches of make check take their own slots, so this launch takes none.
    with Launch(cmd, tmp_path, "make-check", slots=0) as launch:
        code = launch.wait(timeout=CHECK_TIMEOUT)
    lines = {}
    for line in launch.stdout.splitlines():
        m = re.match(r"(pass|FAIL|n/a) +(\d)\. ", line)
        if m:
            lines[int(m.group(2))] = (m.group(1), line)
    return code, lines, launch.stdout + launch.stderr


def test_every_copy_that_edits_the_script_finds_its_line_once(tmp_path):
    """The copies that edit a line of ddp_train.py run in the long tier. This test writes each of
    them and launches none, so make test finds a line that an edit of the script renamed, in
    seconds. write_copy() fails where the line is not in the script exactly once."""
    written = 0
    for copies in (BROKEN_COPIES, CORRECT_COPIES):
        for name, (_, body) in copies.items():
            if isinstance(body, tuple):
                write_copy(tmp_path / name, name, body)
                written += 1
    assert written >= 10


# make test checks three of the broken copies, and the long tier checks the others.
IN_MAKE_TEST = ("summed-loss", "no-set-epoch", "every-rank-writes")


@pytest.mark.parametrize(
    "copy", [pytest.param(c, marks=[] if c in IN_MAKE_TEST else long) for c in BROKEN_COPIES]
)
def test_make_check_names_the_guarantee_a_broken_copy_breaks_and_why(tmp_path, copy):
    fails, body = BROKEN_COPIES[copy]
    script = write_copy(tmp_path / "project", copy, body)
    # With --workers 1, the check must still fail this copy. It must not mistake the draws of the
    # copy's own generator for augmentation.
    args = ["--workers", 1] if copy == "own-generator" else COPY_ARGS.get(copy, [])
    code, lines, output = make_check(tmp_path, script, args, checks=sorted(fails))
    assert code == 1 and set(lines) == set(fails), output
    for number, cause in fails.items():
        status, line = lines[number]
        assert status == "FAIL" and cause in line, output


@pytest.mark.parametrize("copy", CORRECT_COPIES)
@long
def test_make_check_passes_a_correct_copy_that_differs_by_design(tmp_path, copy):
    checks, body = CORRECT_COPIES[copy]
    script = write_copy(tmp_path / "project", copy, body)
    code, lines, output = make_check(tmp_path, script, COPY_ARGS.get(copy, []), checks)
    assert code == 0 and len(lines) == len(checks or GUARANTEES) and " 0 fail (" in output, output
    # Check 2 neutralises BatchNorm, dropout, autocast and the Dataset's draws, and it says so. A
    # layer may still mix a batch's items or move state of its own, a Dataset may draw from
    # generators of its own, a collate_fn may mix items, and a loss may draw noise. The check names
    # them in n/a lines, and every other line passes.
    not_applicable = {
        "running-norm": {2: ["RunningNorm"]},
        "batch-mixer-and-own-draws": {2: ["BatchCentre", "generators of its own"]},
        "noisy-loss": {
            2: ["draws random numbers in training (torch.randn in noisy_loss.py:", "other draws"],
            6: ["compute_loss draws random numbers in evaluation"],
        },
    }
    neutralised = {
        "augmented-subset": ["the Dataset's draws seeded per item"],
        "augmented-dict-batches": ["the Dataset's draws seeded per item"],
        "resnet": ["BatchNorm2d x 5 at fixed statistics", "the Dataset's draws seeded per item"],
        "bf16": ["autocast off"],
        "bf16-weights": ["tolerance 0.016, as the weights' precision is low"],
        "lstm-dropout": ["the dropout of LSTM x 1 off"],
        "mixup-collate": [
            "collate_fn's mixing off, as the eval loader calls it with training=False"
        ],
    }
    neutralised["resnet-workers"] = neutralised["resnet"]
    expected = not_applicable.get(copy, {})
    for number, (status, line) in lines.items():
        assert status == ("n/a" if number in expected else "pass"), output
        assert all(said in line for said in expected.get(number, [])), output
    if (
        2 in lines and 2 not in expected
    ):  # Initial weights per rank pass too, as DDP sends rank 0's.
        assert all(said in lines[2][1] for said in neutralised.get(copy, [])), output


@pytest.mark.parametrize(
    "task",
    [
        pytest.param("ddp_train.py", marks=tier),
        pytest.param("examples/digits.py", marks=long),
        pytest.param("examples/tinylm.py", marks=long),
        pytest.param("examples/imagefolder.py", marks=long),
        pytest.param("examples/stream.py", marks=long),
    ],
)
def test_make_check_passes_every_shipped_task(tmp_path, task):
    repo = fresh_checkout(tmp_path / "repo")
    make = ["make", "-s", "check", f"SCRIPT={task}"]
    env = clean_env(PYTHONPATH=None)
    # As in make_check, this launch takes no slots, because the launches of make check take theirs.
    with Launch(make, tmp_path, "make", env=env, cwd=repo, slots=0) as launch:
        code = launch.wait(timeout=CHECK_TIMEOUT)
    if task == "examples/stream.py":  # Each check says n/a, and why, and none fails.
        assert code == 0 and "0 pass, 8 n/a, 0 fail" in launch.stdout, launch.stdout
        assert launch.stdout.count("the training set is a stream, and the check cuts") == 8
        return
    # The checks N x B and 1 x N*B pass on each task, and the line of check 2 says what it
    # neutralised.
    assert code == 0 and "8 pass, 0 n/a, 0 fail" in launch.stdout, launch.stdout + launch.stderr
    neutralised = {
        "ddp_train.py": [],
        "examples/digits.py": ["BatchNorm2d x 2 at", "Dropout x 1 off", "draws seeded per item"],
        "examples/tinylm.py": ["Dropout x 4 off", "the dropout of scaled_dot_product_attention"],
        "examples/imagefolder.py": ["BatchNorm2d x 9 at", "draws seeded per item", "mixing off"],
    }
    for said in neutralised[task]:
        assert re.search(rf"^pass +2\. .*{said}", launch.stdout, re.M), launch.stdout
    # Check 5 compared the parts of the checkpoint across the ranks and across the resume.
    assert re.search(r"^pass +5\. .*differ after the resume", launch.stdout, re.M), launch.stdout
    # The runs are in the project's out/, as make train's runs are. The logs stay, and every file
    # of weights is gone, the checkpoints and model.pt files and the check's own weights.
    work = repo / "out/check" / Path(task).stem
    assert (work / "records/torchrun/run.out").exists() and (work / "python/metrics.jsonl").exists()
    assert not [path for path in work.rglob("*") if ".pt" in path.name], list(work.rglob("*"))


# These commits hold ddp_train.py as users copied it. The first is from before its restructure into
# the loop and the machinery, and the second is from before one mechanism for each guarantee. Both
# write checkpoints of format 2. make check must still check such copies, and today's script
# refuses their checkpoints in one line.
OLDER_SCRIPTS = ("df2e763", "ead0e36")


def older_script(directory: Path, commit: str) -> Path:
    shown = subprocess.run(
        ["git", "-C", ROOT, "show", f"{commit}:ddp_train.py"], capture_output=True, text=True
    )
    if shown.returncode:
        pytest.skip(f"this checkout has no commit {commit}, as a shallow clone has none")
    directory.mkdir()
    script = directory / "ddp_train.py"
    script.write_text(shown.stdout)
    return script


@long
@pytest.mark.parametrize("commit", OLDER_SCRIPTS)
def test_make_check_passes_a_copy_of_an_older_script(tmp_path, commit):
    script = older_script(tmp_path / "project", commit)
    code, lines, output = make_check(tmp_path, script)
    assert code == 0 and len(lines) == 8 and "8 pass, 0 n/a, 0 fail" in output, output
    # An older copy shows the check no stateful_parts, and check 5 says that it compared no parts.
    assert "the parts of its checkpoint were not compared" in lines[5][1], output


@long
@pytest.mark.parametrize("commit", OLDER_SCRIPTS)
def test_a_checkpoint_of_an_older_script_is_refused_in_one_line(tmp_path, commit):
    # The checkpoint stays as it was, and the line says why it is refused.
    old_script = older_script(tmp_path / "old", commit)
    run(python_cmd(*SMALL, "--max-steps", 5, script=old_script), tmp_path)
    before = (tmp_path / "out/checkpoint.pt").read_bytes()
    r = run(python_cmd(*SMALL), tmp_path, expect=2)
    says = "is of another ddp_train.py (checkpoint format 2, this one reads 4): finish its run"
    assert says in last_line(r.stderr) and "Traceback" not in r.stderr, r
    assert (tmp_path / "out/checkpoint.pt").read_bytes() == before


def test_make_check_says_in_one_line_that_the_script_is_missing(tmp_path):
    script = tmp_path / "mine.py"
    with Launch([PY, ROOT / "check_copy.py", script], tmp_path, "check", slots=0) as launch:
        assert launch.wait() == 1, launch.stderr
    said = f"make check: there is no {script}: SCRIPT=your script, as make train takes it\n"
    assert launch.stdout == said and not launch.stderr, launch.stdout + launch.stderr
