"""benchmarks/step_profile.py: a profile reduced to milliseconds per step by part, and drawn.

- a CPU trace recorded by `train.py --config tiny --torch_profile` (data/tiny_cpu_trace.json.gz): 3 steps, every
  part of the ViT's step present, the parts adding up to the step, the window the one read from the raw events, and
  its timeline drawn; its twin, a hand-built CPU trace on two threads: the operators' own time (an operator less
  the operators it called), and `overlap` exactly the time the two threads ran at once;
- a hand-built GPU Chrome trace (two steps, a copy stream, a gap on the device) against its table computed by hand;
  twin: without the runtime events' correlations the optimizer's kernel is no longer found inside the optimizer and
  moves, exactly, to norm_elementwise;
- the same GPU timeline as an Nsight SQLite export gives the same table; with kernels whose names say nothing, the
  documented difference (the export has NVTX ranges but no aten operators) moves exactly those kernels;
- the five committed H100 profiles reproduce bench_results/gpu/step_profiles.json exactly (pure parsing, the same
  on any CPU); twin: one kernel made longer in a copy changes its part by exactly that time;
- a user's mistakes (missing file, not a trace, no steps, --skip too large) end in one line and exit code 2.

A failure points to benchmarks/step_profile.py (reading, classifying, the window), or to a change of the committed
profiles or their table that was not made together.
"""
import gzip
import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import step_profile
from benchmarks.step_profile import draw, read_trace, reduce_trace
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.compat  # pure parsing: no torch feature involved

DATA = Path(__file__).parent / "data"
TINY_CPU_TRACE = DATA / "tiny_cpu_trace.json.gz"
ROUNDING = 0.0005  # each figure of the table is rounded to 3 decimals (microseconds)


def png_size(path):
    """The size of a PNG file, after checking it is one."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return len(data)


# ---- a CPU trace recorded by train.py ----------------------------------------------------------------------------


def test_recorded_cpu_trace_three_steps_every_part_adding_up_and_drawn(tmp_path):
    table = reduce_trace(read_trace(str(TINY_CPU_TRACE)))
    parts = table["ms_per_step"]
    assert table["device"] == "CPU" and table["steps"] == 3
    for part in ("attention", "gemm", "optimizer", "norm_elementwise", "data_loading"):
        assert parts[part] > 0, (part, parts)  # the ViT's step: SDPA, linear layers, Adam, norms; 0 loader workers
    work = sum(parts[p] for p in step_profile.PARTS)
    assert parts["overlap"] == 0  # one thread: each operator's own time, counted once
    assert work == pytest.approx(table["busy_ms"], abs=len(step_profile.PARTS) * ROUNDING)
    assert work + parts["idle"] - parts["overlap"] == pytest.approx(table["step_ms"], abs=8 * ROUNDING)
    # the window, read from the raw events: the first `step N` starts it, the last range or operator recorded (the
    # next batch's fetch) ends it, not the profiler's own span ("Trace" category) around everything
    events = [e for e in json.load(gzip.open(TINY_CPU_TRACE, "rt"))["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op")]
    start = min(e["ts"] for e in events if e["name"].startswith("step "))
    end = max(e["ts"] + e["dur"] for e in events)
    assert table["step_ms"] == pytest.approx((end - start) / 3 / 1e3, abs=ROUNDING)
    figure = tmp_path / "timeline.png"
    draw(read_trace(str(TINY_CPU_TRACE)), str(figure), "tiny on the CPU")
    assert png_size(figure) > 10_000  # bars, labels and legend, not an empty canvas


def x_event(cat, name, start, end, tid=1, pid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": float(start), "dur": float(end - start),
            "args": args}


def write_chrome(path, events, device_name=None):
    data = {"schemaVersion": 1, "traceEvents": events}
    if device_name:
        data["deviceProperties"] = [{"id": 0, "name": device_name}]
    Path(path).write_text(json.dumps(data))
    return str(path)


def test_cpu_operators_own_time_and_two_threads_overlapping(tmp_path):
    """Twin of the recorded trace's `overlap == 0`: thread 1 runs aten::linear [10, 60] calling aten::mm [20, 50]
    (gemm: 20 own + 30), a DataLoader fetch [110, 140] calling aten::stack [115, 135] (data_loading: 10 + 20) and the
    optimizer's aten::_foreach_add_ [160, 190] (30); thread 2 runs aten::add_ [30, 70] (norm_elementwise 40) while
    linear runs: 30 us counted twice. Window [0, 200], 2 steps; busy [10, 70] + [110, 140] + [160, 190] = 120 us."""
    loader = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
    events = [x_event("user_annotation", "step 0", 0, 100), x_event("cpu_op", "aten::linear", 10, 60),
              x_event("cpu_op", "aten::mm", 20, 50), x_event("cpu_op", "aten::add_", 30, 70, tid=2),
              x_event("user_annotation", "step 1", 100, 200), x_event("user_annotation", loader, 110, 140),
              x_event("cpu_op", "aten::stack", 115, 135), x_event("user_annotation", "optimizer", 150, 200),
              x_event("cpu_op", "aten::_foreach_add_", 160, 190)]
    table = reduce_trace(read_trace(write_chrome(tmp_path / "cpu.json", events)))
    assert table["ms_per_step"] == {"attention": 0.0, "gemm": 0.025, "norm_elementwise": 0.02, "optimizer": 0.015,
                                    "copies": 0.0, "data_loading": 0.015, "communication": 0.0, "idle": 0.04,
                                    "overlap": 0.015}
    assert (table["steps"], table["step_ms"], table["busy_ms"], table["host_loader_ms_per_step"]) == \
        (2, 0.1, 0.06, 0.015)


# ---- a hand-built GPU timeline: Chrome trace and Nsight SQLite export ---------------------------------------------

BASE = 4_934_935_817_000  # microseconds, the size of a real trace's timestamps (float64 keeps whole microseconds)
HOST_TID = 281_474_976_710_657  # the SQLite export's globalTid of the training thread
COMPUTE, COPY = 7, 13  # streams
GEMM_FWD, GEMM_BWD = "ampere_sgemm_64x64_nn", "ampere_sgemm_64x64_tn"
SDPA = "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0"
GELU = "void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>"
ADAM = "void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor<float, 4>>"
LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"

# step 0's host side in microseconds from BASE; step 1's is the same 500 us later
RANGES = [("step {i}", 100, 500), ("data copy in {i}", 100, 130), ("forward", 130, 300), ("backward", 300, 420),
          ("optimizer", 420, 500)]
OPS = [("aten::copy_", 105, 125), ("aten::linear", 135, 180), ("aten::mm", 140, 175),
       ("aten::_scaled_dot_product_cudnn_attention", 185, 230), ("aten::gelu", 235, 260),
       ("autograd::engine::evaluate_function: MmBackward0", 305, 345), ("MmBackward0", 307, 343),
       ("aten::mm", 310, 340), ("Optimizer.step#Adam.step", 425, 495)]
LAUNCH_AT = [110, 150, 190, 240, 315, 430]  # each launch's runtime call [t, t + 5], in the operators above
# what the launches ran: (kind, name, stream, step 0's [start, end], step 1's); the copy of step 1 overlaps its
# first kernel by 10 us, the device waits 60 us between the steps (and 20 us for the first copy)
DEVICE = [("memcpy", "Memcpy HtoD (Pinned -> Device)", COPY, (120, 160), (620, 670)),
          ("kernel", GEMM_FWD, COMPUTE, (160, 260), (660, 760)),
          ("kernel", SDPA, COMPUTE, (260, 320), (760, 820)),
          ("kernel", GELU, COMPUTE, (320, 340), (820, 840)),
          ("kernel", GEMM_BWD, COMPUTE, (340, 540), (840, 1040)),
          ("kernel", ADAM, COMPUTE, (540, 560), (1040, 1060))]
LOADER_AT = [(500, 600), (1000, 1040)]  # the next batch's fetch, after each step (host only)

# by hand: window [100, 1060] = 960 us; busy [120, 560] + [620, 1060] = 880 us, idle 20 + 60 us; gemm 2 x (100 +
# 200), attention 2 x 60, gelu and Adam 2 x 20 each, copies 40 + 50; the parts sum to 890 us: 10 us overlap
EXPECTED = {"attention": 0.06, "gemm": 0.3, "norm_elementwise": 0.02, "optimizer": 0.02, "copies": 0.045,
            "data_loading": 0.0, "communication": 0.0, "idle": 0.04, "overlap": 0.005}
EXPECTED_STEP = {"steps": 2, "step_ms": 0.48, "busy_ms": 0.44}


def gpu_chrome_events(names=None, correlations=True):
    """The timeline as torch.profiler writes it: host ranges, operators and runtime calls on thread 1, kernels and
    copies on the device's streams (`names` renames kernels; without `correlations` the runtime calls carry none)."""
    names = names or {}
    events = []
    for i, shift in ((0, 0), (1, 500)):
        for name, start, end in RANGES:
            events.append(x_event("user_annotation", name.format(i=i), BASE + start + shift, BASE + end + shift))
        for name, start, end in OPS:
            events.append(x_event("cpu_op", name, BASE + start + shift, BASE + end + shift))
        for n, (at, (kind, name, stream, *spans)) in enumerate(zip(LAUNCH_AT, DEVICE)):
            corr = 100 * (i + 1) + n
            call = "cudaMemcpyAsync" if kind == "memcpy" else "cudaLaunchKernel"
            launch = {"correlation": corr} if correlations else {}
            events.append(x_event("cuda_runtime", call, BASE + at + shift, BASE + at + shift + 5, **launch))
            start, end = spans[i]
            events.append(x_event("gpu_memcpy" if kind == "memcpy" else "kernel", names.get(name, name), BASE + start,
                                  BASE + end, tid=stream, pid=0, device=0, stream=stream, correlation=corr))
            events.append({"ph": "s", "cat": "ac2g", "id": corr, "pid": 1, "tid": 1, "ts": BASE + at + shift})
            events.append({"ph": "f", "cat": "ac2g", "id": corr, "pid": 0, "tid": stream, "ts": BASE + start,
                           "bp": "e"})
        # torch.profiler's copy of the step range on the device track: not a step of its own
        events.append(x_event("gpu_user_annotation", f"step {i}", BASE + 120 + 500 * i, BASE + 560 + 500 * i,
                              tid=COMPUTE, pid=0))
    for start, end in LOADER_AT:
        events.append(x_event("user_annotation", LOADER, BASE + start, BASE + end))
    events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python"}})
    return events


def write_gpu_sqlite(path, names=None):
    """The same timeline as `nsys export --type sqlite` writes it (ns): CUPTI kernels, copies and runtime calls,
    the loop's NVTX ranges (some by text, some by textId, one instant marker); no aten operators, no loader range."""
    names = names or {}
    con = sqlite3.connect(str(path))
    con.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, streamId INTEGER,
                                                 correlationId INTEGER, shortName INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER, end INTEGER, streamId INTEGER, correlationId INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER, end INTEGER, globalTid INTEGER,
                                                  correlationId INTEGER, nameId INTEGER);
        CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, globalTid INTEGER, text TEXT, textId INTEGER);
    """)
    strings = {}

    def string_id(value):
        if value not in strings:
            strings[value] = len(strings) + 1
            con.execute("INSERT INTO StringIds VALUES (?, ?)", (strings[value], value))
        return strings[value]

    def ns(us):
        return (BASE + us) * 1000

    for i, shift in ((0, 0), (1, 500)):
        for name, start, end in RANGES:
            name = name.format(i=i)
            text, text_id = (name, None) if name.startswith(("step", "data")) else (None, string_id(name))
            con.execute("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?, ?)",
                        (ns(start + shift), ns(end + shift), HOST_TID, text, text_id))
        for n, (at, (kind, name, stream, *spans)) in enumerate(zip(LAUNCH_AT, DEVICE)):
            corr = 100 * (i + 1) + n
            call = "cudaMemcpyAsync_v3020" if kind == "memcpy" else "cudaLaunchKernel_v7000"
            con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?, ?)",
                        (ns(at + shift), ns(at + shift + 5), HOST_TID, corr, string_id(call)))
            start, end = spans[i]
            if kind == "memcpy":
                con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?, ?, ?, ?)",
                            (ns(start), ns(end), stream, corr))
            else:
                con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, ?, ?)",
                            (ns(start), ns(end), stream, corr, string_id(names.get(name, name))))
    con.execute("INSERT INTO NVTX_EVENTS VALUES (?, NULL, ?, 'checkpoint', NULL)", (ns(700), HOST_TID))  # a marker
    con.commit()
    con.close()
    return str(path)


def test_gpu_chrome_trace_table_by_hand(tmp_path):
    trace = read_trace(write_chrome(tmp_path / "gpu.json", gpu_chrome_events(), "Fake H100"))
    table = reduce_trace(trace)
    assert table["ms_per_step"] == EXPECTED
    assert {k: table[k] for k in EXPECTED_STEP} == EXPECTED_STEP
    assert table["device"] == "Fake H100" and table["host_loader_ms_per_step"] == 0.07  # (100 + 40 us) / 2
    figure = tmp_path / "gpu.png"
    draw(trace, str(figure), "hand-built")
    assert png_size(figure) > 10_000


def test_nccl_kernels_are_communication_and_their_time_under_other_kernels_is_hidden(tmp_path):
    """A data-parallel step's all-reduce: the copy stream's transfers renamed as NCCL kernels are the
    `communication` part (their 45 us a step leave `copies`), and the 10 us of step 1's one that ran under its first
    GEMM are `communication_hidden_ms` (5 us a step); the single-GPU table has none of either."""
    nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
    names = {"Memcpy HtoD (Pinned -> Device)": nccl}
    table = reduce_trace(read_trace(write_chrome(tmp_path / "gpu.json", gpu_chrome_events(names), "Fake H100")))
    assert table["ms_per_step"] == {**EXPECTED, "copies": 0.0, "communication": EXPECTED["copies"]}
    assert table["communication_hidden_ms"] == 0.005
    plain = reduce_trace(read_trace(write_chrome(tmp_path / "plain.json", gpu_chrome_events(), "Fake H100")))
    assert plain["ms_per_step"]["communication"] == 0.0 and plain["communication_hidden_ms"] == 0.0


def test_without_runtime_correlations_the_optimizer_kernel_moves_to_norm_elementwise(tmp_path):
    """Twin: the kernels are the same but cannot be traced back to the thread that launched them, so the Adam kernel
    is no longer inside `optimizer`; the others are put in their parts by their names (copies by their kind)."""
    with_launches = reduce_trace(read_trace(write_chrome(tmp_path / "a.json", gpu_chrome_events(), "GPU")))
    without = reduce_trace(read_trace(write_chrome(tmp_path / "b.json", gpu_chrome_events(correlations=False),
                                                   "GPU")))
    moved = EXPECTED["optimizer"]  # Adam's 20 us a step
    assert with_launches["ms_per_step"]["optimizer"] == moved and without["ms_per_step"]["optimizer"] == 0.0
    assert without["ms_per_step"] == {**EXPECTED, "optimizer": 0.0,
                                      "norm_elementwise": round(EXPECTED["norm_elementwise"] + moved, 3)}


@pytest.mark.parametrize("gzipped", [False, True])
def test_gpu_trace_gzipped_or_not_reads_the_same(tmp_path, gzipped):
    data = json.dumps({"traceEvents": gpu_chrome_events(), "deviceProperties": [{"name": "GPU"}]})
    path = tmp_path / ("gpu.json.gz" if gzipped else "gpu.json")
    if gzipped:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        path.write_text(data)
    assert reduce_trace(read_trace(str(path)))["ms_per_step"] == EXPECTED


def test_nsys_sqlite_export_gives_the_same_table(tmp_path):
    """The kernels are named for what they do and the loop's NVTX ranges (optimizer, data copy in) are in the
    export: the same parts as the Chrome trace, found without aten operators. No loader range in the NVTX."""
    table = reduce_trace(read_trace(write_gpu_sqlite(tmp_path / "gpu.sqlite")))
    assert table["ms_per_step"] == EXPECTED
    assert {k: table[k] for k in EXPECTED_STEP} == EXPECTED_STEP
    assert table["device"] == "GPU" and table["host_loader_ms_per_step"] == 0.0


def test_kernels_named_for_nothing_need_the_aten_operators_the_sqlite_export_lacks(tmp_path):
    """A GEMM and an attention kernel whose names say nothing: the Chrome trace still puts them in gemm and
    attention through the aten operator that launched them (aten::mm, aten::_scaled_dot_product_cudnn_attention);
    the SQLite export has no operators, so exactly their time (0.3 + 0.06 ms a step) moves to norm_elementwise."""
    anonymous = {GEMM_FWD: "void kernel_a<128>", GEMM_BWD: "void kernel_a<64>", SDPA: "void kernel_b"}
    chrome = reduce_trace(read_trace(write_chrome(tmp_path / "gpu.json", gpu_chrome_events(anonymous), "GPU")))
    assert chrome["ms_per_step"] == EXPECTED
    nsys = reduce_trace(read_trace(write_gpu_sqlite(tmp_path / "gpu.sqlite", anonymous)))
    moved = EXPECTED["gemm"] + EXPECTED["attention"]
    assert nsys["ms_per_step"] == {**EXPECTED, "gemm": 0.0, "attention": 0.0,
                                   "norm_elementwise": round(EXPECTED["norm_elementwise"] + moved, 3)}


# ---- the committed H100 profiles ----------------------------------------------------------------------------------

COMMITTED_TABLE = Path(REPO_ROOT) / "bench_results" / "gpu" / "step_profiles.json"


@pytest.mark.long
def test_committed_profiles_reproduce_step_profiles_json(tmp_path, capsys):
    """`python -m benchmarks.step_profile --committed --out ... --figure ...` (its main, in this process): the
    same tables, number for number, and one figure per profile."""
    out, figures = tmp_path / "profiles.json", tmp_path / "figures"
    figures.mkdir()
    step_profile.main(["--committed", "--out", str(out), "--figure", str(figures)])
    made, committed = json.loads(out.read_text()), json.loads(COMMITTED_TABLE.read_text())
    assert made["machine"] == committed["machine"]
    assert list(made["profiles"]) == list(committed["profiles"]) == list(step_profile.COMMITTED)
    for name, table in committed["profiles"].items():
        assert made["profiles"][name] == table, name
    assert sorted(p.name for p in figures.iterdir()) == sorted(f"profile_{name}.png" for name in step_profile.COMMITTED)
    assert all(png_size(p) > 10_000 for p in figures.iterdir())


def test_a_committed_profile_with_one_kernel_longer_gives_another_table(tmp_path):
    """Twin: the UNet profile's longest kernel (a convolution's dgrad: gemm) 6 ms longer in a copy of the trace:
    6 ms over its 6 steps, exactly 1 ms a step more gemm; the other parts do not move."""
    source = Path(step_profile.PROFILES_DIR) / "unet_baseline.json.gz"
    data = json.load(gzip.open(source, "rt"))
    kernel = max((e for e in data["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["dur"])
    assert "conv" in kernel["name"]
    kernel["dur"] += 6000.0
    changed = tmp_path / "unet_baseline.json.gz"
    with gzip.open(changed, "wt") as f:
        json.dump(data, f)
    committed = json.loads(COMMITTED_TABLE.read_text())["profiles"]["unet_baseline"]
    committed = {k: v for k, v in committed.items() if k != "what"}
    skip = step_profile.COMMITTED["unet_baseline"][1]
    assert reduce_trace(read_trace(str(source)), skip) == committed  # the longer kernel is the only change
    table = reduce_trace(read_trace(str(changed)), skip)
    assert table != committed
    before, after = committed["ms_per_step"], table["ms_per_step"]
    assert after["gemm"] == pytest.approx(before["gemm"] + 1.0, abs=2 * ROUNDING)
    for part in ("attention", "norm_elementwise", "optimizer", "copies", "data_loading"):
        assert after[part] == before[part], part


# ---- one line for a user's mistake ------------------------------------------------------------------------------


def not_a_trace_cases(tmp):
    """{case: the command's arguments} for each mistake, its files written under `tmp`."""
    (tmp / "notes.json").write_text("these are notes\n")
    shutil.copy(COMMITTED_TABLE, tmp / "table.json")  # JSON, but the table, not a trace
    (tmp / "cut.json.gz").write_bytes(TINY_CPU_TRACE.read_bytes()[:50_000])  # a copy cut short
    (tmp / "report.sqlite").write_text("not a database\n")
    write_chrome(tmp / "nosteps.json", [x_event("cpu_op", "aten::mm", 0, 10)])
    return {
        "missing": ([str(tmp / "nowhere.json.gz")], r"no profile at .*nowhere\.json\.gz"),
        "text": ([str(tmp / "notes.json")], r"notes\.json is not a readable Chrome trace"),
        "json_not_a_trace": ([str(tmp / "table.json")], r"table\.json is JSON but not a Chrome trace"),
        "cut_short": ([str(tmp / "cut.json.gz")], r"cut\.json\.gz is not a readable Chrome trace"),
        "not_sqlite": ([str(tmp / "report.sqlite")], r"report\.sqlite is not an SQLite database"),
        "no_steps": ([str(tmp / "nosteps.json")], r"nosteps\.json has no step ranges"),
        "skip_all": ([str(TINY_CPU_TRACE), "--skip", "3"], r"holds 3 steps; --skip 3 leaves none"),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["missing", "text", "json_not_a_trace", "cut_short", "not_sqlite", "no_steps",
                                  "skip_all"])
def test_a_mistake_is_one_line_and_exit_code_2(tmp_path, case):
    args, message = not_a_trace_cases(tmp_path)[case]
    result = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", *args], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert re.search(message, lines[0]), lines[0]


@pytest.mark.multiprocess
def test_a_good_trace_from_the_command_line_exits_0(tmp_path):
    """Twin of the mistakes: the recorded trace, with --skip 2, prints its table and writes it (exit code 0)."""
    out = tmp_path / "table.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", str(TINY_CPU_TRACE), "--skip", "2",
                             "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tiny_cpu_trace.json.gz (CPU): 1 steps" in result.stdout
    table = json.loads(out.read_text())
    assert table["steps"] == 1 and table["skipped_steps"] == 2
    assert table == reduce_trace(read_trace(str(TINY_CPU_TRACE)), 2)


def lagging_gpu_trace(path):
    """Three 100 us host steps; each launches one 250 us kernel, so the GPU runs behind: step 0's kernel runs
    [10, 260], step 1's [260, 510], step 2's [510, 760]; the recording ends at 800 (the final synchronisation)."""
    events = []
    for i in range(3):
        events.append(x_event("user_annotation", f"step {i}", BASE + 100 * i, BASE + 100 * i + 100))
        events.append(x_event("cpu_op", "aten::mm", BASE + 100 * i + 5, BASE + 100 * i + 20))
        events.append(x_event("cuda_runtime", "cudaLaunchKernel", BASE + 100 * i + 10, BASE + 100 * i + 15,
                              correlation=i + 1))
        events.append(x_event("kernel", "nvjet_sm90_gemm", BASE + 10 + 250 * i, BASE + 260 + 250 * i, tid=7, pid=0,
                              correlation=i + 1, stream=7))
    events.append(x_event("cuda_runtime", "cudaDeviceSynchronize", BASE + 300, BASE + 800))
    return write_chrome(path, events, device_name="NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("skip, step_ms, gemm_ms", [(0, 0.8 / 3, 0.75 / 3), (1, 0.54 / 2, 0.5 / 2),
                                                    (2, 0.29, 0.25)])
def test_skipped_steps_work_is_theirs_although_the_gpu_runs_it_later(tmp_path, skip, step_ms, gemm_ms):
    """With --skip, the kept steps' work is the kernels they launched: the window opens when the GPU has done the
    skipped steps' work (at 260 us for skip 1), not when the host began the first kept step (at 100 us). Twin: the
    host's step start as the window's start counts the skipped step's kernel in the kept steps' time."""
    trace = step_profile.read_trace(lagging_gpu_trace(tmp_path / "lag.json"))
    table = step_profile.reduce_trace(trace, skip)
    assert table["step_ms"] == pytest.approx(step_ms, abs=ROUNDING)
    assert table["ms_per_step"]["gemm"] == pytest.approx(gemm_ms, abs=ROUNDING)
    if skip:
        host_window = (0.8 - 0.1 * skip) / (3 - skip)  # what the host's clock alone would give
        assert table["step_ms"] != pytest.approx(host_window, abs=ROUNDING)


@pytest.mark.parametrize("flags", [["--skip", "-1"], ["--figure_steps", "0"]])
def test_a_negative_skip_or_no_steps_to_draw_is_refused(tmp_path, flags, capsys):
    with pytest.raises(SystemExit) as stopped:
        step_profile.main([str(TINY_CPU_TRACE), *flags])
    assert stopped.value.code == 2 and "--skip must be >= 0" in capsys.readouterr().err
