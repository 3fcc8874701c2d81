"""Logging set up once per process: rank 0 logs INFO, other ranks only warnings and errors."""
import logging
import os

LOG_FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"


def config_logger(rank=None, log_level=logging.INFO):
    """Console logging in the tutorial's format; `rank` defaults to $RANK (0 outside a launcher)."""
    if rank is None:
        rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(format=LOG_FORMAT, level=log_level if rank == 0 else logging.WARNING, force=True)


def log_to_file(log_filename, log_level=logging.INFO):
    """Also write the root logger to `log_filename` (e.g. <run dir>/out.log)."""
    os.makedirs(os.path.dirname(os.path.abspath(log_filename)), exist_ok=True)
    handler = logging.FileHandler(log_filename)
    handler.setLevel(log_level)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)
