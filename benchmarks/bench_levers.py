"""Each lever of the single-GPU step measured on its own: ViT `short`, bf16, fused Adam, batch 16, in one process.

    python -m benchmarks.bench_levers --data_dir data/gpu_table/full/era5 --out bench_results/gpu/levers.json

Step alone (one batch kept on the GPU, ms per step): the tokens contiguous after the patch embedding against the
transposed view they were before; the attention's input cast to bf16 once against the cast by each of q, k and v
it was (2026-11-28: 109.2 against 113.5 ms on an H100, so it is the model's now); a candidate that leaves the model
and its state_dict as they are (kept only where a GPU says it gains): q, k and v from one GEMM of the three weights
joined at run time; scaled_dot_product_attention's kernels (torch's choice, cuDNN, FlashAttention-2,
memory-efficient). With the loader (8 workers by default, ms per step over several epochs):
the batch copied on the loader's copy stream beside the step before it, against the copy on the compute stream (GPU
only), and the workers' requests kept going across epochs against one epoch's requests at a time, restarted at each
boundary after a device-wide sync (as before). Compiled (`--compiled`, step alone): torch.compile as train.py's
--enable_jit applies it, the same with CUDA Graphs on top (mode "reduce-overhead", GPU only), and compiled with the
candidates that gained in eager ("kept"). Each variant changes one thing; the others stay as they are now. A kernel
that cannot run a shape, or a lever that needs CUDA, is reported with the reason. `--variants`, `--attention` and
`--compiled` choose what runs (a GPU session measures only what it has not measured yet). `--tiny` uses the `tiny`
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
from lifecycle.kernels import select_attention_backend
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


def cast_by_each(self, x):
    """Attention.forward as it was: under autocast q, k and v each cast the same fp32 norm output to bf16 (three
    casts forward, three fp32 gradients summed backward). The forward is bitwise today's, which casts once
    (tests/perf/test_bench.py)."""
    B, N, E = x.shape

    def heads(t):
        return t.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)

    attn = torch.nn.functional.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
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
    "cast_by_each": ("attention input cast by each of q, k, v", [(vit.Attention, "forward", cast_by_each)], False),
    "copy_on_compute_stream": ("copy on the compute stream",
                               [(TORCH_LOADER, "_on_device", copy_on_the_compute_stream)], True),
    "loader_restarted_each_epoch": ("loader restarted each epoch", [(TORCH_LOADER, "set_epoch", restarted_each_epoch),
                                                                    (RING_SAMPLER, "__iter__", one_epoch_of_requests)],
                                    False),
}
CANDIDATES = ("qkv_one_gemm",)  # kept where they gain, together where they patch different methods
ATTENTION = ("auto", "cudnn", "flash", "efficient")
COMPILED = {  # name: (what, torch.compile mode, needs CUDA)
    "default": ("compiled (--enable_jit)", None, False),
    "reduce-overhead": ("compiled + CUDA Graphs (mode reduce-overhead)", "reduce-overhead", True),
    "kept": ("compiled with the candidates that gained", None, False),
}
GAIN = 0.99  # a candidate is kept when its step alone takes at most 99% of now's


class Step:
    """The training step of train.py for the ViT (bf16 autocast, fused Adam), on `device`."""

    def __init__(self, params, device, compile_mode=False):
        torch.manual_seed(0)
        self.model = get_model(params).to(device)
        if compile_mode is not False:  # as train.py's --enable_jit, or with a mode of torch.compile's
            torch._dynamo.reset()
            self.model = torch.compile(self.model, mode=compile_mode)
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


def measure(params, loader, device, steps, warmup, with_loader, compile_mode=False):
    """ms per step of a fresh model (compiled unless compile_mode is False): on one batch kept on the device, or fed
    by `loader` epoch after epoch."""
    step = Step(params, device, compile_mode)
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


def patched(names):
    """The patches of VARIANTS `names` applied until the context ends (every method put back afterwards)."""
    patch = contextlib.ExitStack()
    for name in names:
        for owner, attribute, replacement in VARIANTS[name][1]:
            patch.callback(setattr, owner, attribute, getattr(owner, attribute))
            setattr(owner, attribute, replacement)
    return patch


def kept_candidates(step_alone_ms):
    """The candidates whose step alone took at most GAIN x now's, best first, leaving out one that patches a method
    a better one already patches."""
    now = step_alone_ms.get("now")
    gained = sorted((ms, name) for name, ms in step_alone_ms.items()
                    if name in CANDIDATES and now and isinstance(ms, float) and ms <= GAIN * now)
    kept, taken = [], set()
    for _, name in gained:
        places = {(owner, attribute) for owner, attribute, _ in VARIANTS[name][1]}
        if not places & taken:
            kept.append(name)
            taken |= places
    return kept


def chosen(parser, value, known, what):
    names = [name for name in value.split(",") if name]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown {what} {', '.join(unknown)}; choose among: {', '.join(known)}")
    return names


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True, help="ERA5 sample data (e.g. from make gpu-table)")
    parser.add_argument("--out", default="bench_results/gpu/levers.json")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workers", type=int, default=8, help="loader workers")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (default: all)")
    parser.add_argument("--attention", default=",".join(ATTENTION), help="kernels to time (default: all; '' none)")
    parser.add_argument("--compiled", default="", help=f"compiled steps to time, among {', '.join(COMPILED)} "
                        "(default: none; each compiles the model, about 30 s on an H100)")
    parser.add_argument("--tiny", action="store_true", help="the tiny config (a check of this script)")
    args = parser.parse_args(argv)
    variants = chosen(parser, args.variants, VARIANTS, "variant")
    attention = chosen(parser, args.attention, ATTENTION, "attention kernel")
    compiled = chosen(parser, args.compiled, COMPILED, "compiled step")
    if "now" not in variants:
        variants.insert(0, "now")  # what every lever is measured against
    params = YParams("config/ViT.yaml", "tiny" if args.tiny else "short")
    flags = ["--data_dir", args.data_dir, "--amp_mode", "bf16", "--enable_fused",
             "--num_data_workers", str(args.workers)]
    apply_overrides(params, training_parser("levers").parse_args(flags), dp_size=1, dp_rank=0)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    loader = get_data_loader(params, train=True)  # one loader (its workers started once) for every variant
    report = {"device": device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "config": "tiny" if args.tiny else "short", "batch": params.local_batch_size, "steps": args.steps,
              "step_alone_ms": {}, "with_loader_ms": {}, "attention_ms": {}, "compiled_ms": {}}
    for name in variants:
        what, patches, needs_cuda = VARIANTS[name]
        loader_lever = any(owner in (TORCH_LOADER, RING_SAMPLER) for owner, _, _ in patches)
        for with_loader, key in ((False, "step_alone_ms"), (True, "with_loader_ms")):
            if (needs_cuda and device.type != "cuda") or (not with_loader and loader_lever):
                continue
            with patched([name]):
                report[key][name] = value = measure(params, loader, device, args.steps, args.warmup, with_loader)
            log(f"{what}, {'with the loader' if with_loader else 'step alone'}: {value:.2f} ms/step")
            write_json(args.out, report)  # after every measurement: a run cut short keeps what it measured
    for backend in attention:
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
    report["kept"] = kept = kept_candidates(report["step_alone_ms"])
    log(f"candidates kept (step alone at most {GAIN:.0%} of now's): {', '.join(kept) or 'none'}")
    for name in compiled:
        what, mode, needs_cuda = COMPILED[name]
        if needs_cuda and device.type != "cuda":
            report["compiled_ms"][name] = "not run: CUDA Graphs need a CUDA GPU"
        elif name == "kept" and not kept:
            report["compiled_ms"][name] = "not run: no candidate gained in eager"
        else:
            with patched(kept if name == "kept" else []):
                report["compiled_ms"][name] = measure(params, loader, device, args.steps, args.warmup, False,
                                                      compile_mode=mode)
        value = report["compiled_ms"][name]
        log(f"{what}: {value:.2f} ms/step" if isinstance(value, float) else f"{what}: {value}")
        write_json(args.out, report)
    log(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
