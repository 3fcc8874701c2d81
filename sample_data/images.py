"""Write small, learnable image-classification data sets in the real on-disk formats.

`python -m sample_data cifar100 --out data/cifar100` writes `cifar-100-python/{train,test,meta}`,
the pickles torchvision.datasets.CIFAR100 reads; `python -m sample_data imagefolder --out DIR`
writes `DIR/{train,val}/<class>/*.png` for torchvision.datasets.ImageFolder.

Every class is one combination of a shape (10) and a colour (10), drawn with random position, size,
rotation, brightness and a noisy gradient background, so a small CNN learns it in minutes on a CPU.
"""

import hashlib
import io
import json
import os
import pickle
import shutil
import struct
import time
from pathlib import Path

import numpy as np
from PIL import Image

from sample_data.common import SampleDataError
from utils.atomic import write_bytes

# The 100 fine classes of CIFAR-100 in label order (meta[b'fine_label_names']).
CIFAR100_FINE_NAMES = [
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle",
    "bowl", "boy", "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle",
    "chair", "chimpanzee", "clock", "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur",
    "dolphin", "elephant", "flatfish", "forest", "fox", "girl", "hamster", "house", "kangaroo", "keyboard",
    "lamp", "lawn_mower", "leopard", "lion", "lizard", "lobster", "man", "maple_tree", "motorcycle", "mountain",
    "mouse", "mushroom", "oak_tree", "orange", "orchid", "otter", "palm_tree", "pear", "pickup_truck", "pine_tree",
    "plain", "plate", "poppy", "porcupine", "possum", "rabbit", "raccoon", "ray", "road", "rocket",
    "rose", "sea", "seal", "shark", "shrew", "skunk", "skyscraper", "snail", "snake", "spider",
    "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank", "telephone", "television", "tiger",
    "tractor", "train", "trout", "tulip", "turtle", "wardrobe", "whale", "willow_tree", "wolf", "woman", "worm",
]
# The 20 superclasses (meta[b'coarse_label_names'], in label order) and their five fine classes each.
CIFAR100_COARSE = {
    "aquatic_mammals": ["beaver", "dolphin", "otter", "seal", "whale"],
    "fish": ["aquarium_fish", "flatfish", "ray", "shark", "trout"],
    "flowers": ["orchid", "poppy", "rose", "sunflower", "tulip"],
    "food_containers": ["bottle", "bowl", "can", "cup", "plate"],
    "fruit_and_vegetables": ["apple", "mushroom", "orange", "pear", "sweet_pepper"],
    "household_electrical_devices": ["clock", "keyboard", "lamp", "telephone", "television"],
    "household_furniture": ["bed", "chair", "couch", "table", "wardrobe"],
    "insects": ["bee", "beetle", "butterfly", "caterpillar", "cockroach"],
    "large_carnivores": ["bear", "leopard", "lion", "tiger", "wolf"],
    "large_man-made_outdoor_things": ["bridge", "castle", "house", "road", "skyscraper"],
    "large_natural_outdoor_scenes": ["cloud", "forest", "mountain", "plain", "sea"],
    "large_omnivores_and_herbivores": ["camel", "cattle", "chimpanzee", "elephant", "kangaroo"],
    "medium_mammals": ["fox", "porcupine", "possum", "raccoon", "skunk"],
    "non-insect_invertebrates": ["crab", "lobster", "snail", "spider", "worm"],
    "people": ["baby", "boy", "girl", "man", "woman"],
    "reptiles": ["crocodile", "dinosaur", "lizard", "snake", "turtle"],
    "small_mammals": ["hamster", "mouse", "rabbit", "shrew", "squirrel"],
    "trees": ["maple_tree", "oak_tree", "palm_tree", "pine_tree", "willow_tree"],
    "vehicles_1": ["bicycle", "bus", "motorcycle", "pickup_truck", "train"],
    "vehicles_2": ["lawn_mower", "rocket", "streetcar", "tank", "tractor"],
}
CIFAR100_COARSE_NAMES = list(CIFAR100_COARSE)
FINE_TO_COARSE = {fine: coarse_index for coarse_index, members in enumerate(CIFAR100_COARSE.values())
                  for fine in members}

CIFAR100_FOLDER = "cifar-100-python"  # torchvision's CIFAR100.base_folder
CIFAR_SIZE = 32

SHAPES = ("disk", "ring", "square", "triangle", "hbar", "vbar", "plus", "cross", "dots", "stripes")
COLOURS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 230), "yellow": (235, 215, 40),
    "cyan": (40, 215, 225), "magenta": (215, 45, 200), "orange": (245, 135, 25), "purple": (115, 40, 150),
    "white": (250, 250, 250), "black": (10, 10, 10),
}
COLOUR_NAMES = list(COLOURS)
MAX_CLASSES = len(SHAPES) * len(COLOURS)
SUPERSAMPLE = 2  # masks are drawn at 2x resolution and averaged: anti-aliased edges


def class_look(class_index):
    """(shape, colour) of a class; the first 10 classes differ in both, all 100 are distinct."""
    shape = class_index % len(SHAPES)
    colour = (shape + class_index // len(SHAPES)) % len(COLOURS)
    return SHAPES[shape], COLOUR_NAMES[colour]


def _shape_mask(shape, u, v):
    """Boolean mask of `shape` in local coordinates (u right, v down, shape radius 1)."""
    r = np.hypot(u, v)
    box = np.maximum(np.abs(u), np.abs(v))
    if shape == "disk":
        return r < 0.9
    if shape == "ring":
        return (r > 0.55) & (r < 0.95)
    if shape == "square":
        return box < 0.75
    if shape == "triangle":  # apex up
        return (v < 0.65) & (np.abs(u) < 0.6 * (v + 0.9))
    if shape == "hbar":
        return (np.abs(u) < 0.95) & (np.abs(v) < 0.3)
    if shape == "vbar":
        return (np.abs(v) < 0.95) & (np.abs(u) < 0.3)
    if shape == "plus":
        return ((np.abs(u) < 0.28) & (np.abs(v) < 0.92)) | ((np.abs(v) < 0.28) & (np.abs(u) < 0.92))
    if shape == "cross":  # the plus turned by 45 degrees
        a, b = (u + v) / np.sqrt(2), (u - v) / np.sqrt(2)
        return ((np.abs(a) < 0.26) & (np.abs(b) < 0.95)) | ((np.abs(b) < 0.26) & (np.abs(a) < 0.95))
    if shape == "dots":  # four dots on a square
        return np.hypot(np.abs(u) - 0.55, np.abs(v) - 0.55) < 0.32
    if shape == "stripes":  # a square of three horizontal stripes
        return (box < 0.85) & (np.floor((v + 0.85) / 0.34) % 2 == 0)
    raise ValueError(f"unknown shape {shape}")


def render_class(class_index, n_images, size, rng):
    """n_images uint8 images (n, 3, size, size) of one class, each with its own jitter."""
    shape, colour = class_look(class_index)
    fine = size * SUPERSAMPLE
    coords = (np.arange(fine) + 0.5) / SUPERSAMPLE  # pixel units, supersampled
    y, x = coords[None, :, None], coords[None, None, :]

    # per-image jitter: centre, radius, rotation (small: plus and cross differ only by a 45-degree turn)
    centre_x = size * (0.5 + rng.uniform(-0.1, 0.1, n_images))[:, None, None]
    centre_y = size * (0.5 + rng.uniform(-0.1, 0.1, n_images))[:, None, None]
    radius = size * rng.uniform(0.3, 0.4, n_images)[:, None, None]
    angle = np.deg2rad(rng.uniform(-10.0, 10.0, n_images))[:, None, None]
    dx, dy = x - centre_x, y - centre_y
    u = (np.cos(angle) * dx + np.sin(angle) * dy) / radius
    v = (-np.sin(angle) * dx + np.cos(angle) * dy) / radius
    mask = _shape_mask(shape, u, v).astype(np.float32)
    alpha = mask.reshape(n_images, size, SUPERSAMPLE, size, SUPERSAMPLE).mean(axis=(2, 4))[:, None]

    # background: a gradient between two muted random colours, in a random direction
    grey = rng.uniform(60, 190, (n_images, 1, 1, 1))
    ends = 0.5 * grey + 0.5 * rng.uniform(40, 210, (2, n_images, 3, 1, 1))
    direction = rng.uniform(0, 2 * np.pi, (n_images, 1, 1, 1))
    pixel = (np.arange(size) + 0.5) / size - 0.5
    ramp = 0.5 + np.cos(direction) * pixel[None, None, None, :] + np.sin(direction) * pixel[None, None, :, None]
    background = ends[0] + (ends[1] - ends[0]) * ramp

    foreground = np.array(COLOURS[colour], dtype=np.float64)[None, :, None, None]
    foreground = foreground * rng.uniform(0.8, 1.1, (n_images, 1, 1, 1)) + rng.uniform(-15, 15, (n_images, 3, 1, 1))
    image = background * (1 - alpha) + foreground * alpha
    image += rng.normal(0.0, 8.0, image.shape)
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def _render_split(n_classes, per_class, size, seed, split_index):
    """All images of one split, in shuffled order: (images (N, 3, H, W) uint8, labels (N,))."""
    images, labels = [], []
    for class_index in range(n_classes):
        # one stream per (seed, split, class): a class's images do not depend on the other classes
        rng = np.random.default_rng([seed, split_index, class_index])
        images.append(render_class(class_index, per_class, size, rng))
        labels += [class_index] * per_class
    order = np.random.default_rng([seed, split_index]).permutation(len(labels))
    return np.concatenate(images)[order], np.asarray(labels)[order]


class _Python2Pickler(pickle._Pickler):
    """Writes bytes as Python 2 `str` (BINSTRING), as the real CIFAR files (pickled by Python 2) do.

    Read back with encoding='latin1' (torchvision) they are str keys, with encoding='bytes' (the CIFAR
    web page's recipe) bytes keys: both readers work. Python 3's C pickler cannot emit this opcode.
    """

    dispatch = pickle._Pickler.dispatch.copy()

    def save_python2_str(self, obj):
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_python2_str


def _python2_pickle(obj):
    buffer = io.BytesIO()
    _Python2Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def _check_counts(**counts):
    for name, value in counts.items():
        if value < 1:
            raise SampleDataError(f"--{name} must be >= 1, got {value}")


def write_cifar100(out_dir, train_per_class=50, test_per_class=10, seed=0, overwrite=False, verbose=True):
    """Write `out_dir/cifar-100-python/{train,test,meta}` in the format of the real CIFAR-100 pickles.

    Also writes `SAMPLE_DATA.json` with each file's md5 (the official md5s cannot match), which the
    loader checks instead. Raises SampleDataError on bad sizes or existing data (unless overwrite).
    Returns the folder that holds `cifar-100-python` (pass it as data_path).
    """
    # the reader owns the file names; imported here so `python -m sample_data` does not load torch
    from loaders.images import CIFAR100_FILES, CIFAR100_MANIFEST

    _check_counts(train_per_class=train_per_class, test_per_class=test_per_class)
    if seed < 0:
        raise SampleDataError(f"--seed must be >= 0, got {seed}")
    out_dir = Path(out_dir)
    folder = out_dir / CIFAR100_FOLDER
    existing = [name for name in (*CIFAR100_FILES, CIFAR100_MANIFEST) if (folder / name).exists()]
    if existing and not overwrite:
        raise SampleDataError(f"{folder} already holds CIFAR-100 files ({', '.join(existing)}); "
                              "pass --overwrite to replace them")
    folder.mkdir(parents=True, exist_ok=True)
    # drop the old manifest first: a half-overwritten folder then fails the loader's check
    (folder / CIFAR100_MANIFEST).unlink(missing_ok=True)

    start_time = time.perf_counter()
    md5 = {}
    splits = [("train", train_per_class, "training batch 1 of 1"), ("test", test_per_class, "testing batch 1 of 1")]
    for split_index, (name, per_class, batch_label) in enumerate(splits):
        images, labels = _render_split(len(CIFAR100_FINE_NAMES), per_class, CIFAR_SIZE, seed, split_index)
        fine_names = [CIFAR100_FINE_NAMES[label] for label in labels]
        content = {
            b"filenames": [f"{fine}_s_{i:06d}.png".encode() for i, fine in enumerate(fine_names)],
            b"batch_label": batch_label.encode(),
            b"fine_labels": labels.tolist(),
            b"coarse_labels": [FINE_TO_COARSE[fine] for fine in fine_names],
            b"data": images.reshape(len(labels), 3 * CIFAR_SIZE * CIFAR_SIZE),  # rows: R, G, B planes
        }
        data = _python2_pickle(content)
        write_bytes(folder / name, data)
        md5[name] = hashlib.md5(data).hexdigest()
        if verbose:
            print(f"[cifar100] {name}: {len(labels)} images, {len(data) / 1e6:.1f} MB", flush=True)

    meta = _python2_pickle({
        b"fine_label_names": [name.encode() for name in CIFAR100_FINE_NAMES],
        b"coarse_label_names": [name.encode() for name in CIFAR100_COARSE_NAMES],
    })
    write_bytes(folder / "meta", meta)
    md5["meta"] = hashlib.md5(meta).hexdigest()

    manifest = {"generator": "sample_data.images.write_cifar100", "seed": seed,
                "train_per_class": train_per_class, "test_per_class": test_per_class, "md5": md5}
    write_bytes(folder / CIFAR100_MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    if verbose:
        elapsed = time.perf_counter() - start_time
        print(f"[cifar100] wrote {folder} (100 classes) in {elapsed:.1f} s", flush=True)
    return out_dir


def write_imagefolder(out_dir, num_classes=10, train_per_class=20, val_per_class=5, image_size=64, seed=0,
                      overwrite=False, verbose=True):
    """Write `out_dir/{train,val}/<class>/<class>_<i>.png` (RGB PNG), the layout of ImageNet for ImageFolder.

    Class folders are named `<shape>_<colour>`. Raises SampleDataError on bad sizes or existing data
    (unless overwrite). Returns out_dir as a Path.
    """
    _check_counts(num_classes=num_classes, train_per_class=train_per_class, val_per_class=val_per_class)
    if num_classes > MAX_CLASSES:
        raise SampleDataError(f"--num_classes must be <= {MAX_CLASSES} (shape x colour combinations), "
                              f"got {num_classes}")
    if image_size < 16:
        raise SampleDataError(f"--image_size must be >= 16, got {image_size}")
    if seed < 0:
        raise SampleDataError(f"--seed must be >= 0, got {seed}")
    out_dir = Path(out_dir)
    splits = [("train", train_per_class), ("val", val_per_class)]
    existing = [name for name, _ in splits if (out_dir / name).exists()]
    if existing and not overwrite:
        raise SampleDataError(f"{out_dir} already holds {' and '.join(existing)}; pass --overwrite to replace them")

    start_time = time.perf_counter()
    class_names = ["_".join(class_look(class_index)) for class_index in range(num_classes)]
    for split_index, (split, per_class) in enumerate(splits):
        # build the split in a hidden folder and rename it: a crash never leaves a partial split
        tmp_dir = out_dir / f".{split}.tmp"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        for class_index, class_name in enumerate(class_names):
            rng = np.random.default_rng([seed, split_index, class_index])
            images = render_class(class_index, per_class, image_size, rng)
            (tmp_dir / class_name).mkdir(parents=True)
            for i, image in enumerate(images):
                Image.fromarray(image.transpose(1, 2, 0)).save(tmp_dir / class_name / f"{class_name}_{i:05d}.png")
        shutil.rmtree(out_dir / split, ignore_errors=True)
        # a whole folder, so a rename rather than utils.atomic (which writes single files)
        os.replace(tmp_dir, out_dir / split)
        if verbose:
            print(f"[imagefolder] {split}: {num_classes} classes x {per_class} images of "
                  f"{image_size} x {image_size}", flush=True)
    if verbose:
        elapsed = time.perf_counter() - start_time
        print(f"[imagefolder] wrote {out_dir} in {elapsed:.1f} s", flush=True)
    return out_dir


def _run_cifar100(args):
    write_cifar100(args.out, train_per_class=args.train_per_class, test_per_class=args.test_per_class,
                   seed=args.seed, overwrite=args.overwrite)
    return 0


def _run_imagefolder(args):
    write_imagefolder(args.out, num_classes=args.num_classes, train_per_class=args.train_per_class,
                      val_per_class=args.val_per_class, image_size=args.image_size, seed=args.seed,
                      overwrite=args.overwrite)
    return 0


def add_cifar100_parser(subparsers):
    """Register the `cifar100` subcommand."""
    parser = subparsers.add_parser(
        "cifar100", help="synthetic CIFAR-100 (cifar-100-python/{train,test,meta}, torchvision's format)",
        description="Write CIFAR-100 pickles with learnable content: each of the 100 classes is one "
                    "shape x colour combination. Train with --data_dir set to --out.",
    )
    parser.add_argument("--out", required=True, help="output folder (cifar-100-python/ is created inside)")
    parser.add_argument("--train_per_class", type=int, default=50, help="training images per class (default 50)")
    parser.add_argument("--test_per_class", type=int, default=10, help="test images per class (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace existing CIFAR-100 files in --out")
    parser.set_defaults(run=_run_cifar100)


def add_imagefolder_parser(subparsers):
    """Register the `imagefolder` subcommand."""
    parser = subparsers.add_parser(
        "imagefolder", help="synthetic ImageNet-style folders (train/<class>/*.png, val/<class>/*.png)",
        description="Write class folders of PNG images for torchvision's ImageFolder; each class is one "
                    "shape x colour combination.",
    )
    parser.add_argument("--out", required=True, help="output folder (train/ and val/ are created inside)")
    parser.add_argument("--num_classes", type=int, default=10, help=f"at most {MAX_CLASSES} (default 10)")
    parser.add_argument("--train_per_class", type=int, default=20, help="training images per class (default 20)")
    parser.add_argument("--val_per_class", type=int, default=5, help="validation images per class (default 5)")
    parser.add_argument("--image_size", type=int, default=64, help="height = width in pixels (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace existing train/ and val/ in --out")
    parser.set_defaults(run=_run_imagefolder)
