"""Benchmark: what the checkpoint digest costs, on the save and on the load of a config's checkpoint.

    python -m benchmarks.bench_checkpoint [--config mp] [--out bench_results/checkpoint_digest.json]

Builds the config's ViT (serial, on the CPU) and Adam's state for it (both moments, as after a step), then times,
each the best of --repeats: the digest alone (lifecycle/checkpoint.state_digest), torch.save of the same state to a
file (no digest, no flush to disk), save_checkpoint (digest + atomic write: flushed to disk, renamed), torch.load,
and load_checkpoint (load + digest check). The files go to --dir (default: a temporary folder beside the JSON); the
page cache is warm, so the write and read times are the machine's memory and file system's at their best, and the
digest's share of a save on a cluster's parallel file system is smaller than here.
"""
import os
import shutil
import tempfile
import time

import torch

from benchmarks.common import machine
from lifecycle.checkpoint import load_checkpoint, save_checkpoint, state_digest
from networks import get_model
from utils.atomic import write_json
from utils.errors import ArgumentParser
from utils.YParams import YParams

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkpoint_state(config):
    """The state train.py saves for `config`'s ViT: the model, Adam after one step (both moments), the rest small."""
    params = YParams(os.path.join(REPO_ROOT, "config", "ViT.yaml"), config)
    torch.manual_seed(0)
    model = get_model(params)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iteration": 1,
            "rng_states": [{"torch": torch.get_rng_state()}], "config_name": config, "params": dict(params.params)}


def best_of(repeats, action):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="mp", help="a config of config/ViT.yaml (default mp: 158 M parameters)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoint files are written (removed after)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    print(f"building {args.config}'s model and Adam state ...", flush=True)
    state = checkpoint_state(args.config)
    tensors = [t for part in (state["model"], *state["optimizer"]["state"].values()) for t in
               (part.values() if isinstance(part, dict) else [part]) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    parameters = sum(t.numel() for t in state["model"].values())
    folder = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir or (os.path.dirname(os.path.abspath(args.out))
                                                                           if args.out else None))
    plain, checked = os.path.join(folder, "plain.pt"), os.path.join(folder, "checkpoints", "ckpt.pt")
    try:
        print(f"{parameters / 1e6:.1f} M parameters, {nbytes / 1e9:.2f} GB of tensors; timing (best of "
              f"{args.repeats}) ...", flush=True)
        results = {
            "digest_s": best_of(args.repeats, lambda: state_digest(state)),
            "torch_save_s": best_of(args.repeats, lambda: torch.save(state, plain)),
            "save_checkpoint_s": best_of(args.repeats, lambda: save_checkpoint(checked, state)),
            "torch_load_s": best_of(args.repeats, lambda: torch.load(plain, map_location="cpu", weights_only=True)),
            "load_checkpoint_s": best_of(args.repeats, lambda: load_checkpoint(checked)),
        }
        file_bytes = os.path.getsize(checked)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    results.update(
        digest_gb_per_s=nbytes / 1e9 / results["digest_s"],
        digest_share_of_save=results["digest_s"] / results["save_checkpoint_s"],
        digest_share_of_load=(results["load_checkpoint_s"] - results["torch_load_s"]) / results["load_checkpoint_s"])
    report = {"config": args.config, "parameters": parameters, "tensor_bytes": nbytes, "file_bytes": file_bytes,
              "repeats": args.repeats, "machine": machine(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), **results}
    for key, value in results.items():
        print(f"  {key}: {value:.3f}")
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
