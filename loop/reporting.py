"""The tutorial's log lines and TensorBoard points of a run (rank 0 writes them): the step-0 points, each epoch's
training report and its validation's (with the figure). The means are the data-parallel group's ("dp"); nothing here
knows which script calls it. `run` is lifecycle/run.py's Run: its params, rank, writer, and resume_point (what a
restart resumes from, in words, for the line that stops the run on a nan/inf validation loss)."""
import logging
import math
import os

import torch
from torch.utils.tensorboard import SummaryWriter

from loop.plots import get_figure
from utils import comm
from utils.errors import UserError


def open_tensorboard(run, start_iter):
    """Rank 0's SummaryWriter on <run dir>/logs. Points a killed run wrote after its last checkpoint are purged
    (TensorBoard's purge_step), so a resumed run shows each point once."""
    if run.rank == 0:
        run.writer = SummaryWriter(log_dir=os.path.join(run.exp_dir, "logs"),
                                   purge_step=start_iter + 1 if start_iter else 0)
    return run.writer


def log_step0(run, model, first_batch, valid_loader, to_device, loss_fn, metrics_fn, autocast, group="dp"):
    """The step-0 TensorBoard points: loss of the first training batch and of the first validation batch (and
    the validation metrics), before any update, averaged over `group`."""
    inp, tar = to_device(*first_batch)
    val_inp, val_tar = to_device(*valid_loader.first_batch())  # not consumed: validation stays whole
    model.eval()  # measure only: no dropout, no BatchNorm statistics updated
    with torch.no_grad(), autocast:
        values = [loss_fn(model(inp), tar), loss_fn(val_gen := model(val_inp), val_tar)]
        val_metrics = metrics_fn(val_gen, val_tar)
        values += [m.float().mean() for m in val_metrics.values()]
    values = comm.all_reduce_mean(torch.stack(values).float(), group).tolist()
    if run.writer is not None:
        for tag, value in zip(["Loss/train", "Loss/valid"] + list(val_metrics), values):
            run.writer.add_scalar(tag, value, 0)


def log_training_epoch(run, meter, iters, optimizer, flops_per_device_sample, peak):
    """The tutorial's end-of-epoch lines and TensorBoard points for training (rank 0); returns the epoch's means
    (collective: every rank of the meter's group calls it). A nan/inf loss stops the run here (stop_if_not_finite)."""
    seconds = meter.seconds()
    meter.stop_if_not_finite(iters)
    steps, train_means = meter.steps, meter.means()
    epoch = (iters - 1) // len(meter.loader)
    lr = optimizer.param_groups[0]["lr"]
    iters_per_sec = steps / seconds
    samples_per_sec = run.params.global_batch_size * iters_per_sec
    logging.info(f"Time taken for epoch {epoch + 1} is {seconds:f} sec, avg {samples_per_sec:f} samples/sec")
    logging.info(f"  Avg train loss={train_means['Loss/train']:f}")
    achieved = flops_per_device_sample * samples_per_sec
    logging.info(f"  Throughput per device: {achieved / 1e12:.4f} TFLOP/s, MFU {100 * peak.mfu(achieved):.1f}%")
    if run.writer is not None:
        run.writer.add_scalar("Loss/train", train_means["Loss/train"], iters)
        run.writer.add_scalar("Learning Rate", lr, iters)
        run.writer.add_scalar("Avg iters per sec", iters_per_sec, iters)
        run.writer.add_scalar("Avg samples per sec", samples_per_sec, iters)
        for tag, value in train_means.items():
            if tag != "Loss/train":
                run.writer.add_scalar(tag, value, iters)
    return train_means


def log_validation(run, iters, val_means, val_batch, seconds, train_means):
    """The tutorial's validation lines, TensorBoard points and figure (rank 0); flushes the writer. A nan/inf
    validation loss or metric stops the run (every rank: the means are the same on all), before anything is saved."""
    bad = [tag for tag, value in val_means.items() if not math.isfinite(value)]
    if bad:
        what = "loss" if bad[0] == "loss" else f"metric {bad[0]}"
        raise UserError(f"the validation {what} is not finite (nan or inf) at iteration {iters}; stopped without "
                        f"saving, so the checkpoints are as they were ({run.resume_point()}); check the validation "
                        "data (or lower lr, or use bf16 instead of fp16)")
    logging.info(f"  Avg val loss={val_means['loss']}")
    logging.info(f"  Total validation time: {seconds} sec")
    if "Accuracy/top1/valid" in val_means:
        logging.info(f"  train acc1={train_means['Accuracy/top1/train']:f}, "
                     f"valid acc1={val_means['Accuracy/top1/valid']:f}, "
                     f"valid acc5={val_means['Accuracy/top5/valid']:f}")
    if run.writer is not None:
        run.writer.add_scalar("Loss/valid", val_means["loss"], iters)
        for tag, value in val_means.items():
            if tag != "loss":
                run.writer.add_scalar(tag, value, iters)
        figure = get_figure(run.params, *val_batch)
        if figure is not None:
            run.writer.add_figure(*figure, iters, close=True)
        run.writer.flush()
