"""What the training loops share: the loop's decisions and reports (reporting.py), profiling ranges and memory
(profiling.py), FLOPs and MFU (flops.py), the --enable_benchy timings (benchy.py), the validation figure (plots.py),
and the capture of a training step in a CUDA graph (cuda_graphs.py)."""
