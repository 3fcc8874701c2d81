"""Exercise: split the ViT's MLP over a tensor-parallel ("tp") group of ranks.

The serial MLP (networks/vit.py, repeated below as SerialMLP) is y = fc2(gelu(fc1(x))) with
fc1: dim -> hidden and fc2: hidden -> dim. Tensor parallelism splits the hidden width over the N ranks of
the group: each rank keeps hidden / N of the hidden features, so

* fc1 is column-parallel: each rank keeps a slice of fc1's output features (rows of fc1.weight, and the
  matching entries of fc1.bias) and computes its slice of the hidden activations from the whole input x;
  GELU acts elementwise, so it needs no communication;
* fc2 is row-parallel: each rank keeps the matching slice of fc2's input features (columns of fc2.weight)
  and computes a partial product; the sum of the partial products over the ranks is the serial
  fc2.weight @ h. That sum is one all-reduce; fc2's bias must be added once, after it.

In the backward pass the same pair of collectives appears in reverse: every rank's slice of fc1 contributes
to the gradient of x, so the input gradient must be summed over the ranks too. distributed/mappings.py has
the two autograd functions that do exactly this:

* copy_to_parallel_region(x, name): forward identity, backward all-reduce (enter the column-parallel layer);
* reduce_from_parallel_region(x, name): forward all-reduce, backward identity (leave the row-parallel layer).

Fill in the three TODOs of ExerciseMLP below, then check your answer against the serial MLP:

    python -m exercises.check_tp_mlp --nproc 2

As given, the class runs but is right only on one rank. The answer is in exercises/tp_mlp_solution.py.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: F401 (for TODO 3)

from distributed.mappings import copy_to_parallel_region, reduce_from_parallel_region  # noqa: F401 (TODO 2, 3)
from utils import comm


class SerialMLP(nn.Module):
    """The serial MLP, for reference (the same math as networks.vit.MLP, which the checker compares with)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)  # weight: (hidden, dim), bias: (hidden,)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)  # weight: (dim, hidden), bias: (dim,)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ExerciseMLP(nn.Module):
    """The MLP with its hidden width split over the ranks of the process group `comm_name` (fc1 column-parallel,
    fc2 row-parallel). Keep the names fc1, act, fc2: the checker compares their gradients with the serial ones."""

    def __init__(self, dim, hidden, comm_name="tp"):
        super().__init__()
        self.comm_name = comm_name
        size = comm.get_size(comm_name)  # 1 when the group does not exist: then this is the serial MLP
        if hidden % size:
            raise ValueError(f"the hidden width {hidden} does not divide over {size} ranks")
        # Given: every rank holds hidden / size of the hidden features, so the shapes are already the local ones.
        self.hidden_local = hidden // size
        self.fc1 = nn.Linear(dim, self.hidden_local)  # weight: (hidden_local, dim), bias: (hidden_local,)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(self.hidden_local, dim)  # weight: (dim, hidden_local), bias: (dim,) (whole)

    @torch.no_grad()
    def load_serial(self, serial_mlp):
        """Copy this rank's shard of a serial MLP's weights (so that both compute the same function)."""
        # ------------------------------------------------------------------------------------------------
        # TODO 1: which hidden features does this rank keep? Rank r of the group (comm.get_rank(self.comm_name),
        # 0 .. size - 1) keeps the r-th consecutive block of hidden_local features. The placeholder gives every
        # rank the block of rank 0.
        start, stop = 0, self.hidden_local
        # ------------------------------------------------------------------------------------------------
        # fc1 is column-parallel: this rank's rows of the weight and entries of the bias
        self.fc1.weight.copy_(serial_mlp.fc1.weight[start:stop, :])
        self.fc1.bias.copy_(serial_mlp.fc1.bias[start:stop])
        # fc2 is row-parallel: this rank's columns of the weight; the bias is whole on every rank
        self.fc2.weight.copy_(serial_mlp.fc2.weight[:, start:stop])
        self.fc2.bias.copy_(serial_mlp.fc2.bias)

    def forward(self, x):
        # ------------------------------------------------------------------------------------------------
        # TODO 2: enter the parallel region. The forward pass needs nothing (every rank sees the whole x),
        # but the backward pass must sum the gradient of x over the ranks of self.comm_name: each rank's
        # slice of fc1 gives only part of it. Which function of distributed.mappings does that?
        # ------------------------------------------------------------------------------------------------
        h = self.act(self.fc1(x))  # this rank's slice of the hidden activations: (..., hidden_local)
        # ------------------------------------------------------------------------------------------------
        # TODO 3: leave the parallel region. fc2's partial products (F.linear(h, self.fc2.weight), no bias)
        # must be summed over the ranks of self.comm_name, and fc2's bias added ONCE, after the sum (added
        # before it, the bias would count size times). The placeholder adds the bias and sums nothing.
        y = self.fc2(h)
        # ------------------------------------------------------------------------------------------------
        return y
