"""torch.compile and the model-parallel mappings (distributed/mappings.py): the collectives of an active group run
outside the graph (`_apply`, marked compiler.disable), and on a group of size 1 the mapping is the identity inside
the graph. Before, the whole mapping was marked: a serial ViT's compiled forward broke at its cp scatter and gather
into three graphs (train.py --enable_jit, the single-GPU lesson's compiled step; since a cp rank embeds only its band,
the forward has the gather alone, and the twin breaks it into two); and on torch 2.5 the attention's
input cast (distributed.layers.cast_once_for_autocast) asked torch.amp.is_autocast_available, which that compiler
cannot trace, and broke it again at every attention. A failure points to distributed/mappings.py, the mappings'
calls in networks/vit.py, or cast_once_for_autocast.
"""
import contextlib

import pytest
import torch
import torch.multiprocessing as mp

import networks.vit
from networks import get_model
from tests.conftest import as_spawned_rank, free_port
from utils.YParams import YParams


def tiny_vit_and_batch():
    params = YParams("config/ViT.yaml", "tiny")
    torch.manual_seed(params.seed)
    generator = torch.Generator().manual_seed(1)
    return params, get_model(params), torch.randn(2, 20, 16, 32, generator=generator)


def explain(model, x, autocast=False):
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        explained = torch._dynamo.explain(model)(x)
    return explained.graph_count, explained.graph_break_count


@pytest.mark.compat
@pytest.mark.usefixtures("in_repo_root")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_serial_vit_compiles_to_one_graph(autocast):
    _, model, x = tiny_vit_and_batch()
    assert explain(model, x, autocast) == (1, 0)


@pytest.mark.compat
@pytest.mark.usefixtures("in_repo_root")
def test_twin_the_whole_mapping_marked_breaks_the_serial_graph_in_two(monkeypatch):
    """The check above can fail: the mappings marked as a whole, as before, break the serial forward at the cp gather
    before the head (the sequence-parallel scatter is not called serially)."""
    for name in ("scatter_to_parallel_region", "gather_from_parallel_region"):
        monkeypatch.setattr(networks.vit, name, torch.compiler.disable(getattr(networks.vit, name)))
    _, model, x = tiny_vit_and_batch()
    assert explain(model, x) == (2, 1)


def asked_for_autocast(x):
    """The attention's input cast as it was: it asks whether the device has autocast."""
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


@pytest.mark.compat
@pytest.mark.usefixtures("in_repo_root")
@pytest.mark.skipif(torch.__version__ >= "2.6", reason="this torch's compiler traces is_autocast_available: the "
                    "twin shows the break on the container's torch 2.5 (make test-compat)")
def test_twin_on_torch_2_5_asking_for_autocast_breaks_the_graph_at_every_attention(monkeypatch):
    monkeypatch.setattr(networks.vit, "cast_once_for_autocast", asked_for_autocast)
    params, model, x = tiny_vit_and_batch()
    graphs, breaks = explain(model, x, autocast=True)
    assert breaks >= params.depth, (graphs, breaks)  # at least one break in every block's attention


def _compiled_against_eager(rank, world, port, layout, results):
    as_spawned_rank(rank, world, port, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from distributed.parallelize import split_tokens_and_weights
    from utils import comm
    grid = comm.init(layout, rendezvous_timeout=60)
    params, model, x = tiny_vit_and_batch()
    split_tokens_and_weights(model, grid)
    out = {"sizes": [comm.get_size(name) for name in layout]}
    for label, run in (("eager", model), ("compiled", torch.compile(model, backend="aot_eager"))):
        model.zero_grad()
        loss = run(x).square().mean()
        loss.backward()
        out[label] = (loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()})
    results[rank] = out
    comm.destroy()


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [{"tp": 2}, {"cp": 2}], ids=["tp2", "cp2"])
def test_a_model_parallel_vit_compiles_to_the_eager_loss_and_gradients(layout):
    """At tp=2 and at cp=2 (2 gloo ranks) the compiled forward and backward (aot_eager: the graph without a code
    generator) give the eager loss and every gradient: the collectives run, outside the graph."""
    found = mp.Manager().dict()
    mp.spawn(_compiled_against_eager, args=(2, free_port(), layout, found), nprocs=2)
    assert sorted(found) == [0, 1]
    for rank, out in found.items():
        assert out["sizes"] == [2]  # the mappings are active
        (eager_loss, eager_grads), (loss, grads) = out["eager"], out["compiled"]
        assert loss == pytest.approx(eager_loss, rel=1e-6), rank
        for name, grad in eager_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=f"rank {rank}: {name}")
