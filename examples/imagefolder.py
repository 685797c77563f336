"""imagefolder.py: a ResNet on a folder of images, one folder per class, on top of ddp_train.py.

It is modelled on torchvision's reference classification recipe. SGD with momentum takes a
learning rate that scales with the global batch. The rate warms up over --warmup-epochs, in place
of --warmup-steps, and then follows a cosine. The loss smooths its labels, mixup mixes the
training batches, an EMA of the weights is evaluated and saved beside the model, and the model and
the batches are channels_last. It differs from the recipe in a few places. Its augmentation is a
random flip and a crop after a padding of 2 pixels, not RandomResizedCrop, so the images must have
their final size. Its EMA decays by --ema-decay at every step, and the default of 0.95 suits the
short runs here. A run of many thousand steps takes 0.9999 or so. It launches exactly like
ddp_train.py itself:

    python imagefolder.py --data DIR          # This needs ddp_train.py beside it, or PYTHONPATH=..
    torchrun --nproc_per_node=8 imagefolder.py --data DIR --arch resnet50 --workers 8
    python imagefolder.py                     # This first makes a small folder of its own.

DIR holds train/CLASS/FILE and val/CLASS/FILE, the layout of torchvision's ImageFolder. A file is
an 8-bit JPEG or PNG, which needs torchvision, or a uint8 tensor of shape (3, H, W) that torch.save
wrote. All the images of train/ have one size, and so do all the images of val/, so resize them
once before training. The default --data is out/imagefolder-data. If it is missing, each process
makes a small folder of 16x16 tensors and moves it there, and the first one to arrive is kept.
Without torchvision, the file reads the layout itself, and --arch small, a ResNet in this file, is
the only model.

With --workers 0, the augmentation and mixup draw from torch's generator of each rank, which the
checkpoint saves. So a stopped run resumes bit for bit. With DataLoader workers, a stopped run
resumes with the same samples in the same order, and with other draws. On GPUs,
--cudnn-benchmark is faster, and a run with it is not bit for bit the same twice.
"""

import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import Dataset

import ddp_train

try:
    import torchvision
except ImportError:  # torchvision's wheel needs the torch that it was built for.
    torchvision = None

SYNTHETIC_DATA = "out/imagefolder-data"
# These are the means and deviations of ImageNet's channels, on a scale of 0 to 1.
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def add_task_flags(parser):
    parser.add_argument("--data", default=SYNTHETIC_DATA, help="a folder with train/ and val/")
    parser.add_argument("--arch", default="small", help="small, or a torchvision model's name")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    parser.add_argument("--warmup-epochs", type=float, default=1.0, help="epochs of warmup")
    parser.add_argument("--label-smoothing", type=float, default=0.1, help="the labels' share")
    parser.add_argument("--mixup-alpha", type=float, default=0.2, help="Beta's alpha (0: off)")
    parser.add_argument("--ema-decay", type=float, default=0.95, help="per step (0: no EMA)")
    parser.add_argument("--cudnn-benchmark", action="store_true", help="faster, not bit-exact")
    # The rate is per 256 samples of the global batch. SGD decays the weights of 2 or more
    # dimensions, which are the kernels of the convolutions and the matrices of the linear layers.
    parser.set_defaults(lr=0.1, weight_decay=1e-4, batch_size=32)


def is_image(path):
    return path.lower().endswith((".pt", ".jpg", ".jpeg", ".png"))


def read_image(path):
    """Return the image in the file as a uint8 tensor of shape (3, H, W)."""
    if path.lower().endswith(".pt"):
        image = torch.load(path, weights_only=True)
    else:
        ddp_train.check(torchvision is not None, f"{path}: JPEG and PNG files need torchvision")
        data = torchvision.io.read_file(path)
        image = torchvision.io.decode_image(data, mode=torchvision.io.ImageReadMode.RGB)
    ddp_train.check(image.dtype == torch.uint8, f"{path} is {image.dtype}, not 8 bits a channel")
    return image


def list_images(root):
    """Return [(path, class index)] and the class names of the folder. The classes are sorted by
    name, as torchvision's ImageFolder sorts them."""
    if torchvision is not None:
        folder = torchvision.datasets.ImageFolder(root, loader=read_image, is_valid_file=is_image)
        return folder.samples, folder.classes
    classes = class_names(root)
    samples = []
    for index, name in enumerate(classes):
        files = sorted(os.listdir(os.path.join(root, name)))
        samples += [(os.path.join(root, name, file), index) for file in files if is_image(file)]
    return samples, classes


def class_names(root):
    """Return the names of the class folders, sorted as torchvision's ImageFolder sorts them."""
    ddp_train.check(os.path.isdir(root), f"--data has no folder {root}")
    return sorted(entry.name for entry in os.scandir(root) if entry.is_dir())


class ImageFiles(Dataset):
    """The images of a folder, as normalised float tensors. A training image is flipped and cropped
    at random, with draws from torch's generator, which ddp_train seeds for each rank."""

    def __init__(self, root, augment):
        self.samples, self.classes = list_images(root)
        self.augment = augment

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        image = read_image(path).float() / 255
        if self.augment:
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
            height, width = image.shape[1:]
            padded = F.pad(image, (2, 2, 2, 2), mode="reflect")
            top, left = torch.randint(0, 5, (2,)).tolist()
            image = padded[:, top : top + height, left : left + width]
        return (image - MEAN) / STD, label


def make_synthetic_data(root, seed, classes=10, train_per_class=48, val_per_class=12):
    """Write a small folder of 16x16 images. Each class has a colour of its own, and each image
    adds noise to it. Two runs, or two nodes, may make it at once. So each process writes a folder
    of its own and then moves it to root. The folders are the same, and the first one is kept."""
    generator = torch.Generator().manual_seed(seed)
    colours = torch.rand(classes, 3, 1, 1, generator=generator)
    os.makedirs(os.path.dirname(root), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=os.path.basename(root) + ".", dir=os.path.dirname(root))
    for split, count in ("train", train_per_class), ("val", val_per_class):
        for c in range(classes):
            os.makedirs(f"{staging}/{split}/class{c}")
            for n in range(count):
                noise = 0.25 * torch.randn(3, 16, 16, generator=generator)
                image = ((colours[c] + noise).clamp(0, 1) * 255).to(torch.uint8)
                torch.save(image, f"{staging}/{split}/class{c}/{n:04d}.pt")
    try:
        os.rename(staging, root)
    except OSError:
        shutil.rmtree(staging)
        if not os.path.isdir(root):  # Only a folder that another process made may be there.
            raise


def build_datasets(args):
    # The local rank 0 of each node makes the small folder where it is missing, as the README's
    # cached.py makes its data. The other ranks of the node wait for it.
    if args.data == SYNTHETIC_DATA:
        if args.local_rank == 0 and not os.path.isdir(args.data):
            make_synthetic_data(args.data, seed=1234)
        while not os.path.isdir(args.data):
            time.sleep(0.1)
    train_set = ImageFiles(os.path.join(args.data, "train"), augment=True)
    eval_set = ImageFiles(os.path.join(args.data, "val"), augment=False)
    ddp_train.check(train_set.classes == eval_set.classes, "train/ and val/ have other classes")
    return train_set, eval_set


class Block(nn.Module):
    """A residual block of two 3x3 convolutions, as in ResNet-18."""

    def __init__(self, inputs, outputs, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def build_model(args):
    classes = len(class_names(os.path.join(args.data, "train")))
    if args.arch == "small":
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            Block(16, 16, stride=1),
            Block(16, 32, stride=2),
            Block(32, 64, stride=2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, classes),
        )
    else:
        ddp_train.check(torchvision is not None, f"--arch {args.arch} needs torchvision")
        model = torchvision.models.get_model(args.arch, num_classes=classes)
    return model.to(memory_format=torch.channels_last)


def collate_fn(items, args, training):
    """Return (images, labels, share). The images are channels_last. Mixup mixes each training
    batch with the batch in reverse order, at a share from Beta(alpha, alpha), and the loss mixes
    its two targets at the same share. An eval batch has a share of 1, so it is not mixed."""
    images = torch.stack([image for image, _ in items])
    images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.tensor([label for _, label in items])
    share = 1.0
    if training and args.mixup_alpha > 0:
        share = float(torch.distributions.Beta(args.mixup_alpha, args.mixup_alpha).sample())
        images = share * images + (1 - share) * images.flip(0)
    return images, labels, share


def count_items(batch):
    images, labels, share = batch
    return len(labels)


def compute_loss(model, batch, args):
    """The loss with mixed images is the same mix of the losses of both labels. In evaluation, the
    share is 1, and the accuracy is logged too."""
    images, labels, share = batch
    logits = model(images).float()
    smoothing = args.label_smoothing
    loss = share * F.cross_entropy(logits, labels, label_smoothing=smoothing)
    loss = loss + (1 - share) * F.cross_entropy(logits, labels.flip(0), label_smoothing=smoothing)
    if model.training:
        return loss
    return loss, {"accuracy": (logits.argmax(dim=1) == labels).float().mean()}


def configure_torch(args):
    # cuDNN times the convolutions of each shape and picks the fastest. The images all have the
    # same shape, so this pays. The fastest may differ from run to run, and so may the results.
    torch.backends.cudnn.benchmark = args.cudnn_benchmark


def build_optimizer(args, model, plan):
    """SGD with momentum, at --lr per 256 samples of the global batch. A resume on another world
    size keeps the global batch, and so the rate. Biases and BatchNorm's weights do not decay, as
    with the recipe's --norm-weight-decay 0."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    lr = args.lr * plan.global_batch / 256
    return torch.optim.SGD(groups, lr=lr, momentum=args.momentum)


def build_scheduler(args, optimizer, plan):
    """A linear warmup over --warmup-epochs, then a cosine to 0. It steps after each step, and the
    warmup counts its steps from plan.steps_per_epoch, so it lasts as many epochs on any world
    size."""
    warmup_steps = max(1, round(args.warmup_epochs * plan.steps_per_epoch))
    decay_steps = max(1, plan.total_steps - warmup_steps)

    def lr_factor(step):  # The step argument counts the optimizer steps done before this one.
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return (1 + math.cos(math.pi * (step - warmup_steps) / decay_steps)) / 2

    return LambdaLR(optimizer, lr_factor)


def build_averaged_models(args, model):
    """An EMA of the weights and of BatchNorm's statistics. It is logged as eval_ema_loss and saved
    as ema.pt."""
    if args.ema_decay == 0:
        return {}
    average = get_ema_multi_avg_fn(args.ema_decay)
    return {"ema": AveragedModel(model, multi_avg_fn=average, use_buffers=True)}


# The file hands its functions to ddp_train when it is imported, and not only when it runs as a
# script. The workers of --spawn import it afresh, and they need the functions too.
ddp_train.add_task_flags, ddp_train.configure_torch = add_task_flags, configure_torch
ddp_train.build_datasets, ddp_train.build_model = build_datasets, build_model
ddp_train.collate_fn, ddp_train.count_items = collate_fn, count_items
ddp_train.compute_loss, ddp_train.build_optimizer = compute_loss, build_optimizer
ddp_train.build_scheduler, ddp_train.build_averaged_models = build_scheduler, build_averaged_models

if __name__ == "__main__":
    sys.exit(ddp_train.main())
