"""Every family the census verifies, on each kernel backend (through the recording doubles, `fakes.py`).

The census runs patchkit's exact sdpa backend, which reads no head size and takes every shape; the kernel backends
read the layer's head size for their gate and take one head size for queries, keys and values. DeepSeek's latent
attention (no `head_dim`) and Gemma 4's per-layer head sizes (a config that refuses a global read) crashed there
only. Here each family runs a bf16 training step and left-padded greedy generation (dynamic and static caches) on
flash-attn 2, flash-attn 4 and torch's varlen_attn, every call held to the kernel's contract by its double, with the
numbers of patchkit's exact backend.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from census import causal_lm_types
from fakes import install_flash_double, install_torch_varlen_double
from families import served_tiny
from flash4_stand_in import install_flash4_double
from models import clone, labels_for, padded_batch

import patchkit
from patches import table
from patchkit.backends import SdpaBackend

# a left-padded forward of DeepSeek-V4 steps aside (its compressors pool padding: `padding_into_mixer`), and so would
# this test's whole run; its kernel path: `test_compressed_attention.py`
FAMILIES = sorted(set(causal_lm_types()) & set(table.VERIFIED) - table.PADDING_INTO_MIXERS)


def run(model, ids, mask, left, left_mask, **patch) -> tuple:
    """Under `apply_patch(model=model, **patch)`: the eval logits, the training step's loss and gradients, and the
    greedy tokens of a left-padded batch into a dynamic and a static cache; with the patch's handle and the warnings
    patchkit gave."""
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as said, patchkit.apply_patch(model=model, **patch) as handle:
        warnings.simplefilter("always")
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask), use_cache=False).loss
        loss.backward()
        model.eval()
        with torch.no_grad():
            tokens = torch.cat([model.generate(input_ids=left, attention_mask=left_mask, max_new_tokens=2,
                                               do_sample=False, pad_token_id=0, cache_implementation=cache)
                                for cache in (None, "static")])
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return (logits, loss.detach().float(), grads, tokens), handle, [str(w.message) for w in said]


class Doubles:
    """Several installed doubles as one: `calls` are all of theirs."""

    def __init__(self, *doubles) -> None:
        self.doubles = doubles

    @property
    def calls(self) -> list:
        return [call for double in self.doubles for call in double.calls]


def flash4_and_flash2(monkeypatch) -> Doubles:
    """An H100 with flash-attn 4 and flash-attn 2 installed: flash-attn 4 first, flash-attn 2 where its gates fail
    (a head size that is not a multiple of 8)."""
    flash2 = install_flash_double(monkeypatch)
    return Doubles(install_flash4_double(monkeypatch, (9, 0)), flash2)


DOUBLES = {"flash_attn": install_flash_double, "flash_attn_4": flash4_and_flash2,
           "torch_varlen": install_torch_varlen_double}
GATED = ("use the sdpa backend instead", "exact sdpa backend")  # said where layers, or the model, run on the exact
# backend: a head size, softcap or window the kernel does not take, attention sinks


BF16_EPS = torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("backend", sorted(DOUBLES))
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_verified_family_trains_and_generates_on_the_kernels(model_type, backend, monkeypatch):
    """The kernel path (its head size, layout, casts and decode kernel) gives the numbers of patchkit's exact sdpa
    backend on the same bf16 model, which the census holds to transformers' own: the flash-attn doubles compute what
    the kernel computes with that backend, so they agree to the bit. torch's varlen double rounds a windowed layer its
    own way (an explicit window): there the numbers are held as close to fp32 as the exact backend's bf16 ones. A
    layer the kernel's gates turn away runs on the exact backend, said."""
    # the exact backend's decode steps as the kernels' are: MLA's values padded to the keys' width (the sdpa backend
    # alone takes them as they are, `attend.one_head_size`, rounding bf16 otherwise; the census holds that to fp32)
    monkeypatch.setattr(SdpaBackend, "values_apart", False)
    model = served_tiny(model_type)
    truth = clone(model) if backend == "torch_varlen" else None
    model = model.to(torch.bfloat16)
    ids, mask = padded_batch("mixed", batch=3, seq=16)
    ids = ids.clamp(max=model.config.vocab_size - 1)
    left, left_mask = padded_batch("left", batch=3, seq=16)
    left = left.clamp(max=model.config.vocab_size - 1)
    want, _, _ = run(model, ids, mask, left, left_mask, backend="sdpa")
    fp32 = None if truth is None else run(truth, ids, mask, left, left_mask, backend="sdpa")[0]
    fake = DOUBLES[backend](monkeypatch)
    got, handle, said = run(model, ids, mask, left, left_mask)
    assert handle.calls and handle.backend in (backend, "flash_attn", "sdpa")
    assert fake.calls or any(why in text for why in GATED for text in said), "no kernel call, and no gate said why"
    real = mask.bool()
    if fp32 is None:  # bit for bit the exact backend's logits; its loss and gradients to rounding
        torch.testing.assert_close(got[0][real], want[0][real], atol=0, rtol=0)
        torch.testing.assert_close(got[1], want[1])
        assert got[2].keys() == want[2].keys()
        for name in want[2]:
            torch.testing.assert_close(got[2][name], want[2][name], msg=name)
        assert torch.equal(got[3], want[3])
        return
    # as close to fp32 as the exact backend's bf16 numbers (the logits, the loss, each gradient as a whole), or within
    # bf16's own precision of it (one eps of its size: a gradient near zero, as a linear attention's dt_bias at 7e-6,
    # rounds by a CPU's bf16 kernels, AVX2 or AVX-512, 0.2-0.5% off fp32 on either backend)
    pairs = [(got[0][real], want[0][real], fp32[0][real], "logits"), (got[1], want[1], fp32[1], "loss")]
    pairs += [(got[2][n], want[2][n], fp32[2][n], n) for n in want[2]]
    assert got[2].keys() == want[2].keys()
    for ours, exact, ref, name in pairs:
        off, bound = (ours - ref).norm(), 2 * (exact - ref).norm() + BF16_EPS * ref.norm()
        assert off <= bound, f"{name}: {off:.3g} off fp32, the exact backend's bf16 {bound / 2:.3g}"
