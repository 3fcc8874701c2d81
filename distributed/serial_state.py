"""Checkpoints independent of the layout that wrote them: gather on save, shard on load.

A model-parallel rank holds shards. Saving gathers them (over tp; cp shards activations, not weights) into the
state dict the serial model has, under the serial names, and does the same for the optimizer's per-parameter
state (Adam's moments have the parameters' shapes). Loading takes this rank's shard of each serial tensor. So a
checkpoint written at tp=2 x cp=2 loads at tp=1, in train.py, or at any other layout, and the reverse.
Under FSDP (--fsdp) each tensor is first gathered over dp (a DTensor's full_tensor) and loaded back as this rank's
dp shard (distribute_tensor like the parameter). Under pipeline parallelism (distributed/pipeline.py) each stage
holds some of the serial names: saving sends each stage's tensors to every stage (over "pp"), loading takes the
names of this rank's stage. Gathering is collective: every rank calls these functions in the same order.

A model too large to gather on one rank writes a sharded checkpoint instead (`--checkpoint_format sharded`, the
default from lifecycle/shards.SHARD_ABOVE parameters): each rank hands over its tensors as boxes of the serial ones
(`box`: the serial name and shape, where the rank's part starts, its values), writes its own part, and loads only
the boxes its own layout needs, from any layout's checkpoint (lifecycle/shards.py).
"""
import json
import re

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from distributed.helpers import gather
from distributed.layers import DistributedLayerNorm, DistributedMatmul
from lifecycle import shards
from lifecycle.checkpoint import load_model_state
from utils.errors import UserError


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


def box(model, name, tensor):
    """(serial name, serial shape, offsets, values): where this rank's `tensor` of parameter `name` lies in the serial
    tensor. A DistributedMatmul's weight is a block of rows (column-parallel) or columns (row-parallel), its bias a
    run of the serial bias; under FSDP the rank holds rows of that (torch.chunk's split of the first dimension over
    dp, as DTensor's Shard(0)); anything else is whole."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    shape, offsets = list(tensor.shape), [0] * tensor.dim()
    if isinstance(tensor, DTensor) and tensor.dim():  # FSDP: this rank's rows of the (tp-local) parameter
        ranks, coordinate = tensor.device_mesh.size(), tensor.device_mesh.get_coordinate()[0]
        rows = -(-shape[0] // ranks)
        offsets[0] = min(coordinate * rows, shape[0])
        if local.shape[0] != max(0, min(rows, shape[0] - offsets[0])):
            raise RuntimeError(f"{name}: FSDP's shard of {tuple(local.shape)} is not torch.chunk's rows")
    module, attr = _owner(model, name)
    if isinstance(module, DistributedMatmul):
        if attr == "weight":
            shape = [shape[0] * module.out.size, shape[1] * module.inp.size]
            offsets = [offsets[0] + module.out.rank * tensor.shape[0], module.inp.rank * tensor.shape[1]]
        else:  # a (1, 1, n) bias: n features of the serial bias (under FSDP, rank 0 of dp holds it)
            count = tensor.shape[-1]
            shape, offsets, local = [count * module.out.size], [module.out.rank * count], local.reshape(-1)
    return serial_name(model, name), shape, offsets, local


def writes_sharded(model, checkpoint_format="auto"):
    """Whether `checkpoint_format` ("auto", "serial", "sharded") asks for a sharded checkpoint: "sharded", or "auto"
    and a model of shards.SHARD_ABOVE parameters or more (its serial count, parallelize's `serial_numel`)."""
    return checkpoint_format == "sharded" or (
        checkpoint_format == "auto" and getattr(model, "serial_numel", 0) >= shards.SHARD_ABOVE)


def own_parts(model, optimizer):
    """This rank's boxes of the model's and the optimizer's tensors, with rank 0's param_groups and the serial
    parameter names in the optimizer's order: what it writes of a sharded checkpoint (a shards.ToWrite)."""
    boxes = []
    for name, tensor in model.state_dict().items():
        key, shape, offsets, local = box(model, name, tensor.detach())
        boxes.append(shards.Box("model/" + key, shape, offsets, local))
    parameters = dict(model.named_parameters())
    for name, param in parameters.items():
        key, shape, offsets, _ = box(model, name, param.detach())
        for slot, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value.dim():
                _, _, _, local = box(model, name, value)
                boxes.append(shards.Box(f"optimizer/{key}/{slot}", shape, offsets, local))
            elif torch.is_tensor(value):  # Adam's step count
                boxes.append(shards.Box(f"optimizer/{key}/{slot}", [], [], value))
    order = getattr(model, "serial_parameter_names", None) or [serial_name(model, name) for name in parameters]
    groups = [{**group, "params": list(range(len(order)))} for group in optimizer.state_dict()["param_groups"]]
    return shards.ToWrite(boxes, {"order": order, "param_groups": groups})


def checkpoint_states(model, optimizer, checkpoint_format="auto"):
    """(model state, optimizer state) for lifecycle/run.save: the serial ones, gathered (serial_state_dict,
    serial_optimizer_state), or, for a sharded checkpoint (writes_sharded), this rank's own parts of both, which it
    writes itself (own_parts, None)."""
    if writes_sharded(model, checkpoint_format):
        return own_parts(model, optimizer), None
    return serial_state_dict(model), serial_optimizer_state(model, optimizer)


def _load_boxes(model, state, path):
    """Load this rank's boxes of a sharded checkpoint's model state (shards.ModelShards) into `model`; one line
    naming the first tensor that does not fit."""
    local, mine = {}, set()
    for name, tensor in model.state_dict().items():
        key, shape, offsets, part = box(model, name, tensor)
        mine.add(key)
        if key not in state:
            raise UserError(f"checkpoint '{path}' has no '{key}'; it was written for another model or config")
        if tuple(state.shape(key)) != tuple(shape):
            raise UserError(f"checkpoint '{path}' holds '{key}' of shape {tuple(state.shape(key))}, but this "
                            f"config's model has {tuple(shape)}; resume with the config that wrote it, or start a "
                            "new --run_num")
        local[name] = _like(tensor, state.read(key, offsets, part.shape))
    unexpected = sorted(key for key in state if key not in mine and not _other_stage(model, key))
    if unexpected:
        raise UserError(f"checkpoint '{path}' holds '{unexpected[0]}', which this config's model does not have; "
                        "resume with the config that wrote it, or start a new --run_num")
    model.load_state_dict(local)


def _like(tensor, part):
    """`part` (this rank's box, read) in the form of the model's `tensor`: its shape and, under FSDP, a DTensor."""
    if isinstance(tensor, DTensor):
        return DTensor.from_local(part.reshape(tensor.to_local().shape).to(tensor.device), tensor.device_mesh,
                                  tensor.placements, shape=tensor.shape, stride=tensor.stride())
    return part.reshape(tensor.shape)


def _load_optimizer_boxes(model, optimizer, state):
    """Load this rank's boxes of a sharded checkpoint's optimizer state (shards.OptimizerShards)."""
    found = {}
    for index, (name, param) in enumerate(model.named_parameters()):
        key, _, offsets, part = box(model, name, param.detach())
        slots = {}
        for slot in state.slots(key):
            if state.shape(key, slot) == ():  # Adam's step count
                slots[slot] = state.read(key, slot)
            else:
                slots[slot] = _like(param.detach(), state.read(key, slot, offsets, part.shape))
        if slots:
            found[index] = slots
    groups = [{**group, "params": list(range(len(list(model.parameters()))))} for group in state.param_groups]
    optimizer.load_state_dict({"state": found, "param_groups": groups})


def serial_state_dict(model):
    """model.state_dict() as the serial model would hold it (collective)."""
    return _from_every_stage(model, {serial_name(model, name): to_serial(model, name, tensor.detach())
                                     for name, tensor in model.state_dict().items()})


def load_serial_state_dict(model, state, path):
    """Load a serial state dict into a (possibly distributed) model; one line naming the first misfit. A sharded
    checkpoint's state: this rank reads its boxes only."""
    if isinstance(state, shards.ModelShards):
        return _load_boxes(model, state, path)
    load_model_state(model, {name: tensor for name, tensor in state.items() if not _other_stage(model, name)},
                     path, saved_name=lambda name: serial_name(model, name),
                     shard=lambda name, tensor: from_serial(model, name, tensor))


def _map_optimizer_state(model, state_dict, convert):
    names = [name for name, _ in model.named_parameters()]  # the optimizer was built on model.parameters()
    state = {}
    for index in sorted(state_dict["state"]):
        state[index] = {key: convert(model, names[index], value) if torch.is_tensor(value) and value.dim() else value
                        for key, value in sorted(state_dict["state"][index].items())}
    return {"state": state, "param_groups": state_dict["param_groups"]}


def serial_optimizer_state(model, optimizer):
    """optimizer.state_dict() with every per-parameter tensor gathered to the serial shape (collective). Under
    pipeline parallelism the parameters are numbered as the serial model's (its named_parameters order)."""
    found = _map_optimizer_state(model, optimizer.state_dict(), to_serial)
    if getattr(model, "pp", None) is None or model.pp.size == 1:
        return found
    names = [serial_name(model, name) for name, _ in model.named_parameters()]
    flat = {f"{names[index]}/{key}": value for index, values in found["state"].items() for key, value in values.items()}
    flat = _from_every_stage(model, flat)
    order = model.serial_parameter_names
    state = {}
    for key, value in flat.items():
        name, _, slot = key.rpartition("/")
        state.setdefault(order.index(name), {})[slot] = value
    groups = [{**group, "params": list(range(len(order)))} for group in found["param_groups"]]
    return {"state": {index: state[index] for index in sorted(state)}, "param_groups": groups}


def load_serial_optimizer_state(model, optimizer, state_dict):
    """Load an optimizer state of the serial layout into the optimizer of a (possibly distributed) model."""
    if isinstance(state_dict, shards.OptimizerShards):
        return _load_optimizer_boxes(model, optimizer, state_dict)
    if getattr(model, "pp", None) is not None and model.pp.size > 1:  # this stage's parameters, renumbered
        order, names = model.serial_parameter_names, [serial_name(model, n) for n, _ in model.named_parameters()]
        state = {names.index(order[index]): values for index, values in state_dict["state"].items()
                 if order[index] in names}
        groups = [{**group, "params": list(range(len(names)))} for group in state_dict["param_groups"]]
        state_dict = {"state": state, "param_groups": groups}
    optimizer.load_state_dict(_map_optimizer_state(model, state_dict, from_serial))


# --- pipeline stages -------------------------------------------------------------------------------------------

def _other_stage(model, name):
    """Whether serial name `name` is held by another pipeline stage than this rank's (a name no stage holds is not:
    the load then names it)."""
    if getattr(model, "pp", None) is None or model.pp.size == 1:
        return False
    block = re.match(r"blocks\.(\d+)\.", name)
    if block:
        return int(block.group(1)) not in model.stage_blocks and int(block.group(1)) < len(model.blocks)
    if name.split(".")[0] in ("patch_embed", "pos_embed"):
        return not model.first_stage
    if name.split(".")[0] in ("norm", "head"):
        return not model.last_stage
    return False


def _from_every_stage(model, local):
    """{name: tensor} of this stage merged with every other stage's, on every stage (collective over "pp"): each
    stage's names, shapes and dtypes go round as JSON in a byte tensor (data, never unpickled), then its tensors,
    flattened into one buffer a dtype, in a broadcast from that stage. The tensors land on the CPU."""
    pp = getattr(model, "pp", None)
    if pp is None or pp.size == 1:
        return local
    device = next(model.parameters()).device
    if device.type == "cuda" and dist.get_backend(pp.group) != "nccl":
        device = torch.device("cpu")
    ranks = dist.get_process_group_ranks(pp.group)
    manifest = json.dumps([[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in local.items()])
    manifests = _all_gather_bytes(manifest.encode(), pp, device)
    merged = {}
    for stage, text in enumerate(manifests):
        entries = json.loads(text)
        for dtype_name in sorted({dtype for _, dtype, _ in entries}):
            dtype = getattr(torch, dtype_name)
            names = [(name, shape) for name, kind, shape in entries if kind == dtype_name]
            numel = sum(int(torch.Size(shape).numel()) for _, shape in names)
            if stage == pp.rank:
                flat = torch.cat([local[name].reshape(-1).to(device, dtype) for name, _ in names])
            else:
                flat = torch.empty(numel, dtype=dtype, device=device)
            dist.broadcast(flat, src=ranks[stage], group=pp.group)
            offset = 0
            for name, shape in names:
                size = int(torch.Size(shape).numel())
                merged[name] = flat[offset:offset + size].view(shape).cpu().clone()
                offset += size
    return merged


def _all_gather_bytes(data, axis, device):
    """Every rank of `axis`'s bytes, in rank order."""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(axis.size)]
    dist.all_gather(lengths, length, group=axis.group)
    longest = max(int(n.item()) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[:len(data)] = torch.tensor(list(data), dtype=torch.uint8, device=device)
    found = [torch.zeros_like(mine) for _ in range(axis.size)]
    dist.all_gather(found, mine, group=axis.group)
    return [bytes(t[:int(n.item())].cpu().tolist()) for t, n in zip(found, lengths)]
