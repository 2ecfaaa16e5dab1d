"""What patchkit keeps alive: no model a user dropped, no patch a user reverted (a GPU model kept is its memory)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from families import set_attention
from models import labels_for, padded_batch, tiny_model
from transformers import BertConfig, BertModel

import patchkit
from patchkit.handles import PatchHandle


def named(model: torch.nn.Module) -> None:
    patchkit.register_attention(backend="sdpa")
    set_attention(model, patchkit.ATTENTION_NAME)


def dropped_and_alive(build, times: int = 2) -> int:
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


def train(model: torch.nn.Module) -> None:
    ids, mask = padded_batch("mixed")
    model.train()(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)).loss.backward()


def generate(model: torch.nn.Module) -> None:
    ids, mask = padded_batch("mixed")
    with torch.no_grad():
        model.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)


def compiled_train(model: torch.nn.Module) -> None:
    torch._dynamo.reset()
    train(torch.compile(model, backend="eager"))
    torch._dynamo.reset()  # dynamo's own caches hold what it compiled until reset, patched or not


@pytest.mark.parametrize("way, use", [
    *[(way, use) for way in ("class", "instance", "name") for use in (train, generate)],
    pytest.param("class", compiled_train, marks=pytest.mark.heavy),  # make test-heavy: compiles
], ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_a_patched_model_used_then_dropped_is_freed(way: str, use):
    def built() -> torch.nn.Module:
        model = tiny_model(layers=2)
        if way == "name":
            named(model)
        handle = patchkit.apply_patch(model=model, backend="sdpa") if way == "instance" else None
        use(model)
        if handle is not None:
            handle.revert()
        return model

    if way == "class":
        with patchkit.apply_patch(backend="sdpa") as group:
            assert dropped_and_alive(built) == 0
            assert group.calls > 0 or use is compiled_train
    else:
        try:
            assert dropped_and_alive(built) == 0
        finally:
            patchkit.register_attention(backend="auto", strict=False)  # a fresh route state for later tests


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


def test_the_names_bookkeeping_keeps_no_entry_for_a_dropped_model():
    # What the registered name remembers of a model's parts (adopted by the name; the attention each had before it)
    # is keyed by the config's id: an entry outlived its config, one per part of every model ever named.
    from patchkit.hooks.install import routing

    def built() -> torch.nn.Module:
        model = tiny_model(layers=2)
        named(model)
        copied = copy.deepcopy(model)  # a deepcopy of an adopted part is adopted too
        train(copied)
        return model

    try:
        dropped_and_alive(built, times=1)
        before = len(routing._adopted), len(routing._before)
        assert dropped_and_alive(built, times=3) == 0
        assert (len(routing._adopted), len(routing._before)) == before
    finally:
        patchkit.register_attention(backend="auto", strict=False)  # a fresh route state for later tests
