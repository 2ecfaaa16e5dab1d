"""The registered attention name: `attn_implementation="patchkit"` opts one model in, no family's class patched.

transformers >= 4.53 dispatches attention through `AttentionInterface` and builds masks through
`AttentionMaskInterface`, both keyed by `config._attn_implementation`. patchkit registers its varlen
attention and a mask function under one name; the mask function hands attention the 2D key-padding
mask (without it, a custom name silently receives no mask at all). The name has no "flash" and no "/",
which transformers 5.x would take for a flash-attn build or a hub kernel.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from patchkit import gates
from patchkit.backends import BACKEND_NAMES, make_backend
from patchkit.backends.choice import choose_backend
from patchkit.errors import PatchInputError
from patchkit.forward.context import PaddedOnly, current
from patchkit.forward.in_graph import GRAPH_ROUTE
from patchkit.forward.inputs.arguments import (
    ends_in_padding,
    mask_queries,
    no_column_for_new_tokens,
    transformers_mask,
    window_over_hole,
)
from patchkit.forward.inputs.mask_functions import (
    beyond_causal,
    chunk_size,
    chunks_off_start,
    mask_name,
    packed_sequence_ids,
    sliding_size,
)
from patchkit.forward.inputs.temperature import scaled_query
from patchkit.forward.liveness import in_one_graph, is_compiling
from patchkit.forward.masks import VarlenMask, sequence_ids_metadata
from patchkit.forward.metadata import has_holes
from patchkit.hooks.attention.compressed_kv import appended_cause
from patchkit.hooks.attention.cross_layers import cross_attention, cross_layer
from patchkit.hooks.attention.eager import aside_mask as transformers_aside_mask
from patchkit.hooks.attention.eager import aside_name, for_attention, transformers_attention
from patchkit.hooks.attention.paged import paged_step
from patchkit.hooks.attention.sparse_indexer import overlaid_cause
from patchkit.hooks.attention.varlen import check_family, family_rule, make_attention_function
from patchkit.hooks.decide.graph_plan import asides_in_graph, mask_in_graph
from patchkit.hooks.decide.self_check import CAUSES as UNTRUSTED
from patchkit.hooks.decide.self_check import trusted, untrusted_mask_cause, untrusted_what
from patchkit.hooks.decide.step_aside import keys_beyond, new_columns, padding_before_real, step_aside
from patchkit.hooks.install.registry import (
    NONCAUSAL,
    config_cause,
    cross_layer_names,
    index_topk,
    padding_into_mixers,
    read_table_lists,
    refusal,
    resolve,
    served_model_types,
    spec_for_class,
)
from patchkit.hooks.install.routing import ROUTE_NAME, loads_flash_masks
from patchkit.hooks.install.state import PatchState
from patchkit.hooks.name import batching_name, cached_documents
from patchkit.hooks.name.named import adopted, watch
from patchkit.hooks.name.named_blocks import named_blocks
from patchkit.hooks.parallel.sequence_parallel import refuse_shard_local, through_ulysses

ATTENTION_NAME = ROUTE_NAME  # defined beside the forward wrapper that switches a model to it

_options = {"backend": "auto", "strict": False}
_state: Optional[PatchState] = None
_function: Optional[Callable] = None
_serves: Optional[Callable] = None  # family_rule of every served family, built before any graph traces it


def mask_function(*args: Any, **kwargs: Any) -> Any:
    """`AttentionMaskInterface` entry: the 2D mask, wrapped, with where the queries sit; never a (B, 1, N, N) tensor.

    transformers sizes the keys from the cache: a `kv_length` beyond `q_offset + q_length` means the cache returns
    preallocated slots (a StaticCache), whose unfilled tail no query may see. A pattern beyond causal, sliding and
    packed (`beyond_causal`) gets transformers' own eager mask, which the attention entry steps aside for; so does
    a call that reads values at padding positions under this name alone (`call_cause`). generate()'s static-cache
    mask is made before the model runs and handed to it as a tensor: transformers' own, carrying the key-padding
    mask it was made from (`patchkit_varlen`) where the cache is one the varlen path places (`static_layers`; a
    class patch's model forward reads the 2D mask back from the tensor itself, `slots_mask`).
    """
    if GRAPH_ROUTE[0] is not None or in_one_graph():  # the plan made while traced (`graph_plan`)
        served = mask_in_graph(kwargs, route_state)
        if not isinstance(served, str):
            return served
        if in_one_graph() and _graph_aside(served):  # fullgraph: transformers' mask, counted when traced
            return transformers_eager_mask(args, kwargs)
    return host_mask(args, kwargs)


@torch.compiler.disable  # host reads throughout: one break at the call in a compiled forward, no frame per callee
def host_mask(args: tuple, kwargs: dict) -> Any:
    """`mask_function` outside a graph's plan: what this call's forward tells it, and its 2D mask's host reads."""
    context = current()
    refuse_refused(kwargs.get("config"), context.route)
    function = kwargs.get("mask_function")
    blocks = named_blocks(function, kwargs) if not context.plan.unpadded else None
    if isinstance(blocks, str):
        return aside_mask(blocks, args, kwargs)
    if blocks is None and beyond_causal(function, chunks=True):
        cause = "cross_attention" if encoder_mask(function) else "custom_mask_pattern"
        if context.plan.unpadded:  # transformers' mask over one packed row would join its documents: rerun padded
            raise PaddedOnly(cause)
        return aside_mask(cause, args, kwargs)
    made = served_mask(args, kwargs, context, function)
    if isinstance(made, VarlenMask):
        if blocks:
            made.blocks = blocks
        made.mask_decides = config_cause(kwargs.get("config")) == NONCAUSAL  # the mask built here: what eager
    return made  # attention follows on layers not causal by their config (PaliGemma's Gemma)


def served_mask(args: tuple, kwargs: dict, context: Any, function: Any) -> Any:
    """`host_mask` for a pattern the varlen path serves: the mask transformers' attention would read, as patchkit's."""
    attention_mask, cache_position = kwargs.get("attention_mask"), kwargs.get("cache_position")
    cause = call_cause(kwargs.get("config"), attention_mask, mask_queries(kwargs)) if context.route is None else None
    if cause is None and context.route is None:
        cause = sparse_cause(kwargs, function)
    if cause is None and context.route is None:
        cause = untrusted_mask_cause(kwargs.get("config"), call_device(kwargs), kwargs.get("dtype"))  # a
        # transformers newer than CI's: the family's check
    if cause is not None:
        return aside_mask(cause, args, kwargs)
    q_offset, q_length, kv_length = kwargs.get("q_offset"), kwargs.get("q_length"), kwargs.get("kv_length")
    if q_offset is None and isinstance(cache_position, torch.Tensor) and cache_position.numel():  # 4.53-5.3
        q_offset, q_length = cache_position.reshape(-1)[0], cache_position.numel()
    chunk = chunk_size(function)
    window = kwargs.get("local_size")  # a sliding mask's window (the pattern is causal and sliding: read above)
    if window is None and chunk is None:
        window = sliding_size(function)  # 0: transformers' mask slides nowhere (a layer's own window is not read)
    # q_offset is a tensor before transformers 5.4: read on the host once, here if chunks need it, else below
    past_len = int(q_offset) if q_offset is not None and chunk is not None else None
    if chunk is not None and (chunk_behind_cache(chunk, attention_mask, past_len, q_length) or (
            context.plan.padded is None and chunks_off_start(function, chunk))):  # patchkit's packed rows of a
        # padded batch: each row's chunks count from its first real token, as transformers counts past left padding
        return aside_mask("chunk_behind_cache", args, kwargs)
    attention_mask = flash_loaded_mask(attention_mask, context.route)
    documents = packed_sequence_ids(function) if attention_mask is None else None
    if documents is not None and context.plan.packed is None:  # for layers not handed position_ids (GPT-BigCode)
        return VarlenMask(None, sequence_ids_metadata(documents), route=context.route, window=window, chunk=chunk)
    if q_offset is None:
        return VarlenMask.for_forward(attention_mask, window=window, chunk=chunk)
    past_len = int(q_offset) if past_len is None else past_len
    if no_column_for_new_tokens(attention_mask, past_len):
        return aside_mask("short_mask", args, kwargs)  # transformers fills in the columns it lacks
    key_offset = int(kwargs.get("kv_offset") or 0)
    fixed = kv_length is not None and q_length is not None and kv_length > past_len + q_length - key_offset
    varlen = VarlenMask.for_forward(attention_mask, past_len, fixed, key_offset, kv_length if fixed else None, window,
                                    chunk)
    placed = context.generating  # None: the model's own mask; else generate()'s, made ahead (`named.preparation`)
    if placed is None:
        return varlen
    if past_len == 0 and isinstance(attention_mask, torch.Tensor) and ends_in_padding(attention_mask):
        return aside_mask("right_padded_generation", args, kwargs)  # a static cache's prefill reads its last column
    from transformers.masking_utils import eager_mask

    mask = for_attention(eager_mask(*args, **kwargs), aside_name(kwargs.get("config")))  # a tensor generate() can
    mask.patchkit_ahead = True  # hand the model; its compiled decode step runs it on transformers' attention, counted
    if placed:
        mask.patchkit_varlen = varlen  # a cache the varlen path places: served from the mask it was made from
    return mask


def sparse_cause(kwargs: dict, function: Any) -> Optional[str]:
    """Under the name alone (a patch's model forward asks `forward_cause`): a query of this call sees more keys than
    its family's sparse attention keeps (`step_aside.keys_beyond`), or None."""
    topk = index_topk(kwargs.get("config"))
    if topk is None:
        return None
    documents = packed_sequence_ids(function)
    starts = None
    if isinstance(documents, torch.Tensor) and documents.dim() == 2:
        starts = torch.ones_like(documents, dtype=torch.bool)
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    past, new = int(kwargs.get("q_offset") or 0), int(kwargs.get("q_length") or 0)
    cache_position = kwargs.get("cache_position")  # transformers 4.53-5.3: where the queries sit
    if kwargs.get("q_length") is None and isinstance(cache_position, torch.Tensor) and cache_position.numel():
        past, new = int(cache_position.reshape(-1)[0]), cache_position.numel()
    growing = kwargs.get("kv_length") in (None, past + new) and not kwargs.get("kv_offset")
    beyond = keys_beyond(topk, kwargs.get("attention_mask"), past, new, growing, starts)
    return "sparse_attention" if beyond else None


def flash_loaded_mask(mask: Any, route: Any) -> Any:
    """transformers' `flash_attention_mask`, for a model loaded with a flash attention that patchkit serves: a one-row
    mask with no padding is no mask, so that restarting position_ids are packed documents there, which its flash
    attention keeps apart (`_is_packed_sequence`: one row, no mask). Every other mask and loaded name: as given."""
    if route is None or not isinstance(mask, torch.Tensor) or mask.dim() != 2 or len(mask) != 1:
        return mask
    return None if loads_flash_masks(route.loaded) and bool(mask.all()) else mask


def call_device(kwargs: dict) -> Optional[torch.device]:
    """The device a mask call builds for: its own `device` (5.x), else its 2D mask's or cache positions'."""
    device = kwargs.get("device")
    for tensor in (kwargs.get("attention_mask"), kwargs.get("cache_position")):
        if device is None and isinstance(tensor, torch.Tensor):
            device = tensor.device
    return None if device is None else torch.device(device)


def refuse_refused(config: Any, route: Any) -> None:
    """A family the table refuses by name (its own code reads the mask: sparse or dynamic-mask attention) is told
    so before its mask is built, rather than when its code meets patchkit's mask."""
    model_type = getattr(config, "model_type", None)
    feature = refusal(model_type) if route is None else None
    if feature is not None:
        raise PatchInputError(f"attn_implementation='patchkit' was given to a model of model_type {model_type!r}, "
                              f"which uses {feature}. Load it with attn_implementation='sdpa'.")


def chunk_behind_cache(chunk: int, mask: Any, past_len: Optional[int], q_length: Any) -> bool:
    """Chunked attention whose chunk bites where documents cannot express it: a chunk boundary behind the cache
    (a query past the first chunk with cached keys), or a row with padding between its real tokens."""
    past = past_len or 0
    if past > 0 and past + int(q_length or 0) > chunk:
        return True
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] > chunk and has_holes(mask)


def encoder_mask(function: Any) -> bool:
    """transformers' bare bidirectional mask, which a decoder asks for over its encoder's tokens (cross-attention,
    `create_bidirectional_mask`); an image span in a causal mask comes joined (`or_masks`)."""
    return getattr(function, "__module__", None) == "transformers.masking_utils" and (
        mask_name(function) == "bidirectional_mask_function")


def aside_mask(cause: str, args: tuple, kwargs: dict) -> torch.Tensor:
    """transformers' own eager mask for this forward, tagged with the cause `_attention` steps aside for; a tensor
    even where transformers would skip it (bidirectional over no padding: zeros), so the cause reaches attention."""
    route = current().route
    loaded = route and route.loaded
    mask = transformers_aside_mask(args, kwargs, loaded)
    if mask is None:
        mask = transformers_aside_mask(args, {**kwargs, "allow_is_bidirectional_skip": False}, loaded)
    mask.patchkit_cause = cause
    mask.patchkit_alone = current().route is None  # under the name alone: no patched forward counted it
    return mask


def call_cause(config: Any, mask: Any, new: Optional[int] = None) -> Optional[str]:
    """Under this name alone (no patch wraps the model's forward): why this call needs transformers' values at
    padding positions, which varlen kernels never compute, or None.

    The causal LM of a model adopted where it got the name (`named`) says what of its call reads padding (labels,
    generate()'s right-padded prefill); a model patchkit never saw get the name cannot say, and steps aside. A
    sliding window may span a padding hole (the class patches decide the same at the model's forward,
    `step_aside.forward_cause`).
    """
    if config is not None and not adopted(config):
        return "named_unseen"
    cause = config_cause(config)
    cause = (None if cause == NONCAUSAL else cause) or current().lm_cause  # layers not causal by their config
    if cause is not None:  # attend as the mask built here says (`mask_decides`)
        return cause
    if config is not None and padding_into_mixers(config) and padding_before_real(new_columns(mask, new)):
        return "padding_into_mixer"  # a compiled forward's (its base model's forward tells it uncompiled)
    return "window_over_padding_hole" if config is not None and window_over_hole(config, mask) else None


def route_state() -> PatchState:
    """The registered route's backend, chosen through the gates on first use (warning or raising as usual)."""
    return _state if _state is not None else _first_route_state()


@torch.compiler.disable
def _first_route_state() -> PatchState:
    """The gates probe the machine (installed packages, CUDA): host work that runs outside any traced graph, where
    dynamo would fold `importlib.metadata` lookups of absent packages into an internal error."""
    global _state, _function
    if _state is None:
        spec = resolve("llama2")
        chosen, _ = choose_backend(
            spec.name, spec.flash_attn_min, spec.flash_attn_why, _options["backend"], _options["strict"],
            gates.probe_environment(), who=f"attn_implementation={ATTENTION_NAME!r}",  # any family, not LLaMA's
            silence="patchkit.register_attention(backend='sdpa')",
        )
        _state = PatchState(spec.name, spec.packing, make_backend(chosen), _options["strict"])
        _function = function_for(_state)
    return _state


_graph_aside = asides_in_graph(lambda: route_state() if GRAPH_ROUTE[0] is None else GRAPH_ROUTE[0].state)


def transformers_eager_mask(args: tuple, kwargs: dict) -> torch.Tensor:
    """transformers' own mask for the call the mask interface made, for the attention a step aside runs
    (`eager.aside_name`), in the graph it is traced in (where no contextvar is read)."""
    return transformers_aside_mask(args, kwargs)


def _attention(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """`AttentionInterface` entry: q/k/v (B, H, S, D) after RoPE and cache update -> varlen attention.

    Inside a patched family's forward the patch's own state serves it; otherwise the registered route's. Inside a
    compiled graph (transformers' compiled static-cache decode) a transformers-made 4D mask goes straight to
    transformers' attention: no contextvar, no count, nothing that would break the graph.
    """
    query = scaled_query(query, kwargs)  # Llama 4's NoPE layers in a packed forward: by the padded columns
    if cross_layer(module):  # to another tower's tokens, under the batch's own mask: the loaded attention
        route = current().route
        return cross_attention(module, query, key, value, attention_mask, route and route.loaded, **kwargs)
    if "write_index" in kwargs and not is_compiling():  # continuous batching: its requests are packed documents
        route = current().route
        state = route.state if route is not None else route_state()
        return paged_step(state, function_for(state), module, query, key, value, attention_mask, kwargs,
                          route and route.loaded)
    foreign = transformers_mask(attention_mask)  # read once: every layer of a decode step asks
    if foreign and is_compiling():
        if getattr(attention_mask, "patchkit_alone", False):  # stepped aside under the name alone, in a graph that
            _graph_aside(attention_mask.patchkit_cause)  # may break: counted and warned when traced
        elif getattr(attention_mask, "patchkit_ahead", False) or getattr(attention_mask, "patchkit_attention",
                                                                         None) is None:
            _graph_aside("compiled_4d_mask")  # generate()'s, in its compiled decode step, or the caller's own (any
            # mask patchkit made is tagged): no host read of it in a graph
        return transformers_attention(module, query, key, value, attention_mask, **kwargs)
    route = attention_mask.route if isinstance(attention_mask, VarlenMask) else None  # a graph break-free read
    route = current().route if route is None else route
    routed = None if route is None else route.state
    if foreign and route is None:
        attention_mask = getattr(attention_mask, "patchkit_varlen", attention_mask)  # generate()'s, made by us
        foreign = transformers_mask(attention_mask)
    if foreign:  # a caller's 4D mask (transformers hands it on as it is): step aside
        check_family(module, served_rule())  # an unserved family is refused, not stood aside
        cause = getattr(attention_mask, "patchkit_cause", None) or overlaid_cause(module) or appended_cause(module)
        cause = cause or config_cause(module.config) or "custom_4d_mask"  # else a config's (ALiBi, added to the
        # model's mask as a new tensor) or the caller's mask
        what = untrusted_what(module.config) if cause in UNTRUSTED else None  # the family's check: what differed
        if not getattr(attention_mask, "patchkit_counted", False):  # a patch counts forwards, not layers; the
            step_aside(routed or route_state(), cause, {}, {}, what)  # name alone counts attention calls
            if routed is not None and hasattr(attention_mask, "patchkit_cause"):  # made by `aside_mask` for this
                attention_mask.patchkit_counted = True  # forward (a caller's own tensor may come back in the next)
        return transformers_attention(module, query, key, value, attention_mask, route and route.loaded, **kwargs)
    if routed is not None:
        if route.ulysses is not None:  # sequence parallel: its all-to-alls around patchkit's attention
            return through_ulysses(route.ulysses, function_for(routed), module, query, key, value, attention_mask,
                                   **kwargs)
        return function_for(routed)(module, query, key, value, attention_mask, **kwargs)
    refuse_shard_local()  # a model loaded with this name alone: no route checked it
    if _state is None or _function is None:
        route_state()
    return _function(module, query, key, value, attention_mask, **kwargs)


def served_rule() -> Callable:
    """The `family_rule` of every family patchkit serves, built once."""
    global _serves
    if _serves is None:
        _serves = family_rule(served_model_types(), spec_for_class)
    return _serves


def function_for(state: PatchState) -> Callable:
    """The attention function on `state`, built once per patch state: when the patch is applied, not in a layer's
    first call, which dynamo may trace (it would guard on the unbuilt function and compile the layer again)."""
    function = state.route_function
    if function is None:
        function = state.route_function = make_attention_function(state, served_model_types(), spec_for_class)
    return function


def register_route() -> bool:
    """What a patch's route needs: the attention entry under ATTENTION_NAME (transformers 4.48+, a plain dict up to
    4.49) and, from 4.53, the mask entry; True when masks go through the interface. The served families are read
    now, not in a layer's first call, which may be traced by dynamo (which refuses the imports that read them)."""
    served_rule()
    if register():
        return True
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = _attention  # 4.48-4.52: masks from the patched _update_causal_mask
    return False


def register(backend: Optional[str] = None, strict: Optional[bool] = None) -> bool:
    """Register ATTENTION_NAME (idempotent); False when this transformers has no mask interface (< 4.53).

    `backend` ("auto", "flash_attn", "torch_varlen", "sdpa") and `strict` configure the route; None keeps the
    current setting.
    """
    global _state, _function
    read_table_lists()  # read now, not first inside a traced forward: the table's lists (a model built with this name
    cross_layer_names()  # alone compiled fullgraph failed on the import) and cross-attention layers, the installed
    trusted(None)  # transformers' verdict (an import there guards sys.modules; a functools.cache call warns)
    if backend is not None and backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
    try:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return False
    wanted = {"backend": _options["backend"] if backend is None else backend,
              "strict": _options["strict"] if strict is None else strict}
    if wanted != _options:
        _options.update(wanted)
        _state = _function = None
    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, mask_function)
    cached_documents.install()  # packed documents behind an empty cache, in the forwards patchkit serves
    batching_name.install()  # continuous batching keeps the name
    watch(route_state)  # models get the name from now on: adopted where they get it (`named`), its state made then
    return True


try:  # importing patchkit's attention registers the name (`import patchkit` loads this lazily, or the hook does)
    register()
except Exception:  # noqa: BLE001 - a broken transformers must not make patchkit's imports fail
    pass
