"""The multimodal census: every multimodal model of the installed transformers around a language model, served
through `apply_patch(model=...)` on a batch of text exactly as unpatched, or refused by name.

Real checkpoints of the families people fine-tune are often these wrappers (Gemma 3 from 4B up, Llama 4, Mistral Small
3.1, Qwen3.5, LLaVA-OneVision, InternVL, SmolVLM): each hands its language model what its own forward chose (masks it
built, the head's `logits_to_keep`, a bidirectional config), which the causal-LM census never sees. Each is built tiny
(`census.tiny_wrapper`: the language model at the census's sizes, its towers shrunk) and compared with itself
unpatched on eager attention: a mixed-padded training step (loss and every gradient), left-padded greedy generation,
what reads the logits at padding (labels predicted from padding, right-padded generation), which the wrapper must
tell its language model about, and two steps under `unpad="loss"` (its head on the labelled rows, named in the
report); then the step and those reads under the registered name given to its language model alone. Images are the
VL families' own tests' (`test_qwen_vl.py`, `test_vision_language.py`).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers
from census import tiny_wrapper, wrapper_types
from models import labels_for, padded_batch
from packaging.version import Version

import patchkit
from patchkit.errors import PatchGateError, PatchkitError, PatchTargetError
from patchkit.hooks.install.registry import for_model

pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version("5.0"),
                                reason="families from data: transformers 5.x")
ATOL = 5e-5
SAFE = 5  # a text token id no tiny model gives a meaning


def text_only(model: torch.nn.Module, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded batch of text: ids within the language model's vocabulary, none of the model's special tokens."""
    ids, mask = padded_batch(side, batch=3, seq=16)
    ids = ids.clamp(max=model.config.get_text_config().vocab_size - 1)
    special = {v for k, v in model.config.to_dict().items()
               if isinstance(v, int) and k.endswith(("token_id", "token_index")) and k not in ("pad_token_id",)}
    for token in special - {SAFE}:
        ids = ids.masked_fill(ids == token, SAFE)
    return ids, mask


def train_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask), use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def differs(got: tuple, want: tuple) -> str:
    """'' when the loss and every gradient agree, else what differed."""
    if not (got[0] - want[0]).abs().item() <= ATOL * max(1.0, want[0].abs().item()):
        return f"the loss differs by {(got[0] - want[0]).abs().item():.2g}"
    if got[1].keys() != want[1].keys():
        return f"gradients of other parameters: {sorted(got[1].keys() ^ want[1].keys())[:3]}"
    for name, grad in want[1].items():
        d = (got[1][name] - grad).abs().max().item()
        if not d <= ATOL * max(1.0, grad.abs().max().item()):
            return f"the gradient of {name} differs by {d:.2g}"
    return ""


def padding_reads(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """What reads the logits at padding positions: the loss of labels predicted from padding (labels = input_ids)
    and greedy generation from right-padded prompts (both step aside under the patch, exact)."""
    ids, mask = text_only(model, "mixed")
    with torch.no_grad():
        loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
    return loss, greedy(model, *text_only(model, "right"))


def greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    model.eval()
    try:
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    finally:
        model.train()


@pytest.mark.parametrize("model_type", list(wrapper_types()))
def test_wrapper_census(model_type):
    model, why = tiny_wrapper(model_type)
    if model is None:
        pytest.skip(why)
    ids, mask = text_only(model, "mixed")
    try:
        want = train_step(model, ids, mask)
    except Exception as exc:  # a model that needs its images (BLIP's, Kosmos-2's pixel_values) for any forward
        pytest.skip(f"no text-only forward unpatched: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
    text_type = model.config.get_text_config().model_type
    try:
        for_model(model)
        served = True
    except PatchTargetError:
        served = False
    forwards = {name: m.forward for name, m in model.named_modules()}
    try:
        handle = patchkit.apply_patch(model=model, backend="sdpa")
    except PatchkitError as refused:
        # a language model patchkit does not serve, by its family; a served one only by a config it refuses
        assert isinstance(refused, PatchGateError if served else PatchTargetError), f"{model_type}: {refused}"
        assert {name: m.forward for name, m in model.named_modules()} == forwards, "a refusal left patches behind"
        pytest.skip(f"refused: {str(refused)[:160]}")
    assert served, f"{model_type}: its language model ({text_type}) is not served, yet apply_patch patched it"
    with handle:
        got = train_step(model, ids, mask)
        assert handle.calls > 0 and not handle.stepped_aside, (model_type, handle.calls, handle.stepped_aside)
    assert not differs(got, want), f"{model_type} ({text_type}): {differs(got, want)}"
    prompt = text_only(model, "left")
    want_tokens, want_reads = greedy(model, *prompt), padding_reads(model)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got_tokens, got_reads = greedy(model, *prompt), padding_reads(model)
    assert torch.equal(got_tokens, want_tokens), f"{model_type}: generation differs ({dict(handle.stepped_aside)})"
    assert torch.equal(got_reads[0], want_reads[0]), f"{model_type}: the loss of labels at padding differs"
    assert torch.equal(got_reads[1], want_reads[1]), f"{model_type}: right-padded generation differs"
    with patchkit.apply_patch(model=model, backend="sdpa", unpad="loss") as handle:
        alone = [train_step(model, ids, mask) for _ in range(2)]  # the first checks the head, the second runs as found
        assert sum(handle.heads.values()) == 2, f"{model_type}: its head ran unnamed in the report ({handle.heads})"
    for got in alone:
        assert not differs(got, want), f"{model_type} under unpad='loss' ({handle.heads}): {differs(got, want)}"
    named = copy.deepcopy(model)  # the registered name for the language model alone, the towers on sdpa
    named.set_attn_implementation({"text_config": "patchkit",
                                   **{key: "sdpa" for key in type(named.config).sub_configs if key != "text_config"}})
    assert not differs(train_step(named, ids, mask), want), f"{model_type} under the registered name"
    got_reads = padding_reads(named)
    assert torch.equal(got_reads[0], want_reads[0]), f"{model_type}: the name's loss of labels at padding differs"
    assert torch.equal(got_reads[1], want_reads[1]), f"{model_type}: the name's right-padded generation differs"


@pytest.mark.parametrize("text_type", sorted(__import__("patchkit.patches.table", fromlist=["x"]).WRAPPED_TEXT_MODELS))
def test_a_language_model_with_no_causal_lm_is_served_inside_its_multimodal_model(text_type):
    """GLM-OCR's and Granite-Docling's language models have no causal LM in transformers: `WRAPPED_TEXT_MODELS`
    serves them, checked by `test_wrapper_census` alone, so their multimodal model must build tiny and run text (a
    skip there would leave them unchecked). Under the class patch by the language model's name, the multimodal
    model's own forward is wrapped as a causal LM's: a padded training step runs patched with the unpatched loss and
    gradients, and labels predicted from padding step aside."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    wrapper = next(t for t in wrapper_types() if CONFIG_MAPPING[t]().get_text_config().model_type == text_type)
    model, why = tiny_wrapper(wrapper)
    assert model is not None, why
    assert model.config.get_text_config().model_type == text_type
    ids, mask = text_only(model, "mixed")
    want, want_reads = train_step(model, ids, mask), padding_reads(model)
    with patchkit.apply_patch(text_type, backend="sdpa", strict=True) as handle:
        got = train_step(model, ids, mask)
        assert handle.calls > 0 and not handle.stepped_aside, (handle.calls, handle.stepped_aside)
    with patchkit.apply_patch(text_type, backend="sdpa") as handle, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got_reads = padding_reads(model)
        assert set(handle.stepped_aside) == {"labels_from_padding", "right_padded_generation"}
    assert not differs(got, want), differs(got, want)
    assert torch.equal(got_reads[0], want_reads[0]) and torch.equal(got_reads[1], want_reads[1])
