"""The patched base model forward: unpad once per forward (the decoder runs on real tokens only, as one packed row).

It also keeps no KV cache in training (so a recomputing checkpoint never grows one) or for a caller that reads the
loss alone, and, for an instance patch, routes that model's masks to patchkit for the forward's duration only. The
causal LM's wrapper around it, which asks it for the packed row, is `lm_forward.py`.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from patchkit.errors import PatchInputError
from patchkit.forward.context import ForwardPlan, PaddedOnly, within
from patchkit.forward.documents import APART, kept_apart
from patchkit.forward.inputs.arguments import (
    cache_parameter,
    check_caller_documents,
    check_one_cache,
    given_cache,
    input_tokens,
    renames_past_key_values,
    resolved_use_cache,
    transformers_mask_in_graph,
)
from patchkit.forward.inputs.rope_rows import put_rope_rows, take_rope_rows
from patchkit.forward.inputs.token_inputs import pack_token_inputs
from patchkit.forward.liveness import in_one_graph, is_compiling
from patchkit.forward.metadata import VarlenMetadata
from patchkit.forward.padding import pad_input, unpad_rows
from patchkit.hooks.attention.dropout_draws import say_dropout
from patchkit.hooks.decide.causes import CAUSES
from patchkit.hooks.decide.graph_plan import asides_in_graph, graph_cause, routed_in_graph
from patchkit.hooks.decide.plan import plan_forward
from patchkit.hooks.decide.self_check import CAUSES as UNTRUSTED
from patchkit.hooks.decide.self_check import untrusted_what
from patchkit.hooks.decide.step_aside import step_aside
from patchkit.hooks.forwards.embedding_hooks import embedded_padded
from patchkit.hooks.forwards.recorded_router import hand_up
from patchkit.hooks.generation import padded_slots
from patchkit.hooks.generation.filled_cache import cache_is_storage, caches_in_training, filled_padded, own_cache
from patchkit.hooks.generation.slots_mask import cross_layers
from patchkit.hooks.head import liger_rows
from patchkit.hooks.head.head_request import HeadRequest, asked
from patchkit.hooks.head.lm_head import hand_kept, hand_packed
from patchkit.hooks.install.patching import dressed_as
from patchkit.hooks.install.registry import read_table_lists
from patchkit.hooks.install.routing import ROUTE_NAME, attn_name, routed
from patchkit.hooks.parallel.sequence_parallel import ulysses_wrapper
from patchkit.hooks.parallel.ulysses_padding import check_padding, refuse_step_aside


def _unpad_inputs(args: dict, meta: VarlenMetadata, extra: dict) -> None:
    """The tokens and every per-token input beside them (`token_inputs`), and position_ids: (B, S, ...) ->
    (1, nnz, ...) in place."""
    pack_token_inputs(args, extra, meta.indices_q, meta.batch, meta.q_len)
    positions = args.get("position_ids")
    if positions is None:  # given by **kwargs, where the forward's signature names none (a subclass's own)
        positions = extra.get("position_ids")
    if positions is None:  # transformers' default for a forward without past: 0..S-1 in every row
        positions = torch.arange(meta.q_len, device=meta.cu_seqlens_q.device)
    args["position_ids"] = unpad_rows(positions.expand(meta.batch, meta.q_len), meta.indices_q).unsqueeze(0)
    args["attention_mask"] = None
    if given_cache(args) is None:
        args["use_cache"] = False
    if args.get("cache_position") is not None:
        args["cache_position"] = None  # recomputed for the packed row


RECORDED = ("output_hidden_states", "output_attentions", "output_router_logits")


def every_query(args: dict, extra: dict, config: Any) -> int:
    """A base model that takes `logits_to_keep` (Gemma 4's text models) slices its hidden states to the last ones
    before its KV-shared layers, which on one packed row would be the last row's, and on packed documents would
    leave the shared layers' masks to cut by query: it computes every query instead (exact: the kept queries' own
    numbers), and the number it would have kept is returned (0: none sliced) for `last_queries`."""
    keep = args.get("logits_to_keep")
    if not isinstance(keep, int) or keep <= 0:
        return 0
    args["logits_to_keep"] = 0
    recorded = any(extra.get(k) or getattr(config, k, False) for k in RECORDED)  # transformers then slices none
    return 0 if recorded or keep >= input_tokens(args).shape[1] else keep


def last_queries(out: Any, keep: int) -> Any:
    """The base model's hidden states cut to the `keep` last positions it would have returned (the causal LM's own
    `logits_to_keep` slice leaves them as they are)."""
    if keep and hasattr(out, "keys") and out.get("last_hidden_state") is not None:
        out["last_hidden_state"] = out["last_hidden_state"][:, -keep:]
    return out


def repad_outputs(out: Any, meta: VarlenMetadata) -> Any:
    """Put every (1, nnz, ...) tensor of the model output back to (B, S, ...), zeros at padding (and every (K, 1, nnz,
    ...) stack of them, Gemma 3n's AltUp hidden states, back to (K, B, S, ...)), and every (nnz, E)
    one (a mixture of experts' per-layer router logits) back to (B * S, E), which the load-balancing loss reads
    against the 2D mask (its padding rows masked out): by what each element is, in a ModelOutput or a tuple
    (return_dict=False) alike."""
    indices = meta.indices_q

    def repad(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[:2] == (1, meta.nnz_q):
            return pad_input(x[0], indices, meta.batch, meta.q_len)
        if isinstance(x, torch.Tensor) and x.dim() >= 4 and x.shape[1:3] == (1, meta.nnz_q):  # a stack of them
            return pad_input(x[:, 0].movedim(0, 1), indices, meta.batch, meta.q_len).movedim(2, 0)  # (Gemma 3n's)
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


def exit_outputs(out: Any, meta: VarlenMetadata, head: Optional[HeadRequest]) -> Any:
    """The base model's outputs at its exit: repadded, except the last hidden state a causal LM asked for packed
    (`head`), which it gets as the packed row (and the request the forward's metadata)."""
    packed = hand_packed(out, meta, head) if head is not None and head.wanted else None
    out = repad_outputs(out, meta)
    if head is not None and (packed is not None or not head.wanted):
        head.meta = meta  # what the causal LM counts (and, handed the packed row, repads its logits by)
    if packed is not None:
        out["last_hidden_state"] = packed
    return out


def bound_call(original: Callable) -> tuple[inspect.Signature, Optional[str], Callable, Callable]:
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
    if "cache" in by_name and renames_past_key_values(original):  # 5.24+: renamed by transformers' decorator
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
        extra = arguments.get(var_kw, {})
        if extra and named.keys() & extra.keys():  # patchkit's value for a keyword the forward takes by **kwargs
            extra = {k: v for k, v in extra.items() if k not in named}  # (a subclass's own signature) wins
        return original(self, **named, **extra)

    return signature, var_kw, bind, call


def _keep_no_cache_in_training(module: nn.Module, args: dict, extra: dict) -> None:
    """Training keeps no KV cache unless the caller asks for one (brings one, or passes use_cache=True): a config's
    default use_cache (every Trainer step) makes none, so a recomputing checkpoint never grows one. An asked-for cache
    is kept, as transformers keeps it: a caller who feeds it to the next step gets the same numbers. So is one a
    tuple output (return_dict=False) holds a place for: its later elements keep their positions."""
    if args.get("use_cache") is True or not module.training or given_cache(args) is not None:
        return
    keeps_place = wants_tuple(module, args, extra) and resolved_use_cache(module, args.get("use_cache")) and (
        caches_in_training(module))
    args["use_cache"] = keeps_place


def _keep_no_cache_for_the_loss(module: nn.Module, args: dict) -> None:
    """A forward whose caller reads the loss alone (its causal LM asked for it: `HeadRequest.labels`) keeps no KV
    cache unless the caller asked for one: in eval (the HF Trainer's evaluation) the config's default use_cache would
    otherwise hold every layer's keys and values for the whole batch. A family whose layers read the cache back
    within the forward (`cache_is_storage`) keeps it."""
    if args.get("use_cache") is None and given_cache(args) is None and cache_is_storage(module):
        args["use_cache"] = False


def tuple_cache_kwargs(module: nn.Module, arguments: dict, extra: dict, kwargs: dict) -> dict:
    """`kwargs` with use_cache=True for a training call of a model with a head (a causal LM, a task head) that
    returns a tuple (return_dict=False) whose config's use_cache holds its cache a place: the base model, called for a
    dict, cannot tell (`_keep_no_cache_in_training`). Else `kwargs` as given."""
    if module.training and "use_cache" not in arguments and "use_cache" not in extra and not is_compiling() and (
            wants_tuple(module, arguments, extra) and resolved_use_cache(module, None)):
        return {**kwargs, "use_cache": True}
    return kwargs


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
    # continuous batching runs an eager model as "paged|eager" for its steps: transformers' own switch, not the user's
    if patched_impl is not None and current not in (patched_impl, ROUTE_NAME, f"paged|{patched_impl}"):
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
    read_table_lists()  # read by the plans of its forwards, some traced (`graph_cause`)
    signature, var_kw, bind, call = bound_call(original)
    takes_use_cache = "use_cache" in signature.parameters
    cache_name = cache_parameter(signature.parameters)
    # a `past_key_values` this forward passes on unread in **kwargs (it takes `cache` only: Ergo in 5.25)
    unread = "past_key_values" if cache_name == "cache" and not renames_past_key_values(original) else None
    aside_state = state if state is not None else route
    graph_aside = asides_in_graph(lambda: aside_state) if aside_state is not None else None

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not is_compiling():
            if keep_routed is not None:
                keep_routed()
            liger_rows.ensure()  # Liger's fused loss, imported since, on the rows it scores
        head = asked()
        if head is None:
            return served(self, args, kwargs, None)
        if head.replay is not None:  # the LM runs again on this forward's output (`head_request.run_lm`)
            out, head.replay = head.replay, None
            return out
        with within(head=None):  # the causal LM's ask is for this forward, not for any model it runs
            out = served(self, args, kwargs, head)
        if head.check_rows is not None:  # kept should the fused head's check fail
            head.output = out
        return out

    def served(self: nn.Module, args: tuple, kwargs: dict, head: Optional[HeadRequest]) -> Any:
        arguments = bind(self, args, kwargs)
        check_one_cache(arguments)
        padded_slots.check(given_cache(arguments), arguments.get("attention_mask"), input_tokens(arguments))
        extra = arguments.setdefault(var_kw, {}) if var_kw else {}  # in place: a 4D mask may become cu_seq_lens
        caller = dict(arguments)  # as given, before a training forward's cache is dropped (`joined_by_transformers`)
        check_caller_documents(arguments, extra)
        if takes_use_cache:
            _keep_no_cache_in_training(self, arguments, extra)
            if head is not None and head.labels is not None:
                _keep_no_cache_for_the_loss(self, arguments)
        if transformers_mask_in_graph(arguments.get("attention_mask")):
            if graph_aside is not None:  # no host read of it in a graph: counted and warned while traced
                graph_aside("compiled_4d_mask")
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
        if unread is not None and extra.get(unread) is not None and aside_state is not None:
            plan = ForwardPlan(aside="unread_cache")  # transformers runs it on no past: so does patchkit, warned
        else:
            plan = plan_forward(self, arguments, extra, aside_state, unpad, ulysses is not None, caller)
        if plan.aside is not None:
            if padding_first:
                raise refuse_step_aside(plan.aside, *CAUSES[plan.aside])
            what = untrusted_what(self) if plan.aside in UNTRUSTED else None
            step_aside(aside_state, plan.aside, arguments, extra, what)
            with within(plan=plan):  # transformers' attention; the head and loss still on the labelled rows alone
                return hand_kept(call(self, put_rope_rows(arguments, rope_rows)), head)
        apart = APART[0]
        meta = plan.padded
        say_dropout(self, meta is not None)
        try:
            with _route_masks(self, patched_impl, route), within(plan=plan):
                if meta is None:  # every query here too: packed documents' masks cannot be sliced by query
                    kept = every_query(arguments, extra, self.config)
                    out = last_queries(hand_kept(call(self, put_rope_rows(arguments, rope_rows)), head), kept)
                    padded_slots.marked_by(out, arguments)  # unpadded in each layer: its padding rows differ
                    if plan.joined is not None and APART[0] > apart:  # its layers kept the documents apart
                        kept_apart(plan.joined)
                    return out
                padded = dict(arguments)  # as given: a forward whose masks only transformers serves reruns on it
                cache = given_cache(arguments)
                if plan.own_cache:
                    arguments.pop("past_key_values", None)  # a None under the name 5.24 deprecates: one name given
                    cache = arguments[cache_name] = own_cache(self)  # returned, filled padded, as its own
                kept = every_query(arguments, extra, self.config)
                _unpad_inputs(arguments, meta, extra)
                put_rope_rows(arguments, rope_rows, meta)
                hooked = embedded_padded(self, padded.get("input_ids"), arguments.get("input_ids"), meta.indices_q)
                filled = contextlib.nullcontext() if cache is None else filled_padded(cache, meta, cross_layers(self))
                with filled, hooked:
                    out = call(self, arguments)
                padded_slots.mark(cache, padded.get("attention_mask"), meta.nnz_q < meta.batch * meta.q_len)
        except PaddedOnly as only:  # raised while the masks were built, before any layer ran or filled a cache
            step_aside(aside_state, only.cause, padded, extra)
            with within(plan=ForwardPlan(aside=only.cause)):
                return hand_kept(call(self, put_rope_rows(padded, rope_rows)), head)
        out = last_queries(exit_outputs(out, meta, head), kept)
        if not is_compiling():  # no contextvar in a graph (recording models, MoE, never compile whole)
            hand_up(out)  # to a model around this one that records router logits of its own
        return out

    forward.__patchkit_route__ = route  # type: ignore[attr-defined]
    return dressed_as(forward, original, signature)
