"""What patchkit keeps alive: no model a user dropped, no patch a user reverted (a GPU model kept is its memory)."""

from __future__ import annotations

import gc
import weakref

import torch
from models import labels_for, padded_batch, tiny_model
from transformers import BertConfig, BertModel

import patchkit
from patchkit.handles import PatchHandle


def dropped_and_alive(build, times: int = 3) -> int:
    """Build `times` models with `build()`, drop each, and count those still alive after a full collection."""
    refs = []
    for _ in range(times):
        model = build()
        refs.append(weakref.ref(model))
        del model
    gc.collect()
    return sum(ref() is not None for ref in refs)


def test_models_of_a_family_no_patch_serves_are_freed_once_dropped():
    # Regression: the table's refusal of a family was one cached error object raised again at every model built while
    # a patch was active; each raise put the building frames (the model's own __init__) on its traceback, so every
    # such model (an encoder, a reward model, a multimodal model's vision tower) stayed alive for the process.
    def bert() -> BertModel:
        return BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32))

    with patchkit.apply_patch(backend="sdpa"):
        assert dropped_and_alive(bert) == 0


def test_a_patched_model_trained_then_dropped_is_freed():
    def trained() -> torch.nn.Module:
        model = tiny_model(layers=2).train()
        ids, mask = padded_batch("mixed")
        model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)).loss.backward()
        return model

    with patchkit.apply_patch(backend="sdpa"):
        assert dropped_and_alive(trained) == 0
    assert dropped_and_alive(trained) == 0


def test_reverted_patches_are_not_kept():
    # Regression: each apply_patch() and revert kept its handles (~8000 objects) through that same traceback.
    def handles() -> int:
        gc.collect()
        return sum(isinstance(o, PatchHandle) for o in gc.get_objects())

    with patchkit.apply_patch(backend="sdpa"):
        pass
    after_one = handles()
    for _ in range(3):
        with patchkit.apply_patch(backend="sdpa"):
            pass
    assert handles() == after_one  # the last group is kept (apply_patch() again returns it), no more
