# Every target builds what it needs: a fresh machine with Python 3.11 and make is enough.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# torch first, pinned: 2.13.0 is the CPU wheel this project is tested with (a looser spec may pull a CUDA build).
TORCH ?= torch==2.13.0
TRANSFORMERS ?= transformers==5.23.0

.PHONY: setup demo test lint matrix sp-test bench gpu-test clean

$(BIN)/.installed: pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q "$(TRANSFORMERS)" -e ".[test]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/python examples/demo.py

test: setup
	$(BIN)/ruff check patchkit patches tests examples benchmarks tools
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check patchkit patches tests examples benchmarks tools

# The transformers version matrix (slow: one install per version); see tests/matrix.py.
matrix: setup
	$(BIN)/python tests/matrix.py

# DeepSpeed Ulysses sequence parallelism on two gloo ranks (tests/test_sequence_parallel.py). DeepSpeed is an sdist:
# built against the venv's torch (no build isolation, so no other torch is pulled), into .sp/ beside the venv, not
# into it; its JIT comm op (first run, ~40 s) needs a C++ compiler and the ninja installed there.
SP_DIR := .sp
DEEPSPEED ?= deepspeed==0.19.8
$(SP_DIR)/.installed: $(BIN)/.installed
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --target $(SP_DIR) --no-deps --no-build-isolation "$(DEEPSPEED)" \
		einops hjson msgpack ninja py-cpuinfo
	touch $@

sp-test: $(SP_DIR)/.installed
	PYTHONPATH=$(CURDIR)/$(SP_DIR) PATH=$(CURDIR)/$(SP_DIR)/bin:$$PATH $(BIN)/python -m pytest -q \
		tests/test_sequence_parallel.py tests/test_deepspeed_zero.py

bench: setup
	$(BIN)/patchkit bench

# Every test marked gpu (flash_attn and torch_varlen against eager and sdpa, bf16), flash-attn from a wheel where one
# exists, one summary line; exits 0 with a line saying why on a machine without CUDA. See tests/run_gpu.py.
gpu-test: setup
	$(BIN)/python tests/run_gpu.py

clean:
	rm -rf $(VENV) $(SP_DIR) *.egg-info .pytest_cache .ruff_cache
