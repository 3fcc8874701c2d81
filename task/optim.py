"""Optimizer and learning-rate schedule, selected by the config (`optimizer`, `lr_schedule`).

Every schedule is stepped once per iteration; the ResNet stage's plateau schedule also looks at the
validation loss after each epoch (`end_epoch`). A schedule changes a learning rate held in a tensor in place
(`fill_`), never by putting a new object into the param group: a step captured in a CUDA graph reads the tensor it
was captured with (make_capturable, which loop/cuda_graphs.GraphedStep calls).
"""
import math

import torch

from utils.compat import lr_tensors_kept
from utils.errors import UserError


def initial_lr(params):
    """The peak learning rate: `lr`, or for the UNet stage's `lr_schedule` map start_lr scaled by batch size."""
    schedule = params.lr_schedule
    if not isinstance(schedule, dict):
        if not isinstance(params.get("lr"), (int, float)) or params.lr <= 0:
            raise UserError(f"lr is {params.get('lr')}; set a positive number (or an lr_schedule map)")
        return params.lr
    check_lr_schedule_map(params)
    ratio = params.global_batch_size / params.base_batch_size
    scale = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}
    return schedule["start_lr"] * scale[schedule["scaling"]]


def check_lr_schedule_map(params):
    """The UNet stage's map: every key present, numbers where numbers belong, start_lr > 0."""
    schedule = params.lr_schedule
    missing = [key for key in ("scaling", "start_lr", "end_lr", "warmup_steps") if key not in schedule]
    if missing:
        raise UserError(f"lr_schedule lacks {', '.join(missing)}; give scaling, start_lr, end_lr and warmup_steps")
    if schedule["scaling"] not in ("none", "linear", "sqrt"):
        raise UserError(f"lr_schedule scaling '{schedule['scaling']}' is unknown; choose one of: none, linear, sqrt")
    for key in ("start_lr", "end_lr", "warmup_steps"):
        if not isinstance(schedule[key], (int, float)) or schedule[key] < 0:
            raise UserError(f"lr_schedule {key} is {schedule[key]!r}; it must be a number >= 0, "
                            "not a quoted string")
    if schedule["start_lr"] <= 0:
        raise UserError("lr_schedule start_lr is 0; it must be positive")
    if not isinstance(params.get("base_batch_size"), int) or params.base_batch_size < 1:
        raise UserError("the lr_schedule map scales by global_batch_size / base_batch_size; set base_batch_size")


def get_optimizer(params, model):
    """Adam (ViT: betas 0.9, 0.95; UNet: 0.9, 0.999) or SGD with momentum (ResNet); fused with `enable_fused`."""
    name = params.get("optimizer", "Adam")
    fused = bool(params.enable_fused) or None
    if name == "Adam":
        return torch.optim.Adam(model.parameters(), lr=initial_lr(params),
                                betas=tuple(params.get("adam_betas", (0.9, 0.95))), fused=fused)
    if name == "SGD":
        return zero_momentum_buffers(torch.optim.SGD(
            model.parameters(), lr=initial_lr(params), momentum=params.get("momentum", 0.9),
            weight_decay=params.get("weight_decay", 0.0), fused=fused))
    raise UserError(f"optimizer '{name}' is unknown; choose one of: Adam, SGD")


def zero_momentum_buffers(optimizer):
    """SGD with momentum: every momentum buffer exists, zero, before the first step.

    Why: with fp16 the loss scaler hands a fused SGD its inf flag instead of skipping step(). On a first step the
    fused SGD allocates its buffers uninitialised (empty_like), returns at once when the step overflowed (normal at
    the initial scale), and keeps the never-written buffers: the next step multiplies garbage (a nan loss at
    iteration 3 of the ResNet configs with enable_fused). A zero buffer gives the same first step as torch's own
    start (buffer = gradient, dampening 0), for the fused, foreach and plain kernels alike. A checkpoint's state
    replaces these buffers on resume."""
    for group in optimizer.param_groups:
        if group.get("momentum", 0) != 0:
            for param in group["params"]:
                optimizer.state[param].setdefault("momentum_buffer", torch.zeros_like(param))
    return optimizer


def make_capturable(optimizer):
    """Ready `optimizer` for a step captured in a CUDA graph: each group's lr becomes a 0-d tensor on its
    parameters' device (the schedules fill it in place, so every replay reads the current value), Adam becomes
    `capturable` on CUDA (step counts on the device, no host sync in step()), and its checkpoints keep train.py's
    form (lr a float, not capturable), so they resume in train.py. Call after restoring a checkpoint:
    load_state_dict brings back the saved param groups."""
    for group in optimizer.param_groups:
        device = group["params"][0].device
        for key in ("fused", "foreach"):  # this run's kernels, not those of a restored checkpoint's groups
            if key in group:
                group[key] = optimizer.defaults.get(key)
        if not torch.is_tensor(group["lr"]) or group["lr"].device != device:
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        if "capturable" in group:
            group["capturable"] = device.type == "cuda"  # the only device here PyTorch captures Adam on
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=device, dtype=torch.float32)
    if not getattr(optimizer, "_saves_plain_groups", False):
        optimizer.register_state_dict_post_hook(_plain_param_groups)
        optimizer._saves_plain_groups = True
    return optimizer


def _plain_param_groups(optimizer, state_dict):
    """state_dict post hook: the saved groups as train.py writes them (lr a float, not capturable)."""
    for group in state_dict["param_groups"]:  # copies of the live groups
        if torch.is_tensor(group["lr"]):
            group["lr"] = group["lr"].item()
        if "capturable" in group:
            group["capturable"] = False
    return state_dict


def set_lr(group, value):
    """Set a param group's learning rate: in place when it is a tensor (see make_capturable)."""
    if torch.is_tensor(group["lr"]):
        group["lr"].fill_(value)
    else:
        group["lr"] = value


def cosine_with_warmup(warmup_iters, total_iters):
    """LR factor at scheduler step x: linear warm-up over `warmup_iters`, cosine to 0 at `total_iters`."""

    def factor(x):
        cosine = 0.5 * (1 + math.cos(math.pi * x / total_iters))
        return min((x + 1) / warmup_iters, cosine) if warmup_iters > 0 else cosine

    return factor


def unet_schedule(params, total_iters):
    """LR factor of the UNet stage: warm-up (only when the batch is scaled up), then cosine to end_lr.

    Iteration it = x + 1 (1-based, as upstream) uses it / warmup during warm-up, then a cosine over the
    remaining total - warmup iterations exactly, so the last iteration runs at end_lr.
    """
    schedule = params.lr_schedule
    init_lr, end_lr = initial_lr(params), schedule["end_lr"]
    scaled = params.global_batch_size > params.base_batch_size and schedule["scaling"] != "none"
    warmup = min(schedule["warmup_steps"], total_iters - 1) if scaled else 0

    def factor(x):
        it = x + 1
        if it < warmup:
            return it / warmup
        progress = (it - warmup) / max(total_iters - warmup, 1)
        return (end_lr + 0.5 * (init_lr - end_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))) / init_lr

    return factor


class WarmupThenPlateau:
    """ResNet stage: lr = lr0 * (epoch + 1) / warmup_epochs during warm-up, then ReduceLROnPlateau
    (factor 0.2, patience 10) on the validation loss after each epoch. Both change a tensor lr in place."""

    def __init__(self, optimizer, base_lr, warmup_epochs, steps_per_epoch):
        self.optimizer = optimizer
        self.base_lr = base_lr
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.last_epoch = 0  # iterations done, as LambdaLR counts them
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.2, patience=10)
        self._warmup_lr()

    def _warmup_lr(self):
        epoch = self.last_epoch // self.steps_per_epoch
        if epoch < self.warmup_epochs:
            for group in self.optimizer.param_groups:
                set_lr(group, self.base_lr * (epoch + 1) / self.warmup_epochs)

    def step(self):
        self.last_epoch += 1
        self._warmup_lr()

    def end_epoch(self, val_loss):
        """After the validation of an epoch: past warm-up, lower the lr when the loss stalls (whole epochs only:
        not after a run's shorter last one)."""
        epochs_done, rest = divmod(self.last_epoch, self.steps_per_epoch)
        if rest == 0 and epochs_done > self.warmup_epochs:
            with lr_tensors_kept(self.optimizer):
                self.plateau.step(val_loss)

    def state_dict(self):
        return {"last_epoch": self.last_epoch, "plateau": self.plateau.state_dict()}

    def load_state_dict(self, state):
        self.last_epoch = state["last_epoch"]
        self.plateau.load_state_dict(state["plateau"])


class PerIterationSchedule(torch.optim.lr_scheduler.LambdaLR):
    """lr = initial lr x factor(iteration), stepped every iteration."""

    def end_epoch(self, val_loss):
        """Nothing: only the plateau schedule listens to the validation loss."""


def get_lr_scheduler(params, optimizer, steps_per_epoch):
    """Per-iteration schedule over params.num_iters: cosine, constant, the UNet map, or plateau (ResNet)."""
    name = params.lr_schedule
    if isinstance(name, dict):
        factor = unet_schedule(params, params.num_iters)
    elif name == "cosine":
        factor = cosine_with_warmup(params.get("warmup", 0), params.num_iters)
    elif name == "constant":
        def factor(x):
            return 1.0
    elif name == "plateau":
        return WarmupThenPlateau(optimizer, params.lr, params.get("lr_warmup_epochs", 0), steps_per_epoch)
    else:
        raise UserError(f"lr_schedule '{name}' is unknown; choose one of: cosine, constant, plateau, "
                        "or a map {scaling, start_lr, end_lr, warmup_steps}")
    return PerIterationSchedule(optimizer, factor)

