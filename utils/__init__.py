"""The foundation every other package imports, under the original tutorial's file names: the process grid (comm.py,
layout.py, rank_generator.py, rendezvous.py; check_rank_generator.ipynb prints it), the config file (YParams.py),
errors, atomic file writes, logging, and the PyTorch 2.5 shim (compat.py). It imports no other package of the
project. The original's loader dispatch in this file is loaders.get_data_loader_distributed."""
