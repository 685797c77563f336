# make train and make test set up what they need first. They make a virtual environment in .venv.
# ARGS passes extra arguments to ddp_train.py, as in make train ARGS="--epochs 5 --lr 3e-3".
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=
# SCRIPT is the training script. It is ddp_train.py, or your own script that imports it. An example is
# make train-cpu SCRIPT=examples/digits.py.
SCRIPT ?= ddp_train.py
# Each train target writes its own out-dir for each script, out/TARGET/SCRIPT. Examples are
# out/train/ddp_train and out/train-cpu/digits. The same command, run again, continues its run. One
# target's checkpoint never stops another target's run, even with another world size or another model.
# An --out-dir in ARGS comes later on the command line, so it wins.
out_dir = out/$@/$(basename $(notdir $(SCRIPT)))
# After a stop signal, torchrun gives the workers this long to save their checkpoint before SIGKILL.
# Its own default of 30 s can cut a big model's save short. torch before 2.12 has only that default.
SHUTDOWN_TIMEOUT ?= 120
# Every torchrun goes through run_multi_node.sh. On one node, that script runs torchrun --standalone,
# which takes a free port. It passes --shutdown-timeout where torchrun has it, forwards stop signals, and
# prints its command.
TORCHRUN = NNODES=1 MASTER_ADDR= SHUTDOWN_TIMEOUT=$(SHUTDOWN_TIMEOUT) PYTHON=$(PY) SCRIPT=$(SCRIPT) ./run_multi_node.sh
# These versions are pinned, so a fresh machine gets the CPU wheel and never the newest CUDA build. A
# torch that PYTHON already imports is reused and never reinstalled. The venv sees PYTHON's packages, also
# where PYTHON is a venv's own python.
TORCH_PIN := torch==2.13.0
NUMPY_PIN := numpy==2.4.6
PYTEST_PIN := pytest==9.0.3
XDIST_PIN := pytest-xdist==3.8.0
# The README's TensorBoard recipe needs tensorboard, and the tests run that recipe as written.
TENSORBOARD_PIN := tensorboard==2.20.0
# make lint checks that every Python file is as ruff formats it at line length 100.
RUFF_PIN := ruff==0.14.0
# These multi-node settings go to run_multi_node.sh. Its header explains them.
NNODES ?= 2
NODE_RANK ?= 0
MASTER_ADDR ?= 127.0.0.1
MASTER_PORT ?= 29500
NPROC_PER_NODE ?=
# gpus is the number of GPUs on this machine. train-Ngpu checks it.
gpus = $(shell $(PY) -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
# TORCH is the torch version that make test-torch tests. It comes from the registry into a venv of its
# own, .venv-torch-VERSION.
TORCH ?=
TORCH_VENV = .venv-torch-$(TORCH)
PIP = -m pip install -q --disable-pip-version-check

.PHONY: help setup train train-cpu train-multinode test test-long check test-gpu test-torch lint bench clean

help:  ## This list shows every target on one line.
	@awk -F':.*## ' '/^[a-z%-]+:.*## / {sub("%", "N", $$1); printf "  make %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: $(VENV)/.ready  ## It makes .venv with the pinned CPU torch, numpy, pytest, pytest-xdist, ruff and tensorboard if they are missing.

# A machine may be offline, such as a GPU node with its image's torch. Then setup uses what PYTHON imports.
# Each optional package that is missing, such as pytest-xdist or ruff, gets one line. A missing torch,
# numpy or pytest stops setup here.
$(VENV)/.ready: Makefile
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV) || $(PYTHON) -m venv --system-site-packages --without-pip $(VENV)
	@$(PYTHON) -c "import site; print(*site.getsitepackages(), sep='\n')" > "$$($(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))")/python_that_made_it.pth"
	@$(PY) -c "import torch" 2>/dev/null || $(PY) $(PIP) $(TORCH_PIN)
	@$(PY) -c "import numpy" 2>/dev/null || $(PY) $(PIP) $(NUMPY_PIN)
	@$(PY) -c "import pytest" 2>/dev/null || $(PY) $(PIP) $(PYTEST_PIN)
	@$(PY) -c "import xdist" 2>/dev/null || $(PY) $(PIP) $(XDIST_PIN) 2>/dev/null || echo "make setup: pytest-xdist is missing. This machine may be offline. make test runs one test at a time"
	@$(PY) -m ruff --version >/dev/null 2>&1 || $(PY) $(PIP) $(RUFF_PIN) 2>/dev/null || echo "make setup: ruff is missing. This machine may be offline. make lint cannot run"
	@$(PY) -c "import tensorboard" 2>/dev/null || $(PY) $(PIP) $(TENSORBOARD_PIN) 2>/dev/null || echo "make setup: tensorboard is missing. This machine may be offline. The README test skips"
	@$(PY) -c "import torch; v = torch.__version__; print('torch', v, 'is ready in $(VENV)'); [2, 4] <= [int(p) for p in \
	  v.split('.')[:2]] <= [2, 15] or print(f'make setup: torch {v} is outside 2.4 to 2.15, the tested versions. Setup goes on')"
	@touch $@

# run_single.sh's own --gpu N must come first, so the out-dir goes after it. An example is
# make train ARGS="--gpu 1 --epochs 5".
train: setup  ## It runs one process on the CPU or on one GPU.
	PYTHON=$(PY) SCRIPT=$(SCRIPT) ./run_single.sh $(if $(filter --gpu,$(firstword $(ARGS))),$(wordlist 1,2,$(ARGS)) \
	  --out-dir $(out_dir) $(wordlist 3,$(words $(ARGS)),$(ARGS)),--out-dir $(out_dir) $(ARGS))

train-cpu: setup  ## It runs two CPU processes with torchrun and gloo, even on a GPU machine.
	CUDA_VISIBLE_DEVICES= NPROC_PER_NODE=2 $(TORCHRUN) --out-dir $(out_dir) $(ARGS)

train-%gpu: setup  ## It runs torchrun with one process per GPU, as in train-2gpu, train-4gpu or train-8gpu.
	@test "$(gpus)" -ge "$*" 2>/dev/null || { echo "make $@: it needs $* GPUs, but this machine has $(gpus)" >&2; exit 2; }
	NPROC_PER_NODE=$* $(TORCHRUN) --out-dir $(out_dir) $(ARGS)

train-multinode: setup  ## Each node runs it, as in make train-multinode NODE_RANK=1 MASTER_ADDR=10.0.0.1.
	PYTHON=$(PY) NNODES=$(NNODES) NODE_RANK=$(NODE_RANK) MASTER_ADDR=$(MASTER_ADDR) MASTER_PORT=$(MASTER_PORT) \
	  NPROC_PER_NODE=$(NPROC_PER_NODE) SHUTDOWN_TIMEOUT=$(SHUTDOWN_TIMEOUT) SCRIPT=$(SCRIPT) \
	  ./run_multi_node.sh --out-dir $(out_dir) $(ARGS)

lint: setup  ## It checks that every Python file is as ruff format --line-length 100 writes it.
	$(PY) -m ruff format --check --line-length 100 .

# The tests run in real processes, two at a time with pytest-xdist. make test runs one test of each
# guarantee, and make test-long runs every other test, the two-host and SLURM tests among them. make
# test-gpu and make test-torch run their own tiers.
PYTEST = $(PY) -m pytest -q --durations=15 $$($(PY) -c "import xdist" 2>/dev/null && echo --numprocesses=2 --dist=worksteal) test_ddp_train.py
test: setup  ## It runs one test of each guarantee, in about 5 minutes on 2 cores.
	$(PYTEST) -m "not (long or multinode or slurm or gpu)"

test-long: setup  ## It runs every other test, the two-host and SLURM tests among them.
	$(PYTEST) -m "(long or multinode or slurm) and not gpu"

# make check tests the guarantees on your script, SCRIPT, with your flags, ARGS. It runs real processes
# on the CPU and prints one line for each guarantee. CHECKS=2,3 runs only those checks. check_copy.py runs
# them, and its launches stay in out/check/SCRIPT until the next check replaces them.
CHECKS ?=
check: setup  ## It checks the guarantees on your copy, as in make check SCRIPT=mine.py ARGS="--batch-size 8".
	CUDA_VISIBLE_DEVICES= $(PY) check_copy.py "$(SCRIPT)" --args="$(ARGS)" --checks="$(CHECKS)" \
	  --work=out/check/$(basename $(notdir $(SCRIPT)))

# PyPI's torch for Linux is a CUDA build. With its packages it takes about 3 GB, and it runs on the CPU. The
# exact version that you ask for is installed even where a pip constraint file, PIP_CONSTRAINT, caps torch.
test-torch:  ## It runs the version tier on a torch from the registry, in its own venv, as in TORCH=2.4.1.
	@test -n "$(TORCH)" || { echo "make test-torch: TORCH must name a version, as in TORCH=2.4.1" >&2; exit 2; }
	@test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	@$(TORCH_VENV)/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH)')" 2>/dev/null || \
	  PIP_CONSTRAINT=/dev/null $(TORCH_VENV)/bin/python $(PIP) torch==$(TORCH) numpy $(PYTEST_PIN) $(XDIST_PIN)
	$(TORCH_VENV)/bin/python -m pytest -q -n 2 -m tier test_ddp_train.py

test-gpu: setup  ## On a GPU machine, it runs the GPU tests, then a short run in every GPU mode as a table.
	@$(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null || \
	  { echo "make test-gpu: this machine has no CUDA device, so there is nothing to run"; exit 0; }; \
	$(PY) -m pytest -q -m gpu test_ddp_train.py; tests=$$?; \
	$(PY) bench_ddp_train.py --gpu-modes; modes=$$?; \
	exit $$(( tests || modes ))

bench: setup  ## It compares throughput, start-up and memory side by side. ARGS=--quick gives a fast check.
	$(PY) bench_ddp_train.py $(ARGS)

clean:  ## It removes the caches and out/, which holds every run of the train targets and scripts.
	rm -rf out .pytest_cache __pycache__
