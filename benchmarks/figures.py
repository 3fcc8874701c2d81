"""Tutorial figures from what this project computed (`make figures`); nothing is measured here.

    python -m benchmarks.figures [--logs example_logs] [--bench bench_results] [--out tutorial_images]

From the example logs (`make example-logs`; TensorBoard events read with TensorBoard's own EventAccumulator):
  vit_demo_curves.png, unet_demo_curves.png, resnet_demo_curves.png
      loss and metric curves of each stage's demo run, against the step and against the wall time since step 0
  vit_dp_sweep_curves.png, vit_dp_sweep_throughput.png
      the ViT demo on 1, 2, 4 data-parallel ranks: validation curves, and samples/s against the number of ranks
      (each run's fastest epoch after the first)
From the benchmark JSON in bench_results/ (`make bench-train`, `bench-unet`, `bench-resnet`, `bench-mp`,
`bench-loader`):
  throughput_vit.png, throughput_unet.png, throughput_resnet.png   samples/s per optimisation step
  mp_layouts.png      samples/s and memory per model-parallel layout
  loader_era5.png     the ERA5 loaders against raw h5py reads
From utils/rank_generator.py:
  rank_groups.png     16 ranks as 4 nodes x 4 GPUs, tp=2, cp=2, dp=4, order tp-cp-dp: which ranks form each group

Each figure's title names the machine its numbers come from (example_logs/runs.json, the JSON's machine or
device fields). A missing input is one line naming the file and the command that makes it.
"""
import glob
import json
import os
import re
from dataclasses import dataclass

import numpy as np

from resilience.exits import exit_on_user_error
from utils.errors import ArgumentParser, UserError

DPI = 100
STAGES = {  # curves figure -> (stage folder of the example logs, title)
    "vit_demo_curves.png": ("vit", "ViT demo (ERA5 sample data)"),
    "unet_demo_curves.png": ("unet", "3D UNet demo (cosmology sample boxes)"),
    "resnet_demo_curves.png": ("resnet", "ResNet18 demo (CIFAR-100 sample data)"),
}
BENCH = {  # figure -> (JSON in the bench folder, the command that writes it)
    "throughput_vit.png": ("train_demo.json", "make bench-train"),
    "throughput_unet.png": ("unet_demo.json", "make bench-unet"),
    "throughput_resnet.png": ("resnet_demo.json", "make bench-resnet"),
    "mp_layouts.png": ("mp_demo.json", "make bench-mp"),
    "loader_era5.png": ("loader_era5.json", "make bench-loader"),
}
RUN_DIR = re.compile(r"(\d+)GPU$")


@dataclass
class Series:
    """One TensorBoard scalar tag of a run: steps, seconds since the run's first point, values."""
    steps: np.ndarray
    seconds: np.ndarray
    values: np.ndarray


def read_scalars(run_dir):
    """{tag: Series} of the TensorBoard events under <run_dir>/logs; time counts from the run's first point."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(os.path.join(run_dir, "logs"), size_guidance={"scalars": 0, "images": 1})
    accumulator.Reload()
    events = {tag: accumulator.Scalars(tag) for tag in accumulator.Tags()["scalars"]}
    if not any(events.values()):
        raise UserError(f"no TensorBoard scalars under {run_dir}/logs; make the example logs with "
                        "`make example-logs`")
    start = min(event.wall_time for series in events.values() for event in series)
    return {tag: Series(np.array([e.step for e in series]), np.array([e.wall_time - start for e in series]),
                        np.array([e.value for e in series])) for tag, series in events.items() if series}


def sweep_runs(logs):
    """{ranks: run directory} of the ViT demo runs <logs>/vit/demo/<N>GPU/00."""
    runs = {}
    for path in glob.glob(os.path.join(logs, "vit", "demo", "*GPU", "00")):
        match = RUN_DIR.search(os.path.dirname(path))
        if match:
            runs[int(match.group(1))] = path
    return dict(sorted(runs.items()))


def sweep_throughput(scalars):
    """(samples/s, global batch) of a run: its fastest epoch after the first (the first pays the start-up; on a
    shared machine other work only ever slows an epoch down), and samples per iteration."""
    samples, iters = scalars["Avg samples per sec"].values, scalars["Avg iters per sec"].values
    steady = samples[1:] if len(samples) > 1 else samples
    return float(steady.max()), int(round(float(np.median(samples / iters))))


def example_logs_machine(logs):
    """The machine(s) the example logs were made on, from <logs>/runs.json."""
    manifest = load_json(os.path.join(logs, "runs.json"), "make example-logs")
    return "; ".join(sorted({run.get("machine", "machine not recorded") for run in manifest.get("runs", [])}))


def load_json(path, command):
    if not os.path.isfile(path):
        raise UserError(f"{path} is missing; make it with `{command}`")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err.msg}, line {err.lineno}); make it again with "
                        f"`{command}`") from None


def bench_machine(doc):
    """The machine a benchmark JSON says it ran on: its `machine`, else its `device` (with the core count for
    a CPU)."""
    if "machine" in doc:
        return doc["machine"]
    device = re.sub(r" \(cpu\)$", "", doc.get("device", "machine not recorded"))
    if device.startswith("CPU"):
        cores = f", {doc['cpu_count']} cores" if "cpu_count" in doc else ""
        return f"{device}{cores}, no GPU"
    return device


def check_inputs(logs, bench):
    """Every input of every figure, before drawing any: one UserError line for the first that is missing."""
    for stage, _ in STAGES.values():
        run = os.path.join(logs, stage, "demo", "1GPU", "00")
        if not glob.glob(os.path.join(run, "logs", "events.out.tfevents.*")):
            raise UserError(f"no TensorBoard events in {run}/logs; make the example logs with `make example-logs`")
    if len(sweep_runs(logs)) < 2:
        raise UserError(f"the data-parallel sweep needs runs {logs}/vit/demo/<N>GPU/00 for at least two N; make "
                        "them with `make example-logs`")
    load_json(os.path.join(logs, "runs.json"), "make example-logs")
    for name, command in BENCH.values():
        load_json(os.path.join(bench, name), command)


# --- drawing ---------------------------------------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path):
    from utils.atomic import atomic_path
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=DPI, format="png")
    _plt().close(fig)
    print(f"[figures] wrote {path}", flush=True)


def _time_axis(seconds):
    """(divisor, label) for an axis of wall-clock seconds: minutes beyond 5 minutes."""
    return (60.0, "minutes since step 0") if seconds.max(initial=0) > 300 else (1.0, "seconds since step 0")


def _log_y(ax):
    """A log-scale y axis labelled in plain numbers (0.2, 0.3, 1) rather than powers of ten."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter(""))


def _curve_rows(scalars):
    """[(row label, [tags], log scale)] of a run: the losses, then each metric family it logged."""
    rows = [("loss", [t for t in ("Loss/train", "Loss/valid") if t in scalars], True)]
    rmse = sorted(t for t in scalars if t.startswith("RMSE"))
    accuracy = sorted(t for t in scalars if t.startswith("Accuracy/"))
    if rmse:
        rows.append(("RMSE (normalised units)", rmse, True))
    if accuracy:
        rows.append(("accuracy", accuracy, False))
    return rows


def stage_curves(run_dir, title, machine, path):
    """Loss and metrics of one run against the step (left) and the wall time since step 0 (right)."""
    plt = _plt()
    scalars = read_scalars(run_dir)
    rows = _curve_rows(scalars)
    divisor, time_label = _time_axis(np.concatenate([scalars[t].seconds for _, tags, _ in rows for t in tags]))
    fig, axes = plt.subplots(len(rows), 2, figsize=(10, 3.2 * len(rows) + 0.8), squeeze=False)
    for (label, tags, log), row in zip(rows, axes):
        for tag in tags:
            series = scalars[tag]
            row[0].plot(series.steps, series.values, marker="o", markersize=3, label=tag)
            row[1].plot(series.seconds / divisor, series.values, marker="o", markersize=3, label=tag)
        for ax, xlabel in zip(row, ("iteration", time_label)):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            if log:
                _log_y(ax)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"{title}: learning curves\n{machine}; run {_short(run_dir)}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def _short(path):
    """A path as shown in a title: from the example-logs folder on."""
    parts = os.path.normpath(path).split(os.sep)
    return "/".join(parts[-5:])


def dp_sweep_curves(runs, machine, path):
    """Validation loss and RMSE of the sweep's runs against the step and the wall time since step 0."""
    plt = _plt()
    data = {ranks: read_scalars(run) for ranks, run in runs.items()}
    tags = [t for t in ("Loss/valid", "RMSE(u10m)/valid") if all(t in s for s in data.values())]
    seconds = np.concatenate([s[t].seconds for s in data.values() for t in tags])
    divisor, time_label = _time_axis(seconds)
    fig, axes = plt.subplots(len(tags), 2, figsize=(10, 3.2 * len(tags) + 0.8), squeeze=False)
    for tag, row in zip(tags, axes):
        for ranks, scalars in data.items():
            _, batch = sweep_throughput(scalars)
            label = f"{ranks} rank{'s' if ranks > 1 else ''}, global batch {batch}"
            row[0].plot(scalars[tag].steps, scalars[tag].values, marker="o", markersize=3, label=label)
            row[1].plot(scalars[tag].seconds / divisor, scalars[tag].values, marker="o", markersize=3, label=label)
        for ax, xlabel in zip(row, ("iteration", time_label)):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(tag)
            _log_y(ax)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("ViT demo, data parallel at local batch 8, same epochs: validation curves\n"
                 f"{machine}; gloo ranks on the CPU", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def dp_sweep_scaling(runs, machine, path):
    """Samples/s of the sweep's runs against the number of ranks, with linear scaling from one rank."""
    plt = _plt()
    points = {ranks: sweep_throughput(read_scalars(run))[0] for ranks, run in runs.items()}
    ranks = np.array(list(points))
    rates = np.array(list(points.values()))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(ranks, rates, marker="o", label="measured: fastest epoch after the first")
    if ranks[0] == 1:
        ax.plot(ranks, rates[0] * ranks, linestyle="--", color="grey", label="linear scaling from 1 rank")
    for n, rate in zip(ranks, rates):
        efficiency = f" ({rate / (rates[0] * n / ranks[0]):.0%})" if n != ranks[0] else ""
        ax.annotate(f"{rate:.1f}{efficiency}", (n, rate), textcoords="offset points", xytext=(0, -14), fontsize=8,
                    ha="center")
    ax.text(0.02, 0.62, "all ranks share this one machine's CPU cores;\non a cluster each rank has its own GPU",
            transform=ax.transAxes, fontsize=8, color="dimgray")
    ax.set_xticks(ranks)
    ax.set_xlim(ranks[0] - 0.4, ranks[-1] + 0.4)
    ax.set_xlabel("data-parallel ranks (local batch 8)")
    ax.set_ylabel("samples/s, whole job")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"ViT demo, data-parallel throughput\n{machine}; gloo ranks on the CPU", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def _barh(ax, labels, values, colors, fmt="{:.1f}", xerr=None):
    y = np.arange(len(labels))[::-1]
    ax.barh(y, values, color=colors, xerr=xerr)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    for yi, value in zip(y, values):
        ax.annotate(fmt.format(value), (value, yi), textcoords="offset points", xytext=(4, -3), fontsize=8)
    ax.set_xlim(0, max(values) * 1.2)
    ax.grid(True, axis="x", alpha=0.3)


def throughput_steps(doc, stage, path):
    """samples/s per optimisation step (bench_train's vit or resnet suite); bars timed over a few steps only
    are hatched and say so."""
    plt = _plt()
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.8))
    short = [not row["measured_over"].startswith("epoch") for row in rows]
    _barh(ax, [row["variant"] for row in rows], [row["samples_per_sec"] for row in rows],
          ["tab:orange" if s else "tab:blue" for s in short], fmt="{:.2f}")
    legend = [plt.Rectangle((0, 0), 1, 1, color="tab:blue", label=rows[short.index(False)]["measured_over"])] \
        if not all(short) else []
    if any(short):
        legend.append(plt.Rectangle((0, 0), 1, 1, color="tab:orange", label=rows[short.index(True)]["measured_over"]))
    ax.legend(handles=legend, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), title="measured over",
              title_fontsize=8)
    ax.set_xlabel("samples/s (train.py's epoch line)")
    ax.set_title(f"{stage}, config {doc.get('config', '?')}: throughput per optimisation step\n{bench_machine(doc)}",
                 fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def throughput_benchy(doc, path):
    """The UNet's IO / SYNTHETIC / FULL samples/s per variant (bench_train's unet suite), with their spread."""
    plt = _plt()
    rows = doc["rows"]
    kinds = [("IO", "tab:green"), ("SYNTHETIC", "tab:purple"), ("FULL", "tab:blue")]
    fig, ax = plt.subplots(figsize=(10, 0.9 * len(rows) + 1.8))
    y = np.arange(len(rows))[::-1]
    height = 0.8 / len(kinds)
    for k, (kind, color) in enumerate(kinds):
        means = np.array([row[kind]["mean"] for row in rows])
        stds = np.array([row[kind]["std"] for row in rows])
        ax.barh(y + (1 - k) * height, means, height, xerr=stds, color=color, label=kind)
        for yi, mean, std in zip(y, means, stds):
            ax.annotate(f"{mean:.1f}", (mean + std, yi + (1 - k) * height), textcoords="offset points",
                        xytext=(4, -3), fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels([row["variant"] for row in rows], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(right=3 * max(row[kind]["mean"] + row[kind]["std"] for row in rows for kind, _ in kinds))
    ax.set_xlabel("samples/s (train.py --enable_benchy: mean +/- std over trials; log scale)")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(f"3D UNet, config {doc.get('config', '?')}: IO, SYNTHETIC (compute) and FULL throughput\n"
                 f"{bench_machine(doc)}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def mp_layouts(doc, path):
    """samples/s and per-rank memory of each model-parallel layout (bench_mp)."""
    plt = _plt()
    rows = doc["rows"]
    labels = [f"{row['layout']} ({row['ranks']} rank{'s' if row['ranks'] > 1 else ''})" for row in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.45 * len(rows) + 2.2))
    _barh(axes[0], labels, [row["samples_per_sec"] for row in rows], "tab:blue")
    axes[0].set_xlabel("samples/s, whole job")
    if all("saved_activations_mb" in row for row in rows):  # measured memory per rank: stacked
        states = [row["parameters_mb"] + row["gradients_mb"] + row["adam_state_mb"] for row in rows]
        saved = [row["saved_activations_mb"] for row in rows]
        _barh(axes[1], labels, [a + b for a, b in zip(states, saved)], "tab:orange", fmt="{:.1f} MB")
        axes[1].barh(np.arange(len(rows))[::-1], states, color="tab:gray")
        axes[1].legend(["saved activations (one forward)", "parameters + gradients + Adam"], fontsize=7,
                       loc="upper center", bbox_to_anchor=(0.4, -0.16), ncol=1)
        axes[1].set_xlabel("memory per rank, rank 0 (MB)")
    else:  # a JSON from before the measured columns
        _barh(axes[1], labels, [row["params_and_adam_mb"] for row in rows], "tab:gray", fmt="{:.1f} MB")
        axes[1].set_xlabel("parameters + Adam moments per rank (MB)")
    fig.suptitle(f"ViT {doc.get('config', '?')} config, train_mp.py layouts\n{bench_machine(doc)}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def loader_comparison(doc, path):
    """The ERA5 loaders' samples/s against raw h5py reads of the same samples (bench_loader)."""
    plt = _plt()
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.8))
    colors = ["tab:gray" if row["loader"].startswith("raw") else "tab:red" if "before" in row["loader"] else
              "tab:green" if row["loader"].startswith("DALI") else "tab:blue" for row in rows]
    _barh(ax, [row["loader"] for row in rows], [row["samples_per_sec"] for row in rows], colors)
    for yi, row in zip(np.arange(len(rows))[::-1], rows):
        ax.annotate(f"{row['ratio_to_raw']:.0%} of raw", (row["samples_per_sec"], yi), textcoords="offset points",
                    xytext=(40, -3), fontsize=8, color="dimgray")
    ax.set_xlim(0, max(row["samples_per_sec"] for row in rows) * 1.6)
    image = "x".join(str(n) for n in doc.get("image", []))
    ax.set_xlabel(f"samples/s (batch {doc.get('batch', '?')}, {image} ERA5 sample pairs, page cache warm)")
    ax.set_title(f"ERA5 loaders against raw h5py reads\n{bench_machine(doc)}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def rank_groups(path, tp=2, cp=2, dp=4, order="tp-cp-dp", gpus_per_node=4):
    """Ranks as nodes x GPUs, one panel per group type, each rank coloured by the group it belongs to."""
    from utils.rank_generator import RankGenerator
    plt = _plt()
    generator = RankGenerator(tp=tp, dp=dp, pp=1, cp=cp, order=order)
    world = generator.world_size
    nodes = world // gpus_per_node
    names = ["tp", "cp", "dp", "tp-cp"]
    most = max(len(generator.get_ranks(name)) for name in names)
    cmap = plt.get_cmap("tab10" if most <= 10 else "tab20")  # distinct colours for up to 10 groups
    fig, axes = plt.subplots(1, len(names), figsize=(3.3 * len(names), 0.75 * nodes + 1.4))
    for ax, name in zip(axes, names):
        groups = generator.get_ranks(name)
        for index, ranks in enumerate(groups):
            for rank in ranks:
                node, gpu = divmod(rank, gpus_per_node)
                ax.add_patch(plt.Rectangle((gpu, nodes - 1 - node), 0.92, 0.92, color=cmap(index % cmap.N)))
                ax.text(gpu + 0.46, nodes - 1 - node + 0.46, str(rank), ha="center", va="center", fontsize=9)
        ax.set_xlim(-0.1, gpus_per_node)
        ax.set_ylim(-0.1, nodes)
        ax.set_aspect("equal")
        ax.set_xticks(np.arange(gpus_per_node) + 0.46)
        ax.set_xticklabels([f"GPU {g}" for g in range(gpus_per_node)], fontsize=7)
        ax.set_yticks(np.arange(nodes) + 0.46)
        ax.set_yticklabels([f"node {n}" for n in reversed(range(nodes))], fontsize=7)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(f"{name}: {len(groups)} groups of {len(groups[0])}", fontsize=9)
    fig.suptitle(f"{world} ranks, tp={tp}, cp={cp}, dp={dp}, order {order} (first name fastest): one colour per "
                 f"group\nlayout from utils/rank_generator.py for a cluster of {nodes} nodes x {gpus_per_node} GPUs "
                 "(computed, not run)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


@exit_on_user_error
def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs", default="example_logs", help="example logs folder (make example-logs)")
    parser.add_argument("--bench", default="bench_results", help="benchmark JSON folder (make bench-*)")
    parser.add_argument("--out", default="tutorial_images", help="folder of the PNG files")
    args = parser.parse_args(argv)
    check_inputs(args.logs, args.bench)
    os.makedirs(args.out, exist_ok=True)
    out = lambda name: os.path.join(args.out, name)  # noqa: E731
    machine = example_logs_machine(args.logs)
    for name, (stage, title) in STAGES.items():
        stage_curves(os.path.join(args.logs, stage, "demo", "1GPU", "00"), title, machine, out(name))
    runs = sweep_runs(args.logs)
    dp_sweep_curves(runs, machine, out("vit_dp_sweep_curves.png"))
    dp_sweep_scaling(runs, machine, out("vit_dp_sweep_throughput.png"))
    docs = {name: load_json(os.path.join(args.bench, file), command) for name, (file, command) in BENCH.items()}
    try:
        throughput_steps(docs["throughput_vit.png"], "ViT", out("throughput_vit.png"))
        throughput_benchy(docs["throughput_unet.png"], out("throughput_unet.png"))
        throughput_steps(docs["throughput_resnet.png"], "ResNet", out("throughput_resnet.png"))
        mp_layouts(docs["mp_layouts.png"], out("mp_layouts.png"))
        loader_comparison(docs["loader_era5.png"], out("loader_era5.png"))
    except KeyError as err:
        raise UserError(f"a benchmark JSON in {args.bench} lacks the field {err}; make it again with its "
                        "`make bench-*` command") from None
    rank_groups(out("rank_groups.png"))


if __name__ == "__main__":
    main()
