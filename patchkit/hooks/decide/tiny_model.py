"""A tiny copy of a user's config, for the self-check: its family's structure kept, every size cut down."""

from __future__ import annotations

import copy
import inspect
import json
import weakref
from typing import Any

import torch

LAYERS, HEADS, VOCAB = 2, 2, 64
BATCH, SEQ = 3, 10  # the check's rows and their length
LENGTHS = (SEQ, SEQ - 3, SEQ - 6)  # real tokens per row
LEFT_IN_TRAINING = (False, False, True)  # the training step's rows padded on the left (the rest on the right)
WINDOW = 4  # shorter than the self-check's rows (10 tokens): a family's sliding window bites
# what draws random numbers in a training step, by the names configs give it (GPT-2's and CTRL's `resid_pdrop`, a
# router's jitter): dropout on the packed row draws other numbers than on the padded batch, and the check would fail
RANDOM = ("dropout", "pdrop", "jitter")
# a Mamba mixer's state and scan chunk (the torch scan's intermediates grow with both: Bamba's defaults, 256 and 256,
# took over 20 GB for a training step of 10-token rows), cut where larger; 16 still spans the check's rows
STATE_CAPS = {"mamba_d_state": 16, "ssm_state_size": 16, "mamba_chunk_size": 16, "chunk_size": 16}
# a config's fields that name where it came from, not what its model computes: left out of `config_key`
PROVENANCE = ("_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "_commit_hash")
_keys: dict[int, tuple[weakref.ref, str]] = {}  # id(config) -> (the config, its key): read on every forward


def tiny_config(config: Any, keep_depth: bool = False, each_twice: bool = False, attention: str = "eager") -> Any:
    """A copy of `config` at a tiny size: 2 layers (3 where the last share keys), 2 heads (GQA kept), the head size
    kept (RoPE sections depend on it), a small vocabulary and MLP, at most 4 experts in one routing group, a small
    Mamba state, no dropout or jitter, per-layer lists cut to those layers with each layer type kept (a per-layer
    config's overrides too: Gemma4's wider full-attention heads), and a sliding window short enough to bite.
    `each_twice`: the first two layers of each type kept, for a family whose layers of a type share weights (Zamba's
    shared transformer block, tied across its hybrid layers, needs two). `keep_depth`: every layer kept, for a config
    whose other fields fix its layer count (HRM-Text's `num_layers_per_stack * H_cycles * (L_cycles + 1)` cache
    slots). `attention`: the attention implementation the tiny model runs unpatched (eager, or the user's sdpa)."""
    tiny = copy.deepcopy(config)
    layers = value_of(config, "num_hidden_layers") or LAYERS
    cut = not keep_depth and layers > LAYERS
    heads = value_of(config, "num_attention_heads") or HEADS
    kv_heads = value_of(config, "num_key_value_heads") or heads
    kv_groups = value_of(config, "num_kv_heads") or heads  # Falcon's own name, which its attention reads
    head_dim = value_of(config, "head_dim") or config.hidden_size // heads
    keep = per_layer_picks(config, layers, each_twice)
    shares = value_of(config, "num_kv_shared_layers") and layers - 1 in keep  # Gemma 3n's: the last shares keys
    sizes = {
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": 1 if kv_heads < heads else 2,
        "num_kv_heads": 1 if kv_groups < heads else 2,
        "hidden_size": HEADS * head_dim, "intermediate_size": 2 * HEADS * head_dim, "vocab_size": VOCAB,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "max_window_layers": 1,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "vocab_size_per_layer_input": VOCAB,
    }
    if cut:
        sizes.update(num_hidden_layers=len(keep))
    if shares and cut:
        sizes.update(num_kv_shared_layers=1)
    if keep_depth:
        del sizes["num_hidden_layers"]
    for key, value in sizes.items():
        if value_of(config, key) is not None:
            setattr(tiny, key, value)
    if value_of(config, "head_dim") is not None and settable(tiny, "head_dim"):
        tiny.head_dim = head_dim  # else derived from the tiny width and head count (Falcon's property, 5.25)
    for key in ("num_experts", "num_local_experts"):
        if isinstance(value_of(config, key), int):
            setattr(tiny, key, min(value_of(config, key), 4))
    if isinstance(value_of(config, "num_experts_per_tok"), int):
        tiny.num_experts_per_tok = min(config.num_experts_per_tok, 2)
    for key, cap in STATE_CAPS.items():
        if isinstance(value_of(config, key), int) and value_of(config, key) > cap:
            setattr(tiny, key, cap)
    for key in ("n_group", "topk_group"):  # DeepSeek-V3's group-limited routing: 4 experts in 8 groups had none
        if isinstance(value_of(config, key), int):
            setattr(tiny, key, 1)
    if isinstance(value_of(config, "sliding_window"), int):
        tiny.sliding_window = WINDOW
    for key, value in vars(config).items():
        if isinstance(value, float) and any(word in key for word in RANDOM):
            setattr(tiny, key, 0.0)
        elif isinstance(value, (list, tuple)) and len(value) == layers and cut:
            setattr(tiny, key, type(value)(value[i] for i in keep))
    overrides = vars(config).get("per_layer_config")
    if isinstance(overrides, dict) and overrides and cut:  # keyed by zero-padded layer index: kept ones renumbered
        width = len(next(iter(overrides)))
        tiny.per_layer_config = {f"{new:0{width}d}": overrides[f"{old:0{width}d}"] for new, old in enumerate(keep)
                                 if f"{old:0{width}d}" in overrides}
    tiny = with_derived_sizes(config, tiny)
    tiny._attn_implementation = attention  # eager: the reference every family has (Gemma2 refuses sdpa)
    return tiny


def config_key(config: Any) -> str:
    """What of `config` its tiny copy takes (the tiny config's fields, where it came from left out), as a string: two
    configs of one class with other features (a sliding window, a softcap, a layer pattern) are checked apart. Made
    once per config object (a field changed after its model's first forward is not seen)."""
    entry = _keys.get(id(config))
    if entry is not None and entry[0]() is config:
        return entry[1]
    try:
        fields = {k: v for k, v in tiny_config(config).to_dict().items() if k not in PROVENANCE}
        key = f"{type(config).__qualname__}:{json.dumps(fields, sort_keys=True, default=repr)}"
    except Exception:  # noqa: BLE001 - a config whose tiny copy will not build: its check says so, under one key
        key = type(config).__qualname__
    try:
        at = id(config)
        _keys[at] = (weakref.ref(config, lambda _: _keys.pop(at, None)), key)
    except TypeError:  # not weakly referable: made again at each forward
        pass
    return key


def with_derived_sizes(config: Any, tiny: Any) -> Any:
    """`tiny` built again through its class where the class derives fields from hidden_size (Mamba-2 hybrids' head
    size and head count), so they follow the tiny width; `tiny` itself where it derives none or will not build."""
    cls = type(config)
    try:
        default = cls()
        narrow, wide = default.to_dict(), cls(hidden_size=2 * default.hidden_size).to_dict()
        width = {"hidden_size", getattr(cls, "attribute_map", {}).get("hidden_size")}  # GPT-2's `n_embd` is the width
        derived = {k for k, v in narrow.items() if k not in width and wide.get(k) != v}
        if not derived:
            return tiny
        return cls(**{k: v for k, v in tiny.to_dict().items() if k not in derived})
    except Exception:  # a config that will not build on defaults, or not from its own dict: the copy as it is
        return tiny


def value_of(config: Any, key: str) -> Any:
    """`config.key`, or None; a per-layer config's global value where reading the attribute raises (transformers'
    heterogeneous configs refuse a global read of a per-layer attribute such as Gemma4's head_dim)."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError, whatever its base
        return vars(config).get(key)


def settable(config: Any, key: str) -> bool:
    """Whether `key` can be set on `config`: not a read-only property of its class (Falcon's `head_dim`)."""
    found = inspect.getattr_static(type(config), key, None)
    return not isinstance(found, property) or found.fset is not None


def per_layer_picks(config: Any, layers: int, each_twice: bool = False) -> list[int]:
    """Which of the user's layers a per-layer list keeps: the first, and the first of another type if any (with
    `each_twice`, the first two of each type, else the first four); and the last where the last layers share an
    earlier layer's keys and values (Gemma 3n's `num_kv_shared_layers`), so that the tiny copy shares one too."""
    kinds = getattr(config, "layer_types", None)
    picks = [0, 1, 2, 3][:min(layers, 4)] if each_twice else [0, 1]
    if isinstance(kinds, (list, tuple)) and len(kinds) == layers:
        picks = [0, next((i for i, kind in enumerate(kinds) if kind != kinds[0]), 1)]
        if each_twice:
            picks = [i for i, kind in enumerate(kinds) if list(kinds[:i]).count(kind) < 2]
    shared = value_of(config, "num_kv_shared_layers")
    if isinstance(shared, int) and 0 < shared < layers - 2 and layers - 1 not in picks:
        picks.append(layers - 1)
    return picks


def check_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    """The check's token ids, its training mask (rows padded on the right, the last on the left, so that a default of
    position_ids or of the mask under left padding shows), its decode's left-padded mask, and the generator that drew
    the ids (for the weights of the outputs)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator).to(device)
    lengths, columns = torch.tensor(LENGTHS)[:, None], torch.arange(SEQ)[None]
    left = (columns >= SEQ - lengths).long()
    train = torch.where(torch.tensor(LEFT_IN_TRAINING)[:, None], left, (columns < lengths).long())
    return ids, train.to(device), left.to(device), generator
