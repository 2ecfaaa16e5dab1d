"""Packed documents behind an empty cache: transformers' masks find them only without one; a served forward's do.

transformers reads documents from restarting position_ids (no attention_mask) in `_preprocess_mask_arguments`, but
only when the forward has no cache, and 5.x makes one in every eval forward (`use_cache` from the config): there the
documents of a padding-free batch attend to each other. patchkit's attention keeps them apart from the position_ids
its layers are handed; a layer handed none (GPT-BigCode, Persimmon, CTRL, Llama 4) learns them from its mask
alone. So in a forward patchkit serves, the mask's preprocessing finds them behind an empty cache too: from the
position_ids the model hands its masks (none for a multimodal model's RoPE-only rows, nor for BioGPT's, as in
transformers; never a time row handed on as text positions, which repeats a position over an image), by the rule
patchkit's attention reads them with (a position that does not increase starts a document; in a graph
`in_graph.graph_layout` lays them out by it). A forward that steps aside, an unpatched model and a cache with a
past keep transformers' own preprocessing. A mask patchkit made for a forward, handed on by a multimodal model to
its language model (PaliGemma's), is kept as made, as transformers keeps a 4D one.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from patchkit.forward.context import NO_PLAN, current
from patchkit.forward.documents import document_ids
from patchkit.forward.in_graph import GRAPH_ROUTE
from patchkit.forward.inputs.arguments import CACHE_NAMES, holds_no_past
from patchkit.forward.inputs.rope_rows import config_text_positions, multimodal_rope
from patchkit.forward.liveness import is_compiling
from patchkit.forward.masks import VarlenMask

PREPROCESS = "_preprocess_mask_arguments"  # masking_utils, 4.53+: returns (early exit, mask, packed ids, ...)
EMBEDS_NAMES = ("inputs_embeds", "input_embeds")


def served_documents(original: Callable) -> Callable:
    """`_preprocess_mask_arguments`, finding packed documents behind an empty cache in a forward patchkit serves:
    planned eagerly (`ForwardContext.plan`, served) or in a graph (`GRAPH_ROUTE`, by position). Its arguments are
    read by name or place, as dynamo traces plain lookups."""
    places = {name: i for i, name in enumerate(inspect.signature(original).parameters)}

    def given(args: tuple, kwargs: dict, names: tuple[str, ...]) -> Any:
        """The first of `names` passed (not None), by keyword or by place."""
        for name in names:
            place = places.get(name, len(args))
            value = kwargs.get(name, args[place] if place < len(args) else None)
            if value is not None:
                return value
        return None

    @functools.wraps(original)
    def preprocess(*args: Any, **kwargs: Any) -> Any:
        mask = given(args, kwargs, ("attention_mask",))
        if isinstance(mask, VarlenMask):  # patchkit's, handed on by a multimodal model (PaliGemma's): kept as made,
            return kept_as_made(args, kwargs, mask)  # as transformers keeps a 4D mask
        out = original(*args, **kwargs)
        if not isinstance(out, tuple) or len(out) < 3 or out[0] or out[2] is not None:
            return out
        in_graph = is_compiling()
        if in_graph:
            graph_plan = GRAPH_ROUTE[0]
            if graph_plan is None or not graph_plan.by_position:
                return out
        else:
            plan = current().plan
            if plan is NO_PLAN or plan.aside is not None:
                return out
        positions, cache = given(args, kwargs, ("position_ids",)), given(args, kwargs, CACHE_NAMES)
        embeds = given(args, kwargs, EMBEDS_NAMES)
        if (not isinstance(positions, torch.Tensor) or positions.dim() != 2 or cache is None
                or given(args, kwargs, ("attention_mask",)) is not None or not isinstance(embeds, torch.Tensor)
                or positions.shape[-1] != embeds.shape[1] or not holds_no_past(cache)):
            return out
        config = given(args, kwargs, ("config",))  # a time row handed on as text positions is no documents
        positions = None if in_graph and multimodal_rope(config) else config_text_positions(config, positions)
        if positions is None:
            return out
        ids = document_ids(positions.expand(embeds.shape[0], -1), checked=not in_graph)
        return out if ids is None else (*out[:2], ids, *out[3:])

    def kept_as_made(args: tuple, kwargs: dict, mask: VarlenMask) -> Any:
        """transformers' early exit for a prepared mask, with `mask` in it: its answer for a 4D one, whose arity
        varies by release, given an empty 4D tensor in the mask's place."""
        place = places.get("attention_mask", len(args))
        prepared = torch.empty(0, 0, 0, 0)
        if "attention_mask" in kwargs or place >= len(args):
            kwargs = {**kwargs, "attention_mask": prepared}
        else:
            args = (*args[:place], prepared, *args[place + 1:])
        out = original(*args, **kwargs)
        return (out[0], mask, *out[2:])

    preprocess.__patchkit_documents__ = True  # type: ignore[attr-defined]
    return preprocess


def install() -> None:
    """Wrap transformers' mask preprocessing once (idempotent; inert outside patchkit's served forwards)."""
    try:
        from transformers import masking_utils
    except ImportError:  # before 4.53: no mask preprocessing to wrap
        return
    original = getattr(masking_utils, PREPROCESS, None)
    if original is None or getattr(original, "__patchkit_documents__", False):
        return
    if "position_ids" not in inspect.signature(original).parameters:
        return
    setattr(masking_utils, PREPROCESS, served_documents(original))
