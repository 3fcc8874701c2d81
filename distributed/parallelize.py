"""The recipe: everything a layout asks of the serial ViT, applied by one function (parallelize), in one fixed order.

    0. pipeline parallelism (`--pipeline_parallel`, pipeline.keep_stage): the model is cut down to this rank's stage
       of consecutive blocks (the first with the patch embedding, the last with the head), before anything else
       splits it;
    1. tensor, sequence and context parallelism (split_tokens_and_weights): each block's attention, MLP and norms
       become the layers of layers.py holding this rank's shard of the serial weights (the attention reaching the
       other cp ranks' keys and values by the layout's cp_method: context_parallel.py), and the model is handed its
       cp and tp groups and split shapes; copies of shared weights are made equal over the model-parallel group;
    2. activation checkpointing (`--activation_checkpointing`, the layout's `checkpointing`): each transformer block
       keeps only its input for the backward pass and recomputes its forward there;
    3. data parallelism over "dp", one of (under pipeline parallelism, not DDP: the pipeline reduces the gradients
       over dp once a step, after its last backward, pipeline.reduce_gradients):
       - DDP (the default): whole weights, gradients and Adam moments on every dp rank; its comm hook also sums the
         gradients of cp-shared weights over "cp" (data_parallel.py);
       - FSDP2 (`--fsdp`, torch.distributed.fsdp.fully_shard per transformer block and the root, over the "dp"
         group): each rank keeps 1/dp of every parameter (of its tp shard), gradient and Adam moment; a block's
         weights are all-gathered just before its forward and its backward and freed after, and the gradients
         reduce-scattered (averaged over dp). The sums over "cp" and "tp" that DDP's hook does run on the gradient
         shards just before each optimizer step (sum_marked_gradient_shards). The optimizer is built after this:
         FSDP replaces the parameters with sharded ones (DTensors); checkpoints gather them (serial_state);
    4. torch.compile (enable_jit) of the wrapped model: compiling the DDP module (rather than the model inside it,
       torchtitan's order for FSDP) lets DDP's graph optimizer split the graph at its buckets, so that each bucket's
       all-reduce starts while the backward goes on;
    5. under pipeline parallelism, the stage is wrapped in the Pipeline that runs the schedules (pipeline.py).

Everything it needs comes in as arguments: the model, the run's grid (utils/layout.Grid, from comm.init) and the
small option objects below; nothing is fetched from a global. A later parallel dimension is one more step here,
with its layers in a file of its own and its rules in utils/layout.py (docs/internals.md).
"""
import functools
import logging
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint

from distributed.bands import Band
from distributed.data_parallel import DDPOptions, init_ddp_model_and_reduction_hooks, reduce_marked_gradients
from distributed.helpers import compute_split_shapes, init_params_for_shared_weights, mark_shared
from distributed.layers import DistributedAttention, DistributedLayerNorm, DistributedMLP
from distributed.pipeline import Pipeline, keep_stage
from utils.compat import fsdp_api

PRESERVE_RNG_STATE = True  # the recomputed forward replays the dropout masks of the first (tests switch it off)
SUM_GRADIENT_SHARDS = True  # FSDP: the cp/tp sums of the marked gradients before each step (tests switch it off)
_step_hook = {}  # "handle": FSDP's optimizer pre-hook, registered for the grid of the latest recipe


@dataclass(frozen=True)
class Options:
    """What the recipe is asked beyond the layout (train_mp.py's flags and config, read once: from_flags)."""
    ddp: DDPOptions = field(default_factory=DDPOptions)  # on or off, bucket size, buffer broadcast
    compile: bool = False  # enable_jit
    param_dtype: torch.dtype = None  # FSDP's all-gathered weights: the autocast dtype (bf16, fp16), or None: fp32
    channels_last: bool = False  # enable_nhwc (FSDP refuses it)

    @classmethod
    def from_flags(cls, args, params):
        return cls(DDPOptions.from_flags(args), bool(params.enable_jit),
                   params.amp_dtype if params.amp_enabled else None, bool(params.get("enable_nhwc")))


def parallelize(model, grid, device, options=Options()):
    """`model` (the serial ViT, on the CPU; moved to `device` after step 0) split, checkpointed, wrapped and compiled
    as the grid's layout and `options` ask, in the order of this module's docstring. The model itself (the same
    module, changed in place by steps 1 and 2) stays what checkpoints hold; build the optimizer on it after this
    call. Returns the model to run. A layout the model or the options cannot take is refused here, in one line,
    before anything changes."""
    layout = grid.layout
    facts = model.layout_facts() if hasattr(model, "layout_facts") else {}  # the ViT's heads, width, tokens, dropout
    layout.check(**facts, noddp=not options.ddp.enabled, channels_last=options.channels_last)
    raw = model
    model.serial_numel = sum(param.numel() for param in model.parameters())  # checkpoints: serial or sharded
    if layout.pp > 1:
        keep_stage(model, layout, grid["pp"])  # 0
    model.to(device)  # built on the CPU: a stage's blocks alone reach the device (the whole 10B model would not fit)
    if layout.model_parallel > 1:
        split_tokens_and_weights(model, grid)  # 1
    if layout.checkpointing:
        checkpoint_blocks(model.held_blocks())  # 2
    if layout.fsdp and layout.world_size == 1:
        logging.info("--fsdp on one rank: nothing to shard, the model stays whole")
    if layout.world_size > 1 and layout.fsdp:  # 3
        model = shard_fully(model, grid, device, options.param_dtype)
    elif layout.world_size > 1 and options.ddp.enabled and layout.pp == 1:
        model = init_ddp_model_and_reduction_hooks(model, grid, device, options.ddp)
    if options.compile:  # 4
        model = torch.compile(model)
    if layout.pp > 1:  # 5: the stages' tokens are fp32, or the dtype FSDP computes in
        model = Pipeline(model, raw, grid, (layout.fsdp and options.param_dtype) or torch.float32)
    return model


def split_tokens_and_weights(model, grid):
    """Swap each block's attention, MLP and norms for their tp/cp versions, loaded with this rank's shard of the serial
    weights: the model equals the serial one built with the same seed. The model is given its cp and tp groups, the
    tokens each cp rank holds and, under sequence parallelism, the tokens each tp rank holds between the blocks."""
    cp, tp = grid["cp"], grid["tp"]
    model.cp, model.tp = cp, tp
    model.cp_shapes = compute_split_shapes(model.h * model.w, cp.size)
    model.band = Band.of(model.img_size, model.patch_size, cp)  # the image rows holding this rank's tokens
    if grid.layout.sequence_parallel and tp.size > 1:  # this rank's cp chunk of tokens is split again over tp
        model.sequence_shapes = compute_split_shapes(model.cp_shapes[cp.rank], tp.size)
    sequence, split_tokens = {"sequence_shapes": model.sequence_shapes}, bool(model.sequence_shapes)
    device = next(model.parameters()).device  # the new layers are built on the CPU, then moved there
    with torch.random.fork_rng(devices=[]):  # the distributed layers' own initialisation must not move the RNG
        for block in model.held_blocks():
            dim, hidden = block.norm1.normalized_shape[0], block.mlp.fc1.out_features
            replacements = {
                "norm1": DistributedLayerNorm(dim, eps=block.norm1.eps, tp=tp, cp=cp, sequence_parallel=split_tokens),
                "attn": DistributedAttention(dim, tp=tp, cp=cp, cp_shapes=model.cp_shapes,
                                             num_heads=block.attn.num_heads, qkv_bias=True,
                                             attn_drop=block.attn.attn_drop, proj_drop=block.attn.proj_drop.p,
                                             cp_method=grid.layout.cp_method, **sequence),
                "norm2": DistributedLayerNorm(dim, eps=block.norm2.eps, tp=tp, cp=cp, sequence_parallel=split_tokens),
                "mlp": DistributedMLP(dim, hidden, tp=tp, cp=cp, drop=block.mlp.drop.p, **sequence),
            }
            for name, layer in replacements.items():
                layer.to(device).load_serial(getattr(block, name))
                setattr(block, name, layer)
    # the final norm sees only this rank's tokens, so its gradients are partial over cp and are summed there
    # (upstream left them unreduced and the copies drifted apart)
    # and so do the patch and position embeddings, which see only this rank's band of the image (bands.py)
    # (a pipeline stage holds them only if it is the first or the last)
    for param in [*(model.norm.parameters() if model.norm else []),
                  *(model.patch_embed.parameters() if model.patch_embed else []),
                  *([model.pos_embed] if model.pos_embed is not None else [])]:
        mark_shared(param, ["tp-cp"], ["cp"])
    init_params_for_shared_weights(model, grid)  # copies of shared weights equal across the model-parallel group
    return model


def checkpoint_blocks(blocks):
    """Wrap each block's forward in torch.utils.checkpoint (non-reentrant): autograd saves the block's input only,
    and the backward pass runs the block's forward again, with the random state of the first run (same dropout
    masks), before its own backward. The blocks' parameters and state_dict names do not change."""
    for block in blocks:
        forward = block.forward  # the bound method: the recomputation calls it, not the wrapper

        def checkpointed(*inputs, forward=forward):
            return checkpoint(forward, *inputs, use_reentrant=False, preserve_rng_state=PRESERVE_RNG_STATE)

        block.forward = checkpointed


def shard_fully(model, grid, device, param_dtype=None):
    """FSDP2 over the grid's "dp": each transformer block is one unit (all-gathered, used, freed in turn), the root
    holds the rest (patch and position embedding, final norm, head). With `param_dtype` (bf16 or fp16) the
    all-gathered weights are in that precision (MixedPrecisionPolicy: half the bytes moved), so the whole forward
    runs in it, the residual stream included (autocast still runs norms and softmax in fp32), and the gradients are
    reduced in fp32. The shared-weight marks (helpers.mark_shared) move to the sharded parameters."""
    fully_shard, MixedPrecisionPolicy = fsdp_api(device)
    marks = {name: (p.is_shared_mp, p.mark_for_reduction) for name, p in model.named_parameters()
             if hasattr(p, "is_shared_mp")}
    mesh = DeviceMesh.from_group(grid["dp"].group, device.type)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.held_blocks():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for name, param in model.named_parameters():
        if name in marks:
            param.is_shared_mp, param.mark_for_reduction = marks[name]
    held = sum(param.to_local().numel() for param in model.parameters())
    logging.info(f"FSDP over dp={grid.size('dp')}: this rank holds {held:,} of its "
                 f"{sum(param.numel() for param in model.parameters()):,} parameters")
    if "handle" in _step_hook:  # one hook a process (it acts on every optimizer), for this grid's groups
        _step_hook.pop("handle").remove()
    _step_hook["handle"] = register_optimizer_step_pre_hook(functools.partial(sum_marked_gradient_shards, grid))
    return model


@torch.no_grad()
def sum_marked_gradient_shards(grid, optimizer, args, kwargs):
    """Optimizer step pre-hook (every optimizer of the process; it acts on FSDP's sharded parameters only): the
    sums over "cp" and "tp" of the marked gradients, and the averages of the copies of shared weights, that DDP's
    comm hook does (data_parallel.reduce_marked_gradients), here on each rank's gradient shard. The copies of a
    shared weight are sharded alike over dp on every rank of the group they are shared over (same shapes, same dp
    size), so summing the shards sums the whole gradients. The sums are linear, so they commute with loss scaling
    (GradScaler unscales before step(), the fused Adam inside it)."""
    if not SUM_GRADIENT_SHARDS:
        return
    sharded = [(p, p.grad.to_local()) for group in optimizer.param_groups for p in group["params"]
               if p.grad is not None and hasattr(p, "is_shared_mp") and isinstance(p, DTensor)]
    if sharded:
        reduce_marked_gradients(grid, *zip(*sharded))
