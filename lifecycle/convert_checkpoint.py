"""Convert one of this repository's checkpoints from before they loaded as data, in place, when you trust it.

    python -m lifecycle.convert_checkpoint PATH [PATH ...]

Checkpoints now load with torch.load(weights_only=True): they hold tensors, numbers, strings, lists and dicts only.
Older ones kept numpy's RNG state as a numpy array, which only a full unpickle reads, and a full unpickle runs
whatever functions a file names: a crafted file runs its own code here. So this command is the one place that loads
a checkpoint that way, only the files you name, and only after you say you trust them (a prompt, or --trusted). Each
file is rewritten in place, atomically, with its RNG states as data and a digest (lifecycle/checkpoint.py), and read
back as data to check.
"""
import os
import sys

import numpy as np
import torch

from lifecycle.checkpoint import DIGEST, load_checkpoint, state_digest
from resilience.exits import exit_on_user_error
from utils.atomic import atomic_path
from utils.errors import ArgumentParser, UserError


def rng_as_data(states):
    """One rank's RNG states of an older checkpoint (numpy's a tuple with an array, Python's a tuple) as data."""
    states = dict(states)
    numpy = states.get("numpy")
    if isinstance(numpy, tuple):
        name, keys, pos, has_gauss, cached_gaussian = numpy
        states["numpy"] = {"name": str(name), "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
                           "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    python = states.get("python")
    if isinstance(python, tuple):
        version, internal, gauss_next = python
        states["python"] = {"version": version, "internal": [int(v) for v in internal], "gauss_next": gauss_next}
    return states


def convert(path):
    """Rewrite the checkpoint at `path` as data (its RNG states), with a digest; returns its iteration."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)  # the user said they trust this file
    if not isinstance(checkpoint, dict) or not {"model", "iteration", "config_name"} <= set(checkpoint):
        raise UserError(f"'{path}' is not a checkpoint written by train.py (no model, iteration and config); it was "
                        "left as it was")
    checkpoint.pop(DIGEST, None)
    checkpoint["rng_states"] = [rng_as_data(states) for states in checkpoint.get("rng_states", [])]
    checkpoint[DIGEST] = state_digest(checkpoint)
    with atomic_path(path) as tmp_path, open(tmp_path, "wb") as f:
        torch.save(checkpoint, f)
    return load_checkpoint(path)["iteration"]  # read back as data, its digest checked


@exit_on_user_error
def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint files to rewrite in place")
    parser.add_argument("--trusted", action="store_true",
                        help="do not ask: you trust every file named (it runs any code a file holds)")
    args = parser.parse_args(argv)
    for path in args.paths:
        if not os.path.isfile(path):
            raise UserError(f"'{path}' is not a file; name checkpoint files")
    if not args.trusted:
        print("Loading these files runs any code they hold. Convert only checkpoints you wrote yourself with this "
              "repository, or trust as much:\n  " + "\n  ".join(args.paths))
        if not sys.stdin.isatty() or input("Convert them? [y/N] ").strip().lower() not in ("y", "yes"):
            raise UserError("nothing converted (add --trusted to say you trust the files without a prompt)")
    for path in args.paths:
        print(f"{path}: converted, iteration {convert(path)}; it now loads as data")


if __name__ == "__main__":
    main()
