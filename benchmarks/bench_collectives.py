"""Bus bandwidth of the collectives the lessons use, between the ranks of this node, at the sizes the lessons send.

    torchrun --nproc_per_node 4 -m benchmarks.bench_collectives --out collectives.json     # 4 GPUs (NCCL)
    CUDA_VISIBLE_DEVICES= torchrun --nproc_per_node 2 -m benchmarks.bench_collectives --scale 0.01 --out c.json

The ranks meet as the training scripts' do (utils/comm.init: NCCL on GPUs, gloo on CPUs) and run the
collectives the lessons run, through the same functions: DDP's gradient all-reduce at its two bucket sizes
(`--bucket_cap_mb 25` and `5`), the all-reduce of a tensor-parallel block's exit, and context parallelism's
all-gather of keys (or values) and the reduce-scatter of their gradients (distributed/helpers.py: `gather`,
`reduce_scatter`; gloo has no reduce-scatter, so there it is an all-reduce and a slice), the last three at the `mp`
config's sizes (local batch 16, 4,050 tokens of 1,024). `--scale` shrinks every message (a CPU check).

Bus bandwidth is nccl-tests' figure, comparable across rank counts and with a link's speed: the bytes of the
message over the time, times 2 (n - 1) / n for an all-reduce and (n - 1) / n for an all-gather (of its output) or a
reduce-scatter (of its input): what each rank's link carried, a second. Beside it, on a GPU the performance model
(planning/perf_model.py) knows, is the model's figure for a group inside one node: its NVLink constant for a pair of
GPUs times its network efficiency.
"""
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from resilience.exits import exit_on_user_error
from utils.atomic import write_json
from utils.errors import ArgumentParser

MP_ACTIVATION = 16 * 4050 * 1024  # the mp config's (local batch 16) activations of one block: values
MESSAGES = (  # (what, op, dtype, values)
    ("DDP gradient bucket, --bucket_cap_mb 25", "all_reduce", torch.float32, 25 * 2 ** 20 // 4),
    ("DDP gradient bucket, --bucket_cap_mb 5", "all_reduce", torch.float32, 5 * 2 ** 20 // 4),
    ("tp: a block's exit (mp, local batch 16, fp16)", "all_reduce", torch.float16, MP_ACTIVATION),
    ("cp: the keys gathered (mp, local batch 16)", "all_gather", torch.float32, MP_ACTIVATION),
    ("cp: the keys' gradients scattered (mp, local batch 16)", "reduce_scatter", torch.float32, MP_ACTIVATION),
)
WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n}


def collective(op, values, dtype, device, ranks):
    """A function running `op` once on a message of `values` (the gathered output, the scattered input)."""
    from distributed.helpers import gather, reduce_scatter
    if op == "all_reduce":
        tensor = torch.ones(values, dtype=dtype, device=device)
        return lambda: dist.all_reduce(tensor)
    chunk = values // ranks
    if op == "all_gather":
        mine = torch.ones(chunk, dtype=dtype, device=device)
        return lambda: gather(mine, 0, None, "dp")
    whole = torch.ones(chunk * ranks, dtype=dtype, device=device)
    return lambda: reduce_scatter(whole, 0, None, "dp")


def measure(run, device, warmup, repeats):
    """Median seconds of `run` over `repeats` calls after `warmup`, the ranks lined up before each."""
    for _ in range(warmup):
        run()
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(seconds)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the collective is as fast as its slowest rank
    return slowest.item()


def model_bus_bandwidth(device):
    """The performance model's bus bandwidth inside a node of this GPU (bytes/s), or None (a CPU, an unknown GPU)."""
    from planning.dry_run import system_of
    from planning.perf_model import EFFICIENCY, SYSTEMS
    system = system_of(device)
    return SYSTEMS[system].nvlink_pair * EFFICIENCY["network"] if system else None


@exit_on_user_error
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON report (rank 0 writes it)")
    parser.add_argument("--scale", type=float, default=1.0, help="every message times this (default 1)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 1:
        parser.error(f"--scale is {args.scale}; give a fraction in (0, 1]")
    from utils import comm
    from utils.logging_utils import config_logger
    config_logger()
    comm.init()
    ranks, rank = comm.get_world_size(), comm.get_world_rank()
    if ranks < 2:
        parser.error("one rank has no one to talk to: start 2 or more (torchrun --nproc_per_node N)")
    device = comm.get_device()
    model = model_bus_bandwidth(device)
    rows = []
    for what, op, dtype, values in MESSAGES:
        values = max(ranks, int(values * args.scale) // ranks * ranks)
        seconds = measure(collective(op, values, dtype, device, ranks), device, args.warmup, args.repeats)
        nbytes = values * torch.tensor([], dtype=dtype).element_size()
        bus = nbytes / seconds * WIRE[op](ranks)
        rows.append({"what": what, "op": op, "bytes": nbytes, "seconds": seconds, "bus_bandwidth_gb_s": bus / 1e9,
                     "model_bus_bandwidth_gb_s": model / 1e9 if model else None})
        if rank == 0:
            print(f"{what}: {op} of {nbytes / 2 ** 20:.1f} MiB in {seconds * 1e3:.2f} ms, bus bandwidth "
                  f"{bus / 1e9:.2f} GB/s" + (f" (model: {model / 1e9:.0f} GB/s)" if model else ""), flush=True)
    report = {"ranks": ranks, "backend": dist.get_backend(), "device": str(device), "scale": args.scale,
              "messages": rows}
    if rank == 0:
        write_json(args.out, report)
        print(json.dumps({"written": args.out}), flush=True)
    comm.destroy()
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
