"""`wfm_tiny` (the 0.25-degree family's CPU model) trained one epoch serially and with each context-parallel method on
4 CPU ranks: the validation loss, and how far each run's weights are from the serial run's.

    python -m benchmarks.bench_wfm_methods [--data_dir data/era5_wfm_tiny] [--out bench_results/wfm_methods.json]

Runs `train.py --config wfm_tiny` and `torchrun --nproc_per_node 4 train_mp.py --config wfm_tiny --context_parallel 4
--cp_method M` for M in allgather, ring, alltoall (gloo; each cp rank reads its band of image rows), one epoch each
(32 steps of batch 8), and compares each run's final checkpoint (the serial model's weights) with the serial run's:
the largest absolute difference of a weight, max |w - w_serial| (the weights are of order 0.02 to 1). The data are
generated first if the folder has none (25 x 48 sample files, read as 24 x 48). About 5 minutes on 2 cores.
"""
import datetime
import os
import re
import subprocess
import sys
import tempfile

import torch

from benchmarks.common import machine
from lifecycle.checkpoint import read_as_data
from utils.atomic import write_json
from utils.errors import ArgumentParser

METHODS = ("allgather", "ring", "alltoall")
CP = 4


def run(argv, log):
    """Run a training command; its output goes to `log`; a failure ends the benchmark with its last line."""
    with open(log, "w") as out:
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        with open(log) as f:
            last = f.read().strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"error: {' '.join(argv[:8])} ... failed: {last[0]}")


def summary(run_dir):
    """(validation loss of the last epoch, the model's weights) of a finished run."""
    with open(os.path.join(run_dir, "out.log")) as f:
        losses = re.findall(r"Avg val loss=([0-9.]+)", f.read())
    weights = read_as_data(os.path.join(run_dir, "checkpoints", "ckpt.pt"))["model"]
    return float(losses[-1]), weights


def largest_difference(weights, serial):
    """(the largest absolute difference of a weight from the serial run's, the tensor it is in)."""
    return max(((weights[name].float() - value.float()).abs().max().item(), name) for name, value in serial.items())


def prepare(argv, description, out):
    """The flags of this benchmark and of bench_wfm_pipeline.py, the sample data (written if the folder has none):
    (args, the training flags every run shares)."""
    parser = ArgumentParser(description=description)
    parser.add_argument("--data_dir", default="data/era5_wfm_tiny")
    parser.add_argument("--iters", type=int, default=32, help="training steps of each run (32: one epoch)")
    parser.add_argument("--out", default=out)
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(args.data_dir, "train")):
        print(f"writing 25 x 48 sample data to {args.data_dir} ...", flush=True)
        subprocess.run([sys.executable, "-m", "sample_data", "era5", "--out", args.data_dir, "--height", "25",
                        "--width", "48"], check=True)
    return args, ["--config", "wfm_tiny", "--data_dir", args.data_dir, "--num_iters", str(args.iters)]


def serial_run(work, common, iters):
    """train.py's run in `work`: (its validation loss, its weights)."""
    print(f"serial: python train.py --config wfm_tiny --num_iters {iters} ...", flush=True)
    run([sys.executable, "train.py", *common, "--expdir", os.path.join(work, "serial")],
        os.path.join(work, "serial.log"))
    loss, weights = summary(os.path.join(work, "serial", "wfm_tiny", "1GPU", "00"))
    print(f"  validation loss {loss:.4f}", flush=True)
    return loss, weights


def compared(run_dir, serial):
    """{val_loss, largest_weight_difference, largest_in} of a finished run against the serial weights, printed."""
    loss, weights = summary(run_dir)
    difference, name = largest_difference(weights, serial)
    print(f"  validation loss {loss:.4f}; weights within {difference:.1e} of the serial run's (largest: {name})",
          flush=True)
    return {"val_loss": loss, "largest_weight_difference": difference, "largest_in": name}


def write_report(args, serial_loss, rows):
    write_json(args.out, {"machine": machine(), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                          "config": "wfm_tiny", "iters": args.iters, "serial_val_loss": serial_loss, "rows": rows})
    print(f"wrote {args.out}")


def main(argv=None):
    args, common = prepare(argv, __doc__.splitlines()[0], "bench_results/wfm_methods.json")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        serial_loss, serial = serial_run(work, common, args.iters)
        for method in METHODS:
            print(f"cp={CP} {method}: torchrun --nproc_per_node {CP} train_mp.py --config wfm_tiny --context_parallel "
                  f"{CP} --cp_method {method} ...", flush=True)
            run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(CP),
                 "train_mp.py", *common, "--context_parallel", str(CP), "--cp_method", method, "--expdir",
                 os.path.join(work, method)], os.path.join(work, f"{method}.log"))
            rows.append({"method": method, "cp": CP,
                         **compared(os.path.join(work, method, "wfm_tiny", f"{CP}MP", "00"), serial)})
    write_report(args, serial_loss, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
