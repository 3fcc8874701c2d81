"""The benchmarks print their numbers and write them as JSON. Failures point to benchmarks/bench_step.py or
benchmarks/bench_train.py."""
import json
import os
import time
from pathlib import Path

import pytest
import torch

from benchmarks import bench_step


def test_bench_step_reports_step_peak_and_ratio(tmp_path, capsys):
    out = tmp_path / "step.json"
    bench_step.main(["--height", "16", "--width", "32", "--patch_size", "4", "--embed_dim", "32", "--depth", "1",
                     "--num_heads", "2", "--batch_size", "2", "--warmup_steps", "1", "--steps", "2",
                     "--out", str(out)])
    printed = capsys.readouterr().out
    for line in ("ViT train step:", "fp32 matmul peak:", "ratio (MFU):"):
        assert line in printed
    results = json.loads(out.read_text())
    assert results["flops_per_step"] > 0 and results["matmul_peak_tflops"] > 0
    assert results["mfu"] == pytest.approx(results["achieved_tflops"] / results["matmul_peak_tflops"])


@pytest.mark.multiprocess
@pytest.mark.long
def test_bench_train_runs_each_variant_fresh(era5_dir, tmp_path, monkeypatch, capsys):
    """Two variants on the tiny ViT: each must train (not resume the other's finished run) and be reported."""
    from benchmarks import bench_train
    from tests.conftest import REPO_ROOT
    monkeypatch.chdir(REPO_ROOT)
    variants = [("baseline", ["--num_data_workers", "0"]), ("again", ["--num_data_workers", "0"])]
    monkeypatch.setitem(bench_train.SUITES, "vit", ("config/ViT.yaml", "tiny", 64, variants))
    out = tmp_path / "train.json"
    bench_train.main(["--suite", "vit", "--config", "tiny", "--data_dir", era5_dir, "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [row["variant"] for row in rows] == ["baseline", "again"]
    assert all(row["samples_per_sec"] > 0 and row["measured_over"].startswith("epoch 2") for row in rows)
    assert "| again |" in capsys.readouterr().out


def test_gpu_check_refuses_a_machine_without_cuda(capsys, monkeypatch):
    from benchmarks import gpu_check
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", "unused.json"]) == 2
    assert capsys.readouterr().err.startswith("error: make gpu-check needs an NVIDIA GPU")


def test_gpu_check_says_which_gpu_tests_need_more_gpus_and_how_to_run_them(monkeypatch):
    """On one GPU the 2-GPU tests are skipped: the report counts them, names why, and gives the command for a
    node with more GPUs; a run that skipped none for that reason says nothing of the kind."""
    from benchmarks import gpu_check
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 1)
    output = "\n".join([
        "....s.s",
        "SKIPPED [1] tests/gpu/test_gpu.py:64: tensor parallelism over NCCL needs 2 GPUs",
        "SKIPPED [2] tests/parallel/test_distributed_layers.py:145: the NCCL variant needs 2 GPUs (one per rank)",
        "SKIPPED [1] tests/datasets/test_dali_cosmo.py:201: the GPU pipeline needs CUDA",
        "12 passed, 4 skipped in 80.00s"])
    report = gpu_check.gpu_test_report(0, output)
    assert report["skipped_for_more_gpus"] == 3 and len(report["skipped"]) == 3
    assert report["said"].startswith("GPU tests on 1 GPU(s): 12 passed, 4 skipped in 80.00s; 3 need more GPUs")
    assert report["said"].endswith(gpu_check.MULTI_GPU_COMMAND) and "tensor parallelism over NCCL" in report["said"]
    alone = gpu_check.gpu_test_report(0, "12 passed in 80.00s")
    assert alone["skipped_for_more_gpus"] == 0 and "need more GPUs" not in alone["said"]


@pytest.mark.multiprocess
@pytest.mark.long
def test_gpu_check_runs_every_step_and_writes_one_report(tmp_path):
    """The same script on the tiny configs: gpu tests (all skipped here), data, the three stage benchmarks."""
    from benchmarks import gpu_check
    out = tmp_path / "report.json"
    assert gpu_check.main(["--tiny", "--allow-cpu", "--work", str(tmp_path / "work"), "--out", str(out),
                           "--tests", "tests/gpu/test_gpu.py"]) == 0  # one module to collect: the suite stays short
    report = json.loads(out.read_text())
    assert report["failures"] == [] and report["gpu_tests"]["exit_code"] == 0
    assert "skipped" in report["gpu_tests"]["summary"]
    assert set(report["stages"]) == {"vit_short_bf16", "unet_short", "resnet_bs256_amp_nhwc_extra_opts"}
    for stage in report["stages"].values():
        assert stage["ok"] and stage["FULL"]["mean"] > 0 and 0 < stage["FULL"]["mfu"] <= 1
        assert stage["peak_memory_gb"] > 0


@pytest.mark.multiprocess
@pytest.mark.long
def test_gpu_table_runs_its_rows_and_keeps_those_that_cannot_run(tmp_path, monkeypatch, capsys):
    """`python -m benchmarks.gpu_table --tiny --allow-cpu` on two rows: the baseline runs and is tabled; CUDA
    Graphs, which need a GPU, are kept with the reason; targets whose row did not run are unknown, not met."""
    from benchmarks import gpu_table
    monkeypatch.setattr(gpu_table.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "table.json"
    assert gpu_table.main(["--tiny", "--allow-cpu", "--skip-levers", "--rows", "vit_baseline,vit_graphs", "--work",
                           str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rows"]["vit_baseline"]["FULL"]["mean"] > 0 and report["date"] and report["device"]
    assert report["rows"]["vit_graphs"] == {"ok": False, "skipped": "CUDA Graphs need a CUDA GPU"}
    assert report["targets"]["eager_samples_per_s"]["met"] is None
    printed = capsys.readouterr().out
    assert "| ViT short: baseline (fp32, 0 workers) |" in printed and "not run: CUDA Graphs need a CUDA GPU" in printed


def test_a_failed_row_keeps_the_line_that_says_what_went_wrong():
    """A failed run's error is its `error:` line or its exception's, not a hint printed after the traceback (the
    H200's compiled channels_last_3d UNet ended on Inductor's 'See https://...opcheck'); the table shows it."""
    from benchmarks import gpu_table
    from benchmarks.common import error_line
    inductor = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in call\n"
                "AssertionError: expected size 512==512, stride 64==1 at dim=1\n"
                "Error in op: torch.ops.aten.convolution_backward.default\n"
                "See https://pytorch.org/docs/stable/library.html#torch.library.opcheck\n")
    assert error_line(inductor) == "AssertionError: expected size 512==512, stride 64==1 at dim=1"
    assert error_line("2026 - root - INFO - start\nerror: --enable_nhwc with --enable_jit stops\n") == (
        "error: --enable_nhwc with --enable_jit stops")
    assert error_line("killed\n") == "killed" and error_line("") == "(no output)"
    # the project's one line wins over a traceback printed after it (a rank's, say); names with digits and
    # exceptions not called ...Error are exception lines too
    assert error_line("error: rank 1: checkpoint cannot be read\nTraceback (most recent call last):\n"
                      "RuntimeError: gloo\n") == "error: rank 1: checkpoint cannot be read"
    assert error_line("torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised\nSee https://x\n") == (
        "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised")
    assert error_line("torch.distributed.distributed_c10d.DistBackendError: NCCL\nhint\n") == (
        "torch.distributed.distributed_c10d.DistBackendError: NCCL")
    report = {"rows": {"unet_short": {"ok": False, "error": [error_line(inductor)]}}}
    # the row of that failure runs only where --rows names it (the scripts now refuse the pair on a GPU)
    assert set(gpu_table.ROWS) - set(gpu_table.DEFAULT_ROWS) == {"unet_fp16_fused_nhwc_jit_w8"}
    assert gpu_table.table(report).splitlines()[-1] == (
        "| UNet short | not run: AssertionError: expected size 512==512, stride 64==1 at dim=1 | | | |")


def test_gpu_table_merge_keeps_the_rows_it_did_not_run_each_with_its_machine():
    """--merge: the old report's rows this run did not measure stay, stamped with the old run's machine and date, in
    the table's order; a row measured again is the new one; the levers are the union, the newest value of each, with
    both runs named. Twin: a new report without an old one is left as it is."""
    from benchmarks.gpu_table import merged
    old = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "date": "2026-11-27",
           "rows": {"vit_bf16": {"ok": True, "x": 1}, "unet_short": {"ok": True, "x": 2}},
           "levers": {"ok": True, "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "date": "2026-11-27",
                      "step_alone_ms": {"now": 113.5, "tokens_transposed": 126.0}, "attention_ms": {"auto": 113.5}}}
    new = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "date": "2026-11-28",
           "rows": {"unet_short": {"ok": True, "x": 3, "ran": "today"}},
           "levers": {"ok": True, "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "date": "2026-11-28",
                      "step_alone_ms": {"now": 113.0, "cast_once": 110.0}, "compiled_ms": {"default": 94.0},
                      "kept": ["cast_once"]}}
    got = merged(json.loads(json.dumps(old)), json.loads(json.dumps(new)))
    assert list(got["rows"]) == ["vit_bf16", "unet_short"]
    assert got["rows"]["vit_bf16"] == {"ran": "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, 2026-11-27", "ok": True,
                                       "x": 1}
    assert got["rows"]["unet_short"] == {"ok": True, "x": 3, "ran": "today"}
    levers = got["levers"]
    assert levers["step_alone_ms"] == {"now": 113.0, "tokens_transposed": 126.0, "cast_once": 110.0}
    assert levers["attention_ms"] == {"auto": 113.5} and levers["compiled_ms"] == {"default": 94.0}
    assert [run["date"] for run in levers["runs"]] == ["2026-11-27", "2026-11-28"] and levers["kept"] == ["cast_once"]
    skipped = merged(json.loads(json.dumps(old)), {**json.loads(json.dumps(new)), "levers": {"skipped": "x"}})
    assert skipped["levers"] == old["levers"]


def test_gpu_table_stopped_by_the_deadline_keeps_the_levers_measured(tmp_path, monkeypatch):
    """SIGTERM (gpu_session.sh's deadline) while bench_levers runs: the table keeps what the levers wrote so far,
    marked cut, and gpu_table ends with 124; the handler of SIGTERM is put back. Twin: a SIGTERM before the levers
    wrote anything keeps no levers."""
    import signal

    from benchmarks import gpu_table
    monkeypatch.setattr(gpu_table.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_table, "make_data", lambda root, sizes, log, names=None: {"era5": str(tmp_path)})
    for wrote in (True, False):
        def levers_cut_short(command, wrote=wrote, **kwargs):
            if wrote:
                out = command[command.index("--out") + 1]
                Path(out).write_text(json.dumps({"device": "cpu", "torch": "x", "date": "d",
                                                 "step_alone_ms": {"now": 20.0}}))
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
            raise AssertionError("SIGTERM did not stop the levers")
        monkeypatch.setattr(gpu_table.subprocess, "run", levers_cut_short)
        before = signal.getsignal(signal.SIGTERM)
        out = tmp_path / f"table_{wrote}.json"
        assert gpu_table.main(["--tiny", "--allow-cpu", "--rows", "levers", "--work", str(tmp_path),
                               "--out", str(out)]) == 124
        assert signal.getsignal(signal.SIGTERM) == before
        report = json.loads(out.read_text())
        if wrote:
            assert report["levers"]["cut"] == "stopped by the session's deadline"
            assert report["levers"]["step_alone_ms"] == {"now": 20.0}
        else:
            assert "levers" not in report


def test_gpu_table_targets_say_met_or_missed():
    """The targets read the right row and compare the right way (a number below the floor is missed)."""
    from benchmarks.gpu_table import check_targets

    def row(full, synthetic, memory):
        return {"ok": True, "FULL": {"mean": full}, "SYNTHETIC": {"mean": synthetic}, "peak_memory_gb": memory}

    checked = check_targets({"vit_bf16": row(136.0, 140.0, 14.0), "vit_fused_compile": row(160.0, 170.0, 13.0)})
    assert checked["eager_samples_per_s"] == {"row": "vit_bf16", "what": "FULL samples/s", "at_least": 135.0,
                                              "at_most": None, "value": 136.0, "met": True}
    assert checked["loader_fraction_eager"]["met"] is True  # 136 / 140 = 0.971
    assert checked["fused_compile_samples_per_s"]["met"] is False
    assert checked["loader_fraction_fused_compile"]["met"] is False  # 160 / 170 = 0.941
    assert checked["peak_memory_gb"]["met"] is True
    assert check_targets({"vit_bf16": row(136.0, 140.0, 14.5)})["peak_memory_gb"]["met"] is False


def test_gpu_table_refuses_an_unknown_row_and_a_machine_without_cuda(capsys, monkeypatch):
    from benchmarks import gpu_table
    assert gpu_table.main(["--rows", "vit_bf17"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown row vit_bf17; choose among: vit_baseline")
    assert gpu_table.main(["--data-only", "--datasets", "era6"]) == 2
    assert "error: unknown data set era6; choose among: era5, cosmo, cifar100" in capsys.readouterr().err
    monkeypatch.setattr(gpu_table.torch.cuda, "is_available", lambda: False)
    assert gpu_table.main([]) == 2
    assert capsys.readouterr().err.startswith("error: make gpu-table measures a GPU")


@pytest.mark.multiprocess
def test_bench_levers_times_each_variant_and_puts_every_patch_back(era5_dir, tmp_path, monkeypatch):
    """bench_levers on the tiny ViT on the CPU: the step alone and with the loader as the code is now and with the
    tokens as a transposed view, the loader restarted each epoch as before, torch's attention choice and flash; the
    CUDA-only kernels said not run; every patched method restored afterwards."""
    from benchmarks import bench_levers
    from loaders.common import RingBatchSampler, TorchLoader
    from networks.vit import Attention, PatchEmbed
    from tests.conftest import REPO_ROOT
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(bench_levers.torch.cuda, "is_available", lambda: False)
    originals = (PatchEmbed.forward, TorchLoader._on_device, TorchLoader.set_epoch, RingBatchSampler.__iter__,
                 Attention.forward)
    out = tmp_path / "levers.json"
    assert bench_levers.main(["--tiny", "--data_dir", era5_dir, "--out", str(out), "--steps", "2",
                              "--warmup", "1", "--workers", "1"]) == 0
    report = json.loads(out.read_text())
    assert set(report["step_alone_ms"]) == {"now", "tokens_transposed", "qkv_one_gemm", "cast_by_each"}
    assert set(report["with_loader_ms"]) == {"now", "tokens_transposed", "qkv_one_gemm", "cast_by_each",
                                             "loader_restarted_each_epoch"}
    assert all(value > 0 for value in [*report["step_alone_ms"].values(), *report["with_loader_ms"].values()])
    assert report["attention_ms"]["auto"] > 0 and report["attention_ms"]["flash"] > 0
    assert report["attention_ms"]["cudnn"].startswith("not run: --sdpa_backend cudnn is a CUDA kernel")
    assert (PatchEmbed.forward, TorchLoader._on_device, TorchLoader.set_epoch, RingBatchSampler.__iter__,
            Attention.forward) == originals


@pytest.mark.multiprocess  # inductor compiles in worker processes
@pytest.mark.long
def test_bench_levers_compiles_the_step_with_the_kept_candidates(era5_dir, tmp_path, monkeypatch):
    """--compiled on the tiny ViT on the CPU: the step compiled as --enable_jit does with the kept candidate patched
    in (torch.compile called once, qkv_one_gemm in place while it traces); CUDA Graphs said not run; the patch put
    back. Twin: with no candidate kept, `kept` is said not run and nothing compiles."""
    from benchmarks import bench_levers
    from networks.vit import Attention
    from tests.conftest import REPO_ROOT
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(bench_levers.torch.cuda, "is_available", lambda: False)
    compiled, compile = [], torch.compile

    def counted(model, mode=None):
        compiled.append((mode, Attention.forward is bench_levers.qkv_one_gemm))
        return compile(model, mode=mode)

    monkeypatch.setattr(bench_levers.torch, "compile", counted)
    original = Attention.forward
    for kept in (["qkv_one_gemm"], []):
        compiled.clear()
        monkeypatch.setattr(bench_levers, "kept_candidates", lambda ms, kept=kept: kept)
        out = tmp_path / "levers.json"
        assert bench_levers.main(["--tiny", "--data_dir", era5_dir, "--out", str(out), "--steps", "1", "--warmup",
                                  "1", "--workers", "0", "--variants", "now", "--attention", "",
                                  "--compiled", "reduce-overhead,kept"]) == 0
        report = json.loads(out.read_text())
        if kept:
            assert compiled == [(None, True)] and report["compiled_ms"]["kept"] > 0
            assert report["compiled_ms"]["reduce-overhead"] == "not run: CUDA Graphs need a CUDA GPU"
        else:
            assert compiled == [] and report["compiled_ms"]["kept"] == "not run: no candidate gained in eager"
        assert Attention.forward is original


@pytest.mark.parametrize("joined, tolerance", [(True, 1e-5), (False, None)])
def test_qkv_from_one_gemm_is_the_three_gemms_within_rounding(joined, tolerance):
    """The lever candidate `qkv_one_gemm` (bench_levers.py): the same attention output and the same gradients of q,
    k and v's weights as the three GEMMs, in fp32 within 1e-5. Its twin joins the weights in the wrong order (k, q,
    v) and differs."""
    from benchmarks import bench_levers
    from networks.vit import Attention
    torch.manual_seed(0)
    attention, x = Attention(48, 4), torch.randn(2, 10, 48)

    def wrong_order(self, x):
        self.q, self.k = self.k, self.q
        try:
            return bench_levers.qkv_one_gemm(self, x)
        finally:
            self.q, self.k = self.k, self.q

    outputs, grads = [], []
    for forward in (Attention.forward, bench_levers.qkv_one_gemm if joined else wrong_order):
        attention.zero_grad()
        out = forward(attention, x)
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append(torch.cat([layer.weight.grad.flatten() for layer in (attention.q, attention.k, attention.v)]))
    if joined:
        torch.testing.assert_close(outputs[1], outputs[0], atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(grads[1], grads[0], atol=tolerance, rtol=tolerance)
    else:
        assert not torch.allclose(outputs[1], outputs[0], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_casts_its_input_once_bitwise_as_q_k_v_did(dtype, monkeypatch):
    """networks/vit.py's Attention casts its input to the autocast dtype once, where autocast made q, k and v each
    cast it (bench_levers' `cast_by_each`, as it was): the output bitwise the same under bf16 autocast, the input's
    gradient within bf16's rounding (now summed in bf16). Its twin casts to fp16 instead of the autocast dtype, and
    the forward differs."""
    from benchmarks import bench_levers
    from networks.vit import Attention
    if dtype is torch.float16:  # the twin: the wrong dtype
        monkeypatch.setattr(torch, "get_autocast_dtype", lambda device: torch.float16)
    torch.manual_seed(0)
    attention, x = Attention(48, 4), torch.randn(2, 10, 48)
    outputs, grads = [], []
    for forward in (bench_levers.cast_by_each, Attention.forward):
        inp = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward(attention, inp)
        out.float().square().sum().backward()
        outputs.append(out.detach())
        grads.append(inp.grad)
    if dtype is torch.bfloat16:
        assert torch.equal(outputs[1], outputs[0])
        torch.testing.assert_close(grads[1], grads[0], atol=2e-2, rtol=2e-2)
    else:
        assert not torch.equal(outputs[1], outputs[0])


def test_only_the_candidates_that_gain_are_kept_and_never_two_on_one_method(monkeypatch):
    from benchmarks import bench_levers
    from benchmarks.bench_levers import kept_candidates
    assert kept_candidates({"now": 100.0, "qkv_one_gemm": 99.5}) == []
    assert kept_candidates({"now": 100.0, "qkv_one_gemm": 98.0}) == ["qkv_one_gemm"]
    assert kept_candidates({"now": 100.0, "tokens_transposed": 90.0}) == []  # not a candidate
    monkeypatch.setattr(bench_levers, "CANDIDATES", ("qkv_one_gemm", "cast_by_each"))  # both patch Attention.forward
    assert kept_candidates({"now": 100.0, "qkv_one_gemm": 98.0, "cast_by_each": 95.0}) == ["cast_by_each"]


def test_gpu_table_lowers_the_workers_to_what_dev_shm_holds():
    """8 workers need 2 rings of 18 batches of 664 MB (23.9 GB); with 16 GB free in /dev/shm (90% of it used at most),
    4 workers fit (13.3 GB), 5 (15.9 GB) do not."""
    from benchmarks.gpu_table import workers_that_fit
    flags = ["--amp_mode", "bf16", "--num_data_workers", "8"]
    assert workers_that_fit(flags, False, 100e9) == (flags, None)
    fitted, note = workers_that_fit(flags, False, 16e9)
    assert fitted == ["--amp_mode", "bf16", "--num_data_workers", "4"]
    assert note == "4 loader workers instead of 8: /dev/shm has 16.0 GB free, 8 workers' rings need 23.9 GB"
    assert workers_that_fit(flags, True, 1e9) == (flags, None)  # --tiny: small batches


@pytest.mark.multiprocess
@pytest.mark.long
def test_bench_dry_run_writes_each_layouts_rank_0(tmp_path):
    """`make bench-dry-run`'s command with --tiny: one row per layout, each rank 0 of 4 with its layout's tp and cp,
    the state the model predicts (to the byte) and the machine named."""
    from benchmarks import bench_dry_run
    out = tmp_path / "dry.json"
    bench_dry_run.main(["--tiny", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["config"] == "tiny" and doc["device"] and doc["torch"] == torch.__version__
    assert [(row["layout"]["tp"], row["layout"]["cp"], row["rank"]) for row in doc["rows"]] == [(2, 1, 0), (2, 2, 0)]
    for row in doc["rows"]:
        assert row["parameters"] == row["predicted"]["parameters"] > 0


def test_bench_dry_run_keeps_a_failed_layout_and_goes_on(tmp_path, monkeypatch):
    """A layout that fails is kept with its reason, the next one still runs, the JSON is written after each, and the
    command ends with an error naming the failed layout (a GPU session's deadline may cut it at any layout)."""
    from benchmarks import bench_dry_run
    written = []
    monkeypatch.setattr(bench_dry_run, "write_json", lambda path, doc: written.append(json.loads(json.dumps(doc))))
    result = {"parameters": 1, "gradients": 1, "optimizer_state": 2, "saved_activations": 3, "peak_memory_gb": 0.1,
              "peak_memory_is": "the sum of this rank's tensors above", "step_time_s": 0.5}
    answers = iter([(None, "out of memory"), (result, None)])
    monkeypatch.setattr(bench_dry_run, "dry_run_in_own_process", lambda args: next(answers))
    with pytest.raises(SystemExit, match=r"error: the dry run of tp=2 dp=2 failed \(the reasons are in .*dry.json\)"):
        bench_dry_run.main(["--tiny", "--out", str(tmp_path / "dry.json")])
    assert [len(doc["rows"]) for doc in written] == [1, 2]
    ran = f"{written[-1]['device']}, torch {torch.__version__}, {written[-1]['date']}"
    assert written[-1]["rows"] == [{"name": "tp=2 dp=2", "ran": ran, "error": "out of memory"},
                                   {"name": "tp=2 cp=2", "ran": ran, **result}]


def test_bench_dry_run_measures_the_layouts_asked_and_keeps_the_others(tmp_path, monkeypatch, capsys):
    """--layouts runs only the layouts whose names start so; --merge keeps an existing report's other rows, each
    stamped with the machine and date of its report, in the layouts' order. Twin: without --merge the old row is
    gone; a start that names no layout is one line."""
    from benchmarks import bench_dry_run
    out = tmp_path / "dry.json"
    old = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "date": "2026-11-27",
           "rows": [{"name": "tp=2 cp=2", "parameters": 7}, {"name": "tp=2 dp=2", "parameters": 5}]}
    result = {"parameters": 1, "gradients": 1, "optimizer_state": 2, "saved_activations": 3, "peak_memory_gb": 0.1,
              "peak_memory_is": "the sum of this rank's tensors above", "step_time_s": 0.5}
    asked = []
    monkeypatch.setattr(bench_dry_run, "dry_run_in_own_process", lambda args: (asked.append(args), (result, None))[1])
    for merge in (True, False):
        out.write_text(json.dumps(old))
        bench_dry_run.main(["--tiny", "--out", str(out), "--layouts", "tp=2 dp", *(["--merge"] if merge else [])])
        rows = json.loads(out.read_text())["rows"]
        new = {"name": "tp=2 dp=2", "ran": rows[0]["ran"], **result}
        assert rows == ([new, {"ran": "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, 2026-11-27", "name": "tp=2 cp=2",
                               "parameters": 7}] if merge else [new])
    assert all("--context_parallel" not in args for args in asked) and len(asked) == 2
    with pytest.raises(SystemExit):
        bench_dry_run.main(["--tiny", "--out", str(out), "--layouts", "tp=8"])
    assert "no layout starts with 'tp=8'; the layouts: tp=2 dp=2; tp=2 cp=2" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_gpu_session_merges_into_the_committed_report_unless_fresh(tmp_path):
    """gpu_session.sh copies the committed report into DIR to merge its rows into (the H100's); --fresh starts a
    report of its own (another card) and refuses a DIR that already holds one; a flag where DIR belongs is refused.
    PYTHON=true stands in for every measurement."""
    import subprocess

    from tests.conftest import REPO_ROOT

    def session(*args):
        return subprocess.run(["bash", "benchmarks/gpu_session.sh", *map(str, args)], cwd=REPO_ROOT,
                              env={**os.environ, "PYTHON": "true"}, capture_output=True, text=True, timeout=60)

    merged, fresh = tmp_path / "merged", tmp_path / "fresh"
    assert session(merged).returncode == 0
    committed = (Path(REPO_ROOT) / "bench_results" / "gpu" / "single_gpu_table.json").read_text()
    assert (merged / "single_gpu_table.json").read_text() == committed
    assert session(fresh, "--fresh").returncode == 0
    assert not (fresh / "single_gpu_table.json").exists() and (fresh / "session.log").exists()
    again = session(merged, "--fresh")
    assert again.returncode == 2 and again.stderr.strip() == (
        f"error: --fresh starts a report of its own, and {merged} already holds one; choose an empty DIR")
    flag_first = session("--fresh")
    assert flag_first.returncode == 2 and "name the report's folder first" in flag_first.stderr


def test_bench_checkpoint_times_the_digest_on_save_and_load(tmp_path, capsys):
    """benchmarks/bench_checkpoint.py on the tiny config: the JSON is the report returned; the file holds the config's
    tensors (the model and Adam's two moments); the digest alone, best of 3, takes less than save_checkpoint, best
    of 3, which computes it and also writes and flushes the file (about 1.5 ms against 11 on 2 cores: best-of-3
    on both sides, not one sub-millisecond timing against another); the digest's shares of the save and of the load
    (load_checkpoint over torch.load) and its speed are computed from the timings. The figures for `mp` are in
    docs/benchmarks.md."""
    from benchmarks import bench_checkpoint
    out = tmp_path / "digest.json"
    report = bench_checkpoint.main(["--config", "tiny", "--repeats", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == report and report["repeats"] == 3
    assert report["parameters"] == 47_008 and report["file_bytes"] > report["tensor_bytes"] > 3 * 4 * 47_008
    assert report["digest_s"] < report["save_checkpoint_s"], report
    assert report["digest_share_of_save"] == pytest.approx(report["digest_s"] / report["save_checkpoint_s"])
    assert report["digest_share_of_load"] == pytest.approx(
        (report["load_checkpoint_s"] - report["torch_load_s"]) / report["load_checkpoint_s"])
    assert report["digest_gb_per_s"] == pytest.approx(report["tensor_bytes"] / 1e9 / report["digest_s"])
    assert not list(tmp_path.glob("bench_checkpoint_*"))  # its files removed
