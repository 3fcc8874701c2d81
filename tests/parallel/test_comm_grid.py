"""Process groups for model parallelism: the rank layout (utils/rank_generator.py), the group building of
utils/comm.py, and the notebook utils/check_rank_generator.ipynb (the layout's rules: test_parallel_layout.py).

A failure in the RankGenerator tests points to the order semantics (the first name of the order must vary
fastest); in the spawned test to comm.init's group building (a rank keeping the wrong group, or ranks calling
new_group in different orders); in the notebook test to the notebook or its kernel setup.
"""
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import REPO_ROOT, as_spawned_rank, free_port
from utils import comm
from utils.errors import UserError
from utils.layout import Layout
from utils.rank_generator import RankGenerator

GROUP_TYPES = ("dp", "tp", "cp", "tp-cp", "dp-cp")
NOTEBOOK = os.path.join(REPO_ROOT, "utils", "check_rank_generator.ipynb")


def groups(tp, dp, cp, order, pp=1):
    generator = RankGenerator(tp=tp, dp=dp, pp=pp, cp=cp, order=order)
    return {name: generator.get_ranks(name) for name in GROUP_TYPES + ("pp",)}


# --- the worked examples of the original tutorial (Megatron-LM's layout), exactly ---------------------------

def test_tp4_dp2_in_order_tp_cp_dp_varies_tp_fastest():
    """8 ranks, tp=4, dp=2: rank 5 does tp comms in [4..7] and its dp reduction with rank 1. A failure: the
    order's first name does not vary fastest."""
    g = groups(tp=4, dp=2, cp=1, order="tp-cp-dp")
    assert g["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["cp"] == g["pp"] == [[r] for r in range(8)]
    assert g["tp-cp"] == g["tp"] and g["dp-cp"] == g["dp"]


def test_tp2_cp2_dp2_tp_cp_dp():
    """tp=2, cp=2, dp=2 in order tp-cp-dp: tp neighbours, cp two apart, dp four apart. A failure: wrong
    strides, or combined groups ("tp-cp") not varying both axes."""
    g = groups(tp=2, dp=2, cp=2, order="tp-cp-dp")
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["tp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_tp2_cp2_dp2_cp_tp_dp():
    """The same sizes in order cp-tp-dp: tp and cp swap places, dp stays. A failure: the order is ignored or
    read slowest-first."""
    g = groups(tp=2, dp=2, cp=2, order="cp-tp-dp")
    assert g["cp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["tp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["tp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["dp-cp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_cp4_dp4_cp_tp_dp():
    """16 ranks, tp=1, cp=4, dp=4: a size-1 axis in the order changes nothing; dp-cp is the whole job."""
    g = groups(tp=1, dp=4, cp=4, order="cp-tp-dp")
    assert g["cp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["dp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["dp-cp"] == [list(range(16))]


def test_notebook_example_tp2_cp2_dp8():
    """32 ranks, tp=2, cp=2, dp=8, order tp-cp-pp-dp (the notebook's example): each dp group takes one rank
    of every block of 4."""
    assert groups(tp=2, dp=8, cp=2, order="tp-cp-pp-dp")["dp"] == [
        list(range(start, 32, 4)) for start in range(4)]


def test_tp2_dp2_both_orders():
    """4 ranks, tp=2, dp=2: "tp-dp" makes tp neighbours, "dp-tp" makes dp neighbours."""
    g = groups(tp=2, dp=2, cp=1, order="tp-dp")
    assert g["tp"] == [[0, 1], [2, 3]] and g["dp"] == [[0, 2], [1, 3]]
    g = groups(tp=2, dp=2, cp=1, order="dp-tp")
    assert g["tp"] == [[0, 2], [1, 3]] and g["dp"] == [[0, 1], [2, 3]]


def test_order_completion_and_the_missing_name_error():
    """Size-1 names missing from the order are appended in the order tp, pp, dp, cp; a missing name of another
    size is refused in one line naming it. A failure: a silently wrong layout instead of an error."""
    assert RankGenerator(tp=2, dp=2, pp=1, cp=1, order="tp-dp").order == "tp-dp-pp-cp"
    assert RankGenerator(tp=2, dp=2, pp=1, cp=2, order="TP-CP-DP").order == "tp-cp-dp-pp"
    with pytest.raises(UserError, match=r"^the size of cp is 2, but the order 'tp-dp' does not name it; add cp "
                                        r"to the order \(e\.g\. 'tp-dp-cp'\)$"):
        RankGenerator(tp=2, dp=2, pp=1, cp=2, order="tp-dp")
    with pytest.raises(UserError, match="names 'ep'"):
        RankGenerator(tp=2, dp=2, pp=1, cp=1, order="tp-ep-dp")
    with pytest.raises(UserError, match="tp more than once"):
        RankGenerator(tp=2, dp=2, pp=1, cp=1, order="tp-dp-tp")


def test_rank_offset_and_partition():
    """rank_offset shifts every rank; for any sizes and order each group type splits the ranks into disjoint
    groups of the product of its sizes. A failure: ranks repeated or lost."""
    assert RankGenerator(tp=2, dp=2, pp=1, cp=1, order="tp-dp", rank_offset=8).get_ranks("dp") == [[8, 10], [9, 11]]
    for order in ("-".join(p) for p in itertools.permutations(["tp", "cp", "dp", "pp"])):
        generator = RankGenerator(tp=2, dp=3, pp=2, cp=4, order=order)
        sizes = {"tp": 2, "dp": 3, "pp": 2, "cp": 4}
        for name in GROUP_TYPES + ("pp", "tp-cp-dp"):
            lists = generator.get_ranks(name)
            assert sorted(r for ranks in lists for r in ranks) == list(range(48))
            assert {len(ranks) for ranks in lists} == {math.prod(sizes[n] for n in name.split("-"))}


def test_init_on_one_process_gives_sizes_1_and_refuses_tp2(monkeypatch):
    """Without WORLD_SIZE every size is 1 and every rank 0; tp=2 on one process is refused before anything
    starts. A failure: init no longer works for a single process (train.py on a laptop)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    grid = comm.init({"tp": 1, "cp": 1, "order": "cp-tp-dp"}, rendezvous_timeout=5)
    assert (comm.get_world_size(), comm.get_world_rank(), comm.get_local_rank()) == (1, 0, 0)
    assert grid.layout == Layout(order="cp-tp-dp")
    assert [comm.get_size(n) for n in GROUP_TYPES + ("tp-cp-pp", None)] == [1] * 7
    assert [comm.get_rank(n) for n in GROUP_TYPES + ("tp-cp-pp", None)] == [0] * 7
    assert [(grid.size(n), grid.rank(n)) for n in GROUP_TYPES + ("tp-cp-pp",)] == [(1, 0)] * 6
    with pytest.raises(UserError, match="does not divide the world size 1"):
        comm.init({"tp": 2}, rendezvous_timeout=5)
    with pytest.raises(UserError, match="order 'tp-ep' names 'ep'"):
        comm.init({"order": "tp-ep"}, rendezvous_timeout=5)


# --- the groups comm.init builds on 4 gloo processes ---------------------------------------------------------

ORDERS = ("tp-cp-dp", "cp-tp-dp")


def _report_groups(rank, port, results):
    as_spawned_rank(rank, 4, port, OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from utils import comm
    report = {}
    for order in ORDERS:  # the second init rebuilds the groups on the same process group
        grid = comm.init({"tp": 2, "cp": 2, "order": order}, rendezvous_timeout=30)
        members = {name: dist.get_process_group_ranks(grid[name].group) for name in GROUP_TYPES}
        positions = {name: (comm.get_size(name), comm.get_rank(name)) for name in GROUP_TYPES}
        handed = {name: (grid.size(name), grid.rank(name)) for name in GROUP_TYPES}
        held = {name: (dist.get_world_size(grid[name].group), dist.get_rank(grid[name].group)) for name in GROUP_TYPES}
        assert positions == handed == held, (positions, handed, held)  # one source: the layout's numbers, checked
        tp_sum = comm.all_reduce_sum(torch.tensor([float(rank)]), "tp").item()
        report[order] = (members, positions, tp_sum, grid.layout)
    results[rank] = report
    comm.destroy()


@pytest.mark.compat  # the container's torch 2.5 is the one whose teardown hung
def test_destroy_has_the_grid_s_axes_let_go_of_their_groups():
    """After comm.destroy the Axes comm.init handed down (the very objects the model's layers hold) keep their size
    and rank but hold no process group: a group they still held went later, with the grid, and on torch 2.5 its
    teardown under the GIL could hang the rank (tests/training/test_run_exit.py, with the process groups' threads).
    Four ranks of torch's fake process group, this one rank 1. A failure points to utils/comm.forget_groups or
    utils/layout.Axis.let_go."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        grid = comm.init({"tp": 2, "cp": 2})
        before = {name: (axis.size, axis.rank, axis.group is not None) for name, axis in grid.axes.items()}
    finally:
        comm.destroy()
    assert not dist.is_initialized() and before["tp"] == (2, 1, True) and before["tp-cp"] == (4, 1, True), before
    after = {name: (axis.size, axis.rank, axis.group is not None) for name, axis in grid.axes.items()}
    assert after == {name: (size, rank, False) for name, (size, rank, _) in before.items()}, after


@pytest.mark.multiprocess
@pytest.mark.long
def test_init_builds_the_groups_of_each_order():
    """4 gloo ranks, tp=2, cp=2: each rank holds, under each name, the RankGenerator group that contains it,
    knows its place in it, and an all-reduce over "tp" sums over its tp partners only (1 = 0+1 with tp-cp-dp,
    2 = 0+2 with cp-tp-dp for rank 0). A failure: comm.init keeps the wrong group, or ignores the order."""
    results = mp.Manager().dict()
    mp.spawn(_report_groups, args=(free_port(), results), nprocs=4)
    for order in ORDERS:
        generator = RankGenerator(tp=2, dp=1, pp=1, cp=2, order=order)
        for rank in range(4):
            members, positions, tp_sum, grid = results[rank][order]
            assert grid == Layout(tp=2, cp=2, dp=1, order=order)
            for name in GROUP_TYPES:
                (expected,) = [ranks for ranks in generator.get_ranks(name) if rank in ranks]
                assert members[name] == expected, (order, rank, name)
                assert positions[name] == (len(expected), expected.index(rank)), (order, rank, name)
            (partners,) = [ranks for ranks in generator.get_ranks("tp") if rank in ranks]
            assert tp_sum == sum(partners)
    assert results[0]["tp-cp-dp"][2] == 1 and results[0]["cp-tp-dp"][2] == 2


# --- the notebook runs headless and prints the layout --------------------------------------------------------

def _stdout(notebook):
    return "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for output in cell.get("outputs", []) if output.get("name") == "stdout")


@pytest.mark.multiprocess
def test_notebook_runs_and_prints_the_dp_groups():
    """utils/check_rank_generator.ipynb runs top to bottom in a fresh kernel (this venv's Python), prints the
    dp groups of its 32-rank example, and its saved outputs are those of a fresh run. A failure: the notebook
    or the RankGenerator API it calls changed; re-run the notebook and save it."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (pip install nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="nbclient not installed (pip install nbclient)")
    pytest.importorskip("ipykernel", reason="ipykernel not installed (pip install ipykernel)")
    from jupyter_client.kernelspec import KernelSpecManager
    if "python3" not in KernelSpecManager().find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix"], check=True,
                       capture_output=True)
    # the spec's command is "python", which jupyter_client replaces by sys.executable: this venv's Python
    saved = nbformat.read(NOTEBOOK, as_version=4)
    fresh = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(fresh, timeout=60, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}}).execute()
    printed = _stdout(fresh)
    assert "  dp     [[0, 4, 8, 12, 16, 20, 24, 28], [1, 5, 9, 13, 17, 21, 25, 29], " \
           "[2, 6, 10, 14, 18, 22, 26, 30], [3, 7, 11, 15, 19, 23, 27, 31]]\n" in printed
    assert "  tp     [[0, 1], [2, 3], [4, 5], [6, 7]]\n" in printed
    assert printed == _stdout(saved)
