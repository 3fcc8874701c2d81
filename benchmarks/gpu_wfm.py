"""One GPU, many ranks: the 0.25-degree configs (`wfm_*`), context parallelism's three methods and pipeline stages on
the one GPU of a node, into one JSON (issue #59 item 7, issue #60 items 5 and 7).

    bash benchmarks/gpu_session.sh DIR --wfm                        # one GPU: about 3 minutes, 9 at most
    bash benchmarks/gpu_session.sh DIR --wfm --tiny --allow-cpu     # the rehearsal: CPU processes over gloo
    python -m benchmarks.gpu_wfm --out DIR [--work W] [--tiny] [--allow-cpu] [--budget S] [--parts a,b]

Four parts, each with a deadline (a fraction of --budget, 540 s), DIR/wfm_one_gpu.json written after each, so a
part cut short keeps what it measured:
  kernels  one GPU's training step of the family, each a dry run on synthetic batches (planning/dry_run.py: a
           warm-up step, then the median of 3, and the rank's memory beside the performance model's): `wfm_tiny` and
           `wfm_p8` at batch 1, both at cp=1, where the three --cp_method are one (plain attention over the whole
           sequence); then rank 0 of `wfm_p8` at cp=2 with each method, where they differ: the step's kernels as that
           method runs them on the rank's half of the tokens (ring's blocks in plain math, all-to-all's whole sequence
           for half the heads, all-gather's queries over every key), the collectives moving nothing
  patch4   rank 0 of the patch-4 layout `wfm_1b_p4` at tp=4 x cp=4 (dry run, batch 1): its memory and step time
  stages   rank 0 of each pipeline stage of `wfm_10b_p2` at the planner's layout for 256 A100s (tp=8 x cp=8 ring x
           dp=2 x pp=2, sequence parallelism, checkpointing, FSDP; 2 microbatches of 1): each stage's memory beside
           the performance model's, the heaviest stage named by both (dry runs, memory only)
  ranks    2 ranks on the one GPU (every rank on cuda:0). NCCL 2.30 or newer (torch.cuda.nccl.version()) takes them
           with NCCL_MULTI_RANK_GPU_ENABLE=1 (and CUDA MPS, started for the part, where nvidia-cuda-mps-control is
           on PATH); an older NCCL refuses two ranks on one GPU, so gloo takes them with CUDA tensors, which it
           moves for all-reduce, broadcast, all-gather and all_to_all_single but not for send/recv: the ring
           (batch_isend_irecv) cannot run there. First a probe of each collective on the ranks' tensors, then
           `wfm_tiny` for 10 steps with TF32 off: DDP (train.py), tp=2, cp=2 with allgather, ring and alltoall, and
           pp=2 (train_mp.py), each against the serial train.py run (the largest weight and TensorBoard point
           differences, over the CPU tests' tolerance |a - b| <= 1e-5 + 1e-4 |b|), and a twin, cp=2 without its
           gradient sums (--noddp), which must miss. The JSON says which backend ran and, for each check that did
           not run, why.
"At cp=1, each method" in the issue is read as above: at cp=1 the methods are the same code, so the single-GPU part
times the step once per config, and the methods run where they differ (cp=2: rank 0's kernels alone, and on two
ranks against the serial run).
On CPUs (--allow-cpu; and --tiny on a GPU) every part runs at the rehearsal's sizes: `wfm_tiny` stands in for wfm_p8
(batch 1), for wfm_1b_p4 (at tp=2 x cp=4) and for wfm_10b_p2's stages (at tp=2 x cp=2 x pp=2), and the ranks are
CPU processes over gloo, which also runs the ring.
The parts' runs go through few processes, each running its runs in turn in-process (python -m benchmarks.gpu_wfm
--runner PLAN): one for the single-GPU parts, one per rank for `ranks` (which makes a process group for each run,
the ranks on one device, before train.py or train_mp.py starts: their own rendezvous refuses two ranks on a GPU);
a process that dies is started again for the runs it had not reached. Logs land in DIR/logs, data and run
directories in --work (default DIR/work).
"""
import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

from benchmarks.common import REPO_ROOT, free_port, machine
from benchmarks.gpu_multi import ATOL, RTOL, Interrupted, difference, interrupt_on_signals, run_results, stop_group
from utils.atomic import write_json
from utils.errors import ArgumentParser, error_line

PARTS = ("kernels", "patch4", "stages", "ranks")
ENDS = {"kernels": 0.30, "patch4": 0.40, "stages": 0.75, "ranks": 1.0}  # each part's deadline, a fraction of the budget
BUDGET_S = 540
RANKS = 2
MAX_ATTEMPTS = 3  # processes started for one plan: again after one dies, for the items it had not reached
PEER_GRACE_S = 20  # once a rank's process ended in failure, the others' time to end before they are stopped
ITERS = "10"
NCCL_MULTI_RANK = (2, 30)  # the first NCCL that takes several ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1)
WFM_TINY_DATA = {"height": 25, "width": 48, "steps_per_year": 16, "train_years": 1, "valid_years": 1,
                 "test_years": 1}  # read as 24 x 48, as 721 x 1440 is read as 720 x 1440
VIT = ["--yaml_config", "config/ViT.yaml"]
METHODS = ("allgather", "ring", "alltoall")
# by sizes ("gpu", "tiny": the rehearsal's, where wfm_tiny stands in): the kernels part's small 0.25-degree config
# (config, flags) and the patch-4 layout (config, tp, cp, flags)
SMALL = {"gpu": ("wfm_p8", ["--local_batch_size", "1"]),
         "tiny": ("wfm_tiny", ["--local_batch_size", "1"])}
PATCH4 = {"gpu": ("wfm_1b_p4", 4, 4, ["--local_batch_size", "1"]),
          "tiny": ("wfm_tiny", 2, 4, ["--local_batch_size", "1"])}
# the stages part (issue #60 item 5): rank 0 of each pipeline stage of the 10B model at the planner's layout for 256
# A100s (tp=8 x cp=8 ring x dp=2 x pp=2, sequence parallelism, checkpointing, FSDP: docs/perf_model.md), with 2
# microbatches of 1 (1F1B holds P - s of them whatever M is; the planner's M = 8 would make the warm-up step 4 times
# longer); the rehearsal's stand-in: wfm_tiny at tp=2 x cp=2 x pp=2. (config, tp, cp, dp, pp, flags)
STAGES = {"gpu": ("wfm_10b_p2", 8, 8, 2, 2, ["--cp_method", "ring", "--sequence_parallel",
                                             "--activation_checkpointing", "--fsdp", "--local_batch_size", "2"]),
          "tiny": ("wfm_tiny", 2, 2, 1, 2, ["--cp_method", "ring", "--local_batch_size", "2"])}
# the collectives each check's run calls (the probe's names): a check whose collective did not run is not started
NEEDS = {"ddp": ["broadcast", "all_reduce"], "tp2": ["broadcast", "all_reduce", "all_gather"],
         "cp2_allgather": ["all_reduce", "all_gather"], "cp2_ring": ["all_reduce", "all_gather", "send_recv"],
         "cp2_alltoall": ["all_reduce", "all_gather", "all_to_all_single"],
         "cp2_twin_noddp": ["all_reduce", "all_gather"],
         "pp2": ["broadcast", "all_reduce", "all_gather", "send_recv"]}  # issue #60 item 7: two stages, one GPU
GLOO_CUDA_SEND_RECV = ("not tried: gloo takes no CUDA tensors for send/recv (FACTS I5), which the ring's and the "
                       "pipeline's batch_isend_irecv needs")
DRY_FIELDS = ("pipeline_stage", "microbatches_in_flight", "checkpoint_save", "step_time_s", "peak_memory_gb",
              "peak_memory_is", "parameters", "gradients", "optimizer_state", "saved_activations", "local_batch_size",
              "amp_mode", "device", "predicted")


def log(message):
    print(f"[wfm {time.strftime('%H:%M:%S')}] {message}", flush=True)


def said(err):
    """An exception in one line: its type and its message's first line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


# ---- the plan: what each process runs ----------------------------------------------------------------------------

def kernel_runs(mode):
    """(name, config, tp, cp, flags) of the kernels part's dry runs."""
    small, small_flags = SMALL[mode]
    return [("wfm_tiny cp=1", "wfm_tiny", 1, 1, []), (f"{small} batch 1 cp=1", small, 1, 1, small_flags)] + [
        (f"{small} batch 1 cp=2 {method}", small, 1, 2, [*small_flags, "--cp_method", method]) for method in METHODS]


def dry_item(name, part, config, tp, cp, flags):
    argv = [*VIT, "--config", config, "--tensor_parallel", str(tp), "--context_parallel", str(cp), *flags,
            "--dry_run", str(tp * cp), "--data_loader_config", "synthetic"]
    return {"name": name, "part": part, "kind": "dry_run", "argv": argv,
            "layout": {"config": config, "tp": tp, "cp": cp, "flags": " ".join(flags)}}


def stage_items(mode):
    """Dry runs of rank 0 of each pipeline stage of STAGES[mode] (pp is the slowest dimension: stage s starts at rank
    s x world / pp), memory only (no timed steps)."""
    config, tp, cp, dp, pp, flags = STAGES[mode]
    world = tp * cp * dp * pp
    return [{"name": f"{config} stage {stage}", "part": "stages", "kind": "dry_run",
             "argv": [*VIT, "--config", config, "--tensor_parallel", str(tp), "--context_parallel", str(cp),
                      "--pipeline_parallel", str(pp), *flags, "--dry_run", str(world), "--dry_run_rank",
                      str(stage * world // pp), "--dry_run_steps", "0", "--data_loader_config", "synthetic"],
             "layout": {"config": config, "tp": tp, "cp": cp, "dp": dp, "pp": pp, "stage": stage,
                        "flags": " ".join(flags)}} for stage in range(pp)]


def heaviest_stage(rows):
    """The stage with the largest peak, measured and predicted (None where a run did not finish)."""
    if not rows or not all(r.get("ok") for r in rows):
        return None
    measured = max(rows, key=lambda r: r["peak_memory_gb"])
    predicted = max(rows, key=lambda r: r["predicted"]["peak_memory_gb"])
    return {"measured": measured["stage"], "predicted": predicted["stage"],
            "peak_memory_gb": measured["peak_memory_gb"],
            "predicted_peak_memory_gb": measured["predicted"]["peak_memory_gb"]}


def one_gpu_items(mode, parts):
    items = []
    if "kernels" in parts:
        items += [dry_item(name, "kernels", *run) for name, *run in kernel_runs(mode)]
    if "patch4" in parts:
        config, tp, cp, flags = PATCH4[mode]
        items.append(dry_item(f"{config} tp={tp} x cp={cp} rank 0", "patch4", config, tp, cp, flags))
    if "stages" in parts:
        items += stage_items(mode)
    return items


def rank_items(data, expdir):
    """The serial reference (rank 0 alone), the probe, then each check: train.py or train_mp.py on every rank."""
    base = [*VIT, "--config", "wfm_tiny", "--data_dir", data, "--num_iters", ITERS, "--checkpoint_interval", "0",
            "--num_data_workers", "0", "--collective_timeout", "60"]

    def train(name, script, flags, folder):
        return {"name": name, "part": "ranks", "kind": "train", "script": script, "needs": NEEDS.get(name, []),
                "argv": [*base, "--expdir", os.path.join(expdir, name), *flags],
                "run_dir": os.path.join(expdir, name, "wfm_tiny", folder, "00")}

    items = [{**train("serial", "train", ["--local_batch_size", "4"], "1GPU"), "kind": "serial"},
             {"name": "probe", "part": "ranks", "kind": "probe"},
             train("ddp", "train", ["--local_batch_size", "2"], f"{RANKS}GPU"),
             train("tp2", "train_mp", ["--tensor_parallel", "2", "--local_batch_size", "4"], "2MP")]
    items += [train(f"cp2_{method}", "train_mp", ["--context_parallel", "2", "--cp_method", method,
                                                  "--local_batch_size", "4"], "2MP") for method in METHODS]
    items.append(train("cp2_twin_noddp", "train_mp", ["--context_parallel", "2", "--noddp", "--local_batch_size",
                                                      "4"], "2MP"))
    items.append(train("pp2", "train_mp", ["--pipeline_parallel", "2", "--local_batch_size", "4"], "1MP2PP"))
    return items


def choose_backend(gpus, nccl):
    """(the backends to try in turn, why): NCCL first where it takes several ranks on one GPU, else gloo."""
    if not gpus:
        return ["gloo"], "no GPU: CPU processes over gloo (the rehearsal)"
    if nccl is None:
        return ["gloo"], "this torch has no NCCL: gloo with CUDA tensors"
    shown = ".".join(map(str, nccl))
    if tuple(nccl[:2]) >= NCCL_MULTI_RANK:
        return ["nccl", "gloo"], (f"NCCL {shown} takes several ranks on one GPU with NCCL_MULTI_RANK_GPU_ENABLE=1 "
                                  "(gloo with CUDA tensors if it fails)")
    return ["gloo"], (f"NCCL {shown} is older than 2.30, which refuses two ranks on one GPU (\"Duplicate GPU "
                      "detected\"): gloo with CUDA tensors")


# ---- the runner: one process running its plan's items in turn ----------------------------------------------------

class Runner:
    """What a process of the plan knows: its rank, the world, the device, the store its ranks share."""

    def __init__(self, plan):
        import torch
        self.plan = plan
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.device = torch.device("cuda", 0) if plan["cuda"] else torch.device("cpu")
        self.progress = open(plan["progress"].format(rank=self.rank), "a", buffering=1)
        self.store = None
        if self.world > 1:
            import torch.distributed as dist
            self.store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), self.world, self.rank == 0,
                                       timeout=datetime.timedelta(seconds=plan["store_timeout_s"]))
        self.backend, self.collectives, self.runs = None, {}, 0

    def note(self, **entry):
        self.progress.write(json.dumps(entry) + "\n")

    def agreed(self, key, value):
        """Rank 0's `value` on every rank (each rank deciding alone could split the ranks: one waiting forever)."""
        if self.store is None:
            return value
        if self.rank == 0:
            self.store.set(key, json.dumps(value))
        return json.loads(self.store.get(key))

    def everyones(self, key, value):
        """[each rank's `value`] (through the store)."""
        if self.store is None:
            return [value]
        self.store.set(f"{key}/{self.rank}", json.dumps(value))
        return [json.loads(self.store.get(f"{key}/{rank}")) for rank in range(self.world)]

    def join(self, backend, name):
        """A process group of every rank for one run, on the ranks' store (a prefix of its own)."""
        import torch.distributed as dist
        self.runs += 1
        extra = {"device_id": self.device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=dist.PrefixStore(f"{name}/{self.runs}", self.store), rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=60), **extra)

    def run(self):
        for item in self.plan["items"]:
            name = item["name"]
            late = time.time() > item["deadline"] - 5
            if self.agreed(f"go/{name}", not late) is False:
                self.note(item=name, skipped="the part's deadline came first")
                continue
            why_not = self.cannot_run(item)
            if why_not:
                self.note(item=name, not_run=why_not)
                continue
            print(f"==== {name}", file=sys.stderr, flush=True)
            self.note(item=name, started=time.time())
            began = time.monotonic()
            result, error = {}, None
            try:
                result = getattr(self, item["kind"])(item) or {}
            except SystemExit as stop:  # the scripts' one-line errors (exit code 2)
                if stop.code not in (0, None):
                    error = f"exit code {stop.code}"
            except Exception as err:
                traceback.print_exc()
                error = said(err)
            finally:
                self.leave()
            self.note(item=name, ok=error is None, seconds=round(time.monotonic() - began, 2),
                      **({"error": error} if error else {}), **result)
        if self.store is not None:  # rank 0 holds the store: it leaves once every rank is done reading it
            self.store.add("finished", 1)
            deadline = time.monotonic() + 60
            while self.rank == 0 and self.store.add("finished", 0) < self.world and time.monotonic() < deadline:
                time.sleep(0.05)

    def cannot_run(self, item):
        missing = [op for op in item.get("needs", []) if not self.collectives.get(op, {}).get("ok")]
        if not missing:
            return None
        if self.backend is None:
            return "no backend passed the probe"
        whys = [f"{op}: {self.collectives.get(op, {}).get('why') or self.collectives.get(op, {}).get('error')}"
                for op in missing]
        return f"needs {', '.join(missing)}, which {self.backend} did not run here ({'; '.join(whys)})"

    def leave(self):
        import torch
        import torch.distributed as dist

        from utils import comm
        if dist.is_initialized():
            comm.destroy()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def no_tf32(self):
        import torch
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

    # the kinds of item

    def dry_run(self, item):
        import torch

        import train_mp
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # each run's own peak, not the process's
        found = train_mp.main(item["argv"])
        return {key: found[key] for key in DRY_FIELDS if key in found}

    def serial(self, item):
        """The reference: rank 0 alone, a world of one (the others wait for it)."""
        key = "serial_done"
        if self.rank != 0:
            self.store.wait([key])
            return {"ran_on": "rank 0"}
        saved = os.environ.get("WORLD_SIZE")
        os.environ["WORLD_SIZE"] = "1"
        try:
            self.train(item)
        finally:
            os.environ.pop("WORLD_SIZE")
            if saved is not None:
                os.environ["WORLD_SIZE"] = saved
            if self.store is not None:
                self.store.set(key, "1")

    def train(self, item):
        import train
        import train_mp
        if item["kind"] == "train":
            self.join(self.backend, item["name"])
        with self.no_tf32():
            (train if item["script"] == "train" else train_mp).main(item["argv"])

    def probe(self, item):
        """Each collective on this device's tensors over the first backend that joins; every rank's outcome
        agreed (an operation runs where it ran on every rank)."""
        tried = {}
        for backend in self.plan["backends"]:
            self.note(item=item["name"], trying=backend)  # a backend that ends the process: the next one, anew
            try:
                self.join(backend, f"probe_{backend}")
                ops = probe_collectives(backend, self.device, self.rank, self.world)
            except Exception as err:
                tried[backend] = said(err)
                ops = None
            finally:
                self.leave()
            everyone = self.everyones(f"probe/{backend}", ops)
            if any(found is None for found in everyone):
                tried.setdefault(backend, "another rank could not join")
                continue
            self.backend = backend
            self.collectives = {op: merge_outcomes([found[op] for found in everyone]) for op in everyone[0]}
            return {"backend": backend, "tensors_on": str(self.device), "collectives": self.collectives,
                    "backends_failed": tried}
        return {"backend": None, "backends_failed": tried}


def probe_collectives(backend, device, rank, world):
    """{name: {"ok": bool, "error"/"why"}} of each collective the checks use, on `device`'s tensors, the values
    checked."""
    import torch
    import torch.distributed as dist

    def full(value, n=4):
        return torch.full((n,), float(value), device=device)

    def all_reduce():
        x = full(rank + 1)
        dist.all_reduce(x)
        return torch.equal(x, full(world * (world + 1) / 2))

    def broadcast():
        x = full(rank + 5)
        dist.broadcast(x, src=0)
        return torch.equal(x, full(5))

    def all_gather():
        pieces = [full(-1) for _ in range(world)]
        dist.all_gather(pieces, full(rank))
        return all(torch.equal(piece, full(r)) for r, piece in enumerate(pieces))

    def all_to_all_single():  # uneven pieces, as the all-to-all method sends: r + 1 values of 10 x sender + r to r
        send = torch.cat([full(10 * rank + r, r + 1) for r in range(world)])
        received = torch.empty((rank + 1) * world, device=device)
        dist.all_to_all_single(received, send, [rank + 1] * world, [r + 1 for r in range(world)])
        return torch.equal(received, torch.cat([full(10 * sender + rank, rank + 1) for sender in range(world)]))

    def send_recv():
        received = full(-1)
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, full(rank), (rank + 1) % world),
                                           dist.P2POp(dist.irecv, received, (rank - 1) % world)])
        for request in requests:
            request.wait()
        return torch.equal(received, full((rank - 1) % world))

    found = {}
    for name, check in (("all_reduce", all_reduce), ("broadcast", broadcast), ("all_gather", all_gather),
                        ("all_to_all_single", all_to_all_single), ("send_recv", send_recv)):
        if name == "send_recv" and backend == "gloo" and device.type == "cuda":
            found[name] = {"ok": False, "why": GLOO_CUDA_SEND_RECV}
            continue
        try:
            right = check()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            found[name] = {"ok": bool(right)} if right else {"ok": False, "error": "a wrong result"}
        except Exception as err:
            found[name] = {"ok": False, "error": said(err)}
    return found


def merge_outcomes(outcomes):
    """One collective's outcome over the ranks: ok where every rank's is; else the first rank's reason."""
    failed = [o for o in outcomes if not o["ok"]]
    return failed[0] if failed else outcomes[0]


def runner_main(plan_path):
    with open(plan_path) as f:
        plan = json.load(f)
    runner = Runner(plan)
    runner.run()
    runner.progress.close()
    return 0


# ---- the session: starting the processes and reading what they did -----------------------------------------------

class Session:
    def __init__(self, out, work, budget, gpus):
        self.out, self.work, self.budget, self.gpus = out, work, budget, gpus
        self.start_wall, self.start = time.time(), time.monotonic()
        self.running, self.processes = None, []  # the processes running now (what an interruption stops), in words
        for folder in (out, work, os.path.join(out, "logs"), os.path.join(work, "progress")):
            os.makedirs(folder, exist_ok=True)
        for name in os.listdir(work):  # an earlier session's runs would resume, not train: only the data stays
            if name not in ("data", "progress"):
                path = os.path.join(work, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        for name in os.listdir(os.path.join(work, "progress")):
            os.remove(os.path.join(work, "progress", name))

    def elapsed(self):
        return time.monotonic() - self.start

    def deadline_of(self, part):
        return ENDS[part] * self.budget

    def env(self, extra=None):
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            env.pop(name, None)
        if self.gpus:  # the first GPU of the node, whatever its number: every rank on the one GPU
            env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.update(extra or {})
        return env

    def launch(self, name, items, nproc, until_s, backends=("gloo",), env=None):
        """Run `items` in processes of `nproc` ranks (one process when 1), again for the items not reached when the
        processes die, until second `until_s` of the session. Returns {item name: what the ranks recorded}."""
        results, left, attempt, backends, died_in = {}, list(items), 0, list(backends), {}
        stopped = None
        while left and until_s - self.elapsed() > 10 and attempt < MAX_ATTEMPTS:
            attempt += 1
            tag = f"{name}_{attempt}" if attempt > 1 else name
            plan = {"items": [{**item, "deadline": self.start_wall + self.deadline_of(item["part"])}
                              for item in left],
                    "cuda": bool(self.gpus), "backends": backends,
                    "progress": os.path.join(self.work, "progress", f"{tag}_rank{{rank}}.jsonl"),
                    "store_timeout_s": max(until_s - self.elapsed(), 30)}
            plan_path = os.path.join(self.work, "progress", f"{tag}.plan.json")
            write_json(plan_path, plan)
            logs = [os.path.join(self.out, "logs", f"{tag}{f'_rank{r}' if nproc > 1 else ''}.log")
                    for r in range(nproc)]
            codes, stopped = self.start_processes(tag, plan_path, nproc, logs, until_s, env)
            recorded = [read_progress(plan["progress"].format(rank=r)) for r in range(nproc)]
            texts = []
            for path in logs:
                with open(path, errors="replace") as f:
                    texts.append(f.read())
            for item in left:
                entries = [r.get(item["name"]) for r in recorded]
                if all(e is None for e in entries):
                    continue  # not reached: the next attempt's
                trying = next((e["trying"] for e in entries if e and "trying" in e and "ok" not in e), None)
                if trying:  # the probe's backend ended the processes: the next backend, in new processes
                    died_in[trying] = merge_ranks(entries, [item_log(t, item["name"]) for t in texts], codes,
                                                  stopped)["error"]
                    backends = backends[backends.index(trying) + 1:]
                    if backends:
                        continue
                results[item["name"]] = merge_ranks(entries, [item_log(text, item["name"]) for text in texts], codes,
                                                    stopped)
                if died_in and item["kind"] == "probe":
                    results[item["name"]].setdefault("backends_failed", {}).update(died_in)
            left = [item for item in left if item["name"] not in results]
            if stopped and stopped.startswith("the part's deadline"):  # what is left is not run
                break
        late = until_s - self.elapsed() <= 10 or (stopped or "").startswith("the part's deadline")
        for item in left:
            results[item["name"]] = {"ok": False, "error": "not reached: " + (
                "the part's deadline came first" if late else "the processes ended before it")}
        return results

    def start_processes(self, tag, plan_path, nproc, logs, until_s, env):
        """The plan's processes (each a session of its own, as torchrun's ranks): (their exit codes, None for those
        stopped; why they were stopped: the deadline, or another rank's process ending in failure; None)."""
        port = free_port()
        command = [sys.executable, "-m", "benchmarks.gpu_wfm", "--runner", plan_path]
        log(f"{tag}: {nproc} process{'es' if nproc > 1 else ''}: python -m benchmarks.gpu_wfm --runner {plan_path} "
            f"(deadline in {until_s - self.elapsed():.0f} s)")
        processes = []
        for rank, path in enumerate(logs):
            ranks = ({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if nproc > 1 else {})
            with open(path, "w") as console:
                processes.append(subprocess.Popen(command, cwd=REPO_ROOT, env=self.env({**(env or {}), **ranks}),
                                                  stdout=console, stderr=subprocess.STDOUT, start_new_session=True))
        self.running = f"{tag} ({nproc} process{'es' if nproc > 1 else ''} of python -m benchmarks.gpu_wfm)"
        self.processes = processes
        stopped, first_failure = None, None
        try:
            while stopped is None:
                codes = [process.poll() for process in processes]
                if None not in codes:
                    break
                failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
                if failed and first_failure is None:
                    first_failure = time.monotonic()
                if self.elapsed() >= until_s:
                    stopped = "the part's deadline stopped it"
                elif first_failure and time.monotonic() - first_failure > PEER_GRACE_S:
                    stopped = f"stopped {PEER_GRACE_S} s after rank {failed[0][0]} ended with code {failed[0][1]}"
                time.sleep(0.2)
        except Interrupted:  # Ctrl-C reaches this process alone: the others run in sessions of their own
            for process in processes:
                stop_group(process, grace_s=5)
            raise
        for process in processes:  # each process and whatever it started (all of them, once one was stopped)
            stop_group(process, grace_s=5)
        self.running = None
        codes = [process.returncode for process in processes]
        if stopped:  # those we stopped: None
            codes = [None if code is None or code < 0 else code for code in codes]
        log(f"{tag}: exit codes {codes}" + (f" ({stopped})" if stopped else ""))
        return codes, stopped


def read_progress(path):
    """{item: its last entry} of what one process recorded (an item started but not ended: {"started": ...})."""
    found = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError):
                    entry = json.loads(line)
                    found.setdefault(entry.pop("item"), {}).update(entry)
    return found


def item_log(text, name):
    """The part of a process's console that one item wrote (after its `==== name` line)."""
    marker = f"==== {name}\n"
    if marker not in text:
        return ""
    return text.split(marker, 1)[1].split("\n==== ", 1)[0]


def merge_ranks(entries, logs, codes, stopped=None):
    """One item's outcome over its ranks: ok where every rank's is; an error in the first failing rank's words."""
    entries = [e or {} for e in entries]
    first = entries[0]
    for key in ("skipped", "not_run"):
        if key in first:
            return {key: first[key]}
    merged = dict(first)
    merged.pop("started", None)
    merged.pop("trying", None)
    ended = all("ok" in e for e in entries)
    merged["ok"] = ended and all(e["ok"] for e in entries)
    if not merged["ok"]:
        rank = next((r for r, e in enumerate(entries) if not e.get("ok")), 0)
        if not ended:  # its process died or was stopped: what its console said last
            code, last = codes[rank], error_line(logs[rank], empty="")
            merged["error"] = (stopped or "stopped" if code is None else
                               f"rank {rank}'s process ended during it (exit code {code})") + (
                f": {last}" if last else "")
        else:  # the scripts' one line, else the exception the runner caught
            one_line = [line for line in logs[rank].splitlines() if line.startswith("error: ")]
            merged["error"] = one_line[-1] if one_line else entries[rank].get("error", "failed")
            merged["rank"] = rank
    return merged


# ---- the parts ------------------------------------------------------------------------------------------------

ONE_GPU = ("kernels", "patch4", "stages")  # the parts one process runs in turn


def one_gpu_parts(s, mode, parts, report, path):
    items = one_gpu_items(mode, parts)
    if not items:
        return
    for part in ONE_GPU:
        if part in parts:
            report["parts"][part] = {"status": "running"}
    write_json(path, report)
    began = time.monotonic()
    results = s.launch("one_gpu", items, 1, max(s.deadline_of(p) for p in parts if p in ONE_GPU))
    for part in ONE_GPU:
        if part not in parts:
            continue
        rows = [{"name": item["name"], **item["layout"], **results.get(item["name"], {})} for item in items
                if item["part"] == part]
        found = {"runs": rows} if part != "patch4" else {"run": rows[0]}
        if part == "stages":
            found["heaviest"] = heaviest_stage(rows)
            if mode == "tiny":
                config, tp, cp, dp, pp, _ = STAGES["gpu"]
                found["stands_for"] = f"{config} at tp={tp} x cp={cp} x dp={dp} x pp={pp} (on a GPU)"
        if part == "patch4" and mode == "tiny":
            config, tp, cp, _ = PATCH4["gpu"]
            found["stands_for"] = f"{config} at tp={tp} x cp={cp} (on a GPU)"
        found["ok"] = all(r.get("ok") for r in rows)
        found["seconds"] = round(sum(r.get("seconds", 0) for r in rows), 1)  # its runs'
        found["process_seconds"] = round(time.monotonic() - began, 1)  # the process both parts share
        report["parts"][part] = found


def ranks_part(s, data, found):
    nccl = versions()["nccl_tuple"]
    backends, why = choose_backend(s.gpus, nccl)
    found.update({"ranks": RANKS, "device": "cuda:0 (every rank)" if s.gpus else "cpu", "backends_tried": backends,
                  "backend_why": why, "iterations": int(ITERS), "tf32": "off",
                  "tolerance": f"|a - b| <= {ATOL:g} + {RTOL:g} |b|"})
    env = {"NVIDIA_TF32_OVERRIDE": "0"}
    mps, found["mps"] = None, "not started: the ranks run over gloo"
    if "nccl" in backends:
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
        mps, found["mps"] = start_mps(s.work)
        env.update(mps or {})
    expdir = os.path.join(s.work, "ranks")
    items = rank_items(data, expdir)
    try:
        results = s.launch("ranks", items, RANKS, s.deadline_of("ranks"), backends, env)
    finally:
        if mps:
            stop_mps(mps)
    probe = results.get("probe", {})
    found["backend"] = probe.get("backend")
    found["tensors_on"] = probe.get("tensors_on")
    found["collectives"] = probe.get("collectives", {})
    if probe.get("backends_failed"):
        found["backends_failed"] = probe["backends_failed"]
    serial = results.get("serial", {})
    reference = None
    if serial.get("ok"):
        try:
            reference = run_results(items[0]["run_dir"])
        except Exception as err:  # ended without its TensorBoard points or checkpoint
            serial.update(ok=False, error=said(err))
    found["serial"] = {k: serial[k] for k in ("ok", "seconds", "error") if k in serial}
    checks, could_not = {}, {}
    for item in items[2:]:
        name, got = item["name"], results.get(item["name"], {})
        if "not_run" in got:  # a collective it needs did not run on this backend
            could_not[name] = got["not_run"]
            continue
        if not got.get("ok"):
            checks[name] = {"ok": False, "error": got.get("skipped") or got.get("error", "failed")}
            continue
        if reference is None:
            checks[name] = {"ok": False, "error": f"no serial run to compare with: {serial.get('error', '')}"}
            continue
        try:
            result = difference(run_results(item["run_dir"]), reference)
        except Exception as err:  # a run that ended without its TensorBoard points or checkpoint
            checks[name] = {"ok": False, "error": said(err)}
            continue
        within = result["excess"] <= 1.0
        twin = "twin" in name
        result.update(ok=not within if twin else within, within_tolerance=within, seconds=got.get("seconds"))
        if twin:
            result["twin"] = "must miss the tolerance: without cp's gradient sums the ranks drift"
        checks[name] = result
    found["checks"] = checks
    found["ran"] = sorted(checks)
    found["could_not_run"] = could_not
    found["ok"] = (bool(checks) and all(c["ok"] for c in checks.values()) and found["backend"] is not None
                   and bool(serial.get("ok")))
    return found


def start_mps(work):
    """CUDA MPS for the ranks' part, where its control program is on PATH: (the variables that reach it, what
    happened in words)."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return None, "not started: nvidia-cuda-mps-control is not on PATH"
    folders = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(work, "mps", "pipe"),
               "CUDA_MPS_LOG_DIRECTORY": os.path.join(work, "mps", "log")}
    for folder in folders.values():
        os.makedirs(folder, exist_ok=True)
    try:
        done = subprocess.run([control, "-d"], env=dict(os.environ, **folders), capture_output=True, text=True,
                              timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"not started: {err}"
    if done.returncode:
        return None, f"not started: nvidia-cuda-mps-control -d exited with {done.returncode}"
    return folders, "started for the part (stopped after it)"


def stop_mps(folders):
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run([shutil.which("nvidia-cuda-mps-control") or "nvidia-cuda-mps-control"], input="quit\n",
                       env=dict(os.environ, **folders), capture_output=True, text=True, timeout=20)


# ---- the session ----------------------------------------------------------------------------------------------

def versions():
    import torch
    nccl = None
    if torch.cuda.is_available():
        with contextlib.suppress(AttributeError, RuntimeError):
            version = torch.cuda.nccl.version()  # (major, minor, patch); an int (NCCL_VERSION_CODE) in old torch
            nccl = tuple(version) if isinstance(version, tuple) else (version // 10000, version // 100 % 100,
                                                                       version % 100)
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if nccl else None, "nccl_tuple": nccl}


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the report's folder: wfm_one_gpu.json, logs/")
    parser.add_argument("--work", default=None, help="data and run directories (default OUT/work)")
    parser.add_argument("--budget", type=float, default=None, help=f"seconds for the parts (default {BUDGET_S})")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts (default all: {','.join(PARTS)})")
    parser.add_argument("--tiny", action="store_true", help="the rehearsal's sizes (always on CPUs)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU processes (gloo) when there is no GPU")
    parser.add_argument("--runner", default=None, help=argparse.SUPPRESS)  # a process of the session (Runner)
    args = parser.parse_args(argv)
    if args.runner:
        return runner_main(args.runner)
    if not args.out:
        parser.error("give --out DIR, the report's folder")
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and not args.allow_cpu:
        parser.error("no GPU here: this session runs on one GPU (add --allow-cpu, and --tiny, to rehearse it on the "
                     "CPU)")
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"no part {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    mode = "gpu" if gpus and not args.tiny else "tiny"
    budget = args.budget or BUDGET_S
    s = Session(args.out, args.work or os.path.join(args.out, "work"), budget, gpus)
    found_versions = versions()
    found_versions.pop("nccl_tuple")
    report = {"made_by": "bash benchmarks/gpu_session.sh DIR --wfm" + (" --tiny" if args.tiny else "") +
              ("" if gpus else " --allow-cpu") + " (benchmarks/gpu_wfm.py)", "machine": machine(), "gpus": gpus,
              **found_versions, "date": time.strftime("%Y-%m-%d"), "mode": mode, "budget_s": budget,
              "status": "running", "parts": {}}
    path = os.path.join(args.out, "wfm_one_gpu.json")
    write_json(path, report)  # at once: an earlier session's report never stands as this one's
    log(f"{report['machine']}; torch {report['torch']}, NCCL {report['nccl']}; parts: {', '.join(parts)}; budget "
        f"{budget:.0f} s; sizes: {mode}")
    interrupt_on_signals()
    try:
        return run_parts(s, mode, parts, report, path)
    except Interrupted as stop:
        what = s.running or "no process"
        report["status"] = "interrupted"
        for part in report["parts"].values():
            if "ok" not in part:
                part.update(ok=False, status="interrupted", error=f"interrupted by {stop}")
        write_json(path, report)
        print(f"error: interrupted by {stop}: stopped {what} and every process it started; {path} marks the session "
              "\"interrupted\"", file=sys.stderr, flush=True)
        return 130


def run_parts(s, mode, parts, report, path):
    from sample_data import write_era5
    data = os.path.join(s.work, "data", "era5_wfm_tiny")
    if "ranks" in parts and not os.path.isdir(data):
        write_era5(data, verbose=False, **WFM_TINY_DATA)
    one_gpu_parts(s, mode, parts, report, path)
    report["seconds"] = round(s.elapsed(), 1)
    write_json(path, report)
    if "ranks" in parts:
        began = time.monotonic()
        found = report["parts"]["ranks"] = {"status": "running"}
        write_json(path, report)
        try:
            ranks_part(s, data, found)
        except Exception as err:  # the part's own error, in one line
            traceback.print_exc()
            found.update(ok=False, error=f"{type(err).__name__}: {err}")
        found.pop("status", None)
        found["seconds"] = round(time.monotonic() - began, 1)
    for name in parts:
        done = report["parts"][name]
        log(f"{name}: {'ok' if done.get('ok') else 'NOT OK'} ({done.get('seconds')} s)")
    report["status"] = "done"
    report["seconds"] = round(s.elapsed(), 1)
    write_json(path, report)
    failed = [name for name in parts if not report["parts"][name].get("ok")]
    log(f"done in {report['seconds']} s; " + (f"not ok: {', '.join(failed)}" if failed else "every part ok") +
        f"; {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
