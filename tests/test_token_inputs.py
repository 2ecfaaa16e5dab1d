"""Per-token inputs beside the tokens (`patchkit/forward/inputs/token_inputs.py`): a padded batch that becomes one
packed row takes its token types with it, or keeps its padded layout, with unpatched numbers either way.

Before, GPT-2's `token_type_ids` stayed (B, S) while the tokens were packed: a shape error, or, where the packed
length divides B·S, logits off by about 0.5 with no warning.
"""

from __future__ import annotations

import pytest
import torch
from census import tiny_lm
from models import labels_for, padded_batch

import patchkit
from patchkit.forward.inputs.token_inputs import token_inputs
from patchkit.hooks.head import lm_head

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def lm(model_type: str) -> torch.nn.Module:
    model, why = tiny_lm(model_type)
    assert model is not None, why
    return model


def step(model: torch.nn.Module, **inputs) -> tuple:
    model.zero_grad(set_to_none=True)
    out = model(**inputs, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(got: tuple, want: tuple, mask: torch.Tensor) -> None:
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1][mask.bool()], want[1][mask.bool()], atol=2e-5, rtol=1e-4)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=2e-5, rtol=1e-3, msg=name)


def halves_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch whose real tokens are exactly half its positions: the packed length divides B·S, where GPT-2's
    `token_type_ids.view(-1, packed_length)` used to run on silently with the wrong types."""
    ids, _ = padded_batch("right", batch=4, seq=16)
    mask = torch.zeros_like(ids)
    for row, n in enumerate((16, 12, 4, 0)):
        mask[row, :n] = 1
    return ids, mask


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_bigcode"])
@pytest.mark.parametrize("layout", ["mixed", "half real", "one row of types"])
def test_token_types_are_packed_with_the_tokens(model_type, layout):
    model = lm(model_type)
    ids, mask = halves_batch() if layout == "half real" else padded_batch("mixed", batch=4, seq=16)
    ids = ids.clamp(max=model.config.vocab_size - 1)
    rows = 1 if layout == "one row of types" else ids.shape[0]
    types = torch.randint(0, 5, (rows, ids.shape[1]), generator=torch.Generator().manual_seed(2))
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask), token_type_ids=types)
    want = step(model, **inputs)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = step(model, **inputs)
        assert handle.heads == {lm_head.REAL_TOKENS: 1}  # packed at the model, head and loss on real tokens
        assert handle.calls > 0 and not handle.stepped_aside
    assert_same(got, want, mask)


def test_generate_with_token_types_gives_unpatched_tokens():
    model = lm("gpt2").eval()
    ids, mask = padded_batch("left", batch=3, seq=16)
    ids = ids.clamp(max=model.config.vocab_size - 1)
    types = torch.randint(0, 5, ids.shape, generator=torch.Generator().manual_seed(3))
    kw = dict(input_ids=ids, attention_mask=mask, token_type_ids=types, max_new_tokens=4, do_sample=False,
              pad_token_id=0)
    with torch.no_grad():
        want = model.generate(**kw)
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got = model.generate(**kw)
            assert handle.calls > 0
    torch.testing.assert_close(got, want)


def test_an_input_of_the_tokens_shape_patchkit_does_not_know_keeps_the_padded_layout():
    ids = torch.zeros(3, 8, dtype=torch.long)
    known = {"input_ids": ids, "token_type_ids": ids[:1]}
    assert [name for _, name in token_inputs(known, {}, 3, 8)] == ["input_ids", "token_type_ids"]
    assert token_inputs({"input_ids": ids}, {"segment_ids": ids}, 3, 8) is None  # unknown: cannot be placed
    assert token_inputs({"input_ids": ids, "token_type_ids": ids[:, :5]}, {}, 3, 8) is None  # not one per token
    assert token_inputs({"input_ids": ids, "pixel_values": torch.zeros(3, 3, 4, 4)}, {}, 3, 8) is not None
