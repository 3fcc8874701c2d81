"""Hand-written tensor (tp), sequence and context (cp) parallelism: the teaching core of the model-parallel stage.

The package is model-agnostic: the layers and mappings know nothing of the ViT (networks/vit.py builds its blocks
from them). What crosses between them is the shared-weight protocol: helpers.mark_shared names, on a parameter, the
groups its copies live on (`is_shared_mp`) and those its gradients are summed over (`mark_for_reduction`);
init_params_for_shared_weights and the DDP hook of data_parallel.py read it. Every group a layer or a collective
works over is handed to it (an Axis of the run's grid, utils/layout.py); nothing here fetches the layout back.

helpers.py       split shapes, the raw collectives (uneven splits work on gloo and NCCL), the shared-weight protocol
mappings.py      autograd functions that move activations between parallel regions (the vocabulary)
layers.py        DistributedMatmul, DistributedMLP, DistributedAttention, DistributedLayerNorm (tp, cp, sequence
                 parallelism)
parallelize.py   the recipe: what train_mp.py applies to the serial ViT, in one function and one order: the tp/cp
                 layers, activation checkpointing, DDP or FSDP, compile
data_parallel.py DDP over "dp" for a split model, and its comm hook for the weights shared over tp and cp
serial_state.py  checkpoints in the serial layout (gather on save, shard on load)
grad_scaler.py   fp16 loss scaling whose skip decision the model-parallel ranks take together
"""
