"""train_mp.py --dry_run N (planning/dry_run.py): one rank of an N-rank layout in one process, torch's fake process
group standing in for the other ranks (planning/dry_run.join).

- Its memory is a real rank's: for tp2, cp2, tp2 x cp2 with sequence parallelism and checkpointing, and cp2 x dp2
  with FSDP, the dry runs of rank 0 and rank 1 report exactly the bytes of parameters, gradients, optimizer state
  and saved activations that the real 2- or 4-rank gloo run (--enable_benchy, every rank's record) measures on that
  rank; the twin, the dry run without sequence parallelism and checkpointing, does not match the real run with them.
- It is a command: the last line is one JSON object with the model's prediction beside each number, it writes
  nothing, and what cannot run is one line (exit 2), as train_mp.py refuses it.
- It scales: rank 0 of the `mp` shape on 16 ranks (tp4 x cp4, local batch 1) runs on the CPU, and holds the bytes the
  performance model predicts.
A failure points to planning/dry_run.py (join), or to a layer whose tensors depend on values
that the stand-in ranks do not send.
"""
import json
import os

import pytest

import train_mp
from planning import dry_run
from tests.conftest import run_command, run_ranks
from tests.parallel.test_fsdp import FSDP_ON_CPU
from utils.errors import UserError

COMMON = ["--config", "tiny", "--data_loader_config", "synthetic"]
MEMORY = ("parameters", "gradients", "optimizer_state", "saved_activations")
LAYOUTS = {  # name: (ranks, flags)
    "dp2": (2, []),  # DDP alone: its own all-reduce hands back no bucket on the stand-ins (the hook does)
    "tp2": (2, ["--tensor_parallel", "2"]),
    "cp2": (2, ["--context_parallel", "2"]),
    "tp2xcp2_sp_ac": (4, ["--tensor_parallel", "2", "--context_parallel", "2", "--sequence_parallel",
                          "--activation_checkpointing"]),
    "cp2xdp2_fsdp": (4, ["--context_parallel", "2", "--fsdp"]),
}


def measured_by_real_ranks(tmp_path, ranks, flags):
    """Every rank's memory record of a real gloo run of train_mp.py --enable_benchy (one batch per trial)."""
    out = run_ranks(["train_mp.py", *COMMON, *flags, "--enable_benchy", "--benchy_nbatches", "1",
                     "--benchy_ntrials", "1", "--benchy_nwarmup", "0", "--expdir", str(tmp_path)], ranks)
    assert out.returncode == 0, out.stderr[-3000:]
    folder = os.path.join(str(tmp_path), "tiny")
    (layout_dir,) = os.listdir(folder)
    with open(os.path.join(folder, layout_dir, "00", "benchy_output.json")) as f:
        return json.load(f)["memory_bytes_by_rank"]


def dry(ranks, flags, rank, capsys):
    """The dry run of `rank`, in this process; returns its JSON (the last line printed) and checks it is last."""
    result = train_mp.main([*COMMON, *flags, "--dry_run", str(ranks), "--dry_run_rank", str(rank)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(result))
    return result


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [pytest.param(name, marks=FSDP_ON_CPU) if "fsdp" in name else name
                                  for name in LAYOUTS])
@pytest.mark.long
def test_the_dry_run_holds_what_a_real_rank_holds(name, tmp_path, capsys):
    ranks, flags = LAYOUTS[name]
    real = measured_by_real_ranks(tmp_path, ranks, flags)
    for rank in (0, 1):
        result = dry(ranks, flags, rank, capsys)
        assert {key: result[key] for key in MEMORY} == {key: real[rank][key] for key in MEMORY}, (name, rank)
        assert result["rank"] == rank and result["world_size"] == ranks
    if name == "tp2xcp2_sp_ac":  # the twin: without the memory switches the bytes differ from the real run's
        twin = dry(ranks, flags[:4], 0, capsys)
        assert twin["saved_activations"] != real[0]["saved_activations"]


def test_the_dry_run_writes_nothing_and_says_so_first(tmp_path, capsys, monkeypatch):
    """No run directory, checkpoint or TensorBoard file under --expdir; the first log line names the dry run; the
    model's prediction sits beside the measurement (exact for rank 0's state)."""
    result = train_mp.main([*COMMON, "--tensor_parallel", "2", "--dry_run", "4", "--dry_run_steps", "1", "--expdir",
                            str(tmp_path)])
    assert os.listdir(tmp_path) == []
    printed = capsys.readouterr()
    first = printed.err.strip().splitlines()[0]
    assert "Dry run: rank 0 of 4 (DP = 2, TP = 2, CP = 1, PP = 1)" in first, first
    assert "no checkpoint, no TensorBoard, no check for nan" in first
    for key in ("parameters", "gradients", "optimizer_state"):
        assert result[key] == result["predicted"][key], key
    assert result["saved_activations"] == pytest.approx(result["predicted"]["saved_activations"], rel=0.05)
    assert result["step_time_s"] > 0 and result["peak_memory_gb"] == pytest.approx(
        sum(result[key] for key in MEMORY) / 1024 ** 3)
    assert "| saved activations" in printed.out


@pytest.mark.compat
@pytest.mark.parametrize("argv, words", [
    (["--tensor_parallel", "3", "--dry_run", "4"], "tp x cp = 3 x 1 = 3 does not divide the world size 4"),
    (["--tensor_parallel", "2", "--dry_run", "4", "--dry_run_rank", "4"], "--dry_run_rank 4 is not a rank of 4"),
    (["--dry_run", "2", "--sequence_parallel"], "it needs --tensor_parallel 2 or more"),
    (["--dry_run", "4", "--pipeline_parallel", "4", "--num_microbatches", "2"],
     "--num_microbatches 2 is fewer than the 4 pipeline stages"),
    (["--dry_run", "0"], "'0' is not a number of ranks"),
    (["--dry_run", "131073"], "131073 ranks is more than a dry run stands in for: it builds every process group of "
                              "the layout in this one process (about 0.1 ms a rank), so it takes at most 131072 ranks"),
    (["--dry_run_rank", "1"], "add --dry_run N"),
    (["--dry_run", "2", "--enable_benchy"], "drop --resume and --enable_benchy"),
])
def test_what_cannot_run_is_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as stop:
        train_mp.main([*COMMON, *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0] and "Traceback" not in err, err


@pytest.mark.compat
def test_a_world_too_large_to_stand_in_for_is_refused_before_anything_is_built(capsys, monkeypatch):
    """`--dry_run 100000000` (a 10^8-rank world): one line and exit 2 before a process group is joined. Before, the
    process built every group of the world and grew until the kernel killed it (22 GB, 127 s, no message); here that
    twin fails at once instead of filling the memory, since joining the fake group is refused. Called without the
    flag (dry_run.join of a Layout), the same bound holds; 2^17 ranks pass the flag's check."""
    from utils.layout import DRY_RUN_MAX_RANKS, Layout

    def built(*args):
        raise AssertionError("the dry run joined a process group for a world it cannot hold")

    monkeypatch.setattr(dry_run, "join_fake_process_group", built)
    with pytest.raises(SystemExit) as stop:
        train_mp.main([*COMMON, "--dry_run", "100000000"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["error: argument --dry_run: 100000000 ranks is more than a dry run stands in for: it "
                                "builds every process group of the layout in this one process (about 0.1 ms a rank), "
                                "so it takes at most 131072 ranks (2^17, more than the largest GPU jobs); give a "
                                "smaller N (see --help)"], err
    with pytest.raises(UserError, match=r"^--dry_run 131073 ranks is more than a dry run stands in for"):
        dry_run.join(Layout(dp=DRY_RUN_MAX_RANKS + 1), 0)
    from lifecycle.cli import ranks
    assert ranks(str(DRY_RUN_MAX_RANKS)) == DRY_RUN_MAX_RANKS == 2 ** 17


@pytest.mark.compat
def test_a_dry_run_under_a_launcher_is_refused(monkeypatch):
    from utils.layout import Layout
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="start it with python, not torchrun"):
        dry_run.join(Layout(tp=2), 0)


@pytest.mark.compat
def test_rank_1_of_tp2_in_process(capsys):
    """The fake backend on this torch (2.5 too): rank 1 of tp2 holds rank 0's bytes (an even split) and the model's."""
    result = dry(2, ["--tensor_parallel", "2", "--dry_run_steps", "0"], 1, capsys)
    assert result["step_time_s"] is None and result["step_time_is"].startswith("not timed")
    for key in ("parameters", "gradients", "optimizer_state"):
        assert result[key] == result["predicted"][key], key


@pytest.mark.multiprocess
@pytest.mark.long
def test_rank_0_of_the_mp_shape_on_16_ranks():
    """The tutorial's `mp` ViT (embed 1024, depth 12, 4050 tokens) as rank 0 of tp4 x cp4, local batch 1, as a
    command: its state is the model's to the byte, its saved activations within 5%."""
    out = run_command(["train_mp.py", "--config", "mp", "--data_loader_config", "synthetic", "--amp_mode", "none",
                       "--local_batch_size", "1", "--tensor_parallel", "4", "--context_parallel", "4",
                       "--dry_run", "16"], timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 16 and result["layout"]["dp"] == 1 and result["local_batch_size"] == 1
    for key in ("parameters", "gradients", "optimizer_state"):
        assert result[key] == result["predicted"][key], key
    assert result["saved_activations"] == pytest.approx(result["predicted"]["saved_activations"], rel=0.05)
