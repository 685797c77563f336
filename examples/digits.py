"""digits.py: a user's own project on top of ddp_train.py, without editing ddp_train.py.

It replaces four task functions with its own. Its Dataset holds 8x8 images of digits, and it
augments every sample at random with torch, Python's random and numpy. Its model is a small CNN
with BatchNorm and Dropout. Its evaluation logs a macro-F1 over the whole eval set. The file hands
these functions to ddp_train and calls its main(). So it launches exactly like ddp_train.py itself:

    python digits.py                          # This needs ddp_train.py beside it, or PYTHONPATH=..
    python digits.py --spawn 2
    torchrun --nproc_per_node=2 digits.py --epochs 5

Its runs keep ddp_train.py's guarantees. With --workers 0, the augmentation draws from each
rank's own generators, which the checkpoint saves. So a stopped run resumes bit for bit. With
DataLoader workers, a stopped run resumes with the same samples in the same order. The training
set has 1437 samples, so an epoch of full global batches leaves a few out. The run's first line
says how many.
"""

import random
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, random_split

import ddp_train

# These are the digits 0 to 9 in a 5x7 bitmap font. Every sample starts from one of them.
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
# These are as many images as scikit-learn's digits have, and its usual split of 80% for training.
NUM_DIGITS, TRAIN_SIZE = 1797, 1437


def render(label: int, gen: torch.Generator) -> torch.Tensor:
    """This draws one 8x8 image of a digit. Its place and its strength are random."""
    glyph = torch.tensor([[float(c) for c in row] for row in GLYPHS[label].split()])
    image = torch.zeros(8, 8)
    top, left = (
        torch.randint(0, 2, (1,), generator=gen).item(),
        torch.randint(0, 4, (1,), generator=gen).item(),
    )
    image[top : top + 7, left : left + 5] = glyph * (0.6 + 0.4 * torch.rand(1, generator=gen))
    return image


class Digits(Dataset):
    """This holds the images and labels in memory. __getitem__ augments each image when training."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool):
        self.images, self.labels, self.augment = images, labels, augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = self.images[i]
        if self.augment:  # It draws from Python's random, from numpy and from torch.
            shift, scale = random.choice((-1, 0, 1)), float(np.random.uniform(0.8, 1.2))
            image = torch.roll(image, shifts=shift, dims=1) * scale
            image = image + 0.2 * torch.randn(8, 8)
        return image.unsqueeze(0), self.labels[i]


def build_datasets(args):
    gen = torch.Generator().manual_seed(1234)
    labels = torch.randint(0, 10, (NUM_DIGITS,), generator=gen)
    images = torch.stack([render(int(label), gen) for label in labels])
    # Most projects write a split with no generator of its own, as here. ddp_train seeds the
    # random numbers first, so every rank and every resumed run gets the same split.
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


def compute_loss(model, batch, args):
    """In evaluation, the metrics are the accuracy and, for each class c, the shares of the batch
    that are true positives (tp_c), false positives (fp_c) and false negatives (fn_c) of c."""
    images, labels = batch
    logits = model(images).float()
    loss = F.cross_entropy(logits, labels)
    if model.training:
        return loss
    predicted = logits.argmax(dim=1)
    metrics = {"accuracy": (predicted == labels).float().mean()}
    for c in range(10):
        metrics[f"tp_{c}"] = ((predicted == c) & (labels == c)).float().mean()
        metrics[f"fp_{c}"] = ((predicted == c) & (labels != c)).float().mean()
        metrics[f"fn_{c}"] = ((predicted != c) & (labels == c)).float().mean()
    return loss, metrics


def eval_metrics(means, args):
    """The macro-F1 is the mean over the classes of 2 tp / (2 tp + fp + fn). The means over the
    whole eval set are its counts divided by its size, so they give the same ratio. A class that is
    neither labelled nor predicted has an F1 of 0. The shares themselves are not logged."""
    f1_scores = []
    for c in range(10):
        tp, fp, fn = means[f"tp_{c}"], means[f"fp_{c}"], means[f"fn_{c}"]
        f1_scores.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn > 0 else 0.0)
    macro_f1 = sum(f1_scores) / len(f1_scores)
    return {"loss": means["loss"], "accuracy": means["accuracy"], "macro_f1": macro_f1}


# The file hands its functions to ddp_train when it is imported, and not only when it runs as a
# script. The workers of --spawn import it afresh, and they need the functions too.
ddp_train.build_datasets = build_datasets
ddp_train.build_model = build_model
ddp_train.compute_loss = compute_loss
ddp_train.eval_metrics = eval_metrics

if __name__ == "__main__":
    sys.exit(ddp_train.main())
