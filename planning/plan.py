"""Plan a model-parallel layout before spending GPU hours: the performance model (planning/perf_model.py) predicts
memory, communication and speed of train_mp.py's ViT in any tp x cp x dp x pp layout on a table of GPUs.

    make plan ARGS="--config mp --gpus 16 --tensor_parallel 4"            # one layout
    make plan ARGS="--config mp --gpus 16 --plan"                         # every layout that fits, fastest first
    python -m planning.plan --config mp --gpus 64 --gpu H100-SXM --plan --json
    make plan ARGS="--config mp --gpus 16 --plan --measure"              # + the first 3 measured by dry runs
    make plan ARGS="--config wfm_10b_p2 --gpus 256 --gpu H100-SXM --plan"  # pipeline stages among them

The flags are train_mp.py's (--yaml_config --config --tensor_parallel --context_parallel --parallel_order --amp_mode
--sequence_parallel --activation_checkpointing --fsdp --cp_method --pipeline_parallel --num_microbatches
--pp_schedule --pp_layers) plus --gpu (the system), --gpus (all GPUs of the job: dp = gpus / (tp x cp x pp); the local
batch follows from the config's global batch), --plan and --json (the last line printed is one JSON object: the
prediction, or with --plan {"layouts": [...]}, each with its tp, cp, dp). With --plan the layout flags given are kept
and the others are tried: every tp and cp that divide, pp among 1, 2, 4, 8, ... dividing the depth and the GPUs
(for a model whose state takes 1/8 of a GPU or more: PIPELINE_STATE_SHARE; as many microbatches as the local batch
has samples, unless --num_microbatches is given), and the memory flags. Each layout
comes with the sbatch line that runs it (submit_pm_mp.sh: nodes of 4 GPUs). Predictions, not measurements:
docs/perf_model.md says what the model counts and how it compares with the published runs. --measure K runs rank 0
of the first K layouts on this machine (train_mp.py --dry_run: planning/dry_run.py) and prints what it holds
and how long its step computes beside the prediction.
"""
import dataclasses
import itertools
import json
import math
import os

import torch

from planning.dry_run import CPU_DRY_RUN_FLAGS, dry_run_in_own_process, gpu_system
from planning.perf_model import (
    GIB,
    ORIGINAL_ATTENTION_INPUT_CASTS,
    RUNTIME_OVERHEAD_GIB,
    SYSTEMS,
    ViTShape,
    attention_over_dense,
    compute_seconds,
    flops_per_sample,
    parameters_per_rank,
    predict,
    ring_steps,
)
from resilience.exits import exit_on_user_error
from utils.errors import ArgumentParser, UserError
from utils.layout import CP_METHODS, DEFAULT_CP_METHOD, DEFAULT_PP_SCHEDULE, PP_SCHEDULES, Layout, parse_pp_layers
from utils.YParams import YParams

MEASURE_TIMEOUT_S = 3600  # one dry run of --measure (the `mp` ViT's rank 0 on a laptop CPU takes minutes)
MEMORY_FLAGS = list(itertools.product((False, True), repeat=3))  # sequence parallel, checkpointing, fsdp
# --plan tries pipelines (pp > 1) for a model whose fp32 state (weights, gradients, Adam's moments: 16 bytes a
# parameter) takes at least this share of a GPU's memory: the 0.25-degree ViTs (wfm_1b_p4: 16.6 GB, wfm_10b_p2: 172
# GB), not the tutorial's `mp` (2.5 GB), whose plans stay those README and docs/perf_model.md quote
PIPELINE_STATE_SHARE = 1 / 8


def published_rate(lowest, highest):
    """A published run's samples/s, derived from its log's epoch lines: the middle of the range they span, lowest to
    highest, as the project's facts on the originals record them (FACTS.md, A23, which keeps only each range's ends:
    the single-GPU run's over its steady epochs 2-4, the model-parallel runs' over the epochs shown, the first not told
    apart from the rest). The ranges are narrow (tp=4: 123.6 to 125.2, 1.3%), far inside the model's error. One rule
    for every published rate that has a range."""
    return round((lowest + highest) / 2, 1)


# the published runs (the original tutorial's README, Perlmutter): config, GPU, layout, amp, samples/s, and the
# " Memory usage after forward pass" line (GB; None: not published)
PUBLISHED = [
    ("short", "A100-40GB", Layout(), "bf16", published_rate(53.2, 54.0), None),  # DALI + AMP bf16, one GPU, epochs 2-4
    ("mp", "A100-80GB", Layout(tp=1, dp=4), "fp16", published_rate(93.1, 93.3), 44.9),  # OOM on the 40 GB A100
    ("mp", "A100-40GB", Layout(tp=4, dp=4), "fp16", published_rate(123.6, 125.2), 33.2),  # epochs 123.6 to 125.2
    ("mp", "A100-40GB", Layout(cp=4, dp=4, order="cp-tp-dp"), "fp16", 166.0, 26.6),  # the 2025 edition's: "about 166"
]

# the measured step profiles (benchmarks/step_profile.py --committed) the model is checked against part by part:
# profile name in the file, its label, the ViT config and precision it ran
PROFILES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_results", "gpu",
                        "step_profiles.json")
PROFILED = [("vit_nw8_bf16", "eager", "short", "bf16"), ("vit_nw8_bf16_fused_jit", "compiled", "short", "bf16")]
# the committed profiles (2026-11-27) ran the attention as it was then: q, k and v each cast the norm's output
PROFILED_ATTENTION_INPUT_CASTS = ORIGINAL_ATTENTION_INPUT_CASTS
# a measured part against the model's: (measured parts summed, what the row says)
PARTS = {"attention": (("attention",), "attention (FlashAttention: its matmuls and softmax)"),
         "gemm": (("gemm",), "GEMMs (the linear layers)"),
         "memory_bound": (("norm_elementwise", "optimizer"), "memory-bound (norms, elementwise, optimizer)")}
PART_TOLERANCE = {"attention": 0.15, "gemm": 0.25}  # measured / model within 1 +- this; memory-bound: see below
DEFAULT_GPU = "A100-40GB"
# --methods: Perlmutter's A100 nodes and H100 nodes (unless --gpu names one), and the patch sizes whose sequence
# lengths it sweeps (those that divide the config's image: 720 x 1440 gives 4,050 to 259,200 tokens)
METHOD_SYSTEMS = ("A100-40GB", "H100-SXM")
SWEEP_PATCHES = (16, 12, 8, 6, 4, 3, 2)
METHOD_NAMES = {"allgather": "all-gather", "ring": "ring", "alltoall": "all-to-all"}

def parser():
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--yaml_config", default="./config/ViT.yaml", help="YAML file of named configs")
    add("--config", default="mp", help="a ViT config of the file")
    add("--tensor_parallel", type=int, default=None, help="tp (default 1; with --plan: every tp that divides)")
    add("--context_parallel", type=int, default=None, help="cp (default 1; with --plan: every cp that divides)")
    add("--parallel_order", default="tp-cp-dp", help="rank order, first name fastest (4 ranks a node)")
    add("--amp_mode", choices=["none", "fp16", "bf16"], default=None, help="precision (default: the config's)")
    add("--sequence_parallel", action="store_true")
    add("--activation_checkpointing", action="store_true")
    add("--fsdp", action="store_true")
    add("--cp_method", choices=CP_METHODS, default=None,
        help=f"how cp attention reaches the other ranks' K/V (default {DEFAULT_CP_METHOD}; with --plan: each)")
    add("--pipeline_parallel", type=int, default=None,
        help="pp: pipeline stages (default 1; with --plan, for a model whose state takes 1/8 of a GPU or more: 1, 2, "
             "4, ... dividing the depth and the GPUs)")
    add("--num_microbatches", type=int, default=None,
        help="microbatches a step under pp (default: one a sample of the local batch, the smallest bubble)")
    add("--pp_schedule", choices=PP_SCHEDULES, default=None, help=f"pipeline schedule (default {DEFAULT_PP_SCHEDULE})")
    add("--pp_layers", default=None, help="blocks per stage, e.g. 12,12,12,12 (default: balanced by cost)")
    add("--gpu", choices=sorted(SYSTEMS), default=None,
        help=f"the GPU (default {DEFAULT_GPU}; Perlmutter-style nodes of 4, H200-HGX8 an 8-GPU NVSwitch node)")
    add("--gpus", type=int, default=None, help="GPUs of the job (default: tp x cp, so dp = 1)")
    add("--overhead_gb", type=float, default=RUNTIME_OVERHEAD_GIB,
        help="GPU memory outside the model's tensors (CUDA context, NCCL, DALI); default: the tutorial's")
    add("--plan", action="store_true", help="every layout of --gpus GPUs that fits, fastest first")
    add("--json", action="store_true", help="end with one line of JSON")
    add("--top", type=int, default=10, help="layouts printed with --plan (the JSON holds all)")
    add("--published", action="store_true", help="the model against the published runs (README's table)")
    add("--methods", action="store_true",
        help="the three cp methods: the fastest layouts with their method, and over sequence lengths (the config's "
             f"image at patch {', '.join(map(str, SWEEP_PATCHES))}) where each starts to pay, on "
             f"{' and '.join(METHOD_SYSTEMS)} (or --gpu)")
    add("--parts", nargs="?", const=PROFILES, default=None, metavar="STEP_PROFILES_JSON",
        help="the model's step, part by part, against the measured step profiles of one GPU (default: "
             "bench_results/gpu/step_profiles.json)")
    add("--measure", type=int, nargs="?", const=3, default=0, metavar="K",
        help="also run rank 0 of the first K layouts (default 3) on this machine (train_mp.py --dry_run, synthetic "
             "data) and print the measured memory and compute time beside the prediction")
    return parser


def read_config(args):
    params = YParams(args.yaml_config, args.config)
    if params.get("model", "vit") != "vit":
        raise UserError(f"config '{args.config}' is a {params.get('model')} model; the performance model covers the "
                        "ViT configs of config/ViT.yaml (e.g. --config mp)")
    return ViTShape.from_params(params), params.global_batch_size, args.amp_mode or params.get("amp_mode", "none")


def refusal(shape, layout, global_batch):
    """The line train_mp.py would refuse this layout with (utils/layout.py's rules), or None."""
    return layout.refusal(num_heads=shape.num_heads, mlp_hidden=shape.hidden, tokens=shape.tokens,
                          global_batch=global_batch, depth=shape.depth)


def sbatch_line(config, layout, amp_mode=None, gpus_per_node=4):
    gpus = layout.world_size
    nodes = f"--nodes {math.ceil(gpus / 4)}" if gpus >= 4 else f"--nodes 1 --ntasks-per-node {gpus} " \
        f"--gpus-per-node {gpus}"
    if gpus_per_node != 4:  # submit_pm_mp.sh runs 4 ranks a node: say this node's
        per_node = min(gpus, gpus_per_node)
        nodes = f"--nodes {math.ceil(gpus / per_node)} --ntasks-per-node {per_node} --gpus-per-node {per_node}"
    extra = [f"--amp_mode={amp_mode}"] if amp_mode else []
    return " ".join(["sbatch", nodes, "submit_pm_mp.sh", f"--config={config}", *layout.flags(), *extra])


def pipeline_sizes(gpus, shape, system, args):
    """The pp sizes to try: the one given; else with --plan, for a model whose state takes PIPELINE_STATE_SHARE of
    the GPU's memory or more, 1, 2, 4, 8, ... dividing both the GPUs and the depth; else 1."""
    if getattr(args, "pipeline_parallel", None):
        return [args.pipeline_parallel]
    if not getattr(args, "plan", False) or shape is None or \
            16 * parameters_per_rank(shape) < PIPELINE_STATE_SHARE * system.memory_gib * GIB:
        return [1]
    return [2 ** k for k in range(shape.depth.bit_length()) if shape.depth % 2 ** k == 0 and gpus % 2 ** k == 0]


def pipeline_switches(gpus, tp, cp, pp, global_batch, args):
    """Layout keywords of a pipeline of pp stages (none at pp = 1): the microbatches given, or one a sample of the
    local batch (the smallest bubble; at least pp, so that a batch too small is refused by the layout's rule), the
    schedule and blocks per stage given. None: tp x cp x pp does not divide the GPUs."""
    if pp == 1:
        return {}
    if gpus % (tp * cp * pp):
        return None
    local = global_batch // (gpus // (tp * cp * pp)) if global_batch else pp
    return {"pp": pp, "microbatches": getattr(args, "num_microbatches", None) or max(local, pp),
            "pp_schedule": getattr(args, "pp_schedule", None) or DEFAULT_PP_SCHEDULE,
            "pp_layers": parse_pp_layers(getattr(args, "pp_layers", None))}


def layouts_of(gpus, args, shape=None, global_batch=None, system=None):
    """Every layout of `gpus` GPUs: tp and cp dividing them (or the ones given), pp (pipeline_sizes) with its
    microbatches (pipeline_switches), with each combination of the memory flags that applies (the flags given are
    always on; FSDP at dp = 1 only when asked for)."""
    divisors = [n for n in range(1, gpus + 1) if gpus % n == 0]
    for pp in pipeline_sizes(gpus, shape, system, args):
        for tp in divisors if args.tensor_parallel is None else [args.tensor_parallel]:
            for cp in divisors if args.context_parallel is None else [args.context_parallel]:
                if gpus % (tp * cp):
                    continue
                pipeline = pipeline_switches(gpus, tp, cp, pp, global_batch, args)
                if pipeline is None:
                    continue
                # the cp method given, or each at cp > 1 (at cp = 1 there is none: the default stands for it)
                methods = [args.cp_method or DEFAULT_CP_METHOD] if cp == 1 or args.cp_method else CP_METHODS
                for (sp, ac, fsdp), method in itertools.product(MEMORY_FLAGS, methods):
                    if (sp and tp == 1) or (fsdp and gpus == tp * cp * pp and not args.fsdp):
                        continue
                    if (args.sequence_parallel and not sp) or (args.activation_checkpointing and not ac) or \
                            (args.fsdp and not fsdp):
                        continue
                    yield Layout.for_world(gpus, tp, cp, order=args.parallel_order, sequence_parallel=sp,
                                           checkpointing=ac, fsdp=fsdp, cp_method=method, **pipeline)


def plan(shape, system, gpus, global_batch, amp_mode, args):
    """Predictions of every layout of `gpus` GPUs that divides and fits, fastest first, each with its sbatch line.
    None divides: one line."""
    found, divides, first_problem = [], False, None
    for layout in layouts_of(gpus, args, shape, global_batch, system):
        problem = refusal(shape, layout, global_batch)
        if problem:
            first_problem = first_problem or problem
            continue
        divides = True
        prediction = predict(shape, system, layout, global_batch, amp_mode, args.overhead_gb)
        if prediction["fits"]:
            prediction["sbatch"] = sbatch_line(args.config, layout, args.amp_mode, system.gpus_per_node)
            found.append(prediction)
    if not divides:
        reason = f" ({first_problem})" if first_problem else ""
        raise UserError(f"no layout of {gpus} GPUs with the sizes and flags given divides{reason}; change them")
    return sorted(found, key=lambda row: -row["samples_per_sec"])


def cp_name(row):
    """'cp=4' with its method where there is one: 'cp=4 (ring)'."""
    method = row.get("cp_method", DEFAULT_CP_METHOD)
    return f"cp={row['cp']}" + (f" ({method})" if row["cp"] > 1 else "")


def _flags(row):
    """A row's flags after tp and cp, but the cp method (cp_name says it) and the pipeline's (pp_name says them)."""
    said = ("--cp_method", "--pipeline_parallel", "--num_microbatches", "--pp_schedule", "--pp_layers")
    return [flag for flag in row["flags"][2:] if not flag.startswith(said)]


def pp_name(row):
    """' pp=4 (1f1b, M=16)' for a pipeline, '' without one."""
    if row.get("pp", 1) == 1:
        return ""
    return f" pp={row['pp']} ({row['pp_schedule']}, M={row['microbatches']})"


def pipeline_line(row):
    """A pipeline's stages in one line: blocks, peak memory, the heaviest stage, the bubble and the transfers."""
    pipe = row.get("pipeline")
    if not pipe:
        return None
    stages = ", ".join(f"{stage['blocks']}" for stage in pipe["per_stage"])
    peaks = ", ".join(f"{stage['peak_memory_gb']:.1f}" for stage in pipe["per_stage"])
    return (f"  stages: blocks {stages}; peak GB {peaks}: the heaviest stage {pipe['heaviest_stage']} "
            f"({pipe['heaviest_peak_gb']:.1f} GB); bubble {100 * pipe['bubble']:.1f}% of the step; between stages "
            f"{pipe['p2p_bytes_per_step'] / GIB:.2f} GB each way a step over {pipe['p2p_link']} "
            f"({1e3 * pipe['p2p_seconds']:.0f} ms)")


def ring_line(row):
    """The ring's overlap in one line: its block, the link, the blocks that hide their transfer."""
    ring = row.get("ring")
    if not ring:
        return None
    need = ring["min_block_tokens"]
    return (f"  ring: blocks of {ring['block_tokens']:,} tokens over {ring['link']} "
            f"({ring['link_bytes_per_s'] / 1e9:g} GB/s); a block hides its transfer from "
            f"{need['forward']:,.0f} tokens forward, {need['backward']:,.0f} backward (Liu et al.'s F/B: "
            f"{need['liu']:,.0f}): {'hidden' if ring['hidden'] else 'NOT hidden'}")


def describe(row, system):
    breakdown, counts = row["time_breakdown_s"], row["counts"]
    memory = counts["memory_bytes"]
    comm = ", ".join(f"{group} {nbytes / GIB:.2f} GB" for group, nbytes in row["comm_bytes_per_step"].items()
                     if nbytes)
    lines = [
        f"layout tp={row['tp']} {cp_name(row)} dp={row['dp']}{pp_name(row)} ({row['order']}) "
        f"{' '.join(_flags(row))}".rstrip(),
        f"  per GPU: {row['parameters_per_gpu'] / 1e6:.1f} M parameters, local batch {row['local_batch_size']}; "
        f"memory after the forward {row['memory_after_forward_gb']:.1f} GB, peak {row['peak_memory_gb']:.1f} GB of "
        f"{system.memory_gib:g} ({'fits' if row['fits'] else 'does NOT fit'})",
        "  of which (GB): " + ", ".join(f"{name.replace('_', ' ')} {memory[name] / GIB:.2f}" for name in (
            "weights", "optimizer_state", "ddp_buckets", "gathered_root", "input_batch", "saved_activations",
            "gradients")) +
        f", runtime overhead {row['memory_after_forward_gb'] - memory['after_forward'] / GIB:.1f}",
        f"  one block, one sample: {counts['block_flops_per_sample']['forward'] / 1e9:.1f} GFLOP forward, "
        f"{counts['block_flops_per_sample']['backward'] / 1e9:.1f} backward (this rank's share)",
        f"  step {1e3 * row['step_time_s']:.0f} ms: matmul {1e3 * breakdown['matmul']:.0f}, softmax "
        f"{1e3 * breakdown['softmax']:.0f}, memory-bound {1e3 * breakdown['memory_bound']:.0f}, "
        + (f"bubble {1e3 * breakdown['bubble']:.0f}, " if "bubble" in breakdown else "") + "exposed "
        f"communication {1e3 * breakdown['exposed_communication']:.0f} ms; moved per step: {comm or 'nothing'}",
        f"  predicted {speed(row['samples_per_sec'])} samples/s, MFU {100 * row['mfu']:.1f}%",
        ring_line(row),
        pipeline_line(row),
        f"  run it: {row['sbatch']}"]
    return "\n".join(line for line in lines if line)


def speed(samples_per_sec):
    """Samples/s as printed: one decimal, three figures below 10 (a 0.25-degree step takes seconds)."""
    return f"{samples_per_sec:.1f}" if samples_per_sec >= 10 else f"{samples_per_sec:.3g}"


def against_published(yaml_config="./config/ViT.yaml"):
    """[(config, GPU, layout, amp, prediction, published samples/s, published memory)] of the published runs."""
    rows = []
    for config, gpu, layout, amp, speed, memory in PUBLISHED:
        params = YParams(yaml_config, config)
        # the original's code ran them: its q, k and v each cast the norm's output under autocast
        shape = dataclasses.replace(ViTShape.from_params(params), attention_input_casts=ORIGINAL_ATTENTION_INPUT_CASTS)
        prediction = predict(shape, SYSTEMS[gpu], layout, params.global_batch_size, amp)
        rows.append((config, gpu, layout, amp, prediction, speed, memory))
    return rows


def print_published(as_json):
    """README's table: predicted samples/s and peak memory against the published runs. The published memory is the
    line " Memory usage after forward pass", NVML's used memory at the second step: by then the allocator's cache
    holds the first step's peak, so it is read against the predicted peak (plus the runtime overhead)."""
    print("| run (published in the original tutorial's README; cp=4: its 2025 edition) | GPUs | "
          "samples/s predicted / published | "
          "memory, GB: predicted peak / published |")
    print("|---|---|---|---|")
    found = []
    for config, gpu, layout, amp, row, speed, memory in against_published():
        ratio = row["samples_per_sec"] / speed
        memory_cell = "not published" if memory is None else \
            f"{row['peak_memory_gb']:.1f} / {memory} ({row['peak_memory_gb'] / memory:.2f}x)"
        cp = f" cp={layout.cp}" if layout.cp > 1 else ""
        print(f"| `{config}` tp={layout.tp}{cp} dp={layout.dp}, {amp} | {layout.world_size} x {gpu} | "
              f"{row['samples_per_sec']:.1f} / {speed} ({ratio:.2f}x) | {memory_cell} |")
        found.append({**row, "config": config, "published_samples_per_sec": speed,
                      "published_memory_gb": memory})
    if as_json:
        print(json.dumps({"published": found}))
    return found


def against_profiles(path=PROFILES, yaml_config="./config/ViT.yaml"):
    """{"machine", "system", "rows": [{part, label, model_ms, measured_ms: {eager, compiled}}], totals} of the
    committed step profiles (PROFILED) against the model's prediction of the same step on that GPU."""
    try:
        with open(path) as f:
            found = json.load(f)
        profiles = {label: (found["profiles"][name], config, amp) for name, label, config, amp in PROFILED}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"step profiles '{path}' cannot be read ({err!r}); give the JSON that python -m "
                        "benchmarks.step_profile --committed writes") from None
    devices = {profile["device"] for profile, _, _ in profiles.values()}
    systems = {gpu_system(device) for device in devices}
    if len(systems) != 1 or None in systems:
        raise UserError(f"step profiles '{path}' come from {', '.join(sorted(devices))}: the model knows none of "
                        f"them as one system ({', '.join(sorted(SYSTEMS))})")
    system = SYSTEMS[systems.pop()]
    model = {}
    for label, (_, config, amp) in profiles.items():
        params = YParams(yaml_config, config)
        shape = dataclasses.replace(ViTShape.from_params(params), attention_input_casts=PROFILED_ATTENTION_INPUT_CASTS)
        model[label] = predict(shape, system, Layout(), params.global_batch_size, amp)
    first = model[PROFILED[0][1]]
    if any(row["parts_s"] != first["parts_s"] for row in model.values()):
        raise UserError(f"the profiles of '{path}' ran different steps; the comparison needs one config and precision")
    rows = [{"part": part, "label": label, "model_ms": 1e3 * first["parts_s"][part],
             "measured_ms": {name: sum(profile["ms_per_step"][key] for key in keys)
                             for name, (profile, _, _) in profiles.items()}}
            for part, (keys, label) in PARTS.items()]
    total = {"model_ms": 1e3 * compute_seconds(first),
             "busy_ms": {name: profile["busy_ms"] for name, (profile, _, _) in profiles.items()},
             "step_ms": {name: profile["step_ms"] for name, (profile, _, _) in profiles.items()}}
    return {"machine": found.get("machine", ""), "system": system.name, "config": PROFILED[0][2],
            "batch": first["global_batch_size"],
            "amp_mode": PROFILED[0][3], "rows": rows, "total": total}


def parts_refusals(comparison):
    """What the per-part check finds wrong (empty: the model holds): attention and GEMMs within PART_TOLERANCE of
    every profile; the memory-bound kernels between the compiled step (fused: fewer bytes moved) and the eager one
    (a roofline of the bytes the model counts can be neither)."""
    found = []
    for row in comparison["rows"]:
        measured = row["measured_ms"]
        if row["part"] in PART_TOLERANCE:
            tolerance = PART_TOLERANCE[row["part"]]
            found += [f"{row['part']}: {name} measured {value:.1f} ms, model {row['model_ms']:.1f} ms (outside "
                      f"+-{tolerance:.0%})" for name, value in measured.items()
                      if abs(value / row["model_ms"] - 1) > tolerance]
        elif not min(measured.values()) <= row["model_ms"] <= max(measured.values()):
            found.append(f"{row['part']}: model {row['model_ms']:.1f} ms outside the measured "
                         f"{min(measured.values()):.1f}-{max(measured.values()):.1f} ms")
    return found


def print_parts(path, as_json):
    """The table of docs/perf_model.md: the model's compute by part against the measured profiles."""
    comparison = against_profiles(path)
    names = list(comparison["rows"][0]["measured_ms"])
    print(f"ViT `{comparison['config']}`, {comparison['amp_mode']}, batch {comparison['batch']}, one GPU: the model "
          f"({comparison['system']}) against the step profiles ({comparison['machine']}), ms per step:")
    print(f"| part | model | {' | '.join(f'measured, {name}' for name in names)} |")
    print("|---|---|" + "---|" * len(names))
    for row in comparison["rows"]:
        cells = " | ".join(f"{row['measured_ms'][name]:.1f} ({row['measured_ms'][name] / row['model_ms']:.2f}x)"
                           for name in names)
        print(f"| {row['label']} | {row['model_ms']:.1f} | {cells} |")
    total = comparison["total"]
    cells = " | ".join(f"{total['busy_ms'][name]:.1f} busy, {total['step_ms'][name]:.1f} a step" for name in names)
    print(f"| the step (the model: compute only) | {total['model_ms']:.1f} | {cells} |")
    problems = parts_refusals(comparison)
    print("The model holds part by part." if not problems else "Outside the model's tolerance: " + "; ".join(problems))
    if as_json:
        print(json.dumps(comparison))
    return comparison


def summary(row, system):
    """Two lines of --plan: the layout and its prediction, then the sbatch line."""
    flags = " ".join(_flags(row))
    exposed_ms = 1e3 * row["time_breakdown_s"]["exposed_communication"]
    pipe = row.get("pipeline")
    stage = f"stage {pipe['heaviest_stage']}'s " if pipe else ""
    bubble = f", bubble {1e3 * row['time_breakdown_s']['bubble']:.0f}" if pipe else ""
    return (f"tp={row['tp']} {cp_name(row)} dp={row['dp']}{pp_name(row)}{' ' + flags if flags else ''}: "
            f"{speed(row['samples_per_sec'])} samples/s, MFU {100 * row['mfu']:.1f}%, "
            f"{row['memory_after_forward_gb']:.1f} GB after the forward (peak {stage}{row['peak_memory_gb']:.1f} of "
            f"{system.memory_gib:g}), exposed communication {exposed_ms:.0f}{bubble} of "
            f"{1e3 * row['step_time_s']:.0f} ms a step\n      {row['sbatch']}")


def fastest_of_each_pipeline(rows, top, system, tried=(1,)):
    """Where a plan tried several pp sizes: for each not among the first `top`, its fastest layout in one line, or
    that none fits."""
    shown = {row.get("pp", 1) for row in rows[:top]}
    lines = [f"    pp={pp}: no layout fits" for pp in tried if len(tried) > 1 and
             not any(row.get("pp", 1) == pp for row in rows)]
    for rank, row in enumerate(rows, start=1):
        pp = row.get("pp", 1)
        if pp in shown:
            continue
        shown.add(pp)
        stage = f"stage {row['pipeline']['heaviest_stage']}'s " if pp > 1 else ""
        flags = " ".join(_flags(row))
        lines.append(f"    fastest at pp={pp}: #{rank}, tp={row['tp']} {cp_name(row)} dp={row['dp']}{pp_name(row)}"
                     f"{' ' + flags if flags else ''}: {speed(row['samples_per_sec'])} samples/s, peak {stage}"
                     f"{row['peak_memory_gb']:.1f} of {system.memory_gib:g} GB")
    return lines


def check_numbers(args):
    """Sizes and numbers that cannot be right, one line each."""
    for flag, value in (("--tensor_parallel", args.tensor_parallel), ("--context_parallel", args.context_parallel),
                        ("--pipeline_parallel", args.pipeline_parallel), ("--num_microbatches", args.num_microbatches),
                        ("--gpus", args.gpus), ("--top", args.top)):
        if value is not None and value < 1:
            raise UserError(f"{flag} is {value}; it must be at least 1")
    if args.measure < 0:
        raise UserError(f"--measure is {args.measure}; give how many layouts to run (at least 1)")
    if not math.isfinite(args.overhead_gb) or args.overhead_gb < 0:
        raise UserError(f"--overhead_gb is {args.overhead_gb}; give the GB outside the tensors, a number >= 0")


@exit_on_user_error
def main(argv=None):
    args = parser().parse_args(argv)
    if args.published:
        return print_published(args.json)
    if args.parts:
        return print_parts(args.parts, args.json)
    check_numbers(args)
    shape, global_batch, amp_mode = read_config(args)
    tp, cp, pp = args.tensor_parallel or 1, args.context_parallel or 1, args.pipeline_parallel or 1
    gpus = args.gpus if args.gpus is not None else tp * cp * pp
    if args.methods:
        for name in [args.gpu] if args.gpu else METHOD_SYSTEMS:
            check_gpus(gpus, SYSTEMS[name])
        return methods_report(shape, global_batch, amp_mode, gpus, args)
    system = SYSTEMS[args.gpu or DEFAULT_GPU]
    check_gpus(gpus, system)
    header = (f"ViT config {args.config}: embed {shape.embed_dim}, depth {shape.depth}, {shape.num_heads} heads, "
              f"{shape.tokens} tokens, {parameters_per_rank(shape) / 1e6:.1f} M parameters, "
              f"{flops_per_sample(shape) / 1e12:.2f} TFLOP per sample (forward + backward); global batch "
              f"{global_batch}, amp {amp_mode}, {gpus} x {system.name}")
    if args.plan:
        rows = plan(shape, system, gpus, global_batch, amp_mode, args)
        print(header)
        if not rows:
            print(f"no layout of {gpus} GPUs fits in {system.memory_gib:g} GB (try more GPUs, or a larger GPU)")
        for rank, row in enumerate(rows[:args.top], start=1):
            print(f"{rank:2d}. " + summary(row, system))
        if len(rows) > args.top:
            print(f"... and {len(rows) - args.top} slower layouts that fit (--top N, or --json for all)")
        for line in fastest_of_each_pipeline(rows, args.top, system, pipeline_sizes(gpus, shape, system, args)):
            print(line)
        result = {"gpus": gpus, "system": system.name, "config": args.config, "layouts": rows}
        if args.measure:
            result["measured"] = measure(rows[:args.measure], gpus, args)
    else:
        layout = Layout.for_world(gpus, tp, cp, order=args.parallel_order, sequence_parallel=args.sequence_parallel,
                                  checkpointing=args.activation_checkpointing, fsdp=args.fsdp,
                                  cp_method=args.cp_method or DEFAULT_CP_METHOD,
                                  **(pipeline_switches(gpus, tp, cp, pp, global_batch, args) or
                                     {"pp": pp, "microbatches": args.num_microbatches or pp}))
        problem = refusal(shape, layout, global_batch)
        if problem:
            raise UserError(f"{problem}; choose another layout (or --plan to list those that work)")
        result = predict(shape, system, layout, global_batch, amp_mode, args.overhead_gb)
        result["sbatch"] = sbatch_line(args.config, layout, args.amp_mode, system.gpus_per_node)
        print(header)
        print(describe(result, system))
        if args.measure:
            result["measured"] = measure([result], gpus, args)
    if args.json:
        print(json.dumps(result))
    return result


def check_gpus(gpus, system):
    """A job of `gpus` GPUs on `system`'s nodes: 1 up to a node, or whole nodes."""
    per_node = system.gpus_per_node
    if gpus < 1 or (gpus > per_node and gpus % per_node):
        script = " (submit_pm_mp.sh runs 4 ranks a node)" if per_node == 4 else ""
        raise UserError(f"--gpus {gpus}: give 1 to {per_node} GPUs or whole nodes of {per_node} on {system.name}"
                        f"{script}")


def _short(row):
    """A layout in a table cell: 'tp1 cp4 dp4 ac fsdp'."""
    flags = {"--sequence_parallel": "sp", "--activation_checkpointing": "ac", "--fsdp": "fsdp"}
    return " ".join([f"tp{row['tp']} cp{row['cp']} dp{row['dp']}"] + [flags[flag] for flag in row["flags"]
                                                                       if flag in flags])


def method_sweep(shape, image, global_batch, amp_mode, gpus, system, args):
    """Over the patch sizes of SWEEP_PATCHES that divide `image` (height, width): the fastest layout that fits
    without cp and with each cp method (None: none fits), and where each method starts to pay: the shortest length
    from which, at every length where it fits, its fastest layout is faster than the fastest without cp (or fits
    where none without cp does)."""
    rows = []
    height, width = image
    for patch in SWEEP_PATCHES:
        if height % patch or width % patch:
            continue
        at = dataclasses.replace(shape, patch_size=patch, tokens=(height // patch) * (width // patch))
        try:
            found = plan(at, system, gpus, global_batch, amp_mode, args)
        except UserError:
            continue  # no layout of these sizes divides this sequence
        best = {"none": next((row for row in found if row["cp"] == 1), None)}
        pays = {}
        for method in CP_METHODS:
            best[method] = next((row for row in found if row["cp"] > 1 and row["cp_method"] == method), None)
            if best[method] is not None:  # where it fits: faster than without cp, or nothing without cp fits
                pays[method] = best["none"] is None or \
                    best[method]["samples_per_sec"] > best["none"]["samples_per_sec"]
        rows.append({"patch": patch, "tokens": at.tokens, "attention_over_dense": attention_over_dense(at),
                     "best": best, "pays": pays})
    starts = {}
    for method in CP_METHODS:
        starts[method] = None
        for row in reversed(rows):  # from the longest: back while it pays where it fits
            if row["pays"].get(method) is False:
                break
            if row["pays"].get(method):
                starts[method] = row["tokens"]
    return {"rows": rows, "starts_to_pay": starts}


def _cell(row):
    return "nothing fits" if row is None else f"{speed(row['samples_per_sec'])} ({_short(row)})"


def methods_report(shape, global_batch, amp_mode, gpus, args):
    """`--methods`: for each system, the fastest layouts at the config's own length with their cp method, the ring's
    overlap condition on its links, and the sweep over sequence lengths (method_sweep) with where each method starts
    to pay. Predictions."""
    params = YParams(args.yaml_config, args.config)
    image = tuple(params.img_size)
    names = [args.gpu] if args.gpu else list(METHOD_SYSTEMS)
    print(f"ViT config {args.config}: embed {shape.embed_dim}, depth {shape.depth}, {shape.num_heads} heads, "
          f"{shape.tokens:,} tokens, {parameters_per_rank(shape) / 1e6:,.0f} M parameters; global batch "
          f"{global_batch}, amp {amp_mode}, {gpus} GPUs. The three cp methods, predicted (planning/perf_model.py):")
    found = {}
    for name in names:
        system = SYSTEMS[name]
        rows = plan(shape, system, gpus, global_batch, amp_mode, args)
        print(f"\n{gpus} x {name} ({system.gpus_per_node} a node: NVLink {system.nvlink_pair / 1e9:g} GB/s a GPU "
              f"pair, network {system.nic_bytes_per_s / 1e9:g} GB/s a GPU), the fastest layouts at "
              f"{shape.tokens:,} tokens:")
        for rank, row in enumerate(rows[:args.top], start=1):
            print(f"{rank:2d}. " + summary(row, system))
        inside = ring_steps(shape, system, Layout(cp=2), 1, amp_mode)
        across = ring_steps(shape, system, Layout(cp=2 * system.gpus_per_node), 1, amp_mode)
        print(f"ring: a block hides its K/V transfer from {inside['min_block_tokens']['forward']:,.0f} tokens inside "
              f"a node (NVLink) and from {across['min_block_tokens']['forward']:,.0f} across nodes (the network); "
              f"Liu et al.'s F/B on these links: {inside['min_block_tokens']['liu']:,.0f} and "
              f"{across['min_block_tokens']['liu']:,.0f}")
        sweep = method_sweep(shape, image, global_batch, amp_mode, gpus, system, args)
        print("| tokens (patch) | attention / dense | no cp | " + " | ".join(METHOD_NAMES[m] for m in CP_METHODS)
              + " |")
        print("|---|---|---|" + "---|" * len(CP_METHODS))
        for row in sweep["rows"]:
            cells = " | ".join(_cell(row["best"][key]) for key in ("none", *CP_METHODS))
            print(f"| {row['tokens']:,} ({row['patch']}) | {row['attention_over_dense']:.2f} | {cells} |")
        starts = [f"{METHOD_NAMES[m]} at {sweep['starts_to_pay'][m]:,} tokens" if sweep["starts_to_pay"][m] else
                  f"{METHOD_NAMES[m]} not up to {sweep['rows'][-1]['tokens']:,}" for m in CP_METHODS]
        print(f"samples/s of the fastest layout that fits; cp starts to pay (its fastest layout beats the fastest "
              f"without cp, or fits where none does): {', '.join(starts)}.")
        found[name] = {"layouts": rows, "ring": {"inside_node": inside, "across_nodes": across}, **sweep}
    result = {"gpus": gpus, "config": args.config, "systems": found}
    if args.json:
        print(json.dumps(result))
    return result


def dry_run(row, gpus, args):
    """Rank 0 of the layout `row` on this machine: train_mp.py --dry_run in its own process (a process group is one
    per process), on synthetic batches of the config's shape; its JSON, or the one line it failed with."""
    flags = ["--yaml_config", args.yaml_config, "--config", args.config, "--dry_run", str(gpus), *row["flags"]]
    if not torch.cuda.is_available():  # a CPU: the smallest step (bytes per sample scale with the batch), in fp32
        flags += CPU_DRY_RUN_FLAGS
    elif args.amp_mode:
        flags += ["--amp_mode", args.amp_mode]
    result, error = dry_run_in_own_process(flags, timeout=MEASURE_TIMEOUT_S)
    return {"flags": row["flags"], "error": error} if error else result


def measure(rows, gpus, args):
    """Dry runs of `rows` (their rank 0), printed beside the model: this rank's state (parameters, gradients, Adam),
    its saved activations, the peak and the compute time of one step (measured on this machine's device; the
    prediction is for --gpu)."""
    where = "this GPU, the config's batch" if torch.cuda.is_available() else "this CPU, local batch 1 in fp32"
    print(f"Measured by dry runs (rank 0 of {gpus}, train_mp.py --dry_run, synthetic data) on {where}; each beside "
          "its own prediction (the model at the run's batch; compute time for --gpu):")
    print("| layout | state, MB: model / measured | saved activations, MB | peak, GB | step compute, ms |")
    print("|---|---|---|---|---|")
    found = []
    for row in rows:
        result = dry_run(row, gpus, args)
        found.append(result)
        name = " ".join(row["flags"])
        if "error" in result:
            print(f"| {name} | the dry run failed: {result['error']} | | | |")
            continue
        model = result["predicted"]
        state = model["parameters"] + model["gradients"] + model["optimizer_state"]
        measured_state = result["parameters"] + result["gradients"] + result["optimizer_state"]
        compute = compute_seconds(row)
        print(f"| {name} | {state / 1e6:.1f} / {measured_state / 1e6:.1f} | "
              f"{model['saved_activations'] / 1e6:.1f} / {result['saved_activations'] / 1e6:.1f} | "
              f"{model['peak_memory_gb']:.2f} / {result['peak_memory_gb']:.2f} | "
              f"{compute * 1e3:.1f} on {args.gpu} / {result['step_time_s'] * 1e3:.1f} on {result['device']} |")
    return found


if __name__ == "__main__":
    main()
