"""What flash-attn users hit: int32 overflow in the varlen backward, and helpers whose arity changed (2.7)."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest
import torch
from fakes import RecordingFlashAttn
from models import labels_for, padded_batch, tiny_model

import patchkit
from patchkit import PatchInputError
from patchkit.backends.flash_attn import FlashAttnBackend
from patchkit.backends.limits import INT32_LIMIT, rounded_head_dim
from patchkit.backends.torch_varlen import TorchVarlenBackend
from patchkit.forward.metadata import VarlenMetadata
from patchkit.forward.padding import unpad_input

ROOT = Path(__file__).resolve().parents[1]
# all that patchkit may call: the kernels
KERNELS = {"flash_attn_varlen_func", "flash_attn_with_kvcache"}
OPTS = {"dropout_p": 0.0, "softmax_scale": 0.1, "causal": True}


def packed_meta(lengths: list[int]) -> VarlenMetadata:
    """Metadata of one packed row of documents `lengths` (no padding), built without a (T,) index tensor."""
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    total = sum(lengths)
    return VarlenMetadata(1, total, total, None, None, cu, cu, max(lengths), max(lengths), lengths, lengths)


def huge(*shape: int, grad: bool = True) -> torch.Tensor:
    """A bf16 tensor of `shape` that costs one row of memory (stride 0 on the token axis)."""
    return torch.zeros(1, *shape[1:], dtype=torch.bfloat16, requires_grad=grad).expand(*shape)


def backends() -> list:
    """Both FlashAttention-2 backends, with kernels that only record that they were reached."""
    reached: list[str] = []
    fa = types.SimpleNamespace(
        __version__="2.8.3",
        flash_attn_varlen_func=lambda *a, **k: reached.append("flash_attn") or "kernel",
    )
    return [(FlashAttnBackend(module=fa), reached), (TorchVarlenBackend(fn=lambda *a, **k: "kernel"), reached)]


@pytest.mark.parametrize("which", [0, 1], ids=["flash_attn", "torch_varlen"])
def test_a_packed_batch_past_int32_in_backward_is_refused_naming_size_and_fix(which):
    backend, _ = backends()[which]
    heads, head_dim, total = 32, 128, 600_000  # (600_000 + 128) x 32 x 128 = 2.46e9 >= 2**31
    with pytest.raises(PatchInputError) as err:
        kv = huge(total, 2, 8, head_dim)
        backend.varlen(huge(total, heads, head_dim), kv[:, 0], kv[:, 1], packed_meta([total]), **OPTS)
    text = str(err.value)
    assert f"{(total + 128) * heads * head_dim:,} elements" in text and "2**31" in text
    assert "smaller micro-batch" in text and "backend='sdpa'" in text and backend.name in text


@pytest.mark.parametrize("which", [0, 1], ids=["flash_attn", "torch_varlen"])
def test_many_short_documents_count_the_128_rows_per_sequence(which):
    """400_000 tokens are 1.6e9 elements of q, but 40_000 documents add 128 rows each to the dq accumulator."""
    backend, _ = backends()[which]
    heads, head_dim = 32, 128
    meta = packed_meta([10] * 40_000)
    q = huge(400_000, heads, head_dim)
    assert q.numel() < INT32_LIMIT
    with pytest.raises(PatchInputError, match=r"dq accumulator.*batch 40000"):
        backend.varlen(*huge(400_000, 3, heads, head_dim).unbind(1), meta, **OPTS)


def test_just_under_the_limit_and_forward_only_calls_reach_the_kernel():
    (flash, reached), (varlen, _) = backends()
    heads, head_dim, total = 32, 128, 500_000  # (500_000 + 128) x 4096 = 2.05e9 < 2**31
    assert (total + 128) * heads * rounded_head_dim(head_dim) < INT32_LIMIT
    q, kv = huge(total, heads, head_dim), huge(total, 2, 8, head_dim)
    assert flash.varlen(q, kv[:, 0], kv[:, 1], packed_meta([total]), **OPTS) == "kernel" and reached == ["flash_attn"]
    # K/V with the queries' heads: a GQA call on a torch without enable_gqa repeats them, 2 x 4.9 GB on this CPU
    big_q, big_kv = huge(600_000, heads, head_dim), huge(600_000, 2, heads, head_dim)
    with torch.no_grad():  # no backward, no 32-bit dq accumulator: the forward kernel indexes in 64 bits
        assert varlen.varlen(big_q, big_kv[:, 0], big_kv[:, 1], packed_meta([600_000]), **OPTS) == "kernel"
    assert rounded_head_dim(72) == 96 and rounded_head_dim(160) == 192 and rounded_head_dim(256) == 256


def flash_helpers(arity: int) -> tuple[types.ModuleType, list[str]]:
    """flash_attn.bert_padding as flash-attn `arity` == 4 (<= 2.6) or 5 (>= 2.7) has it, recording every call."""
    called: list[str] = []
    mod = types.ModuleType("flash_attn.bert_padding")

    def helper(name):
        def fn(*args, **kwargs):
            called.append(name)
            if name == "unpad_input":
                return unpad_input(*args[:2])[:arity]
            raise AssertionError(f"patchkit called flash_attn.bert_padding.{name}")
        return fn

    for name in ("unpad_input", "pad_input", "index_first_axis", "index_put_first_axis"):
        setattr(mod, name, helper(name))
    return mod, called


class WatchedFlashAttn(RecordingFlashAttn):
    """The recording double, also noting every public attribute patchkit reads from the `flash_attn` module."""

    def __init__(self) -> None:
        super().__init__()
        self.read: set[str] = set()

    def __getattribute__(self, name: str):
        if not name.startswith("_") and name not in ("calls", "read"):
            object.__getattribute__(self, "read").add(name)
        return super().__getattribute__(name)


@pytest.mark.parametrize("arity", [4, 5], ids=["unpad_input_4_values_le_2.6", "unpad_input_5_values_ge_2.7"])
@pytest.mark.parametrize("patch", ["llama1", "llama2"])
def test_patchkit_reads_only_the_kernels_from_flash_attn(monkeypatch, arity, patch):
    from fakes import GPU_ENV

    from patchkit import gates

    fake = WatchedFlashAttn()
    helpers, called = flash_helpers(arity)
    fake.bert_padding = helpers
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setitem(sys.modules, "flash_attn.bert_padding", helpers)
    monkeypatch.setitem(sys.modules, "flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
    monkeypatch.setattr(gates, "probe_environment", lambda: GPU_ENV)
    model = tiny_model(kv_heads=4, dtype=torch.bfloat16).train()
    ids, mask = padded_batch("mixed")
    with patchkit.apply_patch(patch, strict=True) as handle:
        model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)).loss.backward()
        if patch == "llama2":
            left_ids, left = padded_batch("left")  # generation pads left (right: patchkit steps aside)
            model.eval().generate(input_ids=left_ids, attention_mask=left, max_new_tokens=2, do_sample=False,
                                  pad_token_id=0)
    assert handle.backend == "flash_attn" and fake.calls
    assert called == [], f"patchkit called flash-attn helpers {called}: their arity differs across versions"
    assert fake.read <= KERNELS, f"patchkit read {sorted(fake.read - KERNELS)} from flash_attn: only kernels"


def test_no_source_imports_a_flash_attn_submodule_or_helper():
    """Static: an import of flash_attn.bert_padding (or any flash_attn submodule) anywhere in patchkit fails here.
    flash-attn 4's kernels are the one exception: `flash_attn.cute` is that package's module, not a flash-attn 2 helper
    (the flash_attn_4 backend imports it)."""
    offenders = []
    for path in [*ROOT.joinpath("patchkit").rglob("*.py"), *ROOT.joinpath("patches").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:  # not patchkit's own modules
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value] if node.value.startswith("flash_attn.") and " " not in node.value else []
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("flash_attn.") and n != "flash_attn.cute"]
    assert offenders == []
