"""The step benchmark prints its three numbers and writes them as JSON. Failures point to utils/bench_step.py."""
import json

import pytest

from utils import bench_step


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
