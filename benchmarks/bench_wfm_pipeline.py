"""`wfm_tiny` trained one epoch serially and through pipeline stages on CPU ranks: the validation loss, and how far each
run's weights are from the serial run's (as benchmarks/bench_wfm_methods.py does for the cp methods).

    python -m benchmarks.bench_wfm_pipeline [--data_dir data/era5_wfm_tiny] [--out bench_results/wfm_pipeline.json]

Runs `train.py --config wfm_tiny` and `torchrun --nproc_per_node N train_mp.py --config wfm_tiny
--pipeline_parallel P ...` at pp=2 with GPipe and 4 microbatches, pp=4 with 1F1B and 8 (one sample each), and
pp=2 x cp=2 with the ring, 1F1B and 2 (gloo), one epoch each (32 steps of batch 8), and compares each run's final
checkpoint (the serial model's weights, gathered from the stages) with the serial run's. About 5 minutes on 2 cores.
"""
import datetime
import os
import subprocess
import sys
import tempfile

import torch

from benchmarks.bench_wfm_methods import largest_difference, run, summary
from benchmarks.common import machine
from utils.atomic import write_json
from utils.errors import ArgumentParser

# (ranks, pp, schedule, microbatches, more flags)
LAYOUTS = ((2, 2, "gpipe", 4, ()), (4, 4, "1f1b", 8, ()), (4, 2, "1f1b", 2, ("--context_parallel", "2",
                                                                            "--cp_method", "ring")))


def name_of(pp, schedule, microbatches, more):
    cp = f" x cp={more[1]} {more[3]}" if more else ""
    return f"pp={pp}{cp}, {schedule}, {microbatches} microbatches"


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default="data/era5_wfm_tiny")
    parser.add_argument("--iters", type=int, default=32, help="training steps of each run (32: one epoch)")
    parser.add_argument("--out", default="bench_results/wfm_pipeline.json")
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(args.data_dir, "train")):
        print(f"writing 25 x 48 sample data to {args.data_dir} ...", flush=True)
        subprocess.run([sys.executable, "-m", "sample_data", "era5", "--out", args.data_dir, "--height", "25",
                        "--width", "48"], check=True)
    common = ["--config", "wfm_tiny", "--data_dir", args.data_dir, "--num_iters", str(args.iters)]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        print(f"serial: python train.py --config wfm_tiny --num_iters {args.iters} ...", flush=True)
        run([sys.executable, "train.py", *common, "--expdir", os.path.join(work, "serial")],
            os.path.join(work, "serial.log"))
        serial_loss, serial = summary(os.path.join(work, "serial", "wfm_tiny", "1GPU", "00"))
        print(f"  validation loss {serial_loss:.4f}", flush=True)
        for index, (ranks, pp, schedule, microbatches, more) in enumerate(LAYOUTS):
            flags = ["--pipeline_parallel", str(pp), "--pp_schedule", schedule, "--num_microbatches",
                     str(microbatches), *more]
            print(f"{name_of(pp, schedule, microbatches, more)}: torchrun --nproc_per_node {ranks} train_mp.py "
                  f"--config wfm_tiny {' '.join(flags)} ...", flush=True)
            expdir = os.path.join(work, str(index))
            run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                 "train_mp.py", *common, *flags, "--expdir", expdir], os.path.join(work, f"{index}.log"))
            run_dir = next(os.path.join(root, "00") for root, dirs, _ in os.walk(expdir) if "00" in dirs)
            loss, weights = summary(run_dir)
            difference, name = largest_difference(weights, serial)
            rows.append({"layout": name_of(pp, schedule, microbatches, more), "ranks": ranks, "pp": pp,
                         "schedule": schedule, "microbatches": microbatches, "flags": " ".join(flags),
                         "val_loss": loss, "largest_weight_difference": difference, "largest_in": name})
            print(f"  validation loss {loss:.4f}; weights within {difference:.1e} of the serial run's (largest: "
                  f"{name})", flush=True)
    write_json(args.out, {"machine": machine(), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                          "config": "wfm_tiny", "iters": args.iters, "serial_val_loss": serial_loss, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
