"""tinylm.py: a small language model on top of ddp_train.py, without editing ddp_train.py.

A decoder-only transformer over bytes that learns to write Python functions. Its text ships with
every Python install: the standard library's own source files, one sample per function (its source,
dedented, cut at MAX_LEN bytes). Nothing is downloaded, and every rank builds the same samples.
It launches exactly like ddp_train.py itself:

    python tinylm.py --batch-size 16          # ddp_train.py beside it (here: PYTHONPATH=..)
    python tinylm.py --batch-size 16 --lr 3e-3   # learns faster in a run this short
    python tinylm.py --spawn 2 --batch-size 16
    torchrun --nproc_per_node=2 tinylm.py --epochs 5

Functions have different lengths, so it brings a fourth task function, collate_fn, which pads a
batch to its longest sample; and its compute_loss counts tokens, not samples: the logged loss is
the mean over real tokens, in nats per byte (ln 257 = 5.55 before training), whatever the padding,
the batch size or the world size. The sizes are module constants that a test or a notebook can
shrink before the run (tinylm.TRAIN_SIZE = 48). The samples depend on the Python version: every
node of a multi-node run needs the same one.
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

BOS, VOCAB = 256, 257  # token ids: the 256 byte values, then the begin-of-sequence marker
IGNORE = -100  # F.cross_entropy's default ignore_index: the target at a padding position
# functions: the first 3300 come from 83 files (__future__ to modulefinder)
TRAIN_SIZE, EVAL_SIZE = 3000, 300
EVAL_EVERY = 11  # every 11th function is held out for evaluation (3000 + 300 = 3300 = 300 * 11)
MIN_LEN, MAX_LEN = 16, 128  # bytes of source: shorter functions are skipped, longer ones cut
DIM, LAYERS, HEADS, DROPOUT = 64, 2, 4, 0.1


def stdlib_functions():
    """The source of every function (methods and nested ones too) of the standard library's
    top-level modules, in a fixed order: files by name, functions in source order."""
    stdlib = os.path.dirname(os.__file__)
    for name in sorted(os.listdir(stdlib)):
        if not name.endswith(".py"):
            continue
        try:
            with open(os.path.join(stdlib, name), encoding="utf-8") as f:
                source = f.read()
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue  # unreadable, or not Python that this interpreter parses
        # The lines as ast numbers them, in bytes as its column offsets count. (ast.get_source_segment
        # would do it, but it splits the whole file again for every function: a minute for 3300.)
        lines = source.encode().split(b"\n")
        functions = [
            node
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in sorted(
            functions, key=lambda node: (node.lineno, node.col_offset)
        ):  # walk() is breadth-first
            first, last = node.lineno - 1, node.end_lineno - 1
            # From the start of the def's line: a method keeps its indentation on every line, for dedent.
            text = b"\n".join(lines[first:last] + [lines[last][: node.end_col_offset]]).decode()
            yield textwrap.dedent(text)


class Functions(Dataset):
    """Samples kept as bytes (quick to pickle to DataLoader workers); an item is the 1-D LongTensor
    [BOS] + bytes. It draws no random numbers: the same sample every epoch."""

    def __init__(self, texts: list[bytes]):
        self.texts = texts

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return torch.tensor([BOS, *self.texts[i]])


def build_datasets(args):
    # No RNG for the split: every EVAL_EVERY-th function is held out, so every rank (and every run)
    # gets the same one. Files are read only until both sets are full (the whole stdlib takes ~5 s).
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


def collate_fn(items: list):
    """Pad to the longest item. The padding is IGNORE, so that it never counts as a target; in the
    inputs it becomes 0 (any id would do: causal attention keeps it from every real position, as
    the padding is on the right)."""
    tokens = pad_sequence(items, batch_first=True, padding_value=IGNORE)
    return {"inputs": tokens[:, :-1].clamp(min=0), "targets": tokens[:, 1:]}


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then an MLP, each on a residual."""

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
        # One matmul for q, k and v, split into heads: three tensors of shape (B, heads, L, D / heads).
        q, k, v = (
            self.qkv(self.ln1(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        )
        att = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(B, L, D)))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Token and learned position embeddings, the blocks, a final LayerNorm and an untied head. Every
    matmul is an nn.Linear, so that training costs 6 FLOPs per Linear weight per (padded) token,
    plus the attention."""

    def __init__(self, dim: int, layers: int, heads: int, dropout: float, max_len: int):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(max_len + 1, dim)  # any whole sample fits
        self.blocks = nn.Sequential(*(Block(dim, heads, dropout) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)
        # Small embeddings, as GPT-2's: Adam moves every weight by about the learning rate a step, which
        # barely changes torch's default N(0, 1) ones in a short run. (Loss after 3 epochs: 2.33 -> 2.14.)
        for embedding in (self.tok, self.pos):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.head(self.ln(self.blocks(x)))  # logits: (batch, length, VOCAB)


def build_model(args):
    # The constants are read now, not at import, so that a test may shrink them first.
    return TinyLM(DIM, LAYERS, HEADS, DROPOUT, MAX_LEN)


def compute_loss(model, batch):
    """The mean over the real target tokens (the padding is ignore_index), and their count: tensors, no .item(),
    which would wait for the GPU. ddp_train weighs each micro-batch's mean by its count, so that the gradient
    and the logged loss are the mean over every real token of the step on every rank."""
    targets = batch["targets"]
    logits = model(batch["inputs"]).float()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    real = targets != IGNORE
    accuracy = ((logits.argmax(dim=-1) == targets) & real).sum() / real.sum()
    return loss, real.sum(), {"accuracy": accuracy}


# Hand the functions to ddp_train when this file is imported, not only when it runs as a script:
# --spawn's workers import it afresh and need them too.
ddp_train.build_datasets, ddp_train.build_model = build_datasets, build_model
ddp_train.collate_fn, ddp_train.compute_loss = collate_fn, compute_loss
ddp_train.COUNT_UNIT = "tokens"

if __name__ == "__main__":
    sys.exit(ddp_train.main())
