"""Checkpoints independent of the layout that wrote them: gather on save, shard on load.

A model-parallel rank holds shards. Saving gathers them (over tp; cp shards activations, not weights) into the
state dict the serial model has, under the serial names, and does the same for the optimizer's per-parameter
state (Adam's moments have the parameters' shapes). Loading takes this rank's shard of each serial tensor. So a
checkpoint written at tp=2 x cp=2 loads at tp=1, in train.py, or at any other layout, and the reverse.
Under FSDP (--fsdp) each tensor is first gathered over dp (a DTensor's full_tensor) and loaded back as this rank's
dp shard (distribute_tensor like the parameter). Gathering is collective: every rank calls these functions in the
same order.
"""
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from distributed.helpers import gather
from distributed.layers import DistributedLayerNorm, DistributedMatmul
from lifecycle.checkpoint import load_model_state


def _owner(model, name):
    module_name, _, attr = name.rpartition(".")
    return model.get_submodule(module_name), attr


def serial_name(model, name):
    """The serial model's name of parameter `name` (a DistributedLayerNorm keeps its LayerNorm as `.norm`)."""
    module_name, _, attr = name.rpartition(".")
    parent, _, last = module_name.rpartition(".")
    if last == "norm" and parent and isinstance(model.get_submodule(parent), DistributedLayerNorm):
        return f"{parent}.{attr}"
    return name


def to_serial(model, name, tensor):
    """The whole (serial-shaped) tensor of which `tensor` is this rank's shard for parameter `name`, on the CPU
    (a checkpoint's full copies must not pile up in GPU memory)."""
    if isinstance(tensor, DTensor):  # FSDP: this rank's dp shard of its tp shard
        tensor = tensor.full_tensor()
    module, attr = _owner(model, name)
    if not isinstance(module, DistributedMatmul):
        return tensor.cpu()
    if attr == "weight":
        tensor = gather(tensor, 0, None, module.out) if module.out.size > 1 else tensor
        tensor = gather(tensor, 1, None, module.inp) if module.inp.size > 1 else tensor
        return tensor.cpu()
    if module.out.size > 1:
        tensor = gather(tensor, 2, None, module.out)
    return tensor.reshape(-1).cpu()


def from_serial(model, name, tensor):
    """This rank's shard, for parameter `name`, of the serial-shaped `tensor` (a DTensor sharded like the parameter
    under FSDP)."""
    module, attr = _owner(model, name)
    if isinstance(module, DistributedMatmul):
        tensor = module.shard(tensor, 0, module.out)
        tensor = module.shard(tensor, 1, module.inp) if attr == "weight" else tensor.reshape(1, 1, -1)
    like = getattr(module, attr)
    if isinstance(like, DTensor):
        tensor = distribute_tensor(tensor.to(like.device), like.device_mesh, like.placements)
    return tensor


def serial_state_dict(model):
    """model.state_dict() as the serial model would hold it (collective)."""
    return {serial_name(model, name): to_serial(model, name, tensor.detach())
            for name, tensor in model.state_dict().items()}


def load_serial_state_dict(model, state, path):
    """Load a serial state dict into a (possibly distributed) model; one line naming the first misfit."""
    load_model_state(model, state, path, saved_name=lambda name: serial_name(model, name),
                     shard=lambda name, tensor: from_serial(model, name, tensor))


def _map_optimizer_state(model, state_dict, convert):
    names = [name for name, _ in model.named_parameters()]  # the optimizer was built on model.parameters()
    state = {}
    for index in sorted(state_dict["state"]):
        state[index] = {key: convert(model, names[index], value) if torch.is_tensor(value) and value.dim() else value
                        for key, value in sorted(state_dict["state"][index].items())}
    return {"state": state, "param_groups": state_dict["param_groups"]}


def serial_optimizer_state(model, optimizer):
    """optimizer.state_dict() with every per-parameter tensor gathered to the serial shape (collective)."""
    return _map_optimizer_state(model, optimizer.state_dict(), to_serial)


def load_serial_optimizer_state(model, optimizer, state_dict):
    """Load an optimizer state of the serial layout into the optimizer of a (possibly distributed) model."""
    optimizer.load_state_dict(_map_optimizer_state(model, state_dict, from_serial))
