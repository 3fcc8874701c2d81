"""What the training loops share besides the run (lifecycle/run.py): the loop's decisions in one place (Milestones: an
epoch ends, a checkpoint is due, the run stops), the epoch's sums, clock, progress line and nan check (EpochMeter),
validation, and the tutorial's log lines and TensorBoard points. Reductions of losses and metrics run over the
data-parallel group "dp"; nothing here knows which script calls it.
"""
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from lifecycle import signals
from loop.plots import get_figure
from utils import comm, health
from utils.errors import UserError

NONFINITE_CHECK_EVERY = 50  # iterations between checks of the training loss (each costs one device sync)


class Milestones:
    """The loop's decisions, in one place: when an epoch ends (report and validate), when a checkpoint is due, and
    when to stop (the last iteration, --stop_at_iter, --desired_acc, a signal: lifecycle/signals.py)."""

    def __init__(self, params, args, steps_per_epoch):
        self.steps_per_epoch = steps_per_epoch
        self.num_iters = params.num_iters
        self.stop_iter = min(params.num_iters, args.stop_at_iter or params.num_iters)
        self.interval = params.checkpoint_interval
        self.desired_acc = args.desired_acc
        self.first = True

    def epoch_ends(self, iters):
        """The epoch's last iteration, or the run's (a shorter last epoch is reported too)."""
        return iters % self.steps_per_epoch == 0 or iters == self.num_iters

    def stop(self, iters, val_means=None):
        """True once the loop is to stop after `iters` iterations (saying why when the run is not done); asked once
        before the first step and after every step. Collective: the ranks agree on a signal any of them received
        (lifecycle/signals.py: on several ranks, AGREEMENT_LAG steps after it came, without a wait)."""
        stop = self._decide(iters, val_means, signals.agreed_in_loop())
        if stop:
            signals.settle()  # every rank stops at this boundary: the agreements still in flight are read
        return stop

    def _decide(self, iters, val_means, signal_name):
        first, self.first = self.first, False
        if iters >= self.num_iters:
            return True
        if signal_name:
            logging.info(f"stopped by {signal_name} at iteration {iters}; starting again resumes here")
            return True
        if self.desired_acc is not None and val_means and val_means["Accuracy/top1/valid"] >= self.desired_acc:
            logging.info(f"Reached the desired validation accuracy {self.desired_acc} at iteration {iters}; stopping")
            return True
        if iters >= self.stop_iter:
            logging.info(f"Nothing to train: the run is at iteration {iters}, --stop_at_iter {self.stop_iter}" if first
                         else f"Stopped at iteration {iters} (--stop_at_iter); starting again resumes here")
            return True
        return False

    def checkpoint_due(self, iters):
        """Every checkpoint_interval iterations (0: only when the run stops)."""
        return bool(self.interval) and iters % self.interval == 0


def devices_in_use(args, device):
    """Devices sharing the model's FLOPs: one per rank, or every visible GPU under DataParallel (--parallel dp)."""
    if args.parallel == "dp" and device.type == "cuda":
        return torch.cuda.device_count()
    return comm.get_world_size()


class EpochMeter:
    """Training loss and metrics of the current epoch, its clock, and the ResNet stage's progress line. Per-step
    values stay on the device (no sync per step); the epoch's mean is over its steps and the data-parallel group.
    The partial sums go into checkpoints, so an epoch interrupted and resumed reports exactly what an uninterrupted
    one does. Every NONFINITE_CHECK_EVERY iterations the losses are checked for nan/inf (one device sync)."""

    def __init__(self, device, loader, params=None, group="dp"):
        self.device, self.loader, self.group = device, loader, group
        self.log_freq = params.get("log_freq") if params else None
        self.global_batch_size = params.global_batch_size if params else None
        self._reset(0, None)

    def _reset(self, iteration, partial):
        self.losses, self.metrics, self.checked, self.iteration, self.reported = [], [], 0, iteration, False
        self.prior = partial or {"steps": 0, "sums": {}}

    def start(self, iteration=0, partial=None):
        """A new epoch at `iteration` (iterations done so far), or the rest of one: `partial` = the sums a
        checkpoint kept (empty when it was written after the epoch's report). Waits for the device, starts the clock."""
        self._reset(iteration, partial)
        comm.synchronize(self.device)
        self.start_time = self.report_time = time.time()

    def add(self, loss, metrics):
        """One step's loss and training metrics."""
        self.losses.append(loss.detach())
        self.metrics.append({tag: value.detach().float().mean() for tag, value in metrics.items()})
        self.iteration += 1
        if self.log_freq:
            self._progress_line()
        if self.iteration % NONFINITE_CHECK_EVERY == 0:
            self.stop_if_not_finite(self.iteration)

    def _progress_line(self):
        """The ResNet stage's line every log_freq steps of an epoch: images per second since the last one."""
        epoch, step = divmod(self.iteration - 1, len(self.loader))
        if step % self.log_freq == 0:
            comm.synchronize(self.device)
            now, steps = time.time(), min(self.log_freq, self.steps)
            logging.info(f"Epoch: {epoch + 1}, Iteration: {step}, "
                         f"Avg img/sec: {steps * self.global_batch_size / (now - self.report_time):.2f}")
            self.report_time = now

    @property
    def steps(self):
        """Steps run since start() (this process's part of the epoch)."""
        return len(self.losses)

    def seconds(self):
        """Seconds since start(), once the device has finished its work."""
        comm.synchronize(self.device)
        return time.time() - self.start_time

    def _sums(self):
        sums = dict(self.prior["sums"])
        if self.losses:
            local = {"Loss/train": torch.stack(self.losses).double().sum()}
            local.update({tag: torch.stack([m[tag] for m in self.metrics]).double().sum() for tag in self.metrics[0]})
            reduced = comm.all_reduce_mean(torch.stack(list(local.values())), self.group).tolist()
            for tag, value in zip(local, reduced):
                sums[tag] = sums.get(tag, 0.0) + value
        return {"steps": self.prior["steps"] + self.steps, "sums": sums}

    def state_dict(self):
        """{"steps", "sums"}: sums over the epoch's steps of the data-parallel mean (collective), for a checkpoint;
        empty once the epoch has been reported (means()), so a resumed run never counts those steps again."""
        return {"steps": 0, "sums": {}} if self.reported else self._sums()

    def means(self):
        """{tag: mean over the whole epoch} (collective), for the epoch's report."""
        state = self._sums()
        self.reported = True
        return {tag: total / state["steps"] for tag, total in state["sums"].items()}

    def describe(self, iteration):
        """Where this rank's batch of a (1-based) iteration came from."""
        epoch, step = divmod(iteration - 1, len(self.loader))
        return f"epoch {epoch + 1}, step {step}: {self.loader.describe(epoch, step)}"

    def stop_if_not_finite(self, iters):
        """Collective check of the losses so far: if any rank saw a nan/inf loss, every rank stops with a line
        naming the first such iteration and its samples, before anything is saved."""
        new = self.losses[self.checked:]  # the earlier ones were finite
        bad = (~torch.isfinite(torch.stack(new).float())).nonzero() if new else []
        local = float(iters - len(new) + 1 + bad[0].item()) if len(bad) else math.inf
        self.checked = self.steps
        first = comm.all_reduce_min(torch.tensor([local], dtype=torch.float64, device=self.device)).item()
        if math.isfinite(first):
            first = int(first)
            # name the batch of a rank that saw it (every rank raises the same line)
            seen = [(local, self.describe(first) if local == first else None)]
            if dist.is_initialized():
                seen = [None] * dist.get_world_size()
                dist.all_gather_object(seen, (local, self.describe(first) if local == first else None))
            where = next(f"rank {rank}'s batch: {text}" for rank, (at, text) in enumerate(seen) if at == first)
            raise UserError(f"the training loss is not finite (nan or inf) at iteration {first} ({where}); stopped "
                            f"without saving, so the checkpoints are as they were ({health.resume_point()}); check the "
                            "input data (or lower lr, or use bf16 instead of fp16)")


class AutocastForward(torch.nn.Module):
    """`module` whose forward runs under the run's autocast, for nn.DataParallel: it runs each replica in a thread of
    its own, and autocast state is per thread; torch's parallel_apply enters autocast there again without the dtype,
    which on CUDA means fp16, so a bf16 run would compute its replicas in fp16 with no GradScaler."""

    def __init__(self, module, device_type, dtype, enabled):
        super().__init__()
        self.module, self.device_type, self.dtype, self.enabled = module, device_type, dtype, enabled

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled):
            return self.module(*args, **kwargs)


def set_train_mode(model, params):
    """model.train(); with the config's `freeze_bn` (ResNet stage) the BatchNorm layers stay in eval mode (running
    statistics, no updates)."""
    model.train()
    if params.get("freeze_bn", False):
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.eval()


def validate(model, valid_loader, to_device, loss_fn, metrics_fn, autocast, group="dp"):
    """(mean loss and metrics over the whole validation set and all ranks of `group`, the last batch for a figure,
    seconds taken). Every sample of the set counts once: the samples a sharded sampler repeats so that each rank
    gets as many (padding, the tail of a rank's pass: real_samples) weigh nothing, so N ranks report 1 rank's
    means."""
    start = time.time()
    model.eval()
    sums = None
    left = real_samples(valid_loader)  # this rank's samples still to come that are not padding
    # no_grad, not inference_mode: torch 2.5's gloo all-gather (cp) fills its outputs on another thread, where an
    # inference tensor may not be written
    with torch.no_grad():
        for inp, tar in valid_loader:
            inp, tar = to_device(inp, tar)
            rows = inp.shape[0]
            real, left = min(rows, max(left, 0)), left - rows  # padding: the pass's last row
            with autocast:
                gen = model(inp)
                # Sums over the real rows. The losses are batch means of per-sample values (task/loss.py: l2 per
                # sample; l1 and cross entropy over equally many elements per sample), so a mean over the real
                # rows times their number is their sum; only a batch holding padding (a rank has at most one
                # padded sample, the last of its pass) computes it on a slice. The metrics are per sample: their
                # real rows are summed.
                whole = real == rows  # no padding: nothing sliced (the common case; a slice is a copy on some paths)
                loss = (loss_fn(gen, tar) if whole else loss_fn(gen[:real], tar[:real])).float() * real if real else \
                    torch.zeros((), device=inp.device)
            values = {"loss": loss, "count": torch.tensor(float(real), device=loss.device)}
            values.update({tag: (metric.float() if whole else metric.float()[:real]).sum()
                           for tag, metric in metrics_fn(gen, tar).items()})
            sums = values if sums is None else {k: sums[k] + values[k] for k in sums}
    totals = comm.all_reduce_sum(torch.stack(list(sums.values())), group)
    means = {key: (total / totals[1]).item() for key, total in zip(sums, totals)}
    del means["count"]
    return means, (inp, tar, gen), time.time() - start


def real_samples(loader):
    """How many samples of a validation pass of `loader` on this rank are not padding: its sampler's count
    (loaders/common.py ResumableSampler.real_samples: the PyTorch loaders, and the DALI ones, which deliver the
    same sampler's order), or all of them for a loader without one (the synthetic loader, a list of batches)."""
    count = getattr(getattr(loader, "sampler", None), "real_samples", None)
    return count() if count is not None else math.inf


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
                        f"saving, so the checkpoints are as they were ({health.resume_point()}); check the validation "
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
