"""The inputs that go token by token beside the tokens (token types, per-layer inputs, image-token flags): packed
with them when a padded batch becomes one row, and a forward with one patchkit cannot place keeps its padded
layout (GPT-2 reshapes its `token_type_ids` to the packed length: a (B, S) tensor there would be silently wrong)."""

from __future__ import annotations

from typing import Optional

import torch

from patchkit.forward.padding import unpad_rows

# (B, S, ...) inputs that hold one entry per token, by name: GPT-2's and GPT-BigCode's token types, Qwen3-VL's
# `visual_pos_masks` (where its deepstack features go), Gemma 3n's and 4's `per_layer_inputs`, per-layer embedding ids
PER_TOKEN = ("input_ids", "inputs_embeds", "token_type_ids", "visual_pos_masks", "per_layer_inputs",
             "ple_input_ids", "task_type_ids")
# the unpad itself replaces the first three; the labels (a causal LM's kwargs reach its base model) go to the loss
OWN_WAY = ("attention_mask", "position_ids", "cache_position", "labels", "shift_labels")


def token_inputs(args: dict, extra: dict, batch: int, seqlen: int) -> Optional[list[tuple[dict, str]]]:
    """Where each per-token input of this call sits ((arguments or kwargs, name)), or None when the packed row
    cannot carry the call: a known one not shaped (B or 1, S, ...), or a tensor of another name shaped like the
    batch's tokens, which patchkit cannot tell from a per-token input (the forward keeps its padded layout, exact)."""
    found = []
    for where in (args, extra):
        for name, x in where.items():
            if name in OWN_WAY or not isinstance(x, torch.Tensor):
                continue
            token_shaped = x.dim() >= 2 and x.shape[1] == seqlen and x.shape[0] in (1, batch)
            if name in PER_TOKEN:
                if not token_shaped:
                    return None
                found.append((where, name))
            elif token_shaped:
                return None
    return found


def pack_token_inputs(args: dict, extra: dict, indices: torch.Tensor, batch: int, seqlen: int) -> None:
    """Every per-token input (B or 1, S, ...) -> (1, nnz, ...), the real tokens' entries, in place."""
    for where, name in token_inputs(args, extra, batch, seqlen) or ():
        x = where[name]
        where[name] = unpad_rows(x.expand(batch, *x.shape[1:]), indices).unsqueeze(0)
