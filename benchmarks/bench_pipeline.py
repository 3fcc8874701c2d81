"""The pipeline's idle time and the activations it holds, measured on the real schedules (distributed/pipeline.py),
against the bubble formula (P - 1) / (M + P - 1).

    python -m benchmarks.bench_pipeline [--stages 2,4] [--forward_ms 10] [--out bench_results/pipeline_bubble.json]

P gloo ranks run pipeline.gpipe and pipeline.one_f_one_b through Pipeline.forward_backward for M = P, 2P, 3P, 4P
microbatches. Each stage's work is a sleep: forward_ms a microbatch forward, twice that backward (a block's backward
is about twice its forward). A sleeping rank uses no core, so P ranks on a 2-core machine behave like P devices,
and what is measured is the schedule's own idle time, not the CPU's sharing. Per stage and step: the share of the
step (from a barrier to the step's end) the stage spent outside its forwards and backwards, the median of
--steps steps after one warm-up; and the most microbatches whose activations the stage held at once. The formula
counts compute alone: each exchange's own time (a millisecond or two on gloo) adds to the measured share. Checked
(tests/perf/test_pipeline_bubble.py): the idle share within 0.05 of the formula for every stage, both schedules;
GPipe holds M on every stage, 1F1B P - s on stage s.
"""
import argparse
import datetime
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import free_port, machine
from distributed import pipeline
from utils.atomic import write_json
from utils.layout import Axis, Grid, Layout

TOKENS, WIDTH, MICRO_BATCH = 16, 8, 1  # what crosses between stages each microbatch: (1, 16, 8) fp32


class Sleep(torch.autograd.Function):
    """x * w, after sleeping `forward_s`; its backward sleeps `backward_s`."""

    @staticmethod
    def forward(ctx, x, w, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum().reshape(w.shape), None, None


class SleepingStage(torch.nn.Module):
    def __init__(self, forward_s):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.forward_s = forward_s

    def forward(self, x):
        return Sleep.apply(x, self.w, self.forward_s, 2 * self.forward_s)


class TimedPipeline(pipeline.Pipeline):
    """A Pipeline that adds up the seconds its stage spends in forwards and backwards."""

    busy = 0.0

    def _timed(self, work, *args):
        start = time.perf_counter()
        try:
            return work(*args)
        finally:
            self.busy += time.perf_counter() - start

    def forward_one(self, *args):
        return self._timed(super().forward_one, *args)

    def backward_one(self, *args):
        return self._timed(super().backward_one, *args)


def bubble(stages, microbatches):
    """The share of a step each stage waits, for GPipe and 1F1B alike (equal stages, no transfer time)."""
    return (stages - 1) / (microbatches + stages - 1)


def _rank(rank, world, port, forward_s, steps, results, warmup_offset, multiples):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    pipeline.WARMUP_OFFSET = warmup_offset  # 0; the tests' twin: 1F1B with one warm-up step too many
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    raw = SimpleNamespace(sequence_shapes=None, cp_shapes=[TOKENS], cp=Axis("cp"), tp=Axis("tp"), embed_dim=WIDTH)
    rows = []
    for microbatches in (k * world for k in multiples):
        for schedule in ("gpipe", "1f1b"):
            layout = Layout(pp=world, microbatches=microbatches, pp_schedule=schedule)
            grid = Grid(layout, {"pp": Axis("pp", world, rank, dist.group.WORLD)})
            pipe = TimedPipeline(SleepingStage(forward_s), raw, grid)
            inp = torch.randn(microbatches * MICRO_BATCH, TOKENS, WIDTH)
            shares = []
            for step in range(steps + 1):
                dist.barrier()
                pipe.busy, start = 0.0, time.perf_counter()
                pipe.forward_backward(inp, inp, lambda y, tar: y.mean(), torch.autocast("cpu", enabled=False),
                                      lambda loss: loss)
                if step:  # the first is the warm-up
                    shares.append(1 - pipe.busy / (time.perf_counter() - start))
            rows.append({"stages": world, "microbatches": microbatches, "schedule": schedule, "stage": rank,
                         "idle_share": statistics.median(shares), "idle_share_range": [min(shares), max(shares)],
                         "in_flight": pipe.peak_in_flight})
    results[rank] = rows
    dist.destroy_process_group()


def measure(stages, forward_ms, steps, warmup_offset=0, multiples=(1, 2, 3, 4)):
    """Every stage's rows for each P of `stages`, at M = each of `multiples` times P."""
    rows = []
    for world in stages:
        print(f"[bench_pipeline] P = {world}: M = {world}..{4 * world}, gpipe and 1f1b, {steps} steps each",
              flush=True)
        results = mp.Manager().dict()
        mp.spawn(_rank, args=(world, free_port(), forward_ms / 1000, steps, results, warmup_offset, multiples),
                 nprocs=world)
        for rank in range(world):
            rows += results[rank]
    for row in rows:
        row["formula"] = bubble(row["stages"], row["microbatches"])
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="2,4", help="pipeline sizes P, comma-separated")
    parser.add_argument("--forward_ms", type=float, default=25.0, help="a stage's forward of one microbatch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument("--out", default=None, help="JSON to write")
    args = parser.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    rows = measure([int(p) for p in args.stages.split(",")], args.forward_ms, args.steps)
    for row in rows:
        print(f"P={row['stages']} M={row['microbatches']:2d} {row['schedule']:5s} stage {row['stage']}: idle "
              f"{row['idle_share']:.3f} (formula {row['formula']:.3f}), activations in flight {row['in_flight']}")
    if args.out:
        write_json(args.out, {"made_by": "python -m benchmarks.bench_pipeline " + " ".join(sys.argv[1:] if argv is None
                                                                                         else argv),
                              "machine": machine(), "torch": torch.__version__,
                              "date": datetime.date.today().isoformat(), "forward_ms": args.forward_ms,
                              "backward_ms": 2 * args.forward_ms, "rows": rows})
        print(f"[bench_pipeline] wrote {args.out}")


if __name__ == "__main__":
    main()
