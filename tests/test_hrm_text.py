"""HRM-Text: one stack's layers run many times a forward, a cache slot for each, and a prefix-LM block on token types.

transformers' own modeling tests found it (docs/testing.md): the family's self-check cut its config to 2 layers while
`num_layers_per_stack * H_cycles * (L_cycles + 1)` still asked for 16 cache slots, so the check's tiny model failed
unpatched, the family stepped aside everywhere, and a padding-free batch (position_ids restarting, no mask) was
refused although transformers runs it exactly.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import patchkit
from patchkit.hooks.decide import self_check

pytestmark = pytest.mark.skipif(not hasattr(transformers, "HrmTextConfig"), reason="HRM-Text: transformers 5.2x")


def hrm(prefix_lm: bool = False, seed: int = 0) -> torch.nn.Module:
    """transformers' own test config (CausalLMModelTester's sizes): 2 layers a stack, H_cycles 2, L_cycles 3."""
    torch.manual_seed(seed)
    config = transformers.HrmTextConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=37, prefix_lm=prefix_lm,
                                        pad_token_id=0)
    return transformers.HrmTextForCausalLM(config).eval()


def test_the_self_check_runs_a_config_whose_fields_fix_its_depth():
    """16 cache slots from 2 layers a stack: the check keeps every layer where 2 would not run, and passes."""
    model = hrm()
    assert model.config.num_hidden_layers == 16
    verdict = self_check.check_family(type(model.model), model.config, torch.device("cpu"), torch.float32, None)
    assert verdict is None


def test_a_padding_free_batch_equals_unpatched():
    """Packed documents (position_ids restarting, no mask, no cache): transformers' test
    `test_sdpa_padding_matches_padding_free_with_position_ids`, refused under the patch before."""
    model = hrm()
    ids = torch.randint(3, 99, (1, 15), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([list(range(6)) + list(range(9))])
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            assert handle.calls > 0 and not handle.stepped_aside
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_a_prefix_lm_block_runs_patched_and_equals_unpatched():
    """token_type_ids == 1 form one bidirectional block (`block_sequence_ids`), read from the block ids its mask
    function ORs into causal (`hooks/name/named_blocks.py`) and served by the block pass; before, each such forward
    stepped aside (custom_mask_pattern). Without token types the same model runs patched causally."""
    model = hrm(prefix_lm=True)
    ids = torch.randint(3, 99, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    types = torch.zeros(2, 12, dtype=torch.long)
    types[0, :5], types[1, 4:8] = 1, 1
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        want_causal = model(input_ids=ids, attention_mask=mask).logits
        with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
            got = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
            assert handle.stepped_aside == {} and handle.calls == 16
            got_causal = model(input_ids=ids, attention_mask=mask).logits
            assert handle.calls == 32
    real = mask.bool()
    assert (want - want_causal)[real].abs().max() > 1e-4  # the block changes the numbers
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_causal[real], want_causal[real], atol=2e-5, rtol=1e-4)
