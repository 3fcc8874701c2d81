"""What a model is trained for: the loss (loss.py), the metrics (metrics.py), the optimizers and learning-rate
schedules (optim.py). Imports only utils/."""
