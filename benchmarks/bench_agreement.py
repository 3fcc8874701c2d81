"""Benchmark: what the ranks' agreement on a stop signal costs each training step, before and after, on CPU ranks.

    python -m benchmarks.bench_agreement [--ranks 2 8 16] [--step_ms 20] [--steps 200]
                                         [--out bench_results/stop_agreement.json]

Each of N processes (gloo over TCP on this machine, as on a cluster's host side) runs `--steps` stand-in steps: the
host sleeps `--step_ms` (a GPU step the host waits for; the sleep leaves the cores to the other ranks), then asks the
step boundary's question. Two ways, each timed around the question alone on every rank:
  blocking   the agreement as it was: one all-reduce over every rank, waited for at every boundary
             (resilience.host.max_over_ranks_on_host)
  in loop    lifecycle/signals.agreed_in_loop: start this boundary's all-reduce, read the one started
             AGREEMENT_LAG boundaries before (finished during the steps in between)
The JSON has, per N, the time per step of each (mean over ranks and steps, the median, the 99th percentile and the
worst), and whether every rank stopped at the same boundary when rank N-1 received SIGUSR1 at step `--steps` / 2
(both ways must; the in-loop one AGREEMENT_LAG boundaries later). On a machine with fewer cores than ranks the
blocking numbers include the operating system's scheduling of the ranks, as a cluster's include the ranks' skew.
"""
import datetime
import os
import signal
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import cpu_cores, free_port
from utils.atomic import write_json
from utils.errors import ArgumentParser


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def ways():
    """The questions a boundary can ask: the two agreements, and (the tests' twin) each rank alone on its own flag."""
    from lifecycle import signals
    return {"blocking": signals.agreed, "in loop": signals.agreed_in_loop, "alone": signals.received}


def rank_main(rank, world, port, step_s, steps, results, asked=("blocking", "in loop")):
    """One rank: each way of `asked` in turn, `steps` steps with a signal at steps // 2 on the last rank; puts (rank,
    {way: (seconds per question, boundary it stopped at)}) on `results`."""
    from lifecycle import signals
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)  # a gloo world: comm's host group is the world
    found = {}
    for way in asked:
        question = ways()[way]
        signals.install()
        dist.barrier()
        seconds, stopped_at = [], None
        for step in range(1, steps + 1):
            time.sleep(step_s)
            if step == steps // 2 and rank == world - 1:
                os.kill(os.getpid(), signal.SIGUSR1)  # recorded by the handler: this rank's flag is set
            start = time.perf_counter()
            stop = bool(question())
            seconds.append(time.perf_counter() - start)
            if stop and stopped_at is None:
                stopped_at = step  # the run would stop here; the benchmark goes on timing
        signals.settle()
        signals.uninstall()
        found[way] = (seconds, stopped_at)
    results.put((rank, found))
    dist.barrier()
    dist.destroy_process_group()


def measure(world, step_s, steps, asked=("blocking", "in loop")):
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=rank_main, args=(rank, world, port, step_s, steps, results, asked))
                 for rank in range(world)]
    for process in processes:
        process.start()
    found = dict(results.get(timeout=600) for _ in processes)
    for process in processes:
        process.join(timeout=120)
        if process.exitcode != 0:
            raise RuntimeError(f"rank {processes.index(process)} of {world} ended with {process.exitcode}")
    row = {"ranks": world}
    for way in asked:
        per_question = [1e3 * s for rank in found for s in found[rank][way][0]]
        stops = {found[rank][way][1] for rank in found}
        row[way] = {"ms_per_step": {"mean": statistics.fmean(per_question), "median": statistics.median(per_question),
                                    "p99": percentile(per_question, 0.99), "max": max(per_question)},
                    "stopped_at": sorted(stops, key=lambda x: (x is None, x)),
                    "same_stop_on_every_rank": len(stops) == 1}
    return row


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--step_ms", type=float, default=20.0, help="the stand-in step (host asleep)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="bench_results/stop_agreement.json")
    args = parser.parse_args(argv)
    if min(args.ranks) < 2 or args.steps < 4 or args.step_ms < 0:
        parser.error("--ranks must be at least 2, --steps at least 4, --step_ms at least 0")
    from lifecycle.signals import AGREEMENT_LAG
    rows = []
    for world in args.ranks:
        row = measure(world, args.step_ms / 1e3, args.steps)
        rows.append(row)
        print(f"[bench_agreement] {world} ranks: blocking {row['blocking']['ms_per_step']['mean']:.3f} ms a step "
              f"(p99 {row['blocking']['ms_per_step']['p99']:.3f}), in loop {row['in loop']['ms_per_step']['mean']:.3f}"
              f" (p99 {row['in loop']['ms_per_step']['p99']:.3f}); stopped at {row['blocking']['stopped_at']} and "
              f"{row['in loop']['stopped_at']}", flush=True)
    write_json(args.out, {"machine": cpu_cores(), "torch": torch.__version__,
                          "date": datetime.date.today().isoformat(), "step_ms": args.step_ms, "steps": args.steps,
                          "signal_at_step": args.steps // 2, "agreement_lag": AGREEMENT_LAG, "rows": rows})
    print(f"[bench_agreement] written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
