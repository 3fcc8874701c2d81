"""GPU-only defects reproduced on the CPU: each check of a fix has a twin that shows the defect without it.

- DataParallel runs each replica in a thread of its own, where torch re-enters autocast without the dtype (fp16 on
  CUDA): the replica's forward must carry the run's dtype (loop/dp_autocast.AutocastForward).
- fp16 with tensor parallelism: one rank's gradient shard overflowing must skip the step on every rank of the
  model-parallel group, with one loss scale (distributed/grad_scaler.py).
- Copies of replicated weights (over tp) whose gradients round differently on each rank (atomics, cuDNN algorithms
  autotuned per rank) must stay bitwise equal (distributed/data_parallel._reduce_marked_gradients).
- Two ranks of a node on one GPU, a GPU node whose GPUs PyTorch cannot use, TF32 forced by the container: one line
  each, or the right peak (utils/comm.py, loop/flops.py).
- A tensor learning rate stays the tensor a CUDA graph was captured with, whatever the torch version's schedules
  do (utils/compat.py).
"""
import contextlib
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loop import flops
from loop.dp_autocast import AutocastForward
from tests.conftest import as_spawned_rank, free_port
from utils import comm, rendezvous
from utils.errors import UserError

pytestmark = [pytest.mark.compat, pytest.mark.usefixtures("in_repo_root")]


def forward_in_a_new_thread(module, x):
    """What torch's parallel_apply does for each DataParallel replica: a new thread, autocast entered again with the
    caller's on/off state but not its dtype."""
    enabled, out = torch.is_autocast_enabled("cpu"), {}

    def worker():
        with torch.autocast("cpu", enabled=enabled):
            out["y"] = module(x)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    return out["y"]


def test_dataparallel_replicas_compute_in_the_runs_autocast_dtype():
    """On the CPU autocast's default is bf16, so the run asks for fp16 here (on CUDA the default is fp16 and a bf16
    run is what goes wrong)."""
    def replica():  # DataParallel replicates the module for every forward (autocast caches casts of weights)
        torch.manual_seed(0)
        return torch.nn.Linear(8, 8)

    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        assert replica()(x).dtype == torch.float16  # in the caller's thread
        assert forward_in_a_new_thread(replica(), x).dtype == torch.bfloat16  # the twin: the dtype is lost
        wrapped = AutocastForward(replica(), "cpu", torch.float16, enabled=True)
        assert forward_in_a_new_thread(wrapped, x).dtype == torch.float16


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "twin-not-kept"])
def test_a_tensor_lr_replaced_by_a_schedule_is_filled_in_place(kept, monkeypatch):
    """torch < 2.6's ReduceLROnPlateau puts a float into the param group: a captured step would keep reading the
    old tensor. The plateau schedule's end_epoch (task/optim.WarmupThenPlateau), past warm-up, runs its plateau
    within lr_tensors_kept, which fills that tensor with the new lr and puts it back. Twin: lr_tensors_kept
    switched off (a context that does nothing), the group ends with the float and the tensor with the old lr."""
    from task import optim
    if not kept:
        monkeypatch.setattr(optim, "lr_tensors_kept", lambda optimizer: contextlib.nullcontext())
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = optim.WarmupThenPlateau(optimizer, 0.1, warmup_epochs=1, steps_per_epoch=1)
    lr = optimizer.param_groups[0]["lr"] = torch.tensor(0.1)  # as make_capturable leaves it

    class FloatPlateau:  # what torch < 2.6's ReduceLROnPlateau does when it lowers the lr
        def step(self, val_loss):
            optimizer.param_groups[0]["lr"] = 0.05

    scheduler.plateau = FloatPlateau()
    scheduler.step()
    scheduler.step()  # two epochs of one step: past the warm-up
    scheduler.end_epoch(1.0)
    filled = optimizer.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.05)
    assert filled is kept, (optimizer.param_groups[0]["lr"], lr)


def _tp2_rank(rank, world, port, found):
    """tp=2: (1) fp16 loss scaling with an inf in rank 1's shard only, with the group's scaler and with torch's;
    (2) training steps in which rank 1's gradient of the replicated patch embedding rounds differently, with the
    comm hook's averaging and without it (the weight no longer marked as shared)."""
    as_spawned_rank(rank, world, port)
    from distributed.data_parallel import init_ddp_model_and_reduction_hooks
    from distributed.grad_scaler import ModelParallelGradScaler
    from distributed.helpers import mark_shared
    from distributed.parallelize import split_tokens_and_weights
    from networks import get_model
    from task.loss import get_loss
    from utils.YParams import YParams
    torch.set_num_threads(1)
    grid = comm.init({"tp": 2}, rendezvous_timeout=60)
    params = YParams("config/ViT.yaml", "tiny")
    loss_fn = get_loss(params)
    generator = torch.Generator().manual_seed(1)
    inp, tar = torch.randn(2, 20, 16, 32, generator=generator), torch.randn(2, 20, 16, 32, generator=generator)

    def build(shared_embedding=True):
        torch.manual_seed(params.seed)
        model = split_tokens_and_weights(get_model(params), grid)
        if not shared_embedding:
            mark_shared(model.patch_embed.proj.weight, [])  # as if each rank held its own
        return model, init_ddp_model_and_reduction_hooks(model, grid, torch.device("cpu"))

    out = {}
    for label, scaler_class in (("group", ModelParallelGradScaler), ("torch", torch.amp.GradScaler)):
        model, ddp = build()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        scaler = scaler_class("cpu", init_scale=2.0**8)
        scaler.scale(loss_fn(ddp(inp), tar)).backward()
        if rank == 1:  # an overflow in this rank's shard of a tp-split weight
            model.blocks[0].mlp.fc1.weight.grad[0, 0] = float("inf")
        before = model.head.weight.detach().clone()  # replicated over tp
        scaler.step(optimizer)
        scaler.update()
        out[label] = {"stepped": not torch.equal(before, model.head.weight), "scale": scaler.get_scale()}

    for label, shared in (("averaged", True), ("not averaged", False)):
        model, ddp = build(shared)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        weight = model.patch_embed.proj.weight
        if rank == 1:  # a kernel that rounds differently on this rank
            weight.register_hook(lambda grad: grad * (1 + 1e-6))
        for _ in range(3):
            optimizer.zero_grad()
            loss_fn(ddp(inp), tar).backward()
            optimizer.step()
        copies = [torch.empty_like(weight) for _ in range(2)]
        dist.all_gather(copies, weight.detach(), group=comm.get_group("tp"))
        out[label] = torch.equal(copies[0], copies[1])
    found[rank] = out
    comm.destroy()


@pytest.fixture(scope="module")
def tp2_results():
    found = mp.Manager().dict()
    mp.spawn(_tp2_rank, args=(2, free_port(), found), nprocs=2)
    return dict(found)


@pytest.mark.multiprocess  # not long: it reads the ranks the other test of tp2_results spawns (one xdist group)
def test_an_overflow_in_one_tp_shard_skips_the_step_on_every_rank(tp2_results):
    group = [tp2_results[rank]["group"] for rank in (0, 1)]
    assert group[0] == group[1] == {"stepped": False, "scale": 2.0**7}
    plain = [tp2_results[rank]["torch"] for rank in (0, 1)]  # the twin: each rank decides alone
    assert plain[0] == {"stepped": True, "scale": 2.0**8} and plain[1] == {"stepped": False, "scale": 2.0**7}


@pytest.mark.multiprocess
def test_copies_of_a_replicated_weight_stay_equal_when_their_gradients_round_differently(tp2_results):
    assert tp2_results[0]["averaged"] and tp2_results[1]["averaged"]
    assert not tp2_results[0]["not averaged"]  # the twin: the copies part


def claim_gpus(gpus, host="node1"):
    """check_one_rank_per_gpu on one thread per rank (a store shared as by the rendezvous): what each rank says."""
    store, said = dist.HashStore(), {}

    def rank(index):
        try:
            rendezvous.check_one_rank_per_gpu(store, len(gpus), gpus[index], timeout=30, host=host)
            said[index] = "ok"
        except UserError as err:
            said[index] = str(err)

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(len(gpus))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [said[index] for index in range(len(gpus))]


def test_two_ranks_on_one_gpu_are_refused_on_every_rank():
    assert claim_gpus(["GPU-a", "GPU-b", "GPU-c"]) == ["ok"] * 3  # the twin: one GPU each
    said = claim_gpus(["GPU-a", "GPU-b", "GPU-a"])
    assert all(line.startswith("1 GPU(s) are shared by two or more ranks of one node") for line in said)


def test_a_gpu_node_whose_gpus_pytorch_cannot_use_is_refused(monkeypatch):
    """CUDA visible to the job (CUDA_VISIBLE_DEVICES, Slurm) but torch.cuda unusable: one line, never a quiet CPU
    run; CUDA_VISIBLE_DEVICES set empty is the way to run on the CPU on purpose."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(UserError, match=r"^CUDA_VISIBLE_DEVICES=0,1,2,3, but PyTorch cannot use a GPU \("):
        comm.get_device()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    with pytest.raises(UserError, match="Slurm gave this node GPUs"):
        comm.get_device()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert comm.get_device() == torch.device("cpu")


@pytest.mark.parametrize("env, cudnn_tf32, convolutions, expected", [
    ({}, True, True, 156e12),  # cuDNN's default: fp32 convolutions on TF32 (the UNet's and ResNet's FLOPs)
    ({}, True, False, 19.5e12),  # the twin: a matmul model (the ViT) keeps cuBLAS's fp32 peak
    ({"NVIDIA_TF32_OVERRIDE": "0"}, True, True, 19.5e12),
    ({}, False, True, 19.5e12),
])
def test_fp32_peak_of_a_convolution_model_is_tf32_where_cudnn_uses_it(env, cudnn_tf32, convolutions, expected,
                                                                         monkeypatch):
    """The UNet `short` run on an H100 (2026-11-28) trained at 75 TFLOP/s in fp32, above the fp32 datasheet peak
    (67): cuDNN ran its convolutions on TF32, and MFU read 100%."""
    for name in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, cudnn_tf32
    try:
        assert flops.peak_flops(torch.device("cuda", 0), torch.float32, convolutions)[0] == expected
        assert flops.Peak(torch.device("cuda", 0), torch.float32, convolutions).value == expected
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("env, allow_tf32, expected", [
    ({}, False, 19.5e12),
    ({"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}, False, 156e12),  # NGC containers set it: fp32 matmuls run on TF32
    ({"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1", "NVIDIA_TF32_OVERRIDE": "0"}, False, 19.5e12),
    ({}, True, 156e12),
])
def test_fp32_peak_is_tf32_where_cublas_uses_tf32(env, allow_tf32, expected, monkeypatch):
    for name in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    saved, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, allow_tf32
    try:
        assert flops.peak_flops(torch.device("cuda", 0), torch.float32)[0] == expected
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
