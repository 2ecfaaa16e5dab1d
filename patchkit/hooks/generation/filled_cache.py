"""The KV cache a packed forward returns: made where the model would make one, filled padded as its layers run.

The base model's forward runs on one packed row of real tokens; the cache it hands back must hold what
transformers' padded forward would have stored, so that decode steps (and generate()) run on it unchanged.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Collection, Iterator

import torch
from packaging.version import Version
from torch import nn

from patchkit.forward.cache_length import past_length
from patchkit.forward.metadata import VarlenMetadata
from patchkit.forward.padding import pad_input
from patchkit.hooks.generation.slots_mask import static_layers
from patchkit.hooks.install.model_walk import modeling_files

# The modeling files whose base model forward, in eval mode with use_cache and no cache given, makes a DynamicCache
# (read in each, transformers 4.53.3, 4.54.1, 4.55.4, 4.56.2, 4.57.6 and 5.23.0; the MoE families and phi in 4.53.3,
# 4.56.2, 4.57.6, 5.0.0 and 5.23.0; qwen2_vl and qwen2_5_vl in 4.54.1, 4.56.2, 4.57.6, 5.0.0 and 5.23.0; qwen3_vl in
# 4.57.6, 5.0.0 and 5.23.0, qwen3_vl_moe in 4.57.6, 5.0.0, 5.3.0 and 5.23.0; glm4v and glm4v_moe in 5.0.0, 5.23.0
# and 5.25.0).
OWN_DYNAMIC_CACHE = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3",
                               "granite", "starcoder2", "olmo2", "smollm3", "glm4", "mixtral", "qwen2_moe",
                               "qwen3_moe", "phi", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v",
                               "glm4v_moe"})
# Those whose base model forward makes no cache in training before transformers 5.0, asked or not (`use_cache and
# past_key_values is None and not self.training`; read in 4.53.3, 4.56.2 and 4.57.6).
NO_TRAINING_CACHE_BEFORE_5 = frozenset({"gemma2", "gemma3"})
# Those with KV-sharing layers, which in some releases read keys and values back from the forward's own cache (Gemma
# 3n's `past_key_values.shared_layers` in 4.53-5.0, its shared layers' own projections without a cache): their
# numbers can depend on whether the forward keeps one.
KV_SHARING = frozenset({"gemma3n", "gemma4", "gemma4_unified", "diffusion_gemma", "mistral_large4"})
# transformers' cache layers holding a state per row beside its keys and values (5.x): a recurrent mixer's,
# DeepSeek-V4's compressors' buffers and entries
RECURRENT_LAYERS = ("LinearAttention", "DeepseekV4")


_ERA: list[tuple[bool, bool, bool]] = []  # a plain memo, not functools.cache: compiled forwards read it (an eval
# forward making its own cache), and dynamo warns of "silent incorrectness" at a functools.cache call it traces


def _families_era() -> tuple[bool, bool, bool]:
    """(transformers >= 4.53, whose families' own caches were checked; DynamicCache takes `config`, from 4.56;
    transformers >= 5.0), read once."""
    if not _ERA:
        _ERA.append(_read_era())
    return _ERA[0]


def _read_era() -> tuple[bool, bool, bool]:
    import transformers

    release = Version(transformers.__version__).release
    if release < (4, 53):
        return False, False, False  # before 4.36 there is no cache_utils at all
    from transformers.cache_utils import DynamicCache

    return True, "config" in inspect.signature(DynamicCache.__init__).parameters, release >= (5,)


def makes_own_cache(module: nn.Module) -> bool:
    """The base model's own forward would make a DynamicCache that patchkit can make for it (`own_cache`)."""
    return bool(modeling_files(type(module)) & OWN_DYNAMIC_CACHE) and _families_era()[0]


def caches_in_training(module: nn.Module) -> bool:
    """The base model's forward makes a cache in training when use_cache is on (a tuple output then holds its place),
    as every served family does from transformers 5.0."""
    return not modeling_files(type(module)) & NO_TRAINING_CACHE_BEFORE_5 or _families_era()[2]


def cache_is_storage(module: nn.Module) -> bool:
    """The model's forward computes the same numbers with use_cache off: its cache only stores keys and values for a
    later forward (no KV-sharing layer reads it back within this one)."""
    return not modeling_files(type(module)) & KV_SHARING


def empty_cache(config: Any) -> Any:
    """The empty DynamicCache transformers makes for `config`: `DynamicCache(config=config)` from 4.56 (sliding
    layers for a windowed config), `DynamicCache()` before; generate()'s and the base model's own."""
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=config) if _families_era()[1] else DynamicCache()


def own_cache(module: nn.Module) -> Any:
    """The cache the base model's forward makes when it keeps one it was not given."""
    return empty_cache(module.config)


def fillable_cache(cache: Any) -> bool:
    """An empty DynamicCache, or StaticCache of full-attention and in-order sliding layers: a prefill can run on the
    packed row and write its keys and values back padded (a static cache into its first slots). Not one with a
    state per row (a hybrid's linear attention, DeepSeek-V4's compressors: what the packed row does not keep)."""
    kind = type(cache).__name__ == "DynamicCache" or static_layers(cache) is not None
    if not kind or not callable(getattr(cache, "update", None)) or not bool(past_length(cache) == 0):
        return False  # a decode step's cache, above all: its length is asked before its layers are read
    return not any(type(layer).__name__.startswith(RECURRENT_LAYERS) for layer in getattr(cache, "layers", ()))


@contextlib.contextmanager
def filled_padded(cache: Any, meta: VarlenMetadata, padded_layers: Collection[int] = ()) -> Iterator[None]:
    """While a prefill runs packed, the cache stores each layer's keys and values repadded to (B, Hk, S, D); those of
    the layers `padded_layers` indexes (Mllama's cross-attention ones, run on the padded batch: the image tiles' keys
    per row) as they come; a sparse attention's indexer keys repadded to (B, S, D).

    The cache then holds what transformers' padded prefill would store at every real position (filler at padding,
    which every later step masks), so decode steps run on it unchanged; the layer itself gets its packed keys back.
    The filler is zero, but a StaticCache's padding keys are ones: transformers 4.56-5.x count its filled slots as
    the first row's nonzero keys (the next forward's position when no cache_position is given), and a zero key
    there would shorten that count and misplace every later step.
    """
    original = cache.update
    fills = (1.0 if static_layers(cache) is not None else 0.0, 0.0)  # keys, values

    def update(key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if layer_idx in padded_layers:
            return original(key_states, value_states, layer_idx, *args, **kwargs)
        padded = [pad_input(t[0].transpose(0, 1), meta.indices_q, meta.batch, meta.q_len, fill).transpose(1, 2)
                  for t, fill in zip((key_states, value_states), fills)]
        if args:
            args = (padded_cache_kwargs(args[0], meta), *args[1:])
        elif "cache_kwargs" in kwargs:
            kwargs["cache_kwargs"] = padded_cache_kwargs(kwargs["cache_kwargs"], meta)
        original(*padded, layer_idx, *args, **kwargs)
        return key_states, value_states

    original_indexer = getattr(cache, "update_indexer", None)

    def update_indexer(keys: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        """A sparse attention's indexer keys (B, S, D), single-headed (`hooks/attention/sparse_indexer.py`)."""
        original_indexer(pad_input(keys[0], meta.indices_q, meta.batch, meta.q_len, 0.0), layer_idx, *args, **kwargs)
        return keys

    cache.update = update
    if original_indexer is not None:
        cache.update_indexer = update_indexer
    try:
        yield
    finally:
        del cache.update  # the class's own method again
        if original_indexer is not None:
            del cache.update_indexer


def padded_cache_kwargs(cache_kwargs: Any, meta: VarlenMetadata) -> Any:
    """The packed row's `cache_position` (0..nnz-1, passed by transformers 4.56-5.3) names packed slots; the
    repadded keys fill slots 0..S-1, which a StaticCache writes by position."""
    if not isinstance(cache_kwargs, dict) or cache_kwargs.get("cache_position") is None:
        return cache_kwargs
    return {**cache_kwargs, "cache_position": torch.arange(meta.q_len, device=cache_kwargs["cache_position"].device)}
