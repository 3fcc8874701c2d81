"""The performance model, the planner and the dry run: a feature of the project that train_mp.py uses at run time
(its predicted-memory line, `--dry_run`) and `make plan` prints (`python -m planning.plan`). benchmarks/ measures
and imports this package; nothing here imports benchmarks/."""
