"""Tiny random LLaMA models, padded and packed batches, cached decoding and the shared skip markers (no hub, CPU)."""

from __future__ import annotations

import copy
import importlib.util
import inspect

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

import patchkit
from patchkit.forward.inputs.arguments import cache_parameter

VOCAB = 97
# The cache argument's name in this transformers (`cache` from 5.24, where `past_key_values` is deprecated): the
# helpers pass it by its own name; tests that pass `past_key_values` keep the deprecated spelling users still write.
CACHE = cache_parameter(inspect.signature(LlamaForCausalLM.forward).parameters)

# one marker per condition
needs_mask_interface = pytest.mark.skipif(importlib.util.find_spec("transformers.masking_utils") is None,
                                          reason="the mask interface (registered name, families): transformers 4.53+")
needs_set_attn_implementation = pytest.mark.skipif(not hasattr(PreTrainedModel, "set_attn_implementation"),
                                                   reason="set_attn_implementation: transformers 4.56+")


def tiny_config(kv_heads: int = 4, heads: int = 4, hidden: int = 64, layers: int = 2, **kw) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager", **kw,
    )


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**kw)).to(dtype)
    return model.eval()


def clone(model: LlamaForCausalLM) -> LlamaForCausalLM:
    return copy.deepcopy(model)


def padded_batch(kind: str, batch: int = 4, seq: int = 24, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and a 2D mask: right, left or mixed padding, the last row all padding for 'mixed'."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    lengths = [seq, seq - 7, seq - 13, 5][:batch]
    if min(lengths) < 1:
        raise ValueError(f"seq={seq} is too short for the padding pattern; use seq >= 14")
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for row, n in enumerate(lengths):
        side = {"right": "r", "left": "l", "mixed": "rl"[row % 2]}[kind]
        if side == "r":
            mask[row, :n] = 1
        else:
            mask[row, seq - n :] = 1
    if kind == "mixed":
        mask[-1] = 0
    return ids, mask


def labels_for(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Targets only where both the token and the position predicting it are real (left padding included)."""
    predicted_from_pad = torch.nn.functional.pad(mask[:, :-1] == 0, (1, 0))
    return ids.masked_fill((mask == 0) | predicted_from_pad, -100)


def completion_labels(ids: torch.Tensor, mask: torch.Tensor, prompt: int = 4) -> torch.Tensor:
    """SFT's completion-only labels (`labels_for`): each row's first `prompt` real tokens, its prompt, unlabelled."""
    return labels_for(ids, mask).masked_fill(mask.cumsum(1) <= prompt, -100)


def step(model, ids: torch.Tensor, mask: torch.Tensor, **kw) -> tuple[torch.Tensor, dict]:
    """Logits and every parameter gradient of one padded training step (labels exclude padding unless given)."""
    model.zero_grad(set_to_none=True)
    kw.setdefault("labels", labels_for(ids, mask))
    out = model(input_ids=ids, attention_mask=mask, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def assert_same(got: tuple, want: tuple, mask: torch.Tensor, atol: float = 2e-5) -> None:
    """Two `step` results agree: logits at real tokens (rtol 1e-4) and every gradient (rtol 1e-3), within `atol`."""
    real = mask.bool()
    torch.testing.assert_close(got[0][real], want[0][real], atol=atol, rtol=1e-4)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=atol, rtol=1e-3, msg=name)


@torch.no_grad()
def decode_logits(model, ids: torch.Tensor, mask: torch.Tensor, steps: int, feed: torch.Tensor | None = None,
                  **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill a padded prompt into a DynamicCache, then `steps` one-token steps as generate() runs them.

    Each step feeds the greedy token, or column t of `feed` (B, steps) (teacher forcing, so that two models are
    compared on the same inputs). Returns the last-position logits of the prefill and every step (B, steps + 1, V)
    and the tokens fed (B, steps).
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{CACHE: cache}, use_cache=True,
                **kw)
    logits, fed = [out.logits[:, -1]], []
    for t in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True) if feed is None else feed[:, t : t + 1]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        pos = mask.long().cumsum(-1)[:, -1:] - 1  # generate()'s position for the new token
        out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, **{CACHE: cache}, use_cache=True, **kw)
        logits.append(out.logits[:, -1])
        fed.append(nxt)
    return torch.stack(logits, 1), torch.cat(fed, 1)


def cache_tensors(cache) -> list:
    """Each layer's (keys, values): a layered DynamicCache (4.56+), its key_cache/value_cache lists before, or the
    legacy tuple generate() hands back on 4.48-4.52 (the same tensors)."""
    if isinstance(cache, tuple):
        return [(k, v) for k, v in cache]
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def dynamic_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # before 4.56 a DynamicCache takes no config
        return DynamicCache()


def static_cache(model, batch: int, max_len: int):
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # before 5.x the batch size and dtype are arguments
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_len, dtype=torch.float32)


@torch.no_grad()
def dynamic_decode(model, ids, mask, forwards: int, run=None):
    """A hand-written greedy loop into a DynamicCache: the left-padded prompt's prefill, then one token per forward
    (`forwards` in all, through `run`, the model itself unless given: a compiled one); the last logits per forward."""
    run = model if run is None else run
    kv, step_mask, nxt, logits = dynamic_cache(model), mask, ids, []
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for _ in range(forwards):
        out = run(input_ids=nxt, attention_mask=step_mask, position_ids=positions, **{CACHE: kv}, use_cache=True)
        logits.append(out.logits[:, -1])
        nxt, positions = out.logits[:, -1:].argmax(-1), positions[:, -1:] + 1
        step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], -1)
    return torch.stack(logits, 1)


@torch.no_grad()
def static_decode(model, ids, mask, steps: int, max_len: int, full_mask: bool):
    """Prefill a left-padded prompt into a StaticCache, then decode `steps` tokens greedily; logits per step."""
    batch, prompt = ids.shape
    cache = static_cache(model, batch, max_len)
    slots = torch.zeros(batch, max_len, dtype=mask.dtype)
    slots[:, :prompt] = mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    step_mask = slots if full_mask else slots[:, :prompt]
    out = model(input_ids=ids, attention_mask=step_mask, position_ids=positions, **{CACHE: cache},
                use_cache=True)
    logits, nxt, pos = [out.logits[:, -1]], out.logits[:, -1].argmax(-1, keepdim=True), positions[:, -1:]
    for t in range(prompt, prompt + steps):
        slots[:, t] = 1
        pos = pos + 1
        step_mask = slots if full_mask else slots[:, : t + 1]
        out = model(input_ids=nxt, attention_mask=step_mask, position_ids=pos, **{CACHE: cache}, use_cache=True)
        logits.append(out.logits[:, -1])
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.stack(logits, 1)


DOCS = [[5, 9, 11, 4], [7, 3, 8], [12, 6], [9, 9, 9, 9, 9, 9]]


def doc_ids(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (len(d),), generator=g) for d in DOCS]


def separate_logits(model, docs):
    with torch.no_grad():
        return [model(input_ids=d[None]).logits[0] for d in docs]


def pack(docs, rows):
    """rows: list of lists of doc indices -> input_ids, position_ids (restarting), mask (right padding)."""
    width = max(sum(len(docs[i]) for i in row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = len(docs[i])
            ids[r, at : at + n], pos[r, at : at + n], mask[r, at : at + n] = docs[i], torch.arange(n), 1
            at += n
    return ids, pos, mask


def unpack(logits, docs, rows):
    out = {}
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            out[i] = logits[r, at : at + len(docs[i])]
            at += len(docs[i])
    return [out[i] for i in range(len(docs))]


def check_packed_rows(kv_heads: int, use_cache: bool) -> tuple:
    """Two rows packing the four documents, padded as TRL's padding-free collator pads them (no mask, each padding
    position a restart at 0), under the patch, equal each document run alone unpatched.

    Returns (model, packed ids, position_ids, each document's unpatched logits) for further checks.
    """
    model = tiny_model(kv_heads=kv_heads, seed=7)
    docs = doc_ids()
    want = separate_logits(model, docs)
    rows = [[0, 1], [2, 3]]
    ids, pos, _ = pack(docs, rows)
    with torch.no_grad(), patchkit.apply_patch("llama2", backend="sdpa"):
        logits = model(input_ids=ids, position_ids=pos, use_cache=use_cache).logits
    for got, exp in zip(unpack(logits, docs, rows), want):
        torch.testing.assert_close(got, exp, atol=2e-5, rtol=1e-4)
    return model, ids, pos, want
