"""Imported on the first line of each training script, before torch: from then on SIGTERM, SIGINT and SIGUSR1 are
recorded (lifecycle/signals.py) instead of killing the process mid-import with a traceback or a bare exit status; the
run stops at the first point where the ranks agree, before its first step, with one line and exit code 75.
Only when a training script is the program (`python train.py`, torchrun, srun): a test that imports one keeps its
own Ctrl-C until the script's main() installs the handlers."""
import os
import sys

from lifecycle import signals

TRAINING_SCRIPTS = ("train.py", "train_graph.py", "train_mp.py", "train_mp_graphs.py")

if os.path.basename(getattr(sys.modules["__main__"], "__file__", None) or "") in TRAINING_SCRIPTS:
    signals.record_from_start(program=True)
