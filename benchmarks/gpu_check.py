"""One command for whoever has a GPU: every CUDA-only test, then a short benchmark of each stage, in one JSON.

    make gpu-check        # python -m benchmarks.gpu_check --out bench_results/gpu/gpu_check.json

1. `pytest -m gpu tests`: the tests skipped on machines without CUDA (NCCL, autocast on the GPU, fused
   optimizers, the profiler window, DataParallel, ...). Those that need more GPUs than the node has are skipped,
   counted in the report and named, with the command that runs them on a node with 2 or more GPUs.
2. Sample data at the stages' real sizes (ERA5 360 x 720, cosmology boxes, CIFAR-100), generated once.
3. train.py's built-in benchmark (--enable_benchy: IO, SYNTHETIC, FULL) for the ViT `short` config in bf16, the
   UNet `short` config and the ResNet `bs256-amp-nhwc-extra-opts` config: samples/s, MFU against the datasheet
   peak, peak memory.
4. CUDA Graphs: ms per step of train.py against train_graph.py (benchmarks/bench_graph.py: a small ViT, the ViT
   `short` config in bf16, the UNet `short` config; with --tiny the small ViT only). Needs CUDA: skipped (and
   said so in the report) with --allow-cpu on a machine without it.
Everything runs even after a failure; the exit code is non-zero if anything failed. About 6 minutes on one H100 for
steps 1-3 (step 4 has not been timed on a GPU yet).
`--tiny --allow-cpu` runs the same steps with the `tiny` configs (a check of this script on any machine).
"""
import os
import re
import subprocess
import sys
import time

import torch

from benchmarks import bench_graph
from benchmarks.common import DATA_SIZES, REPO_ROOT, device_name, make_data, run_stage
from utils.atomic import write_json
from utils.errors import ArgumentParser

# name: (yaml, config, data set, extra flags)
STAGES = {
    "vit_short_bf16": ("config/ViT.yaml", "short", "era5", ["--amp_mode", "bf16", "--num_data_workers", "4"]),
    "unet_short": ("config/UNet.yaml", "short", "cosmo", []),
    "resnet_bs256_amp_nhwc_extra_opts": ("config/ResNet50.yaml", "bs256-amp-nhwc-extra-opts", "cifar100", []),
}
SKIP_LINE = re.compile(r"^SKIPPED \[(\d+)\] (\S+?):\d+: (.*)$")  # pytest -rs: SKIPPED [count] file:line: reason
MULTI_GPU_COMMAND = "python -m pytest -m gpu tests -rs   # on a node with 2 or more GPUs"


def log(message):
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def gpu_test_report(exit_code, output):
    """What `pytest -q -rs -m gpu` ran and skipped, said plainly: the tests that need more GPUs than this node has,
    with the command that runs them where there are enough."""
    lines = output.strip().splitlines()
    skipped = [{"count": int(m.group(1)), "where": m.group(2), "reason": m.group(3)}
               for m in map(SKIP_LINE.match, lines) if m]
    need_more = [s for s in skipped if re.search(r"needs? [2-9] GPUs|needs? \d+ or more GPUs", s["reason"])]
    summary = lines[-1] if lines else "(no output)"
    said = f"GPU tests on {torch.cuda.device_count()} GPU(s): {summary}"
    if need_more:
        said += (f"; {sum(s['count'] for s in need_more)} need more GPUs and did not run ("
                 + "; ".join(sorted({s["reason"] for s in need_more})) + f"): {MULTI_GPU_COMMAND}")
    return {"exit_code": exit_code, "summary": summary, "skipped": skipped,
            "skipped_for_more_gpus": sum(s["count"] for s in need_more), "said": said}


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results/gpu/gpu_check.json", help="the JSON report")
    parser.add_argument("--work", default="data/gpu_check", help="sample data and runs go here")
    parser.add_argument("--tiny", action="store_true", help="the tiny configs and data (a check of this script)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (with --tiny, for tests)")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    parser.add_argument("--skip-benchmarks", action="store_true", help="the CUDA-only tests only")
    parser.add_argument("--tests", default="tests", help="where pytest looks for the tests marked gpu")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("error: make gpu-check needs an NVIDIA GPU (torch.cuda.is_available() is False here); run it on a "
              "GPU node, e.g. `salloc -C gpu -N 1 -G 1` then `make gpu-check`", file=sys.stderr)
        return 2
    report = {"device": device_name(), "torch": torch.__version__, "cuda": torch.version.cuda, "started": time.ctime(),
              "stages": {}}
    failures = []

    if not args.skip_tests:
        log(f"CUDA-only tests: pytest -m gpu {args.tests} on {torch.cuda.device_count()} GPU(s)")
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", args.tests, "-p",
                                "no:cacheprovider"], cwd=REPO_ROOT, capture_output=True, text=True)
        report["gpu_tests"] = gpu_test_report(tests.returncode, tests.stdout)
        print(tests.stdout[-5000:], flush=True)
        log(report["gpu_tests"]["said"])
        if tests.returncode != 0:
            failures.append(f"gpu tests: {report['gpu_tests']['summary']}")

    if args.skip_benchmarks:
        return finish(report, failures, args.out)
    sizes = "tiny" if args.tiny else "full"
    data = make_data(os.path.join(os.path.abspath(args.work), sizes), DATA_SIZES[sizes], log)
    bench = {"nbatches": 2, "ntrials": 1, "nwarmup": 0} if args.tiny else {"nbatches": 20, "ntrials": 2, "nwarmup": 1}
    for name, (yaml, config, dataset, flags) in STAGES.items():
        result = run_stage(name, yaml, "tiny" if args.tiny else config, data[dataset], flags,
                           os.path.abspath(args.work), bench, log=log)
        report["stages"][name] = result
        if result["ok"]:
            log(f"{name}: FULL {result['FULL']['mean']:.1f} samples/s, MFU {100 * result['FULL']['mfu']:.1f}% "
                f"({result['peak']}), peak memory {result['peak_memory_gb']:.2f} GB")
        else:
            failures.append(f"{name}: {result['error'][0]}")
            log(f"{name} FAILED: {result['error'][0]}")

    if torch.cuda.is_available():
        log("CUDA Graphs: train.py against train_graph.py, ms per step")
        report["cuda_graphs"] = bench_graph.run(args.tiny, os.path.abspath(args.work),
                                                os.path.join(os.path.abspath(args.work), "bench_graph"))
        failures += [f"cuda graphs {failure}" for failure in report["cuda_graphs"]["failures"]]
        print(bench_graph.table(report["cuda_graphs"]), flush=True)
    else:
        report["cuda_graphs"] = {"skipped": "CUDA Graphs need a CUDA GPU"}
        log("CUDA Graphs benchmark skipped: no CUDA GPU")
    return finish(report, failures, args.out)


def finish(report, failures, out):
    """Write the report; 0 if nothing failed, else 1 with the failures in one line."""
    report["failures"] = failures
    write_json(out, report)
    log(f"report written to {out}")
    if failures:
        print("error: gpu-check failed: " + "; ".join(failures), file=sys.stderr)
        return 1
    log("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
