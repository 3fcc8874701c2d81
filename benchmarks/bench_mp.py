"""Benchmark: train_mp.py's samples/s and per-rank memory per layout and memory flag (JSON + table).

    python -m benchmarks.bench_mp --data_dir data/era5 [--out bench_results/mp_demo.json]     # the demo ViT
    python -m benchmarks.bench_mp --shape mp [--out bench_results/mp_shape.json]             # the tutorial's mp ViT

The demo ViT runs at tp=1, tp=2, cp=2 and dp=2 (DDP and FSDP); the `mp` config (158 M parameters, 4,050 tokens) at
a local batch of 1 in bf16 autocast (the bytes of the tutorial's fp16) on 360 x 720 sample data (generated if
missing, 2.9 GB) at tp=1, tp=4 and dp=2, with the memory flags, one step per trial.

Each layout runs train_mp.py's built-in benchmark (--enable_benchy) under torchrun on this machine (gloo on CPUs,
NCCL on GPUs, one per rank: a layout with more ranks than the node has GPUs is skipped, and said so). Reported per
layout: FULL samples/s of the job, parameters held by one rank (what tp shards: the blocks' attention and MLP
weights; what it leaves whole: patch and position embedding, norms, head), their bytes with Adam's two moments, and
rank 0's peak memory (CUDA allocator high watermark, or the process's peak resident size on CPUs, which the Python
runtime dominates for a model this small). Measured on rank 0 after the trials (loop/benchy.model_memory): the
bytes of its parameters and gradients, and the bytes autograd saves in one forward of a batch (saved-tensor hooks,
in autocast as trained), and of the optimizer's state (Adam's moments). Layouts also run with --sequence_parallel,
--activation_checkpointing and --fsdp, so each flag's memory and step-time cost shows against the same layout
without it.
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

SP, AC, FSDP = "--sequence_parallel", "--activation_checkpointing", "--fsdp"
LAYOUTS = {  # label, ranks, tp, cp, flags
    "demo": [("tp=1", 1, 1, 1, ()), ("tp=1 + checkpointing", 1, 1, 1, (AC,)), ("tp=2", 2, 2, 1, ()),
             ("tp=2 + sp", 2, 2, 1, (SP,)), ("tp=2 + sp + checkpointing", 2, 2, 1, (SP, AC)),
             ("cp=2", 2, 1, 2, ()), ("dp=2", 2, 1, 1, ()), ("dp=2 + fsdp", 2, 1, 1, (FSDP,))],
    "mp": [("tp=1", 1, 1, 1, ()), ("tp=1 + checkpointing", 1, 1, 1, (AC,)), ("tp=4", 4, 4, 1, ()),
           ("tp=4 + sp", 4, 4, 1, (SP,)), ("tp=4 + sp + checkpointing", 4, 4, 1, (SP, AC)),
           ("dp=2", 2, 1, 1, ()), ("dp=2 + fsdp", 2, 1, 1, (FSDP,))],
}
SHAPE_ARGS = {"demo": [], "mp": ["--local_batch_size", "1", "--amp_mode", "bf16", "--data_loader_config", "pytorch",
                                 "--num_data_workers", "0", "--no-enable_fused"]}
PARAMS_LINE = re.compile(r"Number of parameters on this rank: ([\d,]+)")


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(LAYOUTS), default="demo", help="the ViT config and its layouts")
    parser.add_argument("--data_dir", default=None, help="default: data/era5 (demo), data/era5_360x720 (mp)")
    parser.add_argument("--out", default=None, help="default: bench_results/mp_demo.json, mp_shape.json")
    parser.add_argument("--nbatches", type=int, default=None, help="batches per trial (default 10 demo, 1 mp)")
    args = parser.parse_args(argv)
    demo = args.shape == "demo"
    data_dir = args.data_dir or ("data/era5" if demo else "data/era5_360x720")
    out_path = args.out or f"bench_results/{'mp_demo' if demo else 'mp_shape'}.json"
    nbatches = args.nbatches or (10 if demo else 1)
    if not os.path.isdir(os.path.join(data_dir, "train")):
        from sample_data import write_era5
        print(f"[bench_mp] generating sample data in {data_dir}", flush=True)
        kwargs = {} if demo else {"height": 360, "width": 720, "steps_per_year": 48, "train_years": 1,
                                  "valid_years": 1, "test_years": 1}
        write_era5(data_dir, verbose=False, **kwargs)
    rows, skipped = [], []
    for label, ranks, tp, cp, flags in LAYOUTS[args.shape]:
        if torch.cuda.is_available() and torch.cuda.device_count() < ranks:  # NCCL needs one GPU per rank
            skipped.append(f"{label}: {ranks} ranks need {ranks} GPUs, this node has {torch.cuda.device_count()}")
            print(f"[bench_mp] {skipped[-1]}; skipped (run on a node with {ranks} GPUs)", flush=True)
            continue
        with tempfile.TemporaryDirectory() as work:
            out = os.path.join(work, "bench")
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                       str(free_port()), "train_mp.py", "--config", args.shape, "--data_dir", data_dir,
                       "--expdir", work, "--tensor_parallel", str(tp), "--context_parallel", str(cp),
                       "--enable_benchy", "--benchy_nbatches", str(nbatches), "--benchy_ntrials", "2" if demo else "1",
                       "--benchy_nwarmup", "1" if demo else "0", *SHAPE_ARGS[args.shape], *flags]
            env = dict(os.environ, BENCHY_OUTPUT=out, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // ranks)))
            result = subprocess.run(command, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                print(result.stderr[-3000:], file=sys.stderr)
                print(f"error: the {label} run failed", file=sys.stderr)
                return 1
            bench = json.load(open(out + ".json"))
        params = int(PARAMS_LINE.search(result.stderr).group(1).replace(",", ""))  # this rank's tp shard
        memory = {name: value / 1e6 for name, value in bench["memory_bytes"].items()}  # rank 0, measured
        rows.append({"layout": label, "ranks": ranks, "tp": tp, "cp": cp, "dp": ranks // (tp * cp),
                     "flags": list(flags), "local_batch_size": bench["global_batch_size"] // bench["dp_size"],
                     "samples_per_sec": bench["FULL"]["mean"], "params_per_rank": params,
                     "params_held_per_rank": bench["memory_bytes"]["parameters"] // 4,  # fp32: of them, FSDP's shard
                     "params_and_adam_mb": sum(memory[k] for k in ("parameters", "gradients", "optimizer_state")),
                     "parameters_mb": memory["parameters"], "gradients_mb": memory["gradients"],
                     "adam_state_mb": memory["optimizer_state"], "saved_activations_mb": memory["saved_activations"],
                     "peak_memory_gb_rank0": bench["peak_memory_gb"]})
        print(f"[bench_mp] {label}: {rows[-1]['samples_per_sec']:.2f} samples/s, "
              f"{rows[-1]['params_held_per_rank']:,} parameters held per rank "
              f"({rows[-1]['params_and_adam_mb']:.1f} MB with gradients and Adam), saved activations "
              f"{memory['saved_activations']:.1f} MB per forward, peak memory {bench['peak_memory_gb']:.2f} GB",
              flush=True)
    machine = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{cpu_cores()}, no GPU"
    write_json(out_path, {"config": args.shape, "machine": machine, "torch": torch.__version__,
                          "extra_args": SHAPE_ARGS[args.shape], "rows": rows, "skipped": skipped})
    print(f"[bench_mp] written to {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
