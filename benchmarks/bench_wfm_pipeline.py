"""`wfm_tiny` trained one epoch serially and through pipeline stages on CPU ranks: the validation loss, and how far each
run's weights are from the serial run's (as benchmarks/bench_wfm_methods.py does for the cp methods).

    python -m benchmarks.bench_wfm_pipeline [--data_dir data/era5_wfm_tiny] [--out bench_results/wfm_pipeline.json]

Runs `train.py --config wfm_tiny` and `torchrun --nproc_per_node N train_mp.py --config wfm_tiny
--pipeline_parallel P ...` at pp=2 with GPipe and 4 microbatches, pp=4 with 1F1B and 8 (one sample each), and
pp=2 x cp=2 with the ring, 1F1B and 2 (gloo), one epoch each (32 steps of batch 8), and compares each run's final
checkpoint (the serial model's weights, gathered from the stages) with the serial run's. About 5 minutes on 2 cores.
"""
import os
import sys
import tempfile

from benchmarks.bench_wfm_methods import compared, prepare, run, serial_run, write_report

# (ranks, pp, schedule, microbatches, more flags)
LAYOUTS = ((2, 2, "gpipe", 4, ()), (4, 4, "1f1b", 8, ()), (4, 2, "1f1b", 2, ("--context_parallel", "2",
                                                                            "--cp_method", "ring")))


def name_of(pp, schedule, microbatches, more):
    cp = f" x cp={more[1]} {more[3]}" if more else ""
    return f"pp={pp}{cp}, {schedule}, {microbatches} microbatches"


def main(argv=None):
    args, common = prepare(argv, __doc__.splitlines()[0], "bench_results/wfm_pipeline.json")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        serial_loss, serial = serial_run(work, common, args.iters)
        for index, (ranks, pp, schedule, microbatches, more) in enumerate(LAYOUTS):
            flags = ["--pipeline_parallel", str(pp), "--pp_schedule", schedule, "--num_microbatches",
                     str(microbatches), *more]
            print(f"{name_of(pp, schedule, microbatches, more)}: torchrun --nproc_per_node {ranks} train_mp.py "
                  f"--config wfm_tiny {' '.join(flags)} ...", flush=True)
            expdir = os.path.join(work, str(index))
            run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                 "train_mp.py", *common, *flags, "--expdir", expdir], os.path.join(work, f"{index}.log"))
            run_dir = next(os.path.join(root, "00") for root, dirs, _ in os.walk(expdir) if "00" in dirs)
            rows.append({"layout": name_of(pp, schedule, microbatches, more), "ranks": ranks, "pp": pp,
                         "schedule": schedule, "microbatches": microbatches, "flags": " ".join(flags),
                         **compared(run_dir, serial)})
    write_report(args, serial_loss, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
