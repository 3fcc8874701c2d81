"""Validation (validate: the loss and metrics over the whole validation set, every sample counted once) and the
model's training mode after it (set_train_mode). Reductions run over the data-parallel group "dp"; nothing here
knows which script calls it."""
import math
import time

import torch

from utils import comm


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
