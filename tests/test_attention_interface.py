"""attn_implementation="patchkit": a model opts in by name, padding is honoured, nothing global is patched."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from families import static_cache_served
from models import labels_for, needs_mask_interface, padded_batch, tiny_config
from transformers import LlamaConfig, LlamaForCausalLM

import patchkit
from patchkit.hooks.name import attention_interface

pytestmark = needs_mask_interface

# from_pretrained reads attn_implementation from config.json only in newer 5.x: 4.x and 5.0's from_dict overwrite it
# with the call's attn_implementation (None), and the model loads sdpa unpatched or patched alike
CONFIG_JSON_NAMED = LlamaConfig.from_dict({"attn_implementation": "eager"})._attn_implementation_internal == "eager"


@pytest.fixture(autouse=True)
def sdpa_route():
    attention_interface.register(backend="sdpa")
    yield
    attention_interface.register(backend="auto", strict=False)  # back to the import-time default


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config(kv_heads=2)).save_pretrained(tmp_path)
    return tmp_path


def logits_and_grad(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    out.loss.backward()
    return out.logits.detach(), model.lm_head.weight.grad.clone()


@pytest.mark.parametrize("route", ["from_pretrained", pytest.param("config.json", marks=pytest.mark.skipif(
    not CONFIG_JSON_NAMED, reason="this transformers (4.x, 5.0) ignores attn_implementation in config.json: "
    "PretrainedConfig.from_dict overwrites it with from_pretrained's attn_implementation argument"))])
def test_registered_name_matches_eager_on_padded_batches(saved, route):
    eager = LlamaForCausalLM.from_pretrained(saved, attn_implementation="eager")
    if route == "config.json":
        config = json.loads((saved / "config.json").read_text())
        config["attn_implementation"] = patchkit.ATTENTION_NAME
        (saved / "config.json").write_text(json.dumps(config))
        ours = LlamaForCausalLM.from_pretrained(saved)
    else:
        ours = LlamaForCausalLM.from_pretrained(saved, attn_implementation=patchkit.ATTENTION_NAME)
    assert ours.config._attn_implementation == "patchkit"
    assert "flash" not in patchkit.ATTENTION_NAME and "/" not in patchkit.ATTENTION_NAME
    ids, mask = padded_batch("mixed")
    before = attention_interface.route_state().calls
    got, got_g = logits_and_grad(ours, ids, mask)
    want, want_g = logits_and_grad(eager, ids, mask)
    assert attention_interface.route_state().calls - before == 2  # both layers went through patchkit
    assert patchkit.active_patches() == []  # no global patch
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_g, want_g, atol=2e-5, rtol=1e-3)


def test_registered_name_generates_like_eager(saved):
    eager = LlamaForCausalLM.from_pretrained(saved, attn_implementation="eager")
    ours = LlamaForCausalLM.from_pretrained(saved, attn_implementation=patchkit.ATTENTION_NAME)
    ids, mask = padded_batch("left", batch=3, seq=16)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(input_ids=ids, **kw), eager.generate(input_ids=ids, **kw))


def test_auto_route_names_the_failed_gate_when_a_model_gets_the_name(saved):
    """The route's backend is chosen (and a failed gate named) at the line that loads a model with the name, on the
    host: its first forward may be traced by dynamo, which does not run the gates' probe."""
    attention_interface.register(backend="auto")
    with pytest.warns(RuntimeWarning, match=r"sdpa backend \(not flash_attn: flash_attn_installed: FAILED"):
        ours = LlamaForCausalLM.from_pretrained(saved, attn_implementation=patchkit.ATTENTION_NAME)
    ids, mask = padded_batch("right")
    ours(input_ids=ids, attention_mask=mask)
    assert attention_interface.route_state().backend.name == "sdpa"


@needs_mask_interface
def test_static_cache_generate_under_the_registered_name_matches_eager():
    # generate() builds a static cache's mask before the model runs, through the name's mask function, and calls
    # .contiguous() on it: that call got patchkit's key-padding mask object and failed with a misleading
    # PatchStateError ("reached attention code patchkit does not own"). It now gets transformers' own mask, which
    # carries the 2D mask it was made from where the varlen path places the cache (4.56+: every step patched,
    # strict) and is stepped aside for otherwise (exact, counted)
    from transformers import StaticCache

    if not hasattr(StaticCache, "is_compileable"):
        pytest.skip("this transformers' generate() makes no 4D mask ahead for a static cache")
    served = static_cache_served("llama")
    attention_interface.register(backend="sdpa", strict=served)
    torch.manual_seed(0)
    eager = LlamaForCausalLM(tiny_config(kv_heads=2)).eval()
    named = LlamaForCausalLM(tiny_config(kv_heads=2)).eval()
    named.load_state_dict(eager.state_dict())
    named.config._attn_implementation = "patchkit"
    ids, mask = padded_batch("left")
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static",
              output_scores=True, return_dict_in_generate=True)
    want = eager.generate(ids, **kw)
    state = attention_interface.route_state()
    with contextlib.nullcontext() if served else pytest.warns(RuntimeWarning, match="4D attention mask"):
        got = named.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=1e-4, rtol=1e-4)
    assert state.calls == (10 if served else 0)  # prefill and 4 decode steps, 2 layers each
    assert state.stepped_aside == ({} if served else {"custom_4d_mask": 10})


def test_strict_refuses_labels_at_padding_under_the_name_alone_and_the_next_call_runs():
    """strict=True: a loss read at padding positions is refused by name (nothing is stepped aside); the same model's
    next call with labels at real tokens only runs patched, as eager does."""
    attention_interface.register(backend="sdpa", strict=True)
    torch.manual_seed(0)
    eager = LlamaForCausalLM(tiny_config(kv_heads=2))
    named = LlamaForCausalLM(tiny_config(kv_heads=2))
    named.load_state_dict(eager.state_dict())
    named.config._attn_implementation = "patchkit"
    ids, mask = padded_batch("right")
    with pytest.raises(patchkit.PatchkitError, match=r"strict=True\): a label is predicted from a padding position"):
        named(input_ids=ids, attention_mask=mask, labels=ids)
    state = attention_interface.route_state()
    assert state.stepped_aside == {}
    got, got_g = logits_and_grad(named, ids, mask)
    want, want_g = logits_and_grad(eager, ids, mask)
    assert state.calls == 2
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_g, want_g, atol=2e-5, rtol=1e-3)


class PassThrough(torch.nn.Module):
    """A module that only forwards its call (FSDP's and accelerate's wrappers add frames like these)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_labels_at_padding_are_read_however_deeply_the_base_model_is_wrapped():
    """Under the name alone the causal LM's adopted forward tells the masks of its labels, however many wrappers
    (FSDP units, accelerate's hooks) sit around the base model: the stack walk this replaced looked at 16 frames
    and missed the LM behind six pass-through wrappers (18 frames), running labels predicted from padding patched
    with no warning. The forward must step aside, with eager's loss."""
    torch.manual_seed(0)
    eager = LlamaForCausalLM(tiny_config(kv_heads=2))
    named = LlamaForCausalLM(tiny_config(kv_heads=2))
    named.load_state_dict(eager.state_dict())
    named.config._attn_implementation = "patchkit"
    base = named.model
    for _ in range(6):
        base = PassThrough(base)
    named.model = base
    ids, mask = padded_batch("right")
    state = attention_interface.route_state()
    want = eager(input_ids=ids, attention_mask=mask, labels=ids).loss
    with pytest.warns(RuntimeWarning, match="labels_from_padding"):
        got = named(input_ids=ids, attention_mask=mask, labels=ids).loss
    assert state.stepped_aside == {"labels_from_padding": 2}
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
