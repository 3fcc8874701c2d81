"""Train the model a YAML config names: on one device, or data parallel (DDP) over many.

    python train.py --yaml_config config/ViT.yaml --config short --data_dir /path/to/era5
    python train.py --yaml_config config/UNet.yaml --config short --data_dir /path/to/cosmo
    python train.py --yaml_config config/ResNet50.yaml --config bs128 --data_dir /path/to/cifar100
    torchrun --nproc_per_node 4 train.py --config bs64_opt --data_dir ...   # 4 GPUs, or 4 CPU processes
    sbatch -N 4 submit_pm_dp.sh --config=bs256_opt                          # Perlmutter, 16 GPUs

The run directory is <expdir>/<config>/<N>GPU/<run_num>/ with out.log, logs/ (TensorBoard) and
checkpoints/ckpt.pt; starting again in the same directory resumes from that checkpoint.
"""
import logging
import os
import time

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from networks import get_model
from utils import comm, get_data_loader_distributed
from utils.benchy import benchy_output_path, run_benchmarks
from utils.cli import training_parser
from utils.errors import exit_on_user_error
from utils.flops import Peak, train_flops_per_sample
from utils.loss import get_loss
from utils.metrics import get_train_metrics, get_valid_metrics
from utils.optim import get_lr_scheduler, get_optimizer
from utils.profiling import CudaProfilerWindow, nvtx_range
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
    args = training_parser(__doc__.splitlines()[0]).parse_args(argv)
    params = load_config(args)
    comm.init(rendezvous_timeout=args.dist_timeout)  # every rank is a data-parallel replica: "dp" is the world
    run = start_run(args, params, layout=f"{comm.get_world_size()}GPU")
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
    logging.info(f"Number of parameters: {sum(p.numel() for p in model.parameters()):,}")
    optimizer = get_optimizer(params, model)
    scheduler = get_lr_scheduler(params, optimizer, steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=params.amp_mode == "fp16")
    start_iter, epoch_sums = restore(run, raw_model, optimizer, scheduler, scaler)

    # wrap: DDP all-reduces the gradients over the data-parallel group during backward
    if comm.get_size("dp") > 1 and not args.noddp:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                        process_group=comm.get_group("dp"), bucket_cap_mb=args.bucket_cap_mb,
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

    # devices sharing the work: one per rank, or every visible GPU under DataParallel
    num_devices = (torch.cuda.device_count() if args.parallel == "dp" and device.type == "cuda"
                   else comm.get_size("dp"))
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
        save(run, raw_model.state_dict(), optimizer.state_dict(), scheduler, scaler, iters, meter)

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
