"""GPU evidence without a GPU: each stage's step runs on fake CUDA tensors, so no CPU tensor hides in it.

FakeTensorMode tensors have a shape, a dtype, strides and a device but no data. Each stage's model (config/ViT.yaml,
config/UNet.yaml, config/ResNet50.yaml; config `tiny`) is built on the CPU as train.py builds it, then every parameter
and buffer is replaced by a fake tensor on `cuda` of the same shape, dtype and stride, and so is the batch (train.py's
to_device). Then train.py's step runs under torch.autocast("cuda") with the config's dtype (fp32, bf16, fp16), in
the default and in the channels_last format (enable_nhwc), and for the ViT also at tp=2 x cp=2 on a fake process
group (train_mp.py): the forward, the loss (task/loss.py), the training metrics (task/metrics.py) into an
EpochMeter, and loop.validation.validate (validation loss and metrics, up to its reduction over "dp"). Their outputs
must be fake tensors on cuda, the forward's in the autocast dtype. A CPU tensor of one or more dimensions mixed into
any of it (a `torch.arange(n)` or a mask made without device=, a tensor kept in an attribute that is not a buffer, a
target left on the CPU) raises FakeTensor's device-mismatch error, as it would fail on a GPU; the twins inject such
a tensor into a layer, the loss, a metric, the batch and a tp x cp layer and show that the check then fails.

Not covered: backward and the optimizer (the autograd engine asks the CUDA driver for the current stream of every
cuda tensor that requires grad, and without a driver that aborts the whole process, so the fakes do not require
grad and no graph is recorded), zero-dimensional CPU tensors (FakeTensor lets them mix with cuda ones), values.
Torch 2.5's FakeTensorMode calls the CUDA driver for some ops (attention, batch norm in training, channels_last
copies, bf16 convolutions) and has no kernel for the c10d collectives: the cases that need them are skipped there,
naming the op. A failure of a check (not a twin) points to the file of the frame that made or kept the CPU tensor:
networks/ (forward), distributed/ (tp x cp layers), task/loss.py, task/metrics.py, loop/meter.py (EpochMeter.add),
loop/validation.py (validate).
"""
import copy
import functools
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, UnsupportedOperatorException

from distributed.layers import DistributedMatmul
from distributed.parallelize import split_tokens_and_weights
from lifecycle.cli import apply_overrides, training_parser
from loaders.images import sample_shape as image_sample_shape
from loop.meter import EpochMeter
from loop.validation import set_train_mode, validate
from networks import get_model
from task import metrics
from task.loss import get_loss
from task.metrics import get_train_metrics, get_valid_metrics
from tests.conftest import REPO_ROOT
from utils import comm
from utils.YParams import YParams

pytestmark = [pytest.mark.compat]

YAML = {"vit": "ViT.yaml", "unet": "UNet.yaml", "resnet": "ResNet50.yaml"}
PRECISIONS = ["none", "bf16", "fp16"]  # --amp_mode: fp32, bf16 and fp16 autocast
VALID_TAGS = {"vit": 1, "unet": 0, "resnet": 2}  # validation metrics of each stage (task/metrics.py)
# FakeTensor's device check: "found two different devices cuda:0, cpu" (torch 2.5), "found at least two devices,
# cuda:0 and cpu!" (later)
DEVICE_MISMATCH = r"two (different )?devices.*(cuda:0.*cpu|cpu.*cuda:0)"


def load_params(stage, amp_mode, nhwc):
    """The stage's `tiny` config with the flags --amp_mode and --enable_nhwc applied, as train.py reads it."""
    yaml = os.path.join(REPO_ROOT, "config", YAML[stage])
    args = training_parser("fake cuda").parse_args(["--yaml_config", yaml, "--config", "tiny", "--amp_mode", amp_mode,
                                                    "--enable_nhwc" if nhwc else "--no-enable_nhwc"])
    params = YParams(yaml, "tiny")
    apply_overrides(params, args, dp_size=comm.get_size("dp"), dp_rank=comm.get_rank("dp"))
    return params


def sample_shapes(params):
    """(input shape, target shape, target dtype) of one sample as the stage's data loader gives it."""
    stage = params.get("model", "vit")
    if stage == "vit":  # ERA5 maps: n_in_channels -> n_out_channels on img_size
        return (params.n_in_channels, *params.img_size), (params.n_out_channels, *params.img_size), torch.float32
    if stage == "unet":  # cosmology crops: N_in_channels -> N_out_channels on data_size^3
        edge = (params.data_size,) * 3
        return (params.N_in_channels, *edge), (params.N_out_channels, *edge), torch.float32
    return image_sample_shape(params), (), torch.int64  # images and class labels


def memory_format_of(params):
    """train.py's channels_last format: NHWC for images, NDHWC for volumes."""
    return torch.channels_last if len(sample_shapes(params)[0]) == 3 else torch.channels_last_3d


def cpu_batch(params):
    """A batch of local_batch_size samples on the CPU, as the loader yields it."""
    inp_shape, tar_shape, tar_dtype = sample_shapes(params)
    batch = params.local_batch_size
    tar = (torch.randint(0, params.num_classes, (batch,)) if tar_dtype == torch.int64
           else torch.randn(batch, *tar_shape))
    return torch.randn(batch, *inp_shape), tar


def build_model(params, grid=None):
    """train.py's model: seeded, built on the CPU, channels_last when enable_nhwc; split over tp and cp as train_mp.py's
    recipe splits it on `grid` (comm.init's)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params.seed)
        model = get_model(params)
    if params.enable_nhwc:
        model = model.to(memory_format=memory_format_of(params))
    if grid is not None and grid.layout.model_parallel > 1:
        split_tokens_and_weights(model, grid)
    return model


def _empty(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="cuda")


# ops of the stages whose fake cuda version some torch releases (2.5) compute through the CUDA driver
DRIVER_BOUND_OPS = {
    "scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(*[_empty(1, 1, 2, 2)] * 3),
    "batch_norm in training mode": lambda: F.batch_norm(_empty(2, 1, 2, 2), _empty(1), _empty(1), training=True),
    "contiguous(memory_format=channels_last)": lambda: _empty(1, 2, 2, 2).contiguous(
        memory_format=torch.channels_last),
    "contiguous(memory_format=channels_last_3d)": lambda: _empty(1, 2, 2, 2, 2).contiguous(
        memory_format=torch.channels_last_3d),
    "bfloat16 conv2d": lambda: F.conv2d(_empty(1, 1, 2, 2, dtype=torch.bfloat16),
                                        _empty(1, 1, 1, 1, dtype=torch.bfloat16)),
    "bfloat16 conv3d": lambda: F.conv3d(_empty(1, 1, 2, 2, 2, dtype=torch.bfloat16),
                                        _empty(1, 1, 1, 1, 1, dtype=torch.bfloat16)),
}


@functools.cache
def needs_the_driver(op):
    """Why this torch cannot run DRIVER_BOUND_OPS[op] on fake cuda tensors here (its error), or ''."""
    try:
        with FakeTensorMode():
            DRIVER_BOUND_OPS[op]()
    except RuntimeError as err:
        if "CUDA" not in str(err) and "NVIDIA" not in str(err):
            raise  # not the driver: a failure to look at, not a reason to skip
        return str(err).splitlines()[0]
    return ""


def skip_where_torch_needs_the_driver(params):
    """Skip, naming the op, a case that needs an op this torch's FakeTensorMode runs only with a CUDA driver."""
    stage = params.get("model", "vit")
    ops = {"vit": ["scaled_dot_product_attention"], "unet": [], "resnet": ["batch_norm in training mode"]}[stage]
    dims = "3d" if stage == "unet" else "2d"
    if params.enable_nhwc:
        ops.append(f"contiguous(memory_format=channels_last{'_3d' if dims == '3d' else ''})")
    if params.amp_dtype == torch.bfloat16:
        ops.append(f"bfloat16 conv{dims}")
    for op in ops:
        if needs_the_driver(op):
            pytest.skip(f"torch {torch.__version__}'s FakeTensorMode calls the CUDA driver for {op} on fake cuda "
                        f"tensors, and this machine has no GPU ({needs_the_driver(op)})")


def fake_cuda(mode, tensor):
    """A fake tensor on cuda of the same shape, dtype and stride as `tensor` (the CPU one is left alone)."""
    with mode:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cuda")


def to_fake_cuda(model, mode):
    """A copy of `model` whose every parameter and buffer is a fake cuda tensor (parameters without grad)."""
    fake = copy.deepcopy(model)
    for module in fake.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(fake_cuda(mode, param), requires_grad=False)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = fake_cuda(mode, buffer)
    return fake


def cuda_autocast(monkeypatch, params):
    """train.py's `torch.autocast(device.type, dtype=amp_dtype, enabled=amp_enabled)` with device cuda. Its
    constructor turns itself off unless torch.cuda.is_available() and refuses bf16 unless is_bf16_supported(); both
    are patched for the construction only (a fake tensor made while is_available() is True would initialise CUDA)."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        return torch.autocast("cuda", dtype=params.amp_dtype, enabled=params.amp_enabled)


class ReductionReached(Exception):
    """validate() got to its reduction over "dp": everything before it ran; its argument is the stacked sums."""


def validation_sums(model, batch, to_device, loss_fn, metrics_fn, autocast, monkeypatch):
    """loop.validation.validate on one batch, stopped at its reduction (a fake tensor has no value to .item())."""
    def stop(tensor, group="dp"):
        raise ReductionReached(tensor)

    with monkeypatch.context() as patch:
        patch.setattr(comm, "all_reduce_sum", stop)
        try:
            validate(model, [batch], to_device, loss_fn, metrics_fn, autocast)
        except ReductionReached as reached:
            return reached.args[0]
    raise AssertionError("validate() returned without reducing its sums over 'dp'")


def fake_cuda_step(params, model, monkeypatch, change_model=None, loss_fn=None, target_to_device=True):
    """train.py's step on fake cuda tensors: to_device, forward and loss under autocast, training metrics into an
    EpochMeter, then validate() on the same batch. The twins pass `change_model` (applied to the fake model),
    `loss_fn` or target_to_device=False (to_device forgets the target)."""
    skip_where_torch_needs_the_driver(params)
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # a real CPU tensor met inside becomes a fake CPU one
    autocast = cuda_autocast(monkeypatch, params)
    fake_model = to_fake_cuda(model, mode)
    if change_model is not None:
        change_model(fake_model)
    loss_fn = loss_fn or get_loss(params)
    metrics_fn, train_metrics_fn = get_valid_metrics(params), get_train_metrics(params)

    def to_device(inp, tar):  # train.py's, with FakeTensorMode making the copies on the GPU
        inp = fake_cuda(mode, inp)
        if params.enable_nhwc:
            inp = inp.contiguous(memory_format=memory_format_of(params))
        return inp, fake_cuda(mode, tar) if target_to_device else tar

    batch = cpu_batch(params)
    meter = EpochMeter(torch.device("cuda"), loader=None)
    with mode:
        set_train_mode(fake_model, params)
        inp, tar = to_device(*batch)
        with autocast:
            gen = fake_model(inp)
            loss = loss_fn(gen, tar)
        train_metrics = train_metrics_fn(gen.detach(), tar)
        meter.add(loss, train_metrics)
        sums = validation_sums(fake_model, batch, to_device, loss_fn, metrics_fn, autocast, monkeypatch)
    return SimpleNamespace(model=fake_model, inp=inp, gen=gen, loss=loss, train_metrics=train_metrics,
                           meter=meter, sums=sums)


def on_fake_cuda(tensor):
    return isinstance(tensor, FakeTensor) and tensor.device.type == "cuda"


def check_step(step, params, tp_cp=False):
    """What shows the step really ran on fake cuda tensors (not on real CPU ones) in the run's precision."""
    stage = params.get("model", "vit")
    tensors = {**dict(step.model.named_parameters()), **dict(step.model.named_buffers())}
    assert tensors and all(on_fake_cuda(t) for t in tensors.values()), "a parameter or buffer is not a fake cuda tensor"
    assert on_fake_cuda(step.inp) and on_fake_cuda(step.gen) and on_fake_cuda(step.loss)
    assert step.loss.dim() == 0
    batch, (inp_shape, tar_shape, _) = params.local_batch_size, sample_shapes(params)
    assert tuple(step.gen.shape) == ((batch, params.num_classes) if stage == "resnet" else (batch, *tar_shape))
    # autocast on "cuda" was on: the output layer (linear or convolution) computed in the autocast dtype
    assert step.gen.dtype == (params.amp_dtype if params.amp_enabled else torch.float32)
    if params.enable_nhwc:
        memory_format = memory_format_of(params)
        assert step.inp.is_contiguous(memory_format=memory_format) and not step.inp.is_contiguous()
        convs = [t for t in tensors.values() if t.dim() == len(inp_shape) + 1]
        assert convs and all(t.is_contiguous(memory_format=memory_format) for t in convs)
    assert set(step.train_metrics) == ({"Accuracy/top1/train"} if stage == "resnet" else set())
    assert all(on_fake_cuda(v) for v in step.train_metrics.values())
    assert on_fake_cuda(step.meter.losses[0]) and all(on_fake_cuda(v) for v in step.meter.metrics[0].values())
    # validate(): loss x batch, sample count and each validation metric, summed on the device
    assert on_fake_cuda(step.sums) and tuple(step.sums.shape) == (2 + VALID_TAGS[stage],)
    if tp_cp:
        assert any(isinstance(m, DistributedMatmul) for m in step.model.modules())


@pytest.fixture(scope="module")
def cpu_models():
    """build(stage, nhwc): each stage's CPU model, built once for the module (the precision does not change it)."""
    built = {}

    def build(stage, nhwc):
        if (stage, nhwc) not in built:
            built[stage, nhwc] = build_model(load_params(stage, "none", nhwc))
        return built[stage, nhwc]

    return build


@pytest.mark.parametrize("nhwc", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("amp_mode", PRECISIONS)
@pytest.mark.parametrize("stage", list(YAML))
def test_step_runs_on_fake_cuda_tensors_only(cpu_models, monkeypatch, stage, amp_mode, nhwc):
    """A failure with a device mismatch: a CPU tensor in the stage's forward, loss, metrics or validate()."""
    params = load_params(stage, amp_mode, nhwc)
    check_step(fake_cuda_step(params, cpu_models(stage, nhwc), monkeypatch), params)


def add_cpu_tensor(module, kept=False):
    """Add to `module`'s output a CPU tensor: one its forward makes without device= (along the output's last
    dimension), or (`kept`) one made beforehand and kept in a plain attribute, which model.to(device) does not move."""
    forward = module.forward
    if kept:
        module.offset = torch.ones(1)  # a plain attribute, not a buffer

    def forward_with_cpu_tensor(x):
        out = forward(x)
        return out + (module.offset if kept else torch.zeros(out.shape[-1]))

    module.forward = forward_with_cpu_tensor


@pytest.mark.parametrize("stage, amp_mode, nhwc, kept", [
    pytest.param("vit", "none", False, False, id="vit-fp32-made_in_forward"),
    pytest.param("unet", "fp16", False, True, id="unet-fp16-kept_in_attribute"),
    pytest.param("unet", "bf16", True, False, id="unet-bf16-channels_last-made_in_forward"),
    pytest.param("resnet", "bf16", True, True, id="resnet-bf16-channels_last-kept_in_attribute")])
def test_a_cpu_tensor_in_a_layer_fails_the_check(cpu_models, monkeypatch, stage, amp_mode, nhwc, kept):
    params = load_params(stage, amp_mode, nhwc)

    def change(model):  # the last convolution or linear layer: the head
        layers = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)
        add_cpu_tensor([m for m in model.modules() if isinstance(m, layers)][-1], kept)

    with pytest.raises(RuntimeError, match=DEVICE_MISMATCH):
        fake_cuda_step(params, cpu_models(stage, nhwc), monkeypatch, change_model=change)


def test_a_cpu_tensor_in_the_loss_fails_the_check(cpu_models, monkeypatch):
    params = load_params("unet", "fp16", False)
    loss_fn = get_loss(params)
    with pytest.raises(RuntimeError, match=DEVICE_MISMATCH):
        fake_cuda_step(params, cpu_models("unet", False), monkeypatch,
                       loss_fn=lambda gen, tar: loss_fn(gen, tar) * torch.ones(1))


def test_cpu_latitude_weights_in_the_validation_metric_fail_the_check(cpu_models, monkeypatch):
    """lat_weights made without device=: only validate() (the ViT's validation RMSE) meets it."""
    lat_weights = metrics.lat_weights
    monkeypatch.setattr(metrics, "lat_weights", lambda num_lat, device=None: lat_weights(num_lat))
    params = load_params("vit", "fp16", False)
    with pytest.raises(RuntimeError, match=DEVICE_MISMATCH) as failure:
        fake_cuda_step(params, cpu_models("vit", False), monkeypatch)
    assert any(entry.name == "validate" for entry in failure.traceback)


@pytest.mark.parametrize("stage", ["unet", "resnet"])
def test_a_target_left_on_the_cpu_fails_the_check(cpu_models, monkeypatch, stage):
    params = load_params(stage, "fp16", False)
    with pytest.raises(RuntimeError, match=DEVICE_MISMATCH):
        fake_cuda_step(params, cpu_models(stage, False), monkeypatch, target_to_device=False)


# --- the ViT at tp=2 x cp=2 (train_mp.py) on a fake process group --------------------------------------------------

@pytest.fixture
def tp_cp_grid(request):
    """Rank 0 (or the rank the test names) of 4 on the fake process group, with utils.comm's groups of a tp=2 x cp=2
    grid (comm.init), for one test; skipped where the fake process group cannot run a collective on fake cuda
    tensors."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=getattr(request, "param", 0), world_size=4)
    try:
        grid = comm.init({"tp": 2, "cp": 2, "order": "tp-cp-dp"})
        assert [comm.get_size(name) for name in ("tp", "cp", "dp", "tp-cp")] == [2, 2, 1, 4]
        try:
            with FakeTensorMode():
                dist.all_reduce(torch.empty(2, device="cuda"), group=comm.get_group("tp"))
        except UnsupportedOperatorException as err:
            pytest.skip(f"torch {torch.__version__}: FakeTensorMode has no kernel for the c10d collectives on fake "
                        f"tensors ({err}), so tp x cp layers cannot run on fake cuda tensors")
        yield grid
    finally:
        comm.destroy()  # also forgets the grid


def record_collectives(monkeypatch):
    """[(name, whether it sent a fake cuda tensor)] of each dist.all_reduce and dist.all_gather from now on (as
    distributed/helpers.py calls them: all_reduce(tensor, group=), all_gather(tensor_list, tensor, group=))."""
    calls = []

    def recorder(name, collective):
        def record(*args, **kwargs):
            calls.append((name, on_fake_cuda(args[1] if name == "all_gather" else args[0])))
            return collective(*args, **kwargs)
        return record

    for name in ("all_reduce", "all_gather"):
        monkeypatch.setattr(dist, name, recorder(name, getattr(dist, name)))
    return calls


def load_tp_cp_params(amp_mode, **changes):
    params = load_params("vit", amp_mode, False)
    params.update({"tp": 2, "cp": 2, "order": "tp-cp-dp", **changes})  # as train_mp.py's flags
    return params


@pytest.mark.parametrize("amp_mode", PRECISIONS)
def test_tp_cp_vit_step_runs_on_fake_cuda_tensors_only(tp_cp_grid, monkeypatch, amp_mode):
    """A failure with a device mismatch: a CPU tensor in distributed/ (layers, mappings, helpers' collectives)."""
    params = load_tp_cp_params(amp_mode)
    collectives = record_collectives(monkeypatch)
    check_step(fake_cuda_step(params, build_model(params, tp_cp_grid), monkeypatch), params, tp_cp=True)
    # tp's all-reduces and cp's all-gathers (keys, values, the final tokens) ran, on fake cuda tensors
    assert {name for name, _ in collectives} == {"all_reduce", "all_gather"}
    assert all(fake for _, fake in collectives)


@pytest.mark.parametrize("tp_cp_grid", [3], indirect=True)
def test_tp_cp_vit_step_with_an_uneven_sequence_split_runs_on_fake_cuda_tensors_only(tp_cp_grid, monkeypatch):
    """5 x 9 = 45 patches over cp = 2: rank 3 (tp 1, cp 1) holds 22 tokens and pads them to 23 for each all-gather
    (distributed/helpers.py, _padded_all_gather)."""
    params = load_tp_cp_params("bf16", img_size=[20, 36])
    model = build_model(params, tp_cp_grid)
    assert comm.get_rank("cp") == 1 and model.cp_shapes == [23, 22]
    check_step(fake_cuda_step(params, model, monkeypatch), params, tp_cp=True)


def test_a_cpu_tensor_in_a_tp_cp_layer_fails_the_check(tp_cp_grid, monkeypatch):
    params = load_tp_cp_params("fp16")

    def change(model):  # the row-parallel projection of the first block's attention (all-reduce over tp)
        add_cpu_tensor(model.blocks[0].attn.proj, kept=True)

    with pytest.raises(RuntimeError, match=DEVICE_MISMATCH):
        fake_cuda_step(params, build_model(params, tp_cp_grid), monkeypatch, change_model=change)
