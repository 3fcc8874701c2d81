"""Pipeline stages (distributed/pipeline.py, step 0 of distributed/parallelize.py) against the serial ViT, on 4 spawned
gloo ranks, for each layout below: three Adam steps of the stages' schedule (Pipeline.forward_backward) on the same
batches as three serial steps, then each step's loss (1e-5 relative) and the weights gathered from the stages
(serial_state.serial_state_dict: over pp, tp and dp) against the serial model's (|a - b| <= 1e-5 + 1e-4 |b|, the end-
to-end tests' tolerance).

Layouts: pp=4 with GPipe (M = 4) and 1F1B (M = 8, one sample each); pp=2 x tp=2 with sequence parallelism; pp=2 x cp=2
with the ring and with all-to-all (each rank of a stage embedding only its band); pp=2 x dp=2 (the gradients reduced
over dp once a step, after the last backward) and the same under FSDP. Twins, a switch of pipeline.py flipped: the
loss not divided by M (Adam's steps barely see a gradient M times larger, the loss does), and a stage's backward fed
the next microbatch's gradient (GPipe), leave the serial weights by ten times the tolerance or more. (End to end
through train_mp.py, with its loader, checkpoints and logs: tests/training/test_pipeline.py.) A failure points to the
schedules, Pipeline's exchanges, keep_stage's cut or the serial gather of the stages' checkpoints.
"""
import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import as_spawned_rank, free_port
from tests.parallel.test_fsdp import FSDP_ON_CPU

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]
TOLERANCE = 1e-5
STEPS = 3
# name: (Layout settings, twin switch of pipeline.py or None)
LAYOUTS = {
    "pp4 gpipe M4": ({"pp": 4, "microbatches": 4, "pp_schedule": "gpipe"}, None),
    "pp4 1f1b M8": ({"pp": 4, "microbatches": 8}, None),
    "pp2 x tp2, sequence parallel": ({"pp": 2, "microbatches": 2, "tp": 2, "sequence_parallel": True}, None),
    "pp2 x cp2 ring": ({"pp": 2, "microbatches": 4, "cp": 2, "cp_method": "ring"}, None),
    "pp2 x cp2 alltoall, gpipe": ({"pp": 2, "microbatches": 2, "cp": 2, "cp_method": "alltoall",
                                   "pp_schedule": "gpipe"}, None),
    "pp2 x dp2": ({"pp": 2, "microbatches": 2, "dp": 2}, None),
    "pp2 x dp2, fsdp": ({"pp": 2, "microbatches": 2, "dp": 2, "fsdp": True}, None),
    "twin: loss not divided by M": ({"pp": 4, "microbatches": 4}, "DIVIDE_LOSS"),
    "twin: backward fed the next microbatch's gradient": ({"pp": 4, "microbatches": 4, "pp_schedule": "gpipe"},
                                                          "BACKWARD_IN_ORDER"),
}


def _compare(rank, world, port, names, results):
    as_spawned_rank(rank, world, port)
    from utils import comm
    torch.set_num_threads(1)
    found = {}
    for name in names:
        found[name] = _compare_at(name)
    results[rank] = found
    comm.destroy()


def _compare_at(name):
    import contextlib

    from distributed import pipeline, serial_state
    from distributed.parallelize import Options, parallelize
    from networks.vit import VisionTransformer
    from utils import comm
    from utils.layout import Layout
    settings, switch = LAYOUTS[name]
    settings = dict(settings)
    dp = settings.pop("dp", 1)
    layout = Layout(dp=dp, **settings)
    grid = comm.init(layout, rendezvous_timeout=60)
    torch.manual_seed(0)
    batches = [(torch.randn(8, 20, 16, 32), torch.randn(8, 20, 16, 32)) for _ in range(STEPS)]

    def build():
        torch.manual_seed(1)
        return VisionTransformer((16, 32), 4, 20, 20, 32, 4, 4)

    serial = build()
    serial_opt = torch.optim.Adam(serial.parameters(), lr=1e-3)
    serial_losses = []
    for inp, tar in batches:
        serial_opt.zero_grad()
        loss = ((serial(inp) - tar) ** 2).mean()
        loss.backward()
        serial_opt.step()
        serial_losses.append(loss.item())
    raw = build()
    model = parallelize(raw, grid, torch.device("cpu"), Options())  # pp > 1: the pipeline reduces over dp, not DDP
    optimizer = torch.optim.Adam(raw.parameters(), lr=1e-3)
    local, start = 8 // dp, grid.rank("dp") * (8 // dp)
    if switch:
        setattr(pipeline, switch, False)
    try:
        losses = []
        for inp, tar in batches:
            optimizer.zero_grad()
            _, loss = model.forward_backward(inp[start:start + local], tar[start:start + local],
                                             lambda gen, t: ((gen - t) ** 2).mean(), contextlib.nullcontext(),
                                             lambda loss: loss)
            optimizer.step()
            losses.append(comm.all_reduce_mean(loss.reshape(1), "dp").item())
    finally:
        if switch:
            setattr(pipeline, switch, True)
    state = serial_state.serial_state_dict(raw)
    expected = serial.state_dict()
    errors = {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, serial_losses)),
              "names": sorted(state) != sorted(expected)}
    errors["weights"] = max(((state[key] - value).abs() / (1e-5 + 1e-4 * value.abs())).max().item()
                            for key, value in expected.items())  # <= 1: within the tolerance
    errors["largest weight difference"] = max((state[key] - value).abs().max().item()
                                              for key, value in expected.items())
    return errors


def run(names):
    results = mp.Manager().dict()
    mp.spawn(_compare, args=(4, free_port(), names, results), nprocs=4)
    return dict(results)


FSDP_HERE = hasattr(torch.distributed.fsdp, "fully_shard")  # tests/parallel/test_fsdp.py's FSDP_ON_CPU


@pytest.fixture(scope="module")
def found():
    """Every layout in one group of spawned ranks (FSDP only where torch has it on the CPU)."""
    return run([name for name in LAYOUTS if "fsdp" not in name or FSDP_HERE])


@pytest.mark.parametrize("name", [name for name in LAYOUTS if not name.startswith("twin") and "fsdp" not in name])
def test_each_layout_is_the_serial_model(found, name):
    for rank, errors in found.items():
        assert not errors[name]["names"], (rank, name)
        assert errors[name]["loss"] <= TOLERANCE and errors[name]["weights"] <= 1, (rank, name, errors[name])


@FSDP_ON_CPU
def test_fsdp_stages_are_the_serial_model(found):
    for rank, errors in found.items():
        errors = errors["pp2 x dp2, fsdp"]
        assert errors["loss"] <= TOLERANCE and errors["weights"] <= 1, (rank, errors)


@pytest.mark.parametrize("name", [name for name in LAYOUTS if name.startswith("twin")])
def test_the_twins_leave_the_serial_model(found, name):
    for rank, errors in found.items():
        assert errors[name]["weights"] > 10, (rank, name, errors[name])  # ten times the tolerance, or more
