"""The UNet stage through train.py: training on the cosmology sample data, the stage's original flags and
configs, and the built-in throughput benchmark (IO / SYNTHETIC / FULL) for the UNet and the ViT.

A failure points to train.py, lifecycle/cli.py (flag aliases), loop/benchy.py, or the UNet seams
(networks/UNet.py, loaders/cosmo.py and loaders/dali_cosmo.py, the l1_rho loss in task/loss.py).
"""
import json
import os
import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from lifecycle.cli import apply_overrides, training_parser
from sample_data.cosmo import write_cosmo
from task.optim import get_optimizer
from tests.conftest import run_command, run_ranks
from utils.errors import UserError
from utils.YParams import YParams

UNET_YAML = "config/UNet.yaml"
ORIGINAL_CONFIGS = ["base", "short", "short_opt", "bs64_opt", "bs256_opt", "bs512_test", "bs512_opt", "bs2048_opt",
                    "bs8192_opt"]


pytestmark = pytest.mark.usefixtures("in_repo_root")


@pytest.fixture(scope="module")
def cosmo_dir(tmp_path_factory):
    return str(write_cosmo(tmp_path_factory.mktemp("cosmo"), verbose=False))


def overridden(config, flags, dp_size=1):
    params = YParams(UNET_YAML, config)
    args = training_parser("t").parse_args(flags)
    apply_overrides(params, args, dp_size=dp_size, dp_rank=0)
    return params, args


@pytest.mark.parametrize("name", ORIGINAL_CONFIGS + ["demo", "tiny"])
def test_every_original_config_loads(name):
    params = YParams(UNET_YAML, name)
    assert params.N_out_channels == 5 and params.lr_schedule["start_lr"] > 0


def test_opt_configs_really_run_optimised():
    """Upstream overwrote enable_amp/apex/jit from the command line, so *_opt silently ran unoptimised."""
    params, _ = overridden("bs64_opt", [], dp_size=4)
    assert (params.amp_mode, params.enable_fused, params.enable_jit) == ("fp16", True, True)
    assert params.data_loader_config == "dali-lowmem"
    params, _ = overridden("short", [])
    assert (params.amp_mode, params.enable_fused, params.enable_jit) == ("none", False, False)
    params, _ = overridden("short_opt", ["--amp_mode", "none", "--no-enable_fused"])  # flags still win
    assert (params.amp_mode, params.enable_fused, params.enable_jit) == ("none", False, True)


def test_original_flags_are_aliases():
    params, args = overridden("short", ["--enable_amp", "--enable_apex", "--enable_jit", "--num_epochs", "2",
                                        "--enable_manual_profiling"])
    assert (params.amp_mode, params.enable_fused, params.enable_jit, params.num_epochs) == ("fp16", True, True, 2)
    assert (args.profile_epoch, args.profile_iters) == (1, 60)  # upstream: 60 steps of the 2nd epoch
    with pytest.raises(UserError, match="Enable either benchy profiling or manual profiling, not both."):
        overridden("short", ["--enable_benchy", "--enable_manual_profiling"])


SC21_REFUSAL = ("error: --enable_amp is a flag of the UNet stage (the SC21 tutorial), but config/ViT.yaml trains the "
                "ViT: add --yaml_config config/UNet.yaml (for the ViT: --amp_mode fp16)")


@pytest.mark.multiprocess
def test_an_sc21_command_as_written_stops_in_one_line_and_trains_the_unet_with_its_yaml(cosmo_dir, tmp_path):
    """SC21's command names no YAML file, and train.py's default is config/ViT.yaml: its UNet flag stops the run in
    one line naming config/UNet.yaml, before any data or run directory (no ViT trains). Twin: with that file and
    the `tiny` config (2 steps), the same flags train the UNet, with AMP on."""
    result = run_command(["train.py", "--config=short", "--num_epochs", "3", "--enable_amp"])  # as SC21 wrote it
    assert result.returncode == 2 and result.stderr.splitlines() == [SC21_REFUSAL], result.stderr[-2000:]
    twin = run_command(["train.py", "--yaml_config", "config/UNet.yaml", "--config=tiny", "--num_iters", "2",
                        "--enable_amp", "--data_dir", cosmo_dir, "--expdir", str(tmp_path)])
    assert twin.returncode == 0, twin.stderr[-2000:]
    log = open(os.path.join(str(tmp_path), "tiny", "1GPU", "00", "out.log")).read()
    assert log.splitlines()[0].endswith(" - root - INFO - Training UNet: config/UNet.yaml, config tiny")
    assert "amp_mode fp16" in log and "DONE ---- rank 0" in log


def run_unet(cosmo_dir, expdir, *flags, config="tiny"):
    train.main(["--yaml_config", UNET_YAML, "--config", config, "--data_dir", cosmo_dir, "--expdir", str(expdir),
                *flags])
    return os.path.join(str(expdir), config, "1GPU", "00")


@pytest.mark.compat
def test_unet_cpu_run_learns(cosmo_dir, tmp_path):
    """tiny (8 steps per epoch), 6 epochs: the validation L1 falls clearly; epoch lines as the tutorial's."""
    run_dir = run_unet(cosmo_dir, tmp_path, "--num_epochs", "6")
    events = EventAccumulator(os.path.join(run_dir, "logs"))
    events.Reload()
    valid = [e.value for e in events.Scalars("Loss/valid")]
    assert [e.step for e in events.Scalars("Loss/valid")] == [0, 8, 16, 24, 32, 40, 48]
    assert valid[-1] < 0.8 * valid[0], valid
    lr = [e.value for e in events.Scalars("Learning Rate")]
    assert lr[-1] == pytest.approx(0.0, abs=1e-12)  # the cosine ends at end_lr after exactly 6 epochs
    log = open(os.path.join(run_dir, "out.log")).read()
    assert "6 epochs of 8 steps: num_iters 48" in log
    assert re.search(r"Time taken for epoch 6 is \d+\.\d+ sec, avg \d+\.\d+ samples/sec", log)
    assert "data loader initialized with config lowmem" in log and "DONE ---- rank 0" in log


@pytest.mark.parametrize("loader", ["synthetic", "inmem"])
def test_other_loader_configs_train(cosmo_dir, tmp_path, loader):
    run_dir = run_unet(cosmo_dir, tmp_path, "--data_loader_config", loader, "--num_iters", "3")
    log = open(os.path.join(run_dir, "out.log")).read()
    assert f"Cosmo train data ({loader})" in log and f"Cosmo valid data ({loader})" in log  # the dataset's own line


def test_dali_loader_without_the_npy_copies_is_one_clear_line(tmp_path, capsys):
    """dali-lowmem reads <basename>_data.npy / _label.npy; HDF5 files alone are refused with the command that
    writes the copies (training with dali-lowmem: tests/datasets/test_dali_cosmo.py)."""
    data = write_cosmo(tmp_path / "h5_only", npy=False, verbose=False)
    with pytest.raises(SystemExit) as exit_info:
        run_unet(str(data), tmp_path, "--data_loader_config", "dali-lowmem")
    err = [line for line in capsys.readouterr().err.splitlines() if " - root - " not in line]
    assert exit_info.value.code == 2 and len(err) == 1
    assert "downsamp_2048crop_train_data.npy' not found" in err[0] and "python -m sample_data.convert_to_npy" in err[0]


@pytest.mark.multiprocess
def test_missing_cosmology_data_is_one_clear_line(tmp_path):
    result = run_command(["train.py", "--yaml_config", UNET_YAML, "--config", "tiny", "--data_dir",
                          str(tmp_path / "nowhere"), "--expdir", str(tmp_path)])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "python -m sample_data cosmo" in last


def read_benchmark(stderr_or_log, json_path):
    summary = {}
    for name, spacer in (("IO", ""), ("SYNTHETIC", " "), ("FULL", "")):
        match = re.search(rf"BENCHY::SUMMARY::{spacer}{name} average trial throughput: ([\d.]+) \+/- ([\d.]+)",
                          stderr_or_log)
        assert match, name
        summary[name] = float(match.group(1))
    with open(json_path) as f:
        results = json.load(f)
    for name, value in summary.items():
        assert results[name]["mean"] == pytest.approx(value, abs=1e-3) and value > 0
        assert len(results[name]["trial_throughputs"]) == results["ntrials"]
    return summary


def test_benchmark_mode_unet(cosmo_dir, tmp_path, monkeypatch):
    """The three benchmarks' lines and JSON; what each trial does, counted (not timed: 4 batches on a busy CPU
    ordered FULL above IO by 1.5x once): IO draws batches alone, SYNTHETIC steps alone, FULL draws and steps."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import loop.benchy
    work = {"draws": 0, "steps": 0}
    real_endless, real_trial = loop.benchy.endless_batches, loop.benchy.time_trial

    def counted_batches(loader):
        for batch in real_endless(loader):
            work["draws"] += 1
            yield batch

    per_trial = {}

    def counted_trial(label, *args, **kwargs):
        before = dict(work)
        rate = real_trial(label, *args, **kwargs)
        per_trial[label] = (work["draws"] - before["draws"], work["steps"] - before["steps"])
        return rate

    monkeypatch.setattr(loop.benchy, "endless_batches", counted_batches)
    monkeypatch.setattr(loop.benchy, "time_trial", counted_trial)
    hook = register_optimizer_step_post_hook(
        lambda *args: work.__setitem__("steps", work["steps"] + 1))
    monkeypatch.setenv("BENCHY_OUTPUT", str(tmp_path / "unet_bench"))
    try:
        run_dir = run_unet(cosmo_dir, tmp_path, "--enable_benchy", "--benchy_nbatches", "4", "--benchy_ntrials", "2",
                           "--benchy_nwarmup", "1")
    finally:
        hook.remove()
    log = open(os.path.join(run_dir, "out.log")).read()
    read_benchmark(log, tmp_path / "unet_bench.json")
    assert "BENCHY::IO_WARMUP_0::Trial Throughput" in log and "BENCHY::FULL_1::Trial Throughput" in log
    expected = {"IO": (4, 0), "SYNTHETIC": (0, 4), "FULL": (4, 4)}  # (batches drawn, optimizer steps) per trial
    assert per_trial == {f"{name}{part}": counts for name, counts in expected.items()
                         for part in ("_WARMUP_0", "_0", "_1")}, per_trial
    assert not os.path.exists(os.path.join(run_dir, "checkpoints"))  # benchmark only: no training, no checkpoint


@pytest.mark.multiprocess
@pytest.mark.long
def test_benchmark_mode_vit_on_two_ranks(era5_dir, tmp_path, monkeypatch):
    out = tmp_path / "vit_bench"
    monkeypatch.setenv("BENCHY_OUTPUT", str(out))
    result = run_ranks(["train.py", "--config", "tiny", "--data_dir", era5_dir, "--expdir", str(tmp_path),
                        "--enable_benchy", "--benchy_nbatches", "4", "--benchy_ntrials", "2", "--benchy_nwarmup", "0"],
                       2)  # plain ranks: torchrun is not under test
    assert result.returncode == 0, result.stderr[-3000:]
    read_benchmark(result.stderr, str(out) + ".json")
    assert json.load(open(str(out) + ".json"))["world_size"] == 2
    assert result.stderr.count("BENCHY::SUMMARY::IO") == 1  # rank 0 reports for the job


@pytest.mark.parametrize("flags, changes, message", [
    (["--num_epochs", "2", "--num_iters", "5"], {}, "--num_iters or --num_epochs, not both"),
    (["--benchy_ntrials", "0"], {}, "benchy_ntrials is 0; it must be at least 1"),
    ([], {"start_lr": 0.0}, "start_lr is 0; it must be positive"),
    ([], {"start_lr": "2e-4"}, "start_lr is '2e-4'; it must be a number"),
    ([], {"scaling": "cubic"}, "scaling 'cubic' is unknown"),
    ([], {"warmup_steps": None}, "warmup_steps is None"),
])
def test_bad_unet_settings_are_one_clear_line(flags, changes, message):
    with pytest.raises(UserError, match=re.escape(message)):
        params, _ = overridden("bs256_opt", ["--data_loader_config", "lowmem", *flags], dp_size=4)
        params.lr_schedule = {**params.lr_schedule, **changes}
        get_optimizer(params, torch.nn.Linear(1, 1))
