# pdserve: `make run` (the main job) and `make test` work from a fresh clone; both create the venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= models
export OMP_NUM_THREADS ?= 2
# The torch pyproject.toml pins: installed before the project, whose build compiles against it.
TORCH := $(shell sed -n 's/^ *"\(torch==[^"]*\)",.*/\1/p' pyproject.toml | head -n 1)
NATIVE_SOURCES := $(wildcard kernels/native/*.h kernels/native/*.cpp kernels/native/build.py) engine/kv_cache/crc32c.c

.PHONY: run test lint bench bench-served-peers protos venv native clean

# The install compiles the native CPU kernels for every ISA level (setup.py, about a minute on 2
# cores), without build isolation: the venv's torch is the one they link against.
$(VENV)/.installed: pyproject.toml setup.py
	@command -v $(PYTHON) >/dev/null || (echo "need $(PYTHON)" && exit 1)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "installing torch and the build's tools ..."
	$(PY) -m pip install -q 'setuptools>=68' '$(TORCH)' numpy
	@echo "installing pdserve; its build compiles the native CPU kernels for every ISA level (about a minute) ..."
	$(PY) -m pip install -q --no-build-isolation -e '.[test,bench,nixl]'
	touch $@

venv: $(VENV)/.installed

# After an edit of the kernels' sources: rebuild their libraries ahead, as the install does (else
# the first engine compiles the one it needs, once).
kernels/native/prebuilt/.built: $(VENV)/.installed $(NATIVE_SOURCES)
	$(PY) kernels/native/build.py
	touch $@

native: kernels/native/prebuilt/.built

# ARCH=v4: the trained DeepSeek-V4 model instead of the V3 one.
ARCH ?= v3
run: venv native
	$(VENV)/bin/pdserve demo --model-dir $(MODEL_DIR) --arch $(ARCH)

# The suite in TEST_WORKERS processes (pytest-xdist), a test file's tests in one of them (its
# module fixtures, e.g. a stack, started once): most of its time is spent waiting on the stacks
# and engines it starts as processes, so two workers on two cores finish in about 0.8 of one's time.
TEST_WORKERS ?= 2

test: venv native
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

protos: venv
	$(PY) -m services.protogen

lint: venv
	$(VENV)/bin/ruff check engine kernels services modelkit tests benchmarks setup.py
	$(VENV)/bin/ruff format --check engine kernels services modelkit tests benchmarks setup.py

bench: venv
	$(VENV)/bin/pdserve make-model bench --out $(MODEL_DIR)/pdserve-bench
	$(PY) benchmarks/offline_throughput.py --model $(MODEL_DIR)/pdserve-bench
	$(PY) benchmarks/decode_curve.py --model $(MODEL_DIR)/pdserve-bench
	$(PY) benchmarks/ep_balance.py
	$(PY) benchmarks/prefix_offload.py --model $(MODEL_DIR)/pdserve-bench
	$(PY) benchmarks/serving.py --model $(MODEL_DIR)/pdserve-bench --rates 1,2 --num-requests 16

# `pdserve serve` against `vllm serve` and llama.cpp's `llama-server` under one load generator, one
# server at a time (about 1.5 h on 2 cores). The peers first, once: ../shared/peers/setup.sh, then
# STEPS=llamaserver ../shared/peers/setup.sh. ENGINES=pdserve,llamacpp runs some.
bench-served-peers: venv native
	$(VENV)/bin/pdserve make-model bench --out $(MODEL_DIR)/pdserve-bench
	$(PY) benchmarks/served_peers.py --model $(MODEL_DIR)/pdserve-bench $(if $(ENGINES),--engines $(ENGINES))

clean:
	rm -rf $(VENV) $(MODEL_DIR) kernels/native/prebuilt build
