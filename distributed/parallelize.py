"""What train_mp.py applies to the ViT once it is built, in one place and one fixed order (torchtitan's order):

1. tensor, sequence and context parallelism: already in the model (networks/vit.py swaps in the layers of
   layers.py);
2. activation checkpointing (`--activation_checkpointing`, the layout's `checkpointing`): each transformer
   block keeps only its input for the backward pass and recomputes its forward there;
3. data parallelism over "dp", one of:
   - DDP (the default): whole weights, gradients and Adam moments on every dp rank; its comm hook also sums the
     gradients of cp-shared weights over "cp" (mappings.init_ddp_model_and_reduction_hooks);
   - FSDP2 (`--fsdp`, torch.distributed.fsdp.fully_shard per transformer block and the root, over the "dp" group):
     each rank keeps 1/dp of every parameter (of its tp shard), gradient and Adam moment; a block's weights are
     all-gathered just before its forward and its backward and freed after, and the gradients reduce-scattered
     (averaged over dp). The sums over "cp" and "tp" that DDP's hook does run on the gradient shards just before
     each optimizer step (sum_marked_gradient_shards). The optimizer is built after this: FSDP replaces the
     parameters with sharded ones (DTensors); checkpoints gather them (serial_state).

A later feature takes its place in this order here, not in the training scripts.
"""
import logging

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint

from distributed.mappings import init_ddp_model_and_reduction_hooks, reduce_marked_gradients
from utils import comm
from utils.compat import fsdp_api

PRESERVE_RNG_STATE = True  # the recomputed forward replays the dropout masks of the first (tests switch it off)
SUM_GRADIENT_SHARDS = True  # FSDP: the cp/tp sums of the marked gradients before each step (tests switch it off)
_step_hook = None


def checkpoint_blocks(blocks):
    """Wrap each block's forward in torch.utils.checkpoint (non-reentrant): autograd saves the block's input only,
    and the backward pass runs the block's forward again, with the random state of the first run (same dropout
    masks), before its own backward. The blocks' parameters and state_dict names do not change."""
    for block in blocks:
        forward = block.forward  # the bound method: the recomputation calls it, not the wrapper

        def checkpointed(*inputs, forward=forward):
            return checkpoint(forward, *inputs, use_reentrant=False, preserve_rng_state=PRESERVE_RNG_STATE)

        block.forward = checkpointed


def shard_fully(model, device, params):
    """FSDP2 over "dp": each transformer block is one unit (all-gathered, used, freed in turn), the root holds the
    rest (patch and position embedding, final norm, head). With bf16 or fp16 the all-gathered weights are in that
    precision (MixedPrecisionPolicy: half the bytes moved), so the whole forward runs in it, the residual stream
    included (autocast still runs norms and softmax in fp32), and the gradients are reduced in fp32. The
    shared-weight marks (helpers.mark_shared) move to the sharded parameters."""
    fully_shard, MixedPrecisionPolicy = fsdp_api(device)
    marks = {name: (p.is_shared_mp, p.mark_for_reduction) for name, p in model.named_parameters()
             if hasattr(p, "is_shared_mp")}
    mesh = DeviceMesh.from_group(comm.get_group("dp"), device.type)
    policy = MixedPrecisionPolicy(param_dtype=params.amp_dtype if params.amp_enabled else None,
                                  reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for name, param in model.named_parameters():
        if name in marks:
            param.is_shared_mp, param.mark_for_reduction = marks[name]
    held = sum(param.to_local().numel() for param in model.parameters())
    logging.info(f"FSDP over dp={comm.get_size('dp')}: this rank holds {held:,} of its "
                 f"{sum(param.numel() for param in model.parameters()):,} parameters")
    global _step_hook
    if _step_hook is None:  # once per process
        _step_hook = register_optimizer_step_pre_hook(sum_marked_gradient_shards)
    return model


@torch.no_grad()
def sum_marked_gradient_shards(optimizer, args, kwargs):
    """Optimizer step pre-hook (every optimizer of the process; it acts on FSDP's sharded parameters only): the
    sums over "cp" and "tp" of the marked gradients, and the averages of the copies of shared weights, that DDP's
    comm hook does (mappings.reduce_marked_gradients), here on each rank's gradient shard. The copies of a shared
    weight are sharded alike over dp on every rank of the group they are shared over (same shapes, same dp size),
    so summing the shards sums the whole gradients. The sums are linear, so they commute with loss scaling
    (GradScaler unscales before step(), the fused Adam inside it)."""
    if not SUM_GRADIENT_SHARDS:
        return
    sharded = [(p, p.grad.to_local()) for group in optimizer.param_groups for p in group["params"]
               if p.grad is not None and hasattr(p, "is_shared_mp") and isinstance(p, DTensor)]
    if sharded:
        reduce_marked_gradients(*zip(*sharded))


def parallelize(model, layout, args, device, params):
    """The model with activation checkpointing (if the layout asks for it), then wrapped for data parallelism (if
    distributed and not --noddp): DDP, or FSDP when the layout asks for it (in place, the same module). The
    unwrapped model stays what checkpoints hold; build the optimizer on it after this call."""
    layout.check(noddp=args.noddp, channels_last=bool(params.get("enable_nhwc")))  # what FSDP cannot combine with
    if layout.checkpointing:
        checkpoint_blocks(model.blocks)
    if layout.fsdp and comm.get_world_size() == 1:
        logging.info("--fsdp on one rank: nothing to shard, the model stays whole")
    if comm.get_world_size() > 1 and layout.fsdp:
        return shard_fully(model, device, params)
    if comm.get_world_size() > 1 and not args.noddp:
        device_ids = [device.index] if device.type == "cuda" else None
        model = init_ddp_model_and_reduction_hooks(model, device_ids, device_ids, bucket_cap_mb=args.bucket_cap_mb,
                                                   broadcast_buffers=not args.disable_broadcast_buffers,
                                                   gradient_as_bucket_view=args.disable_broadcast_buffers)
    return model
