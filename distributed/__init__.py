"""Hand-written tensor (tp), sequence and context (cp) parallelism: the teaching core of the model-parallel stage.

The package is model-agnostic: the layers and mappings know nothing of the ViT (networks/vit.py builds its blocks
from them). What crosses between them is the shared-weight protocol: helpers.mark_shared names, on a parameter, the
groups its copies live on (`is_shared_mp`) and those its gradients are summed over (`mark_for_reduction`);
init_params_for_shared_weights and the DDP hook of mappings.py read it.

helpers.py       split shapes, the raw collectives (uneven splits work on gloo and NCCL), the shared-weight protocol
mappings.py      autograd functions that move activations between parallel regions, and the DDP wrapper
layers.py        DistributedMatmul, DistributedMLP, DistributedAttention, DistributedLayerNorm (tp, cp, sequence
                 parallelism)
parallelize.py   what train_mp.py applies after building the model, in one order: activation checkpointing, DDP
serial_state.py  checkpoints in the serial layout (gather on save, shard on load)
grad_scaler.py   fp16 loss scaling whose skip decision the model-parallel ranks take together
"""
