"""CIFAR-100's pickles load as data, never as code (loaders/images.load_cifar_pickle).

A CIFAR file is a Python pickle, and a pickle may name any function to call while it loads. The loader accepts a
folder whose md5s match its SAMPLE_DATA.json, so whoever can write the folder can rewrite the manifest too: the md5
check says nothing about what a file runs. Here a crafted `test` file (a valid CIFAR dict plus an object whose
unpickling creates a file) with its manifest rewritten is refused in one line and creates nothing; its twin reads it
with Python's plain unpickler, as torchvision does, and the file appears. The real format (Python 2's pickles, and
Python 3's protocol 2, whose bytes go through `_codecs.encode`) still loads. A failure points to loaders/images.py.
"""
import hashlib
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torchvision

import loaders.images
from loaders.images import CIFAR100_MANIFEST, get_image_dataset, load_cifar_pickle
from sample_data.images import write_cifar100
from tests.conftest import REPO_ROOT
from utils.errors import UserError
from utils.YParams import YParams

pytestmark = [pytest.mark.compat]


class CreatesAFile:
    """Unpickled, it opens `path` for writing: what a crafted pickle could do with os.system instead."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    return Path(write_cifar100(tmp_path_factory.mktemp("cifar") / "data", train_per_class=2, test_per_class=1,
                               verbose=False))


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tried to download")

    monkeypatch.setattr(torchvision.datasets.utils, "download_and_extract_archive", refuse)


def crafted_folder(cifar_root, tmp_path, marker):
    """A copy of the sample data whose `test` file also holds CreatesAFile(marker), its md5 in the manifest."""
    root = tmp_path / "copy"
    shutil.copytree(cifar_root, root)
    folder = root / "cifar-100-python"
    entry = {"data": np.zeros((4, 3 * 32 * 32), np.uint8), "fine_labels": [0, 1, 2, 3], "coarse_labels": [0] * 4,
             "filenames": ["x.png"] * 4, "batch_label": "testing batch 1 of 1", "note": CreatesAFile(marker)}
    (folder / "test").write_bytes(pickle.dumps(entry, protocol=2))
    manifest = json.loads((folder / CIFAR100_MANIFEST).read_text())
    manifest["md5"]["test"] = hashlib.md5((folder / "test").read_bytes()).hexdigest()
    (folder / CIFAR100_MANIFEST).write_text(json.dumps(manifest))
    return root


def params_for(root):
    params = YParams(Path(REPO_ROOT) / "config" / "ResNet50.yaml", "tiny")
    params.update({"data_path": str(root)})
    return params


def test_a_crafted_file_with_its_manifest_rewritten_runs_nothing(cifar_root, tmp_path):
    marker = tmp_path / "ran"
    root = crafted_folder(cifar_root, tmp_path, marker)
    with pytest.raises(UserError, match=r"CIFAR file '.*test' is not data: its pickle calls 'io.open' as it "
                                        r"loads .*so it was not loaded; delete the folder"):
        get_image_dataset(params_for(root), train=False)
    assert not marker.exists()


def test_twin_read_with_the_plain_unpickler_the_crafted_file_runs(cifar_root, tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    root = crafted_folder(cifar_root, tmp_path, marker)
    monkeypatch.setattr(loaders.images, "_DataOnly", pickle.Unpickler)
    get_image_dataset(params_for(root), train=False)
    assert marker.exists()


def test_the_real_formats_still_load(cifar_root, tmp_path):
    """The sample data (Python 2's str opcodes, as the real files) and a Python 3 protocol-2 file (its array bytes
    through _codecs.encode) both load, with their arrays and labels."""
    folder = cifar_root / "cifar-100-python"
    entry = load_cifar_pickle(folder / "train")
    assert entry["data"].dtype == np.uint8 and entry["data"].shape == (200, 3 * 32 * 32)
    assert len(entry["fine_labels"]) == 200 and len(load_cifar_pickle(folder / "meta")["fine_label_names"]) == 100
    python3 = tmp_path / "python3"
    data = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    python3.write_bytes(pickle.dumps({"data": data, "fine_labels": [5, 7]}, protocol=2))
    read = load_cifar_pickle(python3)
    assert np.array_equal(read["data"], data) and read["fine_labels"] == [5, 7]
    assert len(get_image_dataset(params_for(cifar_root), train=False)) == 100
