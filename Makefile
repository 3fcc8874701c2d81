# Two commands on a fresh clone: `make demo` (train the ViT on generated sample data), `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DATA_DIR ?= data/era5
COSMO_DIR ?= data/cosmo
CIFAR_DIR ?= data/cifar100
RUN_NUM ?= 00

.PHONY: install demo demo-unet demo-resnet test lint gpu-check bench bench-step bench-train bench-unet bench-resnet bench-mp bench-loader clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(DATA_DIR)/stats/global_stds.npy: | $(VENV)/.installed
	$(PY) -m utils.sample_data era5 --out $(DATA_DIR)

$(COSMO_DIR)/downsamp_1024crop_valid.h5: | $(VENV)/.installed
	$(PY) -m utils.sample_data cosmo --out $(COSMO_DIR)

$(CIFAR_DIR)/cifar-100-python/meta: | $(VENV)/.installed
	$(PY) -m utils.sample_data cifar100 --out $(CIFAR_DIR)

demo: install $(DATA_DIR)/stats/global_stds.npy
	$(PY) train.py --yaml_config config/ViT.yaml --config demo --data_dir $(DATA_DIR) --expdir logs --run_num $(RUN_NUM)

# the other stages on their sample data: 3D UNet (cosmology boxes), ResNet (CIFAR-100)
demo-unet: install $(COSMO_DIR)/downsamp_1024crop_valid.h5
	$(PY) train.py --yaml_config config/UNet.yaml --config demo --data_dir $(COSMO_DIR) --expdir logs/unet --run_num $(RUN_NUM)

demo-resnet: install $(CIFAR_DIR)/cifar-100-python/meta
	$(PY) train.py --yaml_config config/ResNet50.yaml --config demo --data_dir $(CIFAR_DIR) --expdir logs/resnet --run_num $(RUN_NUM)

lint: install
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -q tests

# on a GPU node: every CUDA-only test and a short benchmark of each stage, one JSON (fails loudly on any error)
gpu-check: install
	$(PY) -m benchmarks.gpu_check --out bench_results/gpu/gpu_check.json

# benchmarks write JSON under bench_results/ (numbers quoted in README)
bench: bench-step bench-train bench-unet bench-resnet bench-mp

bench-step: install
	$(PY) -m benchmarks.bench_step --out bench_results/vit_step_cpu.json

bench-train: install $(DATA_DIR)/stats/global_stds.npy
	$(PY) -m benchmarks.bench_train --suite vit --data_dir $(DATA_DIR) --out bench_results/train_demo.json

bench-unet: install $(COSMO_DIR)/downsamp_1024crop_valid.h5
	$(PY) -m benchmarks.bench_train --suite unet --data_dir $(COSMO_DIR) --out bench_results/unet_demo.json

bench-mp: install $(DATA_DIR)/stats/global_stds.npy
	$(PY) -m benchmarks.bench_mp --data_dir $(DATA_DIR) --out bench_results/mp_demo.json

bench-loader: install
	$(PY) -m benchmarks.bench_loader --data_dir data/era5_360x720 --out bench_results/loader_era5.json

bench-resnet: install $(CIFAR_DIR)/cifar-100-python/meta
	$(PY) -m benchmarks.bench_train --suite resnet --data_dir $(CIFAR_DIR) --out bench_results/resnet_demo.json

clean:
	rm -rf logs __pycache__ */__pycache__ .pytest_cache
