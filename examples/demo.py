"""The Quickstart demo: patch a tiny random LLaMA, train on a padded batch, generate, and compare with eager."""

from __future__ import annotations

import copy
import sys
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import patchkit


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four sequences of lengths 48, 31, 17 and 9, right-padded to 48 (45% padding)."""
    g = torch.Generator().manual_seed(1)
    lengths = [48, 31, 17, 9]
    ids = torch.randint(3, 256, (len(lengths), max(lengths)), generator=g)
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return ids, mask, ids.masked_fill(mask == 0, -100)


def train(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, steps: int) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def generate(model: LlamaForCausalLM) -> torch.Tensor:
    """Greedy, 16 new tokens, on a left-padded batch (the generation convention)."""
    ids = torch.tensor([[0, 0, 0, 5, 17, 42], [9, 8, 7, 6, 5, 4]])
    mask = (ids != 0).long()
    model.eval()
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)


def main() -> int:
    ids, mask, labels = padded_batch()
    print(f"padded batch: lengths {mask.sum(-1).tolist()}, padding {1 - mask.float().mean().item():.0%}")
    eager = tiny_llama()
    patched = copy.deepcopy(eager)  # same weights; patched below

    eager_losses = train(eager, ids, mask, labels, steps=5)
    eager_tokens = generate(eager)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = patchkit.apply_patch("llama2", model=patched)  # "auto": flash_attn if its gates pass, else sdpa
    for w in caught:
        print(f"warning: {w.message}")
    patched_losses = train(patched, ids, mask, labels, steps=5)
    patched_tokens = generate(patched)

    print(f"{'step':>4} {'eager loss':>12} {'patchkit loss':>14} {'|diff|':>9}")
    for step, (a, b) in enumerate(zip(eager_losses, patched_losses)):
        print(f"{step:>4} {a:>12.6f} {b:>14.6f} {abs(a - b):>9.2e}")
    max_loss_diff = max(abs(a - b) for a, b in zip(eager_losses, patched_losses))
    same_tokens = torch.equal(eager_tokens, patched_tokens)
    print(f"generated tokens identical to eager: {same_tokens}")
    print(handle.report())
    handle.revert()
    ok = max_loss_diff < 1e-4 and same_tokens
    print("demo OK: patched training and generation match eager" if ok else "demo FAILED: mismatch against eager")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
