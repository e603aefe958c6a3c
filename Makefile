# pdserve: `make run` (the main job) and `make test` work from a fresh clone; both create the venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= models
export OMP_NUM_THREADS ?= 2

.PHONY: run test lint bench protos venv clean

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || (echo "need $(PYTHON)" && exit 1)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,nixl]'
	touch $@

venv: $(VENV)/.installed

run: venv
	$(VENV)/bin/pdserve demo --model-dir $(MODEL_DIR)

test: venv
	$(PY) -m pytest -q

protos: venv
	$(PY) -m services.protogen

lint: venv
	$(VENV)/bin/ruff check engine kernels services modelkit tests benchmarks
	$(VENV)/bin/ruff format --check engine kernels services modelkit tests benchmarks

bench: venv
	$(VENV)/bin/pdserve make-model bench --out $(MODEL_DIR)/pdserve-bench
	$(PY) benchmarks/offline_throughput.py --model $(MODEL_DIR)/pdserve-bench
	$(PY) benchmarks/decode_curve.py --model $(MODEL_DIR)/pdserve-bench
	$(PY) benchmarks/ep_balance.py
	$(PY) benchmarks/prefix_offload.py --model $(MODEL_DIR)/pdserve-bench
	$(PY) benchmarks/serving.py --model $(MODEL_DIR)/pdserve-bench --rates 1,2 --num-requests 16

clean:
	rm -rf $(VENV) $(MODEL_DIR)
