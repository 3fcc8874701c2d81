"""Convert a cosmology HDF5 box to the channels-last .npy pair the DALI loader reads.

    python -m sample_data.convert_to_npy -i downsamp_2048crop_train.h5 -d Nbody -l Hydro [-o OUT_DIR]

writes OUT_DIR/downsamp_2048crop_train_data.npy (D, H, W, 4) and ..._label.npy (D, H, W, 5).
"""
import os
import sys

import h5py
import numpy as np

from resilience.exits import exit_on_user_error
from utils.atomic import atomic_path
from utils.errors import ArgumentParser, UserError

# Planes along D converted at a time: the slab, not the whole box, has to fit in memory.
SLAB_BYTES = 256 * 2**20


def _field_shape(h5_file, h5_path, field):
    if field not in h5_file:
        raise UserError(f"HDF5 file '{h5_path}' has no dataset '{field}' (it holds: "
                        f"{', '.join(h5_file) or 'nothing'}); pass an existing name with -d/-l")
    shape = h5_file[field].shape
    if len(shape) != 4:
        raise UserError(f"dataset '{field}' in '{h5_path}' has shape {shape}; expected channels-first "
                        "(C, D, H, W)")
    return shape


def _write_channels_last(dataset, out_path):
    """dataset (C, D, H, W) -> out_path (D, H, W, C) float32, slab by slab, atomically."""
    channels, depth, height, width = dataset.shape
    planes_per_slab = max(1, SLAB_BYTES // (channels * height * width * 4))
    with atomic_path(out_path) as tmp_path:
        out = np.lib.format.open_memmap(tmp_path, mode="w+", dtype=np.float32,
                                        shape=(depth, height, width, channels))
        for first in range(0, depth, planes_per_slab):
            last = min(first + planes_per_slab, depth)
            out[first:last] = np.moveaxis(dataset[:, first:last].astype(np.float32, copy=False), 0, -1)
        out.flush()
        del out  # closes the memory map before the rename
    return out_path


def convert(h5_path, data_field, label_field, out_dir="."):
    """Write `<basename>_data.npy` and `<basename>_label.npy` (channels-last) into out_dir; return both paths."""
    h5_path = os.fspath(h5_path)
    out_dir = os.fspath(out_dir)
    if not os.path.isfile(h5_path):
        raise UserError(f"input file '{h5_path}' not found; pass an existing HDF5 file with -i")
    basename = os.path.splitext(os.path.basename(h5_path))[0]
    try:
        h5_file = h5py.File(h5_path, "r")
    except OSError as err:
        raise UserError(f"input file '{h5_path}' is not a readable HDF5 file ({err})") from None
    with h5_file:
        for field in (data_field, label_field):
            _field_shape(h5_file, h5_path, field)
        os.makedirs(out_dir, exist_ok=True)
        data_path = _write_channels_last(h5_file[data_field], os.path.join(out_dir, f"{basename}_data.npy"))
        label_path = _write_channels_last(h5_file[label_field], os.path.join(out_dir, f"{basename}_label.npy"))
    return data_path, label_path


@exit_on_user_error
def main(argv=None):
    parser = ArgumentParser(prog="python -m sample_data.convert_to_npy", description=__doc__.splitlines()[0])
    parser.add_argument("-i", "--input_file", required=True, help="HDF5 file with channels-first datasets")
    parser.add_argument("-d", "--data_field", required=True, help="input dataset name (e.g. Nbody)")
    parser.add_argument("-l", "--label_field", required=True, help="target dataset name (e.g. Hydro)")
    parser.add_argument("-o", "--out_dir", default=".", help="output folder (default: current directory)")
    args = parser.parse_args(argv)
    for path in convert(args.input_file, args.data_field, args.label_field, args.out_dir):
        print(f"wrote {path} {np.load(path, mmap_mode='r').shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
