"""Dry runs of pipeline stages (`train_mp.py --dry_run N --dry_run_rank R --pipeline_parallel P`, planning/dry_run.py)
against the performance model's stages (planning/perf_model.stage_memory_bytes): one rank of every stage of
wfm_tiny at pp=4 x tp=2 x cp=2 (ring), 1F1B with 8 microbatches, on this CPU: the stage's parameters, gradients,
Adam's state and saved activations (one microbatch's, times the microbatches its schedule held at once), and the
heaviest stage, which the planner must name, its peak within 10% of the measured one.
Twin: a planner that leaves the embeddings off the first stage (as a memory estimator that misses the heaviest stage
does) names another stage or misses the peak by more than 10%.
The dry run's checkpoint line: the sharded format copies this rank's parts, the serial one the whole model.
"""
import dataclasses

import pytest
import torch

from planning import perf_model
from planning.dry_run import CPU_DRY_RUN_FLAGS, dry_run_in_own_process, predicted
from utils.layout import Layout
from utils.YParams import YParams

pytestmark = [pytest.mark.usefixtures("in_repo_root"), pytest.mark.multiprocess, pytest.mark.long]
FLAGS = ["--config", "wfm_tiny", "--tensor_parallel", "2", "--context_parallel", "2", "--cp_method", "ring",
         "--pipeline_parallel", "4", "--num_microbatches", "8", *CPU_DRY_RUN_FLAGS, "--local_batch_size", "8",
         "--dry_run_steps", "0"]
LAYOUT = Layout(tp=2, cp=2, cp_method="ring", pp=4, microbatches=8)
WORLD = LAYOUT.world_size


@pytest.fixture(scope="module")
def stages():
    """The dry run of rank 0 of each stage (pp is the slowest dimension: stage s starts at rank s x tp x cp), the
    last one with sharded checkpoints."""
    found = []
    for stage in range(4):
        more = ["--checkpoint_format", "sharded"] if stage == 3 else []
        result, error = dry_run_in_own_process([*FLAGS, "--dry_run", str(WORLD), "--dry_run_rank", str(stage * 4),
                                                *more], timeout=600)
        assert error is None, error
        found.append(result)
    return found


def planned(stage, shapes=None):
    params = YParams("config/ViT.yaml", "wfm_tiny")
    params.update({"local_batch_size": 8, "amp_enabled": False})
    if shapes is None:
        return predicted(params, LAYOUT, torch.device("cpu"), stage=stage)
    memory = perf_model.stage_memory_bytes(shapes[stage], LAYOUT, 8, False, stage)
    return {"peak_memory_gb": sum(memory[key] for key in ("weights", "gradients", "optimizer_state",
                                                          "saved_activations")) / perf_model.GIB}


def test_each_stage_holds_what_the_planner_predicts(stages):
    for stage, result in enumerate(stages):
        assert result["pipeline_stage"] == stage
        assert result["microbatches_in_flight"] == 4 - stage  # 1F1B: P - s
        model = result["predicted"]
        for kind in ("parameters", "gradients", "optimizer_state", "saved_activations"):
            assert result[kind] == pytest.approx(model[kind], rel=0.10), (stage, kind)


def heaviest(peaks):
    return max(range(len(peaks)), key=lambda stage: peaks[stage])


def test_the_planner_names_the_heaviest_stage_and_its_peak_within_10_percent(stages):
    measured = [result["peak_memory_gb"] for result in stages]
    model = [planned(stage)["peak_memory_gb"] for stage in range(4)]
    assert heaviest(measured) == heaviest(model) == 0  # the embeddings and 1F1B's P microbatches in flight
    assert model[0] == pytest.approx(measured[0], rel=0.10)


def test_twin_a_planner_without_the_embeddings_on_the_first_stage_misses_it(stages):
    shape = perf_model.ViTShape.from_params(YParams("config/ViT.yaml", "wfm_tiny"))
    shapes = perf_model.stage_shapes(shape, LAYOUT)
    shapes[0] = dataclasses.replace(shapes[0], holds_embedding=False)
    model = [planned(stage, shapes)["peak_memory_gb"] for stage in range(4)]
    measured = [result["peak_memory_gb"] for result in stages]
    assert heaviest(model) != heaviest(measured) or model[0] != pytest.approx(measured[0], rel=0.10)


def test_the_dry_run_counts_a_save_in_either_format(stages):
    """Serial: every rank gathers the whole model and Adam's two moments (fp32); sharded: its own parts, with Adam's
    step counts."""
    serial, sharded = stages[0]["checkpoint_save"], stages[3]["checkpoint_save"]
    assert (serial["format"], sharded["format"]) == ("serial", "sharded")
    assert serial["host_bytes"] == 228_800 * 4 * 3  # wfm_tiny's parameters (config/ViT.yaml)
    held = stages[3]["parameters"] + stages[3]["optimizer_state"]  # the last stage's own parts
    assert held < sharded["host_bytes"] < held * 1.01 and sharded["host_bytes"] < serial["host_bytes"] / 4
