"""Benchmark: how much of the disk's read rate the ERA5 loader delivers (JSON + table).

    python -m benchmarks.bench_loader --data_dir data/era5_360x720 [--out bench_results/loader_era5.json]

Generates ERA5 sample data at the real 360 x 720 size if `--data_dir` holds none, then reads the same training
sample pairs (x(t), x(t+dt); 2 x 20 x 360 x 720 float32 = 41.5 MB) several ways, page cache warm (one
untimed pass first):
  raw h5py       one thread reading both frames of each pair into fresh arrays: the rate to compare with
  per-sample     the loader as it was: one sample at a time, normalised with temporaries, stacked by collate
  PyTorch, N workers   the loader train.py uses (whole batches read into one buffer, normalised in place)
  DALI, N workers      `--data_loader_config dali`: N Python workers read, DALI normalises (CPU here)
Each rate is samples/s and its ratio to the raw rate of the same run.
"""
import os
import platform
import sys
import time

import h5py
import numpy as np
from torch.utils.data import default_collate

from utils.atomic import write_json
from utils.benchy import endless_batches
from utils.errors import ArgumentParser


def loader_params(data_dir, batch, workers, height, width):
    from utils.cli import apply_overrides, training_parser
    from utils.YParams import YParams
    params = YParams(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config", "ViT.yaml"),
                     "base")
    args = training_parser("bench").parse_args(["--data_dir", data_dir, "--local_batch_size", str(batch),
                                                "--num_data_workers", str(workers)])
    apply_overrides(params, args, dp_size=1, dp_rank=0)
    params.img_size = [height, width]
    return params


def timed(label, batches, nbatches, batch, rows, raw_rate=None):
    next(batches)  # start-up (workers) outside the clock
    start = time.perf_counter()
    for _ in range(nbatches):
        next(batches)
    rate = nbatches * batch / (time.perf_counter() - start)
    rows.append({"loader": label, "samples_per_sec": rate, "ratio_to_raw": rate / raw_rate if raw_rate else 1.0})
    ratio = f" ({rate / raw_rate:.0%} of raw)" if raw_rate else ""
    print(f"[bench_loader] {label}: {rate:.1f} samples/s{ratio}", flush=True)
    return rate


def endless(iterable_factory):
    while True:
        yield from iterable_factory()


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default="data/era5_360x720")
    parser.add_argument("--out", default="bench_results/loader_era5.json")
    parser.add_argument("--height", type=int, default=360)
    parser.add_argument("--width", type=int, default=720)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--nbatches", type=int, default=10)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    args = parser.parse_args(argv)
    from utils.data_loader import get_data_loader
    from utils.sample_data import write_era5
    if not os.path.isdir(os.path.join(args.data_dir, "train")):
        print(f"[bench_loader] generating {args.height} x {args.width} sample data in {args.data_dir}", flush=True)
        write_era5(args.data_dir, height=args.height, width=args.width, steps_per_year=48, train_years=1,
                   valid_years=1, test_years=1, verbose=False)
    params = loader_params(args.data_dir, args.batch, 0, args.height, args.width)
    loader = get_data_loader(params, train=True)
    dataset = loader.dataset
    loader.set_epoch(0)
    order = list(loader.sampler)

    files = [h5py.File(path, "r")["fields"] for path in dataset.files_paths]  # plain h5py, one thread

    def raw_batches():
        for first in range(0, len(order) - args.batch + 1, args.batch):
            pairs = []
            for index in order[first:first + args.batch]:
                year_idx, step = dataset._position(index)
                fields = files[year_idx]
                pairs.append((fields[step, :, :args.height, :args.width],
                              fields[step + dataset.dt, :, :args.height, :args.width]))
            yield pairs

    def per_sample_batches():  # the loader before: a sample at a time, temporaries, collate copy
        for first in range(0, len(order) - args.batch + 1, args.batch):
            yield default_collate([dataset[index] for index in order[first:first + args.batch]])

    for _ in raw_batches():  # warm the page cache
        pass
    rows = []
    raw = timed("raw h5py (1 thread)", endless(raw_batches), args.nbatches, args.batch, rows)
    timed("per-sample (the loader before), 0 workers", endless(per_sample_batches), args.nbatches, args.batch,
          rows, raw)
    for config in ("pytorch", "dali"):
        for workers in args.workers:
            params = loader_params(args.data_dir, args.batch, workers, args.height, args.width)
            params.data_loader_config = config
            batches = get_data_loader(params, train=True)
            label = f"{'PyTorch' if config == 'pytorch' else 'DALI'}, {workers} workers"
            # told each epoch as training does (a DALI loader takes an untold epoch for a jump: a new pipeline)
            timed(label, endless_batches(batches), args.nbatches, args.batch, rows, raw)
    pair_mb = 2 * int(np.prod(next(per_sample_batches())[0].shape[1:])) * 4 / 1e6
    write_json(args.out, {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                          "image": [args.height, args.width], "batch": args.batch, "nbatches": args.nbatches,
                          "sample_pair_mb": pair_mb, "rows": rows})
    print(f"[bench_loader] written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
