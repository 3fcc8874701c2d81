"""What a rank of the 1B model at patch 4 (`wfm_1b_p4`: 64,800 tokens, embed 2048, depth 18, 16 heads of 128) holds
under each context-parallel method, cp 4 to 16 and tp 1 to 4: the performance model's prediction for every layout,
beside one-rank dry runs (`train_mp.py --dry_run`) of some of them.

    python -m benchmarks.bench_cp_memory [--measure] [--out bench_results/cp_memory.json]

Every layout is predicted (planning/perf_model.py: parameters, gradients, Adam's state and the activations saved for
the backward pass, at local batch 1 in fp32, the CPU dry run's settings). With --measure, the layouts of MEASURED
also run as dry runs on this machine, synthetic batches, no timed steps (`--dry_run_steps 0`). A step of a real-size
rank takes minutes on a few CPU cores (a rank at tp=4 x cp=16 computes about 12 s per block forward), so each is run
at depth 1 and depth 2, and the depth-18 rank extrapolated: the blocks are identical, so the second run's extra
bytes are one block's, exactly (`per_block` in the JSON: the saved activations where the methods differ). Rows not
measured are predictions only, and labelled so. Without --measure, an existing --out's measurements are kept and
the predictions recomputed.
"""
import datetime
import json
import os
import sys
import tempfile

import torch
import yaml

from benchmarks.common import machine
from planning import dry_run, perf_model
from planning.dry_run import CPU_DRY_RUN_FLAGS, dry_run_in_own_process
from utils.atomic import write_json
from utils.errors import ArgumentParser
from utils.layout import Layout
from utils.YParams import YParams

CONFIG = "wfm_1b_p4"
LAYOUTS = [(tp, cp) for tp in (1, 2, 4) for cp in (4, 8, 16)]
METHODS = ("allgather", "ring", "alltoall")
# measured here (2 CPU cores: about 30 minutes): allgather and ring at two cp, all-to-all at two cp of the same tp
MEASURED = [(4, 8, "allgather"), (4, 16, "allgather"), (4, 8, "ring"), (4, 16, "ring"), (2, 4, "alltoall"),
            (2, 8, "alltoall")]
KINDS = ("parameters", "gradients", "optimizer_state", "saved_activations")


def layouts():
    """(tp, cp, method, the layout's refusal or None) for every layout of the table."""
    params = YParams(os.path.join("config", "ViT.yaml"), CONFIG)
    found = []
    for tp, cp in LAYOUTS:
        for method in METHODS:
            refusal = Layout(tp=tp, cp=cp, cp_method=method).refusal(num_heads=params.num_heads)
            found.append((tp, cp, method, refusal))
    return found


def predicted(tp, cp, method):
    """The performance model's bytes of rank 0 of a tp x cp layout (dp 1) at local batch 1 in fp32: what a CPU dry
    run prints beside its measurement (planning/dry_run.predicted)."""
    params = YParams(os.path.join("config", "ViT.yaml"), CONFIG)
    params.update({"local_batch_size": 1, "amp_enabled": False})
    found = dry_run.predicted(params, Layout(tp=tp, cp=cp, cp_method=method), torch.device("cpu"))
    found = {kind: found[kind] for kind in KINDS}
    return {**found, "total_gb": sum(found.values()) / perf_model.GIB}


def config_at_depth(folder, depth):
    """A YAML file of its own holding CONFIG at `depth` blocks (merge keys resolved), under the same name."""
    with open(os.path.join("config", "ViT.yaml")) as f:
        config = dict(yaml.safe_load(f)[CONFIG])
    config["depth"] = depth
    path = os.path.join(folder, f"{CONFIG}_depth{depth}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({CONFIG: config}, f)
    return path


def measure(tp, cp, method, folder):
    """Dry runs of rank 0 at depth 1 and 2; the depth-18 bytes extrapolated, and one block's."""
    depth = YParams(os.path.join("config", "ViT.yaml"), CONFIG).depth
    runs = []
    for blocks in (1, 2):
        args = ["--yaml_config", config_at_depth(folder, blocks), "--config", CONFIG, "--tensor_parallel", str(tp),
                "--context_parallel", str(cp), "--cp_method", method, "--dry_run", str(tp * cp), "--dry_run_steps",
                "0", "--data_loader_config", "synthetic", *CPU_DRY_RUN_FLAGS]
        result, error = dry_run_in_own_process(args)
        if error:
            return {"error": error}
        runs.append(result)
    per_block = {kind: runs[1][kind] - runs[0][kind] for kind in KINDS}
    found = {kind: runs[0][kind] + (depth - 1) * per_block[kind] for kind in KINDS}
    return {**found, "total_gb": sum(found.values()) / perf_model.GIB, "per_block": per_block,
            "measured_at_depth": [1, 2]}


def markdown(rows):
    lines = ["| tp | cp | method | measured (GB) | predicted (GB) | saved activations, measured / predicted (GB) |",
             "|---:|---:|---|---:|---:|---:|"]
    for row in rows:
        if row.get("refused"):
            lines.append(f"| {row['tp']} | {row['cp']} | {row['method']} | refused: cp must divide the heads left "
                         "after tp | | |")
            continue
        got, model = row.get("measured"), row["predicted"]
        measured = f"{got['total_gb']:.2f}" if got and "total_gb" in got else "prediction only"
        saved = (f"{got['saved_activations'] / perf_model.GIB:.2f} / " if got and "total_gb" in got else "- / ") + \
            f"{model['saved_activations'] / perf_model.GIB:.2f}"
        total = f"{model['total_gb']:.2f}"
        lines.append(f"| {row['tp']} | {row['cp']} | {row['method']} | {measured} | {total} | {saved} |")
    return "\n".join(lines)


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="run the dry runs of MEASURED (minutes each)")
    parser.add_argument("--only", default="", help="with --measure: 'tp,cp,method' of one layout to measure")
    parser.add_argument("--out", default="bench_results/cp_memory.json")
    args = parser.parse_args(argv)
    old = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = {(row["tp"], row["cp"], row["method"]): row for row in json.load(f)["rows"]}
    to_measure = MEASURED if args.measure else []
    if args.only:
        tp, cp, method = args.only.split(",")
        to_measure = [(int(tp), int(cp), method)]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for tp, cp, method, refusal in layouts():
            row = {"tp": tp, "cp": cp, "method": method, "ranks": tp * cp}
            if refusal:
                rows.append({**row, "refused": refusal})
                continue
            row["predicted"] = predicted(tp, cp, method)
            if (tp, cp, method) in to_measure:
                print(f"dry runs of tp={tp} x cp={cp} {method} at depth 1 and 2 ...", flush=True)
                row["measured"] = {**measure(tp, cp, method, folder), "machine": machine(),
                                   "torch": torch.__version__, "date": datetime.date.today().isoformat()}
                print(f"  {row['measured'].get('total_gb', row['measured'].get('error'))}", flush=True)
            elif old.get((tp, cp, method), {}).get("measured"):
                row["measured"] = old[(tp, cp, method)]["measured"]
            rows.append(row)
            write_json(args.out, {"config": CONFIG, "local_batch_size": 1, "amp_mode": "none", "rows": rows})
    write_json(args.out, {"config": CONFIG, "local_batch_size": 1, "amp_mode": "none", "rows": rows})
    print(markdown(rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
