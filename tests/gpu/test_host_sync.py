"""The step train_graph.py and train_mp_graphs.py capture never asks the host for a value.

A CUDA graph records device work only: a step that reads a value on the host (`.item()`, `bool(tensor)`, a
data-dependent shape such as `nonzero`, a copy to the CPU) either breaks the capture or, worse, is recorded with the
value it read at capture and replays it for ever. Here the step each script hands to cuda_graphs.capture (forward,
loss, backward with DDP's hook, GradScaler and Adam, the lr a device tensor) runs, at the moment of capture, under a
TorchDispatchMode that records every such call with the line of this project that made it: `_local_scalar_dense`
(what .item(), float() and bool() dispatch to), `nonzero`, `is_nonzero`, `equal`, and device-to-host copies
(`copy_`/`_to_copy` from a non-CPU tensor to a CPU one: none can occur on a CPU-only run, the rule is there for a
run on a GPU). The capture itself is emulated on the CPU as in tests/training/test_train_graph.py.

Adam: make_capturable makes it `capturable` on CUDA only, and torch refuses capturable Adam on CPU tensors; its CPU
path reads the step count with .item(), which the capturable GPU path does not. So the check runs the fused Adam
(`--enable_fused`), which keeps its step counts and lr in tensors on every device and is what the graph captures with
--enable_fused on a GPU; in fp32 and in fp16 (GradScaler hands the fused kernel the scale and the inf flag as
tensors). The non-fused capturable path can only be checked on a GPU (tests marked gpu). The twins add an `.item()`
or a `nonzero` to the loss and are caught. A failure names the line that syncs: the step in the scripts,
loop/cuda_graphs.py, task/optim.py, task/loss.py, networks/ or distributed/.
"""
import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train_graph
import train_mp_graphs
from loop import cuda_graphs
from tests.conftest import REPO_ROOT
from tests.training.test_train_graph import emulated_graphs, run_tiny  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.compat, pytest.mark.usefixtures("in_repo_root")]
aten = torch.ops.aten
ASKS_THE_HOST = {aten._local_scalar_dense, aten.nonzero, aten.is_nonzero, aten.equal}
FUSED = ["--enable_fused", "--num_iters", "8", "--stop_at_iter", "2"]


def project_line():
    """The innermost frame of this repository's code outside tests/ (where the sync was asked for)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path.startswith(REPO_ROOT) and "/tests/" not in path and "/.venv" not in path:
            return f"{os.path.relpath(path, REPO_ROOT)}:{frame.lineno} {frame.line}"
    return "(outside the project)"


class HostSyncs(TorchDispatchMode):
    """Records each op that makes the host wait for a device value: (op, the project line that called it)."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = False
        if func.overloadpacket is aten.copy_:
            to_host = args[0].device.type == "cpu" and args[1].device.type != "cpu"
        elif func.overloadpacket is aten._to_copy:
            to_host = args[0].device.type != "cpu" and str(kwargs.get("device", args[0].device)) == "cpu"
        if func.overloadpacket in ASKS_THE_HOST or to_host:
            self.found.append((str(func), project_line()))
        return func(*args, **kwargs)


@pytest.fixture
def captured_step_syncs(emulated_graphs, monkeypatch):  # noqa: F811 (the imported fixture)
    """Host syncs of the step recorded by each capture (a list per capture, filled when a script runs)."""
    emulated_capture, captures = cuda_graphs.capture, []

    def checked_capture(step, static_inputs, stream):
        with HostSyncs() as syncs:
            step(*static_inputs)  # the call a real capture records
        captures.append(syncs.found)
        return emulated_capture(step, static_inputs, stream)

    monkeypatch.setattr(cuda_graphs, "capture", checked_capture)
    return captures


@pytest.mark.parametrize("main, layout", [(train_graph.main, "1GPU"), (train_mp_graphs.main, "1MP")])
@pytest.mark.parametrize("precision", [[], ["--amp_mode", "fp16"]], ids=["fp32", "fp16"])
def test_the_captured_step_never_asks_the_host(main, layout, precision, captured_step_syncs, era5_dir, tmp_path):
    run_tiny(main, era5_dir, tmp_path, layout, [*FUSED, *precision])
    assert len(captured_step_syncs) == 1 and captured_step_syncs[0] == []


@pytest.mark.parametrize("sync, op", [(lambda loss: loss.item(), "aten._local_scalar_dense.default"),
                                      (lambda loss: torch.nonzero(loss.detach() > 0), "aten.nonzero.default")],
                         ids=["item", "nonzero"])
def test_twin_a_host_sync_in_the_loss_is_caught(sync, op, captured_step_syncs, era5_dir, tmp_path, monkeypatch):
    get_loss = train_graph.get_loss

    def syncing_loss(params):
        loss_fn = get_loss(params)

        def loss(gen, tar):
            value = loss_fn(gen, tar)
            sync(value)
            return value

        return loss

    monkeypatch.setattr(train_graph, "get_loss", syncing_loss)
    run_tiny(train_graph.main, era5_dir, tmp_path, "1GPU", FUSED)
    assert [found_op for found_op, _ in captured_step_syncs[0]] == [op]
    assert captured_step_syncs[0][0][1].startswith("train_graph.py:")  # names the line that asked
