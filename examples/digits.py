"""digits.py: a user's own project on top of ddp_train.py, without editing ddp_train.py.

It replaces the task functions with its own: a map-style Dataset of 8x8 digit images that
augments every sample at random (with torch, Python's random and numpy), and a small CNN
with BatchNorm and Dropout. Then it hands them to ddp_train and calls its main(), so it
launches exactly like ddp_train.py itself:

    python digits.py                          # ddp_train.py beside it (here: PYTHONPATH=..)
    python digits.py --spawn 2
    torchrun --nproc_per_node=2 digits.py --epochs 5

Its runs keep ddp_train.py's guarantees: with --workers 0, where the augmentation draws from
each rank's own checkpointed generators, a stopped run resumes bit for bit; with DataLoader
workers it resumes with the same samples in the same order. 1437 samples: an epoch of full
global batches leaves a few out, as the header says.
"""

import random
import sys

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import Dataset, random_split

import ddp_train

# Digits 0-9 in a 5x7 bitmap font: the clean images every sample starts from.
GLYPHS = [
    "01110 10001 10011 10101 11001 10001 01110",
    "00100 01100 00100 00100 00100 00100 01110",
    "01110 10001 00001 00010 00100 01000 11111",
    "11111 00010 00100 00010 00001 10001 01110",
    "00010 00110 01010 10010 11111 00010 00010",
    "11111 10000 11110 00001 00001 10001 01110",
    "00110 01000 10000 11110 10001 10001 01110",
    "11111 00001 00010 00100 01000 01000 01000",
    "01110 10001 10001 01110 10001 10001 01110",
    "01110 10001 10001 01111 00001 00010 01100",
]
NUM_DIGITS, TRAIN_SIZE = 1797, 1437  # as many as scikit-learn's digits, and its usual 80% split


def render(label: int, gen: torch.Generator) -> torch.Tensor:
    """One 8x8 image of a digit: the glyph at a random place, with random stroke strength."""
    glyph = torch.tensor([[float(c) for c in row] for row in GLYPHS[label].split()])  # 7 x 5
    image = torch.zeros(8, 8)
    top, left = (
        torch.randint(0, 2, (1,), generator=gen).item(),
        torch.randint(0, 4, (1,), generator=gen).item(),
    )
    image[top : top + 7, left : left + 5] = glyph * (0.6 + 0.4 * torch.rand(1, generator=gen))
    return image


class Digits(Dataset):
    """Images and labels in memory; __getitem__ augments each image at random when training."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool):
        self.images, self.labels, self.augment = images, labels, augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = self.images[i]
        if self.augment:  # with Python's random, numpy and torch
            shift, scale = random.choice((-1, 0, 1)), float(np.random.uniform(0.8, 1.2))
            image = torch.roll(image, shifts=shift, dims=1) * scale
            image = image + 0.2 * torch.randn(8, 8)  # torch
        return image.unsqueeze(0), self.labels[i]


def build_datasets(args):
    gen = torch.Generator().manual_seed(1234)
    labels = torch.randint(0, 10, (NUM_DIGITS,), generator=gen)
    images = torch.stack([render(int(label), gen) for label in labels])
    # A split with no generator of its own, as most projects write it: ddp_train seeds first,
    # so every rank (and every resumed run) gets the same one.
    train_part, eval_part = random_split(range(NUM_DIGITS), [TRAIN_SIZE, NUM_DIGITS - TRAIN_SIZE])
    train_idx, eval_idx = list(train_part), list(eval_part)
    return (
        Digits(images[train_idx], labels[train_idx], augment=True),
        Digits(images[eval_idx], labels[eval_idx], augment=False),
    )


def build_model(args):
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(32 * 4 * 4, 10),
    )


# Hand the functions to ddp_train when this file is imported, not only when it runs as a script:
# --spawn's workers import it afresh and need them too.
ddp_train.build_datasets, ddp_train.build_model = build_datasets, build_model

if __name__ == "__main__":
    sys.exit(ddp_train.main())
