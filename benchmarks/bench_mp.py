"""Benchmark: train_mp.py's samples/s and per-rank memory for the demo ViT at tp=1, tp=2 and cp=2 (JSON + table).

    python -m benchmarks.bench_mp --data_dir data/era5 [--out bench_results/mp_demo.json]

Each layout runs train_mp.py's built-in benchmark (--enable_benchy) under torchrun on this machine (gloo on CPUs,
NCCL on GPUs, one per rank: a layout with more ranks than the node has GPUs is skipped, and said so). Reported per
layout: FULL samples/s of the job, parameters held by one rank (what tp shards: the blocks' attention and MLP
weights; what it leaves whole: patch and position embedding, norms, head), their bytes with Adam's two moments, and
rank 0's peak memory (CUDA allocator high watermark, or the process's peak resident size on CPUs, which the Python
runtime dominates for a model this small). Measured on rank 0 after the trials (utils/benchy.model_memory): the
bytes of its parameters and gradients, and the bytes autograd saves in one forward of a batch (saved-tensor hooks,
outside autocast); Adam's state is computed as two moments per parameter. Layouts also run with
--sequence_parallel and --activation_checkpointing, so each flag's memory and step-time cost shows against the
same layout without it.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from benchmarks.common import cpu_cores, free_port
from utils.atomic import write_json
from utils.errors import ArgumentParser

SP, AC = "--sequence_parallel", "--activation_checkpointing"
LAYOUTS = [("tp=1", 1, 1, 1, ()), ("tp=1 + checkpointing", 1, 1, 1, (AC,)), ("tp=2", 2, 2, 1, ()),
           ("tp=2 + sp", 2, 2, 1, (SP,)), ("tp=2 + sp + checkpointing", 2, 2, 1, (SP, AC)),
           ("cp=2", 2, 1, 2, ())]  # label, ranks, tp, cp, flags
PARAMS_LINE = re.compile(r"Number of parameters on this rank: ([\d,]+)")


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default="data/era5")
    parser.add_argument("--config", default="demo")
    parser.add_argument("--out", default="bench_results/mp_demo.json")
    parser.add_argument("--nbatches", type=int, default=10)
    args = parser.parse_args(argv)
    rows, skipped = [], []
    for label, ranks, tp, cp, flags in LAYOUTS:
        if torch.cuda.is_available() and torch.cuda.device_count() < ranks:  # NCCL needs one GPU per rank
            skipped.append(f"{label}: {ranks} ranks need {ranks} GPUs, this node has {torch.cuda.device_count()}")
            print(f"[bench_mp] {skipped[-1]}; skipped (run on a node with {ranks} GPUs)", flush=True)
            continue
        with tempfile.TemporaryDirectory() as work:
            out = os.path.join(work, "bench")
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                       str(free_port()), "train_mp.py", "--config", args.config, "--data_dir", args.data_dir,
                       "--expdir", work, "--tensor_parallel", str(tp), "--context_parallel", str(cp),
                       "--enable_benchy", "--benchy_nbatches", str(args.nbatches), "--benchy_ntrials", "2",
                       "--benchy_nwarmup", "1", *flags]
            env = dict(os.environ, BENCHY_OUTPUT=out, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // ranks)))
            result = subprocess.run(command, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                print(result.stderr[-3000:], file=sys.stderr)
                print(f"error: the {label} run failed", file=sys.stderr)
                return 1
            bench = json.load(open(out + ".json"))
        params = int(PARAMS_LINE.search(result.stderr).group(1).replace(",", ""))
        memory = {name: value / 1e6 for name, value in bench["memory_bytes"].items()}  # rank 0, measured
        rows.append({"layout": label, "ranks": ranks, "tp": tp, "cp": cp, "flags": list(flags),
                     "samples_per_sec": bench["FULL"]["mean"], "params_per_rank": params,
                     "params_and_adam_mb": 3 * 4 * params / 1e6, "parameters_mb": memory["parameters"],
                     "gradients_mb": memory["gradients"], "adam_state_mb": 2 * memory["parameters"],
                     "saved_activations_mb": memory["saved_activations"],
                     "peak_memory_gb_rank0": bench["peak_memory_gb"]})
        print(f"[bench_mp] {label}: {rows[-1]['samples_per_sec']:.1f} samples/s, {params:,} parameters per rank "
              f"({rows[-1]['params_and_adam_mb']:.1f} MB with Adam), saved activations "
              f"{memory['saved_activations']:.1f} MB per forward, peak memory {bench['peak_memory_gb']:.2f} GB",
              flush=True)
    machine = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{cpu_cores()}, no GPU"
    write_json(args.out, {"config": args.config, "machine": machine, "torch": torch.__version__, "rows": rows,
                          "skipped": skipped})
    print(f"[bench_mp] written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
