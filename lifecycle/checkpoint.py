"""Checkpoints written atomically: a kill or a full disk at any moment leaves the previous checkpoint intact.

A run directory keeps two: checkpoints/ckpt.pt and the one before it, ckpt_previous.pt. When the newest is damaged
(a write cut short by a failing file system, a zeroed file) the run resumes from the previous one and says so.
"""
import logging
import os
import random

import numpy as np
import torch

from utils import comm
from utils.atomic import atomic_path, free_space
from utils.errors import UserError


class DamagedCheckpoint(UserError):
    """A checkpoint file that torch.load cannot read."""


def previous_path(path):
    """Where the checkpoint before `path` is kept: ckpt.pt -> ckpt_previous.pt."""
    root, ext = os.path.splitext(path)
    return f"{root}_previous{ext}"


def save_checkpoint(path, state):
    """torch.save to `<path>.tmp`, flushed to disk, then the current `path` becomes previous_path(path) and the new
    file takes its place. A failed write (disk full, quota) removes the temporary file, keeps the checkpoints there
    were and raises a UserError naming the folder and its free space."""
    try:
        with atomic_path(path, keep_previous=previous_path(path)) as tmp_path, open(tmp_path, "wb") as f:
            torch.save(state, f)
    except (OSError, RuntimeError) as err:
        message = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        if isinstance(err, OSError):
            reason = err.strerror or message
        elif "inline_container" in str(err) or "PytorchStreamWriter" in str(err):
            # torch's zip writer says only "[enforce fail at inline_container.cc:...] . unexpected pos ..."
            reason = "the disk is full or over its quota: the file system took fewer bytes than torch wrote"
        else:
            reason = message
        folder = os.path.dirname(os.path.abspath(path))
        kept = "the previous checkpoint is kept" if os.path.isfile(path) else "there was no earlier checkpoint"
        raise UserError(f"writing checkpoint '{path}' failed ({reason}; {free_space(folder)} in '{folder}'); the "
                        f"partial file was removed and {kept}; free disk space (or choose another --expdir) and "
                        "start again to resume") from None


def load_checkpoint(path):
    """The checkpoint dict at `path`, on the CPU; DamagedCheckpoint when the file cannot be read."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint '{path}' not found; pass an existing file to --resume")
    try:
        # our own files hold numpy/python RNG states, which weights_only loading refuses
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise DamagedCheckpoint(f"checkpoint '{path}' cannot be read ({type(err).__name__}): it is damaged, "
                                "incomplete (a write cut short, a failing file system) or not a checkpoint; pass "
                                "another checkpoint to --resume") from None


def load_newest_checkpoint(path):
    """(checkpoint, the file it came from): `path`, or the previous checkpoint when `path` is damaged or missing
    (a crash between the two renames of save_checkpoint), saying so on rank 0."""
    previous = previous_path(path)
    if not os.path.isfile(path):
        why = f"checkpoint '{path}' is missing"
    else:
        try:
            return load_checkpoint(path), path
        except DamagedCheckpoint as err:
            why = str(err).rsplit("; pass another", 1)[0]  # the run directory's own: --resume would not be read
            if not os.path.isfile(previous):
                raise UserError(f"{why}, and there is no previous one; move it away to train from the beginning "
                                "here, or start a new --run_num (or --expdir)") from None
    try:
        checkpoint = load_checkpoint(previous)
    except DamagedCheckpoint:
        raise UserError(f"{why}, and the previous one, '{previous}', is damaged or incomplete too; start a new "
                        "--run_num (or --expdir) to train from the beginning") from None
    if comm.get_world_rank() == 0:
        logging.warning(f"{why}; resuming from the previous checkpoint '{previous}' (iteration "
                        f"{checkpoint.get('iteration', '?') if isinstance(checkpoint, dict) else '?'})")
    return checkpoint, previous


def load_model_state(model, state, path, saved_name=lambda name: name, shard=lambda name, tensor: tensor):
    """model.load_state_dict(state), after checking that names and shapes fit; else one line naming the first
    parameter that does not. A model-parallel model passes the saved (serial) name of each of its parameters
    and the function that cuts its shard out of the saved tensor (distributed/serial_state.py)."""
    local = {}
    for name, param in model.state_dict().items():
        key = saved_name(name)
        if key not in state:
            raise UserError(f"checkpoint '{path}' has no '{key}'; it was written for another model or config")
        local[name] = shard(name, state[key])
        if tuple(local[name].shape) != tuple(param.shape):
            sharded = " (this rank's shard)" if tuple(local[name].shape) != tuple(state[key].shape) else ""
            raise UserError(f"checkpoint '{path}' holds '{key}' of shape {tuple(state[key].shape)}, but this "
                            f"config's model has {tuple(param.shape)}{sharded}; resume with the config that wrote "
                            "it, or start a new --run_num")
    unexpected = sorted(set(state) - {saved_name(name) for name in local})
    if unexpected:
        raise UserError(f"checkpoint '{path}' holds '{unexpected[0]}', which this config's model does not have; "
                        "resume with the config that wrote it, or start a new --run_num")
    model.load_state_dict(local)


def get_rng_states():
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states):
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
