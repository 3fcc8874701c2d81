"""Benchmark: one ViT training step (forward, backward, Adam) against the device's matmul peak.

    python -m benchmarks.bench_step [--out bench_results/vit_step_cpu.json]

Default shape, as in the project's CPU target: input 20 x 64 x 128, patch 8, embed 384, depth 12,
8 heads, batch 4, fp32, Adam (fused unless --no-fused). Prints the step's achieved FLOP/s, the matmul
peak measured in the same run, and their ratio (MFU), and writes them as JSON.
"""
import argparse
import platform
import time

import torch

from loop.flops import measure_matmul_peak, train_flops_per_sample
from networks.vit import VisionTransformer
from utils.atomic import write_json
from utils.errors import ArgumentParser


def build(args):
    return VisionTransformer(img_size=(args.height, args.width), patch_size=args.patch_size, in_chans=20,
                             out_chans=20, embed_dim=args.embed_dim, depth=args.depth, num_heads=args.num_heads)


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--patch_size", type=int, default=8)
    parser.add_argument("--embed_dim", type=int, default=384)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--num_heads", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--warmup_steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                        help="fused Adam, as train.py --enable_fused")
    parser.add_argument("--out", type=str, default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    print(f"[bench_step] measuring the fp32 matmul peak on {device} ...", flush=True)
    peak = measure_matmul_peak(device, torch.float32, seconds=2.0)
    flops_per_step = args.batch_size * train_flops_per_sample(lambda _: build(args), None,
                                                              (20, args.height, args.width))
    torch.manual_seed(0)
    model = build(args).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=args.fused)
    inp = torch.randn(args.batch_size, 20, args.height, args.width, device=device)
    tar = torch.randn_like(inp)

    step_times = []
    for step in range(args.warmup_steps + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(inp), tar)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup_steps:
            step_times.append(time.perf_counter() - start)
            print(f"[bench_step] step {len(step_times)}/{args.steps}: {step_times[-1] * 1e3:.1f} ms", flush=True)
    step_time = sorted(step_times)[len(step_times) // 2]  # median: robust to a stray slow step
    achieved = flops_per_step / step_time
    results = {
        "shape": {k: getattr(args, k) for k in ("height", "width", "patch_size", "embed_dim", "depth",
                                                  "num_heads", "batch_size")},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "fused_adam": args.fused,
        "flops_per_step": flops_per_step,
        "median_step_seconds": step_time,
        "achieved_tflops": achieved / 1e12,
        "matmul_peak_tflops": peak / 1e12,
        "mfu": achieved / peak,
    }
    print(f"[bench_step] ViT train step: {step_time * 1e3:.1f} ms, {achieved / 1e9:.1f} GFLOP/s")
    print(f"[bench_step] fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"[bench_step] ratio (MFU): {100 * achieved / peak:.1f}%")
    if args.out:
        write_json(args.out, results)
        print(f"[bench_step] wrote {args.out}")


if __name__ == "__main__":
    main()
