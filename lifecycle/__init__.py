"""A run's life: the flags and the config (cli.py), the stop signals (signals.py; early_signals.py is the first
import of every training script), the run directory's lock (run_lock.py), checkpoints (checkpoint.py), the kernels
chosen at a run's start (kernels.py), and the run's start, restore, save and finish (run.py). Imports only utils/
and resilience/ (which start_run attaches)."""
