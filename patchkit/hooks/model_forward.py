"""The patched model forwards: unpad once per forward (the decoder runs on real tokens only, as one packed row).

The base model's wrapper also keeps no KV cache in training (so a recomputing checkpoint never grows one) and,
for an instance patch, routes that model's masks to patchkit for the forward's duration only. The causal-LM
wrapper keeps the packed path off a batch whose labels are predicted from padding positions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from patchkit.errors import PatchInputError
from patchkit.forward.arguments import cache_parameter, check_one_cache, given_cache
from patchkit.forward.context import PaddedOnly, current, within
from patchkit.forward.liveness import in_one_graph, is_compiling
from patchkit.forward.masks import build_metadata
from patchkit.forward.metadata import VarlenMetadata
from patchkit.forward.padding import pad_input, unpad_rows
from patchkit.forward.rope_rows import put_rope_rows, take_rope_rows
from patchkit.hooks.causes import CAUSES
from patchkit.hooks.graph_plan import asides_in_graph, graph_cause, lm_in_graph, lm_plan, routed_in_graph
from patchkit.hooks.padded_cache import caches_in_training, fillable_cache, filled_padded, makes_own_cache, own_cache
from patchkit.hooks.patching import dressed_as
from patchkit.hooks.recorded_router import hand_up
from patchkit.hooks.routing import ROUTE_NAME, attn_name, routed
from patchkit.hooks.self_check import CAUSES as UNTRUSTED
from patchkit.hooks.self_check import untrusted_cause, untrusted_what
from patchkit.hooks.sequence_parallel import ulysses_wrapper
from patchkit.hooks.slots_mask import served_cause
from patchkit.hooks.step_aside import (
    documents_metadata,
    forward_cause,
    input_tokens,
    lm_cause,
    sliding_window,
    step_aside,
    transformers_mask_in_graph,
)
from patchkit.hooks.ulysses_padding import check_padding, refuse_step_aside

FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")  # caller-made packing: the per-layer path serves it


def _resolved_use_cache(module: nn.Module, use_cache: Optional[bool]) -> bool:
    """use_cache as given, else the config's (a vision-language model's: its text config's)."""
    if use_cache is not None:
        return bool(use_cache)
    config = module.config
    if not hasattr(config, "use_cache") and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return bool(getattr(config, "use_cache", False))


def _fills_a_cache(module: nn.Module, args: dict) -> bool:
    """This forward returns a cache the packed path must fill padded: with use_cache in eval, and in training only
    where the caller asked (use_cache=True; a cache brought in training keeps the per-layer path, as before)."""
    if not _resolved_use_cache(module, args.get("use_cache")):
        return False
    return not module.training or (args.get("use_cache") is True and caches_in_training(module))


def unpad_plan(module: nn.Module, args: dict, extra: dict) -> Optional[VarlenMetadata]:
    """The padded batch's metadata when this forward can run packed, else None (run the original as is).

    Packed needs a 2D mask with padding, no past, and no caller-made packing (`cu_seq_lens_*`). A cache to return
    must be an empty DynamicCache (generate()'s prefill), or none where the model would make one itself (an eval
    forward with use_cache: `own_cache`); `filled_padded` fills it padded. Everything else, decode steps above all,
    keeps the per-layer path, which is exact there too.
    """
    mask = args.get("attention_mask")
    tokens = input_tokens(args)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tokens is None or tokens.dim() < 2:
        return None
    if any(extra.get(k) is not None for k in FLASH_KWARGS):
        return None
    if args.get("output_attentions") or extra.get("output_attentions"):
        return None  # refused by the attention layers with the reason
    if current().lm_cause is not None:
        return None  # padding positions' logits are read (eras without stepping aside: the per-layer path)
    cache = given_cache(args)
    if _fills_a_cache(module, args):
        if cache is None and not makes_own_cache(module):
            return None  # an era whose own cache was not checked: the per-layer path lets the model make it
        if cache is not None and not fillable_cache(cache):
            return None  # a cache with a past, or one patchkit cannot fill from the packed row: the per-layer path
    elif cache is not None:
        return None
    batch, seqlen = tokens.shape[:2]
    if tuple(mask.shape) != (batch, seqlen):
        return None  # the per-layer path raises its clear shape error
    position_ids = args.get("position_ids")
    meta = build_metadata(mask, batch, seqlen, seqlen, tokens.device, position_ids)
    if meta.indices_q is None or meta.nnz_q == 0:
        return None  # no padding, nothing to gain; or no real token, which the per-layer path answers with zeros
    if rope_reads_padded_length(module, mask, position_ids, seqlen):
        return None
    if meta.holes and sliding_window(module.config) is not None:
        return None  # a window that does not bite (else stepped aside): the per-layer path sees the padded distances
    visual = args.get("visual_pos_masks")  # Qwen3-VL's deepstack features go to these tokens, padding or not
    if isinstance(visual, torch.Tensor) and bool((visual.bool() & ~mask.bool()).any()):
        return None  # an image token at padding: the packed row would drop it, the per-layer path keeps it
    return meta


def rope_reads_padded_length(module: nn.Module, mask: torch.Tensor, position_ids: Any, seqlen: int) -> bool:
    """Dynamic and longrope RoPE pick their frequencies from the largest position in the batch, padding included:
    when the packed row's largest position differs, the per-layer path keeps the padded positions (exact)."""
    kinds = [getattr(m, "rope_type", "") for m in module.children()]
    kinds = [k for kind in kinds for k in (kind.values() if isinstance(kind, dict) else [kind])]
    if not any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds):
        return False
    if position_ids is None:
        return not bool(mask[:, -1].any())  # 0..S-1 in every row: the largest is S-1 only if a row reaches it
    positions = position_ids.expand(mask.shape)
    return bool(positions.max() != positions[mask.bool()].max())


def packed_row_metadata(meta: VarlenMetadata) -> VarlenMetadata:
    """The same documents as one row of `nnz` real tokens: no gather, the cu_seqlens unchanged."""
    nnz = meta.nnz_q
    return dataclasses.replace(
        meta, batch=1, q_len=nnz, kv_len=nnz, indices_q=None, indices_k=None, packed=len(meta.seqlens_q) > 1
    )


def _unpad_inputs(args: dict, meta: VarlenMetadata) -> None:
    """input_ids / inputs_embeds, Qwen3-VL's `visual_pos_masks` (where its deepstack features go) and position_ids
    (B, S, ...) -> (1, nnz, ...) in place in `args`."""
    for name in ("input_ids", "inputs_embeds", "visual_pos_masks"):
        x = args.get(name)
        if x is not None:
            args[name] = unpad_rows(x, meta.indices_q).unsqueeze(0)
    positions = args.get("position_ids")
    if positions is None:  # transformers' default for a forward without past: 0..S-1 in every row
        positions = torch.arange(meta.q_len, device=meta.cu_seqlens_q.device)
    args["position_ids"] = unpad_rows(positions.expand(meta.batch, meta.q_len), meta.indices_q).unsqueeze(0)
    args["attention_mask"] = None
    if given_cache(args) is None:
        args["use_cache"] = False
    if args.get("cache_position") is not None:
        args["cache_position"] = None  # recomputed for the packed row


def repad_outputs(out: Any, meta: VarlenMetadata) -> Any:
    """Put every (1, nnz, ...) tensor of the model output back to (B, S, ...), zeros at padding, and every (nnz, E)
    one (a mixture of experts' per-layer router logits) back to (B * S, E), which the load-balancing loss reads
    against the 2D mask (its padding rows masked out): by what each element is, in a ModelOutput or a tuple
    (return_dict=False) alike."""
    indices = meta.indices_q

    def repad(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[:2] == (1, meta.nnz_q):
            return pad_input(x[0], indices, meta.batch, meta.q_len)
        if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] == meta.nnz_q:
            return pad_input(x, indices, meta.batch, meta.q_len).flatten(0, 1)
        if isinstance(x, (tuple, list)) and not hasattr(x, "keys"):
            return type(x)(repad(t) for t in x)
        return x

    if hasattr(out, "keys"):  # a ModelOutput: update its fields in place, keeping its class
        for key in list(out.keys()):
            out[key] = repad(out[key])
        return out
    return repad(out)


def _bound_call(original: Callable) -> tuple[inspect.Signature, Optional[str], Callable, Callable]:
    """`original`'s signature, its **kwargs name, a binder of a call's arguments to a dict, and a caller that passes
    such a dict by keyword.

    The binder reads plain lists made here, never `signature.parameters` (a mapping proxy, which TorchDynamo refuses
    to read after a dict of the frame was mutated, e.g. by transformers' `can_return_tuple`: a fullgraph compile
    fails); like `Signature.bind` it applies no defaults, and leaves what it cannot place to `Signature.bind`.
    """
    signature = inspect.signature(original)
    params = list(signature.parameters.values())
    var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if "cache" in by_name:  # 5.24+: `past_key_values` still accepted, renamed by transformers' decorator (warned)
        by_name |= {"past_key_values"}
    simple = all(p.kind is not p.VAR_POSITIONAL for p in params)
    skipped = (params[0].name, var_kw)  # self and **kwargs: passed on their own

    def bind(self: nn.Module, args: tuple, kwargs: dict) -> dict:
        if not simple or len(args) >= len(positional):
            arguments = dict(signature.bind(self, *args, **kwargs).arguments)
            if "past_key_values" in by_name and "past_key_values" in arguments.get(var_kw, {}):
                arguments["past_key_values"] = arguments[var_kw].pop("past_key_values")  # beside `cache`, by name
            return arguments
        arguments = dict(zip(positional, (self, *args)))
        extra = {}
        for name, value in kwargs.items():
            if name in by_name and name not in arguments:
                arguments[name] = value
            elif var_kw is not None and name not in arguments and name not in by_name:
                extra[name] = value
            else:
                return dict(signature.bind(self, *args, **kwargs).arguments)  # its TypeError, word for word
        if extra:
            arguments[var_kw] = extra
        return arguments

    def call(self: nn.Module, arguments: dict) -> Any:
        # by keyword: transformers 5.x decorators fill some arguments (use_cache) in by keyword themselves
        named = {k: v for k, v in arguments.items() if k not in skipped}
        return original(self, **named, **arguments.get(var_kw, {}))

    return signature, var_kw, bind, call


def _keep_no_cache_in_training(module: nn.Module, args: dict, extra: dict) -> None:
    """Training keeps no KV cache unless the caller asks for one (brings one, or passes use_cache=True): a config's
    default use_cache (every Trainer step) makes none, so a recomputing checkpoint never grows one. An asked-for cache
    is kept, as transformers keeps it: a caller who feeds it to the next step gets the same numbers. So is one a
    tuple output (return_dict=False) holds a place for: its later elements keep their positions."""
    if args.get("use_cache") is True or not module.training or given_cache(args) is not None:
        return
    keeps_place = wants_tuple(module, args, extra) and _resolved_use_cache(module, args.get("use_cache")) and (
        caches_in_training(module))
    args["use_cache"] = keeps_place


def wants_tuple(module: nn.Module, args: dict, extra: dict) -> bool:
    """The call returns a tuple (return_dict=False, on the call or the config), whose elements sit by position."""
    asked = args.get("return_dict", extra.get("return_dict"))
    return asked is False or (asked is None and getattr(module.config, "return_dict", True) is False)


@contextlib.contextmanager
def _route_masks(module: nn.Module, patched_impl: Optional[str], route: Any) -> Iterator[None]:
    """Send this forward's masks (and, with `route`, its attention) to patchkit's registered name.

    Only for the forward's duration: outside it the config is untouched, so copies and pickles of the model carry
    no patchkit name. `patched_impl` (an instance patch): the implementation at patch time; a change since then
    (set_attn_implementation) is refused rather than ignored. `route`: the patch state the attention runs on.
    """
    if patched_impl is None and route is None:
        yield
        return
    current = attn_name(module.config)
    if patched_impl is not None and current not in (patched_impl, ROUTE_NAME):
        raise PatchInputError(
            f"this model's attention implementation was changed to {current!r} after patchkit patched it (it was "
            f"{patched_impl!r}; model.set_attn_implementation?). patchkit's patched layers would ignore that change. "
            "Revert the patch first (handle.revert() or patchkit.revert_patch()), then change the implementation."
        )
    with routed(module.config, route):
        yield


def make_model_forward(
    original: Callable, unpad: str, patched_impl: Optional[str] = None, route: Any = None, state: Any = None,
    keep_routed: Optional[Callable[[], None]] = None,
) -> Callable:
    """Wrap a base model's forward: no cache in training; under unpad="model", unpad its batch once, run the
    original on the packed row and repad its outputs. `patched_impl`: an instance's implementation at patch time;
    `route`: the patch state that this forward's masks go to through the registered name. With a state (`route`
    or `state`), a forward the varlen path cannot serve exactly steps aside (`step_aside`). `keep_routed`: called
    first (eager forwards), it re-wraps an attention forward a framework set on the class since (`rerouting`)."""
    signature, var_kw, bind, call = _bound_call(original)
    takes_use_cache = "use_cache" in signature.parameters
    cache_name = cache_parameter(signature.parameters)
    aside_state = state if state is not None else route
    graph_aside = asides_in_graph(lambda: aside_state) if aside_state is not None else None

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if keep_routed is not None and not is_compiling():
            keep_routed()
        arguments = bind(self, args, kwargs)
        check_one_cache(arguments)
        extra = arguments.setdefault(var_kw, {}) if var_kw else {}  # in place: a 4D mask may become cu_seq_lens
        if takes_use_cache:
            _keep_no_cache_in_training(self, arguments, extra)
        if transformers_mask_in_graph(arguments.get("attention_mask")):
            return call(self, arguments)  # in a graph (fullgraph: no host sync, no contextvar): the mask steps aside
        one_graph = in_one_graph()
        if one_graph or (is_compiling() and route is not None and arguments.get("attention_mask") is None):
            # planned while traced: served in the graph (no host read, no break), or stepped aside in one that may
            # not break; a compiled forward with no mask needs no host read at all, whatever its compile mode
            cause = "compiled_fullgraph" if route is None else graph_cause(self, arguments, extra, aside_state)
            if cause is None:
                with routed_in_graph(self.config, route, arguments):
                    return call(self, arguments)
            if one_graph:
                if graph_aside is not None:
                    graph_aside(cause)
                return call(self, arguments)
        rope_rows = take_rope_rows(arguments)  # multimodal RoPE: back in before the call, unpadded if packed
        ulysses = ulysses_wrapper(attn_name(self.config))
        padding_first = check_padding(self, ulysses, arguments, extra)  # on every rank, before any rank's own choice
        cause = forward_cause(self, arguments, extra) if aside_state is not None else None
        cause = served_cause(self, arguments, extra, cause)  # packed documents, static caches' masks: patched
        if cause is None and aside_state is not None:
            cause = untrusted_cause(self, aside_state)  # a transformers newer than CI's: the family's self-check
        if cause is not None:
            if padding_first:
                raise refuse_step_aside(cause, *CAUSES[cause])
            step_aside(aside_state, cause, arguments, extra, untrusted_what(self) if cause in UNTRUSTED else None)
            with within(aside=cause):
                return call(self, put_rope_rows(arguments, rope_rows))
        # under sequence parallelism every rank keeps its equal-length shard: attention unpads the gathered one
        whole = unpad == "model" and ulysses is None
        meta = unpad_plan(self, arguments, extra) if whole else None
        documents = documents_metadata(arguments, extra) if meta is None and ulysses is None else None
        carried = {} if documents is None else {"packed": documents}  # documents ride the mask, as checkpoints do
        try:
            with _route_masks(self, patched_impl, route), within(no_mask=arguments.get("attention_mask") is None,
                                                                 **carried):
                if meta is None:
                    return call(self, put_rope_rows(arguments, rope_rows))
                padded = dict(arguments)  # as given: a forward whose masks only transformers serves reruns on it
                cache = given_cache(arguments)
                if cache is None and _fills_a_cache(self, arguments):
                    arguments.pop("past_key_values", None)  # a None under the name 5.24 deprecates: one name given
                    cache = arguments[cache_name] = own_cache(self)  # returned, filled padded, as its own
                _unpad_inputs(arguments, meta)
                put_rope_rows(arguments, rope_rows, meta)
                filling = filled_padded(cache, meta) if cache is not None else contextlib.nullcontext()
                with within(packed=packed_row_metadata(meta), unpadded=True), filling:
                    out = call(self, arguments)
        except PaddedOnly as only:  # raised while the masks were built, before any layer ran or filled a cache
            step_aside(aside_state, only.cause, padded, extra)
            with within(aside=only.cause):
                return call(self, put_rope_rows(padded, rope_rows))
        out = repad_outputs(out, meta)
        if not is_compiling():  # no contextvar in a graph (recording models, MoE, never compile whole)
            hand_up(out)  # to a model around this one that records router logits of its own
        return out

    forward.__patchkit_route__ = route  # type: ignore[attr-defined]
    return dressed_as(forward, original, signature)


def make_lm_forward(original: Callable) -> Callable:
    """Wrap a causal LM's forward: tell the base model's forward what of this call reads padding positions."""
    signature, var_kw, bind, _ = _bound_call(original)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        arguments = bind(self, args, kwargs)
        check_one_cache(arguments)
        extra = arguments.get(var_kw, {}) if var_kw else {}
        if transformers_mask_in_graph(arguments.get("attention_mask")):
            return original(self, *args, **kwargs)  # the base model's forward decides (and hands that mask on)
        if in_one_graph():  # what the base model's traced forward plans by: labels over a padded batch
            with lm_in_graph(lm_plan(arguments, extra)):
                return original(self, *args, **kwargs)
        if self.training and "use_cache" not in arguments and "use_cache" not in extra and not is_compiling() and (
                wants_tuple(self, arguments, extra) and _resolved_use_cache(self, None)):
            kwargs = {**kwargs, "use_cache": True}  # the tuple's cache element, which the base model cannot tell
        cause = lm_cause(arguments, extra)
        if cause is None and (is_compiling() or current().lm_cause is None):
            return original(self, *args, **kwargs)  # nothing to tell (and no contextvar inside a compiled graph)
        with within(lm_cause=cause):
            return original(self, *args, **kwargs)

    return dressed_as(forward, original, signature)
