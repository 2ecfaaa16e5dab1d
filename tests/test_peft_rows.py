"""PEFT's per-row arguments (a mixed-adapter batch's `adapter_names`, aLoRA's `alora_offsets`) reach its LoRA layers
by hooks and are read by the padded batch's rows: a forward that carries them keeps the padded layout in its layers
(attention still patched), and equals unpatched."""

from __future__ import annotations

import warnings

import pytest
import torch
from models import labels_for, padded_batch, tiny_model

import patchkit

peft = pytest.importorskip("peft", reason="peft is a test extra")

TARGETS = ["q_proj", "v_proj", "down_proj"]
NAMES = ["a", "b", "__base__", "a"]  # one adapter per row of padded_batch's 4, the base model for one
INVOKE = [7, 8]  # aLoRA's invocation tokens: its adapter acts from their last occurrence on


def two_adapters() -> torch.nn.Module:
    """A tiny LLaMA under two LoRA adapters with weights drawn non-zero (init_lora_weights=False), in eval mode."""
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_model(kv_heads=2), peft.LoraConfig(
        task_type="CAUSAL_LM", r=4, target_modules=TARGETS, init_lora_weights=False), adapter_name="a")
    model.add_adapter("b", peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=TARGETS,
                                         init_lora_weights=False))
    return model.eval()


def layer_rows(model: torch.nn.Module) -> list[int]:
    """The batch size the first decoder layer receives, per call (1 on the packed row)."""
    rows: list[int] = []
    model.get_base_model().model.layers[0].register_forward_pre_hook(patchkit.shape_free(
        lambda m, args: rows.append(args[0].shape[0])))
    return rows


@pytest.mark.parametrize("use_cache", [None, False])
def test_a_mixed_adapter_batch_equals_unpatched(use_cache):
    """`model(..., adapter_names=[...])`, one adapter per row (PEFT's mixed-batch inference): unpatched, every LoRA
    layer splits its (B, S, H) input by row; on one packed row PEFT refused the batch ("Length of adapter_names should
    be the same as the number of inputs"). The forward keeps its rows; its attention runs patched."""
    model = two_adapters()
    ids, mask = padded_batch("right")
    kw = {} if use_cache is None else {"use_cache": use_cache}
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, adapter_names=NAMES, **kw).logits
        rows = layer_rows(model)
        with warnings.catch_warnings(record=True) as caught, patchkit.apply_patch(
                model=model, backend="sdpa", strict=True) as handle:
            warnings.simplefilter("always")
            got = model(input_ids=ids, attention_mask=mask, adapter_names=NAMES, **kw).logits
            model(input_ids=ids, attention_mask=mask, **kw)  # without them: the packed row
            assert handle.calls == 2 * 2 and handle.stepped_aside == {}
    assert rows == [4, 1]
    assert not [w for w in caught if "patchkit" in str(w.message)]  # PEFT's own hooks: kept unannounced
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


def test_a_mixed_adapter_batch_generates_the_unpatched_tokens():
    model = two_adapters()
    ids, mask = padded_batch("left")
    kw = dict(input_ids=ids, attention_mask=mask, adapter_names=NAMES, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        want = model.generate(**kw)
        with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
            got = model.generate(**kw)
            assert handle.calls > 0 and handle.stepped_aside == {}
    assert torch.equal(got, want)


@pytest.mark.skipif(not hasattr(peft.LoraConfig(), "alora_invocation_tokens"), reason="aLoRA: peft 0.17+")
def test_an_alora_training_step_equals_unpatched():
    """Activated LoRA: PEFT finds each row's invocation tokens and its adapter acts on that row's last `offset`
    positions, counted in the (B, S) batch. A padded training step keeps its rows: loss and gradients as unpatched."""
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_model(kv_heads=2), peft.LoraConfig(
        task_type="CAUSAL_LM", r=4, target_modules=TARGETS, init_lora_weights=False,
        alora_invocation_tokens=INVOKE)).train()
    ids, mask = padded_batch("left")
    ids[:, -6:-4] = torch.tensor(INVOKE)  # in every row's real tokens (the shortest has 5... its own 2 of them)
    labels = labels_for(ids, mask)

    def step() -> tuple[torch.Tensor, dict]:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = step()
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got = step()
        assert handle.calls > 0 and handle.stepped_aside == {}
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    assert got[1].keys() == want[1].keys() and want[1]
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=2e-6, rtol=1e-4, msg=name)
