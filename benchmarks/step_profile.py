"""Where a training step's time goes: a profile reduced to a table of milliseconds per step, and drawn as a timeline.

    python -m benchmarks.step_profile TRACE [--out table.json] [--figure timeline.png] [--title "..."] [--skip N]
    python -m benchmarks.step_profile --committed     # make profile-figures: example_logs/profiles -> JSON, figures

TRACE is a torch.profiler Chrome trace (`train.py ... --torch_profile run.json.gz`, .json or .json.gz) or an Nsight
Systems report exported to SQLite (`nsys export --type sqlite run.nsys-rep`, where nsys exists). The steps are the
loop's ranges named `step N` (or torch.profiler's `ProfilerStep#N`); the window runs from the first step's start to
the end of what was recorded after the last (the next batch's fetch, and the profiler's final synchronisation). On
a GPU, which runs behind the host, the steps' work is the kernels and copies they launched, and the window opens
when the GPU could start it (the work launched before them done).

What is counted as busy depends on where the step ran:
- on a GPU, the device's kernels and copies (every stream): a kernel is put in a part by its name and by the
  ranges and operators that were open on the CPU thread that launched it;
- on a CPU, the operators' own time (an operator's time less that of the operators it called).
The parts, in the order they are tried: `optimizer` (launched inside torch's Optimizer.step or the loop's
`optimizer` range), `copies` (memcpy and memset on a GPU; on a CPU the operators inside `data copy in`),
`data_loading` (CPU only: the loader's own work in the training process), `attention` (scaled_dot_product_attention
and its kernels: cuDNN, flash, memory-efficient), `gemm` (matrix multiplies and convolutions), and
`norm_elementwise` (everything else: normalisation, activations, residual adds, casts, reductions, the loss).
`idle` is the window less the union of busy time. Parts that ran at the same time (a copy stream beside the compute
stream) are each counted, so the parts add up to the step plus `overlap`.
"""
import bisect
import gzip
import json
import os
import re
import sqlite3
import sys
from dataclasses import dataclass, field

from resilience.exits import exit_on_user_error
from utils.atomic import write_json
from utils.errors import ArgumentParser, UserError

PARTS = ("attention", "gemm", "norm_elementwise", "optimizer", "copies", "data_loading", "communication")
STEP = re.compile(r"^(?:step (\d+)|ProfilerStep#(\d+))$")
ATTENTION = re.compile(r"attention|sdpa|fmha|flash_|flash::|_attn", re.I)
GEMM = re.compile(r"gemm|matmul|aten::mm\b|aten::addmm|aten::bmm|aten::baddbmm|aten::linear|conv|cutlass|xmma|nvjet"
                  r"|wgmma|cublas|sm\d\d_|MmBackward|AddmmBackward|BmmBackward", re.I)
OPTIMIZER = re.compile(r"^Optimizer\.|^optimizer$|Adam|SGD|_fused_adam|multi_tensor_apply", re.I)
LOADER = re.compile(r"DataLoader|data loader", re.I)
COPY_RANGE = re.compile(r"^data copy in")
# the collectives between ranks: NCCL's kernels on a GPU, the c10d operators that hand work to NCCL or gloo
COMMUNICATION = re.compile(r"nccl|gloo|^c10d::|^record_param_comms$|allreduce|all_reduce|allgather|all_gather"
                           r"|reduce_scatter|reducescatter", re.I)


@dataclass
class Span:
    """One recorded interval, in microseconds: a host range or operator (track: the thread), or a device kernel or
    copy (track: the stream)."""
    name: str
    start: float
    end: float
    track: str
    kind: str  # range | op | kernel | memcpy | memset | runtime
    correlation: int | None = None
    children: list = field(default_factory=list, repr=False)


@dataclass
class Trace:
    spans: list
    device: str
    source: str

    def host(self):
        return [s for s in self.spans if s.kind in ("range", "op", "runtime")]

    def device_spans(self):
        return [s for s in self.spans if s.kind in ("kernel", "memcpy", "memset")]


# ---- reading ---------------------------------------------------------------------------------------------------


def read_trace(path):
    """A Trace from a Chrome trace (.json, .json.gz) or an Nsight SQLite export (.sqlite)."""
    if not os.path.exists(path):
        raise UserError(f"no profile at {path}; record one with train.py ... --torch_profile {path}")
    if path.endswith((".sqlite", ".db")):
        return read_nsys_sqlite(path)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, ValueError, EOFError) as err:  # EOFError: a gzip file cut short
        raise UserError(f"{path} is not a readable Chrome trace ({err}); give the file --torch_profile wrote") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise UserError(f"{path} is JSON but not a Chrome trace (no list of traceEvents); give the file "
                        "--torch_profile wrote")
    spans = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat", "")
        kind = {"user_annotation": "range", "gpu_user_annotation": None, "cpu_op": "op", "kernel": "kernel",
                "gpu_memcpy": "memcpy", "gpu_memset": "memset", "cuda_runtime": "runtime",
                "cuda_driver": "runtime"}.get(cat)
        if kind is None:
            continue
        track = f"stream {e['args'].get('stream', e.get('tid'))}" if kind in ("kernel", "memcpy", "memset") \
            else f"thread {e.get('tid')}"
        corr = (e.get("args") or {}).get("correlation")
        spans.append(Span(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]), track, kind, corr))
    props = data.get("deviceProperties") if isinstance(data, dict) else None
    device = props[0].get("name", "GPU") if props else "CPU"
    if not any(s.kind in ("kernel", "memcpy", "memset") for s in spans):
        device = "CPU"
    return Trace(spans, device, path)


def read_nsys_sqlite(path):
    """A Trace from `nsys export --type sqlite`: CUPTI kernels, copies and runtime calls, NVTX ranges (ns -> us)."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as err:
        con.close()
        raise UserError(f"{path} is not an SQLite database ({err}); give the file `nsys export --type sqlite` "
                        "wrote") from None
    strings = dict(con.execute("SELECT id, value FROM StringIds")) if "StringIds" in tables else {}
    spans = []

    def rows(table, query):
        return con.execute(query) if table in tables else []

    for start, end, stream, corr, name in rows("CUPTI_ACTIVITY_KIND_KERNEL", "SELECT start, end, streamId, "
                                                "correlationId, shortName FROM CUPTI_ACTIVITY_KIND_KERNEL"):
        spans.append(Span(strings.get(name, str(name)), start / 1e3, end / 1e3, f"stream {stream}", "kernel", corr))
    for table, kind in (("CUPTI_ACTIVITY_KIND_MEMCPY", "memcpy"), ("CUPTI_ACTIVITY_KIND_MEMSET", "memset")):
        for start, end, stream, corr in rows(table, f"SELECT start, end, streamId, correlationId FROM {table}"):
            spans.append(Span(kind, start / 1e3, end / 1e3, f"stream {stream}", kind, corr))
    for start, end, tid, corr, name in rows("CUPTI_ACTIVITY_KIND_RUNTIME", "SELECT start, end, globalTid, "
                                            "correlationId, nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
        spans.append(Span(strings.get(name, str(name)), start / 1e3, end / 1e3, f"thread {tid}", "runtime", corr))
    for start, end, tid, text, text_id in rows("NVTX_EVENTS", "SELECT start, end, globalTid, text, textId "
                                               "FROM NVTX_EVENTS WHERE end IS NOT NULL"):
        name = text if text is not None else strings.get(text_id, "")
        spans.append(Span(name, start / 1e3, end / 1e3, f"thread {tid}", "range"))
    con.close()
    device = "GPU" if any(s.kind == "kernel" for s in spans) else "CPU"
    return Trace(spans, device, path)


# ---- reducing --------------------------------------------------------------------------------------------------


def steps_of(trace, skip=0):
    """The step ranges, in time order (the loop's `step N`, else torch.profiler's ProfilerStep#N), less the first
    `skip` (warm-up steps recorded with the rest)."""
    ranges = [s for s in trace.host() if s.kind == "range" and STEP.match(s.name)]
    loop_steps = [s for s in ranges if s.name.startswith("step ")]
    steps = loop_steps or ranges  # ProfilerStep#N only where the loop's ranges are missing
    if not steps:
        raise UserError(f"{trace.source} has no step ranges (`step N` or ProfilerStep#N); record it with "
                        "--torch_profile (or under nsys with the loop's NVTX ranges)")
    steps = sorted(steps, key=lambda s: s.start)
    if skip >= len(steps):
        raise UserError(f"{trace.source} holds {len(steps)} steps; --skip {skip} leaves none")
    return steps[skip:]


def nest(host_spans):
    """Per thread, the ranges and operators as a forest (each span's children); returns {thread: roots}."""
    forest = {}
    for track in {s.track for s in host_spans}:
        spans = sorted((s for s in host_spans if s.track == track and s.kind != "runtime"),
                       key=lambda s: (s.start, -s.end))
        roots, stack = [], []
        for s in spans:
            s.children = []
            while stack and stack[-1].end <= s.start:
                stack.pop()
            (stack[-1].children if stack else roots).append(s)
            stack.append(s)
        forest[track] = roots
    return forest


def open_at(roots, t):
    """The names of the spans open at time t, outermost first (a walk down the forest)."""
    names, level = [], roots
    while level:
        i = bisect.bisect_right([s.start for s in level], t) - 1
        if i < 0 or level[i].end < t:
            break
        names.append(level[i].name)
        level = level[i].children
    return names


def classify(name, context, kind):
    """The part of the step a span belongs to (see the module's docstring), from its own name and the names of the
    host ranges and operators around it (outermost first)."""
    if COMMUNICATION.search(name):
        return "communication"
    if any(OPTIMIZER.search(n) for n in context if n.startswith("Optimizer.") or n == "optimizer"):
        return "optimizer"
    if kind in ("memcpy", "memset"):
        return "copies"
    if any(COPY_RANGE.match(n) for n in context):
        return "copies"
    if kind == "op" and any(LOADER.search(n) for n in context):
        return "data_loading"
    names = [name, *reversed(context)]
    if any(ATTENTION.search(n) for n in names):
        return "attention"
    if GEMM.search(name) or (kind == "kernel" and not name.startswith("triton_")
                             and any(GEMM.search(n) for n in reversed(context) if n.startswith("aten::"))):
        return "gemm"
    if kind == "op" and any(GEMM.search(n) for n in context if n.startswith("aten::")):
        return "gemm"
    return "norm_elementwise"


def launched(trace, host, forest):
    """Each device span with its launch call (None where none is recorded) and its part of the step."""
    launches = {s.correlation: s for s in host if s.kind == "runtime" and s.correlation is not None}
    for s in trace.device_spans():
        launch = launches.get(s.correlation)
        context = open_at(forest.get(launch.track, []), launch.start) if launch else []
        yield s, launch, classify(s.name, context, s.kind)


def union_length(intervals, lo, hi):
    """Total length of the union of (start, end) intervals clipped to [lo, hi]."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _operator_time(level, context, lo, hi, parts, busy):
    """On a CPU: each operator's own time inside [lo, hi] (less its child operators') into its part, the operators'
    intervals into `busy`; the loader's ranges count as work (its Python runs on the training thread)."""
    def works(s):
        return s.kind == "op" or bool(LOADER.search(s.name))

    for s in level:
        inner = context + [s.name]
        if works(s) and s.end > lo and s.start < hi:
            own = (min(s.end, hi) - max(s.start, lo)) - sum(
                min(c.end, hi) - max(c.start, lo) for c in s.children if works(c) and c.end > lo and c.start < hi)
            parts[classify(s.name, inner, "op")] += max(own, 0.0)
            busy.append((s.start, s.end))
        _operator_time(s.children, inner, lo, hi, parts, busy)


def reduce_trace(trace, skip=0):
    """The table: milliseconds per step in each part, idle, overlap, and what the window was."""
    steps = steps_of(trace, skip)
    host = trace.host()
    forest = nest(host)
    on_gpu = trace.device != "CPU"
    lo = steps[0].start
    hi = max(s.end for s in trace.spans if s.start >= lo or s.end > lo)  # the end of the recording
    parts = dict.fromkeys(PARTS, 0.0)
    busy = []
    if on_gpu:
        # the GPU runs behind the host: the kept steps' work is what they launched, and the window opens when the
        # GPU could start it (the work launched before them done, and the first kept step begun on the host)
        kept, first_step = [], lo
        for s, launch, part in launched(trace, host, forest):
            if (launch.start if launch else s.start) >= first_step:
                kept.append((s, part))
            else:
                lo = max(lo, s.end)
        for s, part in kept:
            parts[part] += min(s.end, hi) - max(s.start, lo)
            busy.append((s.start, s.end))
    else:
        for roots in forest.values():
            _operator_time(roots, [], lo, hi, parts, busy)
    window = hi - lo
    busy_union = union_length(busy, lo, hi)
    n = len(steps)
    per_step = {k: round(v / n / 1e3, 3) for k, v in parts.items()}
    per_step["idle"] = round((window - busy_union) / n / 1e3, 3)
    per_step["overlap"] = round((sum(parts.values()) - busy_union) / n / 1e3, 3)
    hidden = None
    if on_gpu:  # the collectives' kernel time during which other kernels ran
        talking = [(s.start, s.end) for s, part in kept if part == "communication"]
        working = [(s.start, s.end) for s, part in kept if part != "communication"]
        hidden = round((union_length(talking, lo, hi) + union_length(working, lo, hi) - busy_union) / n / 1e3, 3)
    loader_wait = sum(s.end - s.start for s in host if s.kind == "range" and LOADER.search(s.name)
                      and s.start >= lo and s.end <= hi)
    return {"trace": os.path.basename(trace.source), "device": trace.device, "steps": n,
            "step_ms": round(window / n / 1e3, 3), "busy_ms": round(busy_union / n / 1e3, 3),
            "skipped_steps": skip, "ms_per_step": per_step, "host_loader_ms_per_step": round(loader_wait / n / 1e3, 3),
            "communication_hidden_ms": hidden}


# ---- drawing ---------------------------------------------------------------------------------------------------

COLORS = {"attention": "#d62728", "gemm": "#1f77b4", "norm_elementwise": "#2ca02c", "optimizer": "#9467bd",
          "copies": "#bcbd22", "data_loading": "#8c564b", "communication": "#17becf"}
RANGES = (  # the loop's ranges drawn: (test of the name, label, colour, row: 0 the step, 1 its parts)
    (lambda n: bool(STEP.match(n)), None, "#d9d9d9", 0),
    (lambda n: bool(LOADER.search(n)), "next batch", "#c49c94", 0),
    (lambda n: n == "forward", "forward", "#aec7e8", 1),
    (lambda n: n == "backward", "backward", "#ffbb78", 1),
    (lambda n: n == "optimizer", "optimizer", "#c5b0d5", 1),
    (lambda n: bool(COPY_RANGE.match(n)), "copy in", "#dbdb8d", 1),
)


def draw(trace, out, title, max_steps=3):
    """A timeline of the last `max_steps` steps: the loop's ranges on the training thread, then each GPU stream's
    kernels and copies (or, on a CPU, the training thread's operators) coloured by part; white is idle."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    steps = steps_of(trace)[-max_steps:]
    lo = steps[0].start
    hi = max(s.end for s in trace.spans if s.start >= lo and s.start <= steps[-1].end + 1)
    host = trace.host()
    forest = nest(host)
    main = steps[0].track
    rows = []  # (label, [(start, end, color)])
    range_rows = {}
    for s in host:
        if s.kind == "range" and s.track == main and s.end > lo and s.start < hi:
            for test, label, color, depth in RANGES:
                if test(s.name):
                    range_rows.setdefault(depth, []).append((s.start, s.end, color, label or s.name))
                    break
    for depth in sorted(range_rows):
        rows.append(("loop ranges" if depth == 0 else "step parts", range_rows[depth]))
    if trace.device != "CPU":
        streams = {}
        for s, _, part in launched(trace, host, forest):
            if s.end > lo and s.start < hi:
                streams.setdefault(s.track, []).append((s.start, s.end, COLORS[part], None))
        for track in sorted(streams, key=lambda t: -len(streams[t])):
            rows.append((f"GPU {track}", streams[track]))
    else:
        ops = []
        for root in forest.get(main, []):
            def leaves(s, context):
                if s.kind == "op" and not any(c.kind == "op" for c in s.children):
                    if s.end > lo and s.start < hi:
                        ops.append((s.start, s.end, COLORS[classify(s.name, context, "op")], None))
                for c in s.children:
                    leaves(c, context + [s.name])
            leaves(root, [])
        rows.append(("CPU operators", ops))
    rows = [(label, [(max(a, lo), min(b, hi), c, name) for a, b, c, name in bars if b > lo and a < hi])
            for label, bars in rows]  # clipped to the window drawn
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * len(rows)), dpi=100)
    for y, (_, bars) in enumerate(reversed(rows)):
        ax.broken_barh([((a - lo) / 1e3, max((b - a) / 1e3, 1e-3)) for a, b, _, _ in bars], (y - 0.4, 0.8),
                       facecolors=[c for _, _, c, _ in bars], linewidth=0)
        for a, b, _, name in bars:
            if name and (b - a) / (hi - lo) > 0.06:
                ax.text((a + b) / 2 / 1e3 - lo / 1e3, y, name, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _ in reversed(rows)], fontsize=8)
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel("milliseconds")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], fontsize=7, ncol=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 4 else -0.2), frameon=False)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


# the profiles committed under example_logs/profiles (benchmarks/gpu_lessons.py on one H100, 2026-11-27):
# name -> (what was run, warm-up steps left out of the table)
COMMITTED = {
    "vit_baseline": ("ViT short: baseline (fp32, 0 loader workers)", 3),
    "vit_nw8": ("ViT short: 8 loader workers (fp32)", 3),
    "vit_nw8_bf16": ("ViT short: bf16, 8 workers", 0),
    "vit_nw8_bf16_fused_jit": ("ViT short: bf16 + fused Adam + torch.compile, 8 workers", 0),
    "unet_baseline": ("UNet short: baseline (fp32, 2 loader workers), the loader before its rewrite", 0),
}
PROFILES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "example_logs", "profiles")
MACHINE = "H100 80GB HBM3, torch 2.11.0+cu130, 2026-11-27"


def committed(out, figures):
    """The committed profiles reduced into one JSON and drawn into `figures` (profile_<name>.png)."""
    tables = {}
    for name, (what, skip) in COMMITTED.items():
        path = os.path.join(PROFILES_DIR, f"{name}.json.gz")
        trace = read_trace(path)
        tables[name] = {"what": what, **reduce_trace(trace, skip)}
        if figures:
            draw(trace, os.path.join(figures, f"profile_{name}.png"), f"{what}: {MACHINE}")
        print(f"{name}: {tables[name]['step_ms']} ms a step, {tables[name]['ms_per_step']}")
    write_json(out, {"machine": MACHINE, "made_by": "benchmarks/gpu_lessons.py (the runs' commands are in "
                     "bench_results/gpu/lessons/), reduced by python -m benchmarks.step_profile --committed",
                     "profiles": tables})
    return tables


@exit_on_user_error
def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", help="torch.profiler Chrome trace (.json, .json.gz) or nsys SQLite export")
    parser.add_argument("--committed", action="store_true",
                        help="reduce and draw the profiles in example_logs/profiles (default --out "
                             "bench_results/gpu/step_profiles.json, figures in tutorial_images/)")
    parser.add_argument("--out", help="the table as JSON here (default: printed only)")
    parser.add_argument("--figure", help="the timeline of the last steps as a PNG here")
    parser.add_argument("--title", default=None, help="the figure's title (default: the trace's name and device)")
    parser.add_argument("--figure_steps", type=int, default=3, help="steps drawn (default 3)")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first N steps (warm-up) of the table")
    args = parser.parse_args(argv)
    if args.skip < 0 or args.figure_steps < 1:
        parser.error(f"--skip must be >= 0 and --figure_steps >= 1 (got {args.skip} and {args.figure_steps})")
    if args.committed:
        return committed(args.out or "bench_results/gpu/step_profiles.json", args.figure or "tutorial_images")
    if not args.trace:
        parser.error("give a trace, or --committed")
    trace = read_trace(args.trace)
    table = reduce_trace(trace, args.skip)
    print(f"{table['trace']} ({table['device']}): {table['steps']} steps, {table['step_ms']} ms a step")
    for part, ms in table["ms_per_step"].items():
        print(f"  {part:<17}{ms:10.3f} ms")
    if args.out:
        write_json(args.out, table)
    if args.figure:
        draw(trace, args.figure, args.title or f"{table['trace']} on {table['device']}", args.figure_steps)
    return table


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
