"""torch.jit.trace and torch.export of a patched model: the unpatched model's numbers, on other batches too.

A trace keeps what the forward read on the host as constants: patchkit's rows' lengths would become the trace's, and
a batch of other lengths reuse them (0.43 off on Gemma 2, silently). A traced forward steps aside (`jit_trace`); an
exported one is planned as a compiled graph that may not break."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from test_lm_head import family

import patchkit

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning", "ignore::FutureWarning")


class Logits(torch.nn.Module):
    """A wrapper whose forward returns a tensor, as tracing takes it."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, attention_mask=mask, use_cache=False).logits


def batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two right-padded batches of the same shape and token count, their rows of other lengths."""
    ids = torch.randint(3, vocab, (3, 16), generator=torch.Generator().manual_seed(0))
    out = []
    for lengths in ([16, 9, 3], [16, 6, 6]):
        mask = (torch.arange(16)[None] < torch.tensor(lengths)[:, None]).long()
        out.append((ids.masked_fill(mask == 0, 0), mask))
    return out


@pytest.mark.parametrize("model_type", ["gemma2", "llama"])
def test_a_jit_trace_of_a_patched_model_gives_unpatched_numbers_on_another_batch(model_type):
    model = family(model_type).eval()
    plain = copy.deepcopy(model)
    (ids, mask), (other, other_mask) = batches(model.config.vocab_size)
    with torch.no_grad():
        want = plain(input_ids=other, attention_mask=other_mask).logits
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            traced = torch.jit.trace(Logits(model), (ids, mask), strict=False, check_trace=False)
            got = traced(other, other_mask)
            assert handle.stepped_aside == {"jit_trace": 1}
    real = other_mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


def test_a_torch_export_of_a_patched_model_gives_unpatched_numbers():
    model = family("llama").eval()
    plain = copy.deepcopy(model)
    (ids, mask), (other, other_mask) = batches(model.config.vocab_size)
    with torch.no_grad():
        want = plain(input_ids=other, attention_mask=other_mask).logits
        with patchkit.apply_patch(model=model, backend="sdpa"):
            exported = torch.export.export(Logits(model), (ids, mask)).module()
            got = exported(other, other_mask)
    real = other_mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("way", ["instance", "name"])
def test_a_torch_export_of_the_patched_model_itself_gives_unpatched_numbers(way):
    """torch.export of the causal LM itself (not a wrapper), patched on the instance or loaded under the name: torch
    reads `model.forward.__code__`, which patchkit's bound forward hid (AttributeError: __code__); it shows it now,
    as a bound method does."""
    from transformers import AutoModelForCausalLM

    model = family("llama").eval()
    plain = copy.deepcopy(model)
    if way == "name":
        config = copy.deepcopy(model.config)
        config._attn_implementation = "patchkit"
        named = AutoModelForCausalLM.from_config(config, attn_implementation="patchkit").eval()
        named.load_state_dict(model.state_dict())
        model = named
    (ids, mask), (other, other_mask) = batches(model.config.vocab_size)
    with torch.no_grad():
        want = plain(input_ids=other, attention_mask=other_mask, use_cache=False).logits
        with patchkit.apply_patch(model=model, backend="sdpa") if way == "instance" else contextlib.nullcontext():
            exported = torch.export.export(model, (ids,), {"attention_mask": mask, "use_cache": False}).module()
            got = exported(other, attention_mask=other_mask, use_cache=False).logits
    real = other_mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
