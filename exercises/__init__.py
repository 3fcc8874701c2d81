"""Hands-on exercises: fill in the TODOs, then run the matching checker (e.g. python -m exercises.check_tp_mlp)."""
