"""Which ranks form each process group, from the parallel sizes and an order string (Megatron-LM's scheme).

The job's ranks are laid out on a grid with one axis per parallel dimension: tp (tensor), cp (context),
dp (data), pp (pipeline). The order string names the axes from fastest to slowest: its FIRST name varies
fastest, so with order "a-b-c" a rank's global number is a + size_a * (b + size_b * c). A group of type "x"
holds the ranks that differ only along axis x; "x-y" groups vary along both.

Worked example, 8 ranks, tp=2, cp=2, dp=2, order "tp-cp-dp" (rank = tp + 2 cp + 4 dp):

    tp     [[0, 1], [2, 3], [4, 5], [6, 7]]      neighbours: the fastest axis
    cp     [[0, 2], [1, 3], [4, 6], [5, 7]]
    dp     [[0, 4], [1, 5], [2, 6], [3, 7]]      the slowest axis: one rank from each half of the job
    tp-cp  [[0, 1, 2, 3], [4, 5, 6, 7]]
    dp-cp  [[0, 2, 4, 6], [1, 3, 5, 7]]

Put the most talkative dimension first (tp usually), so that its groups are neighbouring ranks on one node.
A dimension of size 1 may be left out of the order (it is appended, in the order tp, pp, dp, cp); one of
any other size may not. utils/check_rank_generator.ipynb prints these tables for other sizes and orders.
"""
import itertools
import math

from utils.errors import UserError

_NAMES = ("tp", "pp", "dp", "cp")  # order in which size-1 names missing from the order string are appended


def _indices(shape):
    """Every index tuple of a grid of `shape`, the FIRST index varying fastest."""
    for reversed_index in itertools.product(*(range(size) for size in reversed(shape))):
        yield reversed_index[::-1]


class RankGenerator:
    """Rank lists of the process groups of a tp x cp x dp x pp grid laid out in `order` (first name fastest);
    `rank_offset` is added to every rank (for a grid that starts at a later global rank)."""

    def __init__(self, tp, dp, pp, cp, order, rank_offset=0):
        self.sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp}
        for name, size in self.sizes.items():
            if not isinstance(size, int) or size < 1:
                raise UserError(f"the {name} size is {size!r}; give a whole number of ranks, at least 1")
        self.rank_offset = rank_offset
        tokens = str(order).lower().split("-")
        unknown = [token for token in tokens if token not in self.sizes]
        if unknown:
            raise UserError(f"order '{order}' names {', '.join(map(repr, unknown))}; use the names tp, cp, dp, pp "
                            "joined by '-', e.g. 'tp-cp-dp'")
        repeated = sorted({token for token in tokens if tokens.count(token) > 1})
        if repeated:
            raise UserError(f"order '{order}' names {', '.join(repeated)} more than once; name each dimension once")
        named = list(tokens)
        for name in _NAMES:
            if name not in tokens:
                if self.sizes[name] != 1:
                    raise UserError(f"the size of {name} is {self.sizes[name]}, but the order '{order}' does not "
                                    f"name it; add {name} to the order (e.g. '{'-'.join(named + [name])}')")
                tokens.append(name)
        self.tokens = tokens
        self.order = "-".join(tokens)
        self.world_size = math.prod(self.sizes[token] for token in tokens)

    def get_ranks(self, token):
        """Every group of type `token` ("dp", "tp", "tp-cp", ...): the lists of ranks that differ only along
        the named dimensions, each list ordered with the first named axis of the order fastest."""
        names = str(token).lower().split("-")
        unknown = [name for name in names if name not in self.sizes]
        if unknown:
            raise UserError(f"group type '{token}' names {', '.join(map(repr, unknown))}; use tp, cp, dp, pp "
                            "joined by '-'")
        strides = {}  # the distance between ranks one step apart along each axis
        stride = 1
        for axis in self.tokens:
            strides[axis] = stride
            stride *= self.sizes[axis]
        inside = [axis for axis in self.tokens if axis in names]  # varies within a group
        across = [axis for axis in self.tokens if axis not in names]  # fixed within a group, varies between
        groups = []
        for group_index in _indices([self.sizes[axis] for axis in across]):
            base = sum(i * strides[axis] for i, axis in zip(group_index, across))
            groups.append([self.rank_offset + base + sum(i * strides[axis] for i, axis in zip(rank_index, inside))
                           for rank_index in _indices([self.sizes[axis] for axis in inside])])
        return groups
