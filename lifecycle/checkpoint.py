"""Checkpoints written atomically: a kill or a full disk at any moment leaves the previous checkpoint intact.

A run directory keeps two: checkpoints/ckpt.pt and the one before it, ckpt_previous.pt. When the newest is damaged
(a write cut short by a failing file system, a zeroed file) the run resumes from the previous one, says so, and
moves the damaged file aside (ckpt.pt.damaged), so that the next save keeps the good one as the previous.
Every rank resumes from the same file, or the job stops (load_on_every_rank): rank 0 chooses, the others follow.

Every checkpoint carries a digest (state_digest: SHA-256 over each tensor's bytes, dtype and shape and every other
value, in order), computed from the state in memory as it is saved and checked on every load: a bit flipped on disk
or in a copy inside a tensor's data, which torch.load reads without a word, makes the file damaged like an unreadable
one. A checkpoint written before the digest loads with one line saying it cannot be checked.

Checkpoints load as data (torch.load with weights_only=True): a checkpoint holds tensors, numbers, strings, lists
and dicts only (the RNG states included: rng_state_as_data), so unpickling it calls nothing of a file's choosing. A
file that would need to run code to load (it names a function or class, as a crafted pickle calling os.system does,
or a checkpoint written before this rule with numpy's RNG state) is refused in one line (NeedsCode), and nothing in
it runs; `python -m lifecycle.convert_checkpoint` converts one of this repository's older checkpoints, if its owner
says they trust it.
"""
import errno
import hashlib
import logging
import os
import pickle
import random
import re
import stat
import sys

import numpy as np
import torch
import torch.distributed as dist

from resilience import peers, store
from utils import comm
from utils.atomic import atomic_path, free_space
from utils.errors import OneRankError, UserError


class DamagedCheckpoint(UserError):
    """A checkpoint file that torch.load cannot read, or whose contents differ from what was written (its digest);
    `reason`: what was found, in a few words."""
    reason = "unreadable"


class NeedsCode(UserError):
    """A torch file whose unpickling would call a function or build a class it names (weights_only refuses it):
    refused, nothing in it run."""


CONVERT = "python -m lifecycle.convert_checkpoint"
DIGEST = "digest"  # the checkpoint's key for state_digest of everything else in it


def needs_code(path, err):
    """The NeedsCode line of the file at `path`, from weights_only's refusal `err`."""
    named = re.search(r"GLOBAL ([\w.]+)", str(err))
    what = f"it names {named.group(1)}" if named else "it names a function or class to call"  # torch's wording
    return NeedsCode(f"'{path}' is not a checkpoint written by train.py: it would need to run code to load ({what}), "
                     "so it was not loaded and nothing in it ran; if it is one of this repository's own from before "
                     f"checkpoints loaded as data and you trust it, convert it once with `{CONVERT} {path}`, else "
                     "move it away")


def read_as_data(path):
    """torch.load of `path` on the CPU, as data (weights_only=True): NeedsCode if it names anything to call."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "Unsupported global" in str(err):  # weights_only's refusal of a name to call (garbage: damaged instead)
            raise needs_code(path, err) from None
        raise


def state_digest(state):
    """SHA-256 (hex) of a checkpoint's state: each tensor's bytes with its dtype and shape, numpy arrays likewise,
    containers by their length and items in order, any other value by its type and repr. The same for the state
    that was saved and the state torch.load returns from an intact file."""
    digest = hashlib.sha256()
    _feed(digest, state)
    return digest.hexdigest()


def _feed(digest, value):
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"tensor {tensor.dtype} {tuple(tensor.shape)};".encode())
        if tensor.numel():
            digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    elif isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        digest.update(f"array {array.dtype.str} {array.shape};".encode())
        digest.update(memoryview(array.reshape(-1).view(np.uint8)))
    elif isinstance(value, dict):
        digest.update(f"dict {len(value)};".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__} {len(value)};".encode())
        for item in value:
            _feed(digest, item)
    else:  # str, int, float (repr is exact), bool, None, numpy scalars
        digest.update(f"{type(value).__name__} {value!r};".encode())


def verify_digest(checkpoint, path):
    """Raise DamagedCheckpoint when `checkpoint` (as torch.load returned it from `path`) is not what was written;
    returns whether it could be checked (False: a checkpoint of train.py written before the digest, said once on
    rank 0, or a torch file of something else, which the caller refuses)."""
    if not isinstance(checkpoint, dict) or DIGEST not in checkpoint:
        if isinstance(checkpoint, dict) and {"model", "iteration"} <= set(checkpoint) and comm.get_world_rank() == 0:
            logging.warning(f"checkpoint '{path}' was written before checkpoints carried a digest: what it holds "
                            "cannot be checked against what was written")
        return False
    written = checkpoint.pop(DIGEST)
    if state_digest(checkpoint) != written:
        damaged = DamagedCheckpoint(f"checkpoint '{path}' does not hold what was written (its digest differs: "
                                    "bytes changed on disk or in a copy); pass another checkpoint to --resume")
        damaged.reason = "its digest differs from what was written"
        raise damaged
    return True


def previous_path(path):
    """Where the checkpoint before `path` is kept: ckpt.pt -> ckpt_previous.pt."""
    root, ext = os.path.splitext(path)
    return f"{root}_previous{ext}"


def damaged_path(path):
    """Where a damaged newest checkpoint is moved on resuming from the one before: ckpt.pt -> ckpt.pt.damaged."""
    return f"{path}.damaged"


def present(path):
    """Whether the checkpoint file `path` exists: False only when the file system says there is none. A file system
    that cannot say (EIO, ESTALE, EACCES: an evicted Lustre client, a failing disk) is a UserError: taken for "no
    checkpoint", the run would start again from iteration 0 and its saves would push the good checkpoints out."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as err:
        folder = os.path.dirname(os.path.abspath(path))
        what = (f"this user may not look into '{folder}': check its permissions" if err.errno in (errno.EACCES,
                errno.EPERM) else f"the file system under '{folder}' is failing: start again when it answers")
        raise UserError(f"checkpoint '{path}' cannot be looked up ({err.strerror or type(err).__name__}); nothing was "
                        f"started, the checkpoints are as they were; {what}") from None


def has_checkpoint(path):
    """Whether the run directory's checkpoint `path` or its previous one is there; anything but a file (a directory)
    at either name stops the run before training, in one line: taken for "no checkpoint", the run would train from
    the beginning and move it aside at its first save, and its last save would fail."""
    for name in (path, previous_path(path)):
        if not present(name) and os.path.lexists(name):  # present: one line where the file system cannot say
            kind = "a directory" if os.path.isdir(name) else "not a file"
            raise UserError(f"'{name}' is {kind}, not a checkpoint file; move it away, then start again (nothing was "
                            "started)")
    return present(path) or present(previous_path(path))


def save_checkpoint(path, state):
    """torch.save of `state` and its digest to `<path>.tmp`, flushed to disk, then the current `path` becomes
    previous_path(path) and the new file takes its place. A failed write (disk full, quota) removes the temporary
    file, keeps the checkpoints there were and raises a UserError naming the folder and its free space."""
    state = {**state, DIGEST: state_digest(state)}
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
    """The checkpoint dict at `path`, on the CPU, read as data and its digest checked (and removed); DamagedCheckpoint
    when the file cannot be read or does not hold what was written, NeedsCode when it would need to run code."""
    if os.path.isdir(path):
        raise UserError(f"'{path}' is a directory, not a checkpoint file; pass a checkpoint file to --resume (a run "
                        "directory keeps its own as checkpoints/ckpt.pt)")
    if not present(path):
        raise UserError(f"checkpoint '{path}' not found; pass an existing file to --resume")
    try:
        checkpoint = read_as_data(path)
    except NeedsCode:
        raise
    except Exception as err:
        reason = type(err).__name__ + (f": {err.strerror}" if isinstance(err, OSError) and err.strerror else "")
        damaged = DamagedCheckpoint(f"checkpoint '{path}' cannot be read ({reason}): it is damaged, incomplete (a "
                                    "write cut short, a failing file system) or not a checkpoint; pass another "
                                    "checkpoint to --resume")
        damaged.reason = reason
        raise damaged from None
    verify_digest(checkpoint, path)
    return checkpoint


def load_newest_checkpoint(path):
    """(checkpoint, the file it came from): `path`, or the previous checkpoint when `path` is damaged, saying so on
    rank 0. A damaged `path` is moved to damaged_path(path): saved over, it would become the previous checkpoint, and
    the good one would be lost. A save that a crash cut short is first finished or undone (finish_interrupted_save).
    Rank 0 alone. Beside a good `path`, the previous checkpoint is checked too (check_previous), so that a damaged
    one is known now, not when it is needed."""
    previous = previous_path(path)
    finish_interrupted_save(path)
    if not present(path):
        why = f"checkpoint '{path}' is missing"
    else:
        try:
            checkpoint = load_checkpoint(path)
            check_previous(previous)
            return checkpoint, path
        except DamagedCheckpoint as err:
            why = str(err).rsplit("; pass another", 1)[0]  # the run directory's own: --resume would not be read
            if not present(previous):
                raise UserError(f"{why}, and there is no previous one; move it away to train from the beginning "
                                "here, or start a new --run_num (or --expdir)") from None
    try:
        checkpoint = load_checkpoint(previous)
    except DamagedCheckpoint:
        raise UserError(f"{why}, and the previous one, '{previous}', is damaged or incomplete too; start a new "
                        "--run_num (or --expdir) to train from the beginning") from None
    aside = ""
    if present(path):  # damaged: moved aside, else the next save would make it the previous checkpoint
        try:
            os.replace(path, damaged_path(path))
        except OSError as err:
            raise UserError(f"{why}; it could not be moved aside to '{damaged_path(path)}' ({err.strerror}), and "
                            "the next checkpoint would push the good previous one out: move it away by hand, then "
                            "start again to resume from the previous one") from None
        aside = f"; the damaged file is kept as '{damaged_path(path)}'"
    if comm.get_world_rank() == 0:
        logging.warning(f"{why}; resuming from the previous checkpoint '{previous}' (iteration "
                        f"{checkpoint.get('iteration', '?') if isinstance(checkpoint, dict) else '?'}){aside}")
    return checkpoint, previous


def check_previous(previous):
    """The previous checkpoint, checked at start (rank 0): a damaged one is moved aside (its .damaged name) and said
    in one line, since until the next save the newest is then the run's only good checkpoint; one that would need to
    run code to load is said in one line and left alone. Nothing is said of a missing or good one."""
    if not present(previous):
        return
    try:
        load_checkpoint(previous)
    except DamagedCheckpoint as err:
        why = str(err).rsplit("; pass another", 1)[0]
        try:
            os.replace(previous, damaged_path(previous))
            kept = f"it is kept as '{damaged_path(previous)}'"
        except OSError as move:
            kept = f"it could not be moved aside ({move.strerror})"
        logging.warning(f"{why}; {kept}: until the next checkpoint is written the newest is this run's only good one")
    except NeedsCode as err:
        logging.warning(f"the previous checkpoint: {err}; until the next checkpoint is written the newest is this "
                        "run's only one")


def finish_interrupted_save(path):
    """Finish or undo a save_checkpoint that a crash cut short, so that `path` is the newest checkpoint and no
    temporary file is left (a run restarted at its final iteration trains no step and saves nothing: it would keep
    them as they are). `<path>.tmp` is flushed before the renames; where its digest says it is whole, the save is
    finished (`path` becomes the previous checkpoint, the temporary file `path`). Else it is removed, and a `path`
    missing beside its previous one (the crash came between the renames) is the previous one again, as before that
    save. Rank 0 alone, in a locked run directory."""
    tmp_path, previous = f"{path}.tmp", previous_path(path)
    if present(tmp_path):
        whole, why = False, "cut short or damaged"
        try:
            saved = read_as_data(tmp_path)
            whole = isinstance(saved, dict) and DIGEST in saved and verify_digest(saved, tmp_path)
            why = why if whole or (isinstance(saved, dict) and DIGEST in saved) else "not a save of train.py's"
        except NeedsCode:
            why = "it would need to run code to load, so it was not loaded"
        except Exception:  # cut short or damaged (a DamagedCheckpoint): not a checkpoint
            whole = False
        if whole:
            if present(path):
                os.replace(path, previous)
            os.replace(tmp_path, path)
            logging.warning(f"a save was cut short after writing '{tmp_path}', which is whole: it is now '{path}'")
            return
        os.remove(tmp_path)
        logging.warning(f"'{tmp_path}' was removed ({why}); the checkpoints beside it are as they were")
    if not present(path) and present(previous):
        os.replace(previous, path)
        logging.warning(f"checkpoint '{path}' was missing (a save cut between its two renames): '{previous}' is "
                        f"'{path}' again, as before that save")


def iteration_of(checkpoint):
    """The iteration a checkpoint holds (None for anything else, or for a value that is not a whole number)."""
    iteration = checkpoint.get("iteration") if isinstance(checkpoint, dict) else None
    return iteration if isinstance(iteration, int) and not isinstance(iteration, bool) else None


STOPS = "every rank must resume from the same checkpoint, so the job stops"


def load_rank0s_choice(path, iteration):
    """(checkpoint, None) on a rank other than 0 that loads `path`, rank 0's choice, at rank 0's `iteration`; else
    (None, this rank's problem in one sentence): it cannot read the file, or the file holds another iteration here.
    No fallback of its own: rank 0 decided."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        found = present(path)
    except UserError:  # this node's file system cannot look it up
        found = None
    if not found:
        why = "not found" if found is False else "its file system cannot look it up"
    else:
        try:
            checkpoint = load_checkpoint(path)
        except DamagedCheckpoint as err:
            why = err.reason
        except UserError:  # its file system cannot look it up (any more)
            why = "its file system cannot look it up"
        else:
            mine = iteration_of(checkpoint)
            if mine == iteration:
                return checkpoint, None
            return None, (f"checkpoint '{path}' holds iteration {'?' if mine is None else mine} on this rank but "
                          f"{iteration} on rank 0; {STOPS}: check that every node sees the same '{folder}' (one "
                          "shared file system for --expdir), then start again")
    return None, (f"checkpoint '{path}' cannot be read on this rank ({why}), though rank 0 read it (iteration "
                  f"{iteration}); {STOPS}: check that this node sees '{folder}' as rank 0's does (a shared, healthy "
                  "file system), then start again")


def resume_verdict(problems, rank):
    """What rank `rank` does once every rank tried rank 0's checkpoint; `problems`: each rank's problem (None where
    it loaded rank 0's iteration). None: go on (every rank agrees). Else the job stops: the lowest rank with a
    problem gets its line (naming any other such ranks), to print once; every other rank gets '' (exit quietly)."""
    failing = [r for r, problem in enumerate(problems) if problem]
    if not failing:
        return None
    if rank != failing[0]:
        return ""
    others = failing[1:]
    if not others:
        return problems[rank]
    listed = ", ".join(map(str, others[:5])) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    return f"{problems[rank]} (rank{'s' if len(others) > 1 else ''} {listed} cannot resume from it either)"


def load_on_every_rank(path, newest=False, check=None):
    """(checkpoint, the file it came from): the same file at the same iteration on every rank, or the job stops.
    Rank 0 chooses and loads: `path`, or with `newest` the newest good one of `path` and its previous checkpoint
    (load_newest_checkpoint: a damaged newest falls back, said once); `check(checkpoint, file)` may refuse it with a
    UserError (every rank stops; rank 0 prints it). Rank 0 sends the file and its iteration; each other rank loads
    exactly that file (load_rank0s_choice), and one collective tells every rank whether all did: if not, the
    lowest rank that could not prints one line naming itself and the file (`rank R: ...`, a OneRankError) and every
    rank exits with code 2, none waits. Every rank calls it; rank 0 reads the file once."""
    rank = comm.get_world_rank()
    checkpoint, error = None, None
    if rank == 0:
        try:
            checkpoint, path = load_newest_checkpoint(path) if newest else (load_checkpoint(path), path)
            if check is not None:
                check(checkpoint, path)
        except UserError as err:
            error = str(err)
        except Exception:  # a bug: its traceback on rank 0; the others stop instead of waiting for rank 0
            store.broadcast_from_rank0((path, None, None, True))
            raise
    path, iteration, error, crashed = store.broadcast_from_rank0((path, iteration_of(checkpoint), error, False))
    if crashed:
        sys.exit(2)
    if error:  # rank 0's reason: every rank stops as when every rank found it; rank 0 prints it
        raise UserError(error)
    if iteration is not None:  # what a rank that loses a peer from here on says the job resumes from
        peers.note_checkpoint(path, iteration)
    problem = None
    if rank != 0:
        checkpoint, problem = load_rank0s_choice(path, iteration)
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:  # the agreement: every rank learns every rank's outcome
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    verdict = resume_verdict(problems, rank)
    if verdict:
        raise OneRankError(verdict)
    if verdict == "":
        sys.exit(2)  # another rank's line says why, once
    return checkpoint, path


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
    """This process's random states as data (tensors, ints, floats, strings: what weights_only loading reads): torch's
    and CUDA's byte tensors, numpy's Mersenne Twister (its 624 keys as an int64 tensor), Python's."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    states = {"torch": torch.get_rng_state(),
              "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
              "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states):
    torch.set_rng_state(states["torch"])
    numpy = states["numpy"]
    np.random.set_state((numpy["name"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"],
                         numpy["cached_gaussian"]))
    python = states["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
