"""Checkpoints written atomically: a kill or a full disk at any moment leaves the previous checkpoint intact."""
import os
import random

import numpy as np
import torch

from utils.atomic import atomic_path
from utils.errors import UserError


def save_checkpoint(path, state):
    """torch.save to `<path>.tmp`, flushed to disk, renamed over `path`. A failed write (disk full, quota)
    removes the temporary file, keeps the previous checkpoint and raises a UserError that says so."""
    try:
        with atomic_path(path) as tmp_path, open(tmp_path, "wb") as f:
            torch.save(state, f)
    except OSError as err:
        kept = ("the previous checkpoint is kept" if os.path.isfile(path)
                else "there was no earlier checkpoint")
        raise UserError(f"writing checkpoint '{path}' failed ({err.strerror or err}); the partial file was removed "
                        f"and {kept}; free disk space (or choose another --expdir) and start again to resume") from None


def load_checkpoint(path):
    """The checkpoint dict at `path`, on the CPU."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint '{path}' not found; pass an existing file to --resume")
    try:
        # our own files hold numpy/python RNG states, which weights_only loading refuses
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise UserError(f"checkpoint '{path}' cannot be read ({type(err).__name__}); "
                        "it is not a checkpoint written by train.py") from None


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
