"""Sharded checkpoints' files (lifecycle/shards.py), in one process: boxes written in pieces with their digests, read
back box by box, each read touching only the pieces it needs; a damaged, missing or foreign piece refused in one line
(nothing in it run); a full disk stops the save and keeps nothing half written; earlier saves' folders removed once
no checkpoint names them. The end-to-end resumes across layouts and the kill -9: tests/training/test_pipeline.py.
"""
import errno
import os
import re

import pytest
import torch

from lifecycle import shards
from lifecycle.checkpoint import DamagedCheckpoint
from utils.errors import UserError

pytestmark = pytest.mark.compat  # torch 2.5's torch.load(mmap=True) and weights_only too


def two_halves(weight):
    """The boxes two tp ranks would hand over for a column-parallel weight: rows 0-3 and 4-7 of 8."""
    return [shards.Box("model/w", weight.shape, [0, 0], weight[:4]), shards.Box("model/w", weight.shape, [4, 0],
                                                                               weight[4:])]


def saved(tmp_path, boxes, meta=None):
    """A sharded save of `boxes` (one process writes them all) and its reader."""
    path = str(tmp_path / "checkpoints" / "ckpt.pt")
    index = shards.write(path, shards.ToWrite(boxes, meta or {}), 3)
    return path, index, shards.Shards(path, index)


def test_a_box_is_read_from_the_pieces_it_overlaps_and_no_others(tmp_path):
    weight = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    _, index, reader = saved(tmp_path, two_halves(weight))
    assert len(index["pieces"]) == 2 and index["folder"].startswith("it000000003-")
    assert torch.equal(reader.read("model/w", [4, 0], [4, 6]), weight[4:])
    assert reader.bytes_read == weight[4:].nbytes  # only the second half was read
    assert torch.equal(reader.read("model/w", [2, 1], [4, 3]), weight[2:6, 1:4])  # across both pieces
    assert torch.equal(reader.read("model/w"), weight) and reader.bytes_read == weight.nbytes
    assert reader.total_bytes() == weight.nbytes


def test_twin_reading_every_piece_of_a_tensor_is_seen_in_the_bytes_read(tmp_path, monkeypatch):
    weight = torch.randn(8, 6)
    _, _, reader = saved(tmp_path, two_halves(weight))
    monkeypatch.setattr(shards, "READ_ONLY_WHAT_IS_NEEDED", False)
    assert torch.equal(reader.read("model/w", [4, 0], [4, 6]), weight[4:])  # the values are still right
    assert reader.bytes_read == weight.nbytes  # but the whole tensor was read


def test_large_boxes_are_written_in_pieces_each_with_its_digest(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "PIECE_BYTES", 3 * 6 * 4)  # 3 rows of 6 floats
    weight, step = torch.randn(8, 6), torch.tensor(7.0)
    _, index, reader = saved(tmp_path, [shards.Box("optimizer/w/exp_avg", weight.shape, [0, 0], weight),
                                        shards.Box("optimizer/w/step", [], [], step)])
    rows = [entry[3][0] for entry in index["pieces"] if entry[0] == "optimizer/w/exp_avg"]
    assert rows == [3, 3, 2] and len({entry[5] for entry in index["pieces"]}) == 4  # 4 digests, all different
    assert torch.equal(reader.read("optimizer/w/exp_avg", [3, 0], [3, 6]), weight[3:6])
    assert reader.bytes_read == weight[3:6].nbytes
    assert torch.equal(reader.read("optimizer/w/step"), step) and reader.shape("optimizer/w/step") == ()


def test_a_box_no_piece_covers_is_refused(tmp_path):
    weight = torch.randn(8, 6)
    _, _, reader = saved(tmp_path, two_halves(weight)[:1])  # rows 4-7 were never written
    with pytest.raises(DamagedCheckpoint, match="the pieces of 'model/w' do not cover it"):
        reader.read("model/w")


@pytest.mark.parametrize("rank0_holds, written", [(2, []), (1, [[4, 0]])], ids=["the-same-boxes", "half"])
def test_a_box_several_ranks_hold_is_written_by_the_lowest_of_them(tmp_path, monkeypatch, rank0_holds, written):
    """As rank 1 of 2, as dp or cp ranks' copies are: a box rank 0 holds too is rank 0's to write."""
    weight = torch.randn(8, 6)
    mine = two_halves(weight)
    calls = []

    def gather(value):  # rank 0's value first: in the first call, the boxes it holds
        calls.append(value)
        return [[box.where() for box in mine[:rank0_holds]], value] if len(calls) == 1 else [([], None), value]

    monkeypatch.setattr(shards.comm, "get_world_rank", lambda: 1)
    monkeypatch.setattr(shards.host, "gather_on_host", gather)
    index = shards.write(str(tmp_path / "ckpt.pt"), shards.ToWrite(mine, {}), 1)
    assert [entry[2] for entry in index["pieces"]] == written
    assert all(entry[6] == "rank00001.pt" for entry in index["pieces"])


def flip_a_byte_of(path, value):
    """Change the first occurrence of float `value`'s bytes in the file at `path` (a piece's data)."""
    data = bytearray(open(path, "rb").read())
    needle = bytes(torch.tensor([value], dtype=torch.float32).numpy().tobytes())
    at = data.find(needle)
    assert at >= 0
    data[at] ^= 0x01
    open(path, "wb").write(bytes(data))


def test_a_damaged_piece_is_refused_in_one_line_naming_the_shard(tmp_path):
    weight = torch.arange(1, 8 * 6 + 1, dtype=torch.float32).view(8, 6)
    path, index, reader = saved(tmp_path, two_halves(weight))
    shard = os.path.join(shards.shards_folder(path, index["folder"]), "rank00000.pt")
    flip_a_byte_of(shard, 30.0)  # in rows 4-7
    assert torch.equal(reader.read("model/w", [0, 0], [4, 6]), weight[:4])  # the intact piece still reads
    with pytest.raises(DamagedCheckpoint, match=r"its shard '.*rank00000.pt' cannot be read \(a piece's digest "
                                                r"differs from the one written\); move '.*ckpt.pt' aside"):
        reader.read("model/w", [4, 0], [4, 6])


def test_a_missing_or_foreign_shard_file_is_refused_and_nothing_in_it_runs(tmp_path):
    weight = torch.randn(8, 6)
    path, index, _ = saved(tmp_path, two_halves(weight))
    shard = os.path.join(shards.shards_folder(path, index["folder"]), "rank00000.pt")
    os.remove(shard)
    with pytest.raises(DamagedCheckpoint, match="cannot be read"):
        shards.Shards(path, index).read("model/w")
    marker = tmp_path / "ran"
    torch.save({"0": Calls(str(marker))}, shard)  # a pickle that would call os.system-like code
    with pytest.raises(DamagedCheckpoint, match="cannot be read"):
        shards.Shards(path, index).read("model/w")
    assert not marker.exists()


@pytest.mark.parametrize("field, value, words", [
    ("folder", "../../elsewhere", "names the folder '../../elsewhere'"),
    ("file", "../ckpt.pt", "names a piece in '../ckpt.pt'"),
    ("dtype", "load", "of dtype 'load'")])
def test_an_index_naming_anything_outside_its_shards_folder_is_refused(tmp_path, field, value, words):
    path, index, _ = saved(tmp_path, two_halves(torch.randn(8, 6)))
    if field == "folder":
        index = {**index, "folder": value}
    else:
        column = {"file": 6, "dtype": 4}[field]
        index = {**index, "pieces": [[*entry[:column], value, *entry[column + 1:]] for entry in index["pieces"]]}
    with pytest.raises(DamagedCheckpoint, match=re.escape(words) + r".*, which no sharded save writes"):
        shards.Shards(path, index)


class Calls:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_full_disk_stops_the_save_and_leaves_no_folder(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shards.torch, "save", full)
    with pytest.raises(UserError, match=r"rank 0: writing its checkpoint shard in '.*' failed \(No space left on "
                                        r"device; .*\); the previous checkpoint is kept; free disk space"):
        saved(tmp_path, two_halves(torch.randn(8, 6)))
    assert os.listdir(tmp_path / "checkpoints" / "shards") == []


def test_folders_no_checkpoint_names_are_removed(tmp_path):
    path = str(tmp_path / "checkpoints" / "ckpt.pt")
    previous = str(tmp_path / "checkpoints" / "ckpt_previous.pt")
    names = [shards.write(path, shards.ToWrite(two_halves(torch.randn(8, 6)), {}), i)["folder"] for i in (1, 2, 3)]
    torch.save({"shards": {"folder": names[1]}}, previous)
    torch.save({"shards": {"folder": names[2]}}, path)
    shards.remove_unnamed(path, previous, names[2])
    assert sorted(os.listdir(shards.shards_folder(path))) == names[1:]
    open(previous, "wb").write(b"garbage")  # which folder a damaged previous names is unknown: none is removed
    extra = shards.write(path, shards.ToWrite(two_halves(torch.randn(8, 6)), {}), 4)["folder"]
    shards.remove_unnamed(path, previous, names[2])
    assert sorted(os.listdir(shards.shards_folder(path))) == [*names[1:], extra]
    torch.save({"model": {}}, path)  # serial saves since: no folder is named, and the emptied shards folder goes
    torch.save({"model": {}}, previous)
    shards.remove_unnamed(path, previous)
    assert not os.path.exists(shards.shards_folder(path))


def test_a_serial_load_reads_whole_tensors_and_the_optimizer_state(tmp_path):
    weight, moment, step = torch.randn(8, 6), torch.randn(8, 6), torch.tensor(3.0)
    boxes = [*two_halves(weight), shards.Box("optimizer/w/exp_avg", weight.shape, [0, 0], moment),
             shards.Box("optimizer/w/step", [], [], step)]
    path, index, _ = saved(tmp_path, boxes, {"order": ["w"], "param_groups": [{"lr": 0.1, "params": [0]}]})
    checkpoint = shards.open_sharded({"model": shards.SHARDED, "shards": index}, path)
    assert dict(checkpoint["model"]).keys() == {"w"} and torch.equal(checkpoint["model"]["w"], weight)
    whole = checkpoint["optimizer"].whole()
    assert whole["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert torch.equal(whole["state"][0]["exp_avg"], moment) and torch.equal(whole["state"][0]["step"], step)
    serial = {"model": {"w": weight}}
    assert shards.open_sharded(serial, path) is serial  # a serial checkpoint is as it was
