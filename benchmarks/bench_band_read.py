"""What a context-parallel rank reads: its band of image rows (distributed/bands.py), against a raw read of the bytes.

    python -m benchmarks.bench_band_read [--data_dir data/era5_721x1440] [--out bench_results/band_read.json]

On 0.25-degree sample files (721 x 1440, read as 720 x 1440 at patch 8, the `wfm_p8` config; written first if the
folder has none: a few time steps, about 83 MB each), for cp = 1, 2 and 4 and each cp rank: the bytes the rank
reads per sample (input and target, from the HDF5 file, counted by a file object that h5py reads through), and the
host's GB/s of the band read (ERA5Dataset.read_into: an HDF5 hyperslab, one run of bytes per channel) against a
raw read of as many bytes (plain reads of one contiguous run per field, no HDF5), and, for information, of the whole
loader (the read and its per-channel normalisation). The files are read once before timing, so the rates are the
page cache's, not the disk's: the test is whether the band read wastes bytes or time, not the file system's speed.
Each rate is the median of --repeats trials. Checked: bytes per rank fall as 1/cp; the band read reaches at least
0.8x the raw read's GB/s.
"""
import argparse
import glob
import logging
import os
import statistics
import sys
import time

import h5py
import numpy as np
import torch

from benchmarks.common import machine
from distributed.bands import Band
from loaders import era5
from resilience.exits import exit_on_user_error
from utils.atomic import write_json
from utils.layout import Axis
from utils.YParams import YParams

MIN_RATIO = 0.8  # the band read's GB/s against the raw read's, at least
H5_FILE = h5py.File  # the real one (counted_dataset swaps it while a dataset checks its files)


class CountingFile:
    """A file object h5py reads through (driver "fileobj"), counting the bytes it hands over."""

    def __init__(self, path):
        self.file = open(path, "rb")  # noqa: SIM115 (closed with the h5py file that reads it)
        self.bytes_read = 0

    def readinto(self, buffer):
        count = self.file.readinto(buffer)
        self.bytes_read += count or 0
        return count

    def read(self, size=-1):
        data = self.file.read(size)
        self.bytes_read += len(data)
        return data

    def seek(self, offset, whence=0):
        return self.file.seek(offset, whence)

    def tell(self):
        return self.file.tell()

    def close(self):
        self.file.close()


def counted_dataset(params, location):
    """An ERA5Dataset whose files are read through CountingFile objects: (dataset, the list of them)."""
    counters = []

    def open_counted(path, mode="r"):
        counters.append(CountingFile(path))
        return H5_FILE(counters[-1], mode)

    plain = era5.h5py.File
    era5.h5py.File = open_counted
    try:
        dataset = era5.ERA5Dataset(params, location, train=True)
        dataset.files = [open_counted(path)["fields"] for path in dataset.files_paths]  # opened now, counted from 0
    finally:
        era5.h5py.File = plain
    for counter in counters:
        counter.bytes_read = 0
    return dataset, counters


def bytes_per_sample(params, location, index=0):
    """Bytes read from the files for one sample (input and target) with `params.read_rows`."""
    dataset, counters = counted_dataset(params, location)
    batch = tuple(torch.empty(1, *shape) for shape in dataset.sample_shapes())
    dataset.read_batch_into([index], batch)
    return sum(counter.bytes_read for counter in counters)


def median_rate(read, nbytes, repeats):
    """GB/s of `read()` moving `nbytes`, the median of `repeats` trials (after one untimed)."""
    read()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def rank_row(params, location, cp, rank, samples, repeats):
    band = Band.of(params.img_size, params.patch_size, Axis("cp", cp, rank))
    params.read_rows = band.rows
    dataset = era5.ERA5Dataset(params, location, train=True)
    shape = dataset.sample_shapes()[0]
    indices = list(range(samples))
    nbytes = 2 * len(indices) * int(np.prod(shape)) * 4
    out = np.empty((2 * len(indices), *shape), np.float32)
    steps = [(year, at) for year, step in map(dataset.position, indices) for at in (step, step + dataset.dt)]

    def band_read():  # the loader's read: an HDF5 hyperslab of the band's rows, each channel's a run of bytes
        for n, (year, at) in enumerate(steps):
            dataset.read_into(year, at, out[n])

    band_read()  # opens the files
    raw = []
    for year, at in steps:  # where each field starts in its (contiguous) file, and the file to read it from
        fields = dataset.files[year]
        start = fields.id.get_offset() + at * int(np.prod(fields.shape[1:])) * 4
        raw.append((open(dataset.files_paths[year], "rb"), start))  # noqa: SIM115 (closed below)
    flat = out.reshape(len(steps), -1)

    def raw_read():  # the same number of bytes, one contiguous run per field, with plain reads: no HDF5, no strides
        for n, (file, start) in enumerate(raw):
            file.seek(start)
            file.readinto(memoryview(flat[n]).cast("B"))

    batch = tuple(torch.empty(len(indices), *shape) for _ in range(2))
    row = {"cp": cp, "rank": rank, "rows": list(band.rows or (0, dataset.img_h)),
           "bytes_per_sample": bytes_per_sample(params, location),
           "band_gb_per_s": round(median_rate(band_read, nbytes, repeats), 3),
           "raw_gb_per_s": round(median_rate(raw_read, nbytes, repeats), 3),
           # the whole loader: the read and the per-channel normalisation (two more passes over the memory)
           "loader_gb_per_s": round(median_rate(lambda: dataset.read_batch_into(indices, batch), nbytes, repeats), 3)}
    for file, _ in raw:
        file.close()
    row["ratio_to_raw"] = round(row["band_gb_per_s"] / row["raw_gb_per_s"], 3)
    return row


def check(rows):
    """What the benchmark must show; the lines that fail (empty: all held)."""
    failures = []
    whole = next(row["bytes_per_sample"] for row in rows if row["cp"] == 1)
    for row in rows:
        share = (row["rows"][1] - row["rows"][0]) / (rows[0]["rows"][1] - rows[0]["rows"][0])
        expected = whole * share  # the band's share of the field; 1/cp up to a partly used patch row at each end
        if abs(row["bytes_per_sample"] - expected) > 0.01 * whole or share > 1 / row["cp"] + 0.05:
            failures.append(f"cp={row['cp']} rank {row['rank']}: {row['bytes_per_sample']} bytes read per sample, "
                            f"not its band's {expected:.0f} (1/cp of {whole})")
        if row["ratio_to_raw"] < MIN_RATIO:
            failures.append(f"cp={row['cp']} rank {row['rank']}: the band read reaches {row['ratio_to_raw']}x the raw "
                            f"read's GB/s, below {MIN_RATIO}")
    return failures


def write_data(data_dir, height, width, steps):
    from sample_data import era5 as writer
    print(f"writing {height} x {width} sample data to {data_dir}: a training, a validation and a test year of "
          f"{steps} time steps ...", flush=True)
    writer.write_era5(data_dir, height=height, width=width, steps_per_year=steps, train_years=1, valid_years=1,
                      test_years=1, verbose=True)


@exit_on_user_error
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default="data/era5_721x1440")
    parser.add_argument("--config", default="wfm_p8", help="a ViT config of config/ViT.yaml (img_size, patch_size)")
    parser.add_argument("--height", type=int, default=721)
    parser.add_argument("--width", type=int, default=1440)
    parser.add_argument("--steps", type=int, default=4, help="time steps of the year written if there are no files")
    parser.add_argument("--samples", type=int, default=2, help="samples per timed read")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_results/band_read.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    train_dir = os.path.join(args.data_dir, "train")
    if not glob.glob(os.path.join(train_dir, "*.h5")):
        write_data(args.data_dir, args.height, args.width, args.steps)
    params = YParams(os.path.join("config", "ViT.yaml"), args.config)
    params.update({"global_means_path": os.path.join(args.data_dir, "stats", "global_means.npy"),
                   "global_stds_path": os.path.join(args.data_dir, "stats", "global_stds.npy"),
                   "limit_nsamples": None, "dt": 1})
    rows = []
    for cp in (1, 2, 4):
        for rank in range(cp):
            rows.append(rank_row(params, train_dir, cp, rank, args.samples, args.repeats))
            row = rows[-1]
            print(f"cp={cp} rank {rank}: rows {row['rows'][0]}-{row['rows'][1]}, "
                  f"{row['bytes_per_sample'] / 1e6:.1f} MB read per sample, {row['band_gb_per_s']} GB/s "
                  f"({row['ratio_to_raw']}x the raw read's {row['raw_gb_per_s']})", flush=True)
    failures = check(rows)
    write_json(args.out, {"machine": machine(), "torch": torch.__version__, "config": args.config,
                          "img_size": list(params.img_size), "patch_size": params.patch_size,
                          "file_rows": args.height, "rows": rows, "min_ratio": MIN_RATIO, "failures": failures})
    print(f"wrote {args.out}")
    for line in failures:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
