"""The performance model's counts (utils/perf_model.py) against the real ViT: FLOPs per sample against
torch.utils.flop_counter on the model for every ViT config (within 2%, exact here), parameters per rank against the
model built at tp=1, 2, 4 (exact) and FSDP's shard at dp=2 against the tensors FSDP leaves on rank 0 (tests/test_fsdp
measures that count: 1,420,896 of the demo ViT's 2,817,216 in bench_results/mp_demo.json). A failure points to
utils/perf_model.py, or to a change of networks/vit.py or distributed/layers.py the model has not followed.
"""
import json
import os

import pytest
import torch.multiprocessing as mp
import yaml

from networks import get_model
from tests.conftest import REPO_ROOT, as_spawned_rank, free_port
from utils import comm
from utils.flops import train_flops_per_sample
from utils.perf_model import ViTShape, flops_per_sample, parameters_per_rank, state_bytes_per_rank
from utils.YParams import YParams

pytestmark = pytest.mark.usefixtures("in_repo_root")
VIT_CONFIGS = [name for name, value in yaml.safe_load(open(os.path.join(REPO_ROOT, "config", "ViT.yaml"))).items()
               if isinstance(value, dict) and value.get("model", "vit") == "vit" and name != "base"]


@pytest.mark.parametrize("config", VIT_CONFIGS)
def test_flops_per_sample_are_the_flop_counters(config):
    params = YParams("config/ViT.yaml", config)
    counted = train_flops_per_sample(get_model, params, (params.n_in_channels, *params.img_size))
    assert flops_per_sample(ViTShape.from_params(params)) == pytest.approx(counted, rel=0.02)


def test_a_wrong_count_is_caught():
    """The twin: attention's backward counted with the recomputed scores (flash attention's 10 T^2 D, not 8)."""
    params = YParams("config/ViT.yaml", "mp")
    shape = ViTShape.from_params(params)
    counted = train_flops_per_sample(get_model, params, (params.n_in_channels, *params.img_size))
    recomputed = flops_per_sample(shape) + 2 * shape.depth * shape.tokens ** 2 * shape.embed_dim
    assert recomputed != pytest.approx(counted, rel=0.02)


def vit_params(config):
    params = YParams("config/ViT.yaml", config)
    if config == "tiny":
        params.update({"num_heads": 4})  # divisible by tp = 4
    return params


def _parameters_at_tp(rank, world, port, found):
    as_spawned_rank(rank, world, port, OMP_NUM_THREADS="1")
    comm.init({"tp": world, "cp": 1}, rendezvous_timeout=60)
    for config in ("tiny", "demo") if world == 2 else ("tiny",):  # demo has 6 heads
        found[(config, world, rank)] = sum(p.numel() for p in get_model(vit_params(config)).parameters())
    comm.destroy()


@pytest.mark.multiprocess
def test_parameters_per_rank_are_the_models_at_tp_1_2_4():
    """tiny (4 heads) at tp=1, 2, 4 and demo at tp=1, 2: every rank's count."""
    found = mp.Manager().dict()
    comm.init({"tp": 1, "cp": 1})
    for config in ("tiny", "demo"):
        found[(config, 1, 0)] = sum(p.numel() for p in get_model(vit_params(config)).parameters())
    for world in (2, 4):
        mp.spawn(_parameters_at_tp, args=(world, free_port(), found), nprocs=world)
    assert len(found) == 2 + 2 * 2 + 4
    for (config, tp, rank), count in found.items():
        shape = ViTShape.from_params(vit_params(config))
        assert parameters_per_rank(shape, tp=tp) == count, (config, tp, rank)


def test_fsdp_shard_and_states_follow_the_measured_benchmark():
    """bench_results/mp_demo.json: rank 0's parameters and its bytes of parameters, gradients and Adam, measured
    from the tensors by `make bench-mp`, at tp=1, tp=2 and dp=2 with FSDP."""
    rows = {row["layout"]: row for row in json.load(open("bench_results/mp_demo.json"))["rows"]}
    shape = ViTShape.from_params(YParams("config/ViT.yaml", "demo"))
    for layout, tp, dp, fsdp in (("tp=1", 1, 1, False), ("tp=2", 2, 1, False), ("dp=2 + fsdp", 1, 2, True)):
        row = rows[layout]
        assert parameters_per_rank(shape, tp, dp, fsdp) == row["params_held_per_rank"], layout
        states = state_bytes_per_rank(shape, tp, dp, fsdp)
        assert states["parameters"] / 1e6 == pytest.approx(row["parameters_mb"], rel=1e-9), layout
        assert states["optimizer_state"] / 1e6 == pytest.approx(row["adam_state_mb"], rel=1e-9), layout
