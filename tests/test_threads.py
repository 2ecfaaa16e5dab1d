"""Forwards of one patched model in several threads (a server's request threads, nn.DataParallel's replicas, which
share the config): each equals unpatched, and the config's attention name is the user's after them."""

from __future__ import annotations

import threading

import pytest
import torch
from models import padded_batch, tiny_model

import patchkit

WAIT = 1.0  # seconds a paused forward waits for the other thread (the whole wait, where the other waits its turn)


def interleaved(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """Thread B's forward pauses inside layer 1 until thread A's forward is inside it too, then finishes while A is
    paused there: the order in which B's exit restored the user's attention name under A's running forward. Where
    forwards take turns, each pause ends by its timeout instead. Each thread's logits, or its error."""
    inside_a, inside_b, done_b = threading.Event(), threading.Event(), threading.Event()

    def pause(module: torch.nn.Module, args: tuple) -> None:
        if threading.current_thread().name == "B":
            inside_b.set()
            inside_a.wait(WAIT)
        else:
            inside_a.set()
            done_b.wait(WAIT)

    results: dict = {}

    def run(name: str) -> None:
        try:
            with torch.no_grad():
                results[name] = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        except Exception as error:  # noqa: BLE001 - the thread's outcome, asserted below
            results[name] = error
        finally:
            if name == "B":
                done_b.set()

    hook = model.model.layers[1].register_forward_pre_hook(patchkit.shape_free(pause))
    b = threading.Thread(target=run, args=("B",), name="B")
    a = threading.Thread(target=run, args=("A",), name="A")
    b.start()
    inside_b.wait(WAIT)
    a.start()
    a.join()
    b.join()
    hook.remove()
    return results


@pytest.mark.parametrize("way", ["instance", "class"])
def test_two_threads_forwarding_one_model_each_get_the_unpatched_logits(way):
    """Before, B's exit wrote the user's name back while A ran: A's next layer sent patchkit's mask to transformers'
    sdpa (PatchStateError), and A's exit left the config naming patchkit."""
    ids, mask = padded_batch("right")
    model = tiny_model(kv_heads=2, layers=3)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    if way == "class":
        handle = patchkit.apply_patch("llama", backend="sdpa")
        patched = tiny_model(kv_heads=2, layers=3)
        patched.load_state_dict(model.state_dict())
        patched.config._attn_implementation = "sdpa"
    else:
        patched = model
        handle = patchkit.apply_patch(model=model, backend="sdpa")
    try:
        results = interleaved(patched, ids, mask)
        calls = handle.calls
    finally:
        handle.revert()
    real = mask.bool()
    for name in "AB":
        assert isinstance(results[name], torch.Tensor), results[name]
    assert calls == 2 * 3  # two forwards, each layer patched
    for name in "AB":
        torch.testing.assert_close(results[name][real], want[real], atol=2e-5, rtol=1e-4, msg=name)
    assert patched.config._attn_implementation == "sdpa"
