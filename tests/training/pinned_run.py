"""Run a training script with the CPU's kernels pinned to code paths that every x86-64 CPU runs the same way, so
that the numbers it computes do not depend on the CPU (test_recorded_runs.py, beside it, records and checks its
numbers so):

    python tests/training/pinned_run.py train.py --yaml_config config/ResNet50.yaml --config tiny --data_dir ...

The pins, set here before torch is loaded, over whatever the caller's environment says:
- ATEN_CPU_CAPABILITY=default: ATen's kernels without AVX2/AVX512 code. Those use other vector widths (other
  summation orders) and FMA, so their results differ in the last bits;
- MKL_CBWR=COMPATIBLE: MKL (the matrix products, also inside the im2col convolutions) runs its one code branch that
  gives the same results on every x86 processor, instead of the branch it picks for this CPU (Intel or AMD, AVX2
  or AVX512);
- one thread (OMP_NUM_THREADS, MKL_NUM_THREADS, torch.set_num_threads): reductions split their work by thread count;
- oneDNN off (torch.backends.mkldnn): its convolutions follow the CPU's instruction set and block by its cache
  sizes; ATen's own convolutions (im2col and MKL) run instead;
- NNPACK off (torch.backends.nnpack): at batch >= 16 forward convolutions would go there (AVX2 kernels only,
  tiles sized by the caches);
- CUDA hidden.
The script runs as `python SCRIPT ARGS` would run it (its folder first on sys.path, as __main__).
"""
import os
import runpy
import sys

PINNED_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1",
              "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
# what torch.backends.cpu.get_cpu_capability() calls ATen's DEFAULT capability (its kernels without vector
# extensions): "DEFAULT", or "NO AVX" on the x86 builds of older torch (2.5.1, the tutorial container's); the pinned
# torch's library has no "NO AVX", and no other capability goes by either name
DEFAULT_CAPABILITY = ("DEFAULT", "NO AVX")


def pin():
    """Pin the kernels of this process; call before torch is imported (the libraries read the variables when they
    load or first dispatch)."""
    os.environ.update(PINNED_ENV)
    import torch
    torch.backends.mkldnn.enabled = False
    torch.backends.nnpack.set_flags(False)
    torch.set_num_threads(1)
    assert torch.backends.cpu.get_cpu_capability() in DEFAULT_CAPABILITY, torch.backends.cpu.get_cpu_capability()


def main():
    if len(sys.argv) < 2:
        sys.exit(f"usage: python {sys.argv[0]} SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    pin()
    sys.path[0] = os.path.dirname(script)
    sys.argv = [sys.argv[1], *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
