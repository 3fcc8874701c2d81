"""Rank 0 of the `mp` config's layouts, each measured alone on this machine's one device by a dry run
(`train_mp.py --dry_run N`, synthetic batches): what a rank of a 4- or 16-GPU job holds, beside the performance
model, without the GPUs. `make bench-dry-run` writes the JSON (device, torch, date).

On a GPU the layouts are the published ones at the config's batch (global 64 over dp, fp16): tp=1 x dp=4, tp=4 x
dp=4, the same with sequence parallelism and activation checkpointing, dp=16 with FSDP. A CPU cannot run the
whole model's step in reasonable time, so there (or with --tiny) the layouts are the tensor-parallel ones at a
local batch of 1 in fp32; bytes are the same tensors a GPU holds, the time is the CPU's. `--layouts` runs some
of them (by the names in the JSON's rows, or their start), `--merge` keeps an existing --out's other rows, each with
the machine and date that measured it.
"""
import datetime
import json
import os

import torch

from benchmarks.common import cpu_cores, device_name, ran_on
from planning.dry_run import CPU_DRY_RUN_FLAGS, dry_run_in_own_process
from utils.atomic import write_json
from utils.errors import ArgumentParser

TP4, SP_AC = ["--tensor_parallel", "4"], ["--sequence_parallel", "--activation_checkpointing"]
GPU_LAYOUTS = [  # (name, ranks, flags): the published runs of the original tutorial and the memory switches
    ("tp=1 dp=4 (published: 44.9 GB after the forward, A100-80GB)", 4, []),
    ("tp=4 dp=4 (published: 33.2 GB in 2024, 29.3 GB in 2025)", 16, TP4),
    ("tp=4 dp=4 sequence parallel + checkpointing", 16, TP4 + SP_AC),
    ("dp=16 FSDP", 16, ["--fsdp"]),
]
CPU_LAYOUTS = [
    ("tp=4 dp=4", 16, TP4),
    ("tp=4 dp=4 sequence parallel + checkpointing", 16, TP4 + SP_AC),
    ("tp=4 cp=4", 16, TP4 + ["--context_parallel", "4"]),
]
TINY_LAYOUTS = [("tp=2 dp=2", 4, ["--tensor_parallel", "2"]),
                ("tp=2 cp=2", 4, ["--tensor_parallel", "2", "--context_parallel", "2"])]


def ordered(kept, new):
    """The rows kept and measured, in the order of the layouts."""
    order = [name for name, _, _ in GPU_LAYOUTS + CPU_LAYOUTS + TINY_LAYOUTS]
    return sorted(kept + new, key=lambda row: order.index(row["name"]) if row["name"] in order else len(order))


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="default: bench_results/gpu/dry_run_mp.json on a GPU, else "
                        "bench_results/dry_run_mp.json")
    parser.add_argument("--tiny", action="store_true", help="the tiny config (a check of the command, seconds)")
    parser.add_argument("--layouts", default="", help="comma-separated starts of layout names, e.g. "
                        "'tp=4 dp=4 sequence,dp=16' (default: all)")
    parser.add_argument("--merge", action="store_true", help="keep the other rows of an existing --out")
    args = parser.parse_args(argv)
    if args.tiny and not args.out:
        parser.error("--tiny checks the command; give it an --out of its own")
    on_gpu = torch.cuda.is_available() and not args.tiny
    config = "tiny" if args.tiny else "mp"
    layouts = GPU_LAYOUTS if on_gpu else CPU_LAYOUTS
    extra = [] if on_gpu else CPU_DRY_RUN_FLAGS
    if args.tiny:
        layouts = TINY_LAYOUTS
    if args.layouts:
        starts = [start.strip() for start in args.layouts.split(",") if start.strip()]
        unknown = [start for start in starts if not any(name.startswith(start) for name, _, _ in layouts)]
        if unknown:
            parser.error(f"no layout starts with {', '.join(map(repr, unknown))}; the layouts: "
                         f"{'; '.join(name for name, _, _ in layouts)}")
        layouts = [layout for layout in layouts if any(layout[0].startswith(start) for start in starts)]
    out = args.out or ("bench_results/gpu/dry_run_mp.json" if on_gpu else "bench_results/dry_run_mp.json")
    doc = {"device": device_name(), "machine": cpu_cores(), "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "config": config, "extra_flags": extra, "rows": []}
    kept = []
    if args.merge and os.path.exists(out):
        with open(out) as f:
            old = json.load(f)
        measured = {name for name, _, _ in layouts}
        kept = [{"ran": ran_on(old), **row} for row in old["rows"] if row["name"] not in measured]
    stamp = ran_on(doc)
    failed = []
    for name, ranks, flags in layouts:
        print(f"dry run: {name} ({ranks} ranks)", flush=True)
        result, error = dry_run_in_own_process(["--config", config, "--dry_run", str(ranks), *flags, *extra])
        if error:  # said and kept; the other layouts still run
            failed.append(name)
            doc["rows"].append({"name": name, "ran": stamp, "error": error})
            print(f"  failed: {error}", flush=True)
        else:
            doc["rows"].append({"name": name, "ran": stamp, **result})
            print(f"  rank 0 holds {sum(result[k] for k in ('parameters', 'gradients', 'optimizer_state')) / 1e9:.3f} "
                  f"GB of state, {result['saved_activations'] / 1e9:.3f} GB of saved activations; peak "
                  f"{result['peak_memory_gb']:.2f} GB ({result['peak_memory_is']}), step {result['step_time_s']:.3f} s "
                  "(compute only)", flush=True)
        write_json(out, {**doc, "rows": ordered(kept, doc["rows"])})  # a run cut short keeps what it measured
    print(f"wrote {out}")
    if failed:
        raise SystemExit(f"error: the dry run of {', '.join(failed)} failed (the reasons are in {out})")


if __name__ == "__main__":
    main()
