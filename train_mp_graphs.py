"""Train as train_mp.py does (tp x cp x dp ViT), with the whole training step captured in a CUDA graph.

    torchrun --nproc_per_node 4 train_mp_graphs.py --config mp --tensor_parallel 4 --data_dir /path/to/era5
    torchrun --nproc_per_node 4 train_mp_graphs.py --config mp --tensor_parallel 2 --context_parallel 2 ...
    TRAINING_SCRIPT=train_mp_graphs.py sbatch -N 4 submit_pm_mp.sh --config=mp --tensor_parallel=4

`diff train_mp.py train_mp_graphs.py` is the same lesson as `diff train.py train_graph.py` (loop/cuda_graphs.py):
the tp/cp collectives, DDP's all-reduce with its cp hook and the optimizer are captured with the step.

Ranks form a tp x cp x dp grid in the order --parallel_order (first name fastest). The run directory is
<expdir>/<config>/<tp*cp>MP/<run_num>/; checkpoints hold the serial model's state (gathered on save, sharded
on load), so they resume at any layout and in train.py.
"""
import lifecycle.early_signals  # noqa: F401 (first: SIGTERM, SIGINT, SIGUSR1 recorded while torch imports)

# isort: split
import logging

import torch

from distributed import bands, pipeline, serial_state
from distributed.grad_scaler import ModelParallelGradScaler
from distributed.parallelize import Options, parallelize
from lifecycle.cli import model_parallel_parser
from lifecycle.run import finish_run, load_config, restore, save, set_run_length, start_run
from loaders import get_data_loader_distributed
from loop import cuda_graphs
from loop.benchy import run_benchmarks
from loop.flops import Peak, devices_in_use, train_flops_per_sample
from loop.meter import EpochMeter
from loop.milestones import Milestones
from loop.profiling import CudaProfilerWindow, nvtx_range, peak_memory_gb
from loop.reporting import log_step0, log_training_epoch, log_validation, open_tensorboard
from loop.validation import set_train_mode, validate
from networks import get_model
from planning import dry_run, perf_model
from resilience.exits import exit_on_user_error
from task.loss import get_loss
from task.metrics import get_train_metrics, get_valid_metrics
from task.optim import get_lr_scheduler, get_optimizer
from utils import comm
from utils.layout import Layout


@exit_on_user_error
def main(argv=None):
    args = model_parallel_parser(__doc__.splitlines()[0]).parse_args(argv)  # + layout, memory and dry-run flags
    params = load_config(args)
    layout = Layout.from_flags(args, args.dry_run or comm.world_size_to_be())  # tp x cp x dp, checked once
    if args.dry_run:  # this process is one rank of the layout, the others stand-ins (planning/dry_run.py)
        dry_run.join(layout, args.dry_run_rank)
    grid = comm.init(layout, rendezvous_timeout=args.dist_timeout, collective_timeout=args.collective_timeout)
    run = start_run(args, params, grid, layout=layout.name)
    device = run.device
    cuda_graphs.check_support(params, args, device, script=__file__)

    # data: each data-parallel rank reads its own shard
    logging.info(f"rank {run.rank}, begin data loader init")
    band = bands.Band.of_config(params, grid["cp"])  # cp > 1: this rank's tokens lie in a band of image rows
    params.read_rows = band.rows  # and its loaders read only those rows of each field (distributed/bands.py)
    train_loader = get_data_loader_distributed(params, train=True, worker_start=run.worker_start)
    valid_loader = get_data_loader_distributed(params, train=False, worker_start=run.worker_start)
    logging.info(f"rank {run.rank}, data loader initialized with config {params.data_loader_config}")
    sample_shape = train_loader.sample_shape
    steps_per_epoch = len(train_loader)
    set_run_length(params, steps_per_epoch)

    # model (same initial weights on every rank): the serial ViT, split by the recipe below
    torch.manual_seed(params.seed)
    model = get_model(params)  # on the CPU: the recipe moves to the device only what this rank keeps
    # channels_last: convolutions run on NHWC (NDHWC) tensor-core kernels without transposes
    memory_format = torch.channels_last if len(sample_shape) == 3 else torch.channels_last_3d
    if params.enable_nhwc:
        model = model.to(memory_format=memory_format)
    raw_model = model  # unwrapped: what checkpoints hold

    stream = cuda_graphs.side_stream(device)  # warm-up and capture run on it, and DDP must be built on it
    cuda_graphs.enter_stream(stream)  # the wrap is the eager script's; check_support refused --enable_jit (and dp)
    # wrap for data parallelism over "dp"
    model = parallelize(model, grid, device, Options.from_flags(args, params))  # the recipe: distributed/parallelize.py
    logging.info(f"Number of parameters on this rank: {sum(p.numel() for p in raw_model.parameters()):,}")
    logging.info(f"Scaffolding memory high watermark: {peak_memory_gb(device):.4f} GB.")
    logging.info(perf_model.predicted_memory_line(params, layout, ddp=not args.noddp))  # against the line at i == 1

    # the optimizer on the wrapped parameters (--fsdp shards them), then the checkpoint's state if resuming
    optimizer = get_optimizer(params, raw_model)
    scheduler = get_lr_scheduler(params, optimizer, steps_per_epoch)
    scaler = ModelParallelGradScaler(device.type, grid["tp-cp-pp"], enabled=params.amp_mode == "fp16")  # skip together
    start_iter, epoch_sums = restore(run, raw_model, optimizer, scheduler, scaler, serial_state.load_serial_state_dict,
                                     lambda opt, state: serial_state.load_serial_optimizer_state(raw_model, opt, state))

    cuda_graphs.leave_stream(stream)  # back on the default stream, which waits for the wrap's work
    loss_fn = get_loss(params)
    metrics_fn = get_valid_metrics(params)
    train_metrics_fn = get_train_metrics(params)
    autocast = torch.autocast(device.type, dtype=params.amp_dtype, enabled=params.amp_enabled)

    def to_device(inp, tar):
        inp = inp.to(device, non_blocking=True)
        if params.enable_nhwc:
            inp = inp.contiguous(memory_format=memory_format)
        return inp, band.whole(tar.to(device, non_blocking=True))  # the targets' bands gathered over cp

    def train_step(inp, tar):
        """One optimisation step on a batch already on the device; returns (prediction, loss)."""
        optimizer.zero_grad(set_to_none=True)
        with nvtx_range("forward"), autocast:
            gen = model(inp)
            loss = loss_fn(gen, tar)
        with nvtx_range("backward"):
            scaler.scale(loss).backward()
        with nvtx_range("optimizer"):
            scaler.step(optimizer)  # a plain optimizer.step() when the scaler is disabled
            scaler.update()
        return gen, loss

    # capture: static input and target buffers shaped like the loader's batches (the target has the output's
    # channels), the lr made a device tensor (capturable Adam), warm-up steps on the side stream, then train_step
    # recorded once, all-reduce and optimizer included
    static_inp, static_tar = to_device(*train_loader.first_batch())
    graphed_step = cuda_graphs.GraphedStep(train_step, (static_inp, static_tar), stream, model, optimizer, scaler)

    num_devices = devices_in_use(args, device)  # one per rank, or every visible GPU under DataParallel
    if layout.pp > 1:  # the stages run a schedule over microbatches instead (distributed/pipeline.py)
        train_step = pipeline.train_step(model, optimizer, scaler, loss_fn, autocast)
    if args.dry_run:  # one rank of the layout measured, the others stand-ins (planning/dry_run.py), not training
        return dry_run.report(run, model, raw_model, train_loader.first_batch(), to_device, train_step, optimizer)
    flops_per_sample = train_flops_per_sample(get_model, params, sample_shape)
    peak = Peak(device, params.amp_dtype, convolutions=params.model != "vit")  # TF32 convolutions in fp32
    logging.info(f"Training FLOPs per sample: {flops_per_sample:.4g}; {peak.describe()}")
    if params.enable_benchy:  # time the loader, the step, and both (loop/benchy.py) instead of training
        return run_benchmarks(run, model, train_loader, to_device, graphed_step, flops_per_sample / num_devices, peak,
                              optimizer)

    milestones = Milestones.of_run(run, steps_per_epoch)  # when an epoch ends, a checkpoint is due, the run stops
    meter = EpochMeter(device, train_loader, params, resume_point=run.resume_point)
    # every rank: one report each (Nsight), one trace each (--torch_profile)
    profiler_window = CudaProfilerWindow(args.profile_epoch, args.profile_iters, trace=args.torch_profile)
    open_tensorboard(run, start_iter)
    if start_iter == 0:
        log_step0(run, model, train_loader.first_batch(), valid_loader, to_device, loss_fn, metrics_fn, autocast)

    def checkpoint(iters):
        meter.stop_if_not_finite(iters)  # never a nan checkpoint over a good one
        save(run, *serial_state.checkpoint_states(raw_model, optimizer, args.checkpoint_format),  # serial or sharded
             scheduler, scaler, iters, meter)

    logging.info("Starting Training Loop...")
    iters, stop = start_iter, milestones.stop(start_iter)
    while not stop:
        epoch, first_step = divmod(iters, steps_per_epoch)
        train_loader.set_epoch(epoch, skip=first_step)  # resume at the same data position
        set_train_mode(model, params)
        meter.start(iters, epoch_sums if iters == start_iter else None)  # a resumed epoch keeps its sums
        for i, (inp, tar) in enumerate(train_loader, start=first_step):
            profiler_window.step(epoch, i)
            with nvtx_range(f"step {i}"):
                with nvtx_range(f"data copy in {i}"):
                    inp, tar = to_device(inp, tar)
                gen, loss = graphed_step(inp, tar)  # copy into the static buffers, replay, clone the outputs
            scheduler.step()  # outside the step: a benchmark or a captured graph must not advance it
            iters += 1
            meter.add(loss, train_metrics_fn(gen.detach(), tar))  # the epoch's sums; progress line; nan check
            if i == 1:
                logging.info(f" Memory usage after forward pass: {peak_memory_gb(device):.4f} GB.")

            val_means = None
            if milestones.epoch_ends(iters):  # the epoch's report, then validation
                profiler_window.stop()  # the window ends with the epoch, before its report
                train_means = log_training_epoch(run, meter, iters, optimizer, flops_per_sample / num_devices, peak)
                profiler_window.write_trace()  # after the report: writing a trace is not the epoch's time
                val_means, val_batch, val_seconds = validate(model, valid_loader, to_device, loss_fn, metrics_fn,
                                                             autocast)
                log_validation(run, iters, val_means, val_batch, val_seconds, train_means)
                scheduler.end_epoch(val_means["loss"])  # the plateau schedule; a no-op for the others
            stop = milestones.stop(iters, val_means)
            if stop or milestones.checkpoint_due(iters):
                checkpoint(iters)
            if stop:
                break
    profiler_window.close()  # a window the stop cut short; a trace never reached is said
    finish_run(run)


if __name__ == "__main__":
    main()
