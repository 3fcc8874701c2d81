"""README's GPU figures are the committed GPU runs' JSON (bench_results/gpu/), number for number: the single-GPU
table, the attention kernels, the UNet and ResNet rates, the dry runs and the step profiles (step_profiles.json);
docs/benchmarks.md holds `make gpu-table`'s own table of the same run and each change to the step. Twin: a changed
number in the JSON is named as a mismatch."""
import copy
import json
from pathlib import Path

from benchmarks import gpu_table

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench_results" / "gpu"

VIT_ROWS = {  # README's label -> the gpu-table row
    "baseline: fp32, no loader workers": "vit_baseline",
    "fp32, 8 workers (DALI: not installed there)": "vit_workers",
    "`--amp_mode bf16`": "vit_bf16",
    "`--amp_mode bf16 --enable_fused --enable_jit`": "vit_fused_compile",
    "`train_graph.py --amp_mode bf16 --enable_fused`": "vit_graphs",
}
LEVERS = {  # docs/benchmarks.md's row -> (step alone variant or None, with the loader variant)
    "| as the code is now |": ("now", "now"),
    "| the attention's input cast once (the model's since) |": ("cast_once", "cast_once"),
    "| q, k, v from one GEMM of the three weights joined |": ("qkv_one_gemm", "qkv_one_gemm"),
    "| tokens as the transposed view they were |": ("tokens_transposed", "tokens_transposed"),
    "| the batch copied on the compute stream |": (None, "copy_on_compute_stream"),
    "| loader restarted (after a device-wide sync) at each epoch |": (None, "loader_restarted_each_epoch"),
}
PROFILE_ROWS = {  # README's profile table label -> the profile in step_profiles.json
    "ViT fp32, 0 workers": "vit_baseline",
    "[ViT fp32, 8 workers](tutorial_images/profile_vit_nw8.png)": "vit_nw8",
    "ViT bf16, 8 workers": "vit_nw8_bf16",
    "[ViT bf16 + fused + compile](tutorial_images/profile_vit_nw8_bf16_fused_jit.png)": "vit_nw8_bf16_fused_jit",
    "UNet fp32, 2 workers, the loader before its rewrite": "unet_baseline",
}
DRY_RUN_ROWS = {"| tp=1 dp=4 |": "tp=1 dp=4 (", "| tp=4 dp=4 |": "tp=4 dp=4 (",
                "| tp=4 dp=4, sequence parallel + checkpointing |": "tp=4 dp=4 sequence", "| dp=16, FSDP |": "dp=16"}
UNET_ROWS = {  # README's UNet table label -> the gpu-table row
    "H100: `lowmem`, 2 workers": "unet_short",
    "H100: `--amp_mode fp16 --enable_fused`, 2 workers": "unet_fp16_fused",
    "H100: the same, `--num_data_workers 8`": "unet_fp16_fused_w8",
    "H100: `--amp_mode bf16 --enable_fused`, 8 workers": "unet_bf16_fused_w8",
}


def cells(text, start):
    """The cells of the one table line of `text` that starts with `start`."""
    lines = [line for line in text.splitlines() if line.startswith(start)]
    assert len(lines) == 1, f"README should have one table line starting {start!r}, has {len(lines)}"
    return [cell.strip() for cell in lines[0].strip("|").split("|")]


def mismatches(readme, table, dry):
    """Each README figure that is not the JSON's, as 'what: README says X, the JSON Y'."""
    found = []

    def check(what, said, value):
        if said != value:
            found.append(f"{what}: README says {said!r}, the JSON {value!r}")

    flat = " ".join(readme.split())  # prose wraps anywhere

    def check_said(what, text):
        if text not in flat:
            found.append(f"{what}: README does not say {text!r}")

    rows = table["rows"]
    for label, name in VIT_ROWS.items():
        row = cells(readme, f"| {label} |")
        check(f"{name} FULL", row[1], f"{rows[name]['FULL']['mean']:.1f}")
        check(f"{name} SYNTHETIC", row[2], f"{rows[name]['SYNTHETIC']['mean']:.1f}")
        check(f"{name} peak", row[3], f"{rows[name]['peak_memory_gb']:.1f} GB")
    attention = table["levers"]["attention_ms"]
    check_said("attention auto", f"{attention['auto']:.1f} ms with cuDNN's")
    check_said("attention flash", f"{attention['flash']:.1f} with FlashAttention-2")
    check_said("attention efficient", f"{attention['efficient']:.1f} memory-efficient")
    unet_rows = {**{label: rows[name] for label, name in UNET_ROWS.items()},
                 "H100, the loader as it was: `lowmem`, 2 workers": table["earlier_rows"]["unet_short"]}
    for label, row in unet_rows.items():
        check(f"UNet {label}", cells(readme, f"| {label} |")[1:4],
              [f"{row[part]['mean']:.0f}" for part in ("IO", "SYNTHETIC", "FULL")])
    levers = table["levers"]
    alone = levers["step_alone_ms"]
    check_said("cast once", f"took the eager step to {alone['cast_once']:.1f} ms")
    check_said("compiled levers", f"({levers['compiled_ms']['default']:.1f} ms, and "
                                  f"{levers['compiled_ms']['reduce-overhead']:.1f} with CUDA Graphs")
    check_said("mp compiled", f"compiled (`--enable_jit`, 2026-11-28), {rows['mp_tp1_compile']['FULL']['mean']:.1f}")
    for name in ("resnet_bs128", "resnet_extra_opts"):
        check_said(f"{name} FULL", f"{rows[name]['FULL']['mean']:,.0f}")
    check_said("resnet_extra_opts SYNTHETIC", f"the step alone {rows['resnet_extra_opts']['SYNTHETIC']['mean']:,.0f}")
    for start, prefix in DRY_RUN_ROWS.items():
        row = cells(readme, start)
        result = next(r for r in dry["rows"] if r["name"].startswith(prefix))
        state = sum(result[k] for k in ("parameters", "gradients", "optimizer_state"))
        model = sum(result["predicted"][k] for k in ("parameters", "gradients", "optimizer_state"))
        check(f"{start} state", row[1], f"{state / 1e9:.3f} / {model / 1e9:.3f} GB")
        check(f"{start} saved", row[2], f"{result['saved_activations'] / 1e9:.3f} / "
                                        f"{result['predicted']['saved_activations'] / 1e9:.3f} GB")
        check(f"{start} peak", row[3], f"{result['peak_memory_gb']:.1f} / "
                                       f"{result['predicted']['peak_memory_gb']:.1f} GB")
    return found


def lever_mismatches(docs, table):
    """Each change to the step in docs/benchmarks.md that is not the JSON's."""
    found, levers = [], table["levers"]
    for start, (alone, loader) in LEVERS.items():
        row = cells(docs, start)
        said = [row[1], row[2]]
        value = [f"{levers['step_alone_ms'][alone]:.1f}" if alone else "",
                 f"{levers['with_loader_ms'][loader]:.1f}"]
        if said != value:
            found.append(f"{start}: docs say {said}, the JSON {value}")
    return found


def profile_mismatches(readme, profiles):
    """Each number of README's table of step profiles that is not step_profiles.json's."""
    found = []
    for label, name in PROFILE_ROWS.items():
        row = cells(readme, f"| {label} |")
        ms = profiles["profiles"][name]["ms_per_step"]
        value = [f"{ms['attention']:.1f}", f"{ms['gemm']:.1f}", f"{ms['norm_elementwise']:.1f}",
                 f"{ms['optimizer']:.1f}", f"{ms['copies']:.1f} ({ms['overlap']:.1f})", f"{ms['idle']:.1f}",
                 f"{profiles['profiles'][name]['step_ms']:.1f}"]
        if row[1:] != value:
            found.append(f"{name}: README says {row[1:]}, the JSON {value}")
    baseline = profiles["profiles"]["vit_baseline"]  # the prose under the baseline's picture
    flat = " ".join(readme.split())
    for words in (f"Of its {baseline['step_ms']:.0f} ms, {baseline['ms_per_step']['attention']:.0f} are attention",
                  f"and {baseline['ms_per_step']['gemm']:.0f} the GEMMs",
                  f"the 0-worker loader, {baseline['host_loader_ms_per_step']:.0f} ms of the host's time a step"):
        if words not in flat:
            found.append(f"vit_baseline: README does not say {words!r}")
    return found


def load_profiles():
    return json.loads((GPU / "step_profiles.json").read_text())


def test_readme_profile_table_is_the_committed_profiles():
    profiles = load_profiles()
    assert profiles["machine"] == "H100 80GB HBM3, torch 2.11.0+cu130, 2026-11-27"
    readme = (ROOT / "README.md").read_text()
    assert "one H100 80GB HBM3, torch 2.11.0+cu130, 2026-11-27" in " ".join(readme.split())
    assert profile_mismatches(readme, profiles) == []
    changed = copy.deepcopy(profiles)
    changed["profiles"]["vit_nw8_bf16"]["ms_per_step"]["idle"] += 0.1
    assert [line.split(":")[0] for line in profile_mismatches(readme, changed)] == ["vit_nw8_bf16"]
    changed["profiles"]["vit_baseline"]["host_loader_ms_per_step"] = 252.0  # what README said until 2026-11-28
    assert [line.split(":")[0] for line in profile_mismatches(readme, changed)] == ["vit_nw8_bf16", "vit_baseline"]


def load():
    readme = (ROOT / "README.md").read_text()
    table = json.loads((GPU / "single_gpu_table.json").read_text())
    dry = json.loads((GPU / "dry_run_mp.json").read_text())
    return readme, table, dry


def test_readme_gpu_figures_are_the_committed_runs():
    """Each row names the machine and date that measured it; README says the same (the ViT rows 2026-11-27, the
    UNet rows and the compiled mp row 2026-11-28, the last two dry runs 2026-11-28)."""
    readme, table, dry = load()
    flat = " ".join(readme.split())
    assert table["device"].startswith("NVIDIA H100") and dry["device"].startswith("NVIDIA H100")
    assert "on one NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, 16 CPU cores, 2026-11-27)" in flat
    assert {table["rows"][name]["ran"] for name in VIT_ROWS.values()} == {
        "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, 2026-11-27"}
    assert {table["rows"][name]["ran"] for name in [*UNET_ROWS.values(), "mp_tp1_compile"]} == {
        "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, 2026-11-28"}
    assert "(torch 2.11.0+cu130; the first row with the loader as it was on 2026-11-27, the others 2026-11-28;" in flat
    assert [row["ran"][-10:] for row in dry["rows"]] == ["2026-11-27", "2026-11-27", "2026-11-28", "2026-11-28"]
    assert "(torch 2.11.0+cu130, 2026-11-27; the last two rows 2026-11-28)" in flat
    assert mismatches(readme, table, dry) == []


def test_a_changed_number_is_a_mismatch():
    readme, table, dry = load()
    changed = copy.deepcopy(table)
    changed["rows"]["vit_bf16"]["FULL"]["mean"] += 1.0
    changed["levers"]["with_loader_ms"]["loader_restarted_each_epoch"] += 1.0
    changed_dry = copy.deepcopy(dry)
    changed_dry["rows"][1]["saved_activations"] += 10 ** 7
    found = mismatches(readme, changed, changed_dry)
    assert [line.split(":")[0] for line in found] == ["vit_bf16 FULL", "| tp=4 dp=4 | saved"], found
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert [line.split(":")[0] for line in lever_mismatches(docs, changed)] == [
        "| loader restarted (after a device-wide sync) at each epoch |"]
    assert mismatches(readme.replace("167.6", "167.7"), table, dry) == [
        "vit_fused_compile FULL: README says '167.7', the JSON '167.6'"]


def test_docs_benchmarks_hold_the_tables_own_rendering():
    """docs/benchmarks.md shows `make gpu-table`'s table of the committed run, as gpu_table.table renders it, and the
    targets as the JSON judged them."""
    _, table, _ = load()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert gpu_table.table(table) in docs
    assert lever_mismatches(docs, table) == []
    assert all(target["met"] for target in table["targets"].values()), table["targets"]
    assert gpu_table.check_targets(table["rows"]) == table["targets"]


def lesson_mismatches(readme):
    """README's figures from the lessons' benchmarks (bench_results/gpu/lessons/): the `mp` config at tp=1, eager, as
    its JSON says, and the loader its log's config names; and the raw h5py rate of the 2026-11-28 session's
    log (the original loader's per-window reads on that node's CPU)."""
    lessons = GPU / "lessons"
    mp = json.loads((lessons / "mp_tp1_benchy.json").read_text())
    log = (lessons / "second_call_mp_tp1_benchy.log").read_text()
    session = (GPU / "gpu_session.log").read_text()
    raw = float(session.split("[bench_loader] raw h5py (1 thread): ")[1].split(" samples/s")[0])
    flat = " ".join(readme.split())
    said = {
        "mp FULL": f"tp=1 at local batch 16 ran at {mp['FULL']['mean']:.1f} samples/s",
        "mp peak": f"with a {mp['peak_memory_gb']:.1f} GB peak",
        "raw h5py": f"one core of that H100 node reads {raw:.0f} windows a second",
    }
    found = [f"{what}: README does not say {text!r}" for what, text in said.items() if text not in flat]
    loader = "PyTorch's loader, 8 workers"  # the mp row names its loader, as the run's logged config has it
    if loader not in flat or not ("data_loader_config pytorch" in log and "num_data_workers 8" in log):
        found.append(f"mp loader: README does not say {loader!r} or the run's log has another")
    return found


def test_readme_lesson_benchmarks_are_the_committed_runs():
    readme = (ROOT / "README.md").read_text()
    assert lesson_mismatches(readme) == []
    assert [line.split(":")[0] for line in lesson_mismatches(readme.replace("62.0 samples/s", "62.1 samples/s"))] == [
        "mp FULL"]


H200 = GPU / "h200"
def last_val_loss(log):
    return float(log.split("Avg val loss=")[-1].split()[0])


def h200_mismatches(readme, docs, report, logs):
    """README's and docs/benchmarks.md's H200 figures that are not the H200 report's (bench_results/gpu/h200/) or
    its loss curves' logs. The UNet's H200 rows are docs/benchmarks.md's (the report's own table); README quotes
    their ratios."""
    found, rows = [], report["rows"]

    def step_ratio(name):
        return rows[name]["SYNTHETIC"]["mean"] / rows["unet_fp16_fused_w8"]["SYNTHETIC"]["mean"]

    full = {name: f"{rows[name]['FULL']['mean']:.1f}" for name in ("vit_bf16", "vit_fused_compile", "vit_h64_bf16",
                                                                   "vit_h64_fused_compile")}
    loss = {name: f"{last_val_loss(log):.4f}" for name, log in logs.items()}
    alone = report["levers"]["step_alone_ms"]
    said = {
        "README": (" ".join(readme.split()), [
            f"trains at {full['vit_bf16']} samples/s, {full['vit_fused_compile']} compiled",
            f"trains at {full['vit_h64_bf16']} samples/s, {full['vit_h64_fused_compile']} compiled",
            f"(validation loss {loss['short_h64']} against {loss['short']} after 128 steps",
            f"makes the fp16 step {step_ratio('unet_fp16_fused_nhwc_w8'):.2f}x faster, `torch.compile` "
            f"{step_ratio('unet_fp16_fused_jit_w8'):.2f}x"]),
        "docs/benchmarks.md": (" ".join(docs.split()), [
            f"the cast once {alone['now']:.1f} ({report['levers']['with_loader_ms']['now']:.1f})",
            f"cast by each of q, k and v {alone['cast_by_each']:.1f}",
            f"its validation loss after 128 steps on the same data was {loss['short_h64']} against `short`'s "
            f"{loss['short']}",
            f"trains at {full['vit_h64_bf16']} eager and {full['vit_h64_fused_compile']} compiled"]),
    }
    for where, (flat, texts) in said.items():
        found += [f"{where} does not say {text!r}" for text in texts if text not in flat]
    return found


def load_h200():
    report = json.loads((H200 / "single_gpu_table.json").read_text())
    logs = {name: (H200 / "loss_curves" / f"{name}_bf16_out.log").read_text() for name in ("short", "short_h64")}
    return report, logs


def test_h200_figures_are_the_committed_h200_runs():
    """The H200 session (2026-11-28): every row stamped with that card, README's UNet ratios, ViT rates and the two
    configs' validation loss as the report and the runs' logs say; docs/benchmarks.md holds the report's own table.
    Twin: a changed number is named."""
    report, logs = load_h200()
    readme = (ROOT / "README.md").read_text()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert report["device"] == "NVIDIA H200" and report["torch"] == "2.11.0+cu130"
    assert {row["ran"] for row in report["rows"].values()} == {"NVIDIA H200, torch 2.11.0+cu130, 2026-11-28"}
    assert all(target["met"] for target in report["targets"].values()), report["targets"]
    assert "On one H200 (the same torch, 2026-11-28;" in " ".join(readme.split())
    assert gpu_table.table(report) in docs
    assert "config short_h64" in logs["short_h64"] and "num_heads 6" in logs["short_h64"]
    assert "config short" in logs["short"] and "num_heads 8" in logs["short"]
    assert h200_mismatches(readme, docs, report, logs) == []
    changed = copy.deepcopy(report)
    changed["rows"]["unet_fp16_fused_nhwc_w8"]["SYNTHETIC"]["mean"] += 20.0
    changed["rows"]["vit_h64_bf16"]["FULL"]["mean"] += 0.1
    found = h200_mismatches(readme, docs, changed, logs)
    assert found == ["README does not say 'trains at 171.8 samples/s, 201.8 compiled'",
                     "README does not say 'makes the fp16 step 1.21x faster, `torch.compile` 1.08x'",
                     "docs/benchmarks.md does not say 'trains at 171.8 eager and 201.8 compiled'"], found
    later = {**logs, "short": logs["short"] + "  Avg val loss=0.2\n"}
    assert len(h200_mismatches(readme, docs, report, later)) == 2
