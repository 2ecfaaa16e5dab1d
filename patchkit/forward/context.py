"""What one model forward tells the code it calls, as one object: mask builders and attention read it, the patched
forwards set it, so nested and concurrent forwards never see each other's."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:
    from patchkit.forward.metadata import BlockQueries, VarlenMetadata


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """What one base model's forward is, decided once from its arguments (`hooks/decide/plan.py`), for every mask
    builder and layer it runs.

    - `aside`: the cause it steps aside for (mask builders hand over to transformers', so its layers and their
      checkpoint recomputes run transformers' attention), or None: served.
    - `padded`: the padded batch's metadata when the forward unpadded its batch into one packed row itself (a mask
      patchkit cannot serve there raises `PaddedOnly`: the forward reruns padded, stepped aside), else None.
    - `packed`: the documents of its rows, which mask builders given no mask hand the layers (the packed row's, or
      caller-made `cu_seq_lens`), else None.
    - `no_mask`: its caller gave no attention_mask (position_ids may define documents).
    - `own_cache`: unpadded, it returns a KV cache its caller did not bring, which the model would make itself: the
      forward makes it and fills it padded.
    - `blocks`: its queries that also see the later keys of their block (an image's), in the unpadded rows
      (`forward/metadata.py`), which its layers' metadata carry; else None.
    - `mask_decides`: its layers are not causal by their config (PaliGemma's Gemma), and attend as the mask read back
      (or a single query) says, which the varlen path serves: their `is_causal=False` is no refusal.
    - `joined`: how transformers' own sdpa or eager run of the call would let its caller's packed documents see each
      other, which its layers keep apart (said once after it runs), else None.
    """

    aside: Optional[str] = None
    padded: Optional[VarlenMetadata] = None
    packed: Optional[VarlenMetadata] = None
    no_mask: bool = False
    own_cache: bool = False
    blocks: Optional[BlockQueries] = None
    mask_decides: bool = False
    joined: Optional[str] = None

    @property
    def unpadded(self) -> bool:
        return self.padded is not None


NO_PLAN = ForwardPlan()  # outside any patched base model's forward


class ForwardContext:
    """What the forward running in this context carries. Immutable: `within` sets fields for the span of a block.

    Lifetimes, by who sets each field:
    - `plan`: the base model's forward, for its call (`ForwardPlan`).
    - `lm_cause`: the causal LM's forward, for its call: what of it reads padding positions (labels,
      generate()'s next token), for the base model's forward to step aside for.
    - `route`: one routed forward or attention call, for its span: the patch state (and sequence-parallel wrapper)
      that the registered attention name serves it on. Masks built within the span carry it (`VarlenMask.route`):
      layers read it there, which a compiled graph can do without a break.
    - `generating`: generate()'s preparation of a step's inputs under the registered name, for its span (the
      masks built there are made before the model runs): whether patchkit places the cache it was given.
    - `head`: the causal LM's forward, for its call: its ask of the base model for the packed row of real tokens
      (`hooks/head/head_request.HeadRequest`), which the base model's forward takes (its own calls run without it)
      and answers.
    What must outlive the forward (a checkpoint's recompute in backward) rides the mask object instead.
    """

    __slots__ = ("plan", "lm_cause", "route", "generating", "head")

    def __init__(self, plan: ForwardPlan = NO_PLAN, lm_cause: Optional[str] = None, route: Any = None,
                 generating: Optional[bool] = None, head: Any = None) -> None:
        self.plan, self.lm_cause, self.route, self.generating, self.head = plan, lm_cause, route, generating, head

    def replace(self, **fields: Any) -> ForwardContext:
        """A copy with `fields` changed."""
        values = {name: getattr(self, name) for name in self.__slots__}
        values.update(fields)
        return ForwardContext(**values)

    def __repr__(self) -> str:
        return "ForwardContext(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__) + ")"


class PaddedOnly(Exception):
    """Raised inside a forward the base model unpadded itself, by a mask builder asked for what only transformers'
    attention serves (`cause`): nothing has run that the forward cannot run again padded, stepped aside."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


_NONE = ForwardContext()
_CURRENT: contextvars.ContextVar[Optional[ForwardContext]] = contextvars.ContextVar("patchkit_forward", default=None)


def current() -> ForwardContext:
    """The context of the forward running here (all fields unset outside any patched forward)."""
    return _CURRENT.get() or _NONE


@contextlib.contextmanager
def within(**fields: Any) -> Iterator[None]:
    """Within the block, the current context with `fields` changed; what it was before after it."""
    token = _CURRENT.set(current().replace(**fields))
    try:
        yield
    finally:
        _CURRENT.reset(token)
