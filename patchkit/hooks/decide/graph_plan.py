"""The plan of a forward inside a compiled graph that may not break, made while dynamo traces it, from what is known
then: the graph serves it on patchkit's in-graph varlen path (`forward/in_graph.py`), or steps aside by name.

Nothing here reads a tensor's values: whether a label sits after padding, or a padding hole under a sliding window,
is data a graph cannot branch on, so a forward that could hold one steps aside (exact, warned once, counted when
traced; refused in strict mode). No contextvar either (dynamo refuses it): the causal LM's and the base model's
forwards leave their plan in `in_graph.GRAPH_LABELS` / `GRAPH_ROUTE` for the span of the traced call.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from patchkit.forward.documents import kept_apart
from patchkit.forward.in_graph import GRAPH_LABELS, GRAPH_ROUTE, GraphMask, GraphPlan
from patchkit.forward.inputs.arguments import (
    cross_attends,
    given_cache,
    input_tokens,
    mask_queries,
    resolved_use_cache,
    sliding_window,
    weights_wanted,
)
from patchkit.forward.inputs.mask_functions import mask_kind
from patchkit.hooks.decide.causes import CAUSES
from patchkit.hooks.decide.self_check import untrusted_in_graph
from patchkit.hooks.decide.step_aside import step_aside
from patchkit.hooks.install.patching import unpatched
from patchkit.hooks.install.registry import config_cause, index_topk, padding_into_mixers
from patchkit.hooks.install.routing import ROUTE_NAME, Route, attn_name, loads_flash_masks, set_attn_name
from patchkit.hooks.parallel.sequence_parallel import ulysses_wrapper

# why a forward in such a graph steps aside (the cause `compiled_fullgraph`, in these words), and the fix
IN_GRAPH = {
    "labels": "torch.compile(fullgraph=True) of a padded batch with labels (or a sequence classifier's pooled "
              "token): whether one is read at a padding position (which transformers computes and varlen kernels "
              "skip) is data the graph cannot branch on",
    "name_alone": "torch.compile(fullgraph=True) of a padded batch under attn_implementation='patchkit' alone: the "
                  "graph cannot see whether the caller's labels read padding positions",
    "cache": "torch.compile(fullgraph=True) of a forward given a KV cache: patchkit's in-graph path serves forwards "
             "with no past (training, eval, a prefill that fills a new cache)",
    "window": "torch.compile(fullgraph=True) of a padded batch on a model with a sliding window: a padding hole inside "
              "the window is data the graph cannot branch on",
    "sinks": "torch.compile(fullgraph=True) of a model with attention sinks, which patchkit serves on the eager path "
             "only",
    "dropout": "torch.compile(fullgraph=True) of a training forward with attention dropout, which patchkit's sdpa op "
               "does not run",
    "backend": "torch.compile(fullgraph=True) on the {backend} backend, whose in-graph path is not verified yet",
    "positions": "torch.compile(fullgraph=True) of a forward with multimodal (k, B, S) position_ids",
    "sequence_parallel": "torch.compile(fullgraph=True) under sequence parallelism",
    "joined": "torch.compile(fullgraph=True) under attn_implementation='patchkit' alone of a mask transformers joins "
              "from parts (a sliding window, packed documents, a pattern of the model's own), which the graph cannot "
              "read apart (a patch applied with apply_patch() plans them before the graph)",
}

def lm_plan(arguments: dict, extra: dict) -> bool:
    """The causal LM's part, while traced: True where its call has labels over a padded batch (a 2D mask)."""
    mask = arguments.get("attention_mask")
    labelled = any(isinstance(x, torch.Tensor) for x in (arguments.get("labels"), extra.get("shift_labels")))
    return labelled and isinstance(mask, torch.Tensor) and mask.dim() == 2


class lm_in_graph:  # noqa: N801 (used as a function, `with lm_in_graph(plan):`)
    """For the traced span of a causal LM's call, what its base model's forward plans by. A class, not a
    contextlib.contextmanager: dynamo before torch 2.7 refuses those in a graph that may not break."""

    def __init__(self, labels_over_padding: bool) -> None:
        self.labels_over_padding = labels_over_padding

    def __enter__(self) -> None:
        GRAPH_LABELS[0] = self.labels_over_padding

    def __exit__(self, *exc: object) -> None:
        GRAPH_LABELS[0] = False


def graph_cause(module: nn.Module, arguments: dict, extra: dict, state: Any) -> Optional[str]:
    """Why the base model's traced forward cannot be served in the graph (a key of IN_GRAPH, or a step-aside cause
    of its own name), or None."""
    config, mask = module.config, arguments.get("attention_mask")
    padded = isinstance(mask, torch.Tensor)
    if weights_wanted(config, arguments, extra):
        return "output_attentions"
    refused = config_cause(config)
    if refused is not None:
        return refused
    if padded and padding_into_mixers(config):
        return "padding_into_mixer"  # its padding's place cannot be read in the graph
    if padded and GRAPH_LABELS[0]:
        return "labels"
    if given_cache(arguments, extra) is not None:
        return "cache"
    if cross_attends(arguments, extra):
        return "cross_attention"  # as outside a graph: the whole forward on transformers' attention
    window = sliding_window(config)
    tokens = input_tokens(arguments)
    if padded and window is not None and tokens is not None and window < tokens.shape[1]:
        return "window"
    topk = index_topk(config)
    if topk is not None and tokens is not None and tokens.shape[1] > topk:
        return "sparse_attention"  # a row's padding or documents are data: counted by its columns
    cause = modeling_cause(type(module).__module__, type(module).__qualname__)
    if cause:
        return cause
    if module.training and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return "dropout"
    if not getattr(state.backend, "in_graph", False):
        return "backend"
    positions = arguments.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() != 2:
        return "positions"
    if ulysses_wrapper(attn_name(config)) is not None:
        return "sequence_parallel"
    family = getattr(config, "model_type", None)
    return untrusted_in_graph(type(module).__module__, type(module).__qualname__, family) or None


def asides_in_graph(state_of: Callable[[], Any]) -> Callable[[str], bool]:
    """A function that steps a traced forward aside for a reason of IN_GRAPH (as `compiled_fullgraph`, in its words)
    or a step-aside cause of its own and returns True: counted and warned once while dynamo traces (its result a
    constant of the graph: nothing of it runs there), refused in strict mode. `state_of`: the patch state, read then."""

    def make(reason: str) -> Callable[[], bool]:
        def aside() -> bool:
            state = state_of()
            if reason in IN_GRAPH:
                what = IN_GRAPH[reason].format(backend=state.backend.name)
                step_aside(state, "compiled_fullgraph", {}, {}, what)
            else:
                step_aside(state, reason, {}, {})
            return True

        return torch._dynamo.assume_constant_result(aside)

    table = {reason: make(reason) for reason in (*IN_GRAPH, *CAUSES)}

    def aside(reason: str) -> bool:
        return table[reason]()

    return aside


@contextlib.contextmanager
def routed_in_graph(config: Any, state: Any, arguments: dict) -> Iterator[None]:
    """For the traced span of the base model's forward: its masks and attention go to patchkit's name on `state`;
    a caller's position_ids with no mask may hold packed documents (patchkit's rule, cache or not: a forward that
    makes its own cache reads them as its attention does eagerly, `cached`)."""
    name = attn_name(config)
    positions, mask = arguments.get("position_ids"), arguments.get("attention_mask")
    by_position = mask is None and positions is not None
    one_row = isinstance(mask, torch.Tensor) and mask.dim() == 2 and len(mask) == 1
    flash_ones = one_row and positions is not None and flash_masks_in_graph(name)
    flat = (by_position or flash_ones) and isinstance(positions, torch.Tensor) and positions.dim() == 2
    module = arguments.get("self")
    cached = module is not None and resolved_use_cache(module, arguments.get("use_cache"))
    if by_position and cached and not flash_masks_in_graph(name):
        kept_apart_in_graph()  # transformers' sdpa and eager find no documents behind the cache: said as traced
    GRAPH_ROUTE[0] = GraphPlan(state, by_position, positions if flat else None, cached, flash_ones and flat)
    set_attn_name(config, ROUTE_NAME)
    try:
        yield
    finally:
        set_attn_name(config, name)
        GRAPH_ROUTE[0] = None


def mask_in_graph(kwargs: dict, name_alone: Callable[[], Any]) -> GraphMask | str:
    """The mask builder's part, while traced: the graph mask of a forward planned in the graph, or the reason it steps
    aside (a key of IN_GRAPH, or a step-aside cause).

    A forward under the registered name alone (no patched forward planned it; `name_alone()` gives its state) is
    served where it has no padding, no past and a plain causal (or sliding) pattern. Dynamo cannot read the closures
    of a mask function made in the graph, only its name: transformers' `and_masks` of a forward a patched model
    planned is packed documents (the model's own source was checked for other patterns, `modeling_cause`),
    whose sequence indices the layers compute from position_ids as transformers does. Under the name alone nothing
    planned it: a sliding window's, documents' or the model's own pattern, it steps aside as "joined".
    """
    mask, window, function = kwargs.get("attention_mask"), kwargs.get("local_size"), kwargs.get("mask_function")
    plan = GRAPH_ROUTE[0]
    kind = "expressible" if function is None else mask_kind(function)
    packed = kind == "joining"
    if kind == "beyond":
        return "custom_mask_pattern"
    if packed and plan is None:
        return "joined"  # the name alone: a window, documents or the model's own pattern, unread in the graph
    q_length, kv_length = mask_queries(kwargs), kwargs.get("kv_length")
    if kv_length is None or q_length is None:
        return "cache"  # where the queries sit is unknown: planned for no past only
    if kv_length != q_length:
        return "cache"  # a past, or a static cache's slots
    topk = index_topk(kwargs.get("config"))
    if topk is not None and kv_length > topk:
        return "sparse_attention"  # as `graph_cause`, for the name alone
    if plan is None:
        if mask is not None:
            return "name_alone"
        plan = GraphPlan(name_alone(), packed)  # transformers' own rule: documents where it found them
    if mask is not None and window is not None and window < mask.shape[-1]:
        return "window"
    # where transformers' own mask packs documents (by the position_ids it was handed), a layer handed none reads
    # them from the forward's own
    ones = plan.flash_ones and mask is not None  # the mask's rows have no padding: documents by position
    return GraphMask(mask, (plan.by_position and mask is None) or ones, Route(plan.state), window,
                     plan.positions if (packed and mask is None) or ones else None, plan.cached)


def _modeling_cause(module_name: str, class_name: str) -> str:
    """What in a base model's modeling code the in-graph path does not serve, read from its source once per class
    (run while traced): "custom_mask_pattern" where its forward asks transformers for a mask beyond causal, sliding
    and packed (bidirectional spans, chunks, a caller's and/or mask functions), "sinks" where its module passes
    attention sinks (`s_aux`), else "". A decoder's encoder mask (`create_bidirectional_mask`, GPT-2 built with
    cross-attention) is not such a pattern: `graph_cause` steps a forward given encoder states aside by name, and a
    bare bidirectional mask is told at the mask call by its name."""
    key = (module_name, class_name)
    if key not in _MODELING:
        module = sys.modules[module_name]
        method = unpatched(getattr(getattr(module, class_name, None), "forward", None))
        try:
            forward, whole = inspect.getsource(method), inspect.getsource(module)
        except (OSError, TypeError):  # unreadable: assume the worst, step aside
            forward, whole = PATTERN_MARKERS[0], ""
        forward = forward.replace(ENCODER_MASK, "")
        _MODELING[key] = ("custom_mask_pattern" if any(m in forward for m in PATTERN_MARKERS)
                          else "sinks" if "s_aux" in whole else "")
    return _MODELING[key]


ENCODER_MASK = "create_bidirectional_mask("  # cross-attention's mask over the encoder's tokens
PATTERN_MARKERS = ("or_mask_function", "and_mask_function", "block_sequence_ids", "chunked", "bidirectional")
_MODELING: dict[tuple[str, str], str] = {}
modeling_cause = torch._dynamo.assume_constant_result(_modeling_cause)  # run while traced
flash_masks_in_graph = torch._dynamo.assume_constant_result(loads_flash_masks)  # run while traced


def _kept_apart_in_graph() -> bool:
    """`documents.kept_apart` for a compiled forward given position_ids and no mask that makes or is given a cache:
    whether they restart is data the graph does not read, so it is said where they may."""
    kept_apart("find no documents behind the KV cache this forward makes or is given (a compiled forward cannot "
               "read whether its position_ids restart: said where they may; use_cache=False has them find them)")
    return True


kept_apart_in_graph = torch._dynamo.assume_constant_result(_kept_apart_in_graph)  # run while traced
