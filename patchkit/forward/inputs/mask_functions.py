"""What transformers' `mask_function` is, read from its qualified names and closures without importing transformers
or calling it: causal, sliding and packed (which a key-padding mask expresses), chunks, or a pattern beyond them."""

from __future__ import annotations

from typing import Any, Optional

import torch

# transformers' mask functions (masking_utils, by qualified name) that a key-padding mask with documents expresses:
# causal, a sliding window over it, packed documents; and the combinators that only join or shift them
PACKED = "packed_sequence_mask_function.<locals>.inner_mask"  # documents transformers found in position_ids
EXPRESSIBLE = ("causal_mask_function", "sliding_window_overlay.<locals>.inner_mask", PACKED)  # tuples: dynamo
# traces this check
JOINING = ("and_masks.<locals>.and_mask", "remap_positions_for_packed_sequence.<locals>.inner_mask",
           "add_offsets_to_mask_function.<locals>.inner_mask")
CHUNKED = "chunked_overlay.<locals>.inner_mask"  # Llama 4's chunks: documents split at the chunk size, when asked


def mask_name(function: Any) -> str:
    """A mask function's name by its code object: dynamo traces a function's __qualname__ wrongly (torch 2.13) and
    cannot read the closures of one made in its graph."""
    return getattr(getattr(function, "__code__", None), "co_qualname", None) or function.__qualname__


def mask_kind(function: Any) -> str:
    """What transformers' `mask_function` is by its name alone: "expressible" (causal, sliding, packed), "chunked"
    (Llama 4's chunks), "joining" (a combinator whose parts decide) or "beyond" (anything else)."""
    if getattr(function, "__module__", None) != "transformers.masking_utils":
        return "beyond"
    name = mask_name(function)
    if name == CHUNKED:
        return "chunked"
    return "expressible" if name in EXPRESSIBLE else "joining" if name in JOINING else "beyond"


def mask_parts(function: Any) -> list[Any]:
    """The functions and tensors a joining mask function (`and_masks`, ...) closes over, one level down."""
    parts = [c.cell_contents for c in function.__closure__ or ()]
    return [f for p in parts for f in (p if isinstance(p, tuple) else (p,))]


def leaf_parts(function: Any, leaf: str) -> Optional[list[Any]]:
    """What the first mask function named `leaf` joined into transformers' `mask_function` closes over, or None."""
    if function is None or getattr(function, "__module__", None) != "transformers.masking_utils":
        return None
    name = mask_name(function)
    if name == leaf:
        return mask_parts(function)
    if name not in JOINING:
        return None
    found = (leaf_parts(f, leaf) for f in mask_parts(function) if callable(f) and not isinstance(f, torch.Tensor))
    return next((parts for parts in found if parts is not None), None)


def leaf_rows(function: Any, leaf: str) -> Optional[torch.Tensor]:
    """The (B, N) tensor the first mask function named `leaf` in transformers' `mask_function` closes over, or None."""
    return next((t for t in leaf_parts(function, leaf) or () if isinstance(t, torch.Tensor) and t.dim() == 2), None)


def packed_sequence_ids(function: Any) -> Optional[torch.Tensor]:
    """The (B, N) document ids transformers found in position_ids and joined into its `mask_function` (a packed
    batch, no mask), or None: its documents, for layers that are not handed position_ids themselves."""
    return leaf_rows(function, PACKED)


def sliding_size(function: Any) -> Optional[int]:
    """The window of the sliding overlay joined into transformers' `mask_function` (what eager and sdpa attend
    within), 0 where no part of it slides, None where its closures do not say (one joined by `or_masks`)."""
    parts = leaf_parts(function, SLIDING)
    if parts is not None:
        return next((p for p in parts if isinstance(p, int) and not isinstance(p, bool)), None)
    return None if _slides(function, 4) else 0


def _slides(function: Any, depth: int) -> bool:
    """Some function in `function`'s closures, `depth` levels down, is one of transformers' sliding ones."""
    if not callable(function) or isinstance(function, torch.Tensor):
        return False
    if "sliding" in mask_name(function):
        return True
    return depth > 0 and any(_slides(f, depth - 1) for f in mask_parts(function))


def beyond_causal(function: Any, chunks: bool = False) -> bool:
    """True when transformers' `mask_function` holds a pattern beyond causal, sliding and packed (or_masks of a
    bidirectional span, a caller's and_mask_function, chunked attention unless `chunks` are served): read from its
    closures, no tensor work."""
    if function is None:
        return False
    kind = mask_kind(function)
    if kind != "joining":
        return kind == "beyond" or (kind == "chunked" and not chunks)
    parts = [f for f in mask_parts(function)
             if not isinstance(f, torch.Tensor) and callable(f)]  # a traced tensor is not asked: dynamo refuses
    return any(beyond_causal(f, chunks) for f in parts)


REMAP = "remap_positions_for_packed_sequence.<locals>.inner_mask"  # packed documents' own positions


def chunks_off_start(function: Any, chunk: int) -> bool:
    """Packed documents whose first position is not a multiple of `chunk`: transformers counts chunks by position,
    patchkit's documents from their first token."""
    ids, positions = packed_sequence_ids(function), leaf_rows(function, REMAP)
    if ids is None or positions is None:
        return False
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return bool((positions.expand_as(ids)[starts] % chunk != 0).any())


def chunk_size(function: Any) -> Optional[int]:
    """The chunk size of chunked attention (Llama 4's `attention_chunk_size`) joined into transformers'
    `mask_function`, or None."""
    return next((c for c in leaf_parts(function, CHUNKED) or () if isinstance(c, int) and not isinstance(c, bool)),
                None)


OR = "or_masks.<locals>.or_mask"
AND = "and_masks.<locals>.and_mask"
BLOCKWISE = "blockwise_overlay.<locals>.inner_mask"  # `block_sequence_ids`: each block's tokens see each other
SLIDING = "sliding_window_overlay.<locals>.inner_mask"


def block_pattern(function: Any) -> Optional[tuple[torch.Tensor, Optional[bool]]]:
    """transformers' causal mask OR its blockwise overlay (images, PaliGemma's prompt: each block's tokens see each
    other both ways), in the three shapes its multimodal models build: (the block ids (B, N), whether a sliding window
    cuts a block's keys), or None for any other mask function.

    - or(causal, blocks): a full layer's (window None);
    - and(or(causal, blocks), sliding): Gemma 3's sliding layers, the window over the blocks too (True);
    - or(and(sliding, causal), blocks): `create_sliding_window_causal_mask` given block ids (PaliGemma 2's), where a
      block sees all of itself past the window (False)."""
    if getattr(function, "__module__", None) != "transformers.masking_utils":
        return None
    parts = [f for f in mask_parts(function) if callable(f) and not isinstance(f, torch.Tensor)]
    names = sorted(mask_name(f) for f in parts)
    if mask_name(function) == AND and names == sorted([OR, SLIDING]):
        inner = block_pattern(next(f for f in parts if mask_name(f) == OR))
        return None if inner is None or inner[1] is not None else (inner[0], True)
    if mask_name(function) != OR or len(parts) != 2 or BLOCKWISE not in names:
        return None
    ids = leaf_rows(next(f for f in parts if mask_name(f) == BLOCKWISE), BLOCKWISE)
    base = next(f for f in parts if mask_name(f) != BLOCKWISE)
    if ids is None or getattr(base, "__module__", None) != "transformers.masking_utils":
        return None
    if mask_name(base) == "causal_mask_function":
        return ids, None
    inner = sorted(mask_name(f) for f in mask_parts(base) if callable(f))
    return (ids, False) if mask_name(base) == AND and inner == sorted(["causal_mask_function", SLIDING]) else None
