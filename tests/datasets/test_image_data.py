"""Tests for sample_data/images.py and loaders/images.py: a failure here means the
generated CIFAR-100 / ImageFolder data no longer match the real on-disk formats, are not reproducible
or not learnable, the md5 check accepts corrupted files (or refuses verified ones), the datasets yield
wrong tensors or labels, or a bad input ends in a traceback instead of a one-line UserError."""
import hashlib
import json
import pickle
import shutil
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from loaders.images import CIFAR100_MANIFEST, cifar100_files_verified, get_image_dataset, sample_shape
from sample_data.common import SampleDataError
from sample_data.images import (
    CIFAR100_COARSE_NAMES,
    CIFAR100_FINE_NAMES,
    FINE_TO_COARSE,
    SHAPES,
    add_cifar100_parser,
    add_imagefolder_parser,
    class_look,
    render_class,
    write_cifar100,
    write_imagefolder,
)
from utils.errors import ArgumentParser, UserError
from utils.YParams import YParams

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_PER_CLASS, TEST_PER_CLASS = 4, 2
IMAGEFOLDER_CLASSES = 3


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    return write_cifar100(tmp_path_factory.mktemp("cifar") / "data", train_per_class=TRAIN_PER_CLASS,
                          test_per_class=TEST_PER_CLASS, verbose=False)


@pytest.fixture(scope="module")
def imagefolder_root(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("imagefolder") / "data", num_classes=IMAGEFOLDER_CLASSES,
                             train_per_class=3, val_per_class=2, image_size=40, verbose=False)


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    """Every test fails if anything tries to download CIFAR-100."""

    def refuse(*args, **kwargs):
        raise AssertionError("tried to download")

    monkeypatch.setattr(torchvision.datasets.utils, "download_and_extract_archive", refuse)


def cifar_params(data_path, **overrides):
    params = YParams(REPO_ROOT / "config" / "ResNet50.yaml", "tiny")
    params.update({"data_path": str(data_path), **overrides})
    return params


def imagefolder_params(root, **overrides):
    params = YParams(REPO_ROOT / "config" / "ResNet50.yaml", "imagefolder_demo")
    params.update({"train_path": str(root / "train"), "val_path": str(root / "val"), **overrides})
    return params


def copy_cifar(cifar_root, tmp_path):
    shutil.copytree(cifar_root, tmp_path / "copy")
    return tmp_path / "copy", tmp_path / "copy" / "cifar-100-python"


def load_pickle(path, encoding):
    with open(path, "rb") as f:
        return pickle.load(f, encoding=encoding)


def test_cifar_files_have_the_real_pickle_format(cifar_root):
    """Failure: keys, dtypes, shapes or label names differ from the real cifar-100-python files
    (read with encoding='bytes' as on the CIFAR web page, and with 'latin1' as torchvision does)."""
    folder = cifar_root / "cifar-100-python"
    for split, per_class in (("train", TRAIN_PER_CLASS), ("test", TEST_PER_CLASS)):
        entry = load_pickle(folder / split, "bytes")
        assert set(entry) == {b"data", b"fine_labels", b"coarse_labels", b"filenames", b"batch_label"}
        n_images = 100 * per_class
        assert entry[b"data"].dtype == np.uint8 and entry[b"data"].shape == (n_images, 3072)
        assert np.bincount(entry[b"fine_labels"], minlength=100).tolist() == [per_class] * 100
        assert entry[b"coarse_labels"] == [FINE_TO_COARSE[CIFAR100_FINE_NAMES[i]] for i in entry[b"fine_labels"]]
        assert len(entry[b"filenames"]) == n_images and entry[b"filenames"][0].endswith(b".png")
        assert entry[b"batch_label"] == (b"training batch 1 of 1" if split == "train" else b"testing batch 1 of 1")
        assert sorted(load_pickle(folder / split, "latin1")) == ["batch_label", "coarse_labels", "data",
                                                                 "filenames", "fine_labels"]
    meta = load_pickle(folder / "meta", "bytes")
    assert len(meta[b"fine_label_names"]) == 100 and len(set(meta[b"fine_label_names"])) == 100
    assert meta[b"fine_label_names"][:3] == [b"apple", b"aquarium_fish", b"baby"]
    assert meta[b"fine_label_names"][-1] == b"worm"
    assert len(meta[b"coarse_label_names"]) == 20 and meta[b"coarse_label_names"][0] == b"aquatic_mammals"
    assert FINE_TO_COARSE["apple"] == CIFAR100_COARSE_NAMES.index("fruit_and_vegetables")


def test_cifar_dataset_yields_normalised_images_and_labels(cifar_root):
    """Failure: wrong image layout (CHW rows), wrong normalisation, labels out of range or not the
    file's fine labels, or augmentation that changes the image size."""
    params = cifar_params(cifar_root)
    valid = get_image_dataset(params, train=False)
    entry = load_pickle(cifar_root / "cifar-100-python" / "test", "bytes")
    assert len(valid) == 100 * TEST_PER_CLASS and valid.classes == CIFAR100_FINE_NAMES
    image, label = valid[5]
    expected = torch.tensor(entry[b"data"][5].reshape(3, 32, 32), dtype=torch.float32) / 255
    mean, std = torch.tensor(params.cifar100_mean), torch.tensor(params.cifar100_std)
    expected = (expected - mean[:, None, None]) / std[:, None, None]
    assert image.dtype == torch.float32 and image.shape == (3, 32, 32)
    torch.testing.assert_close(image, expected)
    assert label == entry[b"fine_labels"][5]

    train = get_image_dataset(params, train=True)
    assert len(train) == 100 * TRAIN_PER_CLASS
    labels = set()
    for index in range(0, len(train), 37):
        image, label = train[index]
        assert image.shape == (3, 32, 32) and torch.isfinite(image).all()
        labels.add(label)
    assert all(isinstance(label, int) and 0 <= label < 100 for label in labels)
    assert sample_shape(params) == (3, 32, 32)


def test_generated_files_pass_only_their_manifest_check(cifar_root, tmp_path, monkeypatch):
    """Failure: torchvision's own md5 check was weakened (it must still refuse generated files), or
    the manifest check accepts a folder without a manifest."""
    root, folder = copy_cifar(cifar_root, tmp_path)
    assert cifar100_files_verified(folder)
    with pytest.raises(RuntimeError, match="not found or corrupted"):
        torchvision.datasets.CIFAR100(root, train=False)  # torchvision itself, unchanged
    (folder / CIFAR100_MANIFEST).unlink()
    assert not cifar100_files_verified(folder)
    with pytest.raises(UserError, match="neither the official CIFAR-100 files nor sample data"):
        get_image_dataset(cifar_params(root), train=False)
    # the official path still decides on its own: files with "official" md5s need no manifest
    md5 = {name: hashlib.md5((folder / name).read_bytes()).hexdigest() for name in ("train", "test", "meta")}
    monkeypatch.setattr(torchvision.datasets.CIFAR100, "train_list", [["train", md5["train"]]])
    monkeypatch.setattr(torchvision.datasets.CIFAR100, "test_list", [["test", md5["test"]]])
    monkeypatch.setattr(torchvision.datasets.CIFAR100, "meta",
                        {"filename": "meta", "key": "fine_label_names", "md5": md5["meta"]})
    assert cifar100_files_verified(folder)
    assert len(get_image_dataset(cifar_params(root), train=False)) == 100 * TEST_PER_CLASS


@pytest.mark.parametrize("name", ["train", "test", "meta"])
def test_tampered_generated_file_is_refused(cifar_root, tmp_path, name):
    """Failure: a corrupted generated file is accepted because a manifest exists."""
    root, folder = copy_cifar(cifar_root, tmp_path)
    content = bytearray((folder / name).read_bytes())
    content[len(content) // 2] ^= 0xFF
    (folder / name).write_bytes(bytes(content))
    with pytest.raises(UserError, match="corrupted or edited"):
        get_image_dataset(cifar_params(root), train=(name == "train"))


def test_generator_is_deterministic_and_refuses_existing_data(tmp_path):
    """Failure: the same seed gives different bytes (irreproducible data), another seed the same
    bytes, or existing data is silently overwritten."""
    def generate(name, seed):
        write_cifar100(tmp_path / name, train_per_class=1, test_per_class=1, seed=seed, verbose=False)
        folder = tmp_path / name / "cifar-100-python"
        return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}

    first, again, other = generate("a", 0), generate("b", 0), generate("c", 1)
    assert sorted(first) == ["SAMPLE_DATA.json", "meta", "test", "train"]
    assert first == again
    assert first["train"] != other["train"]
    manifest = json.loads(first[CIFAR100_MANIFEST])
    assert manifest["md5"]["train"] == hashlib.md5(first["train"]).hexdigest()
    with pytest.raises(SampleDataError, match="--overwrite"):
        write_cifar100(tmp_path / "a", train_per_class=1, test_per_class=1, verbose=False)
    write_cifar100(tmp_path / "a", train_per_class=1, test_per_class=1, seed=1, overwrite=True, verbose=False)
    assert (tmp_path / "a" / "cifar-100-python" / "train").read_bytes() == other["train"]

    write_imagefolder(tmp_path / "f1", num_classes=2, train_per_class=1, val_per_class=1, image_size=16,
                      verbose=False)
    write_imagefolder(tmp_path / "f2", num_classes=2, train_per_class=1, val_per_class=1, image_size=16,
                      verbose=False)
    files = sorted(p.relative_to(tmp_path / "f1") for p in (tmp_path / "f1").rglob("*.png"))
    assert len(files) == 4
    assert all((tmp_path / "f1" / f).read_bytes() == (tmp_path / "f2" / f).read_bytes() for f in files)
    with pytest.raises(SampleDataError, match="--overwrite"):
        write_imagefolder(tmp_path / "f1", num_classes=2, verbose=False)


def test_shapes_are_learnable_at_32_pixels():
    """Failure: the ten shapes are not distinguishable (a small CNN, 200 steps, one colour only, must
    beat chance by far), so the sample data cannot teach anything beyond colour."""
    torch.manual_seed(0)
    red_classes = [c for c in range(100) if class_look(c)[1] == "red"]
    assert sorted(class_look(c)[0] for c in red_classes) == sorted(SHAPES)
    assert len({class_look(c) for c in range(100)}) == 100

    def images_and_labels(per_class, salt):
        images = np.concatenate([render_class(c, per_class, 32, np.random.default_rng([salt, c]))
                                 for c in red_classes])
        return torch.tensor(images, dtype=torch.float32) / 255 - 0.5, torch.arange(10).repeat_interleave(per_class)

    train_x, train_y = images_and_labels(40, 0)
    valid_x, valid_y = images_and_labels(10, 1)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(200):
        batch = torch.randint(0, len(train_y), (32,))
        loss = torch.nn.functional.cross_entropy(model(train_x[batch]), train_y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        accuracy = (model(valid_x).argmax(1) == valid_y).float().mean().item()
    assert accuracy > 0.4, f"shape accuracy {accuracy:.2f}, chance is 0.10"


def test_imagefolder_layout_and_transforms(imagefolder_root):
    """Failure: the folders are not the ImageNet layout ImageFolder reads, or the train/val
    transforms do not give img_size x img_size normalised tensors."""
    root = imagefolder_root
    class_names = ["_".join(class_look(c)) for c in range(IMAGEFOLDER_CLASSES)]
    for split, per_class in (("train", 3), ("val", 2)):
        assert sorted(p.name for p in (root / split).iterdir()) == sorted(class_names)
        for name in class_names:
            files = sorted((root / split / name).iterdir())
            assert len(files) == per_class and all(f.suffix == ".png" for f in files)
            with Image.open(files[0]) as image:
                assert image.mode == "RGB" and image.size == (40, 40)
    params = imagefolder_params(root)
    assert sample_shape(params) == (3, 32, 32)
    for train, n_images in ((True, 9), (False, 6)):
        dataset = get_image_dataset(params, train)
        assert len(dataset) == n_images and dataset.classes == sorted(class_names)
        image, label = dataset[n_images - 1]
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32
        assert label == IMAGEFOLDER_CLASSES - 1
        assert image.min() < -1.0 and image.max() > 1.0  # ImageNet-normalised, not in [0, 1]


def test_cifar100_and_imagefolder_subcommands_are_registered_like_era5(tmp_path):
    """Failure: the cifar100/imagefolder subcommands are not registered like `era5` (--out, sizes,
    set_defaults(run=...))."""
    parser = ArgumentParser()
    subparsers = parser.add_subparsers(dest="dataset", required=True)
    add_cifar100_parser(subparsers)
    add_imagefolder_parser(subparsers)
    args = parser.parse_args(["cifar100", "--out", str(tmp_path / "c"), "--train_per_class", "1",
                              "--test_per_class", "1", "--seed", "3"])
    assert args.run(args) == 0
    assert (tmp_path / "c" / "cifar-100-python" / CIFAR100_MANIFEST).is_file()
    args = parser.parse_args(["imagefolder", "--out", str(tmp_path / "f"), "--num_classes", "2",
                              "--train_per_class", "1", "--val_per_class", "1", "--image_size", "16"])
    assert args.run(args) == 0
    assert len(list((tmp_path / "f" / "val").rglob("*.png"))) == 2
    with pytest.raises(SampleDataError, match="--num_classes must be <= 100"):
        write_imagefolder(tmp_path / "g", num_classes=101)


def test_missing_cifar_data_is_one_line_naming_the_sample_data_command(tmp_path, monkeypatch):
    """Failure: absent CIFAR-100 data is not reported with the sample-data command, a download is
    attempted although the config or the caller forbids it, or a failed download is a traceback."""
    params = cifar_params(tmp_path / "absent")
    with pytest.raises(UserError, match=r"CIFAR-100 not found in '.*absent'; generate sample data with "
                                        r"`python -m sample_data cifar100 --out data/cifar100`"):
        get_image_dataset(params, train=True)
    params.download = True
    with pytest.raises(UserError, match="CIFAR-100 not found"):
        get_image_dataset(params, train=True, download_ok=False)  # not rank 0: never downloads

    def offline(url, root, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torchvision.datasets.utils, "download_and_extract_archive", offline)
    with pytest.raises(UserError, match="CIFAR-100 not found in .* downloading it failed .*no network"):
        get_image_dataset(params, train=True, download_ok=True)


def test_cifar_images_of_the_wrong_size_are_refused(cifar_root, tmp_path):
    """Failure: a file of 16x16 images (with a matching manifest) is reshaped into wrong 32x32 images."""
    root, folder = copy_cifar(cifar_root, tmp_path)
    small = {"data": np.zeros((8, 3 * 16 * 16), np.uint8), "fine_labels": [0] * 8, "coarse_labels": [4] * 8,
             "filenames": ["x.png"] * 8, "batch_label": "testing batch 1 of 1"}
    (folder / "test").write_bytes(pickle.dumps(small, protocol=2))
    manifest = json.loads((folder / CIFAR100_MANIFEST).read_text())
    manifest["md5"]["test"] = hashlib.md5((folder / "test").read_bytes()).hexdigest()
    (folder / CIFAR100_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"CIFAR file '.*test' has data of shape \(8, 768\): wrong image size"):
        get_image_dataset(cifar_params(root), train=False)


def test_labels_beyond_num_classes_are_refused(cifar_root, imagefolder_root):
    """Failure: labels >= num_classes reach the loss (a crash or silent garbage mid-training)."""
    with pytest.raises(UserError, match="has 100 classes but num_classes is 10; set num_classes: 100"):
        get_image_dataset(cifar_params(cifar_root, num_classes=10), train=False)
    with pytest.raises(UserError, match="has 3 classes but num_classes is 2"):
        get_image_dataset(imagefolder_params(imagefolder_root, num_classes=2), train=True)


def test_bad_image_folders_are_one_line_each(imagefolder_root, tmp_path):
    """Failure: a missing or empty image folder, mismatched class folders or an unknown dataset name
    end in a traceback (or silently wrong labels) instead of a UserError."""
    with pytest.raises(UserError, match="image folder '.*nowhere/train' does not exist; generate sample data"):
        get_image_dataset(imagefolder_params(tmp_path / "nowhere"), train=True)
    (tmp_path / "empty" / "train" / "some_class").mkdir(parents=True)
    with pytest.raises(UserError, match="holds no images in class folders"):
        get_image_dataset(imagefolder_params(tmp_path / "empty"), train=True)
    shutil.copytree(imagefolder_root, tmp_path / "fewer")
    shutil.rmtree(next((tmp_path / "fewer" / "val").iterdir()))
    with pytest.raises(UserError, match="class folders of .* differ from those of"):
        get_image_dataset(imagefolder_params(tmp_path / "fewer"), train=False)
    params = imagefolder_params(imagefolder_root, dataset="mnist")
    for function in (lambda: get_image_dataset(params, train=True), lambda: sample_shape(params)):
        with pytest.raises(UserError, match="dataset 'mnist' is not an image data set"):
            function()
