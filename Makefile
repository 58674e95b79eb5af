# The two commands of README.md. Each sets itself up on a fresh machine.
#   make run    the main job: ResNet-18 on scikit-learn's digits, 2 ranks, data parallel + SyncBN
#   make test   ruff + the whole suite: pure and gloo tiers, the mpiexec tier on 1-4 ranks, the XLA
#               tier, the GPU tier (skipped without CUDA), and the model-zoo tier (pk.parallelize
#               on torchvision, timm and smp networks, in .venv-zoo)
#   make test-fast  the inner loop (~1.5 min): ruff, the pure tests and the 2-rank pool tests
# and: make bench (every script under benchmarks/ but the peers, ~50 min; results under
#                  benchmarks/results/)
#      make bench-peers (ChainerMN and torch's DDP/SyncBatchNorm/DTensor next to parallelkit)

VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on the machine; torch_xla needs its own venv (see docs).
TORCH ?= torch==2.13.0
# Ranks oversubscribe the cores: one thread each.
export OMP_NUM_THREADS := 1
# The gloo and zoo tiers run in this many pytest-xdist workers. A 2-rank test keeps about one
# core busy (its ranks take turns), so 2 workers fill a 2-core machine; each worker starts its
# own pools of ranks. test-py hands out whole files (module fixtures run once), test-zoo single
# cases (nearly all of them are in one file).
TEST_WORKERS ?= 2
# A stuck MPI collective aborts the job after this many seconds (tests only).
MPI_TEST_ENV := PARALLELKIT_TIMEOUT=120 MPIEXEC_TIMEOUT=600
# torch_xla pins torch exactly, so the XLA tier has its own venv (PyPI's torch 2.9.0, ~7 GB
# with its CUDA libraries; about 2.5 min to install). XLA CPU devices stand in for TPU cores.
XLA_VENV ?= .venv-xla
XLA_PY := $(XLA_VENV)/bin/python
TORCH_XLA ?= torch==2.9.0 torch_xla==2.9.0
XLA_TEST_ENV := PJRT_DEVICE=CPU PARALLELKIT_TIMEOUT=120
# The model-zoo tier needs torchvision, which only imports beside the torch it was built for
# (not the CPU torch 2.13.0 of .venv): its own venv with a matched pair that lies on the
# machine (a CUDA build, ~5.5 GB, that runs on the CPU), and timm, smp and monai pinned so that
# the table of expected outcomes (tests/zoo/zoo_expected.py) stays the table of these versions.
ZOO_VENV ?= .venv-zoo
ZOO_PY := $(ZOO_VENV)/bin/python
TORCH_ZOO ?= torch==2.14.1 torchvision==0.29.1
ZOO_MODELS ?= timm==1.0.31 segmentation_models_pytorch==0.6.0 monai==1.6.1
ZOO_TEST_ENV := HF_HUB_OFFLINE=1 PARALLELKIT_TIMEOUT=120
# The peers benchmark runs ChainerMN (inside chainer 7.8.1) under its own mpiexec: chainer
# needs numpy<2 and an old setuptools to build, so it has its own venv.
CHAINER_VENV ?= .venv-chainer
CHAINER_PY := $(CHAINER_VENV)/bin/python
CHAINER ?= chainer==7.8.1

.PHONY: run test test-fast lint test-py test-mpi test-xla test-gpu test-zoo bench bench-peers plots clean

# The package is installed editable, so pip compiles none of its bytecode; where
# PYTHONDONTWRITEBYTECODE is set (the ranks inherit it) every process would compile it anew.
$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[mpi,dev,data,tensorboard,plot,examples]" mpich
	$(PY) -m compileall -q parallelkit > /dev/null
	touch $@

# torch and torch_xla first, pinned together; then the package and its test tools, which
# accept that torch (torch>=2.4) and so leave it alone.
$(XLA_VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(XLA_VENV)
	$(XLA_PY) -m pip install -q --disable-pip-version-check $(TORCH_XLA)
	$(XLA_PY) -m pip install -q --disable-pip-version-check -e ".[dev]" $(TORCH_XLA)
	touch $@

# torch and torchvision first, pinned together; every later install repeats the pins so that
# nothing replaces them; the last line checks it.
$(ZOO_VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(ZOO_VENV)
	$(ZOO_PY) -m pip install -q --disable-pip-version-check $(TORCH_ZOO)
	$(ZOO_PY) -m pip install -q --disable-pip-version-check $(ZOO_MODELS) $(TORCH_ZOO)
	$(ZOO_PY) -m pip install -q --disable-pip-version-check -e ".[dev]" $(TORCH_ZOO)
	$(ZOO_PY) -c "import torch, torchvision, timm, segmentation_models_pytorch, monai; \
	  assert torch.__version__.startswith('2.14.1'), torch.__version__; print('zoo venv: torch', \
	  torch.__version__, 'torchvision', torchvision.__version__, 'timm', timm.__version__)"
	touch $@

# chainer builds from its sdist against the venv's numpy<2 and setuptools<70 (no isolation).
$(CHAINER_VENV)/.installed: Makefile
	python3 -m venv $(CHAINER_VENV)
	$(CHAINER_PY) -m pip install -q --disable-pip-version-check "setuptools<70" wheel "numpy<2"
	$(CHAINER_PY) -m pip install -q --disable-pip-version-check --no-build-isolation \
	  "$(CHAINER)" mpi4py mpich
	$(CHAINER_PY) -c "import chainer, chainermn, mpi4py; print('chainer venv: chainer', \
	  chainer.__version__, 'mpi4py', mpi4py.__version__)"
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/parallelkit train train.overwrite=true

# The XLA and zoo venvs (pip installs of several GB that mostly wait on the disk and the
# network) are built in the background from the start, while .venv is made and the CPU-bound
# gloo and mpiexec tiers run; their log is printed when both are done.
test:
	@$(MAKE) --no-print-directory $(XLA_VENV)/.installed $(ZOO_VENV)/.installed \
	  > .venv-builds.log 2>&1 & builds=$$!; \
	$(MAKE) --no-print-directory lint test-py test-mpi; tiers=$$?; \
	wait $$builds; built=$$?; cat .venv-builds.log; \
	[ $$tiers = 0 ] && [ $$built = 0 ]
	@$(MAKE) --no-print-directory test-xla test-gpu test-zoo

# Pure tests and the pool tests on 2 ranks (tests/conftest.py: --fast); no subprocess runs of
# parallelkit train, no 1-, 3- or 4-rank cases, no mpiexec, XLA or zoo tiers.
test-fast: lint
	$(PY) -m pytest -q -p no:cacheprovider --durations=5 --fast tests

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check parallelkit tests benchmarks examples

test-py: $(VENV)/.installed
	$(PY) -m pytest -q --durations=60 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

test-mpi: $(VENV)/.installed
	for n in 1 2 3 4; do \
	  echo "== mpiexec -n $$n pytest tests/mpi"; \
	  $(MPI_TEST_ENV) $(VENV)/bin/mpiexec -n $$n $(PY) -m pytest -q -p no:cacheprovider tests/mpi \
	    || exit 1; \
	done
	@echo "== mpiexec -n 3 pytest tests/mpi, debug mode (every collective checked across ranks)"
	PARALLELKIT_DEBUG=1 $(MPI_TEST_ENV) $(VENV)/bin/mpiexec -n 3 $(PY) -m pytest -q -p no:cacheprovider tests/mpi

test-xla: $(XLA_VENV)/.installed
	$(XLA_TEST_ENV) $(XLA_PY) -m pytest -q -p no:cacheprovider tests/xla

# Needs a CUDA build of torch (skips cleanly here). On a GPU machine whose python has it:
#   python3 -m pytest tests/gpu   (docs/gpu.md: the pure-Python wheels to bring along)
test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider tests/gpu

# pk.parallelize on 51 real image networks under data, rows and channel (21 also on cols, 3 on
# data x rows) and 14 volume networks, against the dense model, and the spatially refused ones
# again under fallback="gather" (docs/zoo.md).
test-zoo: $(ZOO_VENV)/.installed
	$(ZOO_TEST_ENV) $(ZOO_PY) -m pytest -q --durations=10 -p no:cacheprovider \
	  -n $(TEST_WORKERS) --dist load tests/zoo

bench: $(VENV)/.installed
	$(PY) benchmarks/collectives.py
	$(PY) benchmarks/call_overhead.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/sync_batchnorm.py
	$(PY) benchmarks/data_parallel.py
	$(PY) benchmarks/model_parallel.py
	$(PY) benchmarks/spatial_resnet.py
	$(PY) benchmarks/spatial_volume.py
	$(PY) benchmarks/token_mixing.py
	$(PY) benchmarks/train.py
	$(PY) benchmarks/startup.py
	$(PY) benchmarks/transport.py
	$(PY) benchmarks/plan_vs_measured.py

# The peers side by side (~3 min, plus ~2 min to create .venv-chainer the first time):
# ChainerMN in $(CHAINER_VENV) under its mpiexec; parallelkit in $(VENV) on MPI under $(VENV)'s
# mpiexec (ChainerMN's transport) and on gloo, next to torch's DDP, SyncBatchNorm and DTensor;
# results and plots under benchmarks/results/.
bench-peers: $(VENV)/.installed $(CHAINER_VENV)/.installed
	$(PY) benchmarks/peers.py --chainer-python $(CHAINER_PY)

# The PNGs of every benchmark, redrawn from the JSON records under benchmarks/results/.
plots: $(VENV)/.installed
	$(PY) benchmarks/plots.py

clean:
	rm -rf $(VENV)
