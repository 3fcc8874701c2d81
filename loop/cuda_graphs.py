"""CUDA Graphs for the training step (train_graph.py, train_mp_graphs.py): the step is captured once and replayed.

Eagerly, each step launches hundreds of kernels from Python (forward, backward, the gradient all-reduce, the
optimizer); a small model, or a large one split over many GPUs, then waits on those launches. A CUDA graph records
the launches once and replays them with one call. The step function is the one train.py runs; it is wrapped at one
point, GraphedStep:

    check_support(params, args, device, __file__)       # what cannot be captured ends in one line (exit code 2)
    stream = side_stream(device)                        # warm-up and capture run off the default stream,
    enter_stream(stream)                                # and DDP is built on that stream (PyTorch's recipe)
    model = DDP(model, ...)
    leave_stream(stream)
    graphed_step = GraphedStep(train_step, (static_inp, static_tar), stream, model, optimizer, scaler)
    gen, loss = graphed_step(inp, tar)                  # copy into the static buffers, replay, clone the outputs

GraphedStep first makes the optimizer capturable (task/optim.make_capturable: the lr in a device tensor that the
schedule fills in place, capturable Adam).

A graph reads and writes fixed addresses: every batch is copied into the same static buffers, the learning rate is
a tensor the schedule fills in place (the schedule steps outside the graph, as in train.py), and the outputs (loss,
prediction) are cloned before the next replay overwrites them. Warm-up steps (WARMUP_STEPS, on the side stream) run
the step eagerly first (DDP, cuDNN autotuning, NCCL communicators and Adam's state need it), then the model, the
optimizer state, the loss scale and the RNG are put back, so the first replay starts where train.py's first step
does. fp16 is captured with the fused Adam: GradScaler then hands it the scale and an inf flag as device tensors
and the kernel skips a step with inf gradients on the GPU (the plain path asks the host, which a graph cannot). Nothing
else is captured: the step-0 points, validation and checkpoints use the eager model, whose parameters are the
tensors the graph updates in place.
"""
import contextlib
import logging
import os

import torch

from task.optim import make_capturable
from utils.errors import UserError
from utils.layout import DEFAULT_CP_METHOD

WARMUP_STEPS = 20  # eager steps before capture: the original's 20 (DDP needs at least 11, per PyTorch's notes)


def require_cuda(device, instead):
    """CUDA graphs need a CUDA device; elsewhere stop with one line naming the eager script."""
    if device.type != "cuda":
        raise UserError(f"CUDA Graphs need an NVIDIA GPU (this process runs on the {device.type}); "
                        f"use {instead}, which runs the same training eagerly")


def eager_script(script):
    """The script that runs the same training eagerly: train_graph.py -> train.py, train_mp_graphs.py -> train_mp.py."""
    name = os.path.basename(script)
    return name.replace("_graphs.py", ".py").replace("_graph.py", ".py")


def check_support(params, args, device, script):
    """Refuse, in one line each, what a captured step of `script` (a graph script's __file__) cannot do here."""
    instead = eager_script(script)
    require_cuda(device, instead)
    if params.get("model", "vit") == "resnet" or params.get("optimizer", "Adam") != "Adam":
        raise UserError(f"the captured step supports Adam (capturable) for the ViT and the UNet; the ResNet stage "
                        f"(SGD, BatchNorm statistics, plateau schedule) is not captured here; use {instead}")
    if params.amp_mode == "fp16" and not params.enable_fused:
        raise UserError("fp16 in a CUDA graph needs --enable_fused: the fused Adam skips a step with inf gradients "
                        "on the GPU, where GradScaler's plain path asks the host, which a graph cannot capture; add "
                        "--enable_fused, or use --amp_mode bf16 (no loss scaling)")
    if params.enable_jit:
        raise UserError("torch.compile (enable_jit) does not combine with this script, which captures the eager "
                        "step itself (the compiler's own CUDA-graph path is mode='reduce-overhead'); add "
                        f"--no-enable_jit, or use {instead}")
    if args.parallel == "dp":
        raise UserError("--parallel dp (DataParallel) splits each batch from the host and cannot be captured; "
                        "launch one process per GPU (torchrun --nproc_per_node N) instead")
    if getattr(args, "activation_checkpointing", False):  # a flag of the model-parallel scripts only
        raise UserError("--activation_checkpointing is not supported in the captured step (its recomputation saves "
                        "and restores the random state around each block, which has not been tried under capture); "
                        f"use {instead}")
    cp_method = getattr(args, "cp_method", DEFAULT_CP_METHOD)  # a flag of the model-parallel scripts only
    if cp_method != DEFAULT_CP_METHOD:
        moves = ("its sends and receives of key/value blocks round the ring" if cp_method == "ring" else
                 "its all-to-alls of q, k, v and the attention's output")
        raise UserError(f"--cp_method {cp_method} is not supported in the captured step ({moves} have not been "
                        f"tried under capture); use --cp_method allgather, or {instead}")
    if getattr(args, "pipeline_parallel", 1) > 1:  # a flag of the model-parallel scripts only
        raise UserError("--pipeline_parallel is not supported in the captured step (a schedule of microbatches sent "
                        f"and received between stages has not been tried under capture); use {instead}")
    if getattr(args, "dry_run", None) is not None:  # a flag of the model-parallel scripts only
        raise UserError("--dry_run measures the eager step of one rank; run it with train_mp.py")
    if getattr(args, "fsdp", False):
        raise UserError("--fsdp is not supported in the captured step (FSDP2 allocates and frees the all-gathered "
                        f"weights on its own streams each step, which has not been tried under capture); use {instead}")
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        if os.environ.get(name, "0") not in ("", "0"):
            raise UserError(f"{name} makes the host wait for each collective, which a CUDA graph cannot capture; "
                            "unset it")


def side_stream(device):
    """The stream that DDP is built on, and that warm-up and capture run on (never the default stream)."""
    return torch.cuda.Stream(device)


def enter_stream(stream):
    """Make `stream` the current stream, after the work queued so far (DDP is built there: PyTorch's recipe)."""
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    torch.cuda.set_stream(stream)


def leave_stream(stream):
    """Back to the default stream; later work there waits for `stream`'s."""
    default = torch.cuda.default_stream(stream.device)
    torch.cuda.set_stream(default)
    default.wait_stream(stream)


@contextlib.contextmanager
def on_stream(stream):
    """Run a block on `stream` after the work queued so far (enter_stream); then back on the default stream, whose
    later work waits for it (leave_stream)."""
    enter_stream(stream)
    try:
        yield
    finally:
        leave_stream(stream)


class _Snapshot:
    """Model parameters and buffers, optimizer state, loss scale and the device's RNG, to put back after warm-up."""

    def __init__(self, model, optimizer, scaler, device):
        self.model, self.optimizer, self.scaler, self.device = model, optimizer, scaler, device
        self.scaler_state = scaler.state_dict()  # {} when disabled
        self.tensors = [(t, t.detach().clone()) for t in [*model.parameters(), *model.buffers()]]
        self.state = {param: {key: value.clone() for key, value in state.items() if torch.is_tensor(value)}
                      for param, state in optimizer.state.items()}
        self.rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()

    @torch.no_grad()
    def restore(self):
        for tensor, saved in self.tensors:
            tensor.copy_(saved)
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                saved = self.state.get(param, {}).get(key)
                if saved is not None:
                    value.copy_(saved)
                elif torch.is_tensor(value):  # created during warm-up: zeros are how Adam starts (step 0, moments 0)
                    value.zero_()
        if self.scaler_state:
            self.scaler.load_state_dict(self.scaler_state)  # in place: fills the scale tensor the graph reads
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(self.rng, self.device)
        else:
            torch.set_rng_state(self.rng)
        self.optimizer.zero_grad(set_to_none=True)  # the captured backward allocates the grads the graph owns


def warm_up(step, static_inputs, stream, model, optimizer, scaler):
    """Run `step` eagerly WARMUP_STEPS times on `stream`, then put model, optimizer, scaler and RNG back."""
    device = static_inputs[0].device
    saved = _Snapshot(model, optimizer, scaler, device)
    with on_stream(stream):
        for _ in range(WARMUP_STEPS):
            step(*static_inputs)
    saved.restore()


def capture(step, static_inputs, stream):
    """Record one call of `step(*static_inputs)` in a CUDA graph on `stream`; returns replay(), which runs the
    recorded work again and returns the step's outputs (tensors the graph owns and overwrites on each replay)."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: only this thread's CUDA calls are checked for capture safety (a DALI or pin-memory thread
    # started by an earlier loader pass may still call CUDA)
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        outputs = step(*static_inputs)

    def replay():
        graph.replay()
        return outputs

    return replay


class GraphedStep:
    """`step(inp, tar)` captured once (after warm-up), called like it: the batch is copied into the static buffers,
    the graph replayed, and its outputs returned as clones (the next replay overwrites the graph's own)."""

    def __init__(self, step, static_inputs, stream, model, optimizer, scaler):
        make_capturable(optimizer)  # lr in a device tensor that the schedule fills in place; capturable Adam
        self.static_inputs = tuple(static_inputs)
        logging.info(f"Capturing the training step in a CUDA graph ({WARMUP_STEPS} warm-up steps on a side stream; "
                     f"static buffers {[tuple(t.shape) for t in self.static_inputs]})")
        warm_up(step, self.static_inputs, stream, model, optimizer, scaler)
        self.replay = capture(step, self.static_inputs, stream)

    def __call__(self, *batch):
        for static, new in zip(self.static_inputs, batch, strict=True):
            static.copy_(new, non_blocking=True)  # same shapes: training batches are whole (drop_last)
        return tuple(output.detach().clone() for output in self.replay())
