"""Each lever of the single-GPU step measured on its own: ViT `short`, bf16, fused Adam, batch 16, in one process.

    python -m benchmarks.bench_levers --data_dir data/gpu_table/full/era5 --out bench_results/gpu/levers.json

Step alone (one batch kept on the GPU, ms per step): the tokens contiguous after the patch embedding against the
transposed view they were before; q, k and v from one GEMM of the three weights joined at run time (a candidate, not
yet in the model: kept only if a GPU says it gains); scaled_dot_product_attention's kernels (torch's choice, cuDNN,
FlashAttention-2, memory-efficient). With the loader (8 workers by default, ms per step over several epochs): the
batch copied on the loader's copy stream beside the step before it, against the copy on the compute stream (GPU
only), and the workers' requests kept going across epochs against one epoch's requests at a time, restarted at each
boundary after a device-wide sync (as before). Each variant changes one thing; the others stay as they are now. A
kernel that cannot run a shape, or a lever that needs CUDA, is reported with the reason. `--tiny` uses the `tiny`
config (a check of this script on any machine).
"""
import contextlib
import copy
import os
import sys
import time

import torch
from torch.utils.data import BatchSampler

from benchmarks.common import device_name
from lifecycle.cli import apply_overrides, training_parser
from lifecycle.run import select_attention_backend
from loaders import common as loader_common
from loaders import get_data_loader
from loop.benchy import endless_batches
from networks import get_model, vit
from task.loss import get_loss
from task.optim import get_optimizer
from utils import comm
from utils.atomic import write_json
from utils.errors import ArgumentParser
from utils.YParams import YParams


def log(message):
    print(f"[levers {time.strftime('%H:%M:%S')}] {message}", flush=True)


def transposed_tokens(self, x):
    """PatchEmbed.forward as it was: the tokens a transposed view of the convolution's output."""
    return self.proj(x).flatten(2).transpose(1, 2)


def qkv_one_gemm(self, x):
    """Attention.forward with q, k and v from one GEMM (a candidate, issue #39): the three weights (and biases) joined
    at run time, so the model and its state_dict stay as they are; the join costs a copy of 3 x dim^2 weights a step.
    Equal to the three GEMMs within rounding (tests/perf/test_bench.py)."""
    B, N, E = x.shape
    bias = None if self.q.bias is None else torch.cat([self.q.bias, self.k.bias, self.v.bias])
    qkv = torch.nn.functional.linear(x, torch.cat([self.q.weight, self.k.weight, self.v.weight]), bias)
    q, k, v = qkv.view(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                            dropout_p=self.attn_drop if self.training else 0.0)
    return self.proj_drop(self.proj(attn.transpose(1, 2).reshape(B, N, E)))


def copy_on_the_compute_stream(self, host, device):
    """TorchLoader._on_device as it was: each batch copied on the loop's stream when the loop asks for it (after the
    step before it), the slot freed by an event on that stream."""
    for batch in host:
        on_gpu = tuple(tensor.to(device, non_blocking=True) for tensor in batch)
        self.copied.append(torch.cuda.Event())
        self.copied[-1].record()
        yield on_gpu


def one_epoch_of_requests(self):
    """RingBatchSampler.__iter__ as it was: the requests of one epoch, then the end of the DataLoader's pass."""
    sampler, (epoch, skip) = copy.copy(self.sampler), self.start
    sampler.set_epoch(epoch, skip=skip * self.batch_size)
    for indices in BatchSampler(sampler, self.batch_size, drop_last=self.train):
        slot, self.count = self.count % self.slots, self.count + 1
        yield slot, indices


def restarted_each_epoch(self, epoch, skip=0):
    """TorchLoader.set_epoch as it was: every pass a new one (the workers' requests stopped at the epoch's end),
    after a device-wide sync."""
    self.epoch, self.skip, self.position = epoch, skip, None
    if torch.cuda.is_available():
        torch.cuda.synchronize()


TORCH_LOADER, RING_SAMPLER = loader_common.TorchLoader, loader_common.RingBatchSampler
VARIANTS = {  # name: (what, [(where it is patched, attribute, replacement)], needs CUDA)
    "now": ("as the code is now", [], False),
    "tokens_transposed": ("tokens as a transposed view", [(vit.PatchEmbed, "forward", transposed_tokens)], False),
    "qkv_one_gemm": ("q, k, v from one GEMM", [(vit.Attention, "forward", qkv_one_gemm)], False),  # a candidate
    "copy_on_compute_stream": ("copy on the compute stream",
                               [(TORCH_LOADER, "_on_device", copy_on_the_compute_stream)], True),
    "loader_restarted_each_epoch": ("loader restarted each epoch", [(TORCH_LOADER, "set_epoch", restarted_each_epoch),
                                                                    (RING_SAMPLER, "__iter__", one_epoch_of_requests)],
                                    False),
}
ATTENTION = ("auto", "cudnn", "flash", "efficient")


class Step:
    """The training step of train.py for the ViT (bf16 autocast, fused Adam), on `device`."""

    def __init__(self, params, device):
        torch.manual_seed(0)
        self.model = get_model(params).to(device)
        self.optimizer = get_optimizer(params, self.model)
        self.loss_fn = get_loss(params)
        self.autocast = torch.autocast(device.type, dtype=params.amp_dtype, enabled=params.amp_enabled)

    def __call__(self, inp, tar):
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast:
            loss = self.loss_fn(self.model(inp), tar)
        loss.backward()
        self.optimizer.step()


def ms_per_step(run_one, steps, warmup, device):
    for _ in range(warmup):
        run_one()
    comm.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        run_one()
    comm.synchronize(device)
    return 1000 * (time.perf_counter() - start) / steps


def measure(params, loader, device, steps, warmup, with_loader):
    """ms per step of a fresh model: on one batch kept on the device, or fed by `loader` epoch after epoch."""
    step = Step(params, device)
    if with_loader:
        batches = endless_batches(loader)

        def run_one():
            inp, tar = next(batches)
            step(inp.to(device, non_blocking=True), tar.to(device, non_blocking=True))
    else:
        inp, tar = (tensor.to(device) for tensor in loader.first_batch())

        def run_one():
            step(inp, tar)
    return ms_per_step(run_one, steps, warmup, device)


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True, help="ERA5 sample data (e.g. from make gpu-table)")
    parser.add_argument("--out", default="bench_results/gpu/levers.json")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workers", type=int, default=8, help="loader workers")
    parser.add_argument("--tiny", action="store_true", help="the tiny config (a check of this script)")
    args = parser.parse_args(argv)
    params = YParams("config/ViT.yaml", "tiny" if args.tiny else "short")
    flags = ["--data_dir", args.data_dir, "--amp_mode", "bf16", "--enable_fused",
             "--num_data_workers", str(args.workers)]
    apply_overrides(params, training_parser("levers").parse_args(flags), dp_size=1, dp_rank=0)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    loader = get_data_loader(params, train=True)  # one loader (its workers started once) for every variant
    report = {"device": device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "config": "tiny" if args.tiny else "short", "batch": params.local_batch_size, "steps": args.steps,
              "step_alone_ms": {}, "with_loader_ms": {}, "attention_ms": {}}
    for name, (what, patches, needs_cuda) in VARIANTS.items():
        for with_loader, key in ((False, "step_alone_ms"), (True, "with_loader_ms")):
            loader_lever = any(owner in (TORCH_LOADER, RING_SAMPLER) for owner, _, _ in patches)
            if (needs_cuda and device.type != "cuda") or (not with_loader and loader_lever):
                continue
            patch = contextlib.ExitStack()
            for owner, attribute, replacement in patches:
                patch.callback(setattr, owner, attribute, getattr(owner, attribute))
                setattr(owner, attribute, replacement)
            with patch:
                report[key][name] = value = measure(params, loader, device, args.steps, args.warmup, with_loader)
            log(f"{what}, {'with the loader' if with_loader else 'step alone'}: {value:.2f} ms/step")
    for backend in ATTENTION:
        try:
            select_attention_backend(backend, device)
            report["attention_ms"][backend] = value = measure(params, loader, device, args.steps, args.warmup, False)
            log(f"attention {backend}: {value:.2f} ms/step")
        except Exception as err:  # a kernel that cannot run this shape or device: reported, the others go on
            report["attention_ms"][backend] = f"not run: {str(err).splitlines()[0]}"
            log(f"attention {backend}: not run ({str(err).splitlines()[0]})")
        finally:
            select_attention_backend("auto", device)
    write_json(args.out, report)
    log(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
