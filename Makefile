# Set-up and everyday commands. `make serve` and `make test` work from a fresh clone.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONFIG ?= configs/tiny-1p1d.yaml
PORT ?=
ARGS ?=
STAMP := $(VENV)/.installed
# pytest-xdist processes for `make test`: most tests wait on clusters of subprocesses, so two
# keep both cores of the dev box busy (whole modules per process: their clusters are shared),
# in collection order: tests/conftest.py puts the modules with slow tests first.
TEST_WORKERS ?= 2
# auto: CUDA builds of torch/triton/Mooncake when nvidia-smi lists a GPU, else the CPU ones;
# DEVICE=cuda|cpu forces one. Pins: pyproject.toml [tool.tandem.install].
DEVICE ?= auto
SELECT := python3 deploy/torch_install.py --device $(DEVICE)

.PHONY: install serve image test lint proto chaos bench clean system-deps

# apt packages the transfer backends and the Slurm tests need (skipped when present or not root).
system-deps:
	@bash deploy/install-system-deps.sh

$(STAMP): pyproject.toml
	@$(SELECT) --which >/dev/null   # a bad DEVICE, or cuda without a driver: one line, stop here
	@DEVICE=$$($(SELECT) --which) $(MAKE) --no-print-directory system-deps
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(SELECT) --pip "$(PIP)"   # first: torch for this device (a bare `torch` is the CUDA build)
	$(PIP) install -q -e ".[$$($(SELECT) --extras)]"
	$(PIP) install -q --no-deps nixl==1.5.1   # the meta package's own deps do not resolve; its API is in nixl-cu13
	$(SELECT) --which > $(STAMP)   # the device this venv is for

install: $(STAMP)
	@$(SELECT) --check-stamp $(STAMP)

# `make serve PORT=8100` beside a cluster on 8000; ARGS= passes any other flag of `tandem serve`
# (e.g. ARGS="--set transfer.backend=nixl --api-key k").
serve: $(STAMP)
	$(VENV)/bin/tandem serve --config $(CONFIG)$(if $(PORT), --port $(PORT)) $(ARGS)

# Container images for deploy/k8s (deploy/Dockerfile; it installs with `make install`, as CI):
# tandem:cpu (also tagged tandem:latest), or tandem:cuda with DEVICE=cuda. CONTAINER: the
# builder (podman, buildah or docker: the first on PATH); IMAGE_FLAGS: more flags for it.
CONTAINER ?= $(firstword $(shell command -v podman buildah docker 2>/dev/null))
IMAGE_FLAGS ?=
IMAGE_DEVICE = $(if $(filter cuda,$(DEVICE)),cuda,cpu)
image:
	@test -n "$(CONTAINER)" || { echo "make image: no podman, buildah or docker on PATH; install one (e.g. apt-get install podman) or set CONTAINER=" >&2; exit 2; }
	$(CONTAINER) build -f deploy/Dockerfile --build-arg DEVICE=$(IMAGE_DEVICE) \
	  $(if $(filter cuda,$(IMAGE_DEVICE)),--build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL) -t tandem:cuda,$(if $(TORCH_INDEX_URL),--build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL)) -t tandem:cpu -t tandem:latest) \
	  $(IMAGE_FLAGS) .

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests ran"; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protocol/*.proto

chaos: $(STAMP)
	$(PY) -m pytest -q -m chaos tests/e2e/chaos

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
