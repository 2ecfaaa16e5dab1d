"""A drop-in varlen self-attention module for models that are not transformers models, on patchkit's backends."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from patchkit import gates as _gates
from patchkit.backends import BACKEND_NAMES, Backend, SdpaBackend, make_backend
from patchkit.backends.choice import resolve, serving_backend
from patchkit.errors import PatchInputError
from patchkit.forward.masks import build_metadata
from patchkit.forward.metadata import VarlenMetadata
from patchkit.forward.padding import pad_input, unpad_rows
from patchkit.gates import GateResult
from patchkit.hooks.attention.varlen import half_dtype, to_half
from patchkit.warn import warn_user

FLASH_MIN = "2.0"
FLASH_WHY = "the varlen API"

__all__ = ["VarlenSelfAttention", "resolve_backend"]


def device_gate(device: torch.device) -> GateResult:
    """flash-attn kernels run on CUDA tensors only (checked per call, on the real input)."""
    return GateResult(
        "input_device",
        device.type == "cuda",
        "CUDA tensors",
        str(device),
        "move the module and its inputs to the GPU (.cuda()), or use backend='sdpa'",
    )


def resolve_backend(backend: str, strict: bool, head_dim: int) -> tuple[Backend, list[GateResult]]:
    """Resolve "auto"/"flash_attn"/"sdpa" with the patches' gates: fall back with a warning, or raise if strict."""
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if backend == "sdpa":
        return make_backend("sdpa"), []
    choice = resolve(backend, strict, _gates.probe_environment(), FLASH_MIN, FLASH_WHY, "VarlenSelfAttention", head_dim)
    return make_backend(choice.backend), choice.gates


def _check_padding_mask(mask: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """A (B, S) mask with True/1 = real token; refuse float (additive) masks and wrong shapes."""
    if not isinstance(mask, torch.Tensor):
        raise PatchInputError(f"key_padding_mask must be a tensor or None, got {type(mask).__name__}")
    if mask.is_floating_point():
        raise PatchInputError(
            "key_padding_mask must be bool or integer with True/1 = real token (note: the opposite of "
            "torch.nn.MultiheadAttention's convention); a float mask (additive 0/-inf) is ambiguous and refused"
        )
    if tuple(mask.shape) != (batch, seq):
        raise PatchInputError(
            f"key_padding_mask must have shape (batch, seq) = {(batch, seq)}, got {tuple(mask.shape)}"
        )
    return mask.bool()


class VarlenSelfAttention(nn.Module):
    """Multi-head self-attention on real tokens only: padding is removed before the projections, not masked.

    Differences from `torch.nn.MultiheadAttention`: batch-first input (B, S, E); `causal` is a constructor flag
    (no attention-mask tensor); `key_padding_mask` is (B, S) with True = real token (MultiheadAttention uses
    True = ignore); fewer key/value heads (GQA/MQA) via `num_kv_heads`; the forward returns only the output,
    which is exactly zero at padding positions (and for rows that are all padding); no attention weights.

    Args:
        embed_dim: model width E.
        num_heads: query heads H.
        num_kv_heads: key/value heads; default None = `num_heads`. Must divide `num_heads`.
        causal: each token sees itself and earlier real tokens of its row; default False.
        dropout: attention-probability dropout, applied in training mode only; default 0.0.
        bias: biases on the input and output projections; default True.
        head_dim: per-head size; default `embed_dim // num_heads`.
        softmax_scale: default `head_dim ** -0.5`.
        backend: "auto" (flash_attn, else torch_varlen, else sdpa, with a warning naming the failed gates;
            flash_attn_4 where installed, first on sm90/sm100),
            "flash_attn", "flash_attn_4", "torch_varlen" or "sdpa"; default "auto".
        strict: raise `PatchGateError` instead of falling back or casting; default False.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        *,
        causal: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
        head_dim: Optional[int] = None,
        softmax_scale: Optional[float] = None,
        backend: str = "auto",
        strict: bool = False,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}); pass head_dim")
            head_dim = embed_dim // num_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.causal, self.dropout, self.strict = bool(causal), float(dropout), bool(strict)
        self.softmax_scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
        factory = {"device": device, "dtype": dtype}
        self.in_proj = nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **factory)
        self.backend, self.gates = resolve_backend(backend, self.strict, head_dim)
        self.requested_backend = backend
        self._fallback = SdpaBackend()
        self._warned: set[str] = set()

    @classmethod
    def from_torch(
        cls, mha: nn.MultiheadAttention, *, causal: bool = False, backend: str = "auto", strict: bool = False
    ) -> VarlenSelfAttention:
        """Build one with the weights of a `torch.nn.MultiheadAttention` (same q/k/v/out projections)."""
        if not mha._qkv_same_embed_dim:
            raise ValueError("VarlenSelfAttention is self-attention: kdim and vdim must equal embed_dim")
        if mha.bias_k is not None:
            raise ValueError("add_bias_kv=True has no VarlenSelfAttention equivalent")
        weight = mha.in_proj_weight
        module = cls(
            mha.embed_dim, mha.num_heads, causal=causal, dropout=mha.dropout, bias=mha.in_proj_bias is not None,
            backend=backend, strict=strict, device=weight.device, dtype=weight.dtype,
        )
        with torch.no_grad():
            module.in_proj.weight.copy_(weight)
            module.out_proj.weight.copy_(mha.out_proj.weight)
            if mha.in_proj_bias is not None:
                module.in_proj.bias.copy_(mha.in_proj_bias)
                module.out_proj.bias.copy_(mha.out_proj.bias)
        return module

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, causal={self.causal}, dropout={self.dropout}, backend={self.backend.name}"
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_user(message)

    def _backend_for(self, device: torch.device) -> Backend:
        """The chosen backend, unless it is a kernel backend and the input is not on CUDA or needs dropout (or, on
        flash_attn_4, a backward) it lacks (then the exact fallback with one warning, or raise in strict mode)."""
        return serving_backend(
            self.backend, self._fallback, lambda: device_gate(device),
            ((-1, -1), 0.0, self.dropout if self.training else 0.0, self.head_dim,
             torch.is_grad_enabled() and self.in_proj.weight.requires_grad), strict=self.strict,
            who=f"VarlenSelfAttention on the {self.backend.name} backend", uses="VarlenSelfAttention uses",
            warn_once=self._warn_once,
        )

    def _attend(self, qkv: torch.Tensor, meta: VarlenMetadata, backend: Backend) -> torch.Tensor:
        """(nnz, (H + 2Hk) * D) projections -> (nnz, H, D) attention output, in the input dtype."""
        nnz, h, hk, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        in_dtype = qkv.dtype
        if backend.half_only:
            device_type, weight_dtype = qkv.device.type, self.in_proj.weight.dtype
            (qkv,), backend = to_half(
                (qkv,), lambda: half_dtype(device_type, weight_dtype), self.strict, "VarlenSelfAttention",
                self._warn_once, backend, self._fallback,
            )
        dropout_p = self.dropout if self.training else 0.0
        options = {"dropout_p": dropout_p, "softmax_scale": self.softmax_scale, "causal": self.causal}
        q = qkv[:, : h * d].view(nnz, h, d)  # views of the one projection: no copy for the kernel
        k, v = qkv[:, h * d :].view(nnz, 2, hk, d).unbind(1)
        return backend.varlen(q, k, v, meta, **options).to(in_dtype)

    def forward(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, S, E), key_padding_mask (B, S) with True = real token -> (B, S, E), zero at padding."""
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise PatchInputError(f"expected input (batch, seq, {self.embed_dim}), got {tuple(x.shape)}")
        batch, seq, _ = x.shape
        mask = None if key_padding_mask is None else _check_padding_mask(key_padding_mask, batch, seq)
        meta = build_metadata(mask, batch, seq, seq, x.device)
        tokens = unpad_rows(x, meta.indices_q)
        qkv = self.in_proj(tokens)
        if meta.nnz_q == 0:  # nothing is real: no kernel call; an empty slice keeps the graph (zero gradients)
            attn = qkv[:, : self.num_heads * self.head_dim]
        else:
            attn = self._attend(qkv, meta, self._backend_for(x.device)).reshape(meta.nnz_q, -1)
        out = self.out_proj(attn)
        if meta.indices_q is None:
            return out.view(batch, seq, self.embed_dim)
        return pad_input(out, meta.indices_q, batch, seq)
