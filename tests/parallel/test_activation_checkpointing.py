"""Activation checkpointing of the ViT's blocks (distributed/parallelize.py, `train_mp.py --activation_checkpointing`):
the blocks keep only their inputs for the backward pass (measured with saved-tensor hooks), gradients are those of
the plain model, and the recomputation replays the dropout masks (a run equals the run without checkpointing; the
twin, without the random state kept, does not). tp=2 x cp=2 with checkpointing against serial train.py is in
tests/training/test_train_mp.py. A failure points to distributed/parallelize.py or loop/profiling.py
(SavedActivations)."""
import os

import pytest
import torch
import yaml

import distributed.parallelize
import train_mp
from distributed.parallelize import checkpoint_blocks
from loop.profiling import SavedActivations
from networks import get_model
from tests.training.test_train_mp import results
from utils import comm
from utils.YParams import YParams

pytestmark = [pytest.mark.compat, pytest.mark.usefixtures("in_repo_root")]


def tiny_vit_and_batch():
    comm.init({"tp": 1, "cp": 1})
    params = YParams("config/ViT.yaml", "tiny")
    torch.manual_seed(0)
    model = get_model(params)
    return model, torch.randn(2, params.n_in_channels, *params.img_size)


def forward_and_backward(model, batch):
    with SavedActivations(model) as saved:
        loss = model(batch).square().mean()
    loss.backward()
    return saved.nbytes, {name: param.grad for name, param in model.named_parameters()}


def test_checkpointed_blocks_keep_their_inputs_only_and_give_the_same_gradients():
    """Measured with saved-tensor hooks: the model without its blocks saves what lies outside them; with checkpointed
    blocks, exactly one (B, N, E) block input more per block; without checkpointing, many times that."""
    model, batch = tiny_vit_and_batch()
    plain_bytes, plain_grads = forward_and_backward(model, batch)
    model.zero_grad(set_to_none=True)
    names = [name for name, _ in model.named_parameters()]
    checkpoint_blocks(model.blocks)
    checkpointed_bytes, grads = forward_and_backward(model, batch)
    assert [name for name, _ in model.named_parameters()] == names  # state_dict names stay the serial ones
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)

    depth, block_input = len(model.blocks), batch.shape[0] * model.h * model.w * model.pos_embed.shape[-1] * 4
    model.blocks = torch.nn.ModuleList()  # what the patch embedding, final norm, head and loss save
    outside_bytes, _ = forward_and_backward(model, batch)
    assert checkpointed_bytes - outside_bytes == depth * block_input
    assert plain_bytes - outside_bytes > 10 * depth * block_input  # the twin: without checkpointing


def dropout_config(tmp_path):
    """The tiny config with dropout 0.1 (attention, MLP and stochastic depth), in a YAML file of its own."""
    tiny = dict(yaml.safe_load(open("config/ViT.yaml"))["tiny"])  # merge keys resolved: the whole config
    tiny["dropout"] = 0.1
    path = tmp_path / "vit_dropout.yaml"
    path.write_text(yaml.safe_dump({"tiny": tiny}))
    return str(path)


def run_tiny(era5_dir, expdir, *flags):
    train_mp.main(["--yaml_config", dropout_config(expdir), "--config", "tiny", "--data_dir", era5_dir,
                   "--expdir", str(expdir), "--num_iters", "12", *flags])
    return results(os.path.join(str(expdir), "tiny", "1MP", "00"))


@pytest.fixture(scope="module")
def without_checkpointing(era5_dir, tmp_path_factory):
    return run_tiny(era5_dir, tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("keep_random_state", [True, False], ids=["replayed", "twin-not-replayed"])
def test_the_recomputed_forward_replays_the_dropout_masks(era5_dir, tmp_path, monkeypatch, without_checkpointing,
                                                          keep_random_state):
    """With dropout 0.1, a checkpointed run equals the plain one in every TensorBoard point and weight (12 steps:
    the recomputation drew the same masks, and left the random stream where the plain run has it). The twin
    recomputes without the kept random state: other masks, other gradients, another run."""
    monkeypatch.setattr(distributed.parallelize, "PRESERVE_RNG_STATE", keep_random_state)
    points, checkpoint = run_tiny(era5_dir, tmp_path, "--activation_checkpointing")
    plain_points, plain_checkpoint = without_checkpointing
    same = points == pytest.approx(plain_points, rel=1e-5) and all(
        torch.allclose(checkpoint["model"][name], weight, rtol=1e-5, atol=1e-6)
        for name, weight in plain_checkpoint["model"].items())
    assert sorted(points) == sorted(plain_points) and same == keep_random_state


def test_the_benchmark_reports_the_bytes_checkpointing_saves(era5_dir, tmp_path, monkeypatch):
    """`--enable_benchy` records this rank's parameter, gradient, Adam and saved-activation bytes (what make bench-mp
    tabulates): checkpointing leaves the parameters and gradients as they are and saves far less."""
    import json
    memory = []
    for run, flags in enumerate(((), ("--activation_checkpointing",))):
        monkeypatch.setenv("BENCHY_OUTPUT", str(tmp_path / f"bench{run}"))
        train_mp.main(["--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path / str(run)),
                       "--enable_benchy", "--benchy_nbatches", "2", "--benchy_ntrials", "1", "--benchy_nwarmup", "1",
                       *flags])
        memory.append(json.loads((tmp_path / f"bench{run}.json").read_text())["memory_bytes"])
    plain, checkpointed = memory
    model, _ = tiny_vit_and_batch()
    parameter_bytes = 4 * sum(param.numel() for param in model.parameters())
    assert plain["parameters"] == checkpointed["parameters"] == plain["gradients"] == parameter_bytes
    assert plain["optimizer_state"] == 2 * parameter_bytes  # Adam's two moments, counted from the optimizer
    assert 0 < checkpointed["saved_activations"] < plain["saved_activations"] / 2
