"""Milliseconds per training step with and without CUDA Graphs: train.py against train_graph.py, on one GPU.

    python -m benchmarks.bench_graph --out bench_results/gpu/bench_graph.json
    python -m benchmarks.bench_graph --tiny --out /tmp/bench_graph.json        # the small ViT only, short trials

Both scripts run their built-in benchmark (--enable_benchy) on the same config; the step time is read from SYNTHETIC
(the step fed one batch already on the device: compute and kernel launches, no loader): ms/step = 1000 x global
batch / samples per second. FULL (with the loader) is reported beside it. Cases:
  vit_tiny        the `tiny` ViT (2 blocks of width 32, 16 x 32 images, batch 4): launch bound, where graphs pay
  vit_short_bf16  the ViT `short` config in bf16 (360 x 720, 12 blocks of width 384, batch 16)
  unet_short      the UNet `short` config as configured (fp32, 64^3 crops, batch 64): compute bound
Sample data is generated once, in the layout `make gpu-check` uses (data/gpu_check/{tiny,full}/...). Also step 4 of
benchmarks/gpu_check.py. On a machine without CUDA it stops with one line.
"""
import os
import sys
import time
from collections import namedtuple

import torch

from benchmarks.common import DATA_SIZES, make_data, run_stage
from utils.atomic import write_json
from utils.errors import ArgumentParser

Case = namedtuple("Case", "name yaml config dataset flags")
CASES = [
    Case("vit_tiny", "config/ViT.yaml", "tiny", "era5", []),
    Case("vit_short_bf16", "config/ViT.yaml", "short", "era5", ["--amp_mode", "bf16", "--num_data_workers", "4"]),
    Case("unet_short", "config/UNet.yaml", "short", "cosmo", []),
]
SCRIPTS = {"eager": "train.py", "graph": "train_graph.py"}


def log(message):
    print(f"[bench-graph {time.strftime('%H:%M:%S')}] {message}", flush=True)


def measure(case, data_dir, work, nbatches=20, ntrials=2, nwarmup=1):
    """ms per step of train.py and train_graph.py on one case, and the speed-up of the graph."""
    result = {"config": f"{case.yaml} {case.config} {' '.join(case.flags)}".strip()}
    for kind, script in SCRIPTS.items():
        bench = run_stage(f"{case.name}_{kind}", case.yaml, case.config, data_dir, case.flags, work,
                          {"nbatches": nbatches, "ntrials": ntrials, "nwarmup": nwarmup}, script=script, log=log)
        if not bench["ok"]:
            raise RuntimeError(f"{script} failed: {bench['error'][0]}")
        batch = bench["global_batch_size"]
        result[kind] = {"ms_per_step": 1000 * batch / bench["SYNTHETIC"]["mean"],
                        "full_ms_per_step": 1000 * batch / bench["FULL"]["mean"],
                        "synthetic_samples_per_sec": bench["SYNTHETIC"]["mean"], "peak_memory_gb":
                        bench["peak_memory_gb"], "global_batch_size": batch}
    result["speedup"] = result["eager"]["ms_per_step"] / result["graph"]["ms_per_step"]
    return result


def run(tiny, data_root, work):
    """Every case (the small ViT only with `tiny`); {"cases": {name: result or error}, "failures": [...]}."""
    cases = CASES[:1] if tiny else CASES
    bench = {"nbatches": 5, "ntrials": 1, "nwarmup": 1} if tiny else {"nbatches": 20, "ntrials": 2, "nwarmup": 1}
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
              "measured": "SYNTHETIC step of --enable_benchy", **bench, "cases": {}, "failures": []}
    for case in cases:
        sizes = "tiny" if case.config == "tiny" else "full"
        try:  # one case failing (a run, its data, its JSON) is reported; the others still run
            data = make_data(os.path.join(data_root, sizes), DATA_SIZES[sizes], log)
            report["cases"][case.name] = result = measure(case, data[case.dataset], work, **bench)
            log(f"{case.name}: eager {result['eager']['ms_per_step']:.2f} ms/step, graph "
                f"{result['graph']['ms_per_step']:.2f} ms/step, speed-up {result['speedup']:.2f}x")
        except (RuntimeError, OSError, ValueError, KeyError) as err:
            report["cases"][case.name] = {"ok": False, "error": str(err)}
            report["failures"].append(f"{case.name}: {err}")
            log(f"{case.name} FAILED: {err}")
    return report


def table(report):
    rows = ["| case | eager ms/step | graph ms/step | speed-up | FULL eager / graph ms/step |", "|---|---|---|---|---|"]
    for name, result in report["cases"].items():
        if "speedup" in result:
            rows.append(f"| {name} | {result['eager']['ms_per_step']:.2f} | {result['graph']['ms_per_step']:.2f} | "
                        f"{result['speedup']:.2f}x | {result['eager']['full_ms_per_step']:.2f} / "
                        f"{result['graph']['full_ms_per_step']:.2f} |")
    return "\n".join(rows)


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results/gpu/bench_graph.json", help="the JSON report")
    parser.add_argument("--data_root", default="data/gpu_check", help="sample data (generated here if missing)")
    parser.add_argument("--work", default="data/gpu_check/bench_graph", help="run directories and benchmark files")
    parser.add_argument("--tiny", action="store_true", help="the small ViT only, short trials")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_graph times CUDA Graphs and needs an NVIDIA GPU (torch.cuda.is_available() is False "
              "here); run it on a GPU node, e.g. `salloc -C gpu -N 1 -G 1`", file=sys.stderr)
        return 2
    report = run(args.tiny, os.path.abspath(args.data_root), os.path.abspath(args.work))
    write_json(args.out, report)
    print(table(report), flush=True)
    log(f"report written to {args.out}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
