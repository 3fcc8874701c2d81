# Two commands on a fresh clone: `make demo` (train the ViT on generated sample data), `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DATA_DIR ?= data/era5
RUN_NUM ?= 00

.PHONY: install demo test lint bench bench-step bench-train clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(DATA_DIR)/stats/global_stds.npy: | $(VENV)/.installed
	$(PY) -m utils.sample_data era5 --out $(DATA_DIR)

demo: install $(DATA_DIR)/stats/global_stds.npy
	$(PY) train.py --yaml_config config/ViT.yaml --config demo --data_dir $(DATA_DIR) --expdir logs --run_num $(RUN_NUM)

lint: install
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -q tests

# benchmarks write JSON under bench_results/ (numbers quoted in README)
bench: bench-step bench-train

bench-step: install
	$(PY) -m utils.bench_step --out bench_results/vit_step_cpu.json

bench-train: install $(DATA_DIR)/stats/global_stds.npy
	$(PY) -m utils.bench_train --data_dir $(DATA_DIR) --out bench_results/train_demo.json

clean:
	rm -rf logs __pycache__ */__pycache__ .pytest_cache
