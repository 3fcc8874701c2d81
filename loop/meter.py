"""The epoch's training sums, clock, progress line and nan check (EpochMeter). Reductions run over the data-parallel
group "dp"; nothing here knows which script calls it."""
import logging
import math
import time

import torch
import torch.distributed as dist

from utils import comm
from utils.errors import UserError

NONFINITE_CHECK_EVERY = 50  # iterations between checks of the training loss (each costs one device sync)


def _unknown_resume_point():
    """A meter's resume point where no run tells it (a meter built alone)."""
    return "starting again resumes from the run directory's last checkpoint"


class EpochMeter:
    """Training loss and metrics of the current epoch, its clock, and the ResNet stage's progress line. Per-step
    values stay on the device (no sync per step); the epoch's mean is over its steps and the data-parallel group.
    The partial sums go into checkpoints, so an epoch interrupted and resumed reports exactly what an uninterrupted
    one does. Every NONFINITE_CHECK_EVERY iterations the losses are checked for nan/inf (one device sync).
    `resume_point()`: what a restart resumes from, in words, for the line that stops the run on a nan/inf loss (a
    run's: lifecycle/run.py's Run.resume_point)."""

    def __init__(self, device, loader, params=None, group="dp", resume_point=_unknown_resume_point):
        self.device, self.loader, self.group, self.resume_point = device, loader, group, resume_point
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
                            f"without saving, so the checkpoints are as they were ({self.resume_point()}); check the "
                            "input data (or lower lr, or use bf16 instead of fp16)")
