# make train / make test set up what they need first (a virtual environment in .venv).
# Extra arguments for ddp_train.py: make train ARGS="--epochs 5 --lr 3e-3"
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=
# The training script: ddp_train.py, or your own that imports it (make train-cpu SCRIPT=examples/digits.py).
SCRIPT ?= ddp_train.py
# Each train target and script writes its own out-dir, out/TARGET/SCRIPT (out/train/ddp_train,
# out/train-cpu/digits): the same command again continues its run, and one target's checkpoint (another
# world size, another model) never stops another's. An --out-dir in ARGS comes later and wins.
out_dir = out/$@/$(basename $(notdir $(SCRIPT)))
# After a stop signal torchrun gives the workers this long to save their checkpoint before SIGKILL
# (its own default, 30 s, can cut a big model's save short; torch before 2.12 has only that).
SHUTDOWN_TIMEOUT ?= 120
# Every torchrun goes through run_multi_node.sh: on one node it runs torchrun --standalone (a free port).
# It passes --shutdown-timeout where torchrun has it, forwards stop signals, and prints its command.
TORCHRUN = NNODES=1 MASTER_ADDR= SHUTDOWN_TIMEOUT=$(SHUTDOWN_TIMEOUT) PYTHON=$(PY) SCRIPT=$(SCRIPT) ./run_multi_node.sh
# Pinned: a fresh machine gets the CPU wheel, never the newest CUDA build. A torch that PYTHON already
# imports is reused (the venv sees PYTHON's packages, also where PYTHON is a venv's own), never reinstalled.
TORCH_PIN := torch==2.13.0
NUMPY_PIN := numpy==2.4.6
PYTEST_PIN := pytest==9.0.3
XDIST_PIN := pytest-xdist==3.8.0
# The README's TensorBoard recipe, which the tests run as written.
TENSORBOARD_PIN := tensorboard==2.20.0
# make lint: every Python file as ruff formats it at line length 100.
RUFF_PIN := ruff==0.14.0
# Multi-node settings, passed to run_multi_node.sh (see its header).
NNODES ?= 2
NODE_RANK ?= 0
MASTER_ADDR ?= 127.0.0.1
MASTER_PORT ?= 29500
NPROC_PER_NODE ?=
# How many GPUs this machine has, for train-Ngpu.
gpus = $(shell $(PY) -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
# make test-torch: the torch to test in a venv of its own (.venv-torch-VERSION), from the registry.
TORCH ?=
TORCH_VENV = .venv-torch-$(TORCH)
PIP = -m pip install -q --disable-pip-version-check

.PHONY: help setup train train-cpu train-multinode test check test-gpu test-torch lint bench clean

help:  ## these targets, one line each
	@awk -F':.*## ' '/^[a-z%-]+:.*## / {sub("%", "N", $$1); printf "  make %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: $(VENV)/.ready  ## create .venv: the pinned CPU torch, numpy, pytest, pytest-xdist, ruff and tensorboard, unless present

# Offline (a GPU node with its image's torch): what PYTHON imports is used, and what is missing but optional
# (pytest-xdist, ruff) is said in one line each; torch, numpy and pytest missing stop here.
$(VENV)/.ready: Makefile
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV) || $(PYTHON) -m venv --system-site-packages --without-pip $(VENV)
	@$(PYTHON) -c "import site; print(*site.getsitepackages(), sep='\n')" > "$$($(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))")/python_that_made_it.pth"
	@$(PY) -c "import torch" 2>/dev/null || $(PY) $(PIP) $(TORCH_PIN)
	@$(PY) -c "import numpy" 2>/dev/null || $(PY) $(PIP) $(NUMPY_PIN)
	@$(PY) -c "import pytest" 2>/dev/null || $(PY) $(PIP) $(PYTEST_PIN)
	@$(PY) -c "import xdist" 2>/dev/null || $(PY) $(PIP) $(XDIST_PIN) 2>/dev/null || echo "make setup: no pytest-xdist (offline?): make test runs one test at a time"
	@$(PY) -m ruff --version >/dev/null 2>&1 || $(PY) $(PIP) $(RUFF_PIN) 2>/dev/null || echo "make setup: no ruff (offline?): make lint cannot run"
	@$(PY) -c "import tensorboard" 2>/dev/null || $(PY) $(PIP) $(TENSORBOARD_PIN) 2>/dev/null || echo "make setup: no tensorboard (offline?): the README test skips"
	@$(PY) -c "import torch; v = torch.__version__; print('torch', v, 'ready in $(VENV)'); [2, 4] <= [int(p) for p in \
	  v.split('.')[:2]] <= [2, 15] or print(f'make setup: torch {v} is outside 2.4 to 2.15, the versions tested; going on')"
	@touch $@

# The out-dir goes after run_single.sh's own --gpu N, which must come first: make train ARGS="--gpu 1 --epochs 5".
train: setup  ## one process: the CPU or one GPU
	PYTHON=$(PY) SCRIPT=$(SCRIPT) ./run_single.sh $(if $(filter --gpu,$(firstword $(ARGS))),$(wordlist 1,2,$(ARGS)) \
	  --out-dir $(out_dir) $(wordlist 3,$(words $(ARGS)),$(ARGS)),--out-dir $(out_dir) $(ARGS))

train-cpu: setup  ## two CPU processes with torchrun and gloo, even on a GPU machine
	CUDA_VISIBLE_DEVICES= NPROC_PER_NODE=2 $(TORCHRUN) --out-dir $(out_dir) $(ARGS)

train-%gpu: setup  ## torchrun with one process per GPU: make train-2gpu, make train-4gpu, make train-8gpu ...
	@test "$(gpus)" -ge "$*" 2>/dev/null || { echo "make $@: needs $* GPUs; this machine has $(gpus)" >&2; exit 2; }
	NPROC_PER_NODE=$* $(TORCHRUN) --out-dir $(out_dir) $(ARGS)

train-multinode: setup  ## on every node: make train-multinode NODE_RANK=1 MASTER_ADDR=10.0.0.1
	PYTHON=$(PY) NNODES=$(NNODES) NODE_RANK=$(NODE_RANK) MASTER_ADDR=$(MASTER_ADDR) MASTER_PORT=$(MASTER_PORT) \
	  NPROC_PER_NODE=$(NPROC_PER_NODE) SHUTDOWN_TIMEOUT=$(SHUTDOWN_TIMEOUT) SCRIPT=$(SCRIPT) \
	  ./run_multi_node.sh --out-dir $(out_dir) $(ARGS)

lint: setup  ## every Python file formatted as ruff format --line-length 100 writes it
	$(PY) -m ruff format --check --line-length 100 .

test: setup  ## the whole test suite: real processes, two tests at a time (pytest-xdist)
	$(PY) -m pytest -q --durations=15 $$($(PY) -c "import xdist" 2>/dev/null && echo --numprocesses=2) test_ddp_train.py

# make check: the guarantees, on your script (SCRIPT) with your flags (ARGS), in real processes on the
# CPU: one line each. CHECKS=2,3 runs only those. check_copy.py runs them, and its launches stay in
# out/check/SCRIPT until the next check replaces them.
CHECKS ?=
check: setup  ## the guarantees on your copy: make check SCRIPT=mine.py ARGS="--batch-size 8"
	CUDA_VISIBLE_DEVICES= $(PY) check_copy.py "$(SCRIPT)" --args="$(ARGS)" --checks="$(CHECKS)" \
	  --work=out/check/$(basename $(notdir $(SCRIPT)))

# PyPI's torch for Linux is a CUDA build (about 3 GB with its packages; it runs on the CPU). An exact version
# asked for is installed even where a pip constraint file caps torch (PIP_CONSTRAINT).
test-torch:  ## the version tier on another torch: make test-torch TORCH=2.4.1 (its own venv, from the registry)
	@test -n "$(TORCH)" || { echo "make test-torch: name a version: make test-torch TORCH=2.4.1" >&2; exit 2; }
	@test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	@$(TORCH_VENV)/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH)')" 2>/dev/null || \
	  PIP_CONSTRAINT=/dev/null $(TORCH_VENV)/bin/python $(PIP) torch==$(TORCH) numpy $(PYTEST_PIN) $(XDIST_PIN)
	$(TORCH_VENV)/bin/python -m pytest -q -n 2 -m tier test_ddp_train.py

test-gpu: setup  ## on a GPU machine: the GPU tests, then a short run in every GPU mode, as a table
	@$(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null || \
	  { echo "make test-gpu: no CUDA device here; nothing to run"; exit 0; }; \
	$(PY) -m pytest -q -m gpu test_ddp_train.py; tests=$$?; \
	$(PY) bench_ddp_train.py --gpu-modes; modes=$$?; \
	exit $$(( tests || modes ))

bench: setup  ## side-by-side throughput, start-up and memory; ARGS=--quick for a fast check
	$(PY) bench_ddp_train.py $(ARGS)

clean:  ## remove out/ (every run of the train targets and scripts) and caches
	rm -rf out .pytest_cache __pycache__
