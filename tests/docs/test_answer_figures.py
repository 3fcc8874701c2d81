"""docs/answers.md answers with this repository's own measurements where it has one: every such figure is the committed
file's, number for number, formatted here from the file itself (the multi-GPU session on CPU ranks,
example_logs/multi_gpu_cpu/multi_gpu.json; the example logs; the GPU runs of bench_results/gpu/), or what the
performance model prints now (`make plan`, run in this process: no training, no GPU). Twins: a changed source value
is named as missing.

A failure names the answer (its anchor) and the words docs/answers.md should hold: run the command that made the
file again and copy its numbers into the answer, or mend the sentence that quotes them.
"""
import copy
import json
import re
from pathlib import Path

from planning import plan

ROOT = Path(__file__).resolve().parents[2]
ANSWERS = ROOT / "docs" / "answers.md"
SESSION = ROOT / "example_logs" / "multi_gpu_cpu" / "multi_gpu.json"
GPU = ROOT / "bench_results" / "gpu"

# the performance model's predictions the answers quote: name -> `make plan` arguments
PLANS = {
    "bs64_opt": ["--config", "bs64_opt", "--gpus", "4"],
    "bs256_opt_16": ["--config", "bs256_opt", "--gpus", "16"],
    "bs256_opt_64": ["--config", "bs256_opt", "--gpus", "64"],
    "bs1024_opt": ["--config", "bs1024_opt", "--gpus", "64"],
    "bs512_opt": ["--config", "bs512_opt", "--gpus", "32"],
    "tp4cp2": ["--config", "mp", "--gpus", "16", "--tensor_parallel", "4", "--context_parallel", "2"],
    "tp4cp2_cp_first": ["--config", "mp", "--gpus", "16", "--tensor_parallel", "4", "--context_parallel", "2",
                        "--parallel_order", "cp-tp-dp"],
}


def read_json(path):
    return json.loads(Path(path).read_text())


def last_val_loss(log):
    return float(re.findall(r"Avg val loss=([\d.]+)", Path(log).read_text())[-1])


def sources():
    """Every committed file the answers quote, read."""
    return {
        "session": read_json(SESSION),
        "table": read_json(GPU / "single_gpu_table.json"),
        "h200": read_json(GPU / "h200" / "single_gpu_table.json"),
        "h200_losses": {name: last_val_loss(GPU / "h200" / "loss_curves" / f"{name}_bf16_out.log")
                        for name in ("short", "short_h64")},
        "graphs": read_json(GPU / "gpu_check.json")["cuda_graphs"]["cases"],
        "dry": read_json(GPU / "dry_run_mp.json"),
        "demo": {n: last_val_loss(ROOT / "example_logs" / "vit" / "demo" / f"{n}GPU" / "00" / "out.log")
                 for n in (1, 2, 4)},
    }


def predictions(capsys):
    """{name: the JSON row `make plan ... --json` prints last} for each of PLANS."""
    found = {}
    for name, argv in PLANS.items():
        capsys.readouterr()
        plan.main([*argv, "--json"])
        found[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return found


def said_session(session):
    """{anchor: [words]} quoting the multi-GPU session on CPU ranks."""
    parts = session["parts"]
    weak = {row["ranks"]: row for row in parts["data_parallel"]["weak"]}
    lr = parts["data_parallel"]["learning_rate"]
    one, kept, scaled = lr["runs"]
    epochs = lr["epochs"]
    b25, b5 = parts["dp_profile"]["buckets"]["25"], parts["dp_profile"]["buckets"]["5"]
    checks = parts["exactness"]["checks"]
    steps = parts["exactness"]["iterations"]
    messages = {m["what"]: m for m in parts["collectives"]["messages"]}
    m25 = messages["DDP gradient bucket, --bucket_cap_mb 25"]
    m5 = messages["DDP gradient bucket, --bucket_cap_mb 5"]

    def loss(run):
        return f"{run['val_loss'][-1]:.3f}"

    def diff(name):
        return f"{checks[name]['max_weight_difference']:.1e}"

    def spread(row):
        return "-".join(f"{value:.1f}" for value in row["samples_per_s_range"])

    return {
        "one-process-per-gpu": [f"both processes had exited {parts['failure']['error']['seconds_to_last_exit']:.2f} s "
                                "later"],
        "the-initial-broadcast": [f"the weights after {steps} steps were {diff('ddp')} from one process's with DDP and "
                                  f"{diff('ddp_twin_noddp')} with `--noddp`"],
        "learning-rate-fixed-while-the-batch-grows": [
            f"repeats it for {epochs} epochs", f"1 rank (global batch {one['global_batch_size']}) reached {loss(one)}, "
            f"4 ranks (global {kept['global_batch_size']}) {loss(kept)} with the rate kept"],
        "raising-the-learning-rate-alone": [
            f"at global batch {kept['global_batch_size']}, doubling the rate alone ({kept['lr']:g} to "
            f"{scaled['lr']:g}) "
            f"took the validation loss after {epochs} epochs from {loss(kept)} to {loss(scaled)}"],
        "throughput-against-convergence": [
            f"{session['date']}: 4 ranks share 2 cores",
            f"4 ranks ran at {weak[4]['samples_per_s']:.1f} samples/s ({spread(weak[4])}, the median and range of "
            f"{weak[4]['trials']} trials) against one rank's {weak[1]['samples_per_s']:.1f} ({spread(weak[1])}), at "
            f"global batch {kept['global_batch_size']} against {one['global_batch_size']}",
            f"while in the same {epochs} epochs they reached a validation loss of {loss(scaled)} (the rate scaled by "
            f"sqrt(4)) against one rank's {loss(one)}"],
        "where-the-gradients-are-synced": [
            f"{b25['ms_per_step']['communication']:.2f} ms of a {b25['step_ms']:.1f} ms step at 25 MB buckets "
            f"({session['date']})"],
        "smaller-buckets": [
            f"{b5['ms_per_step']['communication']:.2f} ms of a {b5['step_ms']:.1f} ms step at 5 MB against "
            f"{b25['ms_per_step']['communication']:.2f} of {b25['step_ms']:.1f} at 25 MB (the steps' "
            f"{abs(b5['step_ms'] - b25['step_ms']):.0f} ms gap is within the shared cores' noise: their GEMMs, which "
            f"buckets do not change, took {b5['ms_per_step']['gemm']:.0f} and {b25['ms_per_step']['gemm']:.0f} ms)",
            f"({m25['bytes'] / 1e6:.1f} MB) took {1e3 * m25['seconds']:.1f} ms, one of a 5 MB bucket "
            f"({m5['bytes'] / 1e6:.2f} MB) {1e3 * m5['seconds']:.1f} ms"],
        "what-caps-batch-and-learning-rate-scaling": [
            f"in the same {epochs} epochs, 4 ranks at global batch {scaled['global_batch_size']} with the rate scaled "
            f"by sqrt(4) reached a validation loss of {loss(scaled)}, one rank at batch {one['global_batch_size']} "
            f"{loss(one)}"],
        "strong-scaling": [
            f"DDP's weights after {steps} steps were at most {diff('ddp')} from one process's at batch 8"],
        "copy_to_parallel_region-forward-and-backward": [
            f"at tp=2 on 4 CPU ranks ended {steps} steps at most {diff('tp2')} from the serial run's weights"],
        "shared-weights": [
            f"at cp=2 the weights after {steps} steps were {diff('cp2')} from the serial run's; with `--noddp`, which "
            f"leaves out the hook (the cp sum and the dp average), {diff('cp2_twin_noddp')}"],
    }


def said_files(s):
    """{anchor: [words]} quoting the example logs and the GPU runs."""
    rows, levers = s["table"]["rows"], s["table"]["levers"]
    fp32, bf16 = rows["vit_baseline"]["SYNTHETIC"]["mean"], rows["vit_bf16"]["SYNTHETIC"]["mean"]
    batch = rows["vit_baseline"]["global_batch_size"]
    unet = rows["unet_short"]
    unet_peak = re.search(r"peak ([\d.]+) TFLOP/s", unet["peak"]).group(1)
    h200 = {name: row["FULL"]["mean"] for name, row in s["h200"]["rows"].items() if "FULL" in row}
    g = s["graphs"]
    dry = {row["layout"]["tp"]: row for row in s["dry"]["rows"] if not row["layout"]["flags"][2:]}

    def states(row):
        return (row["parameters"] + row["gradients"] + row["optimizer_state"]) / 1e9

    w2, w8 = rows["unet_fp16_fused"], rows["unet_fp16_fused_w8"]
    demo = s["demo"]
    return {
        "hiding-the-input-copy": [
            f"{levers['with_loader_ms']['copy_on_compute_stream']:.1f} ms with the copy on the compute stream and "
            f"{levers['with_loader_ms']['now']:.1f} ms with the copy stream, against "
            f"{levers['step_alone_ms']['now']:.1f} ms for the step alone"],
        "turning-tf32-off": [
            f"(`vit_baseline`, {fp32:.1f} samples/s at batch {batch}) takes {batch / fp32:.2f} s, and bf16 "
            f"(`vit_bf16`, {bf16:.1f}) is {bf16 / fp32:.1f}x faster",
            f"(`unet_short`) ran at {unet['FULL']['tflops_per_device']:.1f} TFLOP/s, above the H100's fp32 peak of "
            f"{float(unet_peak):.0f}"],
        "heads-of-64": [
            f"{h200['vit_h64_bf16']:.1f} against {h200['vit_bf16']:.1f} samples/s in bf16 "
            f"({h200['vit_h64_bf16'] / h200['vit_bf16']:.2f}x), {h200['vit_h64_fused_compile']:.1f} against "
            f"{h200['vit_fused_compile']:.1f} compiled "
            f"({h200['vit_h64_fused_compile'] / h200['vit_fused_compile']:.2f}x)",
            f"{s['h200_losses']['short_h64']:.4f} against `short`'s {s['h200_losses']['short']:.4f}"],
        "learning-rate-fixed-while-the-batch-grows": [
            f"{demo[1]:.3f} (global batch 8, 256 steps), {demo[2]:.3f} (16, 128 steps) and {demo[4]:.3f} "
            "(32, 64 steps)"],
        "what-is-left-un-partitioned": [
            f"from {dry[1]['saved_activations'] / 1e9:.2f} GB at tp=1 to {dry[4]['saved_activations'] / 1e9:.2f} GB at "
            f"tp=4 ({100 * dry[4]['saved_activations'] / dry[1]['saved_activations']:.0f}%), while weights, gradients "
            f"and Adam fall from {states(dry[1]):.2f} to {states(dry[4]):.2f} GB"],
        "the-plain-and-the-graphed-script": [
            f"a small ViT at batch 4, {g['vit_tiny']['eager']['ms_per_step']:.2f} / "
            f"{g['vit_tiny']['graph']['ms_per_step']:.2f} ({g['vit_tiny']['speedup']:.1f}x",
            f"{g['vit_short_bf16']['eager']['ms_per_step']:.1f} / {g['vit_short_bf16']['graph']['ms_per_step']:.1f}, "
            f"and the UNet `short`, {g['unet_short']['eager']['ms_per_step']:.1f} / "
            f"{g['unet_short']['graph']['ms_per_step']:.1f}"],
        "how-many-loader-workers": [
            f"IO {w2['IO']['mean']:.0f} and SYNTHETIC {w2['SYNTHETIC']['mean']:.0f}",
            f"8 workers read {w8['IO']['mean']:.0f} a second and the run trained at {w8['FULL']['mean']:.0f}, "
            f"{100 * w8['FULL']['mean'] / w8['SYNTHETIC']['mean']:.0f}% of the step alone"],
    }


def said_plans(p):
    """{anchor: [words]} quoting the performance model's predictions (for A100-40GB: predictions, not runs)."""
    def rate(name):
        return f"{p[name]['samples_per_sec']:.1f}"

    per_gpu = {f"{row['samples_per_sec'] / row['gpus']:.1f}" for row in (p["bs64_opt"], p["bs256_opt_16"],
                                                                         p["bs1024_opt"])}
    exposed = {name: f"{1e3 * p[name]['time_breakdown_s']['exposed_communication']:.0f}"
               for name in ("tp4cp2", "tp4cp2_cp_first")}
    return {
        "fastest-and-least-gpu-time": [
            f"predict {rate('bs64_opt')}, {rate('bs256_opt_16')} and {rate('bs1024_opt')} samples/s, "
            f"{' / '.join(sorted(per_gpu))} a GPU each"],
        "your-own-configuration": [
            f"predicts {rate('bs512_opt')} samples/s on {p['bs512_opt']['gpus']} A100-40GB with a "
            f"{p['bs512_opt']['peak_memory_gb']:.1f} GB peak"],
        "a-manual-all-reduce": [f"a predicted step of {1e3 * p['bs64_opt']['step_time_s']:.0f} ms"],
        "what-caps-batch-and-learning-rate-scaling": [
            f"predicts a {p['bs64_opt']['peak_memory_gb']:.1f} GB peak at the `bs*_opt` configs' local batch "
            f"{p['bs64_opt']['local_batch_size']}"],
        "strong-scaling": [
            f"`bs256_opt` at {rate('bs256_opt_16')} samples/s on 16 A100-40GB and {rate('bs256_opt_64')} on 64",
            f"{p['bs256_opt_64']['samples_per_sec'] / p['bs256_opt_16']['samples_per_sec']:.2f}x on 4x the GPUs"],
        "rank-groups": [
            f"predicts {rate('tp4cp2')} samples/s with `tp-cp-dp` ({exposed['tp4cp2']} ms of a step's communication "
            f"exposed) and {rate('tp4cp2_cp_first')} with `--parallel_order cp-tp-dp` ({exposed['tp4cp2_cp_first']} "
            f"ms), where tp's {p['tp4cp2']['comm_bytes_per_step']['tp'] / 1024 ** 3:.2f} GB"],
    }


def anchors(text):
    """The anchors of the answers' headings, as GitHub makes them."""
    return {re.sub(r"[^\w\- ]", "", line[4:].strip().lower()).replace(" ", "-")
            for line in text.splitlines() if line.startswith("### ")}


def missing(text, said):
    """Each quoted figure the page does not hold, as 'anchor: words'."""
    flat = " ".join(text.split())  # prose wraps anywhere
    found = [f"{anchor}: no such answer" for anchor in said if anchor not in anchors(text)]
    return found + [f"{anchor}: docs/answers.md does not say {' '.join(words.split())!r}"
                    for anchor, quoted in said.items() for words in quoted if " ".join(words.split()) not in flat]


def test_the_answers_quote_the_committed_files():
    s = sources()
    text = ANSWERS.read_text()
    assert missing(text, said_session(s["session"])) == []
    assert missing(text, said_files(s)) == []


def test_the_answers_quote_what_make_plan_prints(capsys):
    assert missing(ANSWERS.read_text(), said_plans(predictions(capsys))) == []


def sections(text):
    """{anchor: the answer's words} of each answer."""
    parts = re.split(r"(?m)^### ", text)[1:]
    return {next(iter(anchors("### " + part.splitlines()[0]))): " ".join(part.split()) for part in parts}


def test_each_answer_quoting_the_cpu_session_names_its_file_and_the_cpus():
    answers = sections(ANSWERS.read_text())
    for anchor in said_session(read_json(SESSION)):
        assert "example_logs/multi_gpu_cpu/multi_gpu.json" in answers[anchor], anchor
        assert "CPU" in answers[anchor], anchor
    assert "has not run `NVIDIA_TF32_OVERRIDE=0` on a GPU" in answers["turning-tf32-off"]


def test_twin_a_changed_source_value_is_missing(capsys):
    s = sources()
    text = ANSWERS.read_text()
    session = copy.deepcopy(s["session"])
    session["parts"]["data_parallel"]["learning_rate"]["runs"][2]["val_loss"][-1] += 0.01
    session["parts"]["exactness"]["checks"]["tp2"]["max_weight_difference"] = 3e-6
    found = [line.split(":")[0] for line in missing(text, said_session(session))]
    assert found == ["raising-the-learning-rate-alone", "throughput-against-convergence",
                     "what-caps-batch-and-learning-rate-scaling", "copy_to_parallel_region-forward-and-backward"], found
    changed = copy.deepcopy(s)
    changed["table"]["levers"]["with_loader_ms"]["copy_on_compute_stream"] += 1.0
    changed["demo"][4] += 0.01
    found = [line.split(":")[0] for line in missing(text, said_files(changed))]
    assert found == ["hiding-the-input-copy", "learning-rate-fixed-while-the-batch-grows"], found
    predicted = predictions(capsys)
    predicted["bs256_opt_64"]["samples_per_sec"] *= 1.01
    found = [line.split(":")[0] for line in missing(text, said_plans(predicted))]
    assert found == ["strong-scaling", "strong-scaling"], found
