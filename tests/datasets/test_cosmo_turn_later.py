"""The cosmology crops turned after the copy to the GPU (issue #39, item 1): with `turn_later` (the default where
there is a GPU) the loader's host work per sample is a plain copy of the crop window, and the 24 rotations and
the flips run on the device, on the loader's copy stream (loaders/common.py TorchLoader._on_device,
loaders/cosmo.py turn_batch). The loop must get the same batches bit for bit as when the host turns them: one
rank and two, workers or none, training (epochs in sequence and a mid-epoch resume) and validation, the GPU path's
order of operations (streams written down on the CPU: tests/datasets/test_loader_ring.py) and, on a GPU, the real
thing (tests/gpu). Twins: a finish that does not turn, and the turn on the wrong axes, are caught.

Failures point to loaders/cosmo.py (turn_code, turn_batch, read_batch_into with turn_later) or loaders/common.py
(TorchLoader.__iter__, _finished, _on_device, BatchRing, torch_loader)."""
import h5py
import pytest
import torch

from lifecycle.cli import apply_overrides, training_parser
from loaders.common import TorchLoader, torch_loader
from loaders.cosmo import PERMUTATIONS, ROTATIONS, CosmoDataset, CropPlan, transform, turn_batch, turn_code
from sample_data.cosmo import TRAIN_FILE, VALID_FILE, write_cosmo
from tests.datasets.test_loader_ring import StreamLog, run_on_logged_streams
from utils.YParams import YParams


@pytest.fixture(scope="module")
def cosmo_dir(tmp_path_factory):
    return write_cosmo(tmp_path_factory.mktemp("cosmo") / "data", train_size=24, valid_size=16, verbose=False)


def params_of(cosmo_dir, workers=0, dp_size=1, dp_rank=0):
    params = YParams("config/UNet.yaml", "tiny")
    args = training_parser("t").parse_args(["--local_batch_size", "3", "--num_data_workers", str(workers)])
    apply_overrides(params, args, dp_size=dp_size, dp_rank=dp_rank)
    params.update({"train_path": str(cosmo_dir / TRAIN_FILE), "val_path": str(cosmo_dir / VALID_FILE),
                   "data_loader_config": "lowmem", "data_size": 8, "Nsamples": 12, "Nsamples_val": 12,
                   "enable_flips": True, "seed": 3})
    return params


def loader_of(params, train, turn_later):
    return torch_loader(params, CosmoDataset(params, train), train, turn_later=turn_later)


def pass_of(loader, epoch, skip=0):
    loader.set_epoch(epoch, skip)
    return [tuple(tensor.clone() for tensor in batch) for batch in loader]


def assert_same(got, expected):
    assert len(got) == len(expected) > 0
    for batch, reference in zip(got, expected, strict=True):
        assert len(batch) == len(reference) == 2
        assert all(torch.equal(a, b) for a, b in zip(batch, reference, strict=True))


def mismatches(turn):
    """How many of the 24 rotations x 8 flip patterns `turn` (turn_batch's signature) gets wrong, against
    transform() of the crop."""
    volume = torch.arange(2 * 5 ** 3, dtype=torch.float32).reshape(1, 2, 5, 5, 5)
    wrong = 0
    for rotation in range(len(ROTATIONS)):
        for bits in range(8):
            plan = CropPlan((0, 0, 0), rotation, tuple(axis for axis in range(3) if bits >> axis & 1))
            (turned,) = turn([volume], [turn_code(plan)])
            wrong += not torch.equal(turned[0], torch.from_numpy(transform(volume[0].numpy(), plan).copy()))
    return wrong


def test_a_turn_code_turns_as_the_plan_says():
    """turn_batch of a crop read unturned, by its code, is transform() of it, for all 24 rotations x 8 flips (and
    codes are distinct per distinct turn; 0 is none)."""
    assert mismatches(turn_batch) == 0
    codes = {turn_code(CropPlan((0, 0, 0), rotation, tuple(axis for axis in range(3) if bits >> axis & 1)))
             for rotation in range(len(ROTATIONS)) for bits in range(8)}
    assert turn_code(CropPlan((0, 0, 0), 0, ())) == 0 and len(codes) == 48 == len(PERMUTATIONS) * 8


def mirror_first(volumes, codes):
    """A wrong turn: the mirrors applied to the input's axes before the permutation."""
    out = torch.empty_like(volumes[0])
    for row, code in enumerate(codes):
        mirrored = [axis + 1 for axis in range(3) if code % 8 >> axis & 1]
        view = volumes[0][row].flip(mirrored) if mirrored else volumes[0][row]
        out[row] = view.permute(0, *(axis + 1 for axis in PERMUTATIONS[code // 8]))
    return (out,)


@pytest.mark.parametrize("wrong", [lambda volumes, codes: tuple(volumes), mirror_first],
                         ids=["no turn", "mirrors on the input's axes"])
def test_twin_a_turn_that_is_not_the_plans_is_caught(wrong):
    """The check above fails for a turn that leaves crops as read, or mirrors the input's axes where the plan
    names the output's."""
    assert mismatches(wrong) > 0


@pytest.mark.compat  # the GPU nodes run the container's torch
def test_turned_later_without_workers_the_loop_gets_the_host_turned_batches(cosmo_dir):
    """No workers (the training process reads unturned windows into its ring; TorchLoader turns them): on ranks 0
    and 1 of 2, epochs 0 and 1, a resume at step 1, and validation, the batches of the host-turned loader."""
    for dp_rank in (0, 1):
        params = params_of(cosmo_dir, 0, dp_size=2, dp_rank=dp_rank)
        host, late = loader_of(params, True, False), loader_of(params, True, True)
        assert late.finish is not None and host.finish is None
        for epoch, skip in ((0, 0), (1, 0), (1, 1)):
            assert_same(pass_of(late, epoch, skip), pass_of(host, epoch, skip))
        assert_same(pass_of(loader_of(params, False, True), 0), pass_of(loader_of(params, False, False), 0))
        assert torch.equal(late.first_batch()[0], host.first_batch()[0])  # the step-0 batch: turned either way


def test_twin_a_finish_that_does_not_turn_gives_other_batches(cosmo_dir, monkeypatch):
    """The same comparison with the late loader's finish reduced to dropping the codes: the batches differ (the
    crops really are read unturned and turned afterwards)."""
    params = params_of(cosmo_dir)
    host = pass_of(loader_of(params, True, False), 0)
    monkeypatch.setattr(CosmoDataset, "finish_batch", lambda self, volumes, codes: tuple(volumes))
    late = pass_of(loader_of(params, True, True), 0)
    assert len(late) == len(host) and any(not torch.equal(a[0], b[0]) for a, b in zip(late, host))


@pytest.mark.multiprocess
def test_turned_later_with_workers_the_loop_gets_the_host_turned_batches(cosmo_dir):
    """Two workers reading unturned windows and their codes into the ring (a third buffer): the same batches as
    the host-turned loader without workers, over two epochs and a resume."""
    params = params_of(cosmo_dir, 2)
    late = loader_of(params, True, True)
    assert len(late.ring.buffers) == 3
    reference = loader_of(params_of(cosmo_dir, 0), True, False)
    for epoch, skip in ((0, 0), (1, 0), (1, 2)):
        assert_same(pass_of(late, epoch, skip), pass_of(reference, epoch, skip))


@pytest.mark.compat
@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [0, 2])
def test_on_the_gpu_path_the_turn_follows_the_copy_on_the_copy_stream(cosmo_dir, monkeypatch, workers):
    """TorchLoader._on_device with streams and events written down (the tensors stay on the CPU): each batch's
    codes are read on the host, its crops copied and turned, then handed to the loop, bitwise the host-turned
    batches; with workers (their shared ring) and without (a ring in the training process's own memory, reused
    each batch instead of fresh pages and the DataLoader's pinned copy)."""
    reference = pass_of(loader_of(params_of(cosmo_dir, 0), True, False), 0)
    log = StreamLog(monkeypatch)
    late = loader_of(params_of(cosmo_dir, workers), True, True)
    assert late.ring is not None and late.ring.buffers[0].is_shared() == (workers > 0)
    assert_same(run_on_logged_streams(late, TorchLoader._on_device, log), reference)
    assert log.counts["copy"] == len(reference)


def test_the_benchmarks_host_part_stops_before_the_turn(cosmo_dir):
    """benchmarks/bench_loader.py's "turned on the GPU (host part)" rows time what a GPU node's host does: its
    batches are the windows as they lie in the box, with their turn codes, and turned they are the loader's."""
    from benchmarks.bench_loader import host_part
    params = params_of(cosmo_dir)
    raw = pass_of(host_part(params), 0)
    dataset = CosmoDataset(params, True)
    loader = loader_of(params, True, False)
    loader.set_epoch(0)
    keys = list(loader.sampler)
    assert all(len(batch) == 3 for batch in raw) and any(batch[2].any() for batch in raw)
    for step, (inp, tar, codes) in enumerate(raw):
        for row, key in enumerate(keys[3 * step:3 * step + 3]):
            plan = dataset.plan(key)
            assert codes[row].item() == turn_code(plan)
            z, y, x = plan.corner
            with h5py.File(params.train_path) as f:
                assert torch.equal(inp[row], torch.from_numpy(f["Nbody"][:, z:z + 8, y:y + 8, x:x + 8]))
                assert torch.equal(tar[row], torch.from_numpy(f["Hydro"][:, z:z + 8, y:y + 8, x:x + 8]))
    assert_same([turn_batch(batch[:2], batch[2].view(-1).int().tolist()) for batch in raw], pass_of(loader, 0))
