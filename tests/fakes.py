"""Simulated machines and a recording stand-in for the `flash_attn` package (no GPU here)."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from typing import Optional

import flash_stand_in as stand_in
import pytest
import torch
from packaging.version import Version

from patchkit import gates
from patchkit.backends import sdpa

# The GPU machine these tests play runs a torch with varlen_attn (>= 2.10): the installed torch where it has one, else
# 2.13 (on torch 2.6 the torch_varlen gates would otherwise fail on the version where a test means another gate)
GPU_TORCH = torch.__version__ if importlib.util.find_spec("torch.nn.attention.varlen") else "2.13.0+cu130"
GPU_ENV = gates.Environment(
    torch_version=GPU_TORCH, transformers_version=gates.probe_environment().transformers_version,
    flash_attn_version="2.8.3", flash_attn_error=None, cuda_available=True, device_name="NVIDIA A100-SXM4-80GB",
    compute_capability=(8, 0), bf16_supported=True,
)


def env(**changes) -> gates.Environment:
    return dataclasses.replace(GPU_ENV, **changes)


class RecordingFlashAttn(types.ModuleType):
    """Checks every call against flash-attn's CUDA-side contract, records it, computes with the sdpa backend."""

    def __init__(self) -> None:
        super().__init__("flash_attn")
        self.__version__ = "2.8.3"
        self.calls: list[dict] = []

    def _check(self, name, tensors, cu_q, cu_k, max_q, max_k, softmax_scale, causal, dropout_p, kw=None):
        dtypes = {t.dtype for t in tensors}
        assert dtypes <= {torch.float16, torch.bfloat16} and len(dtypes) == 1, f"{name}: dtypes {dtypes}"
        assert all(t.stride(-1) == 1 for t in tensors), f"{name}: last dim not contiguous"
        for cu in (cu_q, cu_k):
            assert cu.dtype == torch.int32 and cu.dim() == 1 and cu[0] == 0, f"{name}: bad cu_seqlens {cu}"
        assert isinstance(max_q, int) and max_q == int(cu_q.diff().max()), f"{name}: max_seqlen_q {max_q}"
        assert isinstance(max_k, int) and max_k == int(cu_k.diff().max()), f"{name}: max_seqlen_k {max_k}"
        assert tensors[0].shape[-1] <= 256
        self.calls.append(
            dict(name=name, shapes=[tuple(t.shape) for t in tensors], dtype=tensors[0].dtype, cu_q=cu_q.tolist(),
                 cu_k=cu_k.tolist(), max_q=max_q, max_k=max_k, softmax_scale=softmax_scale, causal=causal,
                 dropout_p=dropout_p, **(kw or {}))
        )

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, **kw):
        assert q.dim() == k.dim() == v.dim() == 3 and k.shape[:2] == v.shape[:2] and q.shape[1] % k.shape[1] == 0
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "varlen: q, k and v of one head size (flash-attn 2)"
        self._check("varlen", [q, k, v], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, dropout_p, kw)
        return stand_in.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               dropout_p, softmax_scale, causal, **kw)

    def flash_attn_varlen_qkvpacked_func(self, qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, **kw):
        assert qkv.dim() == 4 and qkv.shape[1] == 3
        self._check("qkvpacked", [qkv], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, causal,
                    dropout_p, kw)
        return stand_in.flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                                     **kw)

    def flash_attn_varlen_kvpacked_func(self, q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        dropout_p=0.0, softmax_scale=None, causal=False, **kw):
        assert q.dim() == 3 and kv.dim() == 4 and kv.shape[1] == 2 and q.shape[1] % kv.shape[2] == 0
        self._check("kvpacked", [q, kv], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, dropout_p, kw)
        return stand_in.flash_attn_varlen_kvpacked_func(
            q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, **kw
        )

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
        """flash-attn >= 2.6.1's checks; row b attends to k_cache[b, cache_leftpad[b]:cache_seqlens[b]], causal
        aligned bottom-right among those keys (its tests' reference), computed per row by the sdpa backend."""
        if cache_leftpad is not None:
            assert Version(self.__version__) >= Version("2.6.1"), "cache_leftpad passed to a flash-attn without it"
        batch, seqlen_q, heads, _ = q.shape
        assert q.dim() == k_cache.dim() == v_cache.dim() == 4 and k_cache.shape == v_cache.shape
        assert k_cache.shape[0] == batch and heads % k_cache.shape[2] == 0
        assert {q.dtype, k_cache.dtype, v_cache.dtype} <= {torch.float16, torch.bfloat16} and \
            len({q.dtype, k_cache.dtype, v_cache.dtype}) == 1, "kvcache: dtypes"
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
        assert k is None and v is None and rotary_cos is None and block_table is None and cache_batch_idx is None
        assert cache_seqlens.dtype == torch.int32 and tuple(cache_seqlens.shape) == (batch,)
        ends = cache_seqlens.tolist()
        starts = [0] * batch
        if cache_leftpad is not None:
            assert cache_leftpad.dtype == torch.int32 and tuple(cache_leftpad.shape) == (batch,)
            starts = cache_leftpad.tolist()
        assert all(0 <= s <= e <= k_cache.shape[1] for s, e in zip(starts, ends)), (starts, ends)
        self.calls.append(dict(
            name="kvcache", shapes=[tuple(q.shape), tuple(k_cache.shape)], dtype=q.dtype,
            cache_seqlens=ends, cache_leftpad=None if cache_leftpad is None else starts,
            storage=(k_cache.untyped_storage().data_ptr(), v_cache.untyped_storage().data_ptr()),
            softmax_scale=softmax_scale, causal=causal,
            **{key: val for key, val in (("window_size", tuple(window_size)), ("softcap", softcap))
               if val not in ((-1, -1), 0.0)},
        ))
        rows = [stand_in.flash_attn_func(q[b : b + 1], k_cache[b : b + 1, s:e], v_cache[b : b + 1, s:e],
                                     softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                     softcap=softcap)
                for b, (s, e) in enumerate(zip(starts, ends))]
        return torch.cat(rows)


def install_flash_double(monkeypatch) -> RecordingFlashAttn:
    """Put the double in sys.modules (with a CUDA extension module) and pretend to be an A100."""
    fake = RecordingFlashAttn()
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setitem(sys.modules, "flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
    monkeypatch.setattr(gates, "probe_environment", lambda: GPU_ENV)
    return fake


NO_FLASH_GPU_ENV = env(flash_attn_version=None, flash_attn_error="not installed (No module named 'flash_attn')")


class RecordingTorchVarlen:
    """Stands in for torch's `varlen_attn` (CUDA only): binds each call to the installed torch's real signature,
    checks what the kernel needs, records it, and computes what torch 2.13 computes with the sdpa reference."""

    def __init__(self, signature: Optional[inspect.Signature] = None, follows_sdpa_kernel: bool = False) -> None:
        from torch.nn.attention import varlen

        self.follows_sdpa_kernel = follows_sdpa_kernel  # torch 2.15's rule: only on SDPA's enabled backends
        self.signature = signature or inspect.signature(varlen.varlen_attn)
        self.__signature__ = self.signature  # what inspect.signature(double) reports, as for the real function
        self.calls: list[dict] = []

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)  # TypeError on any argument torch's function does not take
        bound.apply_defaults()
        a = bound.arguments
        q, k, v = a["query"], a["key"], a["value"]
        cu_q, cu_k, max_q, max_k = a["cu_seq_q"], a["cu_seq_k"], a["max_q"], a["max_k"]
        assert q.dim() == k.dim() == v.dim() == 3 and k.shape == v.shape, "q/k/v must be (T, H, D)"
        assert {q.dtype, k.dtype, v.dtype} <= {torch.float16, torch.bfloat16} and q.dtype == k.dtype == v.dtype
        assert all(t.stride(-1) == 1 for t in (q, k, v)), "last dim not contiguous"
        assert q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
        for cu, total in ((cu_q, q.shape[0]), (cu_k, k.shape[0])):
            assert cu.dtype == torch.int32 and cu.dim() == 1 and cu[0] == 0 and cu[-1] == total, f"bad cu_seq {cu}"
        assert cu_q.numel() == cu_k.numel()
        assert isinstance(max_q, int) and max_q == int(cu_q.diff().max()), f"max_q {max_q}"
        assert isinstance(max_k, int) and max_k == int(cu_k.diff().max()), f"max_k {max_k}"
        window = a["window_size"]
        assert isinstance(window, tuple) and len(window) == 2, f"window_size {window!r}: torch compares a tuple"
        assert q.shape[1] % k.shape[1] == 0 and (a.get("enable_gqa") or q.shape[1] == k.shape[1])
        assert all(a.get(name) is None for name in ("return_aux", "seqused_k", "block_table"))
        assert isinstance(a["scale"], float)
        if self.follows_sdpa_kernel and not torch._C._get_flash_sdp_enabled():  # cuDNN never takes a CPU tensor
            raise RuntimeError("No viable backend for varlen_attn. Enable SDPBackend.FLASH_ATTENTION "
                               "or SDPBackend.CUDNN_ATTENTION with sdpa_kernel().")  # torch 2.15's words
        is_causal = window == (-1, 0)  # torch 2.13's own rule (varlen.py): causal is exactly this window
        self.calls.append(dict(shapes=[tuple(t.shape) for t in (q, k, v)], dtype=q.dtype, cu_q=cu_q.tolist(),
                               cu_k=cu_k.tolist(), max_q=max_q, max_k=max_k, scale=a["scale"], window=window,
                               enable_gqa=a.get("enable_gqa")))
        out, _ = sdpa.varlen_attention(
            q, k, v, cu_q.diff().tolist(), cu_k.diff().tolist(), 0.0, a["scale"], is_causal,
            (-1, -1) if is_causal else window,
        )
        return out


def install_torch_varlen_double(
    monkeypatch, environment: gates.Environment = NO_FLASH_GPU_ENV, signature: Optional[inspect.Signature] = None,
    follows_sdpa_kernel: bool = False,
) -> RecordingTorchVarlen:
    """Put the double where the backend looks it up, and pretend to be an A100 without flash-attn (and, with
    `follows_sdpa_kernel`, a torch from 2.15, whose varlen_attn runs only on SDPA's enabled backends). Skips on a
    torch before 2.10, which has no varlen_attn to stand in for (the backend's torch_version gate turns it away)."""
    varlen = pytest.importorskip("torch.nn.attention.varlen", reason=f"torch {torch.__version__} has no varlen_attn")
    from patchkit.backends import torch_varlen

    fake = RecordingTorchVarlen(signature, follows_sdpa_kernel)
    if follows_sdpa_kernel:  # patchkit reads which torch it runs on: this one is 2.15's
        monkeypatch.setattr(torch_varlen, "OBEYS_SDPA_KERNEL", True)
    monkeypatch.setattr(varlen, "varlen_attn", fake)
    monkeypatch.setattr(gates, "probe_environment", lambda: environment)
    return fake


def install_transformers_flash_attention_2(monkeypatch) -> None:
    """transformers' own "flash_attention_2" (its `_flash_attention_forward`, 4.56+) on the CPU: flash-attn's Python
    functions from the stand-in, and transformers told flash-attn 2 is available, as on a GPU machine with it."""
    from transformers import modeling_flash_attention_utils as fa_utils

    if not hasattr(fa_utils, "_lazy_imports"):
        pytest.skip("this transformers imports flash-attn when its module loads (the stand-in hooks its lazy import)")
    package = types.ModuleType("flash_attn")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # transformers' package probes read it
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = fa_utils._pad_input, fa_utils._unpad_input
    package.flash_attn_func, package.flash_attn_varlen_func = stand_in.flash_attn_func, stand_in.flash_attn_varlen_func
    package.flash_attn_with_kvcache, package.bert_padding = None, padding
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.bert_padding", padding)
    monkeypatch.setattr(fa_utils, "is_flash_attn_2_available", lambda *args, **kwargs: True)
    _forget_transformers_flash_imports(monkeypatch, fa_utils)


def _forget_transformers_flash_imports(monkeypatch, fa_utils: types.ModuleType) -> None:
    """Clear what transformers' flash integration imported lazily (4.57: the functions; 5.x: also their name), so
    that its next call imports the stand-in installed now."""
    for loaded in ("_flash_fn", "_flash_varlen_fn", "_pad_fn", "_unpad_fn", "_process_flash_kwargs_fn",
                   "_loaded_implementation"):
        if hasattr(fa_utils, loaded):
            monkeypatch.setattr(fa_utils, loaded, None)


def install_transformers_flash_attention_3(monkeypatch) -> types.ModuleType:
    """transformers' own "flash_attention_3" (5.x) on the CPU: `flash_attn_interface` is the recording flash-attn 3
    stand-in (`flash3_stand_in.py`), and transformers is told flash-attn 3 is available (an H100 with the Hopper build
    installed). Returns the stand-in."""
    from flash3_stand_in import RecordingFlash3
    from transformers import modeling_flash_attention_utils as fa_utils

    if not hasattr(fa_utils, "is_flash_attn_3_available") or not hasattr(fa_utils, "_lazy_imports"):
        pytest.skip("this transformers has no flash_attention_3 it imports lazily")
    fake = RecordingFlash3()
    fake.__spec__ = importlib.machinery.ModuleSpec("flash_attn_interface", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake)
    monkeypatch.setattr(fa_utils, "is_flash_attn_3_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(fa_utils, "is_flash_attn_2_available", lambda *args, **kwargs: False)
    _forget_transformers_flash_imports(monkeypatch, fa_utils)
    return fake


def install_transformers_flash_attention_4(monkeypatch) -> types.ModuleType:
    """transformers' own "flash_attention_4" (5.x) on the CPU: `flash_attn.cute` is the recording flash-attn 4
    stand-in, the one patchkit's flash_attn_4 backend calls too (an H100 with flash-attn-4 installed), and transformers
    is told flash-attn 4 is available. transformers hands the kernel the max lengths it reads from position_ids as
    0-dim tensors, which the stand-in, strict about patchkit's calls, takes as ints. Returns the stand-in."""
    import functools

    from flash4_stand_in import install_flash4_double
    from transformers import modeling_flash_attention_utils as fa_utils

    if not hasattr(fa_utils, "is_flash_attn_4_available"):
        pytest.skip("this transformers has no flash_attention_4")
    fake = install_flash4_double(monkeypatch)
    strict = fake.flash_attn_varlen_func

    @functools.wraps(strict)  # transformers reads the kernel's arguments from its signature
    def varlen(*args, **kwargs):
        for hint in ("max_seqlen_q", "max_seqlen_k"):
            if isinstance(kwargs.get(hint), torch.Tensor):
                kwargs[hint] = int(kwargs[hint])
        return strict(*args, **kwargs)

    fake.flash_attn_varlen_func = fake.flash_attn_func = varlen  # the batch layout: the same function, no cu_seqlens
    package = types.ModuleType("flash_attn")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    package.__path__, package.cute = [], fake
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setattr(fa_utils, "is_flash_attn_4_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(fa_utils, "is_flash_attn_2_available", lambda *args, **kwargs: False)
    _forget_transformers_flash_imports(monkeypatch, fa_utils)
    return fake
