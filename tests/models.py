"""Tiny random LLaMA models and padded batches for the tests (no hub, CPU)."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 97


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


def step(model, ids: torch.Tensor, mask: torch.Tensor, **kw) -> tuple[torch.Tensor, dict]:
    """Logits and every parameter gradient of one padded training step (labels exclude padding)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask), **kw)
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
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                **kw)
    logits, fed = [out.logits[:, -1]], []
    for t in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True) if feed is None else feed[:, t : t + 1]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        pos = mask.long().cumsum(-1)[:, -1:] - 1  # generate()'s position for the new token
        out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True, **kw)
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
