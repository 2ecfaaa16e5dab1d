"""Shared fixtures: every test starts and ends with every served family's transformers objects unpatched."""

from __future__ import annotations

import importlib
import os

# A PATCHKIT_FLASH_ATTN exported in the caller's shell would make the startup hook patch every LLaMA model the
# moment the tests import transformers' LLaMA; the tests apply and revert patches themselves.
os.environ.pop("PATCHKIT_FLASH_ATTN", None)
# Under pytest-xdist each worker has a core of its own: torch's intra-op threads (one per core in every worker)
# would contend for the same cores on the tiny ops these tests run (the census: 500 s with them, 81 s without).
# The processes the tests start inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

import patchkit  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
    """Hypothesis profiles (tests/test_property.py): few derandomized examples for CI, many random with --runslow."""
    try:
        from hypothesis import settings
    except ImportError:  # hypothesis is a test extra; test_property.py is skipped without it
        return
    # PATCHKIT_HYPOTHESIS_EXAMPLES: fewer draws per property (the version matrix, which runs them on every era)
    examples = int(os.environ.get("PATCHKIT_HYPOTHESIS_EXAMPLES", "200"))
    settings.register_profile("patchkit", max_examples=examples, deadline=None, derandomize=True, database=None)
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
    """Every object a patch of any registered family, in any transformers era, may replace (what this version has
    of them): each modeling module's module classes' forwards and mask builders, its module-level mask helpers, and
    the PreTrainedModel hooks the class patches share."""
    from torch import nn

    from patchkit.hooks.install.registry import registered

    # importing attention_interface registers the name and watches model builds for the process (`hooks/name/named.py`):
    # those wrappers stay, like the name itself
    from patchkit.hooks.name import attention_interface  # noqa: F401

    found: dict[str, object] = {}
    modules = {"transformers.models.llama.modeling_llama"}
    for spec in registered():
        try:
            modules.add(spec.attention_class().__module__)
        except (ImportError, AttributeError):  # a family this transformers does not have
            continue
    methods = ("forward", "_update_causal_mask", "_prepare_decoder_attention_mask")
    for name in sorted(modules):
        mod = importlib.import_module(name)
        for attr, obj in vars(mod).items():
            if isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == name:
                found.update({f"{name}.{attr}.{m}": vars(obj)[m] for m in methods if m in vars(obj)})
            elif attr.startswith(("create_", "_prepare_4d")) and callable(obj):
                found[f"{name}.{attr}"] = obj
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
    left = sorted(k for k in before if after.get(k) is not before[k])
    assert not left, f"a test left objects patched: {left}"
