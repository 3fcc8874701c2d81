"""Loader workers reading into a ring of shared-memory batches (loaders/common.py BatchRing, RingBatchSampler,
TorchLoader): the same batches bit for bit as no workers, the ring really used, a batch untouched while the next is
taken (with a twin: no spare slots), a /dev/shm too small in one line, and the benchmark's worker ratios.
Failures point to loaders/common.py, or to read_batch_into in loaders/era5.py and loaders/cosmo.py."""
import contextlib
import json
import time

import pytest
import torch

import loaders.common
from lifecycle.cli import apply_overrides, training_parser
from loaders.common import torch_loader
from loaders.era5 import ERA5Dataset
from tests.datasets.test_data_loader import data, make_params  # noqa: F401 (the fixture)
from utils.errors import UserError


def era5_loader(data, workers, train=True, **changes):  # noqa: F811 (the fixture's name)
    params = make_params(data, **changes)
    args = training_parser("t").parse_args(["--local_batch_size", "2", "--num_data_workers", str(workers)])
    apply_overrides(params, args, dp_size=1, dp_rank=0)
    params.update({"img_size": make_params(data).img_size, **changes})
    return torch_loader(params, ERA5Dataset(params, str(data / "train"), train), train)


def pass_of(loader, epoch, skip=0, stop=None):
    loader.set_epoch(epoch, skip)
    batches = []
    for step, (inp, tar) in enumerate(loader):
        if step == stop:
            break
        batches.append((inp.clone(), tar.clone()))
    return batches


def assert_same(got, expected):
    assert len(got) == len(expected) > 0
    for (inp, tar), (ref_inp, ref_tar) in zip(got, expected, strict=True):
        assert torch.equal(inp, ref_inp) and torch.equal(tar, ref_tar)


@pytest.mark.compat
@pytest.mark.multiprocess
def test_two_workers_give_the_batches_of_none_through_the_ring(data):  # noqa: F811
    """Epochs after each other, a resume mid-epoch, a pass left early then a whole one, and validation with a
    partial last batch: bitwise the 0-worker batches, read into the ring (views of its buffers)."""
    none, two = era5_loader(data, 0), era5_loader(data, 2)
    assert none.ring is None and two.ring is not None and two.ring.slots == 2 * loaders.common.PREFETCH + 2
    expected = {epoch: pass_of(none, epoch) for epoch in (0, 1, 2)}
    assert len(expected[0]) == 10 and not torch.equal(expected[0][0][0], expected[1][0][0])  # reshuffled
    for epoch in (0, 1):
        assert_same(pass_of(two, epoch), expected[epoch])
    assert_same(pass_of(two, 2, skip=3), expected[2][3:])  # resume at step 3
    assert_same(pass_of(two, 0, stop=4), expected[0][:4])  # left after 4 of 10 batches (workers ran ahead)
    assert_same(pass_of(two, 1), expected[1])
    two.set_epoch(0)
    inp, _ = next(iter(two))
    ring_memory = two.ring.buffers[0].untyped_storage().data_ptr()
    assert inp.untyped_storage().data_ptr() == ring_memory  # a view of the ring, not a fresh tensor

    valid_none, valid_two = (era5_loader(data, workers, train=False, valid_batch_size_per_gpu=3) for workers in (0, 2))
    expected = pass_of(valid_none, 0)
    assert [len(inp) for inp, _ in expected] == [3] * 6 + [2]
    assert_same(pass_of(valid_two, 0), expected)
    assert_same(pass_of(valid_two, 1), expected)


@pytest.mark.compat
@pytest.mark.multiprocess
def test_the_workers_read_on_into_the_next_epoch(data, monkeypatch):  # noqa: F811
    """At an epoch boundary the workers' stream goes on: the next epoch's first batch is already in the ring when
    the loop asks for it, and the workers were started once for epochs in sequence. A resume elsewhere (or a pass
    left early) restarts the stream (the count can fail)."""
    expected = {epoch: pass_of(era5_loader(data, 0), epoch) for epoch in (0, 1)}
    restarts = []
    workers_iter = torch.utils.data.dataloader._MultiProcessingDataLoaderIter
    reset = workers_iter._reset
    monkeypatch.setattr(workers_iter, "_reset", lambda self, loader, first_iter=False:
                        restarts.append(first_iter) or reset(self, loader, first_iter))
    loader = era5_loader(data, 2)
    assert_same(pass_of(loader, 0), expected[0])
    next_slot = loader.loader.batch_sampler.count - 2 * loaders.common.PREFETCH  # the next batch handed out
    deadline = time.monotonic() + 30  # the workers fill the slots they were asked for (a loaded machine: slowly)
    while not torch.equal(loader.ring.views(next_slot % loader.ring.slots, 2)[1], expected[1][0][1]):
        assert time.monotonic() < deadline, "the next epoch's first batch was never read ahead"
        time.sleep(0.05)
    early = [tensor.clone() for tensor in loader.ring.views(next_slot % loader.ring.slots, 2)]
    assert torch.equal(early[0], expected[1][0][0]) and torch.equal(early[1], expected[1][0][1])
    assert_same(pass_of(loader, 1), expected[1])
    assert restarts == [True]  # the first iter() starts the workers; no restart since
    pass_of(loader, 1, skip=3)
    assert restarts == [True, False]


@pytest.mark.compat
@pytest.mark.multiprocess
@pytest.mark.parametrize("spare", [2, 0])
def test_a_batch_stays_untouched_while_the_next_is_taken(data, monkeypatch, spare):  # noqa: F811
    """With the ring's two spare slots, batch j is as it was handed out after batch j+1 was taken and the workers
    had time to run ahead. The twin: without spare slots the workers overwrite it at once."""
    monkeypatch.setattr(loaders.common, "SPARE_SLOTS", spare)
    loader = era5_loader(data, 2)
    loader.set_epoch(0)
    batches = iter(loader)
    next(batches)
    held = next(batches)  # batch 1
    copy = [tensor.clone() for tensor in held]
    next(batches)  # batch 2

    def untouched():
        return all(torch.equal(now, then) for now, then in zip(held, copy))

    # the workers fill every slot they were asked for: 1 s with spare slots; without, until they overwrite batch 1
    # (at most 20 s: a machine busy with other work may take seconds)
    deadline = time.time() + (1.0 if spare == 2 else 20.0)
    while time.time() < deadline and untouched():
        time.sleep(0.05)
    assert untouched() == (spare == 2)


def test_too_little_shared_memory_is_one_line(data, monkeypatch):  # noqa: F811
    def refuse(nbytes):
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2>: No space left on device (28)")
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", staticmethod(refuse))
    with pytest.raises(UserError, match=r"cannot allocate 0\.\d+ GB of shared memory for the loader workers' batches "
                                        r"\(unable to allocate .*\); lower --num_data_workers or the batch size, or "
                                        r"give /dev/shm more room"):
        era5_loader(data, 2)
    assert era5_loader(data, 0).ring is None  # no workers: no shared memory asked for


def test_worker_speedups_are_taken_round_by_round():
    from benchmarks.bench_loader import worker_speedups
    label = "PyTorch, {} workers".format
    rows = [{"loader": label(0), "runs": [100.0, 50.0, 100.0]}, {"loader": label(2), "runs": [200.0, 100.0, 150.0]},
            {"loader": label(4), "runs": [180.0, 120.0, 150.0]}]
    speedups = worker_speedups(rows, label, [0, 2, 4])
    assert speedups["2"]["over_0"]["runs"] == [2.0, 2.0, 1.5] and speedups["2"]["over_0"]["median"] == 2.0
    assert "over_2" not in speedups["2"]
    assert speedups["4"]["over_2"]["runs"] == pytest.approx([0.9, 1.2, 1.0])
    assert speedups["4"]["over_0"]["min"] == pytest.approx(1.5) and speedups["4"]["over_0"]["max"] == 2.4
    assert worker_speedups(rows[1:], label, [2, 4]) == {}  # no 0-worker row: nothing to divide by
    json.dumps(speedups)  # goes into the JSON as is


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_ring_is_page_locked_and_a_slot_waits_for_its_copy(data):  # noqa: F811
    """The loader yields batches on the GPU, copied on its copy stream from the page-locked ring while the loop's
    stream is busy (a long kernel per step): over epochs in sequence and a resume, each batch is the one the loop
    would have read without workers (a slot refilled before its copy ran, or a batch used before its copy ended,
    would show)."""
    expected = {epoch: pass_of(era5_loader(data, 0), epoch) for epoch in (0, 1)}
    loader = era5_loader(data, 2)
    for epoch, skip in ((0, 0), (1, 0), (1, 4)):
        loader.set_epoch(epoch, skip)
        got = []
        for inp, tar in loader:
            assert inp.is_cuda and loader.ring.pinned
            torch.cuda._sleep(50_000_000)  # tens of ms of GPU time ahead of the copies
            got.append((inp.clone(), tar.clone()))  # on the loop's stream, after the sleep
        torch.cuda.synchronize()
        assert loader.copy_stream is not None and loader.copy_stream != torch.cuda.current_stream()
        assert_same([(inp.cpu(), tar.cpu()) for inp, tar in got], expected[epoch][skip:])


class StreamLog:
    """Stand-ins for torch.cuda's streams and events that write down, in order, what the loader asks of them."""

    def __init__(self, monkeypatch):
        self.entries, self.counts = [], {"copy": 0, "step": 0}
        log = self

        class Stream:
            def wait_event(self, event):
                log.entries.append(("loop stream waits for", event.name))

        class Event:
            name = None

            def record(self, stream=None):
                kind = "copy" if stream is log.copy_stream else "step"
                self.name = (kind, log.counts[kind])
                log.counts[kind] += 1

            def synchronize(self):
                log.entries.append(("host waits for", self.name))

        self.compute = Stream()
        self.copy_stream = None
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: setattr(self, "copy_stream", Stream())
                            or self.copy_stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.compute)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None, raising=False)

    def position(self, entry):
        return self.entries.index(entry)


def run_on_logged_streams(loader, on_device, log):
    """One epoch through `_host_pass` and `on_device` (the tensors stay on the CPU), logging each host read and each
    batch handed to the loop; returns the batches."""
    loader.loader.batch_sampler.start = (0, 0)
    loader.batches, loader.position = iter(loader.loader), (0, 0)  # the stream of epoch 0 (starts the workers)

    def logged_host():
        for n, batch in enumerate(loader._host_pass(len(loader))):
            log.entries.append(("host read", n))
            yield batch

    got = []
    for n, batch in enumerate(on_device(loader, logged_host(), torch.device("cpu"))):
        log.entries.append(("loop gets", n))
        got.append(tuple(tensor.clone() for tensor in batch))
    return got


@pytest.mark.multiprocess
@pytest.mark.parametrize("copy", ["on the copy stream", "on the loop's stream (as before)"])
def test_each_copy_runs_beside_the_step_before_it_and_is_waited_for_by_events(data, monkeypatch, copy):  # noqa: F811
    """The GPU path's order of operations, with streams and events written down instead of run: every batch is
    copied on the copy stream, and the loop's stream waits for that copy's event before the batch is handed out;
    before the copy of batch n the host waits for step n-2 and not for step n-1 (so the copy runs while step n-1
    computes, and the loop stays one step ahead of the GPU), and for the copy of batch n-2 before the request that
    reuses its ring slot; no device-wide sync. Every batch is the 0-worker one. The twin (each copy on the loop's
    stream, benchmarks/bench_levers.py's "before") queues the copies behind the steps."""
    from benchmarks.bench_levers import copy_on_the_compute_stream
    expected = pass_of(era5_loader(data, 0), 0)
    log = StreamLog(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.entries.append(("device-wide sync",)))
    loader = era5_loader(data, 2)
    on_device = loaders.common.TorchLoader._on_device if copy == "on the copy stream" else copy_on_the_compute_stream
    got = run_on_logged_streams(loader, on_device, log)
    assert_same(got, expected)
    steps = len(expected)
    waits = [("loop stream waits for", ("copy", n)) for n in range(steps)]
    on_copy_stream = log.counts["copy"] == steps and all(
        wait in log.entries and log.position(wait) < log.position(("loop gets", n)) for n, wait in enumerate(waits))
    assert on_copy_stream == (copy == "on the copy stream")
    if copy != "on the copy stream":
        return
    for n in range(2, steps):
        assert log.position(("host waits for", ("copy", n - 2))) < log.position(("host read", n))
        assert log.position(("host waits for", ("step", n - 2))) < log.position(("loop stream waits for", ("copy", n)))
    for n in range(1, steps):
        assert ("host waits for", ("step", n - 1)) not in log.entries[:log.position(("loop gets", n))]
    assert ("device-wide sync",) not in log.entries
