"""Llama 4's NoPE layers scale their queries by a temperature read from each token's column: in a packed forward, the
column it had in the padded batch, applied where patchkit's attention receives the queries.

transformers computes `log1p(floor((position + 1) / floor_scale)) * attn_scale + 1` for each query of a NoPE layer,
`position` being `arange(q_len) + past`: the token's column in the batch it was handed (padding counted), not its
position id. On the packed row of real tokens that arange would be the token's place in the row. So in a packed
forward the layer's own scaling is switched off for the call (`attn_temperature_tuning`), and the attention function
scales the queries by the padded batch's columns (`QUERY_SCALE`), with transformers' own operations: a float32
product, cast back to the queries' dtype. The numbers are the padded batch's own, and the layer's MoE and every
other layer run on real tokens.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from patchkit.forward.masks import VarlenMask

QUERY_SCALE = "patchkit_query_scale"  # the keyword the layer's attention call carries the scales in


def column_temperature(module: nn.Module, mask: Any, hidden_states: Any) -> Optional[torch.Tensor]:
    """(1, 1, nnz, 1) float32 query scales of a NoPE layer (`attn_temperature_tuning`, no RoPE) called on the packed
    row of a padded batch, from each token's column there; None for any other layer or call."""
    # read from the instance's dict, then its class: nn.Module's __getattr__ raises (a formatted message) for every
    # other family's layer, in every call
    tuning = vars(module).get("attn_temperature_tuning", getattr(type(module), "attn_temperature_tuning", False))
    if not tuning or getattr(module, "use_rope", True):
        return None
    padded = mask.padded if isinstance(mask, VarlenMask) else None
    if padded is None or padded.indices_q is None or not isinstance(hidden_states, torch.Tensor):
        return None
    if tuple(hidden_states.shape[:2]) != (1, padded.nnz_q):
        return None  # the padded batch itself, or the caller's own rows: transformers' scaling is right there
    columns = (padded.indices_q % padded.q_len).to(hidden_states.device)  # a packed forward has no past
    scales = torch.log1p(torch.floor((columns.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
    return scales.view(1, 1, -1, 1)


@contextlib.contextmanager
def own_scaling_off(module: nn.Module) -> Iterator[None]:
    """The layer's own temperature off for one call (its queries are scaled in the attention function instead)."""
    module.attn_temperature_tuning = False
    try:
        yield
    finally:
        module.attn_temperature_tuning = True


def scaled_query(query: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """`query` (B, H, S, D) times the scales a packed forward's NoPE layer handed on (`QUERY_SCALE`, popped from
    `kwargs`), as transformers scales it: a float32 product cast back; `query` itself where there are none."""
    scales = kwargs.pop(QUERY_SCALE, None)
    return query if scales is None else (query * scales).to(query.dtype)
