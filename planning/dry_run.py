"""One rank of an N-rank layout on the one device at hand: `train_mp.py --dry_run N [--dry_run_rank R]`.

train_mp.py builds the layout its flags give as rank R of N (join: torch's fake process group
stands in for the other N - 1 ranks, its collectives return at once and move no data), builds and wraps the model
exactly as a real rank does, and hands the step to `report`, which runs a few steps on one batch and measures what
this rank holds: its parameters, gradients and optimizer state, the activations autograd saves in one forward
(the same record as --enable_benchy's, loop/benchy.model_memory), the peak (the allocator's high watermark on a GPU;
on a CPU, which has none, the sum of those tensors), and the step's time, which is compute only: the collectives
cost nothing here. Beside each number is the performance model's (planning/perf_model.py, what `make plan`
prints) for the same layout. The values the model computes are meaningless (the other ranks' contributions are
missing), so nothing is written: no checkpoint, no TensorBoard, no check for nan.

The last line printed is one JSON object; dry_run_in_own_process runs one and reads it back (`make plan --measure`,
benchmarks/bench_dry_run.py).
"""
import json
import logging
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from distributed import serial_state
from distributed.pipeline import Pipeline
from lifecycle.run import finish_run
from loop.benchy import model_memory
from loop.validation import set_train_mode
from planning import perf_model
from utils import comm
from utils.compat import join_fake_process_group
from utils.errors import UserError, error_line, register_cleanup
from utils.layout import dry_run_refusal

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMORY_KINDS = ("parameters", "gradients", "optimizer_state", "saved_activations")  # what a CPU's peak sums
GPU_SYSTEMS = {"H100": "H100-SXM", "H200": "H200", "A100-SXM4-80GB": "A100-80GB", "A100": "A100-40GB"}


def gpu_system(name):
    """The performance model's system of a GPU named `name` (torch.cuda.get_device_name), or None (unknown)."""
    return next((system for key, system in GPU_SYSTEMS.items() if key in name), None)


def join(layout, rank):
    """Join, as rank `rank` of the Layout `layout` (train_mp.py --dry_run), a process group of torch's fake backend
    (utils/compat.py: its collectives return at once and move no data), alone; comm.init then builds the grid's
    groups on it: every kernel this rank runs is real and every tensor it holds has its real shape; the values that
    cross ranks are meaningless."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 or dist.is_initialized():
        raise UserError("--dry_run runs one process standing for the whole layout; start it with python, not "
                        "torchrun or srun with several tasks")
    too_large = dry_run_refusal(layout.world_size)
    if too_large:
        raise UserError(f"--dry_run {too_large}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.world_size:
        raise UserError(f"--dry_run_rank {rank} is not a rank of {layout.world_size}; give one of 0 to "
                        f"{layout.world_size - 1}")
    logging.info(f"Dry run: rank {rank} of {layout.world_size} ({layout.describe()}) in this one process; the "
                 "other ranks are stand-ins whose collectives move no data, so the numbers it computes are "
                 "meaningless: no checkpoint, no TensorBoard, no check for nan; memory is this rank's, time is "
                 "compute only")
    join_fake_process_group(rank, layout.world_size)
    register_cleanup(comm.destroy)  # a refusal after this point leaves no process group behind (a finished run: no-op)


def system_of(device):
    """The performance model's system for this GPU (its name), or None (a CPU, or a GPU it does not know)."""
    if device.type != "cuda":
        return None
    return gpu_system(torch.cuda.get_device_name(device))


def predicted(params, layout, device, ddp=True, stage=0):
    """The performance model's numbers for this layout at the run's local batch: rank 0's bytes by kind (the ranks of
    a layout hold the same, but for an uneven split of the tokens over cp), the peak measured the same way (on a GPU
    the tensors at the step's peak, without the CUDA context; on a CPU the sum of the four kinds), and on a GPU it
    knows the compute time of one step (matmul, softmax and memory-bound kernels, no collectives)."""
    if params.get("model", "vit") != "vit":
        return None
    shape = perf_model.ViTShape.from_params(params)
    if layout.pp > 1:  # pipeline stage `stage`: its blocks, embeddings or head, and the microbatches it holds
        memory = perf_model.stage_memory_bytes(perf_model.stage_shapes(shape, layout)[stage], layout,
                                               params.local_batch_size, params.amp_enabled, stage)
    else:
        memory = perf_model.memory_bytes(shape, layout, params.local_batch_size, params.amp_enabled, ddp=ddp)
    found = {"parameters": memory["weights"], "gradients": memory["gradients"],
             "optimizer_state": memory["optimizer_state"], "saved_activations": memory["saved_activations"],
             "step_time_s": None, "system": system_of(device)}
    found["peak_memory_gb"] = (memory["peak"] if device.type == "cuda" else sum(
        found[key] for key in MEMORY_KINDS)) / perf_model.GIB
    if found["system"] and layout.pp == 1:  # a stage's step waits on the others': the planner's pipeline rows
        system = perf_model.SYSTEMS[found["system"]]
        amp_mode = params.amp_mode if params.amp_enabled else "none"
        row = perf_model.predict(shape, system, layout, params.local_batch_size * layout.dp, amp_mode)
        found["step_time_s"] = perf_model.compute_seconds(row)
    return found


def report(run, model, raw_model, batch, to_device, train_step, optimizer):
    """`model` as parallelize wrapped it, `raw_model` the serial model inside it (what checkpoints hold); the layout
    is the run's grid's. Time `train_step` on one batch (a warm-up step, which allocates the gradients and Adam's
    moments, then --dry_run_steps more, timed: 0 for memory only), measure this rank's memory, print a table and,
    last, one JSON object; returns that object. Ends the run (finish_run: the process group goes)."""
    params, device, layout = run.params, run.device, run.grid.layout
    set_train_mode(model, params)
    inp, tar = to_device(*batch)
    train_step(inp, tar)  # warm-up: gradients and optimizer state exist from here on
    seconds = []
    for _ in range(run.args.dry_run_steps):
        comm.synchronize(device)
        start = time.perf_counter()
        train_step(inp, tar)
        comm.synchronize(device)
        seconds.append(time.perf_counter() - start)
    with torch.autocast(device.type, dtype=params.amp_dtype, enabled=params.amp_enabled):  # saved as in training
        memory = stage_memory(model, inp, optimizer) if isinstance(model, Pipeline) else model_memory(
            model, inp, optimizer)
    saving = save_memory(raw_model, optimizer, run.args.checkpoint_format)
    if device.type == "cuda":
        peak_gb, peak_is = torch.cuda.max_memory_allocated(device) / perf_model.GIB, "the allocator's high watermark"
    else:
        peak_gb = sum(memory[kind] for kind in MEMORY_KINDS) / perf_model.GIB
        peak_is = "the sum of this rank's tensors above"
    result = {"dry_run": True, "rank": comm.get_world_rank(), "world_size": layout.world_size,
              "layout": {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp, "order": layout.order,
                         "flags": layout.flags()},
              "pipeline_stage": run.grid.rank("pp") if layout.pp > 1 else None,
              "config": params.config_name, "local_batch_size": params.local_batch_size, "amp_mode": params.amp_mode,
              "device": str(device), **memory, "peak_memory_gb": peak_gb, "peak_memory_is": peak_is,
              "step_time_s": statistics.median(seconds) if seconds else None,
              "step_time_is": ("compute only: the collectives move nothing" if seconds
                               else "not timed (--dry_run_steps 0)"),
              "checkpoint_save": saving,
              "predicted": predicted(params, layout, device, ddp=not run.args.noddp, stage=run.grid.rank("pp"))}
    finish_run(run)
    print(table(result))
    print(json.dumps(result))
    return result


def stage_memory(pipe, inp, optimizer):
    """model_memory of a pipeline stage (a Pipeline): the activations autograd saves in one microbatch's forward,
    with the stage's output kept for its backward (but on the last stage), times the most microbatches the
    schedule held at once in the steps just run (Pipeline.peak_in_flight: GPipe M, 1F1B P - s)."""
    micro = inp[:inp.shape[0] // pipe.M]
    memory = model_memory(pipe, micro, optimizer)
    output = 0 if pipe.next is None else torch.Size(pipe.tokens_shape(micro.shape[0])).numel() * pipe.dtype.itemsize
    memory["saved_activations"] = pipe.peak_in_flight * (memory["saved_activations"] + output)
    memory["microbatches_in_flight"] = pipe.peak_in_flight
    return memory


def save_memory(raw, optimizer, checkpoint_format):
    """The host bytes this rank fills to save a checkpoint, from its tensors: the serial format gathers the whole
    model and its Adam moments on every rank (the serial shapes of every stage's tensors); the sharded one copies
    this rank's own boxes (lifecycle/shards.py; less where a lower rank holds the same box)."""
    if serial_state.writes_sharded(raw, checkpoint_format):
        return {"format": "sharded", "host_bytes": sum(box.tensor.nbytes for box in
                                                       serial_state.own_parts(raw, optimizer).boxes),
                "is": "this rank's own parts of the model and its optimizer state"}
    slots = {slot for state in optimizer.state.values() for slot, value in state.items()
             if torch.is_tensor(value) and value.dim()}
    serial = raw.serial_numel * next(raw.parameters()).element_size() * (1 + len(slots))
    return {"format": "serial", "host_bytes": serial,
            "is": "the whole serial model and its optimizer state, gathered on every rank"}


def table(result):
    """The measured numbers beside the model's, one row each."""
    model = result["predicted"] or {}
    rows = [(name, f"{result[key] / 1e6:.1f} MB", f"{model[key] / 1e6:.1f} MB" if key in model else "-")
            for name, key in (("parameters", "parameters"), ("gradients", "gradients"),
                              ("optimizer state", "optimizer_state"), ("saved activations", "saved_activations"))]
    rows.append(("peak memory", f"{result['peak_memory_gb']:.3f} GB",
                 f"{model['peak_memory_gb']:.3f} GB" if model else "-"))
    step = model.get("step_time_s")
    measured = result["step_time_s"]
    saving = result["checkpoint_save"]
    rows.append((f"save ({saving['format']}, host)", f"{saving['host_bytes'] / 1e9:.3f} GB", "-"))
    rows.append(("step time (compute)", f"{measured * 1e3:.1f} ms" if measured is not None else "not timed",
                 f"{step * 1e3:.1f} ms on {model['system']}" if step else "-"))
    layout = result["layout"]
    stage = f", pipeline stage {result['pipeline_stage']}" if result.get("pipeline_stage") is not None else ""
    lines = [f"Dry run of rank {result['rank']} of {result['world_size']} (tp={layout['tp']}, cp={layout['cp']}, "
             f"dp={layout['dp']}{' ' + ' '.join(layout['flags'][2:]) if layout['flags'][2:] else ''}{stage}), config "
             f"{result['config']}, local batch {result['local_batch_size']}, {result['device']}; peak: "
             f"{result['peak_memory_is']}", "",
             f"| {'this rank':<20} | {'measured':>12} | {'performance model':>24} |",
             f"|{'-' * 22}|{'-' * 14}|{'-' * 26}|"]
    lines += [f"| {name:<20} | {measured:>12} | {model_value:>24} |" for name, measured, model_value in rows]
    return "\n".join(lines)


CPU_DRY_RUN_FLAGS = ["--local_batch_size", "1", "--amp_mode", "none"]  # a CPU: the smallest step, in fp32


def dry_run_in_own_process(args, timeout=None):
    """`train_mp.py --dry_run ... ARGS` on synthetic batches, in its own process (a process group is one per
    process): (its JSON, the last line printed; None), or (None; the line it failed with)."""
    command = [sys.executable, "train_mp.py", *args, "--data_loader_config", "synthetic"]
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"no result within {timeout} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return None, error_line(done.stderr, empty="no output")
    return json.loads(lines[-1]), None
