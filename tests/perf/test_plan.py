"""The performance model's time and memory (benchmarks/perf_model.predict) and the layout planner (planning/plan.py):

- the published GPU runs (the original tutorial's README, A100 on Perlmutter): samples/s within 25% and the memory
  line within 15% (of the predicted peak: the line reads NVML at the second step, when the allocator's cache holds
  the first step's peak), every row with the same constants; the twins (tensor parallelism's collectives free, the
  runtime overhead left out) miss;
- the planner's obvious truths: a layout that cannot fit is never listed (the published "OOM on 40 GB" layout is
  missing on A100-40GB and listed on A100-80GB); more GPUs never predicted slower for the same layout per GPU; tp
  across nodes predicted slower than tp inside a node (and the same when the NIC is as fast as NVLink);
- the command's interface: the JSON line, the layouts of --plan, and one line with exit 2 for what cannot be
  planned.
"""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from planning import perf_model, plan
from planning.perf_model import RUNTIME_OVERHEAD_GIB, SYSTEMS, ViTShape, predict
from tests.conftest import REPO_ROOT
from utils import compat
from utils.errors import UserError
from utils.layout import Layout
from utils.YParams import YParams

pytestmark = pytest.mark.usefixtures("in_repo_root")


def shape_of(config):
    return ViTShape.from_params(YParams("config/ViT.yaml", config))


def published_rows():
    return [(row, speed, memory) for *_, row, speed, memory in plan.against_published()]


def test_the_published_runs_are_predicted_within_the_targets(capsys):
    """The four published runs, as `make plan ARGS=--published` prints them for README."""
    checked = 0
    assert len(plan.print_published(False)) == 4 and capsys.readouterr().out.count("x A100") == 4
    for row, speed, memory in published_rows():
        assert row["samples_per_sec"] == pytest.approx(speed, rel=0.25), (row["tp"], row["dp"])
        if memory is not None:
            assert row["peak_memory_gb"] == pytest.approx(memory, rel=0.15), (row["tp"], row["dp"])
            checked += 1
    assert checked == 3


def test_the_model_ranks_context_above_tensor_parallelism_as_published():
    """The 2025 edition ran `mp` on 16 A100-40GB at tp=4 (126 samples/s; 124.4 in 2024) and at cp=4 (166): the model
    puts them in the same order, by about the published ratio (the totals are checked above)."""
    rows = {row["tp"]: row for row, _, _ in published_rows()[2:]}
    tp4, cp4 = rows[4]["samples_per_sec"], rows[1]["samples_per_sec"]
    assert cp4 > tp4 and cp4 / tp4 == pytest.approx(166.0 / 126.0, rel=0.15)


def test_without_the_tp_collectives_or_the_runtime_overhead_the_published_runs_are_missed(monkeypatch):
    """The twins: the collectives of 4-rank groups taken as free (tp's; dp's all-reduce hides behind the backward
    pass anyway), the tp=4 run's speed misses; the memory outside the tensors left out, both mp runs' memory misses."""
    free = perf_model.collective_seconds
    monkeypatch.setattr(perf_model, "collective_seconds",
                        lambda op, nbytes, ranks, bandwidth: 0.0 if ranks == 4 else free(op, nbytes, ranks, bandwidth))
    row, speed, _ = published_rows()[2]
    assert row["samples_per_sec"] != pytest.approx(speed, rel=0.25)
    monkeypatch.setattr(perf_model, "collective_seconds", free)
    for config, gpu, layout, amp, _, memory in plan.PUBLISHED[1:]:
        row = predict(shape_of(config), SYSTEMS[gpu], layout, 64, amp, overhead_gib=0)
        assert row["peak_memory_gb"] != pytest.approx(memory, rel=0.15)


def plan_args(*argv):
    return plan.parser().parse_args(["--config", "mp", *argv])


def test_the_model_holds_part_by_part_against_the_h100_step_profiles(capsys):
    """`make plan ARGS=--parts`: the model's attention, GEMMs and memory-bound time of the ViT `short` bf16 step
    against the committed H100 profiles, eager and compiled, as docs/perf_model.md shows them."""
    with open(plan.PROFILES) as f:
        profiles = json.load(f)["profiles"]
    comparison = plan.print_parts(plan.PROFILES, False)
    printed = capsys.readouterr().out
    assert comparison["system"] == "H100-SXM" and plan.parts_refusals(comparison) == []
    rows = {row["part"]: row for row in comparison["rows"]}
    # the measured side is the profiles' own numbers, summed as PARTS says
    eager, compiled = profiles["vit_nw8_bf16"]["ms_per_step"], profiles["vit_nw8_bf16_fused_jit"]["ms_per_step"]
    assert rows["attention"]["measured_ms"] == {"eager": eager["attention"], "compiled": compiled["attention"]}
    assert rows["memory_bound"]["measured_ms"]["compiled"] == compiled["norm_elementwise"] + compiled["optimizer"]
    # the model's parts add up to its compute, and the model is the one `make plan` prints for that step
    profiled = dataclasses.replace(shape_of("short"), attention_input_casts=plan.PROFILED_ATTENTION_INPUT_CASTS)
    row = predict(profiled, SYSTEMS["H100-SXM"], Layout(), 16, "bf16")
    assert sum(part["model_ms"] for part in rows.values()) == pytest.approx(comparison["total"]["model_ms"])
    assert comparison["total"]["model_ms"] == pytest.approx(1e3 * row["step_time_s"])  # one GPU: no communication
    assert "The model holds part by part." in printed
    with open(os.path.join(REPO_ROOT, "docs", "perf_model.md")) as f:
        doc = f.read()
    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert len(table) == 6 and "\n".join(table) in doc
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        readme = " ".join(f.read().split())
    assert (f"attention {rows['attention']['model_ms']:.1f} ms, GEMMs {rows['gemm']['model_ms']:.1f}, memory-bound "
            f"{rows['memory_bound']['model_ms']:.1f} (`make plan ARGS=--parts`") in readme


@pytest.mark.parametrize("efficiency, missed", [({"matmul": 1.0}, {"attention", "gemm"}),
                                                ({"memory": 0.3}, {"memory_bound"})])
def test_twin_a_model_off_in_one_kind_of_work_fails_the_part_check(monkeypatch, efficiency, missed):
    """The totals could hide it; the parts do not: at the GPU's full matmul peak, or at 30% of its HBM bandwidth."""
    monkeypatch.setattr(perf_model, "EFFICIENCY", {**perf_model.EFFICIENCY, **efficiency})
    problems = plan.parts_refusals(plan.against_profiles())
    assert {problem.split(":")[0] for problem in problems} == missed, problems


def test_a_layout_that_cannot_fit_is_never_listed():
    """The mp config at tp=1 on 4 GPUs ran out of memory on the 40 GB A100 and ran on the 80 GB one (A23)."""
    shape, published_oom = shape_of("mp"), Layout(tp=1, dp=4)
    listed = {gpu: plan.plan(shape, SYSTEMS[gpu], 4, 64, "fp16", plan_args("--gpus", "4"))
              for gpu in ("A100-40GB", "A100-80GB")}
    assert listed["A100-40GB"] and all(row["peak_memory_gb"] <= 40 for row in listed["A100-40GB"])
    layouts = {gpu: [(row["tp"], row["cp"], row["dp"], tuple(row["flags"])) for row in rows]
               for gpu, rows in listed.items()}
    oom = (1, 1, 4, tuple(published_oom.flags()))
    assert oom not in layouts["A100-40GB"] and oom in layouts["A100-80GB"]
    speeds = [row["samples_per_sec"] for row in listed["A100-40GB"]]
    assert speeds == sorted(speeds, reverse=True)


@pytest.mark.parametrize("tp, cp, flags", [(1, 1, {}), (4, 1, {"sequence_parallel": True}),
                                           (2, 2, {"checkpointing": True}), (1, 1, {"fsdp": True})])
def test_more_gpus_are_never_predicted_slower_for_the_same_layout_per_gpu(tp, cp, flags):
    """Local batch 16, the same tp x cp and flags, dp from 1 (2 with FSDP) to 64: samples/s only grows (a ring moves
    at most twice the data per rank, however many ranks, and DDP's all-reduce hides behind the backward pass). The
    twin: NICs 2,500 times slower than Slingshot's, where the dp group leaves the node it no longer hides, and the
    job gets slower."""
    shape = shape_of("mp")

    def speeds(system):
        return [predict(shape, system, Layout(tp=tp, cp=cp, dp=dp, **flags), 16 * dp, "bf16")["samples_per_sec"]
                for dp in (1, 2, 4, 8, 16, 32, 64) if dp > 1 or not flags.get("fsdp")]

    found = speeds(SYSTEMS["A100-40GB"])
    assert all(later > earlier for earlier, later in zip(found, found[1:])), found
    slowed = speeds(dataclasses.replace(SYSTEMS["A100-40GB"], nic_bytes_per_s=1e7))
    assert not all(later > earlier for earlier, later in zip(slowed, slowed[1:])), slowed


def test_tp_across_nodes_is_predicted_slower_than_inside_a_node():
    shape, system = shape_of("mp"), SYSTEMS["A100-40GB"]
    inside, across = Layout(tp=4, dp=4, order="tp-cp-dp"), Layout(tp=4, dp=4, order="dp-tp-cp")
    assert perf_model.group_spans_nodes(inside, 4) == {"tp": False, "cp": False, "tp-cp": False, "dp": True}
    assert perf_model.group_spans_nodes(across, 4)["tp"] and not perf_model.group_spans_nodes(across, 4)["dp"]
    assert predict(shape, system, across, 64)["samples_per_sec"] < predict(shape, system, inside, 64)[
        "samples_per_sec"]
    same = dataclasses.replace(system, nic_bytes_per_s=system.nvlink_pair)  # the twin: placement then costs nothing
    assert predict(shape, same, across, 64)["samples_per_sec"] == pytest.approx(
        predict(shape, same, inside, 64)["samples_per_sec"])


def last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_json_line_has_the_interface(capsys):
    plan.main(["--config", "mp", "--gpus", "16", "--tensor_parallel", "4", "--json"])
    row = last_json(capsys)
    for key in ("samples_per_sec", "mfu", "memory_after_forward_gb", "peak_memory_gb", "flops_per_sample"):
        assert isinstance(row[key], (int, float)) and row[key] > 0, key
    assert set(row["comm_bytes_per_step"]) >= {"tp", "cp", "dp"}
    counts = row["counts"]  # per block and per step: FLOPs, bytes by kind, every collective by group and op
    assert counts["block_flops_per_sample"]["backward"] == 2 * counts["block_flops_per_sample"]["forward"] > 0
    memory = counts["memory_bytes"]
    assert memory["after_forward"] == sum(memory[name] for name in (
        "weights", "optimizer_state", "ddp_buckets", "gathered_root", "input_batch", "saved_activations"))
    assert row["memory_after_forward_gb"] == pytest.approx(memory["after_forward"] / 1024 ** 3 + RUNTIME_OVERHEAD_GIB)
    by_group = {}
    for collective in counts["collectives"]:
        by_group[collective["group"]] = by_group.get(collective["group"], 0) + collective["bytes"]
    assert by_group == {group: value for group, value in row["comm_bytes_per_step"].items() if value}
    assert {(c["group"], c["op"]) for c in counts["collectives"]} >= {("tp", "all_reduce"), ("dp", "all_reduce")}
    assert (row["tp"], row["cp"], row["dp"]) == (4, 1, 4) and row["comm_bytes_per_step"]["tp"] > 0
    assert row["sbatch"] == "sbatch --nodes 4 submit_pm_mp.sh --config=mp --tensor_parallel=4 --context_parallel=1"
    plan.main(["--config", "mp", "--gpus", "16", "--plan", "--json", "--gpu", "H100-SXM"])
    layouts = last_json(capsys)["layouts"]
    assert len(layouts) > 10 and all(row["tp"] * row["cp"] * row["dp"] == 16 for row in layouts)
    assert {(row["tp"], row["cp"]) for row in layouts} >= {(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)}
    assert all(row["fits"] and row["sbatch"].startswith("sbatch --nodes 4 submit_pm_mp.sh") for row in layouts)


@pytest.mark.parametrize("argv, words", [
    (["--yaml_config", "config/UNet.yaml", "--config", "demo"], "covers the ViT"),
    (["--config", "mp", "--gpus", "16", "--tensor_parallel", "3"], "does not divide"),
    (["--config", "mp", "--gpus", "6"], "whole nodes of 4"),
    (["--config", "mp", "--gpus", "128", "--tensor_parallel", "1"], "cannot evenly distribute 64 across 128 GPU"),
    (["--config", "mp", "--tensor_parallel", "16"], "num_heads 8 does not divide by tp = 16"),
    (["--config", "mp", "--gpus", "16", "--tensor_parallel", "16", "--plan"], "no layout of 16 GPUs"),
    (["--config", "mp", "--gpu", "V100"], "invalid choice"),
    (["--config", "mp", "--tensor_parallel", "0"], "--tensor_parallel is 0"),
    (["--config", "mp", "--gpus", "8192", "--context_parallel", "8192"], "4050 patches, fewer than cp = 8192"),
    (["--config", "mp", "--sequence_parallel"], "it needs --tensor_parallel 2 or more"),
    (["--config", "mp", "--gpus", "4", "--parallel_order", "tp-xx"], "order 'tp-xx'"),
    (["--yaml_config", "missing.yaml"], "not found"),
    (["--config", "mp", "--overhead_gb", "nan"], "--overhead_gb is nan"),
    (["--config", "mp", "--plan", "--gpus", "4", "--top", "0"], "--top is 0"),
    (["--parts", "missing.json"], "step profiles 'missing.json' cannot be read"),
])
def test_what_cannot_be_planned_is_one_line_and_exit_2(capsys, argv, words):
    with pytest.raises(SystemExit) as stop:
        plan.main(argv)
    assert stop.value.code == 2
    out = capsys.readouterr()
    err = out.err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and words in err and not out.out, err


@pytest.mark.multiprocess
@pytest.mark.long
def test_make_plan_prints_the_json_last():
    """The command as `make plan` runs it, in its own process."""
    out = subprocess.run([sys.executable, "-m", "planning.plan", "--config", "mp", "--gpus", "4", "--plan",
                          "--json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[1].startswith(" 1. tp=") and lines[2].strip().startswith("sbatch --nodes 1 submit_pm_mp.sh")
    assert json.loads(lines[-1])["layouts"][0]["samples_per_sec"] > 0


def fsdp_runs_on_the_cpu():
    """Whether train_mp.py runs --fsdp on a CPU with this torch: the shim refuses it on torch < 2.6 (FSDP2 needs
    CUDA there), where the first two layouts of the plan below, both --fsdp, could not be measured."""
    try:
        compat.fsdp_api(torch.device("cpu"))
    except UserError:
        return False
    return True


# then the two layouts of cp=4 at tp = 1 and dp = 1, where the planner lists --fsdp only when asked for (and no
# --sequence_parallel): with activation checkpointing and without, which the twin tells apart
WITHOUT_FSDP = ["--tensor_parallel", "1", "--context_parallel", "4"]


@pytest.mark.multiprocess
@pytest.mark.long
def test_measure_dry_runs_the_first_layouts_beside_the_model(capsys):
    """`--plan --measure 2` runs rank 0 of the first two layouts of the tiny ViT on 4 ranks (train_mp.py --dry_run;
    on a CPU at local batch 1; where --fsdp cannot run there, of cp=4's): each measured state is the planner's
    prediction to the byte, and the saved activations the model's at that batch within 5%; the twin, each
    measurement against the other layout's prediction, differs."""
    result = plan.main(["--config", "tiny", "--gpus", "4", "--plan", "--measure", "2", "--json",
                        *([] if fsdp_runs_on_the_cpu() else WITHOUT_FSDP)])
    rows, measured = result["layouts"][:2], result["measured"]
    assert len(measured) == 2 and all("error" not in found for found in measured), measured
    assert rows[0]["flags"] != rows[1]["flags"]

    def state(found):
        return found["parameters"] + found["gradients"] + found["optimizer_state"]

    def predicted_state(row):
        memory = row["counts"]["memory_bytes"]
        return memory["weights"] + memory["gradients"] + memory["optimizer_state"]

    def matches(row, found, model):
        return state(found) == predicted_state(row) and found["saved_activations"] == pytest.approx(
            model["saved_activations"], rel=0.05)

    for row, found in zip(rows, measured):
        assert found["layout"]["flags"] == row["flags"]
        assert matches(row, found, found["predicted"]), (row["flags"], found)
    assert not (matches(rows[0], measured[1], measured[0]["predicted"])
                and matches(rows[1], measured[0], measured[1]["predicted"]))
    assert "Measured by dry runs" in capsys.readouterr().out


# what README and docs/answers.md quote of `make plan`: (the command's arguments, the page, the words with the
# prediction's numbers in them, formatted from the JSON row)
QUOTED = [
    (["--config", "bs1024_opt", "--gpus", "64"], "README.md",
     lambda r: f'`make plan ARGS="--config bs1024_opt --gpus 64"`, predicts {r["samples_per_sec"]:,.0f},'),
    (["--config", "bs1024_opt", "--gpus", "64"], "docs/answers.md",
     lambda r: f'`make plan ARGS="--config bs1024_opt --gpus 64"` predicts {r["samples_per_sec"]:,.0f} samples/s'),
    (["--config", "short", "--gpu", "H100-SXM", "--amp_mode", "bf16"], "docs/perf_model.md",
     lambda r: f'`make plan ARGS="--config short --gpu H100-SXM --amp_mode bf16"` predicts {r["samples_per_sec"]:.1f} '
     "samples/s"),
    (["--config", "mp", "--gpus", "16", "--tensor_parallel", "4"], "docs/answers.md", lambda r: "| tp=4 dp=4 | "
     f"{r['samples_per_sec']:.1f} | {r['peak_memory_gb']:.1f} | {quoted_breakdown(r)} | tp "
     f"{r['comm_bytes_per_step']['tp'] / 1024 ** 3:.2f} GB"),
    (["--config", "mp", "--gpus", "16", "--context_parallel", "4", "--parallel_order", "cp-tp-dp"], "docs/answers.md",
     lambda r: f"| cp=4 dp=4 | {r['samples_per_sec']:.1f} | {r['peak_memory_gb']:.1f} | {quoted_breakdown(r)} | cp "
     f"{r['comm_bytes_per_step']['cp'] / 1024 ** 3:.2f} GB"),
]


def quoted_breakdown(row):
    """'matmul / memory-bound / exposed communication (step in all)', in ms as docs/answers.md's table has them."""
    ms = {name: 1e3 * seconds for name, seconds in row["time_breakdown_s"].items()}
    return (f"{ms['matmul']:.0f} / {ms['memory_bound']:.0f} / {ms['exposed_communication']:.0f} "
            f"({1e3 * row['step_time_s']:.0f} in all)")


def quote_mismatches(capsys, change=None):
    """Each quoted prediction the page does not hold, as 'page: words'; `change` edits the row first (the twin)."""
    found = []
    for argv, page, words in QUOTED:
        plan.main([*argv, "--json"])
        row = last_json(capsys)
        if change:
            change(row)
        with open(os.path.join(REPO_ROOT, page)) as f:
            text = " ".join(f.read().split())  # prose wraps anywhere
        if words(row) not in text:
            found.append(f"{page}: {words(row)}")
    return found


def test_the_docs_quote_what_make_plan_prints(capsys):
    """README's and docs/answers.md's predictions are the model's as it is now (they went stale once, when the model
    learned that the attention casts its input once); the twin: a prediction 1% off is named."""
    assert quote_mismatches(capsys) == []
    changed = quote_mismatches(capsys, change=lambda row: row.update(samples_per_sec=row["samples_per_sec"] * 1.01))
    assert len(changed) == len(QUOTED)
    # the original's step (its attention cast its input three times), which the published bs1024_opt run ran
    shape = dataclasses.replace(shape_of("bs1024_opt"), attention_input_casts=perf_model.ORIGINAL_ATTENTION_INPUT_CASTS)
    original = predict(shape, SYSTEMS["A100-40GB"], Layout(dp=64), 1024, "fp16")["samples_per_sec"]
    with open(os.path.join(REPO_ROOT, "docs", "answers.md")) as f:
        assert f"it predicts {original:,.0f}, and the published run reached {100 * 2570 / original:.0f}% of that" in \
            " ".join(f.read().split())
