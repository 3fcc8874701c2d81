"""Image-classification datasets: CIFAR-100 (torchvision's pickles) and ImageFolder (ImageNet layout).

CIFAR-100's files are Python pickles, and a pickle can name any function to call while it loads. They are read
here as data only (load_cifar_pickle): the unpickler accepts the few globals a CIFAR file holds (numpy's array
reconstruction) and refuses any other in one line, whatever the md5s in the folder's manifest say.

`image_loader` wraps them in the PyTorch loader every data set shares (loaders/common.py: a DataLoader over the
resumable DistributedSampler).
"""
import json
import os
import pickle

import numpy as np
import torchvision
from torchvision import datasets
from torchvision import transforms as T
from torchvision.datasets.utils import calculate_md5, check_integrity

from lifecycle.workers import PLAIN_START
from loaders.common import torch_loader
from utils.errors import UserError

CIFAR100_FILES = ("train", "test", "meta")
# the globals a CIFAR pickle names: numpy's reconstruction of an array (numpy 1's and numpy 2's module), its type and
# dtype, and the codec Python 3 uses for bytes in protocol 2; anything else would be code run by loading the file
CIFAR_PICKLE_GLOBALS = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}
CIFAR100_MANIFEST = "SAMPLE_DATA.json"  # md5 of each generated file: lets the loader accept (and verify) them
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR_IMAGE_VALUES = 3 * 32 * 32
# configs read <data_dir>/cifar-100-python and <data_dir>/{train,val} (data_root '/data' re-rooted)
CIFAR100_HINT = ("generate sample data with `python -m sample_data cifar100 --out data/cifar100` "
                 "and pass --data_dir data/cifar100")
IMAGEFOLDER_HINT = ("generate sample data with `python -m sample_data imagefolder --out data/imagefolder` "
                    "and pass --data_dir data/imagefolder")


def cifar100_files_verified(folder):
    """True if the files in `folder` are the official CIFAR-100 ones (torchvision's md5s), or generated
    sample data whose md5s all match its manifest (so a corrupted generated file is still caught)."""
    official = datasets.CIFAR100.train_list + datasets.CIFAR100.test_list
    official_meta = datasets.CIFAR100.meta
    if all(check_integrity(os.path.join(folder, name), md5) for name, md5 in official) and check_integrity(
            os.path.join(folder, official_meta["filename"]), official_meta["md5"]):
        return True
    manifest_path = os.path.join(folder, CIFAR100_MANIFEST)
    if not os.path.isfile(manifest_path):
        return False
    with open(manifest_path) as f:
        recorded_md5 = json.load(f).get("md5", {})
    return all(os.path.isfile(os.path.join(folder, name))
               and calculate_md5(os.path.join(folder, name)) == recorded_md5.get(name)
               for name in CIFAR100_FILES)


class _DataOnly(pickle.Unpickler):
    """An unpickler that resolves only CIFAR_PICKLE_GLOBALS."""

    def find_class(self, module, name):
        if (module, name) in CIFAR_PICKLE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def load_cifar_pickle(path):
    """What the CIFAR pickle at `path` holds, read as data (encoding latin1, as torchvision reads it); a file that
    names any other global is refused in one line before anything it names is called."""
    try:
        with open(path, "rb") as f:
            entry = _DataOnly(f, encoding="latin1").load()
    except pickle.UnpicklingError as err:
        raise UserError(f"CIFAR file '{path}' is not data: its pickle calls '{err}' as it loads (a CIFAR file holds "
                        f"only numpy arrays, lists and strings), so it was not loaded; delete the folder and "
                        f"{CIFAR100_HINT}") from None
    if not isinstance(entry, dict):
        raise UserError(f"CIFAR file '{path}' holds a {type(entry).__name__}, not a CIFAR dict; delete the folder and "
                        f"{CIFAR100_HINT}")
    return entry


class CIFAR100Dataset(datasets.CIFAR100):
    """torchvision's CIFAR100 that also accepts verified sample data, reads every file as data only
    (load_cifar_pickle, where torchvision's own loading would unpickle anything), and reports bad files as
    UserErrors."""

    def __init__(self, root, train, transform=None):
        folder = os.path.join(root, self.base_folder)
        # verify before unpickling anything, as torchvision does
        if not cifar100_files_verified(folder):
            raise UserError(f"the files in '{folder}' are neither the official CIFAR-100 files nor sample data "
                            f"matching its {CIFAR100_MANIFEST} (corrupted or edited?); delete the folder and "
                            f"{CIFAR100_HINT}")
        split_file = (self.train_list if train else self.test_list)[0][0]
        path = os.path.join(folder, split_file)
        entry = load_cifar_pickle(path)
        _check_cifar_rows(entry, path)
        datasets.VisionDataset.__init__(self, root, transform=transform)  # CIFAR10.__init__ without its pickle.load
        self.train = train
        self.data = entry["data"].reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))  # HWC, as torchvision's
        self.targets = list(entry["fine_labels"] if "fine_labels" in entry else entry["labels"])
        self._load_meta()

    def _check_integrity(self):
        return cifar100_files_verified(os.path.join(self.root, self.base_folder))

    def _load_meta(self):
        # torchvision's version checks the official md5 only; _check_integrity has covered meta already
        meta = load_cifar_pickle(os.path.join(self.root, self.base_folder, self.meta["filename"]))
        self.classes = meta[self.meta["key"]]
        self.class_to_idx = {name: index for index, name in enumerate(self.classes)}


def _check_cifar_rows(entry, path):
    """torchvision reshapes rows to 3x32x32 unchecked: another image size would give wrong images silently."""
    data, labels = entry.get("data"), entry.get("fine_labels", entry.get("labels", []))
    if not isinstance(data, np.ndarray):
        raise UserError(f"CIFAR file '{path}' has no data array; regenerate it")
    if data.ndim != 2 or data.shape[1] != CIFAR_IMAGE_VALUES:
        raise UserError(f"CIFAR file '{path}' has data of shape {tuple(data.shape)}: wrong image size, expected "
                        f"rows of {CIFAR_IMAGE_VALUES} values (3 x 32 x 32); regenerate it")
    if len(labels) != data.shape[0]:
        raise UserError(f"CIFAR file '{path}' has {data.shape[0]} images but {len(labels)} labels; regenerate it")


def _cifar100_present(root):
    return all(os.path.isfile(os.path.join(root, datasets.CIFAR100.base_folder, name)) for name in CIFAR100_FILES)


def _download_cifar100(root):
    try:
        torchvision.datasets.utils.download_and_extract_archive(
            datasets.CIFAR100.url, root, filename=datasets.CIFAR100.filename, md5=datasets.CIFAR100.tgz_md5)
    except OSError as err:  # no network, DNS, HTTP errors (URLError is an OSError)
        raise UserError(f"CIFAR-100 not found in '{root}' and downloading it failed ({err}); {CIFAR100_HINT}") from None


def _cifar100_dataset(params, train, download_ok):
    root = params.data_path
    if not _cifar100_present(root):
        if not (params.get("download", False) and download_ok):
            raise UserError(f"CIFAR-100 not found in '{root}'; {CIFAR100_HINT}")
        _download_cifar100(root)
    normalize = T.Normalize(params.cifar100_mean, params.cifar100_std)
    if train and params.get("augment", True):
        transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                               T.RandomRotation(params.rnd_rotation_angle), T.ToTensor(), normalize])
    else:
        transform = T.Compose([T.ToTensor(), normalize])
    dataset = CIFAR100Dataset(root, train=train, transform=transform)
    n_classes = max(len(dataset.classes), max(dataset.targets) + 1)
    if n_classes > params.num_classes:
        raise UserError(f"CIFAR-100 in '{root}' has {n_classes} classes but num_classes is {params.num_classes}; "
                        f"set num_classes: {n_classes}")
    return dataset


def _imagefolder_dataset(params, train):
    path = params.train_path if train else params.val_path
    if not os.path.isdir(path):
        raise UserError(f"image folder '{path}' does not exist; {IMAGEFOLDER_HINT}")
    size = params.img_size
    normalize = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    if train and params.get("augment", True):
        transform = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    else:
        # the standard ImageNet evaluation crop: resize to size / 0.875, then the central size x size
        transform = T.Compose([T.Resize(int(size / 0.875)), T.CenterCrop(size), T.ToTensor(), normalize])
    try:
        dataset = datasets.ImageFolder(path, transform=transform)
    except FileNotFoundError:  # no class folders, or no image files in them
        raise UserError(f"image folder '{path}' holds no images in class folders (<class>/*.png, *.jpg, ...); "
                        f"{IMAGEFOLDER_HINT}") from None
    if len(dataset.classes) > params.num_classes:
        raise UserError(f"image folder '{path}' has {len(dataset.classes)} classes but num_classes is "
                        f"{params.num_classes}; set num_classes: {len(dataset.classes)}")
    # labels are indices into the sorted class folders: validation must have the same folders as training
    if not train and os.path.isdir(params.train_path):
        train_classes, _ = datasets.folder.find_classes(params.train_path)
        if train_classes != dataset.classes:
            raise UserError(f"class folders of '{path}' differ from those of '{params.train_path}', so labels "
                            "would not match; give both splits the same class folders")
    return dataset


def get_image_dataset(params, train, download_ok=True):
    """Training or validation dataset of `params.dataset` ('cifar100' or 'imagefolder'): (image (3, H, W), label).

    CIFAR-100 is downloaded only if the config sets `download: True`, the folder is absent and the
    caller allows it (rank 0 first, the other ranks after a barrier).
    """
    if params.dataset == "cifar100":
        return _cifar100_dataset(params, train, download_ok)
    if params.dataset == "imagefolder":
        return _imagefolder_dataset(params, train)
    raise UserError(f"dataset '{params.dataset}' is not an image data set; choose cifar100 or imagefolder")


def sample_shape(params):
    """(3, H, W) of one training input, without reading any data."""
    if params.dataset == "cifar100":
        return (3, 32, 32)
    if params.dataset == "imagefolder":
        return (3, params.img_size, params.img_size)
    raise UserError(f"dataset '{params.dataset}' is not an image data set; choose cifar100 or imagefolder")


def image_loader(params, train, worker_start=PLAIN_START):
    """The PyTorch loader of one split of CIFAR-100 or an image folder (any `data_loader_config`)."""
    # rank 0 first: it may download CIFAR-100 (when the config allows); if it fails, every rank stops
    # with its message instead of waiting for it forever
    dataset = worker_start.first(lambda: get_image_dataset(params, train, download_ok=True))
    if dataset is None:
        dataset = get_image_dataset(params, train, download_ok=False)
    return torch_loader(params, dataset, train, worker_start=worker_start)
