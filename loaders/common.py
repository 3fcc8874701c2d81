"""What every loader shares: the resumable sampler, batch plumbing, the PyTorch loader and the base of the DALI ones.

The training loop sees every loader through one interface (`TorchLoader` here for the PyTorch loaders,
`PipelineLoader` for the DALI ones): iterate one epoch's batches, len() = steps per epoch, set_epoch(epoch, skip)
to start an epoch after `skip` steps (exact resume), sample_shape, first_batch() for the step-0 values,
describe(epoch, step) to name the samples of a batch in error messages. Both take the order of the samples from
the same sampler (`sharded_sampler`: a seed shared by every rank, reshuffled per epoch, a disjoint shard per
data-parallel rank), so a DALI loader returns the PyTorch loader's batches.
This module imports no other loader module (loaders/era5.py, cosmo.py, images.py, dali_*.py import it).
"""
import collections
import copy
import ctypes
import functools
import importlib.util
import logging
import math
import multiprocessing
import os
import signal
import sys
import warnings
import weakref

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, default_collate, get_worker_info

from lifecycle.workers import PLAIN_START
from utils.errors import OneRankError, UserError

DALI_HINT = "install nvidia-dali-cuda120 (requirements.txt)"
TORCH_LOADERS = {"dali": "pytorch", "dali-lowmem": "lowmem"}  # what to use instead without DALI
PREFETCH = 2  # batches each worker reads ahead (DataLoader's prefetch_factor)
SPARE_SLOTS = 2  # ring slots beyond those requested ahead: the batch handed out and the one before it
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal this process gets when its parent dies


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way through (resume at the same data position)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def set_epoch(self, epoch, skip=0):
        """Order of `epoch`; the first `skip` of this rank's samples are left out."""
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])

    def real_samples(self):
        """How many of the samples __iter__ yields are the data set's own; the rest, always the last ones, are
        padding. Without drop_last (validation) DistributedSampler makes the order of the N samples a multiple of
        the ranks R by repeating its first ones at the end, then deals it out: this rank's k-th sample is place
        rank + k * R of that order, a repeat when the place is N or more. So the rank holds
        ceil((N - rank) / R) real samples, then padding (one sample on the ranks from N mod R on, when R does not
        divide N). loop/validation.validate weighs the padding zero, so every sample counts once."""
        real = self.num_samples if self.drop_last else \
            min(self.num_samples, max(0, -(-(len(self.dataset) - self.rank) // self.num_replicas)))
        return max(0, real - self.skip)


def split_batch_size(params, train):
    """Samples per batch on this rank: the local batch size, for validation `valid_batch_size_per_gpu` if set."""
    return params.local_batch_size if train else params.get("valid_batch_size_per_gpu", params.local_batch_size)


def sharded_sampler(params, dataset, train):
    """The sampler of one split, sharded over the data-parallel ranks (the dataset's `sampler_class` if it has one:
    the cosmology crops' keys are (epoch, index)). Always a sampler, also on one rank: the shuffle order is then a
    function of (seed, epoch)."""
    if train and len(dataset) < params.local_batch_size * params.data_num_shards:
        raise UserError(f"the training data has {len(dataset)} samples, fewer than one global batch of "
                        f"{params.local_batch_size * params.data_num_shards}; lower the batch size")
    sampler_class = getattr(dataset, "sampler_class", ResumableSampler)
    return sampler_class(dataset, num_replicas=params.data_num_shards, rank=params.data_shard_id,
                         shuffle=train, seed=params.seed, drop_last=train)


def check_same_size_everywhere(size, train, gather):
    """A UserError, the same on every rank, unless every rank's split has `size` samples. Ranks that see different
    data (a node whose copy is still running, a stale or partial mount) would shuffle different orders, overlap
    their shards and end their epochs at different steps, where their collectives stop matching and the job hangs
    until the timeout. A collective over every rank: loaders.get_data_loader calls it, which every rank of a
    training script calls for each split in the same order (not the loaders themselves, which a test may build on
    some ranks only). `gather`: every rank's value in rank order (the run's WorkerStart.gather)."""
    sizes = gather(size)
    if len(set(sizes)) == 1:
        return
    split = "training" if train else "validation"
    counts = collections.Counter(sizes)
    usual = counts.most_common(1)[0][0]
    odd = [rank for rank, n in enumerate(sizes) if n != usual]
    named = ", ".join(f"rank {rank} has {sizes[rank]}" for rank in odd[:4]) + (
        f" (and {len(odd) - 4} more ranks)" if len(odd) > 4 else "")
    others = len(sizes) - len(odd)
    raise UserError(f"the ranks see different {split} data: {named} samples where the other "
                    f"{'rank has' if others == 1 else f'{others} ranks have'} {usual}; every rank must read the same "
                    "files: check that every node sees the same data folder (a copy still running, a stale or "
                    "partial mount), then start again")


def batch_buffer(shape):
    """A float32 tensor to read a batch into, in the process that reads it (numpy asks for huge pages for large
    arrays: 4x fewer page faults than torch.empty here). Loader workers read into a BatchRing instead."""
    return torch.from_numpy(np.empty(shape, dtype=np.float32))


def read_whole_batch(dataset, keys, allocate=batch_buffer):
    """The batch of `keys` (a tuple of tensors, one per output) read by `dataset.read_batch_into` into buffers
    from `allocate(shape)`: the `__getitems__` of the datasets that read whole batches (ERA5, cosmology)."""
    batch = tuple(allocate((len(keys), *shape)) for shape in dataset.sample_shapes())
    dataset.read_batch_into(keys, batch)
    return batch


class BatchRing:
    """Shared-memory buffers that loader workers read whole batches into, allocated once, before the workers start
    (or, without workers, buffers of the training process that it reads into itself: a dataset turned after the
    copy, see torch_loader).

    Why: a worker that returns a fresh tensor per batch makes a new shared-memory file per batch (create, map, fault
    in every 4 KiB page in the worker, fault it in again in the training process, unmap): on the 2-core machine
    that made 2 workers slower than none (`make bench-loader` measures both; docs/loaders.md). The ring's pages
    are mapped once per process and reused for good.

    One buffer per output, of `slots` batches. Batch number n (counted across epochs by the RingBatchSampler in
    the training process) goes to slot n % slots; the worker reads into it and returns only (slot, rows). With
    slots = workers x prefetch + 2, the DataLoader has at most workers x prefetch batches requested ahead of the
    one it hands out, so a batch stays untouched while its caller takes the next one; taking the one after that
    (or starting another pass) may overwrite it.
    On a GPU node the buffers are registered as pinned memory (page-locked, in place), so the copy to the device
    is asynchronous and there is no pin-memory thread copying every batch once more; the loader waits for a
    batch's copy to finish before its slot is reused (see TorchLoader.__iter__)."""

    def __init__(self, sample_shapes, batch_size, slots, shared=True):
        self.slots = slots
        allocate = shared_tensor if shared else batch_buffer  # not shared: read in the training process itself
        self.buffers = [allocate((slots, batch_size, *shape)) for shape in sample_shapes]
        self.pinned = False
        for buffer in self.buffers:  # the pages exist from here on; each worker maps them when it starts
            buffer.zero_()

    @property
    def nbytes(self):
        return sum(buffer.nbytes for buffer in self.buffers)

    def touch(self):
        """Map every page of the buffers into this process now (a read per 4 KiB page): each process faults the
        ring in once, at start-up, not during the first batches of the run."""
        for buffer in self.buffers:
            buffer.view(-1)[::1024].sum()

    def views(self, slot, rows):
        """The batch in `slot`: its first `rows` samples (a last validation batch may be partial)."""
        return tuple(buffer[slot, :rows] for buffer in self.buffers)

    def pin(self):
        """Page-lock the buffers in place for asynchronous copies to the GPU (training process, once; unlocked
        when the ring is collected)."""
        if not self.pinned:
            cudart = torch.cuda.cudart()
            for buffer in self.buffers:
                error = int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0))
                if error:
                    raise OneRankError(f"CUDA cannot page-lock the {buffer.nbytes / 1e9:.2f} GB the loader workers "
                                       f"read batches into (cudaError {error}); raise the locked-memory limit "
                                       "(ulimit -l) or lower --num_data_workers or the batch size")
                weakref.finalize(self, cudart.cudaHostUnregister, buffer.data_ptr())
            self.pinned = True
        return self.pinned

    def __getstate__(self):  # spawned workers get the buffers (shared memory), never a pinned flag
        return {**self.__dict__, "pinned": False}


def shared_tensor(shape):
    """A float32 tensor of `shape` in shared memory (what a loader worker can hand over without a copy)."""
    try:
        storage = torch.UntypedStorage._new_shared(int(np.prod(shape)) * 4)
    except RuntimeError as err:  # /dev/shm too small (a container's 64 MB default)
        raise OneRankError(f"cannot allocate {np.prod(shape) * 4 / 1e9:.2f} GB of shared memory for the loader "
                           f"workers' batches ({str(err).splitlines()[0]}); lower --num_data_workers or the batch "
                           "size, or give /dev/shm more room (docker run --shm-size)") from None
    return torch.empty(0, dtype=torch.float32).set_(storage, 0, shape)


class RingBatchSampler:
    """The sampler's batches as a stream, each with the ring slot to read it into: (slot, indices). Runs in the
    training process (the DataLoader takes the next request from it). It starts at `start` = (epoch, steps to skip)
    and, for training, goes on into the next epochs (its own copy of the sampler reshuffled per epoch), so the
    workers read the next epoch's first batches while this one's last run; validation repeats its one order. The
    batch count goes on across epochs and restarts, so slots follow one another."""

    def __init__(self, sampler, batch_size, train, slots):
        self.sampler, self.batch_size, self.train = sampler, batch_size, train
        self.slots, self.count, self.start = slots, 0, (0, 0)

    def __len__(self):
        return len(BatchSampler(self.sampler, self.batch_size, self.train))

    def __iter__(self):
        sampler, (epoch, skip) = copy.copy(self.sampler), self.start
        while len(self):  # (a shard without a batch: no requests, rather than a search without end)
            sampler.set_epoch(epoch, skip=skip * self.batch_size)
            for indices in BatchSampler(sampler, self.batch_size, drop_last=self.train):
                slot, self.count = self.count % self.slots, self.count + 1
                yield slot, indices
            epoch, skip = epoch + self.train, 0


class RingReader(Dataset):
    """What a loader worker runs: a request (slot, indices) is read by the dataset's `read_batch_into` straight
    into the ring's slot; only (slot, rows) travels back to the training process."""

    def __init__(self, dataset, ring):
        self.dataset, self.ring = dataset, ring

    def __len__(self):
        return len(self.dataset)

    def __getitems__(self, request):
        slot, indices = request
        self.dataset.read_batch_into(indices, self.ring.views(slot, len(indices)))
        return slot, len(indices)


def batch_indices(sampler, batch_size, epoch, step):
    """The sample indices of batch `step` of `epoch` on this rank (the sampler's own position is kept)."""
    saved = (sampler.epoch, sampler.skip)
    sampler.set_epoch(epoch)
    order = list(sampler)
    sampler.set_epoch(saved[0], skip=saved[1])
    return order[step * batch_size:(step + 1) * batch_size]


def probe_copy(dataset):
    """A copy of a dataset for looking at samples (step 0, shapes) that opens its own files: handles opened here
    must not reach the training copy or a loader's workers. (Samples are functions of their keys, so looking
    draws nothing from any training stream.)"""
    probe = copy.copy(dataset)
    if hasattr(probe, "files"):
        probe.files = [None] * len(probe.files)
    return probe


def read_first_batch(dataset, sampler, batch_size):
    """Batch 0 of epoch 0 of this rank, read from a probe copy (nothing the loader will deliver is consumed)."""
    probe, indices = probe_copy(dataset), batch_indices(sampler, batch_size, 0, 0)
    if hasattr(probe, "__getitems__"):
        return probe.__getitems__(indices)
    return default_collate([probe[i] for i in indices])


class TorchLoader:
    """A DataLoader over a ResumableSampler, seen through the interface the training loop uses.

    With a BatchRing (workers, or the training process, reading whole batches) the requests form one stream
    across epochs (RingBatchSampler): a pass goes on where the last one ended when set_epoch asks for that
    position (the next epoch from its start, a validation pass from its start), so the workers never stop reading
    at an epoch boundary; any other position (a resume, a pass left early) starts the stream there. On a CPU it
    yields views of the ring: a batch stays valid while the next one is taken, not beyond (clone() to keep one
    longer). On a GPU it yields the batches on the GPU, each copied from the (page-locked) ring on a copy stream
    while the step before it computes (see `_on_device`), and finished there where the dataset says
    (`finish_batch`: the cosmology crops turned)."""

    def __init__(self, dataset, sampler, loader, batch_size, ring=None):
        self.dataset, self.sampler, self.loader = dataset, sampler, loader
        self.batch_size, self.ring = batch_size, ring
        # a dataset that reads its batches unfinished (CosmoDataset.turn_later: crops still to be turned, their
        # codes in the batch's last tensor) is finished here, after the copy to the GPU where there is one
        self.finish = dataset.finish_batch if getattr(dataset, "turn_later", False) else None
        self.epoch, self.skip = 0, 0
        self.batches, self.position = None, None  # the stream of the workers' batches, and its next (epoch, step)
        self.copy_stream, self.copied = None, collections.deque()  # GPU: the copies' stream, an event per copy

    def __iter__(self):
        if self.ring is None:
            yield from self.loader
            return
        host = self._ring_pass()
        if torch.cuda.is_available() and self.ring.pin():
            yield from self._on_device(host, torch.device("cuda", torch.cuda.current_device()))
        else:
            yield from (self._finished(batch) for batch in host)

    def _finished(self, batch):
        """The batch the loop gets: as read, or finished by the dataset (on the batch's device)."""
        if self.finish is None:
            return batch
        return self.finish(batch[:-1], batch[-1])

    def _ring_pass(self):
        """This pass's batches from the workers' stream (views of the ring), started where set_epoch asked."""
        if self.batches is None or self.position != (self.epoch, self.skip):
            self._wait_for_copies()  # the new stream's first requests may overwrite slots still being copied
            self.loader.batch_sampler.start = (self.epoch, self.skip)
            self.batches = iter(self.loader)  # the first time starts the (persistent) workers: forked before pinning
            self.position = (self.epoch, self.skip)
        yield from self._host_pass(len(self) - self.skip)

    def _host_pass(self, steps):
        """`steps` batches of the stream, as views of the ring."""
        for _ in range(steps):
            # the next request reuses the slot of the batch before last: its copy to the GPU must have finished
            while len(self.copied) > 1:
                self.copied.popleft().synchronize()
            slot, rows = next(self.batches)
            epoch, step = self.position
            train = self.loader.batch_sampler.train  # training goes on into the next epoch
            self.position = (epoch + train, 0) if step + 1 == len(self) else (epoch, step + 1)
            yield self.ring.views(slot, rows)

    def _on_device(self, host, device):
        """The batches of `host` on the GPU, each copied on the loader's copy stream when the loop asks for it. The
        loop asks for batch n+1 as soon as it has queued step n, well before the GPU has run it, so the copy runs
        while step n computes; the loop's stream waits for the copy by its event, and that event also tells when
        the ring slot is free again (no device-wide synchronisation). Before the copy the host waits until the GPU
        has finished step n-1: the loop stays at most one step ahead of the GPU, and the caching allocator can
        reuse batch n-1's memory, so no more batches are on the GPU than when the loop copied each one itself."""
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(device)
        compute = torch.cuda.current_stream(device)
        steps_done = collections.deque()  # an event per step the loop queued, recorded when it asked for more
        for batch in host:
            while len(steps_done) > 1:
                steps_done.popleft().synchronize()
            codes = batch[-1] if self.finish is not None else None  # stays on the host: read there, no sync
            with torch.cuda.stream(self.copy_stream):
                batch = tuple(tensor.to(device, non_blocking=True) for tensor in
                              (batch if codes is None else batch[:-1]))
                if codes is not None:  # turned on the GPU, on the copy stream, before the loop waits for it
                    batch = self.finish(batch, codes)
            self.copied.append(torch.cuda.Event())
            self.copied[-1].record(self.copy_stream)
            compute.wait_event(self.copied[-1])
            for tensor in batch:
                tensor.record_stream(compute)  # made on the copy stream, used (and freed) on the loop's
            yield batch
            steps_done.append(torch.cuda.Event())
            steps_done[-1].record(compute)

    def _wait_for_copies(self):
        while self.copied:
            self.copied.popleft().synchronize()

    def __len__(self):
        """Steps in a whole epoch (also right after set_epoch(epoch, skip))."""
        return len(self.loader)

    def set_epoch(self, epoch, skip=0):
        """Next iteration gives the batches of `epoch` (its shuffle order), leaving out its first `skip` steps."""
        self.epoch, self.skip = epoch, skip
        if self.ring is None:
            self.sampler.set_epoch(epoch, skip=skip * self.batch_size)

    @property
    def sample_shape(self):
        """Shape of one input sample, e.g. (C, H, W)."""
        return tuple(probe_copy(self.dataset)[0][0].shape)

    def first_batch(self):
        """The first batch of epoch 0, as the loop will see it (for the step-0 values)."""
        return read_first_batch(self.dataset, self.sampler, self.batch_size)

    def describe(self, epoch, step):
        """The samples of batch `step` of `epoch` on this rank, by file where the dataset can tell."""
        indices = batch_indices(self.sampler, self.batch_size, epoch, step)
        if hasattr(self.dataset, "describe"):
            return self.dataset.describe(indices)
        return f"sample indices {', '.join(map(str, indices))}"


def torch_loader(params, dataset, train, turn_later=None, worker_start=PLAIN_START):
    """The PyTorch loader (TorchLoader) of one split of `dataset`, sharded over the data-parallel ranks. Datasets
    that read whole batches into given buffers (`read_batch_into`: ERA5, cosmology) get a BatchRing when there are
    workers. A dataset that can finish its batches later (`finish_batch`: the cosmology crops' turns) does so after
    the copy to the GPU (`turn_later`; default: when there is a GPU), where a turn costs microseconds instead of
    a copy of every crop on the host. `worker_start` (lifecycle/workers.py): how the workers start (a training run's:
    deaf to the job's stop signals)."""
    finished_later = hasattr(dataset, "finish_batch") and (torch.cuda.is_available() if turn_later is None
                                                           else turn_later)
    if hasattr(dataset, "finish_batch"):
        dataset.turn_later = finished_later
    batch_size = split_batch_size(params, train)
    sampler = sharded_sampler(params, dataset, train)
    workers = params.num_data_workers
    # own generator: worker seeds do not draw from the global RNG, so a resumed run's RNG (dropout)
    # follows the same sequence as an uninterrupted one
    common = dict(num_workers=workers, persistent_workers=workers > 0,
                  worker_init_fn=functools.partial(_seed_worker, in_worker=worker_start.in_worker),
                  multiprocessing_context=worker_start.context() if workers else None,
                  generator=torch.Generator().manual_seed(params.seed + params.data_shard_id))
    if (workers or finished_later) and hasattr(dataset, "read_batch_into"):
        # without workers (a dataset finished later), the training process reads into a ring of its own memory:
        # the same buffers every batch, page-locked once on a GPU, instead of fresh pages and a pinned copy
        slots = workers * PREFETCH + SPARE_SLOTS
        ring = BatchRing(dataset.sample_shapes(), batch_size, slots, shared=workers > 0)
        logging.info(f"{'Loader workers read' if workers else 'The loader reads'} into a ring of {slots} batches"
                     f"{' in shared memory' if workers else ''} ({ring.nbytes / 1e9:.2f} GB)")
        batches = RingBatchSampler(sampler, batch_size, train, slots)
        loader = DataLoader(RingReader(dataset, ring), batch_sampler=batches, collate_fn=batched_already,
                            prefetch_factor=PREFETCH if workers else None, **common)
        return TorchLoader(dataset, sampler, loader, batch_size, ring)
    # datasets that read whole batches (ERA5, cosmology: __getitems__) hand them on without a collate copy
    collate_fn = batched_already if hasattr(dataset, "__getitems__") else None
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=train,
                        pin_memory=torch.cuda.is_available(), **common)
    return TorchLoader(dataset, sampler, loader, batch_size)


def batched_already(batch):
    """The collate_fn of datasets that return whole batches: the batch as read."""
    return batch


def exit_with_parent():
    """In a loader worker (PyTorch's or DALI's): the kernel kills it (SIGKILL) when its parent, the training process,
    dies, also of a SIGKILL or the OOM killer; a parent already gone ends it here. Linux only (elsewhere nothing).
    PyTorch's workers look for their parent only between requests (every 5 s while idle): a worker blocked in a read
    or a long __getitem__ never looks, and workers outlived an OOM-killed run (issue #53); DALI's parallel-source
    workers were still alive 8 s after a SIGKILL of their training process. The kernel sends the signal when the
    thread that started the worker ends: the loaders start their workers from the training process's main thread."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this libc
        return
    if os.getppid() != parent.pid:  # the parent died before prctl: no signal will come
        os._exit(1)


def _seed_worker(worker_id, in_worker):
    exit_with_parent()
    in_worker()  # a run's WorkerStart: the job's stop signals (to every process of a step) are the main process's
    np.random.seed(torch.initial_seed() % (2**32 - 1))
    dataset = get_worker_info().dataset
    if isinstance(dataset, RingReader):
        dataset.ring.touch()


# --- the parts every DALI loader shares (loaders/dali_era5.py, loaders/dali_cosmo.py) ---

def dali_installed():
    """Whether NVIDIA DALI can be found here (without importing it)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ImportError:  # not even the `nvidia` namespace
        return False


def _import_dali(config):
    try:
        import nvidia.dali as dali
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError as err:
        raise UserError(f"data_loader_config '{config}' needs NVIDIA DALI, which cannot be imported ({err}); "
                        f"use --data_loader_config {TORCH_LOADERS[config]}, or {DALI_HINT}") from None
    return dali, DALIGenericIterator, LastBatchPolicy


class SamplerSource:
    """The base of a per-sample external-source callback: sample `idx_in_epoch` of DALI's epoch `epoch_idx` is the
    sampler's key at that place in epoch `first_epoch + epoch_idx`, after the `first_skip` steps skipped in the
    first epoch (exact resume). The callback may run in DALI's worker processes: it holds only picklable state, and
    calls `in_worker` (a WorkerStart's, lifecycle/workers.py) as a worker unpickles it."""

    def __init__(self, sampler, batch_size, steps_per_epoch, first_epoch, first_skip, in_worker=PLAIN_START.in_worker):
        self.sampler = copy.copy(sampler)  # its own: set_epoch here must not move the loader's sampler
        self.batch_size, self.steps_per_epoch = batch_size, steps_per_epoch
        self.first_epoch, self.first_skip = first_epoch, first_skip
        self.in_worker = in_worker
        self.order_epoch, self.order = None, None

    def __setstate__(self, state):
        """Unpickled in a DALI worker process: in a run, Ctrl-C and Slurm's warning signal are for the main process."""
        self.__dict__.update(state)
        exit_with_parent()
        self.in_worker()

    def _order(self, epoch):
        if epoch != self.order_epoch:
            self.sampler.set_epoch(epoch)
            self.order, self.order_epoch = list(self.sampler), epoch
        return self.order

    def key(self, sample_info):
        """The sampler key of this sample; StopIteration after the epoch's last step."""
        skip = self.first_skip if sample_info.epoch_idx == 0 else 0
        if sample_info.iteration >= self.steps_per_epoch - skip:
            raise StopIteration
        order = self._order(self.first_epoch + sample_info.epoch_idx)
        position = skip * self.batch_size + sample_info.idx_in_epoch
        return order[min(position, len(order) - 1)]  # a last partial batch is padded, then trimmed by the iterator


class PipelineLoader:
    """The loop's view of a DALI pipeline: the same interface as TorchLoader. Subclasses say how to build the
    pipeline (`build_pipeline(first_epoch, first_skip)`), which data_loader_config they serve (`config`) and the
    sample shape. Epoch length, drop_last and validation's last partial batch follow the PyTorch loader; looking
    at the first batch (step 0) does not consume it. `worker_start`: how DALI's workers start (torch_loader's)."""
    config = None  # the data_loader_config it serves

    def __init__(self, params, dataset, sampler, batch_size, train, worker_start=PLAIN_START):
        self.dali, self.iterator_class, self.last_batch_policy = _import_dali(self.config)
        self.dataset, self.sampler, self.batch_size, self.train = dataset, sampler, batch_size, train
        self.worker_start = worker_start
        self.workers = params.num_data_workers
        self.seed = params.seed
        self.steps = len(sampler) // batch_size if train else math.ceil(len(sampler) / batch_size)
        self.device_id = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.epoch, self.skip = 0, 0
        self.iterator, self.expected, self.exhausted = None, None, True

    def __len__(self):
        return self.steps

    def set_epoch(self, epoch, skip=0):
        self.epoch, self.skip = epoch, skip

    def build_pipeline(self, first_epoch, first_skip):
        """A DALI pipeline whose first epoch is `first_epoch`, after `first_skip` steps (subclasses)."""
        raise NotImplementedError

    def _restart(self):
        """A pipeline whose first epoch is self.epoch, after self.skip steps, and DALI's iterator over it."""
        pipe = self.build_pipeline(self.epoch, self.skip)
        with self.worker_start.starting():  # DALI's parallel sources spawn their workers here
            pipe.build()
        # training epochs end when the source raises StopIteration (whole batches, drop_last); validation's last
        # batch is padded by the source and trimmed to the rest of the set by the iterator
        size = -1 if self.train else len(self.sampler) - self.skip * self.batch_size
        with warnings.catch_warnings():  # DALI prefers a reader's own sharding; ours is the sampler's (tested)
            warnings.filterwarnings("ignore", message="Please set `reader_name`")
            self.iterator = self.iterator_class([pipe], ["inp", "tar"], size=size, auto_reset=True,
                                                last_batch_policy=self.last_batch_policy.PARTIAL,
                                                prepare_first_batch=False)

    def __iter__(self):
        # a pipeline runs epochs in sequence; start another one for any other (epoch, skip), or after a pass
        # that stopped early (its iterator sits mid-epoch)
        if self.iterator is None or not self.exhausted or (self.epoch, self.skip) != self.expected:
            self._restart()
        # training moves on by epochs; validation's order does not depend on the epoch, so its pipeline is reused
        self.expected = (self.epoch + 1, 0) if self.train else (self.epoch, self.skip)
        self.exhausted = False
        for batch in self.iterator:
            yield batch[0]["inp"], batch[0]["tar"]
        self.exhausted = True

    # what the loop needs besides the batches, read without the pipeline (nothing is consumed)
    def first_batch(self):
        return read_first_batch(self.dataset, self.sampler, self.batch_size)

    def describe(self, epoch, step):
        return self.dataset.describe(batch_indices(self.sampler, self.batch_size, epoch, step))
