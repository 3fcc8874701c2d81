"""Solution of exercises/tp_mlp_exercise.py: the MLP with its hidden width split over a tensor-parallel group.

fc1 is column-parallel (rank r keeps rows r * hidden_local .. (r + 1) * hidden_local of fc1.weight and fc1.bias),
fc2 row-parallel (the same columns of fc2.weight, the whole bias). One collective each way per MLP: the
partial products of fc2 are all-reduced in the forward pass (reduce_from_parallel_region), the gradient of
the input in the backward pass (copy_to_parallel_region), and fc2's bias is added once, after the sum.
distributed/layers.py (DistributedMLP) is the same lesson, in the form the ViT uses.

    python -m exercises.check_tp_mlp --nproc 2 --solution
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed.mappings import copy_to_parallel_region, reduce_from_parallel_region
from utils import comm


class ExerciseMLP(nn.Module):
    """The MLP with its hidden width split over the ranks of the process group `comm_name` (fc1 column-parallel,
    fc2 row-parallel)."""

    def __init__(self, dim, hidden, comm_name="tp"):
        super().__init__()
        self.comm_name = comm_name
        size = comm.get_size(comm_name)  # 1 when the group does not exist: then this is the serial MLP
        if hidden % size:
            raise ValueError(f"the hidden width {hidden} does not divide over {size} ranks")
        self.hidden_local = hidden // size
        self.fc1 = nn.Linear(dim, self.hidden_local)  # weight: (hidden_local, dim), bias: (hidden_local,)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(self.hidden_local, dim)  # weight: (dim, hidden_local), bias: (dim,) (whole)

    @torch.no_grad()
    def load_serial(self, serial_mlp):
        """Copy this rank's shard of a serial MLP's weights (so that both compute the same function)."""
        # TODO 1: rank r keeps the r-th consecutive block of hidden_local features
        start = comm.get_rank(self.comm_name) * self.hidden_local
        stop = start + self.hidden_local
        self.fc1.weight.copy_(serial_mlp.fc1.weight[start:stop, :])
        self.fc1.bias.copy_(serial_mlp.fc1.bias[start:stop])
        self.fc2.weight.copy_(serial_mlp.fc2.weight[:, start:stop])
        self.fc2.bias.copy_(serial_mlp.fc2.bias)

    def forward(self, x):
        # TODO 2: identity forward; the gradient of x is summed over the ranks backward
        x = copy_to_parallel_region(x, self.comm_name)
        h = self.act(self.fc1(x))  # this rank's slice of the hidden activations
        # TODO 3: sum the partial products over the ranks, then add the bias once
        y = reduce_from_parallel_region(F.linear(h, self.fc2.weight), self.comm_name)
        return y + self.fc2.bias
