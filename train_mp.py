"""Train the ViT with tensor (tp) and context (cp) parallelism, composed with data parallelism (dp).

    torchrun --nproc_per_node 4 train_mp.py --config mp --tensor_parallel 4 --data_dir /path/to/era5
    torchrun --nproc_per_node 4 train_mp.py --config mp --tensor_parallel 2 --context_parallel 2 ...
    sbatch -N 4 submit_pm_mp.sh --config=mp --tensor_parallel=4                 # Perlmutter, 16 GPUs

Ranks form a tp x cp x dp grid in the order --parallel_order (first name fastest). The run directory is
<expdir>/<config>/<tp*cp>MP/<run_num>/; checkpoints hold the serial model's state (gathered on save, sharded
on load), so they resume at any layout and in train.py.
"""
import logging
import os
import time

import torch
from torch.nn.parallel import DataParallel

from distributed.grad_scaler import ModelParallelGradScaler
from distributed.helpers import init_params_for_shared_weights
from distributed.mappings import init_ddp_model_and_reduction_hooks
from distributed.serial_state import (
    load_serial_optimizer_state,
    load_serial_state_dict,
    serial_optimizer_state,
    serial_state_dict,
)
from networks import get_model
from utils import comm, get_data_loader_distributed
from utils.benchy import benchy_output_path, run_benchmarks
from utils.cli import training_parser
from utils.errors import exit_on_user_error
from utils.flops import Peak, train_flops_per_sample
from utils.loss import get_loss
from utils.metrics import get_train_metrics, get_valid_metrics
from utils.optim import get_lr_scheduler, get_optimizer
from utils.profiling import CudaProfilerWindow, nvtx_range, peak_memory_gb
from utils.training import (
    NONFINITE_CHECK_EVERY,
    AutocastForward,
    EpochMeter,
    finish_run,
    load_config,
    log_step0,
    log_training_epoch,
    log_validation,
    open_tensorboard,
    restore,
    save,
    set_run_length,
    set_train_mode,
    start_run,
    validate,
)


@exit_on_user_error
def main(argv=None):
    parser = training_parser(__doc__.splitlines()[0])
    parser.add_argument("--tensor_parallel", type=int, default=1, help="ranks that split each layer's weights (tp)")
    parser.add_argument("--context_parallel", type=int, default=1, help="ranks that split the sequence (cp)")
    parser.add_argument("--parallel_order", type=str, default="tp-cp-dp", help="rank order, first name fastest")
    args = parser.parse_args(argv)
    params = load_config(args)
    # the tp x cp x dp grid: groups "tp", "cp", "tp-cp", "dp", "dp-cp"; dp = world / (tp * cp)
    params.update({"tp": args.tensor_parallel, "cp": args.context_parallel, "order": args.parallel_order})
    comm.init(params, rendezvous_timeout=args.dist_timeout)
    run = start_run(args, params, layout=f"{args.tensor_parallel * args.context_parallel}MP")
    device = run.device

    # data: each data-parallel rank reads its own shard
    logging.info(f"rank {run.rank}, begin data loader init")
    train_loader = get_data_loader_distributed(params, train=True)
    valid_loader = get_data_loader_distributed(params, train=False)
    logging.info(f"rank {run.rank}, data loader initialized with config {params.data_loader_config}")
    sample_shape = train_loader.sample_shape
    steps_per_epoch = len(train_loader)
    set_run_length(params, steps_per_epoch)

    # model, optimizer, schedule (same initial weights on every rank), then the checkpoint's state if resuming
    torch.manual_seed(params.seed)
    model = get_model(params).to(device)
    # channels_last: convolutions run on NHWC (NDHWC) tensor-core kernels without transposes
    memory_format = torch.channels_last if len(sample_shape) == 3 else torch.channels_last_3d
    if params.enable_nhwc:
        model = model.to(memory_format=memory_format)
    raw_model = model  # unwrapped: what checkpoints hold
    if comm.get_size("tp-cp") > 1:
        init_params_for_shared_weights(model)  # copies of shared weights equal across the model-parallel group
    logging.info(f"Number of parameters on this rank: {sum(p.numel() for p in model.parameters()):,}")
    logging.info(f"Scaffolding memory high watermark: {peak_memory_gb(device):.4f} GB.")
    optimizer = get_optimizer(params, model)
    scheduler = get_lr_scheduler(params, optimizer, steps_per_epoch)
    scaler = ModelParallelGradScaler(device.type, "tp-cp", enabled=params.amp_mode == "fp16")  # skip steps together
    start_iter, epoch_sums = restore(run, raw_model, optimizer, scheduler, scaler, load_serial_state_dict,
                                     lambda opt, state: load_serial_optimizer_state(raw_model, opt, state))

    # wrap: DDP averages the gradients over "dp"; its hook also sums those of cp-shared weights over "cp"
    if comm.get_world_size() > 1 and not args.noddp:
        device_ids = [device.index] if device.type == "cuda" else None
        model = init_ddp_model_and_reduction_hooks(model, device_ids, device_ids, bucket_cap_mb=args.bucket_cap_mb,
                                                   broadcast_buffers=not args.disable_broadcast_buffers,
                                                   gradient_as_bucket_view=args.disable_broadcast_buffers)
    elif args.parallel == "dp":
        # one process scatters each batch over all visible GPUs (CPU: as is); each replica's thread enters autocast
        model = DataParallel(AutocastForward(model, device.type, params.amp_dtype, params.amp_enabled))
    if params.enable_jit:
        model = torch.compile(model)  # compiling the DDP model lets its optimizer split graphs at buckets
    loss_fn = get_loss(params)
    metrics_fn = get_valid_metrics(params)
    train_metrics_fn = get_train_metrics(params)
    autocast = torch.autocast(device.type, dtype=params.amp_dtype, enabled=params.amp_enabled)
    freeze_bn = params.get("freeze_bn", False)

    def to_device(inp, tar):
        inp = inp.to(device, non_blocking=True)
        if params.enable_nhwc:
            inp = inp.contiguous(memory_format=memory_format)
        return inp, tar.to(device, non_blocking=True)

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

    # devices sharing the model's FLOPs: every rank of the grid, or every visible GPU under DataParallel
    num_devices = (torch.cuda.device_count() if args.parallel == "dp" and device.type == "cuda"
                   else comm.get_world_size())
    flops_per_sample = train_flops_per_sample(get_model, params, sample_shape)
    peak = Peak(device, params.amp_dtype)
    logging.info(f"Training FLOPs per sample: {flops_per_sample:.4g}; {peak.describe()}")

    if params.enable_benchy:
        set_train_mode(model, freeze_bn)
        run_benchmarks(params, train_loader, to_device, train_step, device, benchy_output_path(run.exp_dir),
                       flops_per_sample, peak, num_devices)
        finish_run(run)
        return

    num_iters = params.num_iters
    stop_iter = min(num_iters, args.stop_at_iter or num_iters)
    interval = params.checkpoint_interval
    log_freq = params.get("log_freq")
    profiler_window = CudaProfilerWindow(args.profile_epoch, args.profile_iters)  # every rank: one report each
    meter = EpochMeter(device, train_loader)
    open_tensorboard(run, start_iter)
    if start_iter == 0:
        log_step0(run, model, train_loader.first_batch(), valid_loader, to_device, loss_fn, metrics_fn, autocast)

    def checkpoint(iters):
        meter.stop_if_not_finite(iters)  # never a nan checkpoint over a good one
        # gathered to the serial layout on every rank (collective), written by rank 0
        save(run, serial_state_dict(raw_model), serial_optimizer_state(raw_model, optimizer), scheduler, scaler,
             iters, meter)

    logging.info("Starting Training Loop...")
    iters = start_iter
    while iters < stop_iter:
        epoch, first_step = divmod(iters, steps_per_epoch)
        train_loader.set_epoch(epoch, skip=first_step)  # resume at the same data position
        meter.start(epoch_sums if iters == start_iter and first_step else None)
        set_train_mode(model, freeze_bn)
        comm.synchronize(device)
        epoch_start = report_start = time.time()
        for i, (inp, tar) in enumerate(train_loader, start=first_step):
            profiler_window.step(epoch, i)
            with nvtx_range(f"step {i}"):
                with nvtx_range(f"data copy in {i}"):
                    inp, tar = to_device(inp, tar)
                gen, loss = train_step(inp, tar)
            scheduler.step()  # outside the step: a benchmark or a captured graph must not advance it
            meter.add(loss, train_metrics_fn(gen.detach(), tar))
            iters += 1
            if i == 1:
                logging.info(f" Memory usage after forward pass: {peak_memory_gb(device):.4f} GB.")
            if log_freq and i % log_freq == 0:  # the ResNet stage's progress line (img/s since the last one)
                comm.synchronize(device)
                now, steps = time.time(), min(log_freq, meter.steps)
                logging.info(f"Epoch: {epoch + 1}, Iteration: {i}, "
                             f"Avg img/sec: {steps * params.global_batch_size / (now - report_start):.2f}")
                report_start = now
            if iters % NONFINITE_CHECK_EVERY == 0:
                meter.stop_if_not_finite(iters)
            if interval and iters % interval == 0 and iters % steps_per_epoch and iters < stop_iter:
                checkpoint(iters)  # mid-epoch; at an epoch's end it waits for the epoch's report
            if iters >= stop_iter:
                break
        profiler_window.end_epoch()
        comm.synchronize(device)
        epoch_time = time.time() - epoch_start
        meter.stop_if_not_finite(iters)
        if iters % steps_per_epoch and iters < num_iters:  # --stop_at_iter mid-epoch: reported after the resume
            logging.info(f"Stopped at iteration {iters} (--stop_at_iter); starting again resumes here")
            break

        train_means = meter.means()
        log_training_epoch(run, epoch, iters, epoch_time, meter.steps, train_means, optimizer.param_groups[0]["lr"],
                           lambda samples_per_sec: flops_per_sample * samples_per_sec / num_devices, peak)
        val_start = time.time()
        val_means, val_batch = validate(model, valid_loader, to_device, loss_fn, metrics_fn, autocast)
        log_validation(run, iters, val_means, val_batch, time.time() - val_start, train_means)
        if params.lr_schedule == "plateau" and iters % steps_per_epoch == 0:  # whole epochs only (resume)
            scheduler.end_epoch(val_means["loss"])
        meter.start()
        if interval and iters % interval == 0 and iters < stop_iter:
            checkpoint(iters)  # after the epoch's report: a resumed run never misses its points
        if args.desired_acc is not None and val_means["Accuracy/top1/valid"] >= args.desired_acc:
            logging.info(f"Reached the desired validation accuracy {args.desired_acc} at iteration {iters}; "
                         "stopping")
            break

    if iters > start_iter or not os.path.isfile(run.checkpoint_path):
        checkpoint(iters)
    finish_run(run)


if __name__ == "__main__":
    main()
