"""Throughput benchmark built into train.py (`--enable_benchy`), replacing the external `benchy` tool.

Three benchmarks, each `nwarmup` warm-up trials then `ntrials` timed trials of `nbatches` batches:
  IO         the data loader alone (is the input pipeline fast enough?)
  SYNTHETIC  the training step fed one batch kept on the device (compute only)
  FULL       normal training: loader, copy to the device, step
Rates are samples/s of the whole job: global batch x batches / the slowest rank's time. Lines follow
benchy's (`BENCHY::SUMMARY::IO average trial throughput: A +/- S`); results go to a JSON file, with the MFU of
the compute trials, rank 0's peak memory and every rank's bytes of parameters, gradients, optimizer state and saved
activations (`memory_bytes_by_rank`). The training step never advances the LR schedule.
"""
import logging
import os
import statistics
import time

import torch
import torch.distributed as dist

from lifecycle.run import finish_run
from loop.profiling import SavedActivations, local_tensor, peak_memory_gb
from loop.validation import set_train_mode
from utils import comm
from utils.atomic import write_json

REPORT_FREQ = 10  # batches between "Iteration Throughput" lines


def _slowest(seconds, device):
    """The largest of every rank's `seconds` (the job is as fast as its slowest rank)."""
    if not dist.is_initialized():
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def benchy_output_path(run_dir):
    """$BENCHY_OUTPUT.json if set (the submit scripts' convention), else benchy_output.json in the run directory."""
    if os.environ.get("BENCHY_OUTPUT"):
        return os.environ["BENCHY_OUTPUT"] + ".json"
    return os.path.join(run_dir, "benchy_output.json")


def endless_batches(loader):
    """The loader's batches, epoch after epoch."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
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


def model_memory(model, inp, optimizer):
    """This rank's bytes of parameters, of their gradients (as the last step left them) and of the optimizer's state
    (Adam's moments), counted from the tensors (under FSDP: this rank's shards), and the bytes autograd saves for the
    backward pass in one forward of `inp` (loop.profiling.SavedActivations; in the caller's autocast)."""
    model = getattr(model, "_orig_mod", model)  # not torch.compile's wrapper (the hooks run eagerly)
    model = getattr(model, "module", model)  # nor the data-parallel one
    state = [local_tensor(value) for per_param in optimizer.state.values() for value in per_param.values()
             if torch.is_tensor(value) and value.dim()]  # not Adam's step count
    memory = {"parameters": sum(local_tensor(p).nbytes for p in model.parameters()),
              "gradients": sum(local_tensor(p.grad).nbytes for p in model.parameters() if p.grad is not None),
              "optimizer_state": sum(t.nbytes for t in state)}
    with SavedActivations(model) as saved:  # (before: FSDP's forward swaps in the gathered root parameters)
        model(inp)
    return {**memory, "saved_activations": saved.nbytes}


def run_benchmarks(run, model, train_loader, to_device, train_step, flops_per_device_sample, peak, optimizer):
    """IO, SYNTHETIC and FULL trials with the model in training mode, summary lines, the JSON written by rank 0
    ($BENCHY_OUTPUT.json, or benchy_output.json in the run directory), then the run's end (finish_run).

    `train_step(inp, tar)` is one optimisation step; MFU is per device (`flops_per_device_sample` is the training
    FLOPs of one sample over the devices sharing it) against `peak` (loop.flops.Peak)."""
    params, device = run.params, run.device
    set_train_mode(model, params)
    nbatches, ntrials, nwarmup = params.benchy_nbatches, params.benchy_ntrials, params.benchy_nwarmup
    batches = endless_batches(train_loader)
    fixed_batch = to_device(*next(batches))

    benchmarks = {
        "IO": lambda: next(batches),
        "SYNTHETIC": lambda: train_step(*fixed_batch),
        "FULL": lambda: train_step(*to_device(*next(batches))),
    }
    results = {"config": params.config_name,
               "world_size": dist.get_world_size() if dist.is_initialized() else 1, "dp_size": comm.get_size("dp"),
               "global_batch_size": params.global_batch_size, "nbatches": nbatches, "ntrials": ntrials,
               "nwarmup": nwarmup, "device": str(device)}
    for name, process_one_batch in benchmarks.items():
        for trial in range(nwarmup):
            time_trial(f"{name}_WARMUP_{trial}", process_one_batch, nbatches, params.global_batch_size, device)
        rates = [time_trial(f"{name}_{trial}", process_one_batch, nbatches, params.global_batch_size, device)
                 for trial in range(ntrials)]
        results[name] = {"trial_throughputs": rates, "mean": statistics.mean(rates),
                         "std": statistics.stdev(rates) if len(rates) > 1 else 0.0}
        if name != "IO":
            achieved = flops_per_device_sample * results[name]["mean"]
            results[name].update({"tflops_per_device": achieved / 1e12, "mfu": peak.mfu(achieved)})
    with torch.autocast(device.type, dtype=params.amp_dtype, enabled=params.amp_enabled):  # saved as in training
        memory = model_memory(model, fixed_batch[0], optimizer)
    memory_by_rank = [memory]  # every rank's record (rank 0 writes the file)
    if dist.is_initialized():
        memory_by_rank = [None] * dist.get_world_size()
        dist.all_gather_object(memory_by_rank, memory)
    results.update({"peak": peak.describe(), "peak_memory_gb": peak_memory_gb(device), "memory_bytes": memory,
                    "memory_bytes_by_rank": memory_by_rank})

    for name in benchmarks:  # upstream's spelling, space before SYNTHETIC included
        spacer = " " if name == "SYNTHETIC" else ""
        logging.info(f"BENCHY::SUMMARY::{spacer}{name} average trial throughput: "
                     f"{results[name]['mean']:.3f} +/- {results[name]['std']:.3f}")
    logging.info(f"BENCHY::SUMMARY::FULL MFU {100 * results['FULL']['mfu']:.1f}% ({peak.describe()}); "
                     f"peak memory {results['peak_memory_gb']:.2f} GB")
    if not dist.is_initialized() or dist.get_rank() == 0:
        out_path = benchy_output_path(run.exp_dir)
        write_json(out_path, results)
        logging.info(f"BENCHY::results written to {out_path}")
    finish_run(run)
    return results
