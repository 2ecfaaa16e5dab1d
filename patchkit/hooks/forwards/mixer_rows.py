"""Token mixers outside attention (linear attention, convolutions) on the packed row: its rows in groups, as padded.

A hybrid family's linear-attention layers (Qwen3.5's and Qwen3-Next's gated delta rule with its causal convolution)
carry a state along the sequence, so one packed row would carry each row's state into the next. transformers hands
them the padded batch's 2D mask (`create_recurrent_attention_mask`), and they zero the hidden states at padding with
it. When the base model runs on the packed row, patchkit's mask builder hands them `MixerRows` instead (the real
tokens of each padded row), and their wrapped forward runs the rows in groups of similar length, each group right-
padded to its longest row with its own 2D mask (a row alone needs none): what the padded batch computed at its real
tokens, since padding carries nothing into a row's state (the census checks each family that runs this way). The
groups trade a call's fixed cost against the padding a group computes (`row_groups`). The rows travel as the
layer's mask argument, so a checkpointed layer recomputed in backward groups the same way.

A caller's own packed documents (TRL's padding-free rows: `position_ids` restarting, or `cu_seq_lens_*`) run the
same way, each document a row from a zero state, as each document run alone: what attention already does, and what
the mixers' CUDA kernels compute when told the documents (transformers' torch path carries one state across them).
"""

from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from patchkit.forward.context import NO_PLAN, ForwardPlan, current
from patchkit.forward.documents import kept_apart, restart_lengths
from patchkit.forward.liveness import in_one_graph
from patchkit.hooks.install.patching import dressed_as
from patchkit.hooks.install.routing import adopted, names_patchkit
from patchkit.warn import warn_user

# A mixer call's fixed cost in tokens of its work (per layer, forward and backward): on the CPU about 100 at hidden
# 256 (Qwen3.5's gated delta rule, transformers' torch path; less at a real model's width); on CUDA a guess for
# launch-bound kernels at a real model's width, until a GPU measures it
CALL_TOKENS = {"cpu": 128}
CALL_TOKENS_ELSEWHERE = 2048


def row_groups(lengths: tuple[int, ...], call_tokens: int) -> list[list[int]]:
    """The rows (indices into `lengths`) in groups of similar length that cost least: each group one call of
    `call_tokens` plus its rows times its longest row's length (its padding computed too). Rows sorted longest
    first, cut into runs by dynamic programming: a few long rows alone, many short ones together. Cuts fall only
    where the length changes (rows of one length split between two groups cost no less in the later one, whose
    longest they are): the work is the distinct lengths squared, and rows of T tokens in all have fewer than
    sqrt(2T) distinct lengths (thousands of short packed documents: a few milliseconds)."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    cuts = [0, *(j for j in range(1, len(order)) if lengths[order[j]] != lengths[order[j - 1]]), len(order)]
    best, back = [0] * len(cuts), [0] * len(cuts)
    for b in range(1, len(cuts)):
        best[b], back[b] = min((best[a] + call_tokens + (cuts[b] - cuts[a]) * lengths[order[cuts[a]]], a)
                               for a in range(b))
    groups, b = [], len(cuts) - 1
    while b > 0:
        groups.append(order[cuts[back[b]]:cuts[b]])
        b = back[b]
    return groups[::-1]


@dataclasses.dataclass(frozen=True)
class MixerRows:
    """The packed row's stretches, one per row of the padded batch: `lengths` real tokens each, in order."""

    lengths: tuple[int, ...]
    _plans: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def bool(self) -> torch.Tensor:
        """Which tokens of the packed row are real, as the recurrent mask's `.bool()` says of the padded batch: all
        of them (Qwen4-Exp's base model marks its padding ids with it before its PLE layers read them)."""
        return torch.tensor(True)

    def plan(self, device: torch.device) -> tuple[list[Group], torch.Tensor]:
        """This forward's groups on `device`, and where each packed token sits among the groups' tokens (`back`),
        made once for every mixer layer (and its recompute)."""
        plan = self._plans.get(device)
        if plan is None:
            call = CALL_TOKENS.get(device.type, CALL_TOKENS_ELSEWHERE)
            groups = [Group.of(rows, self.lengths, device) for rows in row_groups(self.lengths, call)]
            order = torch.cat([g.source for g in groups])
            back = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=device))
            plan = self._plans[device] = (groups, back)
        return plan


@dataclasses.dataclass(frozen=True)
class Group:
    """Rows run in one call: their tokens' places in the packed row (`source`), in the group's right-padded
    (rows, longest) grid (`grid`, None for one row: a slice), and its 2D mask (None where no row is shorter)."""

    shape: tuple[int, int]
    source: torch.Tensor
    grid: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    start: int

    @staticmethod
    def of(rows: list[int], lengths: tuple[int, ...], device: torch.device) -> Group:
        starts = [sum(lengths[:r]) for r in rows]
        longest = max(lengths[r] for r in rows)
        source = torch.cat([torch.arange(a, a + lengths[r]) for a, r in zip(starts, rows)]).to(device)
        if len(rows) == 1:
            return Group((1, longest), source, None, None, starts[0])
        real = torch.arange(longest)[None] < torch.tensor([lengths[r] for r in rows])[:, None]
        grid = real.flatten().nonzero().squeeze(1).to(device)
        mask = None if bool(real.all()) else real.long().to(device)
        return Group((len(rows), longest), source, grid, mask, starts[0])

    def take(self, packed: torch.Tensor) -> torch.Tensor:
        """The group's (rows, longest, ...) input from a (1, total, ...) tensor of the packed row, zeros at padding."""
        if self.grid is None:
            return packed[:, self.start:self.start + self.shape[1]]
        rows = packed[0].index_select(0, self.source)
        grid = rows.new_zeros((self.shape[0] * self.shape[1], *rows.shape[1:])).index_copy(0, self.grid, rows)
        return grid.view(*self.shape, *rows.shape[1:])

    def give(self, out: torch.Tensor) -> torch.Tensor:
        """The group's real tokens of an output (rows, longest, ...), in the order of `source`."""
        return out[0] if self.grid is None else out.flatten(0, 1).index_select(0, self.grid)


MASK_BUILDER = "create_recurrent_attention_mask"  # transformers' recurrent layers' mask, by the modeling modules' name


def hand_rows(modeling: ModuleType) -> None:
    """From now on `modeling`'s recurrent layers get `MixerRows` for their mask in a forward that runs packed (the
    padded rows), or on a caller's packed documents (`document_rows`), and transformers' mask everywhere else.
    Installed once per module and kept, as patchkit's registered attention name is: a revert between two patches'
    forwards must not leave the other's wrapped mixers a mask of None (one state across every row)."""
    original = getattr(modeling, MASK_BUILDER, None)
    if original is None or getattr(original, "__patchkit_rows__", False):
        return

    def create_recurrent_attention_mask(*args: Any, **kwargs: Any) -> Any:
        if in_one_graph():  # fullgraph=True: no contextvar there, and no forward unpadded at the model (graph_plan)
            return original(*args, **kwargs)
        plan = current().plan
        if plan.padded is not None:
            return MixerRows(tuple(plan.padded.seqlens_q))
        rows = document_rows(plan, **dict(zip(("config", "inputs_embeds", "attention_mask", "cache"), args)), **kwargs)
        return original(*args, **kwargs) if rows is None else rows

    wrapper = dressed_as(create_recurrent_attention_mask, original)
    wrapper.__patchkit_rows__ = True  # type: ignore[attr-defined]
    setattr(modeling, MASK_BUILDER, wrapper)


def _named(config: Any) -> bool:
    """A model part adopted under patchkit's name alone, which names it now: its forwards have no plan (no base
    model's forward is patchkit's), yet its mixers are wrapped (`hooks/name/named.adopt`)."""
    return adopted(config) and names_patchkit(config)


def document_rows(plan: ForwardPlan, config: Any = None, inputs_embeds: Any = None, attention_mask: Any = None,
                  cache: Any = None, position_ids: Any = None, **_: Any) -> Optional[MixerRows]:
    """A served forward's packed documents (no mask: `position_ids` restarting, or the caller's `cu_seq_lens_*`), one
    `MixerRows` row each, in the (B, N) rows' order; None where there are none. A cache takes one state per row (as
    transformers fills it), so there the mixers run transformers' way, across the documents, said once."""
    if plan.aside is not None or attention_mask is not None or (plan is NO_PLAN and not _named(config)):
        return None  # a mask given: no documents, in attention either (transformers reads them from its absence)
    if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() < 3 or inputs_embeds.shape[1] < 2:
        return None
    batch, seqlen = inputs_embeds.shape[:2]
    if plan.packed is not None:
        lengths = list(plan.packed.seqlens_q)
    elif isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[-1] == seqlen:
        lengths = restart_lengths(position_ids, batch)
    else:
        return None
    if len(lengths) <= batch or sum(lengths) != batch * seqlen:
        return None  # one document a row: transformers' own way is the same
    if cache is not None:
        warn_user(
            "patchkit: packed documents (position_ids restarting, or cu_seq_lens) with a cache: this hybrid's "
            "recurrent layers carry their state from one document into the next, as transformers runs them (its "
            "cache holds one state per row), while attention keeps the documents apart. Pass use_cache=False to "
            "run each document from a zero state."
        )
        return None
    kept_apart("carry one state across them in a hybrid's linear-attention, Mamba and convolution layers (their "
               "torch path)")
    return MixerRows(tuple(lengths))


def make_mixer_forward(original: Callable, like: Optional[Callable] = None) -> Callable:
    """A mixer's forward that, given `MixerRows` for its mask, runs the packed row's rows in their groups (its
    arguments bound by `like`'s signature, where `original` takes any)."""
    signature = inspect.signature(like or original)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(v, MixerRows) for v in (*args, *kwargs.values())):
            return original(self, *args, **kwargs)
        return _by_groups(original, signature, self, args, kwargs)

    return dressed_as(forward, original)


@torch.compiler.disable  # calls by the rows' lengths: eager between compiled frames, never a guard on them
def _by_groups(original: Callable, signature: inspect.Signature, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    arguments = signature.bind(module, *args, **kwargs).arguments
    rows = next(_rows(arguments))
    hidden = next(v for v in _tensors(arguments) if v.shape[0] * v.shape[1] == rows.total)
    layout = tuple(hidden.shape[:2])  # (1, total) for the packed row; (B, N) for packed documents in their rows
    groups, back = rows.plan(hidden.device)
    outs = [_call(original, signature, {k: _share(k, v, rows, g, layout) for k, v in arguments.items()})
            for g in groups]
    return _joined(outs, groups, back, layout)


def _rows(arguments: dict) -> Iterator[MixerRows]:
    """The `MixerRows` among the arguments, in a `**kwargs` too: a forward wrapped without `functools.wraps` (an
    accelerate hook's wrapper of transformers' development tree) shows only (self, *args, **kwargs)."""
    for v in arguments.values():
        if isinstance(v, MixerRows):
            yield v
        elif isinstance(v, dict):
            yield from _rows(v)


def _tensors(arguments: dict) -> list[torch.Tensor]:
    found = [v for v in arguments.values() if isinstance(v, torch.Tensor) and v.dim() >= 2]
    return found + [t for v in arguments.values() if isinstance(v, dict) for t in _tensors(v)]


# a caller's documents of the whole row, for the mixers' CUDA kernels: a group's rows are its documents already
DOCUMENT_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _share(name: str, value: Any, rows: MixerRows, group: Group, layout: tuple[int, int]) -> Any:
    """A group's share of an argument: its rows of a per-token tensor (the layout's); its own mask for the rows."""
    if isinstance(value, MixerRows):
        return group.mask
    if name in DOCUMENT_KWARGS:
        return None
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == layout:
        return group.take(value.reshape(1, rows.total, *value.shape[2:]))
    if isinstance(value, dict):  # **kwargs
        return {k: _share(k, v, rows, group, layout) for k, v in value.items() if k not in DOCUMENT_KWARGS}
    return value


def _call(original: Callable, signature: inspect.Signature, arguments: dict) -> Any:
    bound = inspect.BoundArguments(signature, arguments)  # type: ignore[arg-type]
    return original(*bound.args, **bound.kwargs)


def _joined(outs: list, groups: list[Group], back: torch.Tensor, layout: tuple[int, int]) -> Any:
    """The groups' outputs as one packed row (1, total, ...): tensors by their tokens' places, tuples element by
    element. A tuple's element that is not per token (MiniMax's lightning attention returns its final state beside
    its output, which its layer drops) is None: a state of each group's rows is no state of the packed row."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        joined = torch.cat([g.give(o) for o, g in zip(outs, groups)]).index_select(0, back)
        return joined.view(*layout, *joined.shape[1:])
    if isinstance(first, tuple):
        return type(first)(_joined(list(parts), groups, back, layout) if _per_token(parts, groups) else None
                           for parts in zip(*outs))
    raise TypeError(f"a token mixer returned {type(first).__name__}: patchkit joins tensors and tuples of them")


def _per_token(parts: tuple, groups: list[Group]) -> bool:
    return all(isinstance(p, torch.Tensor) and p.dim() >= 2 and tuple(p.shape[:2]) == g.shape
               for p, g in zip(parts, groups))
