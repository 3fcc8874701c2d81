"""Checkpoints written atomically: a kill at any moment leaves the previous checkpoint intact."""
import os
import random

import numpy as np
import torch

from utils.errors import UserError


def save_checkpoint(path, state):
    """torch.save to `<path>.tmp`, flush to disk, then rename over `path` (atomic on POSIX)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp_path = path + ".tmp"
    with open(tmp_path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)


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
