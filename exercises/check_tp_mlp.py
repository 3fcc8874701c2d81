"""Check the tensor-parallel MLP of exercises/tp_mlp_exercise.py against the serial MLP of networks/vit.py.

    python -m exercises.check_tp_mlp [--nproc N] [--solution]

Spawns N processes (NCCL on GPUs when CUDA is present and N <= the number of GPUs, else gloo on CPU), makes a
"tp" group of all of them, and on every rank builds the same serial MLP (dim 32, hidden 128, seed 0), the
exercise's ExerciseMLP loaded with load_serial, a random input (batch 4, sequence 10) and a random output
gradient. Forward and backward on both; the relative Frobenius errors of the output, the input gradient and
each weight gradient (against this rank's shard of the serial one), the worst over the ranks, must all be
<= 1e-5. Prints them, then PASSED (exit 0) or FAILED with the TODO to look at (exit 1); sizes that cannot
work end in one error line (exit 2). `check(module_name, nproc)` returns the errors, for tests
(`check_modules` several modules' in one set of processes).
"""
import datetime
import importlib
import math
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from resilience.exits import exit_on_user_error
from utils import comm
from utils.errors import ArgumentParser, UserError

EXERCISE, SOLUTION = "exercises.tp_mlp_exercise", "exercises.tp_mlp_solution"
BATCH, SEQ, DIM, HIDDEN = 4, 10, 32, 128
TOLERANCE = 1e-5
COLLECTIVE_TIMEOUT = 120  # seconds: a rank stuck in a collective its peers never join fails instead of hanging
WEIGHTS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _use_nccl(nproc):
    return torch.cuda.is_available() and nproc <= torch.cuda.device_count()


def rel_error(value, reference):
    """||value - reference|| / ||reference|| (Frobenius); inf when value is missing or has the wrong shape."""
    if value is None or value.shape != reference.shape:
        return math.inf
    return ((value - reference).norm() / reference.norm()).item()


def _serial_shards(serial, rank, size):
    """This rank's part of each serial weight gradient: fc1 rows (column-parallel), fc2 columns (row-parallel),
    fc2's whole bias."""
    grads = {name: param.grad for name, param in serial.named_parameters()}
    return {"fc1.weight": torch.chunk(grads["fc1.weight"], size, dim=0)[rank],
            "fc1.bias": torch.chunk(grads["fc1.bias"], size, dim=0)[rank],
            "fc2.weight": torch.chunk(grads["fc2.weight"], size, dim=1)[rank],
            "fc2.bias": grads["fc2.bias"]}


def _compare(module_name, device):
    """This rank's relative errors of the module's ExerciseMLP against the serial MLP."""
    from networks.vit import MLP
    torch.manual_seed(0)  # the same serial weights, input and output gradient on every rank
    serial = MLP(DIM, HIDDEN).to(device)
    x = torch.randn(BATCH, SEQ, DIM).to(device)
    grad_out = torch.randn(BATCH, SEQ, DIM).to(device)
    x_serial = x.clone().requires_grad_()
    out_serial = serial(x_serial)
    out_serial.backward(grad_out)

    parallel = importlib.import_module(module_name).ExerciseMLP(DIM, HIDDEN, comm_name="tp").to(device)
    parallel.load_serial(serial)
    x_parallel = x.clone().requires_grad_()
    out_parallel = parallel(x_parallel)
    out_parallel.backward(grad_out)

    errors = {"output": rel_error(out_parallel.detach(), out_serial.detach()),
              "input grad": rel_error(x_parallel.grad, x_serial.grad)}
    grads = {name: param.grad for name, param in parallel.named_parameters()}
    for name, reference in _serial_shards(serial, comm.get_rank("tp"), comm.get_size("tp")).items():
        errors[name] = rel_error(grads.get(name), reference)
    return errors


def _worker(rank, nproc, port, module_names, queue):
    torch.set_num_threads(1)  # N processes share the cores
    nccl = _use_nccl(nproc)
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls: the 1e-5 tolerance assumes them
    # the checker starts its own processes, so it joins them itself (comm.init would pick NCCL for any N on GPUs)
    dist.init_process_group("nccl" if nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=nproc, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        comm.init({"tp": nproc})  # the named groups on this process group: tensor parallelism over every rank
        results = {}
        for module_name in module_names:
            errors = _compare(module_name, device)
            # the worst over the ranks (a wrong shard may be right on rank 0 only); NaN counts as the worst
            worst = torch.tensor([v if v == v else math.inf for v in errors.values()], device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            results[module_name] = dict(zip(errors, worst.tolist()))
        if rank == 0:
            queue.put(results)
    finally:
        comm.destroy()  # forgets the named groups too (a group still referenced keeps gloo's threads alive)


def _validate(nproc):
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise UserError(f"--nproc is {nproc!r}; give a whole number of processes, at least 1")
    if HIDDEN % nproc:
        raise UserError(f"the MLP's hidden width {HIDDEN} does not divide over --nproc {nproc} ranks (each keeps an "
                        f"equal slice); choose a divisor of {HIDDEN}, e.g. 2, 4 or 8")


def check(module_name=EXERCISE, nproc=2):
    """Relative errors of `module_name`.ExerciseMLP on `nproc` ranks against the serial MLP, the worst over the
    ranks: {"output", "input grad", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}."""
    return check_modules([module_name], nproc)[module_name]


def check_modules(module_names, nproc=2):
    """check() of several modules in one set of processes (starting them is most of the time): {name: errors}."""
    _validate(nproc)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(nproc, _free_port(), list(module_names), queue), nprocs=nproc)
    return queue.get()


def _hints(errors):
    """What each error above the tolerance points to."""
    hints = []
    if not errors["output"] <= TOLERANCE:
        hints.append("output: check which rows of fc1 / columns of fc2 this rank keeps (TODO 1), and that fc2's "
                     "partial products are summed over the ranks with the bias added once, after the sum (TODO 3)")
    if not errors["input grad"] <= TOLERANCE:
        hints.append("input gradient: the gradient of x must be summed over the ranks on the way back (TODO 2)")
    bad = [name for name in WEIGHTS if not errors[name] <= TOLERANCE]
    if bad:
        hints.append(f"weight gradients ({', '.join(bad)}): check the slices of TODO 1 (rank r keeps the r-th block)")
    return hints


@exit_on_user_error
def main(argv=None):
    parser = ArgumentParser(description="Check the tensor-parallel MLP exercise against the serial MLP.")
    parser.add_argument("--nproc", type=int, default=2, help="number of processes (ranks of the tp group)")
    parser.add_argument("--solution", action="store_true", help=f"check {SOLUTION} instead of {EXERCISE}")
    args = parser.parse_args(argv)
    _validate(args.nproc)
    module_name = SOLUTION if args.solution else EXERCISE
    backend = "nccl, GPUs" if _use_nccl(args.nproc) else "gloo, CPU"
    ranks = f"{args.nproc} rank{'s' if args.nproc > 1 else ''}"
    print(f"checking {module_name}.ExerciseMLP against the serial MLP on {ranks} ({backend})", flush=True)
    errors = check(module_name, args.nproc)
    worst_weight = max(WEIGHTS, key=lambda name: errors[name])
    print(f"final relative error of output in mlp: {errors['output']:.3e}")
    print(f"final relative error of gradients in mlp: {errors['input grad']:.3e}")
    print(f"worst relative error of weight gradients in mlp: {errors[worst_weight]:.3e} ({worst_weight})")
    hints = _hints(errors)
    if not hints:
        print("PASSED")
        return 0
    print(f"FAILED: above {TOLERANCE:g} (worst over the {ranks}) - " + "; ".join(hints))
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
