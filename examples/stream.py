"""stream.py: a language model that reads one contiguous token stream, on top of ddp_train.py.

The stream is the bytes of the standard library's Python files, one file after another. It is cut
into windows of CONTEXT + 1 tokens, and each window starts where the last one ended, so that every
byte is a target once in each pass. The training set is an IterableDataset, a stream, as webdataset
and HF datasets give. Rank r of W reads the windows r, r + W, r + 2W and so on. So a step of W
ranks reads the same windows as a step of one process with W times the batch, and both log the
same loss. The windows wrap around at the end of the stream, counted over all ranks, so the
stream never ends, and the run's one epoch is --max-steps steps. PASSES = 1 makes it end instead.

The stream's state_dict() holds how many windows this rank has read. Each checkpoint keeps it, so
a stopped run resumes at the next window, bit for bit. The eval set is map-style: the EVAL_SIZE
windows after the training windows. The model, its loss and the count of tokens are tinylm.py's.

    python stream.py --max-steps 300        # This needs ddp_train.py beside it, or PYTHONPATH=..
    torchrun --nproc_per_node=2 stream.py --batch-size 8
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset

import ddp_train
import tinylm

CONTEXT = 64  # A window has CONTEXT inputs and CONTEXT targets.
TRAIN_SIZE, EVAL_SIZE = 8192, 64  # These count windows, which are 512 KiB of bytes for training.
PASSES = 0  # The stream ends after this many passes. 0 repeats it forever.
DROPOUT = tinylm.DROPOUT


def read_stdlib(size):
    """Return the first `size` bytes of the standard library's .py files, as a LongTensor."""
    stdlib = os.path.dirname(os.__file__)
    data = bytearray()
    for name in sorted(os.listdir(stdlib)):
        if name.endswith(".py") and len(data) < size:
            with open(os.path.join(stdlib, name), "rb") as f:
                data += f.read()
    return torch.frombuffer(data[:size], dtype=torch.uint8).long()


class TokenStream(IterableDataset):
    """The training stream. read counts the windows that this rank has read, over all passes."""

    def __init__(self, tokens, passes):
        self.tokens, self.passes = tokens, passes
        self.windows = (len(tokens) - 1) // CONTEXT
        self.read = 0

    def __iter__(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        while True:
            window = rank + world_size * self.read  # This counts windows over all passes.
            if self.passes and window >= self.passes * self.windows:
                return
            start = (window % self.windows) * CONTEXT
            self.read += 1  # The count moves before the yield, so a checkpoint sees this window.
            yield self.tokens[start : start + CONTEXT + 1]

    def state_dict(self):
        return {"read": self.read}

    def load_state_dict(self, state):
        self.read = state["read"]


class Windows(Dataset):
    """The eval set, as windows that a DataLoader can index."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return (len(self.tokens) - 1) // CONTEXT

    def __getitem__(self, i):
        return self.tokens[i * CONTEXT : (i + 1) * CONTEXT + 1]


def add_task_flags(parser):
    parser.set_defaults(max_steps=300, batch_size=16, lr=3e-3, log_every=50, eval_every=100)


def build_datasets(args):
    # The constants are read now, not at import, so that a test may shrink them first.
    train_end = TRAIN_SIZE * CONTEXT
    tokens = read_stdlib(train_end + EVAL_SIZE * CONTEXT + 1)
    train_set = TokenStream(tokens[: train_end + 1], PASSES)
    return train_set, Windows(tokens[train_end:]) if EVAL_SIZE else None


def build_model(args):
    return tinylm.TinyLM(tinylm.DIM, tinylm.LAYERS, tinylm.HEADS, DROPOUT, CONTEXT)


def collate_fn(items, args, training):
    windows = torch.stack(items)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


ddp_train.add_task_flags, ddp_train.build_datasets = add_task_flags, build_datasets
ddp_train.collate_fn, ddp_train.build_model = collate_fn, build_model
ddp_train.compute_loss, ddp_train.count_items = tinylm.compute_loss, tinylm.count_items
ddp_train.COUNT_UNIT = "tokens"

if __name__ == "__main__":
    sys.exit(ddp_train.main())
