"""Validation counts every sample once (loop/validation.validate, loaders/common.py ResumableSampler.real_samples).

Without drop_last the sharded sampler gives every rank as many samples by repeating the first ones of the order at
the end (torch's DistributedSampler); validate weighs those repeats zero, so the validation means on N ranks are
1 rank's. Checked on 2 and 3 gloo ranks (one start of 3 processes) on an odd-sized set whose first two samples
have a far larger loss than the others, so a repeat of them shows; with the real loaders on simulated ranks (ERA5
through PyTorch and DALI, the cosmology crops); and the sampler's count itself. The twins count the padding as
before (real_samples patched to "every row"): the means then differ. A failure points to validate's weighting, or
to a sampler (or loader) whose padding is not the last sample of a rank's pass.
"""
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loaders.common import ResumableSampler, dali_installed, torch_loader
from loaders.cosmo import CropSampler
from loop import validation
from task.loss import get_loss, l2_loss
from task.metrics import era5_valid_metrics, get_valid_metrics
from tests.conftest import as_spawned_rank, free_port
from utils import comm

N, C, H, W, BATCH = 7, 2, 4, 8, 2  # 7 samples in batches of 2: 2 ranks pad 1 sample, 3 ranks pad 2
RTOL = 1e-5  # float32 sums in another order
NO_AUTOCAST = torch.autocast("cpu", enabled=False)


class Samples(torch.utils.data.Dataset):
    """N (input, target) pairs: the target is the input up to 1% noise, but for samples 0 and 1 (the ones the
    sampler repeats) it is the negated input: relative L2 error 2 against about 0.01 for the model below."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.inp = torch.randn(N, C, H, W, generator=generator)
        self.tar = self.inp + 0.01 * torch.randn(N, C, H, W, generator=generator)
        self.tar[:2] = -self.inp[:2]

    def __len__(self):
        return N

    def __getitem__(self, index):
        return self.inp[index], self.tar[index]


class Params(dict):
    __getattr__ = dict.__getitem__


def samples_loader(world, rank):
    """The PyTorch loader (loaders/common.torch_loader: TorchLoader over ResumableSampler) of rank `rank` of `world`."""
    params = Params(local_batch_size=BATCH, data_num_shards=world, data_shard_id=rank, seed=0, num_data_workers=0)
    return torch_loader(params, Samples(), train=False)


def samples_means(world, rank):
    """validate() of the persistence model (the identity) on `samples_loader`: {"loss", "RMSE(u10m)/valid"}."""
    return validation.validate(torch.nn.Identity(), samples_loader(world, rank), lambda inp, tar: (inp, tar),
                              l2_loss, era5_valid_metrics, NO_AUTOCAST)[0]


def _rank(rank, port, out_dir):
    """Rank `rank` of 3 gloo processes: the 3-rank means (the reduction over comm's "dp"), then on ranks 0 and 1 the
    2-rank means (reduced over their pair: one start-up of the processes for both), each also with the padding
    counted; rank 0 writes them."""
    as_spawned_rank(rank, 3, port)
    torch.set_num_threads(1)
    comm.init(rendezvous_timeout=60)
    pair = dist.new_group([0, 1])  # every rank takes part in making it

    def pair_sum(tensor, group="dp"):
        dist.all_reduce(tensor, group=pair)
        return tensor

    results = {}
    for world in (3, 2):
        if rank < world:
            with pytest.MonkeyPatch.context() as patch:
                if world == 2:
                    patch.setattr(comm, "all_reduce_sum", pair_sum)
                weighted = samples_means(world, rank)
                patch.setattr(validation, "real_samples", lambda loader: math.inf)  # the twin: every row counts
                results[world] = {"weighted": weighted, "padding_counted": samples_means(world, rank)}
    dist.barrier()
    if rank < 2:
        dist.destroy_process_group(pair)
    comm.destroy()
    if rank == 0:
        with open(os.path.join(out_dir, "means.json"), "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def on_ranks(tmp_path_factory):
    """{"2" and "3": {"weighted": means, "padding_counted": means}}: rank 0's validation means on 2 and 3 gloo
    processes (one spawn of 3 for both, shared by the tests and their twins)."""
    out_dir = str(tmp_path_factory.mktemp("ranks"))
    mp.spawn(_rank, args=(free_port(), out_dir), nprocs=3)
    with open(os.path.join(out_dir, "means.json")) as f:
        return json.load(f)


def assert_means_equal(got, expected):
    assert got.keys() == expected.keys()
    for tag in expected:
        assert got[tag] == pytest.approx(expected[tag], rel=RTOL), tag


def test_one_rank_reports_the_mean_over_samples():
    """1 rank: each sample once, per-sample means (the last batch holds 1 sample), the semantics the ranks keep."""
    data = Samples()
    per_sample = [l2_loss(data.inp[i:i + 1], data.tar[i:i + 1]).item() for i in range(N)]
    rmse = era5_valid_metrics(data.inp, data.tar)["RMSE(u10m)/valid"]
    assert_means_equal(samples_means(1, 0), {"loss": sum(per_sample) / N, "RMSE(u10m)/valid": rmse.mean().item()})


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_validation_on_ranks_equals_one_rank(on_ranks, world):
    """2 ranks: rank 1's last batch is (sample 5, repeat of 0): a slice; 3 ranks: ranks 1 and 2 end with a batch
    of one repeat, which weighs nothing."""
    assert_means_equal(on_ranks[str(world)]["weighted"], samples_means(1, 0))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_with_the_padding_counted_the_ranks_differ_from_one_rank(on_ranks, world):
    """The twin: the repeats of samples 0 and 1 counted (as before) move the loss from 4.05 / 7 to about 6.05 / 8
    (2 ranks) or 8.05 / 9 (3 ranks)."""
    one, padding_counted = samples_means(1, 0), on_ranks[str(world)]["padding_counted"]
    assert padding_counted["loss"] > one["loss"] * 1.2
    assert padding_counted["loss"] != pytest.approx(one["loss"], rel=1000 * RTOL)


@pytest.mark.parametrize("sampler_class", [ResumableSampler, CropSampler])
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_samplers_real_samples_are_each_sample_once_and_the_padding_their_tail(sampler_class, shuffle):
    """Over every rank, the first real_samples() of each rank's pass are the data set once; also with fewer
    samples than ranks, with a skip (resume), with drop_last (no padding). CropSampler's keys are (epoch, index)."""
    def index(key):
        return key[1] if isinstance(key, tuple) else key

    for n in (1, 7, 10, 12):
        for world in range(1, 6):
            real = []
            for rank in range(world):
                sampler = sampler_class(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=3,
                                        drop_last=False)
                sampler.set_epoch(2)
                order, count = [index(key) for key in sampler], sampler.real_samples()
                real += order[:count]
                assert len(order) - count <= 1  # at most one repeat, the last of the pass
                sampler.set_epoch(2, skip=1)  # a pass that starts a sample later has one real sample fewer
                assert [index(key) for key in sampler] == order[1:] and sampler.real_samples() == max(0, count - 1)
            assert sorted(real) == list(range(n)), (n, world)
            whole = sampler_class(range(n), num_replicas=world, rank=world - 1, shuffle=shuffle, drop_last=True)
            assert whole.real_samples() == len(list(whole))


def simulated_ranks(make_loader, world, model, loss_fn, metrics_fn, monkeypatch):
    """validate() on each rank of `world` in turn, in this process: the reduction over "dp" is patched to collect
    the ranks' sums, the last rank's returns their total, so its means are those of `world` ranks."""
    sums = []

    def collect(tensor, group="dp"):
        sums.append(tensor.clone())
        return torch.stack(sums).sum(dim=0)

    with monkeypatch.context() as patch:
        patch.setattr(comm, "all_reduce_sum", collect)
        for rank in range(world):
            means = validation.validate(model, make_loader(world, rank), lambda inp, tar: (inp, tar), loss_fn,
                                       metrics_fn, NO_AUTOCAST)[0]
    return means


def era5_loader(era5_dir, config):
    from lifecycle.cli import apply_overrides, training_parser
    from loaders import get_data_loader
    from utils.YParams import YParams

    def make(world, rank):
        params = YParams("config/ViT.yaml", "tiny")
        args = training_parser("t").parse_args(["--data_dir", era5_dir, "--local_batch_size", "4"])
        apply_overrides(params, args, dp_size=world, dp_rank=rank)
        params.update({"data_loader_config": config, "limit_nsamples_val": 11})  # 2 and 3 ranks pad 1 sample
        return get_data_loader(params, train=False)

    return make


def cosmo_loader(world, rank):
    from lifecycle.cli import apply_overrides, training_parser
    from loaders import get_data_loader
    from utils.YParams import YParams
    params = YParams("config/UNet.yaml", "tiny")
    args = training_parser("t").parse_args(["--local_batch_size", "2"])
    apply_overrides(params, args, dp_size=world, dp_rank=rank)
    params.update({"data_loader_config": "synthetic", "synthetic_box_size": 12, "data_size": 8, "Nsamples_val": 7})
    return get_data_loader(params, train=False)


@pytest.mark.parametrize("dataset", ["era5-pytorch", "era5-dali", "cosmo-crops"])
def test_the_loaders_on_simulated_ranks_report_one_ranks_means(in_repo_root, era5_dir, monkeypatch, dataset):
    """The real loaders deliver their sampler's order, padding last: ERA5 (11 samples in batches of 4) through
    PyTorch and DALI (its source pads and the iterator trims by the same sampler), the cosmology crops (7, keys
    (epoch, index), the UNet's L1 loss). 2 and 3 ranks equal 1; counting the padding they do not."""
    if dataset == "era5-dali" and not dali_installed():
        pytest.skip("NVIDIA DALI is not installed")
    if dataset == "cosmo-crops":
        make, loss_fn = cosmo_loader, get_loss(Params(loss="l1_rho", lambda_rho=0.1))  # with the density term
        metrics_fn = get_valid_metrics(Params(model="unet"))  # none
        torch.manual_seed(0)
        model = torch.nn.Conv3d(4, 5, 1)
        with torch.no_grad():
            model.weight.mul_(0.1)  # small outputs: exp(14 x) of the density term stays finite
    else:
        make, loss_fn, metrics_fn = era5_loader(era5_dir, dataset.split("-")[1]), l2_loss, era5_valid_metrics
        model = torch.nn.Identity()
    one = simulated_ranks(make, 1, model, loss_fn, metrics_fn, monkeypatch)
    for world in (2, 3):
        assert_means_equal(simulated_ranks(make, world, model, loss_fn, metrics_fn, monkeypatch), one)
    monkeypatch.setattr(validation, "real_samples", lambda loader: math.inf)
    padding_counted = simulated_ranks(make, 3, model, loss_fn, metrics_fn, monkeypatch)
    assert padding_counted["loss"] != pytest.approx(one["loss"], rel=10 * RTOL)
