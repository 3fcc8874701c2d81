"""Logging set up once per process: rank 0 logs INFO, other ranks only warnings and errors."""
import logging
import os
import sys

from utils.errors import DISK_FULL, disk_full

LOG_FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"


def config_logger(rank=None, log_level=logging.INFO):
    """Console logging in the tutorial's format; `rank` defaults to $RANK (0 outside a launcher). The records
    logged until log_to_file opens the run's log file are kept for it (EarlyRecords)."""
    if rank is None:
        rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(format=LOG_FORMAT, level=log_level if rank == 0 else logging.WARNING, force=True)
    logging.getLogger().addHandler(EarlyRecords())


class EarlyRecords(logging.Handler):
    """The records logged before the run's log file exists (the run's first line, the process group's), which
    log_to_file writes at the top of the file: out.log begins as the console does."""
    LIMIT = 1000  # a process that never opens a log file keeps no more

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        if len(self.records) < self.LIMIT:
            self.records.append(record)


def log_to_file(log_filename, log_level=logging.INFO):
    """Also write the root logger to `log_filename` (e.g. <run dir>/out.log), starting with the records logged
    since config_logger."""
    os.makedirs(os.path.dirname(os.path.abspath(log_filename)), exist_ok=True)
    handler = OneLineErrorFileHandler(log_filename)
    handler.setLevel(log_level)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    for early in [h for h in root.handlers if isinstance(h, EarlyRecords)]:
        root.removeHandler(early)
        for record in early.records:
            handler.handle(record)  # the handler's level applies, as to any record
    root.addHandler(handler)


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
