"""The run directory's lock: one run at a time in <expdir>/<config>/<layout>/<run_num>/ (two would overwrite each
other's checkpoints and TensorBoard events)."""
import contextlib
import fcntl
import logging
import os
import socket
import time

from utils.errors import UserError, free_space, register_cleanup


class RunDirectoryLock:
    """An flock on <run dir>/run.lock held while a run uses the directory. The kernel drops it when the process
    dies, however it dies, so a killed run never blocks the next start. The file keeps the model of the runs that
    used the directory (`model`): a run of another model (the ViT's and the UNet's configs share names) is refused
    instead of mixing its logs and checkpoints with theirs."""

    def __init__(self, exp_dir, model="vit"):
        self.path = os.path.join(exp_dir, "run.lock")
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = (self.file.read().strip().splitlines() or ["another process"])[0]
            self.file.close()
            raise UserError(f"run directory '{exp_dir}' is in use by {holder}; wait for that run to end, or "
                            "choose another --run_num or --expdir") from None
        except OSError as err:  # a file system without locks: run, but say so
            logging.warning(f"cannot lock '{self.path}' ({err}); make sure no other run uses this directory")
        self.file.seek(0)
        used_by = next((line.split(":", 1)[1].strip() for line in self.file.read().splitlines()
                        if line.startswith("model:")), model)
        if used_by != model:
            self.file.close()
            expdir = os.path.dirname(os.path.dirname(os.path.dirname(exp_dir)))  # <expdir>/<config>/<layout>/<run>
            raise UserError(f"run directory '{exp_dir}' holds a run of the {used_by} model, not the {model}: the "
                            "stages' configs share names (short, base, ...); give this stage a folder of its own "
                            f"(e.g. --expdir {os.path.join(expdir, model)}) or another --run_num")
        try:
            self.file.seek(0)
            self.file.truncate()
            self.file.write(f"process {os.getpid()} on {socket.gethostname()} "
                            f"(started {time.strftime('%Y-%m-%d %H:%M:%S')})\nmodel: {model}\n")
            self.file.flush()
        except OSError as err:  # a full disk or quota: nothing of this run is left behind
            with contextlib.suppress(OSError):
                self.file.close()  # tries the failed flush again, and fails again (without the file's name)
            with contextlib.suppress(OSError):
                os.remove(self.path)
            raise UserError(f"writing the run lock '{self.path}' failed ({err.strerror or err}; "
                            f"{free_space(exp_dir)} in '{exp_dir}'); free disk space (or raise the quota), or choose "
                            "another --expdir") from None
        register_cleanup(self.release)
        # a forked child (a loader worker) would share the lock and keep it after this process is killed
        os.register_at_fork(after_in_child=self._close_in_child)

    def _close_in_child(self):
        if not self.file.closed:
            self.file.close()  # closes the child's copy only; the lock stays with the parent

    def release(self):
        if not self.file.closed:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
