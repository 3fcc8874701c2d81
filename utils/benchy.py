"""Throughput benchmark built into train.py (`--enable_benchy`), replacing the external `benchy` tool.

Three benchmarks, each `nwarmup` warm-up trials then `ntrials` timed trials of `nbatches` batches:
  IO         the data loader alone (is the input pipeline fast enough?)
  SYNTHETIC  the training step fed one batch kept on the device (compute only)
  FULL       normal training: loader, copy to the device, step
Rates are samples/s of the whole job: global batch x batches / the slowest rank's time. Lines follow
benchy's (`BENCHY::SUMMARY::IO average trial throughput: A +/- S`); results go to a JSON file.
"""
import json
import logging
import os
import statistics
import time

import torch
import torch.distributed as dist

from utils import comm

REPORT_FREQ = 10  # batches between "Iteration Throughput" lines


def _slowest(seconds, device):
    """The largest of every rank's `seconds` (the job is as fast as its slowest rank)."""
    if not dist.is_initialized():
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def endless_batches(loader, sampler):
    """The loader's batches, epoch after epoch."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def time_trial(label, process_one_batch, nbatches, global_batch_size, device):
    """Run `process_one_batch` nbatches times; log and return the job's samples/s."""
    window_rates = []
    comm.synchronize(device)
    start = window_start = time.perf_counter()
    for n in range(1, nbatches + 1):
        process_one_batch()
        if n % REPORT_FREQ == 0 or n == nbatches:
            comm.synchronize(device)
            now = time.perf_counter()
            window = n % REPORT_FREQ or REPORT_FREQ
            window_rates.append(window * global_batch_size / _slowest(now - window_start, device))
            logging.info(f"BENCHY::{label}::Iteration Throughput: {window_rates[-1]:.3f}")
            window_start = now
    trial_rate = nbatches * global_batch_size / _slowest(time.perf_counter() - start, device)
    logging.info(f"BENCHY::{label}::Average Iteration Throughput: {statistics.mean(window_rates):.3f}")
    logging.info(f"BENCHY::{label}::Trial Throughput: {trial_rate:.3f}")
    return trial_rate


def run_benchmarks(params, train_loader, train_sampler, to_device, train_step, device, out_path):
    """IO, SYNTHETIC and FULL trials; summary lines, and `out_path` (JSON) written by rank 0."""
    nbatches, ntrials, nwarmup = params.benchy_nbatches, params.benchy_ntrials, params.benchy_nwarmup
    batches = endless_batches(train_loader, train_sampler)
    fixed_batch = to_device(*next(batches))

    benchmarks = {
        "IO": lambda: next(batches),
        "SYNTHETIC": lambda: train_step(*fixed_batch),
        "FULL": lambda: train_step(*to_device(*next(batches))),
    }
    results = {"config": params.config_name,
               "world_size": dist.get_world_size() if dist.is_initialized() else 1,
               "global_batch_size": params.global_batch_size, "nbatches": nbatches, "ntrials": ntrials,
               "nwarmup": nwarmup, "device": str(device)}
    for name, process_one_batch in benchmarks.items():
        for trial in range(nwarmup):
            time_trial(f"{name}_WARMUP_{trial}", process_one_batch, nbatches, params.global_batch_size, device)
        rates = [time_trial(f"{name}_{trial}", process_one_batch, nbatches, params.global_batch_size, device)
                 for trial in range(ntrials)]
        results[name] = {"trial_throughputs": rates, "mean": statistics.mean(rates),
                         "std": statistics.stdev(rates) if len(rates) > 1 else 0.0}

    for name in benchmarks:  # upstream's spelling, space before SYNTHETIC included
        spacer = " " if name == "SYNTHETIC" else ""
        logging.info(f"BENCHY::SUMMARY::{spacer}{name} average trial throughput: "
                     f"{results[name]['mean']:.3f} +/- {results[name]['std']:.3f}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)
        logging.info(f"BENCHY::results written to {out_path}")
    return results
