"""Command-line flags shared by the training scripts, and how they override the YAML config."""
import argparse
import os

import torch

from lifecycle.workers import check_worker_count
from utils.errors import ArgumentParser, UserError
from utils.layout import CP_METHODS, DEFAULT_CP_METHOD, DEFAULT_PP_SCHEDULE, PP_SCHEDULES, Layout, dry_run_refusal
from utils.rendezvous import DEFAULT_COLLECTIVE_TIMEOUT, DEFAULT_RENDEZVOUS_TIMEOUT

AMP_DTYPES = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")  # scaled_dot_product_attention's kernels


def training_parser(description, one_process_dp=True):
    """The flags every training script takes; `one_process_dp=False` leaves out --parallel dp (nn.DataParallel),
    which only train.py offers."""
    parser = ArgumentParser(description=description)
    add = parser.add_argument
    add("--local_rank", "--local-rank", type=int, default=None,
        help="set by `python -m torch.distributed.launch`; LOCAL_RANK from the environment wins")
    add("--dist_timeout", type=float, default=DEFAULT_RENDEZVOUS_TIMEOUT,
        help=f"seconds a rank waits for the others to join the process group before giving up (default "
             f"{DEFAULT_RENDEZVOUS_TIMEOUT})")
    add("--collective_timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT,
        help=f"seconds a collective (a step's all-reduce, a validation sum) waits for the slowest rank before the job "
             f"stops (default {DEFAULT_COLLECTIVE_TIMEOUT}); waits for rank 0's checkpoint write are not bounded by it")
    add("--run_num", type=str, default="00", help="tag for the experiment (leaf folder of the run directory)")
    add("--yaml_config", type=str, default="./config/ViT.yaml", help="YAML file of named configs")
    add("--config", type=str, default="base", help="name of the config inside the YAML file")
    # None below means "keep the YAML value"; every flag can switch a YAML value in either direction
    add("--amp_mode", type=str, default=None, choices=list(AMP_DTYPES), help="mixed precision")
    add("--enable_fused", action=argparse.BooleanOptionalAction, default=None, help="fused optimizer kernels")
    add("--enable_jit", action=argparse.BooleanOptionalAction, default=None, help="torch.compile the model")
    add("--enable_nhwc", action=argparse.BooleanOptionalAction, default=None,
        help="channels_last memory format for conv models (NHWC, NDHWC for 3D) and their inputs")
    add("--local_batch_size", type=int, default=None, help="per-rank batch; sets global = ranks x local")
    add("--num_iters", type=int, default=None, help="total training iterations")
    add("--num_epochs", type=int, default=None, help="total training epochs (instead of num_iters)")
    add("--num_data_workers", type=int, default=None, help="data loader worker processes")
    add("--data_loader_config", type=str, default=None,
        help="data loader: pytorch, dali, synthetic (ERA5: random batches, no files); pytorch (images); synthetic, "
             "inmem, lowmem, dali-lowmem (cosmology)")
    add("--sdpa_backend", type=str, default=None, choices=SDPA_BACKENDS,
        help="attention kernel (ViT): auto = torch's choice; cudnn, flash, efficient (memory-efficient) or math")
    add("--bucket_cap_mb", type=int, default=25, help="DDP gradient bucket size in MB")
    add("--disable_broadcast_buffers", action="store_true",
        help="DDP without buffer broadcast, gradients as bucket views")
    add("--noddp", action="store_true", help="no DDP wrapper even when distributed (no gradient sync)")
    add("--parallel", type=str, default="ddp", choices=["ddp", "dp"] if one_process_dp else ["ddp"],
        help="ddp: one process per device; dp: nn.DataParallel over the node's GPUs in one process")
    add("--arch", "-a", type=str, default=None, help="torchvision architecture (ResNet stage), e.g. resnet50")
    add("--desired_acc", "--desired-acc", type=float, default=None,
        help="stop once the validation top-1 accuracy reaches this fraction (classification)")
    add("--data_dir", type=str, default=os.environ.get("DATA_DIR"),
        help="re-root the config's /data paths here (default: $DATA_DIR)")
    add("--expdir", type=str, default=None, help="root of the run directories (config: expdir)")
    add("--checkpoint_interval", type=int, default=None,
        help="iterations between checkpoints; 0: only at the end")
    add("--resume", type=str, default=None,
        help="checkpoint to resume from (default: the run directory's own checkpoint, if any)")
    add("--stop_at_iter", type=int, default=None,
        help="stop after this iteration, checkpointed, as if the job hit its time limit")
    add("--profile_epoch", type=int, default=3, help="0-based epoch of the cudaProfilerApi window")
    add("--profile_iters", type=int, default=None, help="iterations in the profiler window (default: the epoch)")
    add("--torch_profile", type=str, default=None, metavar="PATH",
        help="also record the profiler window with torch.profiler (any device, no Nsight needed; not under nsys, "
             "which takes the same CUDA tracing interface) and write its Chrome trace to PATH (.json.gz: gzipped; "
             "one file a rank, .rankR added); reduce and draw it with python -m benchmarks.step_profile")
    add("--enable_benchy", action=argparse.BooleanOptionalAction, default=None,
        help="throughput benchmark (IO, SYNTHETIC, FULL) instead of training; JSON to $BENCHY_OUTPUT.json")
    add("--benchy_nbatches", type=int, default=None, help="batches per benchmark trial (default 50)")
    add("--benchy_ntrials", type=int, default=None, help="timed trials per benchmark (default 2)")
    add("--benchy_nwarmup", type=int, default=None, help="warm-up trials per benchmark (default 2)")
    # the UNet stage's original flags, kept as aliases of the unified ones
    add("--enable_amp", action="store_true", help="alias of --amp_mode fp16 (UNet stage)")
    add("--enable_apex", action="store_true", help="alias of --enable_fused (UNet stage; no APEX needed)")
    add("--enable_manual_profiling", action="store_true",
        help="the UNet stage's profiler window: 60 steps of the 2nd epoch (--profile_epoch 1 --profile_iters 60)")
    return parser


# the UNet stage's own flags and loaders (the SC21 tutorial's commands), each with what the ViT takes instead
UNET_FLAGS = {"enable_amp": "--amp_mode fp16", "enable_apex": "--enable_fused",
              "enable_manual_profiling": "--profile_epoch 1 --profile_iters 60"}
UNET_LOADERS = {"dali-lowmem": "dali", "lowmem": "pytorch", "inmem": "pytorch"}


def check_stage_flags(args, params):
    """Refuse the UNet stage's own flags on a config that trains the ViT, in one line naming config/UNet.yaml: the
    SC21 tutorial's commands name no YAML file, and train.py's default (config/ViT.yaml) would train the ViT."""
    if params.get("model", "vit") != "vit":
        return
    given = [(f"--{name}", instead) for name, instead in UNET_FLAGS.items() if getattr(args, name, False)]
    if args.data_loader_config in UNET_LOADERS:
        given.append((f"--data_loader_config {args.data_loader_config}",
                      f"--data_loader_config {UNET_LOADERS[args.data_loader_config]}"))
    if given:
        flags = ", ".join(flag for flag, _ in given[:-1]) + " and " * (len(given) > 1) + given[-1][0]
        raise UserError(f"{flags} {'is a flag' if len(given) == 1 else 'are flags'} of the UNet stage (the SC21 "
                        f"tutorial), but {os.path.normpath(args.yaml_config)} trains the ViT: add --yaml_config "
                        f"config/UNet.yaml (for the ViT: {', '.join(instead for _, instead in given)})")


def model_parallel_parser(description):
    """training_parser for the model-parallel scripts (no --parallel dp), with the layout and memory flags."""
    parser = training_parser(description, one_process_dp=False)
    add = parser.add_argument
    add("--tensor_parallel", type=int, default=1, help="ranks that split each layer's weights (tp)")
    add("--context_parallel", type=int, default=1, help="ranks that split the sequence (cp)")
    add("--parallel_order", type=str, default="tp-cp-dp", help="rank order, first name fastest")
    add("--cp_method", type=str, default=DEFAULT_CP_METHOD, choices=CP_METHODS,
        help="how attention meets the other cp ranks' keys and values (distributed/context_parallel.py): allgather "
             "(each rank gathers the whole sequence's), ring (blocks passed round the cp ranks, each transfer beside "
             "a block's compute) or alltoall (Ulysses: sequence shards swapped for head shards; cp must divide the "
             "heads left after tp)")
    add("--sequence_parallel", action="store_true",
        help="split the tokens over tp between the blocks (needs --tensor_parallel > 1)")
    add("--activation_checkpointing", action="store_true",
        help="recompute each transformer block's forward in the backward pass (less memory)")
    add("--fsdp", action="store_true", help="shard weights, gradients and Adam state over dp (FSDP2) instead of DDP")
    add("--pipeline_parallel", type=int, default=1, metavar="P",
        help="pipeline stages (pp): each holds consecutive blocks, the first the patch embedding, the last the head "
             "and loss; microbatches flow through them (distributed/pipeline.py)")
    add("--num_microbatches", type=int, default=None, metavar="M",
        help="with --pipeline_parallel: microbatches of the local batch a step (default P; at least P)")
    add("--pp_schedule", type=str, default=DEFAULT_PP_SCHEDULE, choices=PP_SCHEDULES,
        help="with --pipeline_parallel: gpipe (all forwards, then all backwards) or 1f1b (one forward, one backward "
             "after a warm-up: at most P microbatches' activations held)")
    add("--pp_layers", type=str, default=None, metavar="N,N,...",
        help="with --pipeline_parallel: blocks per stage, e.g. 5,6,6,7 (default: balanced by cost)")
    add("--checkpoint_format", type=str, default="auto", choices=("auto", "serial", "sharded"),
        help="serial: the whole model gathered and written by rank 0; sharded: each rank writes its own part, and "
             "a load reads only its part, at any layout (lifecycle/shards.py); auto (default): sharded from 1B "
             "parameters")
    add("--dry_run", type=ranks, default=None, metavar="N",
        help="run one rank of this layout on N ranks in this one process (the others stand-ins whose collectives "
             "move no data) and print its memory and compute time instead of training (planning/dry_run.py); "
             "without data, add --data_loader_config synthetic")
    add("--dry_run_rank", type=int, default=0, metavar="R", help="with --dry_run: the rank it runs, 0..N-1 (default 0)")
    add("--dry_run_steps", type=int, default=3, metavar="S",
        help="with --dry_run: the steps timed after the warm-up (default 3; 0: memory only, no step time)")
    return parser


def ranks(text):
    """argparse type of --dry_run: a number of ranks, at least 1 and at most what a dry run stands in for
    (utils/layout.DRY_RUN_MAX_RANKS), refused before anything is built."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of ranks; give a whole number, at least 1")
    too_large = dry_run_refusal(value)
    if too_large:
        raise argparse.ArgumentTypeError(too_large)
    return value


def reroot(path, data_root, data_dir):
    """`data_root/x` -> `data_dir/x`; paths outside data_root are kept."""
    if data_dir and path and data_root and (path == data_root or path.startswith(data_root.rstrip("/") + "/")):
        return os.path.normpath(os.path.join(data_dir, os.path.relpath(path, data_root)))
    return path


def apply_overrides(params, args, dp_size, dp_rank):
    """Write the flags that were given into params, then derive what follows from them, in named steps."""
    take_flags(params, args)
    check_counts_and_set_defaults(params)
    set_precision(params, args)
    set_batch_sizes(params, args, dp_size)
    set_profiling_window(params, args)
    set_data_paths_and_shard(params, args, dp_size, dp_rank)


def take_flags(params, args):
    """The flags given on the command line (None: keep the YAML value) into params; the UNet stage's aliases."""
    if args.enable_amp:
        args.amp_mode = args.amp_mode or "fp16"
    if args.enable_apex:
        args.enable_fused = True
    if args.stop_at_iter is not None and args.stop_at_iter < 1:
        raise UserError(f"--stop_at_iter is {args.stop_at_iter}; give the iteration to stop after (at least 1)")
    if args.num_epochs is not None and args.num_iters is not None:
        raise UserError("give the run length once: --num_iters or --num_epochs, not both")
    if args.num_epochs is not None:  # an explicit length in epochs replaces the config's num_iters
        params.num_iters = None
    for key in ("amp_mode", "enable_fused", "enable_jit", "enable_nhwc", "num_iters", "num_epochs",
                "num_data_workers", "data_loader_config", "expdir", "checkpoint_interval", "arch",
                "enable_benchy", "benchy_nbatches", "benchy_ntrials", "benchy_nwarmup", "sdpa_backend"):
        value = getattr(args, key)
        if value is not None:
            params[key] = value


def check_counts_and_set_defaults(params):
    """Counts that must be whole and large enough (run length, checkpoint interval, workers, benchmark trials);
    defaults for the switches a config may leave out."""
    for key, hint in (("checkpoint_interval", " (0: checkpoint only at the end)"), ("num_data_workers", "")):
        if not isinstance(params.get(key, 0), int) or params.get(key, 0) < 0:
            raise UserError(f"{key} is {params.get(key)}; it must be a whole number >= 0{hint}")
    check_worker_count(params.get("num_data_workers", 0))
    if params.get("num_iters") is None and params.get("num_epochs") is None:
        raise UserError("the config sets neither num_iters nor num_epochs; give one (or --num_iters N)")
    if params.get("num_iters") is not None and params.num_iters < 1:
        raise UserError(f"num_iters is {params.num_iters}; it must be at least 1")
    if params.get("num_iters") is None and params.num_epochs < 1:
        raise UserError(f"num_epochs is {params.num_epochs}; it must be at least 1")
    params.setdefault("enable_jit", False)
    params.setdefault("enable_nhwc", False)
    params.setdefault("enable_benchy", False)
    params.setdefault("sdpa_backend", "auto")
    if params.sdpa_backend not in SDPA_BACKENDS:
        raise UserError(f"sdpa_backend '{params.sdpa_backend}' is unknown; choose one of: {', '.join(SDPA_BACKENDS)}")
    for key, default, minimum in (("benchy_nbatches", 50, 1), ("benchy_ntrials", 2, 1), ("benchy_nwarmup", 2, 0)):
        params.setdefault(key, default)
        if params[key] < minimum:
            raise UserError(f"{key} is {params[key]}; it must be at least {minimum}")
    # cudnn autotuning: on, except where a config keeps it for its "extra opts" step (ResNet baseline)
    params.cudnn_benchmark = bool(params.get("enable_extra_opts", True))


def set_precision(params, args):
    """amp_mode (the UNet and ResNet stages' own YAML switches read into it), amp_enabled, amp_dtype, enable_fused."""
    if args.amp_mode is None and params.get("enable_amp"):
        params.amp_mode = "fp16"
    if args.enable_fused is None and (params.get("enable_apex") or params.get("enable_extra_opts")):
        params.enable_fused = True
    params.setdefault("amp_mode", "none")
    params.setdefault("enable_fused", False)
    if params.amp_mode not in AMP_DTYPES:
        raise UserError(f"amp_mode '{params.amp_mode}' is unknown; choose one of: {', '.join(AMP_DTYPES)}")
    params.update({"amp_enabled": params.amp_mode != "none", "amp_dtype": AMP_DTYPES[params.amp_mode]})


def set_batch_sizes(params, args, dp_size):
    """local_batch_size and global_batch_size over the `dp_size` data-parallel ranks (the original's rule)."""
    if args.local_batch_size is not None:
        if args.local_batch_size < 1:
            raise UserError(f"--local_batch_size is {args.local_batch_size}; it must be at least 1")
        params.local_batch_size = args.local_batch_size
        params.global_batch_size = dp_size * args.local_batch_size
    else:
        Layout(dp=dp_size).check(global_batch=params.global_batch_size)  # the batch splits over dp (utils/layout.py)
        params.local_batch_size = params.global_batch_size // dp_size


def set_profiling_window(params, args):
    """The epoch and length of the profiler window (--profile_epoch/--profile_iters, the UNet and ResNet stages' own
    switches)."""
    if params.enable_benchy and args.enable_manual_profiling:
        raise UserError("Enable either benchy profiling or manual profiling, not both.")
    if getattr(args, "torch_profile", None):
        if params.enable_benchy:
            raise UserError("--torch_profile records the training loop's profiler window, which --enable_benchy "
                            "does not run; drop one of them")
        if getattr(args, "dry_run", None) is not None:
            raise UserError("--torch_profile records the training loop's profiler window, which --dry_run does not "
                            "run; drop one of them")
    if args.enable_manual_profiling:
        args.profile_epoch, args.profile_iters = 1, 60
    elif params.get("enable_profiling"):  # the ResNet stage's *-prof configs name their window
        args.profile_epoch = params.profiling_epoch_start - 1
        args.profile_iters = params.profiling_iters_per_epoch


def set_data_paths_and_shard(params, args, dp_size, dp_rank):
    """The config's /data paths re-rooted at --data_dir; this rank's shard of the data (one per dp rank)."""
    for key in list(params.params):
        if (key.endswith("_path") or "_path_" in key) and isinstance(params[key], str):  # also train_path_npy_data
            params[key] = reroot(params[key], params.get("data_root"), args.data_dir)
    params.data_num_shards = dp_size
    params.data_shard_id = dp_rank
