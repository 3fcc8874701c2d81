"""Benchmark: how much of the disk's read rate the loaders deliver (JSON + table), ERA5 or the cosmology crops.

    python -m benchmarks.bench_loader --data_dir data/era5_360x720 [--out bench_results/loader_era5.json]
    python -m benchmarks.bench_loader --dataset cosmo --data_dir data/cosmo_128 [--out bench_results/loader_cosmo.json]

Generates ERA5 sample data at the real 360 x 720 size if `--data_dir` holds none, then reads the same training
sample pairs (x(t), x(t+dt); 2 x 20 x 360 x 720 float32 = 41.5 MB) several ways, page cache warm (one
untimed pass first):
  raw h5py       one thread reading both frames of each pair into fresh arrays: the rate to compare with
  per-sample     the loader as it was: one sample at a time, normalised with temporaries, stacked by collate
  PyTorch, N workers   the loader train.py uses (whole batches read into one buffer, normalised in place)
  DALI, N workers      `--data_loader_config dali`: N Python workers read, DALI normalises (CPU here)
Each rate is samples/s and its ratio to the raw rate of the same run.

`--dataset cosmo` generates a `--box`^3 training box (HDF5 and the .npy copies) if `--data_dir` holds none, and reads
the same random `--crop`^3 crops (the corners the loaders' crop_plan gives for epoch 0, input and target) these ways:
  raw h5py       h5py reads of the windows from the HDF5 file into fresh arrays (1 thread): the reference the ratios
                 are taken against (what the lowmem loader reads)
  raw npy        numpy memory map of the channels-last .npy, each crop window copied out (1 thread): extra
                 information (how much faster a memory map reads the same windows)
  PyTorch lowmem, N workers   `--data_loader_config lowmem` (HDF5 windows read into the batch, rotation with numpy)
  DALI, N threads             `--data_loader_config dali-lowmem` (DALI's ROI reads of the .npy windows, the rotation
                              in the pipeline; N CPU threads)
Batches default to 4 sample pairs for ERA5 and 16 crops for the cosmology boxes: about 160 MB a batch either way.
Each trial reads `--warmup` batches (10) before its clock starts: a loader's start-up (worker processes starting,
each mapping the ring of batches it reads into; loaders/common.py BatchRing) is paid once in a run, not per batch.
`worker_speedups` in the JSON gives the PyTorch loader's rate with N workers over 0 workers and over the next smaller
count, round by round (the targets: docs/loaders.md).
`--repeats N` times every loader N times, in rounds over the whole list (a noisy moment of a shared machine hits all
loaders of its round); each row gives the median and every round's rate. For the cosmology crops the JSON also has
`dali_over_pytorch`: DALI's rate over the PyTorch loader's at each equal count of threads and workers, round by
round (`make bench-loader-cosmo` runs 5 rounds).
"""
import os
import statistics
import sys
import time

import h5py
import numpy as np
from torch.utils.data import DataLoader, Dataset, default_collate

from benchmarks.common import REPO_ROOT, cpu_cores
from loaders import common as loader_common
from loaders.common import TorchLoader, batched_already, read_whole_batch, shared_tensor, torch_loader
from loop.benchy import endless_batches
from utils.atomic import write_json
from utils.errors import ArgumentParser

BEFORE = "{name}, {workers} workers, fresh shared memory per batch (before the ring)"
NO_DALI = "NVIDIA DALI is not installed here: its rows are left out (pip install nvidia-dali-cuda120)"


def dali_configs(pytorch, dali):
    """The loader configs to time: the PyTorch one, and DALI's where it imports (said once where it does not: a GPU
    node without DALI still measures the rest)."""
    if loader_common.dali_installed():
        return (pytorch, dali)
    print(f"[bench_loader] {NO_DALI}", flush=True)
    return (pytorch,)


def loader_params(data_dir, batch, workers, height, width):
    from lifecycle.cli import apply_overrides, training_parser
    from utils.YParams import YParams
    params = YParams(os.path.join(REPO_ROOT, "config", "ViT.yaml"), "base")
    args = training_parser("bench").parse_args(["--data_dir", data_dir, "--local_batch_size", str(batch),
                                                "--num_data_workers", str(workers)])
    apply_overrides(params, args, dp_size=1, dp_rank=0)
    params.img_size = [height, width]
    return params


def process_tree_usage():
    """{pid: (user s, system s, minor page faults)} of this process and its live children (loader workers), from
    /proc (Linux); {} elsewhere."""
    tick, usage = os.sysconf("SC_CLK_TCK"), {}
    pids = [os.getpid()]
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(pid) for pid in f.read().split()]
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            usage[pid] = (int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7]))
    except OSError:  # not Linux, or a child that ended meanwhile
        return {}
    return usage


def cost_per_batch(before, after, nbatches):
    """CPU ms (user, system) and minor page faults per batch, summed over the processes alive at both ends."""
    common = before.keys() & after.keys()
    if not common:
        return None
    user, system, faults = (sum(after[pid][i] - before[pid][i] for pid in common) for i in range(3))
    return {"user_ms": user / nbatches * 1e3, "system_ms": system / nbatches * 1e3, "page_faults": faults / nbatches}


def rate_of(batches, nbatches, batch, warmup):
    """(samples/s, CPU cost per batch) over `nbatches` batches of an endless iterator, after `warmup` batches
    outside the clock (start-up: worker processes starting, each mapping the ring it reads into; paid once a run)."""
    for _ in range(warmup):
        next(batches)
    usage = process_tree_usage()
    start = time.perf_counter()
    for _ in range(nbatches):
        next(batches)
    rate = nbatches * batch / (time.perf_counter() - start)
    return rate, cost_per_batch(usage, process_tree_usage(), nbatches)


def measure(trials, args):
    """Times every trial (label, function giving an endless batch iterator) `args.repeats` times, interleaved (the
    whole list once per round, so a noisy moment hits every loader alike). The first trial is the raw reference.
    Each row: the median rate, every round's rate, and the median's ratio to the raw median."""
    runs, costs = {label: [] for label, _ in trials}, {label: [] for label, _ in trials}
    for round_ in range(args.repeats):
        tag = f" (round {round_ + 1}/{args.repeats})" if args.repeats > 1 else ""
        for label, batches in trials:
            rate, cost = rate_of(batches(), args.nbatches, args.batch, args.warmup)
            runs[label].append(rate)
            costs[label].append(cost)
            print(f"[bench_loader] {label}{tag}: {rate:.1f} samples/s", flush=True)
    raw = statistics.median(runs[trials[0][0]])
    rows = [{"loader": label, "samples_per_sec": statistics.median(rates), "runs": rates,
             "ratio_to_raw": statistics.median(rates) / raw, "per_batch": median_cost(costs[label])}
            for label, rates in runs.items()]
    for row in rows:
        low, high = min(row["runs"]), max(row["runs"])
        spread = f", {low:.1f}-{high:.1f} over {args.repeats} rounds" if args.repeats > 1 else ""
        cost = row["per_batch"]
        cost = (f"; per batch {cost['user_ms']:.0f} ms user + {cost['system_ms']:.0f} ms system CPU, "
                f"{cost['page_faults']:.0f} page faults") if cost else ""
        print(f"[bench_loader] {row['loader']}: {row['samples_per_sec']:.1f} samples/s{spread} "
              f"({row['ratio_to_raw']:.0%} of {trials[0][0]}){cost}", flush=True)
    return rows


def median_cost(costs):
    """Each CPU cost's median over the rounds (None where /proc could not tell)."""
    costs = [cost for cost in costs if cost]
    return {key: statistics.median(cost[key] for cost in costs) for key in costs[0]} if costs else None


def round_ratios(numerator, denominator):
    """Two rows' rates divided round by round (the same noisy moment): median, range, every round."""
    ratios = [n / d for n, d in zip(numerator, denominator)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "runs": ratios}


def worker_speedups(rows, label_of, counts):
    """The PyTorch loader's rate with N workers over its rate with 0 workers, and over the next smaller count of
    workers, round by round: {"2": {"over_0": ..., }, "4": {"over_0": ..., "over_2": ...}}."""
    runs = {row["loader"]: row["runs"] for row in rows}
    speedups = {}
    if 0 not in counts:
        return speedups
    workers = sorted(count for count in counts if count > 0)
    for index, count in enumerate(workers):
        speedup = {"over_0": round_ratios(runs[label_of(count)], runs[label_of(0)])}
        if index:
            smaller = workers[index - 1]
            speedup[f"over_{smaller}"] = round_ratios(runs[label_of(count)], runs[label_of(smaller)])
        speedups[str(count)] = speedup
        print(f"[bench_loader] {label_of(count)}: " + ", ".join(
            f"{ratio['median']:.2f}x {over.replace('_', ' ')} workers ({ratio['min']:.2f}-{ratio['max']:.2f})"
            for over, ratio in speedup.items()), flush=True)
    return speedups


class FreshSharedMemory(Dataset):
    """The worker path before the ring (for comparison): each batch read into new shared memory in the worker, as
    default_collate does for what it stacks, and sent to the training process, which maps it and unmaps it."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitems__(self, indices):
        return read_whole_batch(self.dataset, indices, allocate=shared_tensor)


def fresh_shared_memory_batches(loader, workers):
    """Endless batches of `loader`'s dataset and sampler through FreshSharedMemory with `workers` workers."""
    fresh = DataLoader(FreshSharedMemory(loader.dataset), batch_size=loader.batch_size, sampler=loader.sampler,
                       collate_fn=batched_already, num_workers=workers, persistent_workers=True, drop_last=True)
    return endless_batches(TorchLoader(loader.dataset, loader.sampler, fresh, loader.batch_size))


def endless(iterable_factory):
    while True:
        yield from iterable_factory()


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=["era5", "cosmo"], default="era5")
    parser.add_argument("--data_dir", default=None, help="default: data/era5_360x720, or data/cosmo_<box>")
    parser.add_argument("--out", default=None, help="default: bench_results/loader_<dataset>.json")
    parser.add_argument("--height", type=int, default=360)
    parser.add_argument("--width", type=int, default=720)
    parser.add_argument("--box", type=int, default=128, help="cosmo: edge of the generated training box")
    parser.add_argument("--crop", type=int, default=64, help="cosmo: crop edge (the original data_size)")
    parser.add_argument("--batch", type=int, default=None, help="default: 4 (ERA5), 16 (cosmo): ~160 MB a batch")
    parser.add_argument("--nbatches", type=int, default=10, help="timed batches per trial")
    parser.add_argument("--warmup", type=int, default=10,
                        help="batches read before the clock starts (start-up: workers starting and mapping the ring)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over all loaders; rows give the median (make bench-loader-cosmo uses 5)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4], help="PyTorch loader workers")
    parser.add_argument("--before_workers", type=int, default=2,
                        help="workers of the row that reads into fresh shared memory per batch (the loader before "
                             "the ring); 0: no such row")
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 4], help="cosmo: DALI threads")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.nbatches < 1 or args.warmup < 0:
        parser.error("--repeats and --nbatches must be at least 1, --warmup at least 0")
    args.out = args.out or f"bench_results/loader_{args.dataset}.json"
    args.batch = args.batch or (16 if args.dataset == "cosmo" else 4)
    if args.dataset == "cosmo":
        args.data_dir = args.data_dir or f"data/cosmo_{args.box}"
        return cosmo_main(args)
    args.data_dir = args.data_dir or "data/era5_360x720"
    from loaders import get_data_loader
    from sample_data import write_era5
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
                year_idx, step = dataset.position(index)
                fields = files[year_idx]
                pairs.append((fields[step, :, :args.height, :args.width],
                              fields[step + dataset.dt, :, :args.height, :args.width]))
            yield pairs

    def per_sample_batches():  # the loader before: a sample at a time, temporaries, collate copy
        for first in range(0, len(order) - args.batch + 1, args.batch):
            yield default_collate([dataset[index] for index in order[first:first + args.batch]])

    for _ in raw_batches():  # warm the page cache
        pass
    trials = [("raw h5py (1 thread)", lambda: endless(raw_batches)),
              ("per-sample (the loader before), 0 workers", lambda: endless(per_sample_batches))]
    configs = dali_configs("pytorch", "dali")
    for config in configs:
        for workers in args.workers:
            params = loader_params(args.data_dir, args.batch, workers, args.height, args.width)
            params.data_loader_config = config
            label = f"{'PyTorch' if config == 'pytorch' else 'DALI'}, {workers} workers"
            # told each epoch as training does (a DALI loader takes an untold epoch for a jump: a new pipeline)
            trials.append((label, lambda params=params: endless_batches(get_data_loader(params, train=True))))
    if args.before_workers:
        params = loader_params(args.data_dir, args.batch, 0, args.height, args.width)
        trials.append((BEFORE.format(name="PyTorch", workers=args.before_workers),
                       lambda: fresh_shared_memory_batches(get_data_loader(params, train=True), args.before_workers)))
    rows = measure(trials, args)
    speedups = worker_speedups(rows, lambda count: f"PyTorch, {count} workers", args.workers)
    pair_mb = 2 * int(np.prod(next(per_sample_batches())[0].shape[1:])) * 4 / 1e6
    write_json(args.out, {"machine": cpu_cores(),
                          "image": [args.height, args.width], "batch": args.batch, "nbatches": args.nbatches,
                          "warmup": args.warmup, "repeats": args.repeats, "sample_pair_mb": pair_mb, "rows": rows,
                          "worker_speedups": speedups,
                          **({} if "dali" in configs else {"dali": NO_DALI})})
    print(f"[bench_loader] written to {args.out}")
    return 0



def cosmo_params(data_dir, config, batch, workers, crop, epoch_steps):
    from lifecycle.cli import apply_overrides, training_parser
    from utils.YParams import YParams
    params = YParams(os.path.join(REPO_ROOT, "config", "UNet.yaml"), "base")
    args = training_parser("bench").parse_args(["--data_dir", data_dir, "--local_batch_size", str(batch),
                                                "--num_data_workers", str(workers), "--data_loader_config", config])
    apply_overrides(params, args, dp_size=1, dp_rank=0)
    params.update({"data_size": crop, "Nsamples": batch * epoch_steps})
    return params


def host_part(params):
    """The PyTorch lowmem loader as it runs on a GPU node, stopped where the host's work ends: crop windows read
    as they lie, with their turn codes, for the GPU to turn after the copy (loaders/cosmo.py turn_later)."""
    from loaders.cosmo import CosmoDataset
    loader = torch_loader(params, CosmoDataset(params, True), True, turn_later=True)
    loader.finish = None  # the turn (TorchLoader._on_device) happens on the GPU, not on this host
    return loader


def cosmo_main(args):
    """The cosmology crops: raw reads of the same windows, then the PyTorch and DALI loaders."""
    from loaders import get_data_loader
    from sample_data.cosmo import TRAIN_FILE, write_cosmo
    if not os.path.isfile(os.path.join(args.data_dir, TRAIN_FILE)):
        print(f"[bench_loader] generating a {args.box}^3 cosmology box in {args.data_dir}", flush=True)
        write_cosmo(args.data_dir, train_size=args.box, valid_size=16, verbose=False)
    import torch
    torch.set_num_threads(1)  # a loader without workers reads on one thread, as the raw reads do
    epoch_steps = args.warmup + args.nbatches + 2
    loader = get_data_loader(cosmo_params(args.data_dir, "lowmem", args.batch, 0, args.crop, epoch_steps), train=True)
    dataset = loader.dataset
    loader.set_epoch(0)
    corners = [dataset.plan(key).corner for key in loader.sampler]
    basename = os.path.join(args.data_dir, TRAIN_FILE[:-3])
    memmaps = [np.load(f"{basename}_{kind}.npy", mmap_mode="r") for kind in ("data", "label")]
    h5 = h5py.File(os.path.join(args.data_dir, TRAIN_FILE), "r")
    fields = [h5["Nbody"], h5["Hydro"]]
    edge = args.crop

    def raw_batches(read):
        for first in range(0, len(corners) - args.batch + 1, args.batch):
            yield [read(z, y, x) for z, y, x in corners[first:first + args.batch]]

    def npy_window(z, y, x):  # copied out of the page cache, channels-last as stored
        return [np.array(m[z:z + edge, y:y + edge, x:x + edge]) for m in memmaps]

    def h5_window(z, y, x):
        return [f[:, z:z + edge, y:y + edge, x:x + edge] for f in fields]

    for read in (npy_window, h5_window):  # warm the page cache
        for _ in raw_batches(read):
            pass
    dali_label = f"DALI ({'GPU' if torch.cuda.is_available() else 'CPU'})"
    trials = [("raw h5py (1 thread)", lambda: endless(lambda: raw_batches(h5_window))),
              ("raw npy memmap (1 thread)", lambda: endless(lambda: raw_batches(npy_window)))]
    labels = {}
    configs = dali_configs("lowmem", "dali-lowmem")
    for config, counts, unit in (("lowmem", args.workers, "workers"), ("dali-lowmem", args.threads, "threads")):
        if config not in configs:
            continue
        for count in counts:
            params = cosmo_params(args.data_dir, config, args.batch, count, args.crop, epoch_steps)
            labels[config, count] = f"{'PyTorch lowmem' if config == 'lowmem' else dali_label}, {count} {unit}"
            trials.append((labels[config, count],
                           lambda params=params: endless_batches(get_data_loader(params, train=True))))
    for count in args.workers:  # what the host does on a GPU node, where the crops are turned after the copy
        params = cosmo_params(args.data_dir, "lowmem", args.batch, count, args.crop, epoch_steps)
        labels["host part", count] = f"PyTorch lowmem, {count} workers, turned on the GPU (host part)"
        trials.append((labels["host part", count], lambda params=params: endless_batches(host_part(params))))
    if args.before_workers:
        params = cosmo_params(args.data_dir, "lowmem", args.batch, 0, args.crop, epoch_steps)
        trials.append((BEFORE.format(name="PyTorch lowmem", workers=args.before_workers),
                       lambda: fresh_shared_memory_batches(get_data_loader(params, train=True), args.before_workers)))
    rows = measure(trials, args)
    speedups = worker_speedups(rows, lambda count: labels["lowmem", count], args.workers)
    # the target: DALI at least the PyTorch loader at equal threads, round by round (the same noisy moment)
    runs = {row["loader"]: row["runs"] for row in rows}
    versus = {}
    for count in sorted(set(args.workers) & set(args.threads) if "dali-lowmem" in configs else []):
        ratios = [d / p for d, p in zip(runs[labels["dali-lowmem", count]], runs[labels["lowmem", count]])]
        versus[str(count)] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                              "rounds_ahead": sum(ratio >= 1 for ratio in ratios), "runs": ratios}
        print(f"[bench_loader] DALI / PyTorch at {count}: median {versus[str(count)]['median']:.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}; DALI ahead in {versus[str(count)]['rounds_ahead']} of "
              f"{len(ratios)} rounds)", flush=True)
    h5.close()
    # issue #39's target, round by round like the ratios above: lowmem without workers at 2.0x the raw h5py reads
    raw = runs[trials[0][0]]
    target = {f"{count} workers": {label: statistics.median([a / b for a, b in zip(runs[labels[key, count]], raw)])
                                   for label, key in (("host turns", "lowmem"), ("GPU turns", "host part"))}
              for count in args.workers}
    print(f"[bench_loader] lowmem over raw h5py with 0 workers (target 2.0): host turns the crops "
          f"{target['0 workers']['host turns']:.2f}, GPU turns them (host part) "
          f"{target['0 workers']['GPU turns']:.2f}" if 0 in args.workers else "", flush=True)
    sample_mb = (memmaps[0].shape[3] + memmaps[1].shape[3]) * edge ** 3 * 4 / 1e6
    write_json(args.out, {"machine": cpu_cores(),
                          "box": list(memmaps[0].shape[:3]), "crop": edge, "batch": args.batch,
                          "nbatches": args.nbatches, "warmup": args.warmup, "repeats": args.repeats,
                          "sample_pair_mb": sample_mb, "torch_threads": torch.get_num_threads(),
                          "raw_reference": "raw h5py (1 thread)", "rows": rows,
                          "worker_speedups": speedups, "dali_over_pytorch": versus,
                          "lowmem_over_raw_h5py": target, **({} if "dali-lowmem" in configs else {"dali": NO_DALI})})
    print(f"[bench_loader] written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
