"""The performance model's pipeline stages (planning/perf_model.py: predict_pipeline and its parts) and the planner's
pipelines (planning/plan.py --pipeline_parallel, and pp sizes in --plan), read against the schedules' formula, the
real model cut into stages, and one published pipeline measurement (docs/perf_model.md, "Pipeline stages"):

- the bubble (P - 1) / (M + P - 1) of a step, the same for GPipe and 1F1B, and the step stretched by it: the slowest
  stage's busy time x (M + P - 1) / M, plus the transfers between stages and the tail after the last backward;
- the point-to-point bytes (2 x M x (batch / M) x tokens on the rank x embed_dim x bytes) and the link the pp group
  crosses; the microbatches in flight (GPipe M on every stage, 1F1B P - s on stage s);
- each stage's parameters exactly those of the serial ViT (built on the meta device) cut by
  distributed/pipeline.keep_stage, and the planner's stage cut keep_stage's;
- more microbatches at fixed P predicted faster, approaching the bubble-free limit, and a deeper pipeline costing
  less per GPU with many microbatches than with few, as the Ultra-Scale Playbook's 1F1B runs show;
- wfm_10b_p2 on 256 H100s: the heaviest stage named (stage 0: the position embedding and 1F1B's P microbatches in
  flight) and whether it fits in 80 GB decided by it;
- the planner's pipelines: on 256 A100-40GB only pipelined layouts of wfm_10b_p2 fit, said with train_mp.py's flags.
Each claim has a twin that fails (the bubble, the stages or the embedding's place switched off or moved). A failure
points to planning/perf_model.py (the pipeline section) or planning/plan.py (pipeline_sizes, pipeline_switches).
"""
import dataclasses
import os

import pytest
import torch

from distributed import pipeline
from networks.vit import ViT
from planning import perf_model, plan
from planning.perf_model import SYSTEMS, ViTShape, predict
from tests.conftest import REPO_ROOT
from utils.layout import Axis, Layout
from utils.YParams import YParams

pytestmark = pytest.mark.usefixtures("in_repo_root")

H100 = SYSTEMS["H100-SXM"]
# The Ultra-Scale Playbook (Hugging Face, nanotron, 2025), its 1F1B section: throughput as PP grows with few
# microbatches (m = pp - 1) falls far more than with many (m = 32 >> pp - 1): "using many more microbatches than PP
# degree (m=32 >> pp-1) helps reduce this effect"
PLAYBOOK_MICROBATCHES = 32


def params_of(config):
    return YParams("config/ViT.yaml", config)


def shape_of(config):
    return ViTShape.from_params(params_of(config))


def pipelined(gpus, **switches):
    switches.setdefault("microbatches", switches.get("pp", 1))
    return Layout.for_world(gpus, **switches)


# --- the bubble and the step ----------------------------------------------------------------------------------

@pytest.mark.parametrize("P, M", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 32), (16, 16)])
def test_the_bubble_is_the_schedules_idle_share(P, M):
    """(P - 1) / (M + P - 1) of a step, for both schedules (1F1B reorders the work, not the idle slots); the twin,
    Megatron's (P - 1) / M (the bubble over the ideal time), differs."""
    assert perf_model.bubble_fraction(P, M) == pytest.approx((P - 1) / (M + P - 1), rel=1e-15)
    assert perf_model.bubble_fraction(P, M) != pytest.approx((P - 1) / M, rel=1e-3)
    shape = shape_of("wfm_1b_p4")
    found = {schedule: predict(shape, H100, pipelined(4 * P, tp=1, cp=4, pp=P, microbatches=M, pp_schedule=schedule,
                                                      checkpointing=True), M, "bf16")
             for schedule in ("gpipe", "1f1b")}
    assert found["gpipe"]["pipeline"]["bubble"] == found["1f1b"]["pipeline"]["bubble"] == \
        perf_model.bubble_fraction(P, M)
    assert found["gpipe"]["step_time_s"] == pytest.approx(found["1f1b"]["step_time_s"], rel=1e-12)


def stretch_of(row):
    """The factor the step stretches the slowest stage's busy time and the transfers by."""
    pipe = row["pipeline"]
    slowest = max(stage["busy_s"] for stage in pipe["per_stage"])
    tail = max(stage["after_s"] for stage in pipe["per_stage"])
    unstretched_p2p = pipe["p2p_seconds"] * (1 - pipe["bubble"])
    return (row["step_time_s"] - tail) / (slowest + unstretched_p2p)


def test_the_step_is_the_slowest_stage_stretched_by_the_bubble(monkeypatch):
    """step = (slowest stage's busy time + the transfers) x (M + P - 1) / M + the tail; the time breakdown adds up to
    it. The twin, a model without the bubble: no stretch, and a shorter step by the bubble's share."""
    shape, layout = shape_of("wfm_1b_p4"), pipelined(64, tp=1, cp=4, pp=4, microbatches=8, checkpointing=True)
    row = predict(shape, H100, layout, 32, "bf16")
    assert stretch_of(row) == pytest.approx((8 + 4 - 1) / 8, rel=1e-12)
    assert sum(row["time_breakdown_s"].values()) == pytest.approx(row["step_time_s"], rel=1e-12)
    assert row["time_breakdown_s"]["bubble"] / row["step_time_s"] > 0.15
    monkeypatch.setattr(perf_model, "bubble_fraction", lambda stages, microbatches: 0.0)
    twin = predict(shape, H100, layout, 32, "bf16")
    assert stretch_of(twin) == pytest.approx(1.0, rel=1e-12)
    assert twin["step_time_s"] < row["step_time_s"] * 0.85


def speeds_over_microbatches(shape, P, counts):
    return [predict(shape, H100, pipelined(P, pp=P, microbatches=M, checkpointing=True), M, "bf16")
            ["samples_per_sec"] for M in counts]


def test_more_microbatches_are_faster_towards_the_bubble_free_limit(monkeypatch):
    """At P = 4 (one sample a microbatch), M = 4, 8, 16, 64: each faster than the last, and M = 64 within 5% of the
    bubble-free step's speed, (M + P - 1) / M away. The twin, without the bubble: every M equally fast."""
    shape, counts = shape_of("wfm_1b_p4"), (4, 8, 16, 64)
    speeds = speeds_over_microbatches(shape, 4, counts)
    assert speeds == sorted(speeds) and speeds[0] < 0.7 * speeds[-1]
    monkeypatch.setattr(perf_model, "bubble_fraction", lambda stages, microbatches: 0.0)
    limits = speeds_over_microbatches(shape, 4, counts)
    for M, found, limit in zip(counts, speeds, limits):
        assert found / limit == pytest.approx(M / (M + 4 - 1), rel=0.02)
    assert speeds[-1] > 0.95 * limits[-1]
    assert max(limits) == pytest.approx(min(limits), rel=1e-2)  # the twin: no ranking left (Adam's step aside)


def per_gpu_speed(shape, P, M):
    row = predict(shape, H100, pipelined(P, pp=P, microbatches=M, checkpointing=True), M, "bf16")
    return row["samples_per_sec"] / row["gpus"]


def test_many_microbatches_keep_a_deeper_pipeline_busy_as_published(monkeypatch):
    """The Ultra-Scale Playbook's 1F1B runs (an LLM in nanotron on 8-GPU H100 nodes): with few microbatches the
    throughput per GPU falls far as PP grows, with m = 32 it falls less. Here wfm_10b_p2 (48 blocks) on 4-GPU H100
    nodes, pp 2 to 16, at M = pp (train_mp.py's least: m = pp - 1 is refused) against M = 32: the loss against
    pp = 1 always smaller at M = 32. The twin, without the bubble: no loss to tell apart."""
    shape = shape_of("wfm_10b_p2")
    alone = predict(shape, H100, Layout(checkpointing=True), 1, "bf16")["samples_per_sec"]
    for P in (2, 4, 8, 16):
        few, many = per_gpu_speed(shape, P, P), per_gpu_speed(shape, P, PLAYBOOK_MICROBATCHES)
        assert many > few and 1 - many / alone < (1 - few / alone) - 0.1, (P, few, many, alone)
    deeper = [per_gpu_speed(shape, P, PLAYBOOK_MICROBATCHES) for P in (2, 4, 8, 16)]
    assert deeper == sorted(deeper, reverse=True)  # with m fixed the bubble still grows with pp
    monkeypatch.setattr(perf_model, "bubble_fraction", lambda stages, microbatches: 0.0)
    assert per_gpu_speed(shape, 8, 8) == pytest.approx(per_gpu_speed(shape, 8, PLAYBOOK_MICROBATCHES), rel=1e-2)


# --- between the stages -----------------------------------------------------------------------------------------

def test_the_bytes_between_stages_and_their_link():
    """2 x M x (batch / M) x tokens on this rank x embed_dim x 4 bytes (fp32; 2 under FSDP's 16-bit policy), the
    tokens cp's chunk (and tp's part of it with sequence parallelism); pp, the slowest dimension, crosses the nodes,
    unless the order puts it first: then NVLink. The twin: the pp group inside a node moves the same bytes faster."""
    shape = shape_of("wfm_1b_p4")
    layout = pipelined(64, tp=2, cp=4, pp=4, microbatches=8, sequence_parallel=True, checkpointing=True)
    row = predict(shape, H100, layout, 16, "bf16")
    tokens = 64800 // 4 // 2
    assert row["pipeline"]["p2p_bytes_per_step"] == 2 * 8 * (16 // 2 // 8) * tokens * 2048 * 4
    assert row["comm_bytes_per_step"]["pp"] == row["pipeline"]["p2p_bytes_per_step"]
    fsdp = pipelined(64, tp=2, cp=4, pp=4, microbatches=8, sequence_parallel=True, fsdp=True)
    assert perf_model.p2p_bytes_per_step(shape, fsdp, 8, half=True) == row["pipeline"]["p2p_bytes_per_step"] // 2
    assert row["pipeline"]["p2p_link"] == "network"
    inside = dataclasses.replace(layout, order="pp-tp-cp-dp")
    twin = predict(shape, H100, inside, 16, "bf16")
    assert twin["pipeline"]["p2p_link"] == "NVLink"
    assert twin["pipeline"]["p2p_bytes_per_step"] == row["pipeline"]["p2p_bytes_per_step"]
    assert twin["pipeline"]["p2p_seconds"] < row["pipeline"]["p2p_seconds"] / 4


def test_the_microbatches_held_in_flight():
    """GPipe holds all M microbatches' activations on every stage, 1F1B P - s on stage s; stage 0's saved
    activations scale with them. The twin: 1F1B holding GPipe's M would hold the same as GPipe."""
    shape = shape_of("wfm_1b_p4")
    rows = {schedule: predict(shape, H100, pipelined(4, pp=4, microbatches=16, pp_schedule=schedule,
                                                     checkpointing=True), 16, "bf16")["pipeline"]["per_stage"]
            for schedule in ("gpipe", "1f1b")}
    assert [stage["microbatches_in_flight"] for stage in rows["gpipe"]] == [16] * 4
    assert [stage["microbatches_in_flight"] for stage in rows["1f1b"]] == [4, 3, 2, 1]
    saved = {schedule: stages[0]["memory_bytes"]["saved_activations"] for schedule, stages in rows.items()}
    assert saved["gpipe"] == 4 * saved["1f1b"]
    assert rows["gpipe"][0]["peak_memory_gb"] > rows["1f1b"][0]["peak_memory_gb"]


# --- the stages against the real model --------------------------------------------------------------------------

def cut_model(config, layout, stage):
    """The serial ViT of `config` on the meta device, cut to pipeline stage `stage` by keep_stage: (its parameters,
    the blocks per stage)."""
    with torch.device("meta"):
        model = ViT(params_of(config))
    layers = pipeline.keep_stage(model, layout, Axis("pp", layout.pp, stage))
    return sum(parameter.numel() for parameter in model.parameters()), tuple(layers)


@pytest.mark.parametrize("config, pp, pp_layers", [("wfm_tiny", 2, None), ("wfm_tiny", 4, None),
                                                   ("wfm_tiny", 2, (1, 3)), ("wfm_1b_p4", 3, None),
                                                   ("wfm_10b_p2", 4, None), ("wfm_10b_p2", 16, None)])
def test_each_stage_holds_the_cut_models_parameters(config, pp, pp_layers):
    """Each stage's parameters in the planner equal those of the serial ViT cut by distributed/pipeline.keep_stage,
    exactly; the planner's blocks per stage are keep_stage's; its state bytes 16 per parameter (fp32 weights,
    gradients, Adam's two moments). The twin: the embeddings counted on every stage (a model without the first
    stage's share) misses every stage but the first."""
    layout = Layout(pp=pp, microbatches=pp, pp_layers=pp_layers)
    shape = shape_of(config)
    stages = perf_model.stage_shapes(shape, layout)
    for index, stage in enumerate(stages):
        counted, layers = cut_model(config, layout, index)
        assert perf_model.stage_layers(shape, layout) == layers
        assert perf_model.parameters_per_rank(stage, layout) == counted, (config, index)
        states = perf_model.state_bytes_per_rank(stage, layout)
        assert sum(states.values()) == 16 * counted
        twin = dataclasses.replace(stage, holds_embedding=True)
        assert (perf_model.parameters_per_rank(twin, layout) == counted) == (index == 0)
    assert sum(perf_model.parameters_per_rank(stage, layout) for stage in stages) == \
        perf_model.parameters_per_rank(shape)


def test_the_planners_stage_costs_are_the_pipelines():
    """stage_cost_ratios is distributed/pipeline.stage_costs of the serial model, to the last bit, so the planner
    cuts where keep_stage does; the twin: the head's cost given to the embedding changes the ratio."""
    for config in ("wfm_tiny", "wfm_1b_p4", "wfm_10b_p2", "mp"):
        with torch.device("meta"):
            model = ViT(params_of(config))
        assert perf_model.stage_cost_ratios(shape_of(config)) == pipeline.stage_costs(model)
        assert perf_model.stage_cost_ratios(shape_of(config))[::-1] != pipeline.stage_costs(model)


def test_the_10b_heaviest_stage_on_h100_decides_the_fit(monkeypatch):
    """wfm_10b_p2 on 256 H100s at tp = 4, cp = 4, pp = 4 (1F1B, M = 4, checkpointing): stage 0 is the heaviest (the
    1.06 B position embedding and P microbatches in flight) and does NOT fit in 80 GB, while every other stage would;
    with sequence parallelism it fits. Twins: with 1F1B's in-flight rule switched off (one microbatch a stage),
    or with the embeddings moved to the last stage, it would fit."""
    shape = shape_of("wfm_10b_p2")
    layout = pipelined(256, tp=4, cp=4, pp=4, microbatches=4, checkpointing=True)
    row = predict(shape, H100, layout, 16, "bf16")
    peaks = [stage["peak_memory_gb"] for stage in row["pipeline"]["per_stage"]]
    assert row["pipeline"]["heaviest_stage"] == 0 and peaks[0] == max(peaks) == row["peak_memory_gb"]
    assert not row["fits"] and peaks[0] > 80 and max(peaks[1:]) < 80
    stage0 = row["pipeline"]["per_stage"][0]["memory_bytes"]
    stage1 = row["pipeline"]["per_stage"][1]["memory_bytes"]
    # both hold 12 blocks; stage 0 also the patch embedding, its bias and the position embedding, whole on every rank
    embeddings = shape.embed_dim * (shape.in_channels * shape.patch_size ** 2 + 1 + shape.tokens)
    assert stage0["weights"] - stage1["weights"] == 4 * embeddings
    sp = predict(shape, H100, dataclasses.replace(layout, sequence_parallel=True), 16, "bf16")
    assert sp["fits"] and sp["pipeline"]["heaviest_stage"] == 0
    with monkeypatch.context() as patch:
        patch.setattr(perf_model, "microbatches_in_flight", lambda layout, stage: 1)
        assert predict(shape, H100, layout, 16, "bf16")["fits"]
    original = perf_model.stage_shapes

    def embeddings_last(shape, layout):
        return [dataclasses.replace(stage, holds_embedding=stage.holds_head) for stage in original(shape, layout)]

    monkeypatch.setattr(perf_model, "stage_shapes", embeddings_last)
    assert predict(shape, H100, layout, 16, "bf16")["fits"]


# --- the planner ------------------------------------------------------------------------------------------------

def test_plan_lists_pipelines_with_their_flags(capsys):
    """On 256 A100-40GB (Perlmutter) at tp = cp = 8, only pipelines of wfm_10b_p2 fit; the plan lists them with
    pp and M and train_mp.py's flags. The twin: the same plan without pipelines (--pipeline_parallel 1) fits none."""
    rows = plan.main(["--config", "wfm_10b_p2", "--gpus", "256", "--plan", "--tensor_parallel", "8",
                      "--context_parallel", "8", "--top", "3"])["layouts"]
    out = capsys.readouterr().out
    assert rows and all(row["pp"] > 1 for row in rows)
    best = rows[0]
    flags = [f"--pipeline_parallel={best['pp']}", f"--num_microbatches={best['microbatches']}",
             f"--pp_schedule={best['pp_schedule']}"]
    assert all(flag in best["flags"] for flag in flags) and all(flag in out for flag in flags)
    assert f"pp={best['pp']} ({best['pp_schedule']}, M={best['microbatches']})" in out
    assert best["microbatches"] == best["local_batch_size"]  # one sample a microbatch: the smallest bubble
    assert "pp=1: no layout fits" in out
    twin = plan.main(["--config", "wfm_10b_p2", "--gpus", "256", "--plan", "--tensor_parallel", "8",
                      "--context_parallel", "8", "--pipeline_parallel", "1"])["layouts"]
    assert twin == [] and "no layout of 256 GPUs fits" in capsys.readouterr().out


def test_one_pipelined_layout_is_described_stage_by_stage(capsys):
    """--pipeline_parallel with --num_microbatches: the layout line says pp and M, the stages line the blocks, each
    stage's peak, the heaviest and the bubble; a layout of fewer microbatches than stages is refused in one line."""
    plan.main(["--config", "wfm_1b_p4", "--gpus", "16", "--gpu", "H100-SXM", "--context_parallel", "4",
               "--pipeline_parallel", "4", "--num_microbatches", "16", "--activation_checkpointing"])
    out = capsys.readouterr().out
    assert "dp=1 pp=4 (1f1b, M=16)" in out and "stages: blocks 4, 5, 5, 4" in out
    assert "the heaviest stage 0" in out and f"bubble {100 * 3 / 19:.1f}% of the step" in out
    with pytest.raises(SystemExit) as stop:
        plan.main(["--config", "wfm_1b_p4", "--gpus", "64", "--pipeline_parallel", "4", "--num_microbatches", "2"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fewer than the 4 pipeline stages" in err
    for argv, words in ((["--tensor_parallel", "4", "--pipeline_parallel", "8"], "tp x cp x pp = 4 x 1 x 8 = 32"),
                        (["--gpus", "32", "--pipeline_parallel", "32"], "more stages than the model's 18 blocks")):
        with pytest.raises(SystemExit):
            plan.main(["--config", "wfm_1b_p4", "--gpus", "16", *argv])
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err


def test_the_pp_sizes_the_plan_tries():
    """Powers of two dividing both the depth and the GPUs, for the 0.25-degree ViTs on A100-40GB and H100 (their
    state takes 1/8 of a GPU or more); 1 for the tutorial's `mp` (its plans as README quotes them), without --plan,
    and the one given with --pipeline_parallel. The twin: a depth of 18 leaves out 4 and 8."""
    args = plan.parser().parse_args(["--plan"])
    for name in ("A100-40GB", "H100-SXM"):
        system = SYSTEMS[name]
        assert plan.pipeline_sizes(256, shape_of("wfm_10b_p2"), system, args) == [1, 2, 4, 8, 16]
        assert plan.pipeline_sizes(256, shape_of("wfm_1b_p4"), system, args) == [1, 2]
        assert plan.pipeline_sizes(8, shape_of("wfm_10b_p2"), system, args) == [1, 2, 4, 8]
        assert plan.pipeline_sizes(256, shape_of("mp"), system, args) == [1]
        assert plan.pipeline_sizes(256, shape_of("wfm_10b_p2"), system, plan.parser().parse_args([])) == [1]
        given = plan.parser().parse_args(["--plan", "--pipeline_parallel", "3"])
        assert plan.pipeline_sizes(256, shape_of("mp"), system, given) == [3]


def test_the_docs_quote_the_pipeline_predictions():
    """docs/perf_model.md's "Pipeline stages" quotes the model as it is now: the first row of the 256-GPU plan, the
    per-GPU losses against the published ranking, the pp 8 -> 16 drop and the H100 leader; the twin: a first row 1%
    faster is not on the page."""
    with open(os.path.join(REPO_ROOT, "docs", "perf_model.md")) as f:
        text = f.read()
    system = SYSTEMS[plan.DEFAULT_GPU]
    layout = pipelined(256, tp=8, cp=8, pp=2, microbatches=8, cp_method="ring", sequence_parallel=True,
                       checkpointing=True, fsdp=True)
    row = predict(shape_of("wfm_10b_p2"), system, layout, 16, "bf16")
    row["sbatch"] = plan.sbatch_line("wfm_10b_p2", layout, None, system.gpus_per_node)
    assert " 1. " + plan.summary(row, system) in text
    row["samples_per_sec"] *= 1.01
    assert " 1. " + plan.summary(row, system) not in text
    shape = shape_of("wfm_10b_p2")
    alone = predict(shape, H100, Layout(checkpointing=True), 1, "bf16")["samples_per_sec"]
    losses = ", ".join(f"pp {P}: {100 * (1 - per_gpu_speed(shape, P, P) / alone):.0f}% / "
                       f"{100 * (1 - per_gpu_speed(shape, P, PLAYBOOK_MICROBATCHES) / alone):.0f}%"
                       for P in (2, 4, 8, 16))
    prose = " ".join(text.split())
    assert f"at M = pp and at M = 32: {losses}." in prose
    drop = 1 - per_gpu_speed(shape, 16, PLAYBOOK_MICROBATCHES) / per_gpu_speed(shape, 8, PLAYBOOK_MICROBATCHES)
    assert f"The model says {100 * drop:.1f}% at M = 32" in prose
