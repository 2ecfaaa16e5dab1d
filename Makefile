# Every target builds what it needs: a fresh machine with Python 3.11 and make is enough.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# torch first, pinned: 2.13.0 is the CPU wheel this project is tested with (a looser spec may pull a CUDA build).
# Bytecode is compiled at install (pip's default): this machine sets PYTHONDONTWRITEBYTECODE=1, so a module without
# its .pyc is compiled again in every process that imports it (measured: make test ~40% slower with --no-compile).
TORCH ?= torch==2.13.0
TRANSFORMERS ?= transformers==5.25.0

.PHONY: setup bytecode demo test test-heavy docs fresh-install census lint matrix newest sp-test torch-check bench gpu-test gpu-truth gpu-truth-stage1 gpu-truth-check clean

$(BIN)/.installed: pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q "$(TRANSFORMERS)" -e ".[test]"
	touch $@

setup: $(BIN)/.installed

# The repo's bytecode, written once its sources change: this machine sets PYTHONDONTWRITEBYTECODE=1, so without it each
# pytest process (two per run, one or two per matrix version) rewrote every test module's asserts again (collection:
# 26 -> 16 CPU-s) and every process a test starts (hundreds in CI) compiled patchkit and the test helpers again. Python
# and pytest read bytecode that is there, and ignore what its source has changed since.
PY_SOURCES := $(shell find patchkit patches tests examples benchmarks tools -name '*.py' 2>/dev/null)
$(VENV)/.bytecode: $(BIN)/.installed $(PY_SOURCES)
	$(BIN)/python -m compileall -q patchkit patches tests examples benchmarks tools
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q --collect-only -p no:cacheprovider tests > /dev/null
	touch $@

bytecode: $(VENV)/.bytecode

demo: setup
	$(BIN)/python examples/demo.py

# The suite on both cores (pytest-xdist, idle workers take queued tests: the slow ones do not pile up at the end);
# PYTEST_ARGS="-n 0" runs it in one process. `make test` is the default run (about 7 minutes): everything but the
# tests marked heavy, which start Python processes (the launcher, torchrun, scripts, benchmarks) or torch.compile a
# model; `make test-heavy` runs those (about 12 minutes), and CI runs both.
PYTEST_ARGS ?= -n 2 --dist worksteal
SUITE := --ignore=tests/test_census.py --ignore=tests/test_trl_families.py --ignore=tests/test_self_check_census.py \
	--ignore=tests/test_wrapper_census.py --ignore=tests/test_task_head_census.py --ignore=tests/test_gpu_truth.py \
	--ignore=tests/test_continuous_batching_census.py
test: setup bytecode
	$(BIN)/ruff check patchkit patches tests examples benchmarks tools
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) --durations=15 -m "not heavy" $(SUITE)

test-heavy: setup bytecode
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) --durations=15 -m heavy $(SUITE)

# A user's install: `pip install <clone>` (not editable) into a fresh venv beside the clone, with whatever transformers
# pip resolves (the newest), then the demo and `patchkit verify` run from outside the clone, as a user runs them.
FRESH_DIR := .fresh
fresh-install:
	rm -rf $(FRESH_DIR) && $(PYTHON) -m venv $(FRESH_DIR)
	$(FRESH_DIR)/bin/pip install -q "$(TORCH)"
	$(FRESH_DIR)/bin/pip install -q .
	cd /tmp && $(CURDIR)/$(FRESH_DIR)/bin/python $(CURDIR)/examples/demo.py
	cd /tmp && $(CURDIR)/$(FRESH_DIR)/bin/patchkit verify

# The docs site: README's pages under docs/ (mkdocs.yml), built strict (a broken link or nav entry fails) into
# site/ (git-ignored). mkdocs comes from the `docs` extra, installed into the venv once.
$(VENV)/.docs-installed: $(BIN)/.installed
	$(BIN)/pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	$(BIN)/python -m mkdocs build --strict --site-dir site

# The census: every causal LM of the pinned transformers, tiny, against its own eager attention every way in
# (tests/test_census.py; `python tests/census.py` prints the table), and TRL's SFTTrainer on the families served
# from data (tests/test_trl_families.py), and every served family's self-check on its default, checkpoint-sized config
# (tests/test_self_check_census.py), and every multimodal model around a language model, on text through
# apply_patch(model=...) (tests/test_wrapper_census.py), and every served family's task heads (sequence and token
# classification, question answering: tests/test_task_head_census.py), and every served family's continuous batching
# (`generate_batch()`: tests/test_continuous_batching_census.py). Its own part of CI: about 4 minutes.
CENSUS_TESTS := tests/test_census.py tests/test_trl_families.py tests/test_self_check_census.py \
	tests/test_wrapper_census.py tests/test_task_head_census.py tests/test_continuous_batching_census.py
census: setup bytecode
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) $(CENSUS_TESTS)

lint: setup
	$(BIN)/ruff check patchkit patches tests examples benchmarks tools

# The transformers version matrix (slow: one install per version); see tests/matrix.py.
matrix: setup bytecode
	$(BIN)/python tests/matrix.py -- $(PYTEST_ARGS)

# The newest transformers release on the package index now, installed beside the venv like a matrix version, under
# the tests that touch every family and every way in (train steps padded and packed, generate into each cache kind,
# the registered name, the launcher and env var, the self-check); nothing to run when it is the pinned version.
NEWEST_TESTS := tests/test_every_family.py tests/test_families.py tests/test_generation.py tests/test_static_cache.py \
	tests/test_packing.py tests/test_model_unpad.py tests/test_attention_interface.py tests/test_launch.py \
	tests/test_self_check.py tests/test_step_aside.py tests/test_peft.py \
	tests/test_continuous_batching.py $(CENSUS_TESTS)
newest: setup bytecode
	$(BIN)/python tests/matrix.py --versions newest --tests $(NEWEST_TESTS) -- $(PYTEST_ARGS)

# DeepSpeed Ulysses sequence parallelism on two gloo ranks (tests/test_sequence_parallel.py). DeepSpeed is an sdist:
# built against the venv's torch (no build isolation, so no other torch is pulled), into .sp/ beside the venv, not
# into it; its JIT comm op (first run, ~40 s) needs a C++ compiler and the ninja installed there.
SP_DIR := .sp
DEEPSPEED ?= deepspeed==0.19.8
$(SP_DIR)/.installed: $(BIN)/.installed
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --target $(SP_DIR) --no-deps --no-build-isolation \
		"$(DEEPSPEED)" \
		einops hjson msgpack ninja py-cpuinfo
	touch $@

sp-test: $(SP_DIR)/.installed bytecode
	PYTHONPATH=$(CURDIR)/$(SP_DIR) PATH=$(CURDIR)/$(SP_DIR)/bin:$$PATH $(BIN)/python -m pytest -q $(PYTEST_ARGS) \
		tests/test_sequence_parallel.py tests/test_deepspeed_zero.py

# Another torch release under the default suite, in .torch-check/ beside the venv: `make torch-check` (the newest,
# 2.15.0), `TORCH_CHECK=torch==2.6.0` (transformers 5's floor), `TORCH_CHECK_MARKS=heavy` for the compiled and
# multi-process tests. PyPI's Linux builds are CUDA builds (several GB; they run on the CPU), so it is not a CI part
# (the install alone takes ~5 minutes). This machine caps pip at torch 2.14.1 (/etc/xdg/pip): lifted for this venv.
TORCH_CHECK ?= torch==2.15.0
TORCH_CHECK_MARKS ?= not heavy
TORCH_CHECK_DIR := .torch-check
torch-check:
	rm -rf $(TORCH_CHECK_DIR) && $(PYTHON) -m venv $(TORCH_CHECK_DIR)
	PIP_CONSTRAINT=/dev/null $(TORCH_CHECK_DIR)/bin/pip install -q "$(TORCH_CHECK)"
	PIP_CONSTRAINT=/dev/null $(TORCH_CHECK_DIR)/bin/pip install -q "$(TRANSFORMERS)" -e ".[test]"
	$(TORCH_CHECK_DIR)/bin/python -m pytest -q $(PYTEST_ARGS) -p no:cacheprovider -m "$(TORCH_CHECK_MARKS)" $(SUITE)

bench: setup
	$(BIN)/patchkit bench

# Every test marked gpu (flash_attn and torch_varlen against eager and sdpa, bf16), flash-attn from a wheel where one
# exists, one summary line; exits 0 with a line saying why on a machine without CUDA. See tests/run_gpu.py.
gpu-test: setup
	$(BIN)/python tests/run_gpu.py

# A lent GPU's one run (tools/gpu_truth.py): flash-attn built from the carried sdist beside the gpu tests, then the
# CUDA benchmarks, each part inside its time budget; summary.md, log.txt and truth.tar.gz under $$OUT (else
# gpu-truth-out/). The GPU machine has no .venv and no network: its own python3 runs it, the wheels in .gpu/ carried.
# Without CUDA it rehearses every part in its smallest CPU form (GPU_TRUTH_ARGS=--dry-run forces that).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-truth:
	$(GPU_PYTHON) tools/gpu_truth.py $(GPU_TRUTH_ARGS)

# The device call before it (.gpu1/ carried): the first part of flash-attn 4's DSL wheel left in /tmp, the flash-attn
# build started; `python tools/gpu_truth.py --fetch` fills .gpu1/ and .gpu/ and prints both calls.
gpu-truth-stage1:
	$(GPU_PYTHON) tools/gpu_truth.py --stage 1

# Its CPU side (a CI part, ~1 min): every benchmark command of the GPU run accepted by its script, the test parts
# rehearsed, the summary and archive written (tests/test_gpu_truth.py).
gpu-truth-check: setup bytecode
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) tests/test_gpu_truth.py

clean:
	rm -rf $(VENV) $(SP_DIR) $(FRESH_DIR) $(TORCH_CHECK_DIR) gpu-truth-out site *.egg-info .pytest_cache .ruff_cache
