"""Hand-written tensor (tp) and context (cp) parallelism: the teaching core of the model-parallel stage.

helpers.py   split shapes and the raw collectives (uneven splits work on gloo and NCCL)
mappings.py  autograd functions that move activations between parallel regions, and the DDP wrapper
layers.py    DistributedMatmul, DistributedMLP, DistributedAttention, DistributedLayerNorm
"""
