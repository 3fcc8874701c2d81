"""What the training loops share: the loop's decisions (milestones.py), the epoch's sums and nan check (meter.py),
validation (validation.py), the log lines and TensorBoard points (reporting.py), profiling ranges and memory
(profiling.py), FLOPs and MFU (flops.py), the --enable_benchy timings (benchy.py), the validation figure (plots.py),
nn.DataParallel's autocast (dp_autocast.py) and the capture of a training step in a CUDA graph (cuda_graphs.py). The
job's side (stop signals, the resume point) is handed in by the run (lifecycle/run.py's Run), not imported."""
