"""Imported on the first line of each training script, before torch: from then on SIGTERM, SIGINT and SIGUSR1 are
recorded (utils/signals.py) instead of killing the process mid-import with a traceback or a bare exit status; the
run stops at the first point where the ranks agree, before its first step, with one line and exit code 75."""
from utils import signals

signals.record_from_start()
