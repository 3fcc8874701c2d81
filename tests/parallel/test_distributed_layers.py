"""The hand-written tp/cp layers against the serial layers, and against PyTorch's own DTensor (tensor parallelism,
and sequence parallelism with the tokens sharded in and out, with a twin: the bias gradient left unsummed over tp).

In the style of the original tutorial's tests: a serial layer and its distributed version hold the same weights
(the distributed one its shard), see the same input (the distributed one its sequence chunk) and the same output
gradient; the outputs, the input gradients and every weight gradient (summed over the groups in
`mark_for_reduction`) must agree to a relative Frobenius error of 1e-5 in fp32, for tp, cp and tp x cp, with even
and uneven sequence splits, on gloo (CPU). A failure points to distributed/mappings.py (a wrong backward),
distributed/helpers.py (uneven collectives) or distributed/layers.py (shards, bias handling, gathered keys/values).
"""

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import as_spawned_rank, free_port

TOLERANCE = 1e-5


def _set_grid(tp, cp):
    """Groups "tp", "cp", "tp-cp", "dp" of a tp x cp x dp grid in the order tp-cp-dp (tp fastest), on the process
    group the test started; returns dp."""
    from utils import comm
    comm.init({"tp": tp, "cp": cp, "order": "tp-cp-dp"})
    return comm.get_size("dp")


def rel_error(value, reference, floor=0.0):
    """||value - reference|| / max(||reference||, floor)."""
    return ((value - reference).norm() / max(reference.norm().item(), floor)).item()


def compare_layers(serial, distributed, x, grad_out, cp_shapes):
    """Relative errors of output, input gradient and each weight gradient; also the largest weight-gradient
    error without the cp reduction (to show the comparison can fail)."""
    from distributed.helpers import gather, reduce, split
    from utils import comm
    x_serial = x.clone().requires_grad_()
    out = serial(x_serial)
    out.backward(grad_out)
    x_local = split(x, 1, "cp").clone().requires_grad_()
    out_local = distributed(x_local)
    out_local.backward(split(grad_out, 1, "cp"))
    errors = {"output": rel_error(gather(out_local.detach(), 1, cp_shapes, "cp"), out.detach()),
              "input grad": rel_error(gather(x_local.grad, 1, cp_shapes, "cp"), x_serial.grad)}
    unreduced = 0.0
    reference = {name: p.grad for name, p in serial.named_parameters()}
    # relative to at least 1% of the layer's largest gradient: the key bias's gradient is zero in exact arithmetic
    # (softmax ignores a shift shared by all keys), so only rounding noise would be compared with rounding noise
    floor = 0.01 * max(grad.norm().item() for grad in reference.values())
    for name, param in distributed.named_parameters():
        grad = param.grad
        for group in param.mark_for_reduction:
            unreduced = max(unreduced, rel_error(grad, _shard_like(reference[_serial_name(name)], param, name), floor))
            grad = reduce(grad, group)
        errors[name] = rel_error(grad, _shard_like(reference[_serial_name(name)], param, name), floor)
    return errors, unreduced if comm.get_size("cp") > 1 else None


def _serial_name(name):
    return name.replace("norm.", "") if name.startswith("norm.") else name


def _shard_like(full, param, name):
    """The slice of a serial gradient that the distributed parameter `name` holds (tp shards of linears)."""
    from utils import comm
    tp, rank = comm.get_size("tp"), comm.get_rank("tp")
    if tp == 1 or full.numel() == param.numel():
        return full.reshape(param.shape)
    module = name.rsplit(".", 1)[0]
    row_parallel = module.endswith(("fc2", "proj"))
    if name.endswith("weight"):
        return torch.chunk(full, tp, dim=1 if row_parallel else 0)[rank]
    return torch.chunk(full, tp, dim=0)[rank].view(param.shape)


def _layer_cases(rank, world, port, layouts, results, device="cpu"):
    as_spawned_rank(rank, world, port, gpu=device == "cuda")
    from distributed.helpers import compute_split_shapes
    from distributed.layers import DistributedAttention, DistributedLayerNorm, DistributedMLP
    from networks.vit import MLP, Attention
    from utils import comm
    torch.set_num_threads(1)
    comm.init(rendezvous_timeout=60)
    out = {}
    for tp, cp, seq in layouts:
        _set_grid(tp, cp)
        embed, heads, batch = 16, 4, 2
        cp_shapes = compute_split_shapes(seq, cp)
        torch.manual_seed(0)  # the same serial weights, input and output gradient on every rank
        x, grad_out = torch.randn(batch, seq, embed).to(device), torch.randn(batch, seq, embed).to(device)
        cases = {"mlp": (MLP(embed, 4 * embed), DistributedMLP(embed, 4 * embed)),
                 "attention": (Attention(embed, heads), DistributedAttention(embed, num_heads=heads, qkv_bias=True,
                                                                            cp_shapes=cp_shapes)),
                 "layernorm": (torch.nn.LayerNorm(embed, eps=1e-6), DistributedLayerNorm(embed))}
        for label, (serial, distributed) in cases.items():
            serial, distributed = serial.to(device), distributed.to(device)
            with torch.no_grad():
                for p in serial.parameters():  # non-trivial norms and biases
                    p.add_(0.1 * torch.randn_like(p))
            distributed.load_serial(serial)
            out[(tp, cp, seq, label)] = compare_layers(serial, distributed, x, grad_out, cp_shapes)
    results[rank] = out
    comm.destroy()


def run_layouts(world, layouts, device="cpu"):
    results = mp.Manager().dict()
    mp.spawn(_layer_cases, args=(world, free_port(), layouts, results, device), nprocs=world)
    return dict(results)


def check(results):
    for rank, cases in results.items():
        for key, (errors, unreduced) in cases.items():
            assert max(errors.values()) <= TOLERANCE, (rank, key, errors)
            if unreduced is not None:  # with cp, the weight gradients are partial before the cp sum
                assert unreduced > 100 * TOLERANCE, (rank, key, unreduced)


@pytest.mark.multiprocess
def test_tp_and_cp_on_two_ranks_match_the_serial_layers():
    # (tp, cp, sequence length): tp alone; cp with an even and an uneven split
    check(run_layouts(2, [(2, 1, 8), (1, 2, 8), (1, 2, 9)]))


@pytest.mark.multiprocess
@pytest.mark.long
def test_tp_times_cp_on_four_ranks_matches_the_serial_layers():
    # 10 tokens over cp=4 split [3, 3, 3, 1] (uneven, gloo); tp=2 x cp=2 with an odd length; tp=4
    check(run_layouts(4, [(1, 4, 10), (2, 2, 9), (4, 1, 8)]))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL variant needs 2 GPUs (one per rank)")
def test_tp_and_cp_over_nccl_match_the_serial_layers():
    """The same comparisons on GPUs with NCCL (real reduce-scatter, padded uneven all-gathers; fp32 matmuls,
    TF32 being off by default)."""
    check(run_layouts(2, [(2, 1, 8), (1, 2, 9)], device="cuda"))


def _dtensor_cross_check(rank, world, port, results):
    as_spawned_rank(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from distributed.helpers import reduce, split
    from distributed.layers import DistributedMLP
    from distributed.mappings import gather_from_parallel_region, scatter_to_parallel_region
    from networks.vit import MLP
    from utils import comm
    torch.set_num_threads(1)
    comm.init(rendezvous_timeout=60)
    _set_grid(world, 1)  # tp over both ranks
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    # the mappings vs DTensor's redistribution
    ours = scatter_to_parallel_region(x, 2, "tp")
    theirs = distribute_tensor(x, mesh, [Shard(2)]).to_local()
    gathered = gather_from_parallel_region(ours, 2, None, "tp")
    replicated = distribute_tensor(x, mesh, [Shard(2)]).redistribute(mesh, [Replicate()]).to_local()
    # our DistributedMLP vs parallelize_module(fc1 colwise, fc2 rowwise) on the same serial weights
    serial = MLP(16, 64)
    reference = MLP(16, 64)
    reference.load_state_dict(serial.state_dict())
    ours_mlp = DistributedMLP(16, 64)
    ours_mlp.load_serial(serial)
    parallelize_module(reference, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours_mlp(x_ours), reference(x_theirs)
    y_ours.sum().backward()
    y_theirs.sum().backward()
    checks = {
        "scatter": torch.equal(ours, theirs), "gather": torch.equal(gathered, replicated),
        "output": rel_error(y_ours.detach(), y_theirs.detach()),
        "input grad": rel_error(x_ours.grad, x_theirs.grad),
        "fc1 weight grad": rel_error(ours_mlp.fc1.weight.grad, reference.fc1.weight.grad.to_local()),
        "fc2 weight grad": rel_error(ours_mlp.fc2.weight.grad, reference.fc2.weight.grad.to_local()),
        "fc2 bias grad": rel_error(ours_mlp.fc2.bias.grad.view(-1), reference.fc2.bias.grad.full_tensor()),
    }
    # sequence parallelism: our MLP on this rank's tokens (all-gather in, reduce-scatter out) against torch's
    # Colwise/RowwiseParallel with the tokens sharded on both sides (the SequenceParallel style's layouts)
    ours_sp = DistributedMLP(16, 64, sequence_shapes=[3, 3])
    ours_sp.load_serial(serial)
    reference_sp = MLP(16, 64)
    reference_sp.load_state_dict(serial.state_dict())
    parallelize_module(reference_sp, mesh, {"fc1": ColwiseParallel(input_layouts=Shard(1)),
                                       "fc2": RowwiseParallel(output_layouts=Shard(1))})
    tokens = split(x, 1, "tp")  # (2, 3, 16): this rank's half of the 6 tokens
    x_ours, x_theirs = tokens.clone().requires_grad_(), tokens.clone().requires_grad_()
    y_ours, y_theirs = ours_sp(x_ours), reference_sp(x_theirs)
    y_ours.sum().backward()
    y_theirs.sum().backward()
    bias_grad = reference_sp.fc2.bias.grad.full_tensor()
    checks.update({
        "sp output": rel_error(y_ours.detach(), y_theirs.detach()),
        "sp input grad": rel_error(x_ours.grad, x_theirs.grad),
        "sp fc1 weight grad": rel_error(ours_sp.fc1.weight.grad, reference_sp.fc1.weight.grad.to_local()),
        "sp fc2 weight grad": rel_error(ours_sp.fc2.weight.grad, reference_sp.fc2.weight.grad.to_local()),
        # the bias meets this rank's tokens only: its gradient is summed over tp (mark_for_reduction) ...
        "sp fc2 bias grad": rel_error(reduce(ours_sp.fc2.bias.grad, "tp").view(-1), bias_grad),
        "sp marked for the tp sum": "tp" in ours_sp.fc2.bias.mark_for_reduction,
    })
    checks["twin: sp fc2 bias grad unsummed"] = rel_error(ours_sp.fc2.bias.grad.view(-1), bias_grad)
    results[rank] = checks  # one assignment: the manager's dict holds copies
    comm.destroy()


@pytest.mark.multiprocess
@pytest.mark.long  # the layers against the serial ones stay in make test; this cross-check with DTensor is extra
def test_mappings_and_tp_mlp_agree_with_dtensor():
    results = mp.Manager().dict()
    mp.spawn(_dtensor_cross_check, args=(2, free_port(), results), nprocs=2)
    for rank, checks in results.items():
        assert checks["scatter"] and checks["gather"] and checks["sp marked for the tp sum"], (rank, checks)
        assert checks.pop("twin: sp fc2 bias grad unsummed") > 0.1, (rank, checks)  # half the tokens' gradient
        errors = {k: v for k, v in checks.items() if k not in ("scatter", "gather", "sp marked for the tp sum")}
        assert max(errors.values()) <= TOLERANCE, (rank, errors)


@pytest.mark.parametrize("size, chunks, expected", [
    (4050, 2, [2025, 2025]), (4050, 4, [1013, 1013, 1013, 1011]), (4050, 8, [507] * 7 + [501]),
    (16200, 4, [4050] * 4), (10, 4, [3, 3, 3, 1]), (5, 4, [1, 1, 1, 2]), (7, 1, [7]),
])
def test_compute_split_shapes_matches_the_original(size, chunks, expected):
    from distributed.helpers import compute_split_shapes
    assert compute_split_shapes(size, chunks) == expected
