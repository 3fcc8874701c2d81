"""Sharded checkpoints: each rank writes only the parts of the serial model's tensors that it holds, and each rank
of a later run, at any layout, reads only the parts it needs (`train_mp.py --checkpoint_format sharded`; the
default for models of SHARD_ABOVE parameters or more).

The serial checkpoint (lifecycle/checkpoint.py, distributed/serial_state.py) gathers the whole model and its Adam
moments on every rank and writes one file: at 10B parameters that is about 120 GB of host memory on every rank, which
no node has. Here, a rank's tensor is a box of the serial tensor: its serial shape, where the box starts along each
dimension (`offsets`) and the box's values (tensor-parallel shards are boxes of rows or columns, FSDP's shards boxes
of rows of those, a pipeline stage's tensors whole boxes). Ranks holding the same box (dp and cp copies) write it
once: the lowest rank of them. Each writing rank saves its boxes, cut along the first dimension into pieces of at most
PIECE_BYTES, to a file of its own, `<checkpoints>/shards/<save>/rank<R>.pt`; then rank 0 writes the checkpoint file
itself, `ckpt.pt`, as before (atomic, its previous one kept, its digest): the iteration, the RNG states, the
scheduler, and the index, every piece's tensor name, serial shape, box, dtype and SHA-256 digest. A kill at any
moment leaves the previous `ckpt.pt` and the shards it names intact: the shards of a save are all written before the
index names them, and a save's folder is removed only once neither checkpoint names it.

Loading: every rank reads `ckpt.pt` (small), then each asks for the boxes of its own layout (ModelShards.read): the
pieces that overlap a box are read (torch.load with mmap: only their bytes are touched), their digests checked, and
the overlaps copied in. train.py and other serial loads ask for whole tensors. Everything loads as data
(weights_only), the index included.
"""
import os
import re
import secrets
import shutil
from collections.abc import Mapping

import torch

from lifecycle.checkpoint import DamagedCheckpoint, read_as_data, state_digest
from resilience import host, store
from utils import comm
from utils.atomic import atomic_path
from utils.errors import UserError, free_space

SHARD_ABOVE = 10 ** 9  # parameters: models this large write sharded checkpoints by default
PIECE_BYTES = 64 << 20  # a box is written in pieces of at most this many bytes (rows of it), each with its digest
READ_ONLY_WHAT_IS_NEEDED = True  # tests switch it off: every piece of a tensor read (the twin of "only its part")
SHARDED = "sharded"  # the checkpoint's "model" entry when its tensors are in shard files


class Box:
    """This rank's part of serial tensor `key` (e.g. 'model/blocks.0.attn.q.weight', 'optimizer/<name>/exp_avg'):
    the serial tensor's `shape`, the box's first index along each dimension (`offsets`) and its values (`tensor`,
    whose shape is the box's lengths)."""

    def __init__(self, key, shape, offsets, tensor):
        self.key, self.tensor = key, tensor
        self.shape, self.offsets = [int(n) for n in shape], [int(o) for o in offsets]

    def where(self):
        return [self.key, self.offsets, list(self.tensor.shape)]


class ToWrite:
    """What a rank hands to save (lifecycle/run.save) instead of a serial state: its boxes, and, from rank 0, the
    optimizer's param_groups and the serial parameter names in the optimizer's order (`meta`)."""

    def __init__(self, boxes, meta):
        self.boxes, self.meta = boxes, meta


def pieces(box, limit=None):
    """The box cut along its first dimension into boxes of at most `limit` (PIECE_BYTES) bytes each (copies: a
    saved view would save its whole storage)."""
    tensor = box.tensor.detach()
    limit = PIECE_BYTES if limit is None else limit
    if tensor.dim() == 0 or tensor.nbytes <= limit:
        return [Box(box.key, box.shape, box.offsets, tensor.cpu().clone())]
    rows = max(1, limit // max(1, tensor[0].nbytes))
    return [Box(box.key, box.shape, [box.offsets[0] + start, *box.offsets[1:]],
                tensor[start:start + rows].cpu().clone()) for start in range(0, tensor.shape[0], rows)]


def shards_folder(checkpoint_path, name=""):
    return os.path.join(os.path.dirname(os.path.abspath(checkpoint_path)), "shards", name)


def write(checkpoint_path, to_write, iteration):
    """Write this rank's boxes of `to_write` (a ToWrite) to its own file in a new folder beside `checkpoint_path`
    (collective: every rank calls it). Returns the index that rank 0 puts in the checkpoint file. A failed write on
    any rank (a full disk) stops every rank with that rank's line; the new folder is removed and the previous
    checkpoint stays."""
    name = store.broadcast_from_rank0(f"it{iteration:09d}-{secrets.token_hex(4)}")
    folder = shards_folder(checkpoint_path, name)
    rank = comm.get_world_rank()
    held = host.gather_on_host([box.where() for box in to_write.boxes])  # who holds what: the lowest rank writes
    first = {}
    for holder, boxes in enumerate(held):
        for where in boxes:
            first.setdefault(repr(where), holder)
    mine = [box for box in to_write.boxes if first[repr(box.where())] == rank and box.tensor.numel()]
    entries, problem = [], None
    if mine:
        file = f"rank{rank:05d}.pt"
        try:
            saved = {}
            for box in mine:
                for piece in pieces(box):
                    slot = str(len(saved))
                    saved[slot] = piece.tensor
                    entries.append([piece.key, piece.shape, piece.offsets, list(piece.tensor.shape),
                                    str(piece.tensor.dtype).removeprefix("torch."), state_digest(piece.tensor),
                                    file, slot])
            with atomic_path(os.path.join(folder, file)) as tmp_path, open(tmp_path, "wb") as f:
                torch.save(saved, f)
        except (OSError, RuntimeError) as err:
            reason = (err.strerror if isinstance(err, OSError) else None) or str(err).strip().splitlines()[-1]
            problem = (f"rank {rank}: writing its checkpoint shard in '{folder}' failed ({reason}; "
                       f"{free_space(folder)} there); the previous checkpoint is kept; free disk space (or choose "
                       "another --expdir) and start again to resume")
    gathered = host.gather_on_host((entries, problem))
    problems = [problem for _, problem in gathered if problem]
    if problems:
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        raise UserError(problems[0])
    return {"folder": name, "pieces": [entry for rank_entries, _ in gathered for entry in rank_entries],
            **to_write.meta}


def remove_unnamed(checkpoint_path, previous_path, current=None):
    """Rank 0, after the checkpoint file was written (its shard folder `current`, None for a serial save): remove the
    shard folders that neither it nor the previous checkpoint names (earlier saves, and saves a crash cut short), and
    the shards folder once it is empty. A previous checkpoint that cannot be read keeps every folder."""
    parent = shards_folder(checkpoint_path)
    if not os.path.isdir(parent):  # no sharded save here (no checkpoint file is read)
        return
    named = {current}
    if os.path.exists(previous_path):
        try:
            previous = read_as_data(previous_path)
        except Exception:  # damaged: which folder it names is unknown, so none is removed
            return
        if isinstance(previous, dict) and isinstance(previous.get("shards"), dict):
            named.add(previous["shards"].get("folder"))
    for name in sorted(os.listdir(parent)):
        if name not in named:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    if not os.listdir(parent):
        os.rmdir(parent)


class Shards:
    """The pieces a sharded checkpoint at `checkpoint_path` names (its index, `checkpoint["shards"]`), read on
    demand: `read(key, offsets, lengths)` is the box of serial tensor `key`, from the pieces that overlap it, each
    read once and its digest checked. `bytes_read`: the bytes of the pieces read so far."""

    def __init__(self, checkpoint_path, index):
        self.path, self.index = checkpoint_path, index
        if not re.fullmatch(r"it\d+-[0-9a-f]+", str(index.get("folder"))):  # never a path outside shards/
            raise self._foreign(f"the folder {index.get('folder')!r}")
        self.folder = shards_folder(checkpoint_path, index["folder"])
        self.by_key = {}
        for key, shape, offsets, lengths, dtype, digest, file, slot in index["pieces"]:
            if not re.fullmatch(r"rank\d+\.pt", str(file)) or not isinstance(getattr(torch, str(dtype), None),
                                                                            torch.dtype):
                raise self._foreign(f"a piece in {file!r} of dtype {dtype!r}")
            self.by_key.setdefault(key, []).append((shape, offsets, lengths, dtype, digest, file, slot))
        self.files, self.checked, self.bytes_read = {}, {}, 0

    def total_bytes(self):
        return sum(torch.Size(lengths).numel() * getattr(torch, dtype).itemsize
                   for _, _, _, lengths, dtype, _, _, _ in self.index["pieces"])

    def describe_read(self):
        """What this rank read of the checkpoint, in one line."""
        return (f"This rank read {self.bytes_read / 1e6:.3f} MB of the checkpoint's {self.total_bytes() / 1e6:.3f} MB "
                f"in {len(self.files)} of its {len({entry[6] for entry in self.index['pieces']})} shard files")

    def keys(self, prefix):
        return [key[len(prefix):] for key in self.by_key if key.startswith(prefix)]

    def shape(self, key):
        return tuple(self.by_key[key][0][0])

    def _piece(self, file, slot, digest):
        if (file, slot) in self.checked:
            return self.checked[file, slot]
        path = os.path.join(self.folder, file)
        if file not in self.files:
            try:
                self.files[file] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:
                raise self._damaged(path, type(err).__name__) from None
        tensor = self.files[file].get(slot) if isinstance(self.files[file], dict) else None
        if not isinstance(tensor, torch.Tensor) or state_digest(tensor) != digest:
            raise self._damaged(path, "a piece's digest differs from the one written")
        self.bytes_read += tensor.nbytes
        self.checked[file, slot] = tensor
        return tensor

    def _foreign(self, what):
        damaged = DamagedCheckpoint(f"checkpoint '{self.path}' names {what}, which no sharded save writes: it is "
                                    f"damaged or not this repository's; move '{self.path}' aside to resume from the "
                                    "previous checkpoint, or start a new --run_num")
        damaged.reason = "a foreign index"
        return damaged

    def _damaged(self, path, reason):
        damaged = DamagedCheckpoint(f"checkpoint '{self.path}': its shard '{path}' cannot be read ({reason}); move "
                                    f"'{self.path}' aside to resume from the previous checkpoint, or start a new "
                                    "--run_num")
        damaged.reason = reason
        return damaged

    def read(self, key, offsets=None, lengths=None):
        """The box of serial tensor `key` starting at `offsets` of `lengths` (None: the whole tensor), on the CPU."""
        entries = self.by_key[key]
        shape = entries[0][0]
        offsets = [0] * len(shape) if offsets is None else list(offsets)
        lengths = list(shape) if lengths is None else list(lengths)
        out = torch.empty(lengths, dtype=getattr(torch, entries[0][3]))
        filled = 0
        for _, start, size, _, digest, file, slot in entries:
            low = [max(a, b) for a, b in zip(start, offsets)]
            high = [min(a + n, b + m) for a, n, b, m in zip(start, size, offsets, lengths)]
            overlaps = all(lo < hi for lo, hi in zip(low, high))
            if not overlaps and READ_ONLY_WHAT_IS_NEEDED:
                continue
            piece = self._piece(file, slot, digest)
            if not overlaps:
                continue
            source = tuple(slice(lo - a, hi - a) for lo, hi, a in zip(low, high, start))
            target = tuple(slice(lo - b, hi - b) for lo, hi, b in zip(low, high, offsets))
            out[target] = piece[source]
            filled += out[target].numel()
        if filled != out.numel():
            raise self._damaged(self.folder, f"the pieces of '{key}' do not cover it")
        return out


class ModelShards(Mapping):
    """A sharded checkpoint's model state as the serial state dict it stands for: name -> whole tensor (what a
    serial load, train.py's, reads); a distributed load asks `read(name, offsets, lengths)` for its box."""

    def __init__(self, shards):
        self.shards, self.names = shards, shards.keys("model/")

    def __getitem__(self, name):
        if name not in self.names:
            raise KeyError(name)
        return self.shards.read("model/" + name)

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)

    def shape(self, name):
        return self.shards.shape("model/" + name)

    def read(self, name, offsets, lengths):
        return self.shards.read("model/" + name, offsets, lengths)


class OptimizerShards:
    """A sharded checkpoint's optimizer state: its param_groups, the serial parameter names in the optimizer's
    order (`order`), each parameter's slots (Adam's step, exp_avg, exp_avg_sq) and their boxes (`read`);
    `whole()` is the serial optimizer.state_dict() (train.py's load)."""

    def __init__(self, shards):
        self.shards, self.order, self.param_groups = shards, shards.index["order"], shards.index["param_groups"]

    def slots(self, name):
        prefix = f"optimizer/{name}/"
        return sorted(self.shards.keys(prefix))

    def shape(self, name, slot):
        return self.shards.shape(f"optimizer/{name}/{slot}")

    def read(self, name, slot, offsets=None, lengths=None):
        return self.shards.read(f"optimizer/{name}/{slot}", offsets, lengths)

    def whole(self):
        state = {index: {slot: self.read(name, slot) for slot in self.slots(name)}
                 for index, name in enumerate(self.order) if self.slots(name)}
        return {"state": state, "param_groups": self.param_groups}


def open_sharded(checkpoint, path):
    """`checkpoint` (a loaded checkpoint file) with its model and optimizer states standing for the shard files it
    names (ModelShards, OptimizerShards), or as it is when it is a serial checkpoint."""
    if checkpoint.get("model") != SHARDED:
        return checkpoint
    shards = Shards(path, checkpoint["shards"])
    return {**checkpoint, "model": ModelShards(shards), "optimizer": OptimizerShards(shards)}


def agree(problem):
    """Every rank's outcome of reading its shards: None where all read theirs; else raise the first rank's line
    (DamagedCheckpoint on every rank: the job stops with one line, instead of ranks waiting for a rank that left)."""
    problems = [p for p in host.gather_on_host(problem) if p]
    if problems:
        raise UserError(problems[0])
