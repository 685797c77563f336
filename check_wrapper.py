"""This is make check's wrapper. check_copy.py copies it under the name of the user's script and runs
it in the script's place, with the script's flags and task functions. What the CHECK_* variables ask
for is installed around the task functions. The wrapper's own files go to CHECK_RECORDS."""

import collections
import contextlib
import functools
import hashlib
import importlib.util
import inspect
import json
import math
import os
import random
import signal
import sys
import time
import traceback

import torch
from torch.utils.data import DataLoader

env = os.environ
RANK = env.get("RANK", "0")
# The wrapper runs with CHECK_RECORDS set. A test may import it without.
RECORDS = env.get("CHECK_RECORDS", ".")
# Check 2's launches run the user's loop and loss with BatchNorm at fixed statistics, dropout off
# and the Dataset's draws seeded per item, so that N x B and 1 x N*B must train the same weights.
NEUTRAL = "CHECK_NEUTRAL" in env
# The check cuts a map-style set into shares of its own, and a stream has no length to cut. So for
# a stream, each check says n/a with this reason.
STREAM = "the training set is a stream, and the check cuts only a map-style set into its own shares"
# This is True while the wrapper writes its records, so that the audit leaves them out.
own_write = False


@contextlib.contextmanager
def own_writes():
    """Leave the wrapper's own writes out of the audit while they happen."""
    global own_write
    own_write = True
    try:
        yield
    finally:
        own_write = False


def record(name, line):
    with own_writes(), open(os.path.join(RECORDS, name), "a") as f:
        f.write(line + "\n")


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
        # Check 2's launches collate as the eval loader does, so that a mixup in collate_fn is off.
        # The script's loaders pass collate_fn as a partial with the keyword training. An older copy
        # passes collate_fn alone, and then it has no training flag to change.
        collate_fn = bound.get("collate_fn")
        takes_training = (
            isinstance(collate_fn, functools.partial) and "training" in collate_fn.keywords
        )
        if NEUTRAL and takes_training:
            keywords = {**collate_fn.keywords, "training": False}
            bound["collate_fn"] = functools.partial(collate_fn.func, *collate_fn.args, **keywords)
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


def showing_parts(save_checkpoint, modules):
    """Wrap the script's save_checkpoint, so that each rank saves the checkpoint's parts as it holds
    them, in parts.RANK.pt. Check 5 compares them across the ranks and across a resume. An
    argument with a dict `stateful_parts` holds the parts, as the script's TrainState does. Each
    rank also saves the numbers that the checkpoint does not hold, which check 5 names as a cause."""

    def save(*args, **kwargs):
        for value in (*args, *kwargs.values()):
            parts = getattr(value, "stateful_parts", None)
            if isinstance(parts, dict) and all(hasattr(p, "state_dict") for p in parts.values()):
                save_parts(parts)
                with own_writes(), open(os.path.join(RECORDS, f"numbers.{RANK}.json"), "w") as f:
                    json.dump(plain_numbers(parts.get("model"), modules), f)
        return save_checkpoint(*args, **kwargs)

    return save


def plain_numbers(model, modules):
    """Return the int and float attributes of the model's modules and the globals of the script's
    modules. No checkpoint holds them, so a counter among them starts again at a resume."""
    numbers = {}
    for module in modules:
        for name, value in vars(module).items():
            if type(value) in (int, float):
                numbers[f"{module.__name__}.{name}"] = value
    if isinstance(model, torch.nn.Module):
        for path, submodule in model.named_modules(prefix="model"):
            for name, value in vars(submodule).items():
                if type(value) in (int, float):
                    numbers[f"{path}.{name}"] = value
    return numbers


def save_parts(parts):
    values = {}
    for name, part in parts.items():
        state = part.state_dict()
        # DDP sends rank 0's buffers to every rank before each forward, so a rank's own buffers,
        # such as BatchNorm's statistics, may differ after a step. So may an EMA's average of them.
        if isinstance(part, torch.nn.Module):
            buffers = {key for key, _ in part.named_buffers()}
            state = {key: value for key, value in state.items() if key not in buffers}
        flatten(state, name, values)
    with own_writes():
        torch.save(values, os.path.join(RECORDS, f"parts.{RANK}.pt"))


def flatten(value, key, values):
    """Put each tensor and number of a nested state_dict into values, under a dotted key."""
    if torch.is_tensor(value):
        values[key] = value.detach().cpu().clone()
    elif isinstance(value, dict):
        for name, item in value.items():
            flatten(item, f"{key}.{name}", values)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            flatten(item, f"{key}.{i}", values)
    elif isinstance(value, (bool, int, float)):
        values[key] = value


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
                neutral["statistics"] = calibrate_batch_norms(target, task, sys.argv[1:])
                neutral["rate"] = sgd_rate(target, task, sys.argv[1:], neutral["statistics"])
            finally:
                env.update(launcher)
                built.update(kept)
                set_random_states(states)
        return neutral

    def build_datasets(args):
        train_set, eval_set = task["build_datasets"](args)
        built.update(train=train_set, eval=eval_set)
        if isinstance(train_set, torch.utils.data.IterableDataset):
            print(f"make check: error: {STREAM}", file=sys.stderr, flush=True)
            raise SystemExit(3)
        if hasattr(train_set, "__len__"):
            train_set = Recorded(train_set, "train", int(env["CHECK_TRAIN_ITEMS"]))
        if eval_set is not None and hasattr(eval_set, "__len__"):
            eval_set = Recorded(eval_set, "eval", int(env["CHECK_EVAL_ITEMS"]))
        return train_set, eval_set

    def build_model(args):
        model = task["build_model"](args)
        if NEUTRAL:
            switch_off_rnn_dropout(model)
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
            # This launch trains as another launch does, with other draws of the model's random
            # numbers. Check 2 measures the noise of those draws with it.
            if training_calls[0] == 1 and "CHECK_RESEED" in env:
                seed_all(7919 + int(RANK))
            first_run = env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if RANK == "0" and first_run and training_calls[0] == int(env.get("CHECK_STOP_AT", 0)):
                stop_torchrun()
        output = call_task(task["compute_loss"], model, batch, *args or [None])
        # Check 3 compares step 1's logged loss with the mean of the losses that the ranks computed
        # there, whatever they drew. This launch accumulates no micro-batches, so step 1 is the
        # first call.
        if model.training and training_calls[0] == 1 and "CHECK_STEP_ONE" in env:
            loss, count = loss_and_count(task, output, batch)
            record(f"step_one.{RANK}", json.dumps([float(loss), float(count)]))
        return output

    def report(record_, args, model):
        record("records.jsonl", json.dumps(record_))
        task["report"](record_, args, model)

    target.build_datasets, target.build_model = build_datasets, build_model
    target.compute_loss, target.report = compute_loss, report
    target.DataLoader = RecordedLoader
    if "CHECK_PARTS" in env and hasattr(target, "save_checkpoint"):
        modules = {target}
        for function in task.values():
            module = sys.modules.get(getattr(function, "__module__", None) or "")
            if module is not None:
                modules.add(module)
        target.save_checkpoint = showing_parts(target.save_checkpoint, modules)
    if NEUTRAL:
        switch_off_dropout()
        switch_off_autocast()
        switch_off_clipping()
    # Plain SGD at the check's rate times CHECK_SGD lets the scale of a gradient show.
    if "CHECK_SGD" in env:

        def build_optimizer(args, model, *plan):
            rate = neutral_settings()["rate"] * float(env["CHECK_SGD"])
            return torch.optim.SGD(model.parameters(), lr=rate)

        def build_scheduler(args, optimizer, *plan):
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

        target.build_optimizer, target.build_scheduler = build_optimizer, build_scheduler
    return task


def loss_and_count(task, output, batch):
    """Return the loss in the output of compute_loss and the count of the batch's items, from a
    copy of today's script or an older one."""
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


def collate(target, args, training):
    """Return the copy's collate_fn as a function of the items alone, as the copy's training loader
    or eval loader calls it."""
    return lambda items: call_task(target.collate_fn, items, args, training)


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


def switch_off_rnn_dropout(model):
    """Set the dropout between the layers of each RNN, LSTM and GRU to 0. That dropout is an
    attribute of the module, and torch's dropout functions never see it. Return the kinds of the
    modules that had one, with their counts."""
    kinds = collections.Counter()
    for module in model.modules():
        if isinstance(module, torch.nn.RNNBase) and module.dropout:
            module.dropout = 0.0
            kinds[type(module).__name__] += 1
    return kinds


def switch_off_autocast():
    """Make every autocast a context that does nothing, so that check 2's launches compute in
    float32 where the user's flags ask for bf16 or fp16. The change is made on torch's autocast
    class. So it also reaches a name that the copy imported before the wrapper ran, as in `from
    torch import autocast`, and torch.cuda.amp.autocast. The file autocast.RANK tells the check
    that the script asked for an autocast."""
    autocast_class = torch.amp.autocast_mode.autocast
    original_init = autocast_class.__init__

    def init_switched_off(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if enabled:
            record(f"autocast.{RANK}", str(dtype))
        original_init(self, device_type, enabled=False)

    autocast_class.__init__ = init_switched_off


def switch_off_clipping():
    """Make torch's clip_grad_norm_ measure the norm and clip nothing. A clipped update has the
    same size whatever the scale of the gradient, so clipping would hide a loss that is divided
    twice. The file clipping.RANK tells the check that the script clipped."""
    original = torch.nn.utils.clip_grad_norm_

    def measure_only(parameters, max_norm, *args, **kwargs):
        if max_norm != math.inf:
            record(f"clipping.{RANK}", str(max_norm))
        return original(parameters, math.inf, *args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = measure_only
    torch.nn.utils.clip_grad.clip_grad_norm_ = measure_only


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
    seeded as the script builds them. The flags are those of check 2's launch of 1 process, so that
    a compute_loss that reads --batch-size or --grad-accum gives every launch the same rate."""
    args = target.parse_args(argv)
    args.batch_size, args.grad_accum = int(env["CHECK_GLOBAL_BATCH"]), 1
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
    switch_off_rnn_dropout(model)
    norms = batch_norms(model)
    if not norms:
        return {}
    batch_size = int(env["CHECK_GLOBAL_BATCH"])
    # The launches collate as the eval loader does, and so does the calibration.
    collate_neutral = collate(target, args, False)
    for module in norms.values():
        module.reset_running_stats()
        module.momentum = None  # None gives a cumulative average over the batches.
    model.train()
    restore = switch_off_dropout()
    try:
        with torch.no_grad():
            for start in range(0, len(train_set), batch_size):
                indices = list(range(start, min(start + batch_size, len(train_set))))
                batch = collate_neutral(read_items(train_set.dataset, indices))
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
            switch_off_rnn_dropout(model)
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
            output = call_task(self.task["compute_loss"], model, batch, self.args)
            loss, n = loss_and_count(self.task, output, batch)
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
    process, without a process group. The inputs are the initial weights from rank 0 of check 2's
    launch of 2 processes, each rank's first micro-batch there, the final weights of check 2's
    launch of 1 process, which it evaluated without autocast, and the python launch's model.pt."""
    args = target.parse_args(argv)
    # The script seeds like this before build_datasets.
    getattr(target, "seed_everything", torch.manual_seed)(args.seed)
    # The Datasets are as the launches had them, because install()'s build_datasets gives their
    # first items. The model and compute_loss are the user's own, from task.
    train_set, eval_set = target.build_datasets(args)
    train_set.kept = {}  # Each figure below compares losses over the same items, read once.
    # Every figure collates as the eval loader does, with training=False, as check 2's launches do.
    losses = Losses(args, task, collate(target, args, False))
    initial, final, micro_batches = inputs["initial"], inputs["final"], inputs["first_step"]
    items = [i for batch in micro_batches for i in batch]
    each = [[i] for i in items]
    found = {"count_unit": target.COUNT_UNIT, "eval_loss": None, "eval_random": False}
    with torch.no_grad():
        # In evaluation there is no dropout and there are no batch statistics. Then a mean over a
        # batch's count is the count-weighted mean of its items' losses, each computed alone. A sum
        # is B times that mean.
        # At the initial weights, every item's loss may be close to the same value, and then a
        # mean of means hides. So the ratio comes from the initial and the trained weights, and
        # the one farther from 1 counts.
        ratios = []
        for weights in (initial, inputs["evaluated"]):
            alone = losses.mean(weights, False, train_set, each)[0]
            ratios.append(losses.mean(weights, False, train_set, micro_batches)[0] / alone)
        found["batch_over_items"] = max(ratios, key=lambda ratio: abs(ratio - 1))
        found["item_counts"] = [losses.mean(initial, False, train_set, [i])[1] for i in each]
        # A mean of 2B items is the count-weighted mean of its halves' means. A sum of 2B items is
        # the sum of its halves' sums.
        both = losses.mean(initial, False, train_set, [items])[0]
        halves = losses.mean(
            initial, False, train_set, [items[: len(items) // 2], items[len(items) // 2 :]]
        )[0]
        found["loss_2b_over_b"] = both / halves if halves else 1.0
        # The figures do not mix where only the training collate_fn mixes, as mixup does. Then the
        # line of check 2 says that its launches turned the mixing off.
        found["training_collate_mixes"] = collate_mixes(
            collate(target, args, True), train_set, items
        )
        found["collate_mixes"] = collate_mixes(losses.collate_fn, train_set, items)
        # The eval loss uses single's final weights, with each eval item alone. A compute_loss that
        # draws noise in evaluation, as a denoiser's does, gives another loss from another state.
        if eval_set is not None and len(eval_set):
            evaluated = inputs["evaluated"]
            draws = [losses.mean(evaluated, False, eval_set, [[0]], seed=s)[0] for s in (1, 2)]
            found["eval_random"] = draws[0] != draws[1]
            per_item = [[i] for i in range(len(eval_set))]
            (found["eval_loss"], _), _ = losses.mean_float64(evaluated, False, eval_set, per_item)
    found["load_error"] = load_error(task["build_model"](args), final)
    statistics = calibrate_batch_norms(target, task, argv)
    found["neutral"] = neutral_figures(losses, inputs, train_set, statistics)
    return found


def neutral_figures(losses, inputs, train_set, statistics):
    """Return what check 2's launches neutralise, and what still differs from process to process
    there. The launches hold BatchNorm at the calibrated statistics, switch dropout off, read each
    item from its own random state, and collate as the eval loader does."""
    neutral = Losses(losses.args, losses.task, losses.collate_fn, statistics)
    initial, micro_batch = inputs["initial"], inputs["first_step"][0]
    model = neutral.model(initial, True)
    found = {
        "batch_norms": collections.Counter(type(m).__name__ for m in batch_norms(model).values()),
        "dropouts": sum(isinstance(m, DROPOUT_MODULES) for m in model.modules()),
        "rnn_dropouts": switch_off_rnn_dropout(task_model(losses)),
        "step_1": None,
    }
    dropouts_seen.clear()
    restore = switch_off_dropout()
    try:
        with torch.no_grad():
            draws = [
                neutral.mean(initial, True, train_set, [micro_batch], seed=s)[0] for s in (1, 2)
            ]
            found["random"] = draws[0] != draws[1]
            found["random_call"] = None
            if found["random"]:
                found["random_call"] = first_random_call(neutral, initial, train_set, micro_batch)
            # Whether an item's output depends on its batch shows only without random draws.
            found["mixing"], found["mixing_layer"] = False, None
            if not found["random"]:
                try:
                    alone = neutral.mean(initial, True, train_set, [[i] for i in micro_batch])[0]
                    found["mixing"] = abs(alone - draws[0]) > 1e-5 * abs(draws[0])
                except Exception:  # A layer that mixes items may refuse a batch of one.
                    found["mixing"] = True
            if found["mixing"]:
                found["mixing_layer"] = mixing_layer(neutral, initial, train_set, micro_batch)
            found["stateful"] = stateful_layers(neutral, initial, train_set, micro_batch)
            # Step 1 as check 2's launch of 2 processes trained it: item by item, or as each
            # rank's micro-batch where an item's output depends on its batch.
            if not found["random"]:
                micro_batches = inputs["first_step"]
                per = micro_batches if found["mixing"] else [[i] for b in micro_batches for i in b]
                (found["step_1"], _), found["precision"] = neutral.mean_float64(
                    initial, True, train_set, per
                )
    finally:
        restore()
    implied = {"dropout"} if found["dropouts"] else set()  # nn.Dropout calls F.dropout.
    found["functions"] = sorted(dropouts_seen - implied)
    return found


def task_model(losses):
    return losses.task["build_model"](losses.args)


# A model draws its random numbers through these functions of torch and methods of its tensors.
RANDOM_FUNCTIONS = ("rand", "randn", "randint", "rand_like", "randn_like", "randint_like")
RANDOM_FUNCTIONS += ("randperm", "normal", "bernoulli", "multinomial", "poisson")
RANDOM_METHODS = ("normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_")


def first_random_call(losses, weights, dataset, items):
    """Return the first call that draws random numbers in a training forward, as `torch.randn in
    FILE:LINE`, with the line outside torch that made it. Return None where none of the calls
    that the check watches drew them."""
    calls = []
    torch_dir = os.path.dirname(torch.__file__)

    def watched(owner, name):
        original = getattr(owner, name)

        def call(*args, **kwargs):
            if not calls:
                for frame in reversed(traceback.extract_stack()[:-1]):
                    if not frame.filename.startswith(torch_dir) and frame.filename != __file__:
                        where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
                        calls.append(f"{'torch' if owner is torch else 'Tensor'}.{name} in {where}")
                        break
            return original(*args, **kwargs)

        return original, call

    model = losses.model(weights, True)
    batch = losses.collate_fn(read(dataset, items))
    patched = [(torch, name, *watched(torch, name)) for name in RANDOM_FUNCTIONS]
    patched += [(torch.Tensor, name, *watched(torch.Tensor, name)) for name in RANDOM_METHODS]
    for owner, name, _, call in patched:
        setattr(owner, name, call)
    try:
        call_task(losses.task["compute_loss"], model, batch, losses.args)
    except Exception:
        pass
    finally:
        for owner, name, original, _ in patched:
            setattr(owner, name, original)
    return calls[0] if calls else None


def collate_mixes(collate_fn, dataset, items):
    """Return whether collate_fn mixes the items of a batch, as mixup and cutmix do. Then a
    batch's tensors differ from its items' tensors, each collated alone."""
    states = random_states()
    try:
        seed_all(0)
        together = tensors_of(collate_fn(read(dataset, items)))
        alone = [tensors_of(collate_fn(read(dataset, [i]))) for i in items]
    except Exception:
        return False
    finally:
        set_random_states(states)
    for position, tensor in enumerate(together):
        parts = [part[position] for part in alone if len(part) == len(together)]
        if len(parts) != len(alone) or tensor.dim() == 0:
            continue
        if any(p.shape[1:] != tensor.shape[1:] for p in parts):
            continue  # A collate_fn that pads to the longest item changes the shapes.
        joined = torch.cat(parts)
        if joined.shape == tensor.shape and not torch.allclose(joined.double(), tensor.double()):
            return True
    return False


def tensors_of(batch):
    """Return the tensors of a batch in a fixed order."""
    if torch.is_tensor(batch):
        return [batch]
    if isinstance(batch, dict):
        return [t for key in batch for t in tensors_of(batch[key])]
    if isinstance(batch, (list, tuple)):
        return [t for value in batch for t in tensors_of(value)]
    return []


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


def sgd_rate(target, task, argv, statistics):
    """Find the one learning rate of the check's plain SGD. The first guess moves the initial
    weights by 1% of their norm in a step, so the user's --lr, which may suit another optimizer such
    as Adadelta, plays no part. The rate is halved until 8 steps at twice the rate, as the control
    launch takes them, lower the loss over the items that the launches train. Every launch gets the
    same rate, so a loss summed over the ranks still trains twice as fast as a mean."""
    args, train_set, model = initial_task(target, task, argv)
    switch_off_rnn_dropout(model)
    freeze_batch_norms(model, statistics)
    model.train()
    size = min(len(train_set), int(env["CHECK_TRAIN_ITEMS"]))
    global_batch = int(env["CHECK_GLOBAL_BATCH"])
    starts = range(0, size, global_batch)
    batches = [
        collate(target, args, False)(read(train_set, list(range(i, min(i + global_batch, size)))))
        for i in starts
    ]
    training_loss(task, model, batches[0], args).backward()
    weights = torch.cat([p.detach().double().flatten() for p in model.parameters()]).norm()
    grads = [p.grad.double().flatten() for p in model.parameters() if p.grad is not None]
    gradient = torch.cat(grads).norm() if grads else torch.tensor(0.0)
    if not (gradient > 0 and gradient.isfinite() and weights > 0):
        return args.lr  # There is nothing to scale by, so the user's own rate stays.
    rate = float(0.01 * weights / gradient)
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    for _ in range(20):
        if loss_falls(task, args, model, initial, batches, 2 * rate):
            break
        rate = rate / 2
    return rate


def training_loss(task, model, batch, args):
    output = call_task(task["compute_loss"], model, batch, args)
    return output[0] if isinstance(output, tuple) else output


def loss_falls(task, args, model, initial, batches, rate):
    """Return whether 8 steps of plain SGD at this rate, from the initial weights, lower the mean
    loss over the batches and keep it finite."""
    model.load_state_dict(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=rate)

    def mean_loss():
        with torch.no_grad():
            seed_all(0)
            return sum(float(training_loss(task, model, b, args)) for b in batches) / len(batches)

    before = mean_loss()
    for step in range(8):
        optimizer.zero_grad()
        training_loss(task, model, batches[step % len(batches)], args).backward()
        optimizer.step()
    after = mean_loss()
    return math.isfinite(after) and after <= before


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
