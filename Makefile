# Two commands on a fresh clone: `make demo` (train the ViT on generated sample data), `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DATA_DIR ?= data/era5
COSMO_DIR ?= data/cosmo
CIFAR_DIR ?= data/cifar100
RUN_NUM ?= 00

.PHONY: install install-compat demo demo-unet demo-resnet test test-long test-all test-fast test-compat test-compat-long lint gpu-check gpu-table bench bench-step bench-train bench-unet bench-resnet bench-mp bench-mp-shape bench-loader bench-loader-cosmo bench-band-read bench-pipeline bench-wfm-pipeline bench-wfm-methods bench-cp-memory bench-graph bench-dry-run bench-agreement bench-checkpoint stress-exit plan example-logs example-logs-multi figures profile-figures gpu-lessons clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-cache-dir -r requirements.txt
	touch $@

$(DATA_DIR)/stats/global_stds.npy: | $(VENV)/.installed
	$(PY) -m sample_data era5 --out $(DATA_DIR)

$(COSMO_DIR)/downsamp_1024crop_valid.h5: | $(VENV)/.installed
	$(PY) -m sample_data cosmo --out $(COSMO_DIR)

$(CIFAR_DIR)/cifar-100-python/meta: | $(VENV)/.installed
	$(PY) -m sample_data cifar100 --out $(CIFAR_DIR)

demo: install $(DATA_DIR)/stats/global_stds.npy
	$(PY) train.py --yaml_config config/ViT.yaml --config demo --data_dir $(DATA_DIR) --expdir logs --run_num $(RUN_NUM)

# the other stages on their sample data: 3D UNet (cosmology boxes), ResNet (CIFAR-100)
demo-unet: install $(COSMO_DIR)/downsamp_1024crop_valid.h5
	$(PY) train.py --yaml_config config/UNet.yaml --config demo --data_dir $(COSMO_DIR) --expdir logs/unet --run_num $(RUN_NUM)

demo-resnet: install $(CIFAR_DIR)/cifar-100-python/meta
	$(PY) train.py --yaml_config config/ResNet50.yaml --config demo --data_dir $(CIFAR_DIR) --expdir logs/resnet --run_num $(RUN_NUM)

lint: install
	$(PY) -m ruff check .

# two pytest processes (pytest-xdist); `loadgroup`: the tests sharing a module's reference run or spawned ranks run
# in one of them, which computes it once (tests/conftest.py groups them); the long end-to-end runs (marked `long`)
# are `make test-long`'s
test: lint
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not long" --durations=15 tests

# the long end-to-end runs: every signal, restart, timeout and 4-rank path (18.1 minutes on 2 cores, 2026-11-29), in
# one pytest process: with two (-n 2) they took longer, each run using both cores; CI runs them after `make test`
test-long: lint
	$(PY) -m pytest -q -m long --durations=15 tests

test-all: test test-long

# every test that runs in this one process (no training ranks, commands or loader workers): 2.5 minutes on 2 cores
test-fast: lint
	$(PY) -m pytest -q -m "not multiprocess" tests

# the tutorial container's PyTorch (nersc/pytorch:24.08.01: torch 2.5, Python 3.10) in a second venv, and the
# compatibility subset of the tests on it (tests marked `compat`; see docs/testing.md), in two pytest processes
COMPAT_VENV := .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_TORCH := torch==2.5.1 torchvision==0.20.1

install-compat: $(COMPAT_VENV)/.installed

$(COMPAT_VENV)/.installed: requirements.txt
	bash .ci/compat_venv.sh $(COMPAT_VENV) "$(COMPAT_TORCH)"
	touch $@

test-compat: install-compat
	$(COMPAT_PY) -m pytest -q -n 2 --dist loadgroup -m "compat and not long" tests

# the long runs of that subset on torch 2.5 (3.7 minutes on 2 cores, 2026-11-29); CI runs them last
test-compat-long: install-compat
	$(COMPAT_PY) -m pytest -q -m "compat and long" tests

# on a GPU node: every CUDA-only test and a short benchmark of each stage, one JSON (fails loudly on any error)
gpu-check: install
	$(PY) -m benchmarks.gpu_check --out bench_results/gpu/gpu_check.json

# on a GPU node: the tutorial's single-GPU table (ViT short step by step, UNet, ResNet) with its targets, one JSON
gpu-table: install
	$(PY) -m benchmarks.gpu_table --out bench_results/gpu/single_gpu_table.json

# benchmarks write JSON under bench_results/ (numbers quoted in README and docs/)
bench: bench-step bench-train bench-unet bench-resnet bench-mp

bench-step: install
	$(PY) -m benchmarks.bench_step --out bench_results/vit_step_cpu.json

bench-train: install $(DATA_DIR)/stats/global_stds.npy
	$(PY) -m benchmarks.bench_train --suite vit --data_dir $(DATA_DIR) --out bench_results/train_demo.json

bench-unet: install $(COSMO_DIR)/downsamp_1024crop_valid.h5
	$(PY) -m benchmarks.bench_train --suite unet --data_dir $(COSMO_DIR) --out bench_results/unet_demo.json

bench-mp: install $(DATA_DIR)/stats/global_stds.npy
	$(PY) -m benchmarks.bench_mp --data_dir $(DATA_DIR) --out bench_results/mp_demo.json

# the tutorial's mp ViT (158 M parameters, 4,050 tokens) at a local batch of 1 on 360 x 720 sample data (2.9 GB,
# generated if missing): memory per rank per layout and flag (about 10 minutes on 2 cores)
bench-mp-shape: install
	$(PY) -m benchmarks.bench_mp --shape mp --data_dir data/era5_360x720 --out bench_results/mp_shape.json

# rank 0 of the mp config's layouts measured alone by dry runs (train_mp.py --dry_run): the published layouts on a
# GPU; on a CPU the tensor-parallel ones at local batch 1 (docs/perf_model.md)
bench-dry-run: install
	$(PY) -m benchmarks.bench_dry_run

# the performance model: memory, communication and speed of a layout, or every layout of N GPUs (docs/perf_model.md)
#   make plan ARGS="--config mp --gpus 16 --plan"      make plan ARGS=--published
plan: install
	$(PY) -m planning.plan $(ARGS)

bench-loader: install
	$(PY) -m benchmarks.bench_loader --data_dir data/era5_360x720 --repeats 5 --out bench_results/loader_era5.json

# what the checkpoint digest costs on the save and load of the mp config's checkpoint (1.9 GB; about a minute)
bench-checkpoint: install
	$(PY) -m benchmarks.bench_checkpoint --config mp --out bench_results/checkpoint_digest.json

# the cosmology crops (64^3 of a generated 128^3 box): PyTorch lowmem and DALI dali-lowmem vs raw reads
# the ranks' agreement on a stop signal, per step, blocking against in-loop, on 2, 8 and 16 CPU ranks (gloo)
bench-agreement: install
	$(PY) -m benchmarks.bench_agreement --ranks 2 8 16 --out bench_results/stop_agreement.json

# not in `make test` (about 15 minutes a torch): the 4-rank start-to-exit cycle of train_mp.py looped 30 times and the
# process group's teardown 300 times, on the container's torch 2.5 and on .venv's; fails if any rank hung (#40 item 10)
stress-exit: install install-compat
	$(COMPAT_PY) -m benchmarks.stress_exit --cycles 30 --teardowns 300 --out bench_results/stress_exit_torch2.5.json
	$(PY) -m benchmarks.stress_exit --cycles 30 --teardowns 300 --out bench_results/stress_exit.json

# what a context-parallel rank reads at 0.25 degrees (distributed/bands.py): bytes and GB/s at cp = 1, 2, 4 (writes
# 1 GB of 721 x 1440 sample data first if data/era5_721x1440 has none; about a minute)
bench-band-read: install
	$(PY) -m benchmarks.bench_band_read --data_dir data/era5_721x1440 --repeats 9 --out bench_results/band_read.json

# the pipeline schedules' idle share and held activations on P = 2 and 4 gloo ranks whose stages sleep for their
# work, against (P - 1) / (M + P - 1) (about a minute)
bench-pipeline: install
	$(PY) -m benchmarks.bench_pipeline --stages 2,4 --forward_ms 25 --out bench_results/pipeline_bubble.json

# wfm_tiny one epoch serially and through pipeline stages on CPU ranks (pp=2 GPipe, pp=4 1F1B, pp=2 x cp=2 ring):
# validation loss, weights against serial (about 5 minutes)
bench-wfm-pipeline: install
	$(PY) -m benchmarks.bench_wfm_pipeline --data_dir data/era5_wfm_tiny --out bench_results/wfm_pipeline.json

# wfm_tiny one epoch serially and with each --cp_method at cp=4 on CPU ranks: validation loss, weights against serial
bench-wfm-methods: install
	$(PY) -m benchmarks.bench_wfm_methods --data_dir data/era5_wfm_tiny --out bench_results/wfm_methods.json

# a rank of wfm_1b_p4 under each --cp_method, cp 4-16, tp 1-4: the planner's memory, and dry runs of some layouts at
# depth 1 and 2 (extrapolated to 18; about 30 minutes on 2 cores)
bench-cp-memory: install
	$(PY) -m benchmarks.bench_cp_memory --measure --out bench_results/cp_memory.json

bench-loader-cosmo: install
	$(PY) -m benchmarks.bench_loader --dataset cosmo --data_dir data/cosmo_128 --repeats 5 --out bench_results/loader_cosmo.json

bench-resnet: install $(CIFAR_DIR)/cifar-100-python/meta
	$(PY) -m benchmarks.bench_train --suite resnet --data_dir $(CIFAR_DIR) --out bench_results/resnet_demo.json

# GPU only: ms/step eager vs CUDA graph (also step 4 of gpu-check)
bench-graph: install
	$(PY) -m benchmarks.bench_graph --out bench_results/gpu/bench_graph.json

# real runs of each stage's demo config and the ViT data-parallel sweep (1, 2, 4 CPU ranks) into example_logs/:
# out.log and TensorBoard events, no checkpoints (several minutes on 2 cores)
example-logs: install $(DATA_DIR)/stats/global_stds.npy $(COSMO_DIR)/downsamp_1024crop_valid.h5 $(CIFAR_DIR)/cifar-100-python/meta
	$(PY) -m benchmarks.example_logs --out example_logs --era5_dir $(DATA_DIR) --cosmo_dir $(COSMO_DIR) --cifar_dir $(CIFAR_DIR)

# the multi-GPU day's session (benchmarks/gpu_multi.py) on 4 CPU ranks over gloo, for README's multi-GPU steps until
# GPUs have run it: example_logs/multi_gpu_cpu/ (multi_gpu.json, the logs, rank 0's DDP traces) and the DDP profiles'
# figures in tutorial_images/ (about 10 minutes on 2 cores; data and run directories in data/multi_work)
example-logs-multi: install
	CUDA_VISIBLE_DEVICES= MULTI_WORK=data/multi_work PYTHON=$(PY) bash benchmarks/gpu_session.sh \
		example_logs/multi_gpu_cpu --multi --allow-cpu --figures tutorial_images

# tutorial_images/*.png from example_logs/ and bench_results/ (no new measurements)
figures: install
	$(PY) -m benchmarks.figures --logs example_logs --bench bench_results --out tutorial_images

# the committed step profiles (example_logs/profiles/, one H100) reduced into bench_results/gpu/step_profiles.json and
# drawn into tutorial_images/profile_*.png (no new measurements)
profile-figures: install
	$(PY) -m benchmarks.step_profile --committed --out bench_results/gpu/step_profiles.json --figure tutorial_images

# on a GPU node: the lessons' example runs and step profiles (about 8 minutes), packed into bench_results/gpu/lessons/
gpu-lessons: install
	bash benchmarks/gpu_session.sh bench_results/gpu/lessons --lessons

clean:
	rm -rf logs __pycache__ */__pycache__ .pytest_cache
