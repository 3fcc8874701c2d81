"""The performance model's counts (planning/perf_model.py) against the real ViT:

- FLOPs per sample against torch.utils.flop_counter on the model, every ViT config (within 2%; exact here; the twin,
  flash attention's recomputed scores counted, misses);
- parameters, gradient and Adam bytes per rank, and saved activations, against every layout `make bench-mp` and
  `make bench-mp-shape` measured (tp, cp, sequence parallelism, checkpointing, FSDP; fp32 and bf16), and saved
  activations against the saved-tensor hooks on the model here (within 5%; exact; the twin, one cast of the norm's
  output shared by q, k and v, misses);
- bytes per collective group and op in one training step against the collectives counted on gloo (within 1%;
  exact).

A failure points to planning/perf_model.py, or to a change of networks/vit.py, distributed/ or the FSDP setup that the
model has not followed.
"""
import collections
import dataclasses
import json
import os

import pytest
import torch
import torch.multiprocessing as mp
import yaml

from loop.flops import train_flops_per_sample
from loop.profiling import SavedActivations
from networks import get_model
from planning.perf_model import (
    ViTShape,
    block_flops_per_sample,
    collectives_per_step,
    comm_bytes_per_step,
    flops_per_sample,
    parameters_per_rank,
    saved_activation_bytes,
    state_bytes_per_rank,
)
from tests.conftest import REPO_ROOT, as_spawned_rank, free_port
from utils import comm
from utils.layout import Layout
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


@pytest.mark.parametrize("config", ["mp", "short"])
def test_one_blocks_forward_and_backward_flops_are_the_flop_counters(config):
    """One serial Block of the config on the meta device, forward then backward, against block_flops_per_sample. The
    twin: the block without attention's score FLOPs misses."""
    from torch.utils.flop_counter import FlopCounterMode

    from networks.vit import Block
    shape = ViTShape.from_params(YParams("config/ViT.yaml", config))
    with torch.device("meta"):
        block = Block(shape.embed_dim, shape.num_heads)
        x = torch.empty(2, shape.tokens, shape.embed_dim, requires_grad=True)
    with FlopCounterMode(display=False) as forward:
        out = block(x)
    with FlopCounterMode(display=False) as backward:
        out.sum().backward()
    predicted = block_flops_per_sample(shape)
    counted = (forward.get_total_flops() // 2, backward.get_total_flops() // 2)
    assert predicted == pytest.approx(counted, rel=0.02)
    assert predicted[0] - 4 * shape.tokens ** 2 * shape.embed_dim != pytest.approx(counted[0], rel=0.02)


def vit_params(config):
    params = YParams("config/ViT.yaml", config)
    if config == "tiny":
        params.update({"num_heads": 4})  # divisible by tp = 4
    return params


@pytest.mark.parametrize("bench, config", [("mp_demo.json", "demo"), ("mp_shape.json", "mp")])
def test_parameters_and_states_per_rank_are_the_measured_ones(bench, config):
    """Every row of `make bench-mp` (demo: tp=1, 2, cp=2, dp=2 with DDP and FSDP) and `make bench-mp-shape` (mp:
    tp=1, 4, dp=2 with FSDP): rank 0's parameters and its bytes of parameters, gradients and Adam, measured from the
    tensors (FSDP: its shards)."""
    shape = ViTShape.from_params(YParams("config/ViT.yaml", config))
    for row in json.load(open(os.path.join("bench_results", bench)))["rows"]:
        layout = Layout(tp=row["tp"], cp=row["cp"], dp=row["dp"], fsdp="--fsdp" in row["flags"])
        assert parameters_per_rank(shape, layout) == row["params_held_per_rank"], row["layout"]
        states = state_bytes_per_rank(shape, layout)
        for key, column in (("parameters", "parameters_mb"), ("gradients", "gradients_mb"),
                            ("optimizer_state", "adam_state_mb")):
            assert states[key] / 1e6 == pytest.approx(row[column], rel=1e-9), (row["layout"], key)


@pytest.mark.parametrize("config", ["tiny", "demo"])
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
def test_saved_activations_are_the_measured_ones(config, half, checkpointing):
    from distributed.parallelize import checkpoint_blocks
    comm.init({"tp": 1, "cp": 1})
    params = YParams("config/ViT.yaml", config)
    torch.manual_seed(0)
    model = get_model(params)
    if checkpointing:
        checkpoint_blocks(model.blocks)
    batch = 3
    with SavedActivations(model) as saved, torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
        model(torch.randn(batch, params.n_in_channels, *params.img_size))
    shape = ViTShape.from_params(params)
    predicted = saved_activation_bytes(shape, batch, half, Layout(checkpointing=checkpointing))
    assert predicted == pytest.approx(saved.nbytes, rel=0.05)
    if half and not checkpointing:  # the twin: q, k and v each casting the norm's output, as they did before
        three_casts = predicted + batch * shape.depth * 2 * 2 * shape.tokens * shape.embed_dim
        assert three_casts != pytest.approx(saved.nbytes, rel=0.05)


def test_a_batch_viewed_from_a_loader_buffer_counts_as_the_batch():
    """The loader's ring holds several batches in one storage; the convolution saves its input, a view of it: the
    measurement counts the batch's bytes, not the ring's (the twin: the whole storage is 6 batches)."""
    comm.init({"tp": 1, "cp": 1})
    params = YParams("config/ViT.yaml", "tiny")
    model = get_model(params)
    ring = torch.randn(6 * 2, params.n_in_channels, *params.img_size)
    measured = []
    for inp in (ring[2:4], ring[2:4].clone()):
        with SavedActivations(model) as saved:
            model(inp)
        measured.append(saved.nbytes)
    assert measured[0] == measured[1] == saved_activation_bytes(ViTShape.from_params(params), 2)
    assert ring.untyped_storage().nbytes() > measured[0]


@pytest.mark.parametrize("bench, config, half", [("mp_demo.json", "demo", False), ("mp_shape.json", "mp", True)])
def test_saved_activations_of_every_measured_layout(bench, config, half):
    """Every DDP layout `make bench-mp` (demo, fp32, batch 8) and `make bench-mp-shape` (mp, bf16, batch 1) measured
    on rank 0: tp, cp, sequence parallelism and checkpointing, for the code each measured (mp_shape.json: the
    attention that cast its input for each of q, k and v). Twin (bf16): the model of today's attention, which casts
    once, is 8.5% below that measurement at tp=1."""
    doc = json.load(open(os.path.join("bench_results", bench)))
    measured_code = dataclasses.replace(ViTShape.from_params(YParams("config/ViT.yaml", config)),
                                        attention_input_casts=doc.get("attention_input_casts", 1))
    checked = 0
    for row in doc["rows"]:
        if "--fsdp" in row["flags"] and half:
            continue  # FSDP's 16-bit policy runs the whole forward in bf16: not modelled
        layout = Layout(tp=row["tp"], cp=row["cp"], sequence_parallel="--sequence_parallel" in row["flags"],
                        checkpointing="--activation_checkpointing" in row["flags"])
        predicted = saved_activation_bytes(measured_code, row["local_batch_size"], half, layout)
        assert predicted / 1e6 == pytest.approx(row["saved_activations_mb"], rel=0.05), row["layout"]
        if half and row["layout"] == "tp=1":
            today = saved_activation_bytes(dataclasses.replace(measured_code, attention_input_casts=1), 1, half, layout)
            assert today / 1e6 != pytest.approx(row["saved_activations_mb"], rel=0.05)
        checked += 1
    assert checked >= 6


def _count_collectives(rank, world, ports, layouts, found):
    """For each layout (grid, runs) in turn, on `world` ranks: each run (label, sequence parallel, checkpointing,
    fsdp) takes a warm-up step, then the bytes rank 0 hands to each collective in one step are kept by group name."""

    import torch.distributed as dist

    from distributed.parallelize import Options, parallelize
    from utils.layout import Grid
    torch.set_num_threads(1)
    counts, names = collections.Counter(), {}

    def counted(collective, op, payload):
        def call(*args, **kwargs):
            name = names.get(kwargs.get("group"))
            if name is not None:
                counts[name, op] += payload(*args, **kwargs)
            return collective(*args, **kwargs)
        return call

    def nbytes(tensor):
        return tensor.numel() * tensor.element_size()

    dist.all_reduce = counted(dist.all_reduce, "all_reduce", lambda tensor, *a, **k: nbytes(tensor))
    dist.all_gather = counted(dist.all_gather, "all_gather", lambda outputs, *a, **k: sum(nbytes(t) for t in outputs))
    if hasattr(dist, "all_gather_single"):
        dist.all_gather_single = counted(dist.all_gather_single, "all_gather", lambda output, *a, **k: nbytes(output))
        dist.reduce_scatter_single = counted(dist.reduce_scatter_single, "reduce_scatter",
                                             lambda *a, **k: nbytes(k["input"]))
    inp = torch.randn(2, 20, 16, 32)
    for port, (grid, runs) in zip(ports, layouts):
        as_spawned_rank(rank, world, port, OMP_NUM_THREADS="1")
        joined = comm.init(grid, rendezvous_timeout=60)
        names.clear()
        for name in ("tp", "cp", "tp-cp", "dp"):
            if comm.get_size(name) > 1:
                names.setdefault(comm.get_group(name), name)
        for label, sequence_parallel, checkpointing, fsdp, half in runs:
            params = vit_params("tiny")
            params.update({"amp_enabled": half, "amp_dtype": torch.bfloat16 if half else torch.float32})
            layout = dataclasses.replace(joined.layout, sequence_parallel=sequence_parallel,
                                         checkpointing=checkpointing, fsdp=fsdp)
            torch.manual_seed(0)
            model = get_model(params, layout)
            options = Options(param_dtype=params.amp_dtype if half else None,
                              channels_last=bool(params.get("enable_nhwc")))
            model = parallelize(model, Grid(layout, joined.axes), torch.device("cpu"), options)
            optimizer = torch.optim.Adam(model.parameters())
            for _ in range(2):  # a warm-up step, then the one counted
                counts.clear()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
                    loss = model(inp).float().square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            if rank == 0:
                found[label] = (grid, sequence_parallel, checkpointing, fsdp, half, dict(counts))
        comm.destroy()


LAYOUTS = [  # grid, runs: (label, sequence parallel, checkpointing, fsdp, bf16 autocast), on 4 ranks
    ({"tp": 2, "cp": 1}, [("tp2xdp2 sp checkpointing", True, True, False, False),
                          ("tp2xdp2 fsdp", False, False, True, False), ("tp2xdp2 bf16", False, False, False, True),
                          ("tp2xdp2 sp fsdp bf16", True, False, True, True)]),
    ({"tp": 2, "cp": 2}, [("tp2xcp2", False, False, False, False),
                          ("tp2xcp2 sp checkpointing", True, True, False, False),
                          ("tp2xcp2 sp checkpointing bf16", True, True, False, True),
                          ("tp2xcp2 fsdp", False, False, True, False)]),  # dp = 1: only the sums on the shards
    ({"tp": 1, "cp": 2}, [("cp2xdp2", False, False, False, False)]),
]


@pytest.mark.multiprocess
@pytest.mark.long
def test_comm_bytes_per_step_are_what_the_collectives_move():
    """Every collective of a training step on gloo, counted on rank 0 by wrapping torch.distributed's calls (DDP's
    comm hook makes them for tp/cp layouts; FSDP2 calls all_gather_single / reduce_scatter_single in the pinned
    torch): tp2 x dp2 with sequence parallelism and checkpointing, and with FSDP; tp2 x cp2, also with sequence
    parallelism and checkpointing, and with FSDP at dp = 1; cp2 x dp2; in fp32, and in bf16 autocast (tp2 x dp2
    plain and with sp + FSDP, tp2 x cp2 with sp + checkpointing: the 16-bit row-parallel exits and FSDP gathers).
    Within 1% (exact here), by group and by op (all-reduce, all-gather, reduce-scatter: what the time model's rings
    cost). The twin: the model with checkpointing's repeated collectives and FSDP switched the other way misses."""
    layouts = LAYOUTS if hasattr(torch.distributed, "all_gather_single") else [
        (grid, [run for run in runs if not run[3]]) for grid, runs in LAYOUTS]
    found = mp.Manager().dict()
    mp.spawn(_count_collectives, args=(4, [free_port() for _ in layouts], layouts, found), nprocs=4)
    shape = ViTShape.from_params(vit_params("tiny"))
    assert len(found) == sum(len(runs) for _, runs in layouts)
    for label, (grid, sequence_parallel, checkpointing, fsdp, half, by_op) in found.items():
        layout = Layout.for_world(4, grid["tp"], grid["cp"], sequence_parallel=sequence_parallel,
                                  checkpointing=checkpointing, fsdp=fsdp)
        twin_layout = dataclasses.replace(layout, checkpointing=not checkpointing, fsdp=not fsdp)
        counts, predicted_by_op = collections.Counter(), collections.Counter()
        for (name, _), value in by_op.items():
            counts[name] += value
        for name, op, value, when in collectives_per_step(shape, 2, layout, half=half):
            if when == "targets":  # gathered before the step (train_mp.py's to_device); the step here starts after
                continue
            if op == "reduce_scatter" and when == "activations":
                op = "all_reduce"  # gloo has none: distributed.helpers.reduce_scatter sums and slices on gloo
            predicted_by_op[name, op] += value
        wrong = [(key, predicted_by_op.get(key), value) for key, value in sorted(by_op.items())
                 if predicted_by_op.get(key) != pytest.approx(value, rel=0.01)]
        assert sorted(predicted_by_op) == sorted(by_op) and not wrong, (label, wrong)
        predicted = collections.Counter()
        for name, _, value, when in collectives_per_step(shape, 2, layout, half=half):
            predicted[name] += value if when != "targets" else 0
        predicted = {name: value for name, value in predicted.items() if value}
        assert sorted(predicted) == sorted(counts), label
        for name, value in counts.items():
            assert predicted[name] == pytest.approx(value, rel=0.01), (label, name)
        twin = comm_bytes_per_step(shape, 2, twin_layout, half=half)
        assert any(twin[name] != pytest.approx(value, rel=0.01) for name, value in counts.items()), label
