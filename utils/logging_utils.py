"""Logging set up once per process: rank 0 logs INFO, other ranks only warnings and errors."""
import logging
import os
import sys

from utils.errors import DISK_FULL, disk_full

LOG_FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"


def config_logger(rank=None, log_level=logging.INFO):
    """Console logging in the tutorial's format; `rank` defaults to $RANK (0 outside a launcher)."""
    if rank is None:
        rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(format=LOG_FORMAT, level=log_level if rank == 0 else logging.WARNING, force=True)


def log_to_file(log_filename, log_level=logging.INFO):
    """Also write the root logger to `log_filename` (e.g. <run dir>/out.log)."""
    os.makedirs(os.path.dirname(os.path.abspath(log_filename)), exist_ok=True)
    handler = OneLineErrorFileHandler(log_filename)
    handler.setLevel(log_level)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)


class OneLineErrorFileHandler(logging.FileHandler):
    """A log file whose failed writes (a full disk) are said once, in one line, instead of a traceback for every
    record (logging's default); the console keeps logging, and the next checkpoint's write says what to do."""
    said = False

    def handleError(self, record):
        err = sys.exc_info()[1]
        if not isinstance(err, OSError) or err.errno not in DISK_FULL:
            return super().handleError(record)
        if not self.said:
            self.said = True
            print(f"error: {disk_full(OSError(err.errno, err.strerror, self.baseFilename))}; logging goes on "
                  "to the console only", file=sys.stderr, flush=True)
