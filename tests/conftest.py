"""Shared fixtures: every test starts and ends with transformers' LLaMA objects unpatched."""

from __future__ import annotations

import importlib
import os

# A PATCHKIT_FLASH_ATTN exported in the caller's shell would make the startup hook patch every LLaMA model the
# moment the tests import transformers' LLaMA; the tests apply and revert patches themselves.
os.environ.pop("PATCHKIT_FLASH_ATTN", None)

import pytest  # noqa: E402

import patchkit  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
    """Hypothesis profiles (tests/test_property.py): few derandomized examples for CI, many random with --runslow."""
    try:
        from hypothesis import settings
    except ImportError:  # hypothesis is a test extra; test_property.py is skipped without it
        return
    settings.register_profile("patchkit", max_examples=200, deadline=None, derandomize=True, database=None)
    settings.register_profile("patchkit-slow", max_examples=1000, deadline=None, database=None, print_blob=True)
    settings.load_profile("patchkit-slow" if config.getoption("--runslow") else "patchkit")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _targets() -> dict[str, object]:
    """Every object a LLaMA patch of any transformers era replaces (what this version has of them)."""
    mod = importlib.import_module("transformers.models.llama.modeling_llama")
    found: dict[str, object] = {}
    for cls_name, attrs in (("LlamaAttention", ["forward"]), ("LlamaSdpaAttention", ["forward"]),
                            ("LlamaFlashAttention2", ["forward"]), ("LlamaForCausalLM", ["forward"]),
                            ("LlamaModel", ["forward", "_update_causal_mask", "_prepare_decoder_attention_mask"])):
        cls = getattr(mod, cls_name, None)
        for attr in attrs:
            if cls is not None and attr in vars(cls):
                found[f"{cls_name}.{attr}"] = vars(cls)[attr]
    builders = ("create_causal_mask", "_prepare_4d_causal_attention_mask", "_prepare_4d_causal_attention_mask_for_sdpa")
    for name in builders:
        if hasattr(mod, name):
            found[name] = getattr(mod, name)
    utils = importlib.import_module("transformers.modeling_utils").PreTrainedModel
    for name in ("_check_and_adjust_attn_implementation", "_check_and_enable_flash_attn_2", "post_init"):
        if name in vars(utils):
            found[name] = vars(utils)[name]
    return found


@pytest.fixture(autouse=True)
def clean_patches():
    """Revert whatever a test applied and check the original objects are back (identity)."""
    before = _targets()
    yield
    patchkit.revert_patch()
    after = _targets()
    assert all(after[k] is before[k] for k in before), "a test left LLaMA objects patched"
