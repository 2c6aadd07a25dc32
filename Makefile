# hvdtrain: `make demo` trains on the built-in dataset with 2 ranks; `make test` runs the suite.
# Both run `make setup` first, which installs what is missing and takes seconds once done.
# VENV=/opt/hvdtrain PYTHON=/usr/bin/python3: a shared install, see docs/launching.md#a-shared-install
VENV ?= $(if $(HVDTRAIN_VENV),$(HVDTRAIN_VENV),.venv)
PYTHON ?=
PY := $(VENV)/bin/python
NP ?= 2
PYTEST_ARGS ?=
EXTRAS ?=
# ENGINE=torch: an install without Horovod (no compile), for dist.engine=torch under torchrun
ENGINE ?= $(if $(HVDTRAIN_ENGINE),$(HVDTRAIN_ENGINE),horovod)
# TORCH=cpu: PyTorch's CPU-only torch and torchvision, for sites whose nodes have no GPU (no CUDA
# libraries or triton, about 3.5 GB less); cuda, the default, runs with or without a GPU
TORCH ?= $(HVDTRAIN_TORCH)

.PHONY: setup demo lint test test-fast image test-image test-unit test-horovod bench bench-scaling clean

# EXTRAS=ray,mlflow,... also installs optional integrations (pyproject.toml's optional-dependencies, pinned).
setup:
	@EXTRAS="$(EXTRAS)" HVDTRAIN_ENGINE="$(ENGINE)" HVDTRAIN_TORCH="$(TORCH)" HVDTRAIN_VENV="$(abspath $(VENV))" \
		PYTHON="$(PYTHON)" bash scripts/setup.sh

ifeq ($(ENGINE),torch)
# The torch engine admits only ranks that know the job's secret (docs/security.md): one per run,
# in the environment, never on a command line.
demo: setup
	export HVDTRAIN_JOB_SECRET=$$($(PY) -c 'import secrets; print(secrets.token_hex(32))'); \
		$(PY) -P -m torch.distributed.run --nproc_per_node $(NP) -m hvdtrain --config demo dist.engine=torch $(ARGS)
else
demo: setup
	$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo \
		$(PY) -P -m hvdtrain --config demo $(ARGS)
endif

# Two pytest-xdist workers: while one waits (a Slurm job's scheduling, ssh, a deadline, a stop
# signal's round trip) the other computes. A test file stays on one worker, tests/multinode on one.
TEST_WORKERS ?= 2

# The house rules a tool keeps: ruff's lint (pyproject.toml, [tool.ruff]) and mypy's type check of
# the modules its [tool.mypy] lists, before any test; the module-size and layering contracts are
# unit tests (tests/unit/test_module_size.py, test_layers.py). ruff and mypy come with the test
# extra (scripts/test-deps.sh, which lint runs first: make test-fast right after make setup finds
# ruff, mypy, pytest-xdist and pytest-timeout), as pytest-xdist does.
lint: setup
	@VENV="$(VENV)" bash scripts/test-deps.sh
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

test: setup
	@VENV="$(VENV)" bash scripts/test-deps.sh
	$(VENV)/bin/ruff check .
	$(PY) -m mypy
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The docker image built for real with podman (offline Debian base, the host's CA bundle as a build
# secret) and run through chroot: check-build, a 2-rank demo epoch, sshd -t, no secrets/compilers.
# `make image` only builds it (podman's layer cache makes the build in test-image take seconds then).
image: setup
	@VENV="$(VENV)" bash scripts/test-deps.sh image
	bash docker/build-local.sh

test-image: image
	HVDTRAIN_TEST_IMAGE=1 $(PY) -m pytest tests/image $(PYTEST_ARGS)

# hvdtrain vs a raw PyTorch loop and DDP, alternating (benchmarks/compare.py; ARGS="--rounds 5" etc.)
bench: setup
	$(PY) benchmarks/compare.py $(ARGS)

# Two nodes over a rate-limited link against the link's limit (benchmarks/scaling.py; needs root for the
# network namespaces; ARGS="--rates 0.25,1 --rounds 2"); writes runs/scaling/scaling.{json,md,png}
bench-scaling: setup
	$(PY) benchmarks/scaling.py $(ARGS)

# The edit-run loop: the unit tests and one launched smoke test (train, checkpoint, resume, compare).
test-fast: lint
	$(PY) -m pytest tests/unit tests/parallel/test_smoke.py -m "not slow" -n $(TEST_WORKERS) --dist loadgroup \
		$(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# Horovod's own test/parallel/test_torch.py (v0.28.1, at a pinned commit and sha256, into the ignored
# .cache/horovod-tests/) under horovodrun --gloo and --mpi against the patched build: any failure
# but the three Muon ones, an abort or a hang fails (scripts/horovod-tests.sh). Without GitHub
# access: HOROVOD_TESTS_SRC=DIR, a Horovod source tree at v0.28.1. CONTROLLERS=gloo runs one.
CONTROLLERS ?=
test-horovod: setup
	VENV="$(VENV)" bash scripts/horovod-tests.sh $(CONTROLLERS)

clean:
	rm -rf runs .pytest_cache
