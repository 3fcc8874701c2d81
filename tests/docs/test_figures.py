"""benchmarks/figures.py (`make figures`) on a tiny generated log folder and small benchmark JSON, and the committed
example logs it draws from (`make example-logs`, benchmarks/example_logs.py).

A failure in the throughput test points to how the sweep's samples/s are read from TensorBoard (the first epoch
must be left out, the global batch is samples/s over iterations/s); in the drawing test to a figure not written,
blank, or not naming the machine its numbers come from; in the missing-input test to a missing file that does
not end in one `error:` line naming it and the command that makes it; in the example-logs test to committed logs
that are incomplete, hold a checkpoint, or whose out.log and TensorBoard events disagree (not one real run).
"""
import json
import os
import re

import pytest

from benchmarks import figures

pytestmark = pytest.mark.usefixtures("in_repo_root")
MACHINE = "Test CPU, 2 CPU cores, no GPU"
BENCH_MACHINE = "bench-box, 2 cores"
PNGS = ["vit_demo_curves.png", "unet_demo_curves.png", "resnet_demo_curves.png", "vit_dp_sweep_curves.png",
        "vit_dp_sweep_throughput.png", "throughput_vit.png", "throughput_unet.png", "throughput_resnet.png",
        "mp_layouts.png", "loader_era5.png", "rank_groups.png"]
# ranks -> samples/s of its 3 epochs, the first the fastest (it must be left out); local batch 8
SWEEP = {1: [40.0, 30.0, 32.0], 2: [60.0, 54.0, 50.0], 4: [80.0, 70.0, 60.0]}


def _write_run(run_dir, scalars):
    """A run's TensorBoard events: {tag: [(step, seconds since the start, value)]}, times from 1.7e9 (written
    with TensorBoard's own writer: no torch import)."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    writer = EventFileWriter(os.path.join(run_dir, "logs"))
    for tag, points in scalars.items():
        for step, seconds, value in points:
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
            writer.add_event(Event(wall_time=1.7e9 + seconds, step=step, summary=summary))
    writer.close()


def _losses(start=1.0):
    return {"Loss/train": [(0, 0, start), (4, 10, start / 2), (8, 20, start / 3)],
            "Loss/valid": [(0, 0, start), (4, 11, start / 1.8), (8, 21, start / 2.5)]}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """(example logs folder, bench folder) holding every input of every figure, tiny."""
    root = tmp_path_factory.mktemp("figures")
    logs, bench = root / "example_logs", root / "bench_results"
    for ranks, rates in SWEEP.items():
        steps = [4 * e for e in range(1, len(rates) + 1)]
        _write_run(logs / "vit" / "demo" / f"{ranks}GPU" / "00", {
            **_losses(), "RMSE(u10m)/valid": [(0, 0, 1.1), (4, 12, 0.6), (8, 22, 0.4)],
            "Avg samples per sec": [(s, 10 * e, r) for e, (s, r) in enumerate(zip(steps, rates), 1)],
            "Avg iters per sec": [(s, 10 * e, r / (8 * ranks)) for e, (s, r) in enumerate(zip(steps, rates), 1)]})
    _write_run(logs / "unet" / "demo" / "1GPU" / "00", _losses(0.05))
    _write_run(logs / "resnet" / "demo" / "1GPU" / "00", {
        **_losses(4.6), "Accuracy/top1/valid": [(0, 0, 0.01), (4, 12, 0.2), (8, 22, 0.4)],
        "Accuracy/top5/valid": [(0, 0, 0.05), (4, 12, 0.5), (8, 22, 0.7)],
        "Accuracy/top1/train": [(4, 10, 0.1), (8, 20, 0.3)]})
    (logs / "runs.json").write_text(json.dumps({"runs": [{"name": "vit", "machine": MACHINE}]}))
    bench.mkdir()
    steps_rows = [{"variant": "baseline", "measured_over": "epoch 2 (epoch 1 is warm-up)", "samples_per_sec": 30.0},
                  {"variant": "bf16", "measured_over": "3 steps of epoch 1", "samples_per_sec": 2.0}]
    for name in ("train_demo.json", "resnet_demo.json"):
        (bench / name).write_text(json.dumps({"config": "demo", "device": "CPU (cpu)", "cpu_count": 2,
                                              "rows": steps_rows}))
    benchy = {kind: {"mean": mean, "std": 1.0} for kind, mean in (("IO", 500.0), ("SYNTHETIC", 70.0), ("FULL", 60.0))}
    (bench / "unet_demo.json").write_text(json.dumps({"config": "demo", "device": "CPU (cpu)", "cpu_count": 2,
                                                      "rows": [{"variant": "lowmem", **benchy}]}))
    (bench / "mp_demo.json").write_text(json.dumps({"config": "demo", "machine": BENCH_MACHINE, "rows": [
        {"layout": "tp=1", "ranks": 1, "samples_per_sec": 12.0, "params_and_adam_mb": 33.8},
        {"layout": "tp=2", "ranks": 2, "samples_per_sec": 25.0, "params_and_adam_mb": 17.8}]}))
    (bench / "loader_era5.json").write_text(json.dumps({"machine": BENCH_MACHINE, "image": [360, 720], "batch": 4,
                                                        "rows": [
        {"loader": "raw h5py (1 thread)", "samples_per_sec": 280.0, "ratio_to_raw": 1.0},
        {"loader": "PyTorch, 0 workers", "samples_per_sec": 140.0, "ratio_to_raw": 0.5}]}))
    return str(logs), str(bench)


def test_sweep_throughput_leaves_out_the_first_epoch(inputs):
    """The sweep's samples/s of each rank count is its fastest epoch after the first, its global batch
    samples/s over iterations/s, and times count from the run's first point."""
    logs, _ = inputs
    runs = figures.sweep_runs(logs)
    assert list(runs) == [1, 2, 4]
    for ranks, rates in SWEEP.items():
        scalars = figures.read_scalars(runs[ranks])
        rate, batch = figures.sweep_throughput(scalars)
        assert rate == pytest.approx(max(rates[1:]), rel=1e-6)
        assert batch == 8 * ranks
        assert scalars["Loss/valid"].seconds == pytest.approx([0, 11, 21], abs=1e-3)
        assert scalars["Loss/train"].steps.tolist() == [0, 4, 8]


def test_every_figure_is_drawn_and_names_its_machine(inputs, tmp_path, monkeypatch):
    """`python -m benchmarks.figures` writes every PNG, none blank, each titled with the machine of its numbers
    (the example logs' runs.json, or the benchmark JSON's own machine or device)."""
    import matplotlib.image

    logs, bench = inputs
    titles = {}
    save = figures.save_figure

    def save_and_record(fig, path):
        texts = [fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in fig.axes]
        titles[os.path.basename(path)] = " ".join(texts)
        save(fig, path)

    monkeypatch.setattr(figures, "save_figure", save_and_record)
    figures.main(["--logs", logs, "--bench", bench, "--out", str(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == sorted(PNGS)
    for name in PNGS:
        image = matplotlib.image.imread(str(tmp_path / name))
        assert image.shape[0] >= 200 and image.shape[1] >= 500, name
        gray = image[..., :3].mean(axis=2)
        assert (gray < 0.5).mean() > 0.003 and gray.std() > 0.05, f"{name} looks blank"
    for name in PNGS[:5]:
        assert MACHINE in titles[name], name
    for name in ("throughput_vit.png", "throughput_unet.png", "throughput_resnet.png"):
        assert "CPU, 2 cores, no GPU" in titles[name], name
    for name in ("mp_layouts.png", "loader_era5.png"):
        assert BENCH_MACHINE in titles[name], name
    assert "computed, not run" in titles["rank_groups.png"]


@pytest.mark.parametrize("remove, message", [
    ("bench_results/loader_era5.json", r"loader_era5\.json is missing; make it with `make bench-loader`"),
    ("example_logs/unet", r"no TensorBoard events in .*unet/demo/1GPU/00/logs; make the example logs with "
                          r"`make example-logs`"),
])
def test_missing_input_is_one_line(inputs, tmp_path, capsys, remove, message):
    """A missing input stops before any figure with exit code 2 and one `error:` line naming it and its command."""
    import shutil
    logs, bench = inputs
    copy = tmp_path / "in"
    shutil.copytree(logs, copy / "example_logs")
    shutil.copytree(bench, copy / "bench_results")
    target = copy / remove
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(SystemExit) as exit_info:
        figures.main(["--logs", str(copy / "example_logs"), "--bench", str(copy / "bench_results"),
                      "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_committed_example_logs_are_whole_runs():
    """Each run in example_logs/runs.json finished (DONE in out.log), kept no checkpoint, stays small, is listed in
    example_logs/README.md, and its out.log's last validation loss is the last Loss/valid point of its events."""
    from benchmarks.example_logs import read_manifest
    runs = read_manifest(os.path.join("example_logs", "runs.json"))
    if not runs:
        pytest.skip("no example logs in this checkout (make example-logs)")
    with open(os.path.join("example_logs", "README.md")) as f:
        readme = f.read()
    for name, run in runs.items():
        run_dir = os.path.join("example_logs", run["run_dir"])
        assert f"`{run['run_dir']}`" in readme and run["command"] in readme, name
        files = [os.path.join(folder, file) for folder, _, names in os.walk(run_dir) for file in names]
        assert not any("checkpoints" in path or path.endswith(".pt") for path in files), name
        assert sum(os.path.getsize(path) for path in files) < 1_000_000, name
        with open(os.path.join(run_dir, "out.log")) as f:
            log = f.read()
        assert "DONE ---- rank 0" in log, name
        last_val = float(re.findall(r"Avg val loss=(\S+)", log)[-1])
        assert figures.read_scalars(run_dir)["Loss/valid"].values[-1] == pytest.approx(last_val, rel=1e-6), name


def test_committed_gpu_example_runs_are_whole_runs():
    """Each GPU run in example_logs/gpu_runs.json finished (DONE in out.log), kept no checkpoint, stays small, has its
    profile, is listed in example_logs/README.md with its command, its summary's rates and loss are its out.log's,
    and its out.log's last validation loss is the last Loss/valid point of its events. Twin: a summary with another
    rate is not the log's."""
    from benchmarks.example_logs import read_gpu_manifest
    runs = read_gpu_manifest("example_logs")
    assert {run["name"] for run in runs} == {"vit-short-bf16", "vit-short-bf16-fused-jit", "unet-short"}
    with open(os.path.join("example_logs", "README.md")) as f:
        readme = f.read()

    def summary_from(log):
        rates = ", ".join(f"{float(r):.1f}" for r in re.findall(r"avg ([\d.]+) samples/sec", log))
        loss = float(re.findall(r"Avg val loss=(\S+)", log)[-1])
        return f"epochs at {rates} samples/s; final validation loss {loss:.4f}"

    for run in runs:
        run_dir = os.path.join("example_logs", run["run_dir"])
        assert f"`{run['run_dir']}`" in readme and run["command"] in readme, run["name"]
        assert os.path.isfile(os.path.join("example_logs", run["profile"])), run["name"]
        files = [os.path.join(folder, file) for folder, _, names in os.walk(run_dir) for file in names]
        assert not any("checkpoints" in path or path.endswith(".pt") for path in files), run["name"]
        assert sum(os.path.getsize(path) for path in files) < 2_000_000, run["name"]
        with open(os.path.join(run_dir, "out.log")) as f:
            log = f.read()
        assert "DONE ---- rank 0" in log and run["machine"].startswith("NVIDIA"), run["name"]
        assert run["summary"] == summary_from(log), run["name"]
        assert summary_from(log.replace("avg 1", "avg 2", 1)) != run["summary"], run["name"]
        last_val = float(re.findall(r"Avg val loss=(\S+)", log)[-1])
        assert figures.read_scalars(run_dir)["Loss/valid"].values[-1] == pytest.approx(last_val, rel=1e-6), run["name"]


def test_readme_says_the_committed_demo_logs_validation_loss_after_128_iterations():
    """README's "the demo model reaches X after 128 iterations" is the committed demo log's validation loss at the
    end of its 4th epoch of 32 steps (iteration 128); README said "about 0.20" before, which fails here."""
    log = open(os.path.join("example_logs", "vit", "demo", "1GPU", "00", "out.log")).read()
    assert "num_iters 256" in log and len(re.findall(r"Time taken for epoch", log)) == 8  # 32 steps an epoch
    after_128 = float(re.findall(r"Avg val loss=([0-9.]+)", log)[3])
    readme = " ".join(open("README.md").read().split())
    said = re.search(r"the demo model reaches ([0-9.]+) after 128 iterations", readme)
    assert said and float(said.group(1)) == pytest.approx(after_128, abs=5e-4), (said, after_128)
