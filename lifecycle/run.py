"""A run's life around the loop each training script keeps for itself: start (flags into the config, the device, the
run directory, the checkpoint to resume from), restore, save and finish.

train.py (data parallel), train_mp.py (model parallel) and train_graph.py (CUDA Graphs) each read top to bottom:
setup -> data -> model, optimizer, resume -> wrap -> step function -> loop -> finish. What they share lives here
(the run) and in loop/ (the loop's decisions, meter, validation and reports), and takes what differs as arguments
(the model's state, the functions that load it); nothing here knows which script calls it.
"""
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

import resilience
from lifecycle import shards, signals
from lifecycle.checkpoint import (
    DamagedCheckpoint,
    get_rng_states,
    has_checkpoint,
    load_model_state,
    load_on_every_rank,
    previous_path,
    save_checkpoint,
    set_rng_states,
)
from lifecycle.cli import apply_overrides, check_stage_flags
from lifecycle.kernels import choose_kernels
from lifecycle.run_lock import RunDirectoryLock
from lifecycle.workers import WorkerStart
from resilience import host, peers, store
from utils import comm
from utils.errors import DISK_FULL, UserError, free_space, register_cleanup
from utils.layout import Grid, Layout
from utils.logging_utils import config_logger, log_to_file
from utils.YParams import YParams


def load_config(args):
    """Console logging, the launcher's local rank, and the named config of the YAML file; the UNet stage's flags on
    a ViT config refused; the run's first log line (rank 0; out.log begins with it too)."""
    config_logger()
    if args.local_rank is not None and "LOCAL_RANK" not in os.environ:  # torch.distributed.launch's --local-rank
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    params = YParams(args.yaml_config, args.config)
    check_stage_flags(args, params)
    if getattr(args, "dry_run", None) is None:  # a dry run's first line is its own (utils/comm.py)
        logging.info(first_line(args, params))
    return params


MODEL_NAMES = {"vit": "ViT", "unet": "UNet", "resnet": "ResNet"}


def first_line(args, params):
    """What the run trains, from which file and config: 'Training ViT: config/ViT.yaml, config short'."""
    model = params.get("model", "vit")
    name = MODEL_NAMES.get(model, model)
    if model == "resnet":
        name += f" ({args.arch or params.get('arch')})"  # the torchvision architecture
    benchy = args.enable_benchy if args.enable_benchy is not None else params.get("enable_benchy")
    return (f"{'Benchmarking' if benchy else 'Training'} {name}: {os.path.normpath(args.yaml_config)}, "
            f"config {args.config}")


@dataclass
class Run:
    """What the helpers need to know about this run (a record, not a trainer)."""
    args: object
    params: YParams
    device: torch.device
    exp_dir: str
    checkpoint_path: str
    resume_path: str = None
    checkpoint: dict = None
    rank: int = 0
    grid: Grid = None  # the process grid comm.init returned (its layout, its groups)
    lock: RunDirectoryLock = None
    writer: SummaryWriter = None
    # what the loop and the loaders ask of the job, handed to them (loop/ and loaders/ import no job code)
    stop_signal: Callable = signals.agreed_in_loop  # at each step boundary (collective): the agreed signal, or None
    settle: Callable = signals.settle  # after the loop's last boundary: the agreements still in flight are read
    resume_point: Callable = peers.resume_point  # what a restart resumes from, in words (the lines that stop a run)
    # loader workers started deaf to the stop signals; the ranks' agreements through the host's group and the store
    worker_start: WorkerStart = signals.SIGNAL_PROOF_START._replace(gather=host.gather_on_host, first=store.on_rank0)


def _make_run_dir(exp_dir, model):
    try:
        os.makedirs(os.path.join(exp_dir, "logs"), exist_ok=True)
    except OSError as err:
        if err.errno in DISK_FULL:  # the free space of the file system it would be on (its nearest existing parent)
            raise UserError(f"cannot create the run directory '{exp_dir}' ({err.strerror}; {free_space(exp_dir)} on "
                            "its file system); free disk space (or raise the quota), or choose another "
                            "--expdir") from None
        raise UserError(f"cannot create the run directory '{exp_dir}' ({err.strerror or err}); choose a writable "
                        "--expdir") from None
    if not os.access(exp_dir, os.W_OK):
        raise UserError(f"the run directory '{exp_dir}' is not writable; choose a writable --expdir")
    return RunDirectoryLock(exp_dir, model)


def start_run(args, params, grid, layout):
    """Flags into the config (batch sizes by the grid's "dp" group), the device, the run directory
    <expdir>/<config>/<layout>/<run_num>/ (locked; out.log; logs/) and the checkpoint to resume from.
    `grid`: what comm.init() returned; every rank calls it. From here on the job is watched (resilience/)."""
    resilience.attach(comm.get_store(), args.collective_timeout)  # one line when the job stops, not a hang
    apply_overrides(params, args, dp_size=grid.size("dp"), dp_rank=grid.rank("dp"))
    grid.layout.check(global_batch=params.global_batch_size)  # the pipeline's microbatches split the local batch
    signals.install()  # SIGTERM, SIGINT, SIGUSR1: stop at the next step boundary, with a checkpoint
    register_cleanup(signals.uninstall)
    if args.parallel == "dp" and comm.get_world_size() > 1:
        raise UserError("--parallel dp runs one process over all GPUs; launch a single task "
                        "(no torchrun/srun tasks), or keep the default --parallel ddp")
    if args.desired_acc is not None and params.get("model") != "resnet":
        raise UserError("--desired_acc needs a classification model (config/ResNet50.yaml)")
    if args.desired_acc is not None and not 0 < args.desired_acc <= 1:
        raise UserError(f"--desired_acc is {args.desired_acc}; give the top-1 accuracy as a fraction, e.g. 0.75")
    device = comm.get_device()
    choose_kernels(params, device)  # the attention kernel, cuDNN autotuning, denormals (lifecycle/kernels.py)

    dry_run = getattr(args, "dry_run", None)
    if dry_run is None and getattr(args, "dry_run_rank", 0):
        raise UserError("--dry_run_rank R picks the rank of a dry run; add --dry_run N (or drop --dry_run_rank)")
    if dry_run is not None and (args.resume or params.enable_benchy):
        raise UserError("--dry_run measures one rank of a layout without training; drop --resume and --enable_benchy")
    if dry_run is not None:  # one rank of a layout, measured (planning/dry_run.py): it writes nothing
        signals.stop_before_training("start-up")
        return Run(args, params, device, exp_dir=None, checkpoint_path=None, rank=comm.get_world_rank(), grid=grid)
    exp_dir = os.path.abspath(os.path.join(params.expdir, args.config, layout, args.run_num))
    params.experiment_dir = exp_dir
    checkpoint_path = os.path.join(exp_dir, "checkpoints", "ckpt.pt")
    run = Run(args, params, device, exp_dir, checkpoint_path, rank=comm.get_world_rank(), grid=grid)
    run.lock = store.on_rank0(lambda: _make_run_dir(exp_dir, params.get("model", "vit")))  # rank 0 creates, locks

    # the run directory's own checkpoint wins (a restarted job that passes --resume again goes on from its latest
    # state); rank 0 decides, so every rank starts at the same iteration
    own = store.on_rank0(lambda: has_checkpoint(checkpoint_path))
    run.resume_path = store.broadcast_from_rank0(checkpoint_path if own else args.resume)
    if args.resume and run.resume_path == checkpoint_path and os.path.abspath(args.resume) != checkpoint_path:
        logging.info(f"The run directory holds its own checkpoint; resuming from {checkpoint_path}, not {args.resume}")
    if run.resume_path and not params.enable_benchy:
        # rank 0 loads the newest good one of the run directory's two (or the --resume file) and checks it; every
        # other rank loads exactly that file at the same iteration, or the whole job stops
        run.checkpoint, run.resume_path = load_on_every_rank(
            run.resume_path, newest=run.resume_path == checkpoint_path,
            check=lambda checkpoint, path: check_written_by(checkpoint, path, args, params, checkpoint_path))
    if run.rank == 0:
        log_to_file(os.path.join(exp_dir, "out.log"))
    signals.stop_before_training("start-up", exp_dir)  # a signal since the script's first line: before the loaders
    if run.rank == 0:
        params.log()
    return run


def check_written_by(checkpoint, path, args, params, checkpoint_path):
    """Refuse (a UserError) a checkpoint at `path` that train.py did not write, or that another config wrote."""
    if not isinstance(checkpoint, dict) or not {"model", "iteration", "config_name"} <= set(checkpoint):
        what = ("move it away to train from the beginning here, or start a new --run_num (or --expdir)"
                if path in (checkpoint_path, previous_path(checkpoint_path))
                else "pass one of a run directory's checkpoints to --resume")
        raise UserError(f"'{path}' is not a checkpoint written by train.py (a torch file without its "
                        f"model, iteration and config); {what}")
    written_by = (checkpoint["config_name"], checkpoint["params"].get("model", "vit"))
    if written_by != (args.config, params.get("model", "vit")):
        raise UserError(f"checkpoint '{path}' was written by config '{written_by[0]}' (model "
                        f"{written_by[1]}), not '{args.config}' (model {params.get('model', 'vit')}); resume "
                        "with the same --yaml_config and --config, or start a new --run_num or --expdir")


def set_run_length(params, steps_per_epoch):
    """num_iters from num_epochs where the config counts epochs (UNet, ResNet stages)."""
    if params.get("num_iters") is None:
        params.num_iters = params.num_epochs * steps_per_epoch
        logging.info(f"{params.num_epochs} epochs of {steps_per_epoch} steps: num_iters {params.num_iters}")


def restore(run, model, optimizer, scheduler, scaler, load_model=load_model_state, load_optimizer=None):
    """Load the run's checkpoint (if any) into model, optimizer, schedule and scaler and set this rank's RNG.
    Returns (start iteration, partial sums of the interrupted epoch or None). `load_model(model, state, path)`
    and `load_optimizer(optimizer, state)` put the saved (whole-model) states in; a model-parallel script passes
    functions that take its shards."""
    if run.params.enable_jit:  # inductor's compile workers, before the first compile and after every refusal of
        signals.start_compile_workers()  # the run (the graph scripts' too): they ignore Slurm's signals
    checkpoint, path = run.checkpoint, run.resume_path
    run.checkpoint = None  # free the memory once restored
    if checkpoint is None:
        signals.stop_before_training("the data loaders' start and the model's build", run.exp_dir)
        return 0, None
    checkpoint = shards.open_sharded(checkpoint, path)  # a sharded one: each rank reads its part as it loads
    problem = None
    try:
        load_model(model, checkpoint["model"], path)
        optimizer_state = checkpoint["optimizer"]
        if load_optimizer is None and isinstance(optimizer_state, shards.OptimizerShards):
            optimizer_state = optimizer_state.whole()  # a serial model reads every tensor whole
        (load_optimizer or type(optimizer).load_state_dict)(optimizer, optimizer_state)
    except DamagedCheckpoint as err:  # a shard: every rank stops with one line
        problem = str(err)
    if isinstance(checkpoint["model"], shards.ModelShards):
        shards.agree(problem)
        logging.info(checkpoint["model"].shards.describe_read())  # rank 0's: its own part only
    elif problem:
        raise UserError(problem)
    scheduler.load_state_dict(checkpoint["scheduler"])
    scaler.load_state_dict(checkpoint["scaler"])
    rng_states = checkpoint["rng_states"]
    set_rng_states(rng_states[run.rank] if len(rng_states) == comm.get_world_size() else rng_states[0])
    start_iter = checkpoint["iteration"]
    peers.note_checkpoint(path, start_iter)
    logging.info(f"Resumed from {path} at iteration {start_iter}")
    written_at = checkpoint.get("layout")  # checkpoints hold the serial model: any layout resumes any other's
    # a record from before a field existed (cp_method) has that field's default
    if isinstance(written_at, dict) and {**dataclasses.asdict(Layout()), **written_at} != dataclasses.asdict(
            run.grid.layout):
        grid = ", ".join(f"{name.upper()} = {written_at.get(name, '?')}" for name in ("dp", "tp", "cp"))
        grid += f", PP = {written_at['pp']}" if written_at.get("pp", 1) > 1 else ""
        logging.info(f"The checkpoint was written at {grid}; resumed at {run.grid.describe()}")
    if start_iter >= run.params.num_iters:
        logging.info(f"This run already finished its {run.params.num_iters} iterations; "
                     "pass a new --run_num (or raise --num_iters) to train again")
    signals.stop_before_training("the restore", run.exp_dir)  # one during the loaders, the build, the load
    return start_iter, checkpoint.get("epoch_sums")


def save(run, model_state, optimizer_state, scheduler, scaler, iters, meter):
    """Collective checkpoint: every rank calls it (RNG states and epoch sums are gathered); world rank 0 writes
    `model_state` and `optimizer_state`, which must be the whole model's there (a model-parallel script gathers
    its shards first), or each rank writes its own part of them (`model_state` a shards.ToWrite; lifecycle/shards.py)
    and rank 0 the checkpoint file that names the parts. If a write fails every rank stops with the same message and
    the previous checkpoint stays."""
    start = time.time()
    index = None
    if isinstance(model_state, shards.ToWrite):
        index = shards.write(run.checkpoint_path, model_state, iters)
        model_state, optimizer_state = shards.SHARDED, None
    rng_states = [get_rng_states()]
    if dist.is_initialized():
        rng_states = [None] * dist.get_world_size()
        dist.all_gather_object(rng_states, get_rng_states())
    state = {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
             "scaler": scaler.state_dict(), "iteration": iters, "rng_states": rng_states,
             "epoch_sums": meter.state_dict(), "config_name": run.params.config_name,
             "params": run.params.params, "layout": dataclasses.asdict(run.grid.layout)}  # the model is serial
    if index is not None:
        state["shards"] = index
    store.on_rank0(lambda: save_checkpoint(run.checkpoint_path, state))
    if run.rank == 0:  # the shards of earlier (sharded) saves that neither checkpoint names
        shards.remove_unnamed(run.checkpoint_path, previous_path(run.checkpoint_path), index and index["folder"])
    peers.note_checkpoint(run.checkpoint_path, iters)  # what a rank that loses a peer says the job resumes from
    logging.info(f"Checkpoint of iteration {iters} written in {time.time() - start:.1f} s")
    if signals.stopped_by():  # the stop's checkpoint: a signal from now on is ignored (signals.ending)
        signals.ending(signals.EXIT_CODE, at_once=False)


def finish_run(run):
    """The last lines of every run: close TensorBoard, wait for all ranks, say done, leave the process group,
    free the run directory; after a stop on a signal, exit with signals.EXIT_CODE. Once done is said, a signal ends
    the process at once with the run's own exit code (signals.ending), and the group's teardown cannot hang
    (utils/compat.leave_process_group)."""
    if run.writer is not None:
        run.writer.close()
        logging.info(f"TensorBoard logs: {os.path.join(run.exp_dir, 'logs')}  (tensorboard --logdir {run.exp_dir})")
    comm.barrier()
    logging.info(f"DONE ---- rank {run.rank}")
    signals.ending(signals.EXIT_CODE if signals.stopped_by() else 0)
    comm.destroy()
    if run.lock is not None:
        run.lock.release()
    if signals.stopped_by():  # checkpointed: the submit scripts requeue the job on this exit code
        sys.exit(signals.EXIT_CODE)
