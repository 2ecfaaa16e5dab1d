"""ring-flash-attn (axolotl's context_parallel_size) makes only transformers' flash_attention_2 ring attention: a
patched model under it is refused by name, never run shard-local; an unpatched one is untouched.

The test double is a `ring_flash_attn` package in sys.modules whose `substitute_hf_flash_attn` replaces what the real
one (zhuzilin/ring-flash-attention, ring_flash_attn/adapters/hf_adapter.py) replaces:
`transformers.modeling_flash_attention_utils._flash_attention_forward` (by a lambda of its adapter that runs ring
attention while `RING_ATTN_SWITCH` is on) and `ALL_ATTENTION_FUNCTIONS["flash_attention_2"]` (its
`flash_attention_forward`). axolotl's batch ring substitution puts its own function in the first place instead.
"""

from __future__ import annotations

import sys
import types
import warnings

import models
import pytest
import torch
import transformers.modeling_flash_attention_utils as fa_utils
from families import any_model
from models import padded_batch
from transformers import LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import patchkit
from patchkit import PatchInputError
from patchkit.hooks.parallel.sequence_parallel import ring_flash_attn_active

FLASH = "flash_attention_2"
MISSING = object()
REFUSAL = r"ring-flash-attn is active .* within each rank's shard.*unpatched.*DeepSpeed Ulysses"

# The adapter's part that touches transformers, as ring-flash-attn 0.1.7 writes it; its ring kernel never computes.
ADAPTER_SOURCE = '''
import transformers
import transformers.modeling_flash_attention_utils
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

RING_ATTN_SWITCH = True
RING_CALLS = []


def use_ring_attn(flag):
    global RING_ATTN_SWITCH
    RING_ATTN_SWITCH = flag


def create_ring_flash_attention_forward(process_group, heads_k_stride):
    def _flash_attention_forward(*args, **kwargs):
        RING_CALLS.append(args[0].shape)
        raise RuntimeError("the test double's ring attention does not compute")
    return [_flash_attention_forward]


def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, **kwargs):
    kwargs.pop("is_causal", None)
    out = transformers.modeling_flash_attention_utils._flash_attention_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attention_mask,
        query_length=query.shape[2], is_causal=module.is_causal, dropout=dropout, softmax_scale=scaling,
        sliding_window=sliding_window, softcap=softcap, **kwargs)
    return out, None


def substitute_hf_flash_attn(process_group, heads_k_stride):
    old_flash_attention_forward = transformers.modeling_flash_attention_utils._flash_attention_forward
    new_flash_attention_forward = create_ring_flash_attention_forward(process_group, heads_k_stride)[0]
    transformers.modeling_flash_attention_utils._flash_attention_forward = (
        lambda *args, **kwargs: (
            new_flash_attention_forward(*args, **kwargs)
            if RING_ATTN_SWITCH
            else old_flash_attention_forward(*args, **kwargs)
        )
    )
    if ALL_ATTENTION_FUNCTIONS is not None:
        ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = flash_attention_forward
'''


def fake_ring_flash_attn() -> types.ModuleType:
    """`ring_flash_attn`, `.adapters` and `.adapters.hf_adapter` in sys.modules; returns the adapter."""
    package, adapters = types.ModuleType("ring_flash_attn"), types.ModuleType("ring_flash_attn.adapters")
    adapter = types.ModuleType("ring_flash_attn.adapters.hf_adapter")
    exec(compile(ADAPTER_SOURCE, "<ring_flash_attn/adapters/hf_adapter.py>", "exec"), vars(adapter))
    for module in (adapters, package):
        module.substitute_hf_flash_attn = adapter.substitute_hf_flash_attn
    package.adapters, adapters.hf_adapter = adapters, adapter
    sys.modules.update({m.__name__: m for m in (package, adapters, adapter)})
    return adapter


def axolotl_batch_ring(adapter: types.ModuleType) -> None:
    """axolotl's `adapters.batch.substitute_hf_flash_attn`: its own function in transformers' module, and the
    adapter's `flash_attention_forward` under flash_attention_2."""

    def _flash_attention_forward(*args, **kwargs):
        raise RuntimeError("the test double's batch ring attention does not compute")

    fa_utils._flash_attention_forward = _flash_attention_forward
    ALL_ATTENTION_FUNCTIONS[FLASH] = adapter.flash_attention_forward


@pytest.fixture
def ring():
    """A substituting test double; afterwards transformers' objects and sys.modules are as they were."""
    local = getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", ALL_ATTENTION_FUNCTIONS)  # a plain dict < 4.50
    saved_entry, saved_forward = local.get(FLASH, MISSING), fa_utils._flash_attention_forward
    saved_global = ALL_ATTENTION_FUNCTIONS.get(FLASH)
    try:
        yield fake_ring_flash_attn()
    finally:
        for name in ("ring_flash_attn.adapters.hf_adapter", "ring_flash_attn.adapters", "ring_flash_attn"):
            sys.modules.pop(name, None)
        fa_utils._flash_attention_forward = saved_forward
        if saved_entry is MISSING:
            local.pop(FLASH, None)
        else:
            local[FLASH] = saved_entry
    assert fa_utils._flash_attention_forward is saved_forward
    assert ALL_ATTENTION_FUNCTIONS.get(FLASH) is saved_global
    assert not ring_flash_attn_active()


def logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("substitution", ["ring_flash_attn", "axolotl_batch_ring"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_patched_model_under_ring_flash_attn_is_refused_by_name(family, substitution, ring):
    model = any_model(family, "sdpa")
    ids, mask = padded_batch("right")
    want = logits(model, ids, mask)
    assert not ring_flash_attn_active()  # imported, not substituted: nothing to refuse
    if substitution == "ring_flash_attn":
        ring.substitute_hf_flash_attn(process_group=None, heads_k_stride=1)
    else:
        axolotl_batch_ring(ring)
    assert ring_flash_attn_active()
    assert torch.equal(logits(model, ids, mask), want)  # unpatched: untouched
    with patchkit.apply_patch(family, backend="sdpa") as handle:
        with pytest.raises(PatchInputError, match=REFUSAL):
            logits(model, ids, mask)
        assert handle.calls == 0
    assert torch.equal(logits(model, ids, mask), want)  # reverted: untouched again
    assert ring.RING_CALLS == []


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_ring_attention_switched_off_serves_the_patched_model(family, ring):
    # use_ring_attn(False): flash_attention_2 runs transformers' own local attention again, so patchkit's does too
    model = any_model(family, "sdpa")
    ids, mask = padded_batch("right")
    want = logits(model, ids, mask)
    ring.substitute_hf_flash_attn(process_group=None, heads_k_stride=1)
    ring.use_ring_attn(False)
    assert not ring_flash_attn_active()
    with patchkit.apply_patch(family, backend="sdpa") as handle:
        got = logits(model, ids, mask)
        assert handle.calls > 0
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=3e-5, rtol=1e-4)
    ring.use_ring_attn(True)
    assert ring_flash_attn_active()


def test_a_flash_attention_2_request_served_by_the_class_patch_is_refused(ring):
    # the training script's model asks for flash_attention_2, which the class patch serves (on a machine without
    # flash-attn by loading it under patchkit's name, with it by routing every layer to that name): either way it
    # would go round the ring, so its forward is refused
    ids, mask = padded_batch("right")
    ring.substitute_hf_flash_attn(process_group=None, heads_k_stride=1)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        config = models.tiny_config()
        config._attn_implementation = FLASH
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flash_request's "served by patchkit" note where flash-attn is absent
            model = LlamaForCausalLM(config).eval()
        with pytest.raises(PatchInputError, match=REFUSAL):
            logits(model, ids, mask)
        assert handle.calls == 0
    assert ring.RING_CALLS == []


def test_a_model_loaded_with_the_patchkit_name_under_ring_flash_attn_is_refused_by_name(ring):
    # no class patch, no route: axolotl shards the sequence for ring attention, and the registered attention itself
    # refuses rather than attend within the shard
    model = any_model("llama", "sdpa")
    ids, mask = padded_batch("right")
    want = logits(model, ids, mask)
    model.set_attn_implementation("patchkit")
    ring.substitute_hf_flash_attn(process_group=None, heads_k_stride=1)
    with pytest.raises(PatchInputError, match=REFUSAL):
        logits(model, ids, mask)
    ring.use_ring_attn(False)
    got = logits(model, ids, mask)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=3e-5, rtol=1e-4)
    assert ring.RING_CALLS == []
