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
import torch.distributed as dist
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.utils.data import default_collate
from torch.utils.tensorboard import SummaryWriter

from networks import get_model
from utils import comm, get_data_loader_distributed
from utils.benchy import run_benchmarks
from utils.checkpoint import get_rng_states, load_checkpoint, save_checkpoint, set_rng_states
from utils.cli import apply_overrides, training_parser
from utils.errors import UserError, exit_on_user_error
from utils.flops import peak_flops, train_flops_per_sample
from utils.logging_utils import config_logger, log_to_file
from utils.loss import get_loss
from utils.metrics import get_train_metrics, get_valid_metrics
from utils.optim import get_lr_scheduler, get_optimizer
from utils.plots import get_figure
from utils.profiling import CudaProfilerWindow, nvtx_range
from utils.YParams import YParams


def all_reduce_sum(tensor):
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def all_reduce_mean(tensor):
    return all_reduce_sum(tensor) / comm.get_world_size()


def validate(model, valid_loader, to_device, loss_fn, metrics_fn, device, autocast):
    """Mean loss and metrics over the whole validation set (all ranks), and the last batch for a figure."""
    model.eval()
    sums = None
    with torch.inference_mode():
        for inp, tar in valid_loader:
            inp, tar = to_device(inp, tar)
            with autocast:
                gen = model(inp)
                loss = loss_fn(gen, tar)
            batch_size = inp.shape[0]
            values = {"loss": loss.float() * batch_size, "count": torch.tensor(float(batch_size), device=device)}
            values.update({tag: metric.float().sum() for tag, metric in metrics_fn(gen, tar).items()})
            sums = values if sums is None else {k: sums[k] + values[k] for k in sums}
    totals = all_reduce_sum(torch.stack(list(sums.values())))
    means = {key: (total / totals[1]).item() for key, total in zip(sums, totals)}
    del means["count"]
    return means, (inp, tar, gen)


def set_train_mode(model, freeze_bn):
    """model.train(); with `freeze_bn` the BatchNorm layers stay in eval mode (running statistics, no updates)."""
    model.train()
    if freeze_bn:
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.eval()


def finish_run(world_rank):
    """The last lines of every run: wait for all ranks, say done, leave the process group."""
    comm.barrier()
    logging.info(f"DONE ---- rank {world_rank}")
    if dist.is_initialized():
        dist.destroy_process_group()


def checkpoint_state(model, optimizer, scheduler, scaler, iters, params):
    """Everything a run needs to continue exactly: weights, optimizer, schedule, scaler, RNG of every rank."""
    rng_states = [get_rng_states()]
    if dist.is_initialized():
        rng_states = [None] * dist.get_world_size()
        dist.all_gather_object(rng_states, get_rng_states())
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "iteration": iters, "rng_states": rng_states,
            "config_name": params.config_name, "params": params.params}


@exit_on_user_error
def main(argv=None):
    args = training_parser(__doc__.splitlines()[0]).parse_args(argv)
    config_logger()
    params = YParams(args.yaml_config, args.config)
    world_size, world_rank, local_rank = comm.init()
    apply_overrides(params, args, dp_size=world_size, dp_rank=world_rank)
    if args.parallel == "dp" and world_size > 1:
        raise UserError("--parallel dp runs one process over all GPUs; launch a single task "
                        "(no torchrun/srun tasks), or keep the default --parallel ddp")
    if args.desired_acc is not None and params.get("model") != "resnet":
        raise UserError("--desired_acc needs a classification model (config/ResNet50.yaml)")
    if args.desired_acc is not None and not 0 < args.desired_acc <= 1:
        raise UserError(f"--desired_acc is {args.desired_acc}; give the top-1 accuracy as a fraction, e.g. 0.75")
    device = comm.get_device()
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = params.cudnn_benchmark
    else:
        torch.set_flush_denormal(True)  # tiny (denormal) floats slow CPU arithmetic down by 2-4x

    exp_dir = os.path.abspath(os.path.join(params.expdir, args.config, f"{world_size}GPU", args.run_num))
    params.experiment_dir = exp_dir
    checkpoint_path = os.path.join(exp_dir, "checkpoints", "ckpt.pt")
    resume_path = args.resume or (checkpoint_path if os.path.isfile(checkpoint_path) else None)
    checkpoint = load_checkpoint(resume_path) if resume_path and not params.enable_benchy else None
    if checkpoint is not None:
        written_by = (checkpoint["config_name"], checkpoint["params"].get("model", "vit"))
        if written_by != (args.config, params.get("model", "vit")):
            raise UserError(f"checkpoint '{resume_path}' was written by config '{written_by[0]}' (model "
                            f"{written_by[1]}), not '{args.config}' (model {params.get('model', 'vit')}); resume "
                            "with the same --yaml_config and --config, or start a new --run_num or --expdir")
    if world_rank == 0:
        os.makedirs(os.path.join(exp_dir, "logs"), exist_ok=True)
        log_to_file(os.path.join(exp_dir, "out.log"))
        params.log()

    logging.info(f"rank {world_rank}, begin data loader init")
    train_loader, train_dataset, train_sampler = get_data_loader_distributed(params, train=True)
    valid_loader, valid_dataset, _ = get_data_loader_distributed(params, train=False)
    logging.info(f"rank {world_rank}, data loader initialized with config {params.data_loader_config}")
    sample_shape = tuple(train_dataset[0][0].shape)
    steps_per_epoch = len(train_loader)
    if params.get("num_iters") is None:  # the UNet and ResNet stages count epochs
        params.num_iters = params.num_epochs * steps_per_epoch
        logging.info(f"{params.num_epochs} epochs of {steps_per_epoch} steps: num_iters {params.num_iters}")

    torch.manual_seed(params.seed)  # same initial weights on every rank
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
    start_iter = 0
    if checkpoint is not None:
        raw_model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_iter = checkpoint["iteration"]
        rng_states = checkpoint["rng_states"]
        set_rng_states(rng_states[world_rank] if len(rng_states) == world_size else rng_states[0])
        logging.info(f"Resumed from {resume_path} at iteration {start_iter}")
        if start_iter >= params.num_iters:
            logging.info(f"This run already finished its {params.num_iters} iterations; "
                         "pass a new --run_num (or raise --num_iters) to train again")
    del checkpoint

    if dist.is_initialized() and not args.noddp:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                        bucket_cap_mb=args.bucket_cap_mb,
                                        broadcast_buffers=not args.disable_broadcast_buffers,
                                        gradient_as_bucket_view=args.disable_broadcast_buffers)
    elif args.parallel == "dp":
        model = DataParallel(model)  # one process scatters each batch over all visible GPUs (CPU: as is)
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
        scheduler.step()
        return gen, loss

    if params.enable_benchy:
        set_train_mode(model, freeze_bn)
        out_path = (os.environ["BENCHY_OUTPUT"] + ".json" if os.environ.get("BENCHY_OUTPUT")
                    else os.path.join(exp_dir, "benchy_output.json"))
        run_benchmarks(params, train_loader, train_sampler, to_device, train_step, device, out_path)
        finish_run(world_rank)
        return

    num_iters = params.num_iters
    stop_iter = min(num_iters, args.stop_at_iter or num_iters)
    local_bs = params.local_batch_size
    flops_per_sample = train_flops_per_sample(get_model, params, sample_shape)
    peak, peak_source = peak_flops(device, params.amp_dtype)
    logging.info(f"Training FLOPs per sample: {flops_per_sample:.4g}; peak {peak / 1e12:.3f} TFLOP/s "
                 f"per device ({peak_source})")
    profiler_window = CudaProfilerWindow(args.profile_epoch, args.profile_iters, enabled=world_rank == 0)
    log_freq = params.get("log_freq")
    # devices sharing the work: one per rank, or every visible GPU under DataParallel
    num_devices = torch.cuda.device_count() if args.parallel == "dp" and device.type == "cuda" else world_size

    tboard_writer = SummaryWriter(log_dir=os.path.join(exp_dir, "logs")) if world_rank == 0 else None
    if start_iter == 0:
        # step-0 values: the first training batch and the first validation batch, before any update
        first_indices = list(train_sampler)[:local_bs]
        inp, tar = to_device(*default_collate([train_dataset[i] for i in first_indices]))
        val_inp, val_tar = to_device(*next(iter(valid_loader)))
        model.eval()  # measure only: no dropout, no BatchNorm statistics updated
        with torch.no_grad(), autocast:
            values = [loss_fn(model(inp), tar), loss_fn(val_gen := model(val_inp), val_tar)]
            val_metrics = metrics_fn(val_gen, val_tar)
            values += [m.float().mean() for m in val_metrics.values()]
        values = all_reduce_mean(torch.stack(values).float()).tolist()
        if tboard_writer is not None:
            tags = ["Loss/train", "Loss/valid"] + list(val_metrics)
            for tag, value in zip(tags, values):
                tboard_writer.add_scalar(tag, value, 0)

    logging.info("Starting Training Loop...")
    iters = start_iter
    while iters < stop_iter:
        epoch, first_step = divmod(iters, steps_per_epoch)
        train_sampler.set_epoch(epoch, skip=first_step * local_bs)  # resume at the same data position
        set_train_mode(model, freeze_bn)
        comm.synchronize(device)
        epoch_start = report_start = time.time()
        step_losses, step_metrics = [], []
        for i, (inp, tar) in enumerate(train_loader, start=first_step):
            profiler_window.step(epoch, i)
            with nvtx_range(f"step {i}"):
                with nvtx_range(f"data copy in {i}"):
                    inp, tar = to_device(inp, tar)
                gen, loss = train_step(inp, tar)
            step_losses.append(loss.detach())
            step_metrics.append({tag: value.mean() for tag, value in train_metrics_fn(gen.detach(), tar).items()})
            iters += 1
            if log_freq and i > first_step and i % log_freq == 0:  # the ResNet stage's progress line
                comm.synchronize(device)
                now = time.time()
                logging.info(f"Epoch: {epoch + 1}, Iteration: {i}, "
                             f"Avg img/sec: {log_freq * params.global_batch_size / (now - report_start):.2f}")
                report_start = now
            if params.checkpoint_interval and iters % params.checkpoint_interval == 0 and iters < stop_iter:
                state = checkpoint_state(raw_model, optimizer, scheduler, scaler, iters, params)
                if world_rank == 0:
                    save_checkpoint(checkpoint_path, state)
            if iters >= stop_iter:
                break
        profiler_window.end_epoch()
        comm.synchronize(device)
        epoch_time = time.time() - epoch_start
        train_loss = all_reduce_mean(torch.stack(step_losses).float().mean()).item()
        train_means = {tag: all_reduce_mean(torch.stack([m[tag] for m in step_metrics]).mean()).item()
                       for tag in step_metrics[0]}

        steps_run = len(step_losses)
        iters_per_sec = steps_run / epoch_time
        samples_per_sec = params.global_batch_size * iters_per_sec
        achieved = flops_per_sample * samples_per_sec / num_devices
        logging.info(f"Time taken for epoch {epoch + 1} is {epoch_time:f} sec, avg {samples_per_sec:f} samples/sec")
        logging.info(f"  Avg train loss={train_loss:f}")
        logging.info(f"  Throughput per device: {achieved / 1e12:.4f} TFLOP/s, MFU {100 * achieved / peak:.1f}%")

        val_start = time.time()
        val_means, (val_inp, val_tar, val_gen) = validate(model, valid_loader, to_device, loss_fn, metrics_fn,
                                                          device, autocast)
        val_loss = val_means.pop("loss")
        logging.info(f"  Avg val loss={val_loss}")
        logging.info(f"  Total validation time: {time.time() - val_start} sec")
        if "Accuracy/top1/valid" in val_means:
            logging.info(f"  train acc1={train_means['Accuracy/top1/train']:f}, "
                         f"valid acc1={val_means['Accuracy/top1/valid']:f}, "
                         f"valid acc5={val_means['Accuracy/top5/valid']:f}")
        if params.lr_schedule == "plateau" and iters % steps_per_epoch == 0:  # whole epochs only (resume)
            scheduler.end_epoch(val_loss)

        if tboard_writer is not None:
            tboard_writer.add_scalar("Loss/train", train_loss, iters)
            tboard_writer.add_scalar("Learning Rate", optimizer.param_groups[0]["lr"], iters)
            tboard_writer.add_scalar("Avg iters per sec", iters_per_sec, iters)
            tboard_writer.add_scalar("Avg samples per sec", samples_per_sec, iters)
            tboard_writer.add_scalar("Loss/valid", val_loss, iters)
            for tag, value in {**train_means, **val_means}.items():
                tboard_writer.add_scalar(tag, value, iters)
            figure = get_figure(params, val_inp, val_tar, val_gen)
            if figure is not None:
                tboard_writer.add_figure(*figure, iters, close=True)
            tboard_writer.flush()
        if args.desired_acc is not None and val_means["Accuracy/top1/valid"] >= args.desired_acc:
            logging.info(f"Reached the desired validation accuracy {args.desired_acc} at iteration {iters}; "
                         "stopping")
            break

    if iters > start_iter or not os.path.isfile(checkpoint_path):
        state = checkpoint_state(raw_model, optimizer, scheduler, scaler, iters, params)
        if world_rank == 0:
            save_checkpoint(checkpoint_path, state)
    if tboard_writer is not None:
        tboard_writer.close()
        logging.info(f"TensorBoard logs: {os.path.join(exp_dir, 'logs')}  (tensorboard --logdir {exp_dir})")
    finish_run(world_rank)


if __name__ == "__main__":
    main()
