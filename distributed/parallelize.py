"""What train_mp.py applies to the ViT once it is built, in one place and one fixed order (torchtitan's order):

1. tensor, sequence and context parallelism: already in the model (networks/vit.py swaps in the layers of
   layers.py);
2. activation checkpointing (`--activation_checkpointing`): each transformer block keeps only its input for the
   backward pass and recomputes its forward there;
3. data parallelism over "dp": DDP, whose comm hook also sums the gradients of cp-shared weights over "cp"
   (mappings.init_ddp_model_and_reduction_hooks).

A later feature takes its place in this order here, not in the training scripts.
"""
from torch.utils.checkpoint import checkpoint

from distributed.mappings import init_ddp_model_and_reduction_hooks
from utils import comm

PRESERVE_RNG_STATE = True  # the recomputed forward replays the dropout masks of the first (tests switch it off)


def checkpoint_blocks(blocks):
    """Wrap each block's forward in torch.utils.checkpoint (non-reentrant): autograd saves the block's input only,
    and the backward pass runs the block's forward again, with the random state of the first run (same dropout
    masks), before its own backward. The blocks' parameters and state_dict names do not change."""
    for block in blocks:
        forward = block.forward  # the bound method: the recomputation calls it, not the wrapper

        def checkpointed(*inputs, forward=forward):
            return checkpoint(forward, *inputs, use_reentrant=False, preserve_rng_state=PRESERVE_RNG_STATE)

        block.forward = checkpointed


def parallelize(model, args, device):
    """The model with activation checkpointing (if asked for) and wrapped for data parallelism (if distributed and
    not --noddp); the unwrapped model stays what checkpoints hold."""
    if args.activation_checkpointing:
        checkpoint_blocks(model.blocks)
    if comm.get_world_size() > 1 and not args.noddp:
        device_ids = [device.index] if device.type == "cuda" else None
        model = init_ddp_model_and_reduction_hooks(model, device_ids, device_ids, bucket_cap_mb=args.bucket_cap_mb,
                                                   broadcast_buffers=not args.disable_broadcast_buffers,
                                                   gradient_as_bucket_view=args.disable_broadcast_buffers)
    return model
