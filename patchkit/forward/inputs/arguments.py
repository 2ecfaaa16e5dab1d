"""What a call hands patchkit, read in one place: a forward's tokens, cache, mask and window, and which of an attention
function's arguments patchkit honours (the rest is refused, never ignored).

A registered attention name is global: transformers gives it to any model that asks (Mistral, Gemma2, BERT), each
with its own arguments. An argument that changes the numbers and that patchkit does not implement must raise; an
allow-list, not a deny-list, so an argument added by a future transformers is refused until someone decides.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn

from patchkit.errors import PatchInputError
from patchkit.forward.cache_length import past_length
from patchkit.forward.documents import block_diagonal_documents, check_positions
from patchkit.forward.liveness import is_compiling
from patchkit.forward.masks import fixed_slots
from patchkit.forward.metadata import has_holes

# Read by patchkit (packing metadata; `seq_idx` checked against it: documents.py); or inert: bookkeeping and loss
# arguments that transformers' causal-LM forwards pass down through **kwargs, which do not change attention.
HONOURED = frozenset({"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})
INERT = frozenset({
    "use_cache", "cache_position", "cache", "past_key_value", "past_key_values", "output_hidden_states", "return_dict",
    "position_embeddings", "layer_idx", "token_type_ids", "num_items_in_batch", "output_router_logits",
    "shift_labels", "labels", "ignore_index",
    "logits_to_keep",  # the head's, which LLaVA-OneVision's and GOT-OCR2's models hand on to their layers
    "user_cache",  # Nemotron-H's layers on transformers 5.3 to 5.8 pass `use_cache` under this misspelt name
})

ACCEPTED = HONOURED | INERT

# The cache argument of a model or layer forward: `cache` from transformers 5.24 (where `past_key_values` is still
# accepted, deprecated, and renamed by a decorator), `past_key_values` from 4.56, `past_key_value` in layers before.
CACHE_NAMES = ("cache", "past_key_values", "past_key_value")


def resolved_use_cache(module: nn.Module, use_cache: Optional[bool]) -> bool:
    """use_cache as given, else the config's (a vision-language model's: its text config's)."""
    if use_cache is not None:
        return bool(use_cache)
    config = module.config
    if not hasattr(config, "use_cache") and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return bool(getattr(config, "use_cache", False))


def given_cache(arguments: Mapping[str, Any], extra: Optional[Mapping[str, Any]] = None) -> Any:
    """The cache a forward was given, under whichever of its version's names the caller used, else None."""
    for source in (arguments, extra or {}):
        for name in CACHE_NAMES:
            value = source.get(name)
            if value is not None:
                return value
    return None


def holds_no_past(cache: Any) -> bool:
    """A cache that holds no past yet (an eval forward's own, or generate()'s before its prefill)."""
    try:
        past = past_length(cache)
        return past is not None and int(past) == 0
    except Exception:  # noqa: BLE001 - a cache that cannot say: keep transformers' own reading
        return False


def check_one_cache(arguments: Mapping[str, Any]) -> None:
    """Refuse two different caches, `cache` and the deprecated `past_key_values` (transformers 5.24+ keeps the first
    and drops the other with a FutureWarning: a prefix library's virtual keys would be ignored, unpatched too)."""
    new, old = arguments.get("cache"), arguments.get("past_key_values")
    if new is not None and old is not None and new is not old:
        raise PatchInputError(
            "this forward was given two caches, `cache` and `past_key_values`: transformers 5.24 renamed the "
            "argument to `cache`, uses that one and ignores `past_key_values`, so whatever the second holds (PEFT's "
            "prefix tuning puts its virtual keys there, up to peft 0.21) would be dropped silently. Pass one cache, "
            "as `cache`; for PEFT prompt learning use a peft release that supports this transformers, or "
            "transformers<5.24."
        )


def cache_parameter(parameters: Iterable[str]) -> str:
    """The name a forward with these parameters takes its cache by: `cache` (5.24+) or `past_key_values`."""
    return "cache" if "cache" in parameters else "past_key_values"


def renames_past_key_values(forward: Any) -> bool:
    """`forward`, or a function it wraps, is transformers' `deprecate_kwarg("past_key_values", new_name="cache")`
    wrapper (5.24+): a `past_key_values` given to it is its cache. A family without it (Ergo, Dory in 5.25) takes the
    cache as `cache` only and passes `past_key_values` on unread in **kwargs."""
    seen = 0
    while forward is not None and seen < 16:  # a chain of decorators, each `functools.wraps` of the next
        cells = getattr(forward, "__closure__", None) or ()
        if any(_cell(cell) == "past_key_values" for cell in cells):
            return True
        inner = getattr(forward, "__wrapped__", None)  # functools.wraps; patchkit's own wrappers keep the original
        forward, seen = inner if inner is not None else getattr(forward, "__wrapped_original__", None), seen + 1
    return False


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return None

WHY = {
    "sliding_window": "a sliding-window attention (each query sees only the last N keys)",
    "softcap": "attention-logit soft-capping (tanh on the scores)",
    "sparse_indices": "sparse attention over the keys an indexer selected for each query (DeepSeek-V3.2's DSA)",
    "block_indices": "sparse attention over the key blocks an indexer selected for each query",
    "indices": "sparse attention over the keys an indexer selected for each query (DSA's top-k)",
    "output_attentions": "the attention weights, which varlen kernels never form",
    "head_mask": "a per-head mask on the attention weights",
    "is_causal": "bidirectional (non-causal) attention",
}


def model_label(module: nn.Module) -> str:
    """'MistralAttention (model_type 'mistral')' for error messages."""
    return f"{type(module).__name__} (model_type {model_type_of(module)!r})"


def part_of_multimodal(module: nn.Module) -> str:
    """The fix for a multimodal model's vision (or audio) tower given the name meant for its language model, else ''.

    transformers gives an `attn_implementation` string to every sub-config, so a VLM loaded with "patchkit" hands it
    to its bidirectional vision tower too; a dict names each part (from_pretrained from 4.53)."""
    cls = type(getattr(module, "config", None))
    key = getattr(cls, "base_config_key", "")
    if not key and cls.__name__.endswith(("VisionConfig", "AudioConfig")):  # Pixtral's, Gemma 3n's: no key (5.25)
        key = "vision_config" if cls.__name__.endswith("VisionConfig") else "audio_config"
    if not isinstance(key, str) or not key or key == "text_config":
        return ""
    return (
        f" It is the {key} part of a multimodal model, and a name given to the whole model reaches every part: name "
        f"patchkit for the language model alone, attn_implementation={{'text_config': 'patchkit', {key!r}: 'sdpa'}} "
        "(from_pretrained, or model.set_attn_implementation)."
    )


def refuse(module: nn.Module, name: str, value: Any) -> PatchInputError:
    what = WHY.get(name, "an argument patchkit's varlen attention does not implement")
    fix = part_of_multimodal(module) or (
        " Run this model on transformers' own attention: without patchkit's patch (its handle's revert()), and, where "
        "it was loaded with attn_implementation='patchkit', loaded with 'sdpa' (or 'eager'); see "
        "patchkit.available_patches() for the families patchkit serves."
    )
    shown = f"<tensor {tuple(value.shape)}>" if hasattr(value, "shape") else repr(value)
    return PatchInputError(
        f"{model_label(module)} passes {name}={shown} to its attention function: {what}. patchkit cannot serve "
        f"it exactly, so it refuses rather than ignore it.{fix}"
    )


def unserved(name: str, value: Any) -> bool:
    """An attention argument patchkit does not implement, given a value that would change the result."""
    return name not in ACCEPTED and value is not None and value is not False and not (
        name == "is_causal" and value is True)


def unserved_arguments(extra: Mapping[str, Any]) -> list[str]:
    """The names of a forward's own keyword arguments (its **kwargs, which its layers hand on to attention) that
    `check_call` would refuse at the attention call: a script's `model(**batch)` with a collator's other keys
    (`special_tokens_mask`, `length`), which transformers' own attention ignores. The forward steps aside for them."""
    return [name for name, value in extra.items() if unserved(name, value)]


def check_call(module: nn.Module, kwargs: Mapping[str, Any], mask_decides: bool = False) -> None:
    """Refuse any argument that would change the result and that patchkit does not implement. `mask_decides`: the
    layer's mask was read back from the one its non-causal layers follow (`ForwardPlan.mask_decides`)."""
    if getattr(module, "is_causal", True) is False and not mask_decides:
        raise refuse(module, "is_causal", False)
    if kwargs.keys() <= ACCEPTED:  # every layer call of a decode step asks: one set operation
        return
    for name, value in kwargs.items():
        if unserved(name, value):
            raise refuse(module, name, value)


def model_type_of(module: nn.Module) -> Any:
    """`module.config.model_type`, read past the config's Python `__getattribute__` (transformers 5.x: about 1 us a
    read, and every layer call asks): the instance's own field where it has one, else its class's."""
    config = getattr(module, "config", None)
    if is_compiling():  # dynamo traces a plain read, not object.__getattribute__ (a graph break in every layer)
        return getattr(config, "model_type", None)
    try:
        own = object.__getattribute__(config, "__dict__")
    except AttributeError:  # no instance dict (None, or a config with slots)
        return getattr(config, "model_type", None)
    return own["model_type"] if "model_type" in own else getattr(type(config), "model_type", None)


def input_tokens(arguments: dict) -> Any:
    """The forward's tokens, (B, S) ids or (B, S, H) embeddings: `inputs_embeds` where given, else `input_ids`."""
    embeds = arguments.get("inputs_embeds")
    return arguments.get("input_ids") if embeds is None else embeds


def check_caller_documents(arguments: dict, extra: dict) -> None:
    """Refuse a call's own position_ids and cu_seq_lens_q that name other documents (`check_positions`), as the
    caller gave them (before a 4D mask's documents become cu_seq_lens); not behind a cache: a paged cache's requests
    continue their own positions."""
    if given_cache(arguments, extra) is None:
        check_positions(arguments.get("attention_mask"), arguments.get("position_ids", extra.get("position_ids")),
                        extra.get("cu_seq_lens_q"))


def one_token_rows(arguments: dict) -> bool:
    """The call brings one token per row (a decode step): its one label is predicted from no position of this call,
    so no label of its is predicted from padding, and no caller's frames need reading for one."""
    tokens = input_tokens(arguments)
    return isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and tokens.shape[1] == 1


def sliding_window(config: Any) -> Optional[int]:
    """The config's sliding window where some layer uses it (generously: a false positive only steps aside)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def window_over_hole(config: Any, mask: Any) -> bool:
    """A window shorter than the mask over a row with a padding hole: the one window varlen kernels cannot place."""
    window = sliding_window(config)
    if window is None or not isinstance(mask, torch.Tensor) or mask.dim() != 2 or window >= mask.shape[-1]:
        return False
    return has_holes(mask)


def mask_queries(kwargs: Mapping[str, Any]) -> Any:
    """How many new tokens (queries) a mask-interface call is for: its `q_length` (5.4+), else its `cache_position`'s
    length (4.53-5.3), else None."""
    q_length, cache_position = kwargs.get("q_length"), kwargs.get("cache_position")
    if q_length is None and isinstance(cache_position, torch.Tensor):
        return cache_position.shape[-1]
    return q_length


def no_column_for_new_tokens(mask: Any, past: int) -> bool:
    """A 2D mask as wide as the `past` keys or narrower, behind a past: this forward's new tokens have no column (a
    decode loop that did not extend it; `mask_short_of_keys`, the registered name's mask function)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and 0 < past and mask.shape[-1] <= past


def mask_short_of_keys(mask: Any, cache: Any) -> bool:
    """A 2D mask with no column for this forward's new tokens, as wide as the cache's past or narrower (a decode loop
    that did not extend it), where transformers reads the keys it lacks as padding (`masking_utils`, 4.53+). A mask
    that covers some of the new tokens but not all (PEFT's prompt tuning re-splicing its virtual tokens behind a
    past it cannot see) or no past at all keeps the per-layer path's shape check, which refuses it with the fix;
    so does an era that failed on the shapes, and a cache that cannot tell its past (a tuple)."""
    if not isinstance(mask, torch.Tensor) or not fills_short_masks():
        return False
    past = past_length(cache)
    return past is not None and no_column_for_new_tokens(mask, int(past))


def mask_beyond_call(arguments: dict, cache: Any, training: bool) -> bool:
    """A 2D mask with more rows than the batch or more columns than the keys (past + new: a mask of another batch,
    past columns prepended to a mask that had them), whose first rows and columns transformers' masks (4.53+) read.
    A cache of fixed slots (a mask up to all its slots) or one that cannot tell its past is left to the per-layer
    path's shape check, as is an era whose masks fail on it, and a wider mask with no cache in `training` mode: a
    decode loop's next step after a forward whose cache patchkit did not keep (its refusal says so)."""
    tokens, mask = input_tokens(arguments), arguments.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tokens is None or fixed_slots(cache):
        return False
    past = past_length(cache) if cache is not None else 0
    if past is None or not fills_short_masks():
        return False
    return mask.shape[0] > tokens.shape[0] or (mask.shape[-1] > int(past) + tokens.shape[1] and not (
        training and cache is None))


def quantizes_across_slots(cache: Any) -> bool:
    """A cache that quantizes its keys and values with a scale shared across slots and rows (transformers'
    QuantizedCache: fp8's per tensor, HQQ's and quanto's per group), so the values stored at a padding slot reach
    those of every real token quantized with them."""
    return cache is not None and any("Quantized" in kind.__name__ for kind in type(cache).__mro__)


def fills_short_masks() -> bool:
    """transformers' masks pad a 2D mask narrower than the keys (`masking_utils.prepare_padding_mask`, 4.53+); read
    once, into a plain memo (dynamo warns of a `functools.cache` call in a compiled forward)."""
    if not _FILLS:
        try:
            from transformers.masking_utils import prepare_padding_mask  # noqa: F401
        except ImportError:
            _FILLS.append(False)
        else:
            _FILLS.append(True)
    return _FILLS[0]


_FILLS: list[bool] = []


def ends_in_padding(mask: torch.Tensor) -> bool:
    """Some row of the 2D mask has a padding last column (a prefill's next token is read there), a row that is all
    padding too: transformers' attention gives it real logits there, varlen kernels zeros."""
    return bool((mask[:, -1] == 0).any())


def transformers_mask(mask: Any) -> bool:
    """A mask transformers built itself (4D): the layer it reaches belongs to a forward patchkit stepped aside for."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4


def transformers_made(mask: Any) -> bool:
    """A 4D mask, or generate()'s dict of them per layer type: masks that only transformers' attention reads."""
    return transformers_mask(mask) or (isinstance(mask, dict) and any(map(transformers_mask, mask.values())))


def transformers_mask_in_graph(mask: Any) -> bool:
    """Inside a compiled graph (no host sync, no contextvar there), a transformers-made mask (generate()'s 4D mask
    of a static cache) goes to transformers' attention as it is, at every level of the model."""
    return is_compiling() and transformers_made(mask)


def weights_wanted(config: Any, arguments: Mapping[str, Any], extra: Mapping[str, Any]) -> bool:
    """output_attentions=True on the call (by name or through **kwargs), or on the config where the call leaves it
    unset: the attention weights, which varlen kernels never form."""
    wanted = arguments.get("output_attentions", extra.get("output_attentions"))
    return bool(getattr(config, "output_attentions", False) if wanted is None else wanted)


def cross_attends(arguments: Mapping[str, Any], extra: Mapping[str, Any]) -> bool:
    """The call gives a decoder its encoder's states (cross-attention), by name or through **kwargs."""
    return any(where.get("encoder_hidden_states") is not None for where in (arguments, extra))


def documents_in_4d_mask(arguments: dict, extra: dict) -> Optional[tuple[torch.Tensor, int]]:
    """A 4D block-diagonal causal mask with no past (LLaMA-Factory's neat_packing) is packed documents: their
    (cu_seqlens, longest), which `take_documents` hands the varlen path instead of stepping aside; else None."""
    cache, mask = given_cache(arguments), arguments.get("attention_mask")
    if not transformers_mask(mask) or extra.get("cu_seq_lens_q") is not None:
        return None  # a dict of masks per layer type is generate()'s, never packed documents
    if cache is not None and (fixed_slots(cache) or past_length(cache) > 0):
        return None  # a static cache's mask is generate()'s, over its keys (`slots_mask`)
    tokens = input_tokens(arguments)
    if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and mask.shape[0] != tokens.shape[0]:
        if mask.shape[0] != 1:
            return None  # transformers' own attention says what is wrong with it
        mask = mask.expand(tokens.shape[0], *mask.shape[1:])  # one mask for every row, as transformers broadcasts it
    return block_diagonal_documents(mask)


_BEFORE: dict[str, bool] = {}  # a plain memo (a compiled forward may read it)


def transformers_before(version: str) -> bool:
    """The installed transformers is older than `version`, read once."""
    if version not in _BEFORE:
        import transformers
        from packaging.version import Version

        _BEFORE[version] = Version(Version(transformers.__version__).base_version) < Version(version)
    return _BEFORE[version]


def binary_4d_masks() -> bool:
    """transformers before 4.41 read a caller's 4D mask as binary (0: masked, else attended: 4.37's
    `_prepare_4d_causal_attention_mask`, 4.38-4.40's `_update_causal_mask`; before, none), where every later release
    reads it additive (0: attended): there it steps aside, whatever it holds, as transformers reads it."""
    return transformers_before("4.41")


def legacy_llama() -> bool:
    """transformers before 4.48, where patchkit's LLaMA patch replaces the attention forward itself (`eras/`), and
    places no static kind of cache's preallocated slots."""
    return transformers_before("4.48")


def take_documents(arguments: dict, extra: dict, documents: tuple[torch.Tensor, int]) -> None:
    """Replace the 4D mask by its documents as `cu_seq_lens` kwargs (in `arguments` / `extra`, in place)."""
    cu, longest = documents
    arguments["attention_mask"] = None
    extra.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
