"""tinylm.py: a small language model on top of ddp_train.py, without editing ddp_train.py.

This is a decoder-only transformer over bytes, and it learns to write Python functions. Its text
ships with every Python install, because it is the source of the standard library. Each function
is one sample. The sample is the function's source, dedented and cut at MAX_LEN bytes. Nothing is
downloaded, and every rank builds the same samples. It launches exactly like ddp_train.py itself:

    python tinylm.py --batch-size 16          # This needs ddp_train.py beside it, or PYTHONPATH=..
    python tinylm.py --batch-size 16 --lr 3e-3   # This learns faster in a run this short.
    python tinylm.py --spawn 2 --batch-size 16
    torchrun --nproc_per_node=2 tinylm.py --epochs 5

Functions have different lengths. So the file brings a fourth task function, collate_fn, which
pads a batch to its longest sample. Its count_items counts tokens, not samples, and its
compute_loss returns the mean over those tokens. The logged loss is the mean over the real tokens,
in nats per byte, whatever the padding, the batch size or the world size. Before training, it is
ln 257 = 5.55. The sizes are module constants, and a test or a notebook can make them smaller
before the run, for example with tinylm.TRAIN_SIZE = 48. The samples depend on the version of
Python, so every node of a multi-node run needs the same version.
"""

import ast
import os
import sys
import textwrap

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

import ddp_train

# The token ids are the 256 byte values, and then the marker for the beginning of a sequence.
BOS, VOCAB = 256, 257
# IGNORE is F.cross_entropy's default ignore_index. A padding position has it as its target.
IGNORE = -100
# The first 3300 functions come from 83 files, from __future__ to modulefinder.
TRAIN_SIZE, EVAL_SIZE = 3000, 300
EVAL_EVERY = 11  # Every 11th function is held out for evaluation, as 3000 + 300 = 300 * 11.
# These are lengths in bytes of source. Shorter functions are skipped, and longer ones are cut.
MIN_LEN, MAX_LEN = 16, 128
DIM, LAYERS, HEADS, DROPOUT = 64, 2, 4, 0.1


def stdlib_functions():
    """This yields the source of every function in the standard library's top-level modules.
    Methods and nested functions count too. The files come by name, and the functions in the order
    of the source."""
    stdlib = os.path.dirname(os.__file__)
    for name in sorted(os.listdir(stdlib)):
        if not name.endswith(".py"):
            continue
        try:
            with open(os.path.join(stdlib, name), encoding="utf-8") as f:
                source = f.read()
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue  # The file cannot be read, or this interpreter cannot parse it.
        # These are the lines as ast numbers them, in bytes, as ast's column offsets count.
        # ast.get_source_segment would do the same, but it splits the whole file again for every
        # function, and that takes a minute for 3300 functions.
        lines = source.encode().split(b"\n")
        functions = [
            node
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        # The sort puts the functions in the order of the source, as ast.walk() is breadth-first.
        for node in sorted(functions, key=lambda node: (node.lineno, node.col_offset)):
            first, last = node.lineno - 1, node.end_lineno - 1
            # The text starts at the start of the def's line. Then a method keeps its indentation on
            # every line, and dedent removes it.
            text = b"\n".join(lines[first:last] + [lines[last][: node.end_col_offset]]).decode()
            yield textwrap.dedent(text)


class Functions(Dataset):
    """The samples are kept as bytes, which are quick to pickle to DataLoader workers. An item is
    the 1-D LongTensor [BOS] + bytes. It draws no random numbers, so it gives the same sample every
    epoch."""

    def __init__(self, texts: list[bytes]):
        self.texts = texts

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return torch.tensor([BOS, *self.texts[i]])


def build_datasets(args):
    # The split uses no random numbers. Every EVAL_EVERY-th function is held out, so every rank and
    # every run gets the same split. The files are read only until both sets are full, because the
    # whole standard library takes about 5 s.
    train, held_out = [], []
    kept = (text.encode()[:MAX_LEN] for text in stdlib_functions())
    for i, text in enumerate(t for t in kept if len(t) >= MIN_LEN):
        if len(held_out) < EVAL_SIZE and (
            i % EVAL_EVERY == EVAL_EVERY - 1 or len(train) == TRAIN_SIZE
        ):
            held_out.append(text)
        elif len(train) < TRAIN_SIZE:
            train.append(text)
        else:
            break
    return Functions(train), Functions(held_out) if held_out else None


def collate_fn(items: list, args, training: bool):
    """This pads the items to the longest one. The padding is IGNORE, so that it never counts as a
    target. In the inputs, it becomes 0. Any id would do, because the padding is on the right, and
    causal attention keeps it away from every real position."""
    tokens = pad_sequence(items, batch_first=True, padding_value=IGNORE)
    return {"inputs": tokens[:, :-1].clamp(min=0), "targets": tokens[:, 1:]}


class Block(nn.Module):
    """This is a pre-LayerNorm transformer block. Causal self-attention comes first, and then an
    MLP. Each of them adds to the residual."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.qkv, self.proj = (
            nn.LayerNorm(dim),
            nn.Linear(dim, 3 * dim),
            nn.Linear(dim, dim),
        )
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        B, L, D = x.shape
        # One matmul makes q, k and v. Each is split into heads, to shape (B, heads, L, D / heads).
        q, k, v = (
            self.qkv(self.ln1(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        )
        att = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(B, L, D)))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """The model has token and learned position embeddings, the blocks, a final LayerNorm and an
    untied head. Every matmul is an nn.Linear. So training costs 6 FLOPs per Linear weight for each
    token, padding included, and the attention adds to that."""

    def __init__(self, dim: int, layers: int, heads: int, dropout: float, max_len: int):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(max_len + 1, dim)  # Any whole sample fits.
        self.blocks = nn.Sequential(*(Block(dim, heads, dropout) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)
        # The embeddings start small, as GPT-2's do. Adam moves every weight by about the learning
        # rate in each step, and in a short run that barely changes torch's default of N(0, 1). With
        # this small start, the loss after 3 epochs is 2.14 instead of 2.33.
        for embedding in (self.tok, self.pos):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.head(self.ln(self.blocks(x)))  # The logits have shape (batch, length, VOCAB).


def build_model(args):
    # The constants are read now, not at import, so that a test may shrink them first.
    return TinyLM(DIM, LAYERS, HEADS, DROPOUT, MAX_LEN)


def count_items(batch):
    """This counts the real target tokens of a batch on the CPU. The padding is IGNORE, so it does
    not count."""
    return int((batch["targets"] != IGNORE).sum())


def compute_loss(model, batch, args):
    """This returns the mean loss over the real target tokens, and their accuracy. ddp_train
    multiplies each micro-batch's mean by its count. So the gradient and the logged loss are the
    mean over every real token of the step, on every rank."""
    targets = batch["targets"]
    logits = model(batch["inputs"]).float()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    real = targets != IGNORE
    accuracy = ((logits.argmax(dim=-1) == targets) & real).sum() / real.sum()
    return loss, {"accuracy": accuracy}


# The file hands its functions to ddp_train when it is imported, and not only when it runs as a
# script. The workers of --spawn import it afresh, and they need the functions too.
ddp_train.build_datasets, ddp_train.build_model = build_datasets, build_model
ddp_train.collate_fn, ddp_train.compute_loss = collate_fn, compute_loss
ddp_train.count_items, ddp_train.COUNT_UNIT = count_items, "tokens"

if __name__ == "__main__":
    sys.exit(ddp_train.main())
