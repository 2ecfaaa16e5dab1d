"""What the version matrix runs: which transformers versions, which test files on each, what each installs beside.

Read by tests/matrix.py (which installs and runs them) and pinned by tests/test_matrix.py.
"""

from __future__ import annotations

import datetime
from typing import Optional

from packaging.version import Version

# One version per era boundary of transformers>=4.31,<6 (see patchkit/eras/__init__.py and transformers-eras.md):
# 4.31 tuple cache, _prepare_decoder_attention_mask; 4.34 padding_mask, FA2 class; 4.35 module-level 4D helper;
# 4.36 per-layer attention classes, Cache; 4.40 _update_causal_mask, rotary by position_ids; 4.46 position_embeddings;
# 4.48 first single attention class (to 4.52, the last _update_causal_mask: `--versions 4.52.4`); 4.53
# create_causal_mask;
# 4.56 past_key_values + layered DynamicCache (4.57, the last 4.x, has them: `--versions 4.56.2` runs 4.56 itself);
# 5.23 the last that names the cache past_key_values
# (5.24 renames it cache), the end of the 5.x era that began with 5.0 (`--versions 5.0.0` runs its start); 5.24 the
# first named `cache`, and the last whose hybrid caches count their past at the first attention layer (5.25 reads
# layer 0, recurrent or not: `patchkit/forward/cache_length.py`). The pinned version (5.25) is not here: make test and
# test-heavy run it whole. Inside the 4.36-4.47 era the legacy patch meets
# `_update_causal_mask`'s changing signature (4.38, 4.39, 4.40, 4.41): 4.37.2 (LLaVA's pin: LlamaSdpaAttention by
# default, before it) and 4.38.2 run too (about 20 s each, install included); 4.39 and 4.41 are in ROTATING.
DEFAULT_VERSIONS = ["4.31.0", "4.34.1", "4.35.2", "4.36.2", "4.37.2", "4.38.2", "4.40.2", "4.46.3", "4.48.3",
                    "4.53.3", "4.57.6", "5.23.0", "5.24.0"]
# The minors between those, in turn: each run of `make matrix` adds one, picked by the UTC date (the day's ordinal
# modulo the pool), so that a release users pin between two boundaries is run within a few weeks of CI at one
# version's cost a run (a version before 4.48 about 20 s, one from 4.48 about 60 s). Each passed its tier when it
# joined (2026-12-02) and all again on 2026-12-07; `python tests/matrix.py --versions X` runs any of them now
# (`--versions rotating`: all eleven). Not here yet, for what their own
# modeling does there: 5.0.0 (the census builds no tiny model of 7 families from its configs; OPT, Persimmon and
# Bamba build 4D masks there, which patchkit steps aside for, exactly), 5.5.4 and 5.10.4 (a chunk behind a cache in
# Falcon-H1 and Zamba2: transformers' own continuation is 8e-4 and 0.3 off its full forward, patchkit's 8.6e-5 off
# that; MiniMax 3.1e-5 against the 2e-5 allowed; DBRX's tiny model is over the census's size).
ROTATING = ["4.32.1", "4.39.3", "4.41.2", "4.43.4", "4.45.2", "4.47.1", "4.50.3", "4.52.4", "4.55.4", "5.16.1",
            "5.20.2"]


def rotating_minor(day: Optional[datetime.date] = None) -> str:
    """The minor of ROTATING that the matrix adds on `day` (default: today, UTC)."""
    day = day or datetime.datetime.now(datetime.timezone.utc).date()
    return ROTATING[day.toordinal() % len(ROTATING)]


def default_versions(day: Optional[datetime.date] = None) -> list[str]:
    """What `make matrix` runs on `day`: every boundary of DEFAULT_VERSIONS and that day's rotating minor, in order."""
    return sorted([*DEFAULT_VERSIONS, rotating_minor(day)], key=Version)
# Before 4.48 only the LLaMA patches exist, and the suite's other files use newer transformers APIs: the era tests
# (padded logits and gradients, generation with a cache, GQA, packed rows, instance patches, the FastChat-era
# Trainer script under the launcher) run there. From 4.48 the core test files run too.
LEGACY_TESTS = ["tests/test_eras.py"]
LEGACY_BEFORE = "4.48"
# Trainer on transformers < 4.48 needs an accelerate (and a peft, which transformers imports when present) of its
# era: today's releases import names those transformers lack. Installed without dependencies into the target dir.
LEGACY_EXTRAS = ["accelerate==0.27.2", "peft==0.7.1"]
# TRL (a test extra) brings today's datasets into the venv, which imports names huggingface_hub has only from 1.0:
# transformers 4.x's Trainer imports datasets when present, so its era's huggingface_hub gets a datasets it can load.
HUB_1_FROM = "5.0"
ERA_DATASETS = ["datasets==4.0.0"]


def era_extras(version: str) -> list[str]:
    """What a transformers version's target dir needs beside it, installed without dependencies."""
    extras = LEGACY_EXTRAS if Version(version) < Version(LEGACY_BEFORE) else []
    return extras + (ERA_DATASETS if Version(version) < Version(HUB_1_FROM) else [])
# What differs by era, in tiers, so that every era is covered inside CI's time: every version from 4.48 runs CORE
# (every family's padded training step, packed rows and generate() into each cache kind: how each family's modeling
# code builds masks, passes kwargs and fills caches); the last 4.x also runs the rest of what touches transformers
# (every cause of stepping aside, the registered name, the patches' mechanics, decode, the vision-language models,
# PEFT, tuple outputs, the ways a model asks for flash attention, the Trainer's steps that read the loss alone), and
# 4.48.3 gradient checkpointing (4.48-4.51 call checkpointed layers without their kwargs). The pinned version
# (make test, make test-heavy) runs everything, torch.compile included.
CORE_TESTS = [
    "tests/test_eras.py",
    "tests/test_every_family.py",
    "tests/test_families.py",
    "tests/test_generation.py",
    "tests/test_static_cache.py",
    "tests/test_packing.py",
    "tests/test_model_unpad.py",
    "tests/test_mllama.py",  # from 5.0: cross-attention layers and their cache layers, renamed and reshaped by release
    "tests/test_continuous_batching.py",  # 5.x: who updates the paged cache (the layers from 5.24) decides the path
]
ERA_TESTS = CORE_TESTS + [
    "tests/test_equivalence.py",
    "tests/test_decode.py",
    "tests/test_training_loops.py",
    "tests/test_tuple_outputs.py",
    "tests/test_mechanics.py",
    "tests/test_gates.py",
    "tests/test_dtypes.py",
    "tests/test_attention_interface.py",
    "tests/test_named.py",
    "tests/test_step_aside.py",
    "tests/test_never_silent_inputs.py",
    "tests/test_never_silent_patching.py",
    "tests/test_never_silent_generation.py",
    "tests/test_vision_language.py",
    "tests/test_qwen_vl.py",
    "tests/test_flash_request.py",
    "tests/test_flash_attention_2_loaded.py",
    "tests/test_flash_attention_3_loaded.py",
    "tests/test_peft.py",
    "tests/test_context_parallel.py",
    "tests/test_ulysses_padding.py",
    "tests/test_trainer_loss_alone.py",
]
ERA_VERSIONS = ("4.57.6",)
EXTRA_TESTS = {"4.48.3": ["tests/test_checkpointing.py"]}
DEFAULT_TESTS = ERA_TESTS + ["tests/test_checkpointing.py"]
# The families file's one slow group, which the pinned run keeps: generate() of every family on either padding in
# either unpad mode (84 cases, 5.24's own check; every version generates left-padded across a window, every family;
# measured on 4.57.6 with the era files: 427 s a version).
CORE_DESELECTED = ["--deselect",
                   "tests/test_families.py::test_generate_on_either_padding_in_either_unpad_mode_equals_unpatched"]
# Before 4.48 the era tests' FastChat-era Trainer script under the launcher (two fresh interpreters, half of such a
# version's time) runs on FastChat's own era.
FASTCHAT_TEST = "tests/test_eras.py::test_a_fastchat_era_trainer_script_under_the_launcher_trains_like_unpatched"
FASTCHAT_VERSIONS = ("4.31.0",)
# Not in the matrix, run once on the pinned version (make test, make test-heavy): what does not touch transformers'
# modeling code (the backends and their contracts, property tests of the kernels, patchkit's tools: doctor, verify,
# the CLI, benchmarks, examples, the launcher and the startup hook), the self-check (of a release newer than CI's),
# and the frameworks' own tests (TRL, FSDP, torchrun), which need today's transformers.


# Before 4.48 a version's era tests take about 6 s of pytest's time: a second worker costs more to start (a fresh
# interpreter importing torch and transformers, ~8 s here) than it saves, so those versions run in one process
# (measured on 4.37.2: 29.4 s wall with `-n 2`, 23.1 s with `-n 0`, the import probe included).
ONE_PROCESS = ["-n", "0"]


def workers_for(version: str, tests: list[str]) -> list[str]:
    """pytest arguments appended after the caller's (the last `-n` wins): one process for the era tests alone."""
    return ONE_PROCESS if tests == DEFAULT_TESTS and Version(version) < Version(LEGACY_BEFORE) else []


def tests_for(version: str, tests: list[str]) -> list[str]:
    """The tests a version runs (files, and `--deselect`ed cases): a list given with --tests, whole; else the era
    tests before 4.48 (the FastChat script on FASTCHAT_VERSIONS), and the tiers from 4.48."""
    if tests != DEFAULT_TESTS:
        return tests
    if Version(version) < Version(LEGACY_BEFORE):
        return LEGACY_TESTS + ([] if version in FASTCHAT_VERSIONS else ["--deselect", FASTCHAT_TEST])
    chosen = ERA_TESTS if version in ERA_VERSIONS else CORE_TESTS
    return chosen + EXTRA_TESTS.get(version, []) + CORE_DESELECTED
