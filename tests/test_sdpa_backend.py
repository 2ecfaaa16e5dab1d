"""The torch-native backend keeps flash-attn's semantics: checked against a float64 reference."""

from __future__ import annotations

import flash_stand_in as stand_in
import pytest
import torch

from patchkit.forward.padding import pad_input, unpad_input


def varlen_inputs(lens_q, lens_k, h=4, hk=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(sum(lens_k), hk, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(sum(lens_k), hk, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    cu = lambda lens: torch.tensor([0, *lens]).cumsum(0).to(torch.int32)  # noqa: E731
    return q, k, v, cu(lens_q), cu(lens_k)


def reference(q, k, v, lens_q, lens_k, causal, scale=None, window=(-1, -1), softcap=0.0):
    """Per-sequence float64 attention, written from flash-attn's documented semantics."""
    outs, lses = [], []
    h, hk = q.shape[1], k.shape[1]
    sq0 = sk0 = 0
    for sq, sk in zip(lens_q, lens_k):
        qs = q[sq0 : sq0 + sq].double().transpose(0, 1)
        ks = k[sk0 : sk0 + sk].double().repeat_interleave(h // hk, 1).transpose(0, 1)
        vs = v[sk0 : sk0 + sk].double().repeat_interleave(h // hk, 1).transpose(0, 1)
        s = qs @ ks.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(sq)[:, None] + sk - sq
        j = torch.arange(sk)[None]
        ok = torch.ones(sq, sk, dtype=torch.bool)
        right = 0 if causal else window[1]
        if right >= 0:
            ok &= j <= i + right
        if window[0] >= 0:
            ok &= j >= i - window[0]
        s = s.masked_fill(~ok, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
        outs.append((p @ vs).transpose(0, 1))
        lses.append(lse.masked_fill(torch.isneginf(lse), float("inf")))
        sq0, sk0 = sq0 + sq, sk0 + sk
    return torch.cat(outs), torch.cat(lses, 1)


CASES = {
    "self, equal": ([5, 5, 5], [5, 5, 5]),
    "self, ragged": ([7, 1, 12, 3], [7, 1, 12, 3]),
    "decode": ([1, 1, 1], [9, 4, 13]),
    "chunked prefill": ([3, 5, 2], [10, 5, 7]),
    "empty sequences": ([0, 4, 0], [3, 4, 0]),
    "a compiled graph's fixed size, empty documents between and after": ([3, 0, 5, 0, 0, 0], [3, 0, 5, 0, 0, 0]),
    "keys no query reads, then documents": ([0, 4, 0, 2], [3, 4, 0, 2]),
    "more queries than keys": ([6, 2], [3, 2]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hk", [4, 2, 1])
def test_varlen_matches_reference_fp32_with_gradients(case, causal, hk):
    lens_q, lens_k = CASES[case]
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, hk=hk)
    out = stand_in.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    want, _ = reference(q, k, v, lens_q, lens_k, causal)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
    grad = torch.randn_like(out)
    got_g = torch.autograd.grad(out, (q, k, v), grad)
    want_g = torch.autograd.grad(want, (q, k, v), grad.double())
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [(2, 0), (3, 1), (-1, 2)])
def test_window_softcap_scale_and_lse(window):
    lens = [6, 9]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, hk=2)
    out, lse, _ = stand_in.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 9, 9, softmax_scale=0.3, causal=False, window_size=window, softcap=5.0,
        return_attn_probs=True,
    )
    want, want_lse = reference(q, k, v, lens, lens, False, scale=0.3, window=window, softcap=5.0)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=1e-5)
    assert lse.shape == (4, sum(lens)) and lse.dtype == torch.float32


def test_query_that_sees_no_key_gives_zero_output_and_infinite_lse():
    q, k, v, cu_q, cu_k = varlen_inputs([4], [2], hk=4)
    out, lse, _ = stand_in.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 2, causal=True, return_attn_probs=True)
    assert out[:2].abs().max() == 0 and torch.isinf(lse[:, :2]).all()  # bottom-right: rows 0, 1 see nothing
    assert out[2:].abs().max() > 0


@pytest.mark.parametrize("lens", [[0], [0, 0]])
def test_no_query_token_gives_an_empty_output_and_an_empty_lse(lens):
    # a micro-batch whose every row is padding unpads to no token: flash-attn returns (0, H, D) and an (H, 0) lse,
    # which a caller with sinks (GPT-OSS) combines with them; an lse of None there raised a TypeError
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens)
    out, lse, _ = stand_in.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 0, 0, causal=True, return_attn_probs=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0) and lse.dtype == torch.float32


def test_bf16_error_within_twice_torch_reference_error():
    lens = [33, 17, 64]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, hk=2)
    q16, k16, v16 = (t.detach().bfloat16() for t in (q, k, v))
    truth, _ = reference(q, k, v, lens, lens, True)
    ours = stand_in.flash_attn_varlen_func(q16, k16, v16, cu_q, cu_k, 64, 64, causal=True)
    # the plain PyTorch reference in bf16 (flash-attn's own test rule: error <= 2x the reference's error)
    ref16, _ = reference(q16, k16, v16, lens, lens, True)
    ref16 = ref16.bfloat16().double()
    assert (ours.double() - truth).abs().max() <= 2 * (ref16 - truth).abs().max() + 1e-3


def test_packed_and_dense_entry_points_agree():
    b, s, h, hk, d = 3, 8, 4, 2, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, hk, d, generator=g), torch.randn(b, s, hk, d,
                                                                                                       generator=g)
    dense = stand_in.flash_attn_func(q, k, v, causal=True)
    kvp = stand_in.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True)
    want = stand_in.reference_attention(q, k, v, causal=True)
    torch.testing.assert_close(dense.double(), want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(kvp, dense)
    qkv = torch.stack([q, q, q], 2)
    torch.testing.assert_close(
        stand_in.flash_attn_qkvpacked_func(qkv, causal=True).double(), stand_in.reference_attention(q, q, q, True),
        atol=2e-6, rtol=1e-5,
    )
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
    var = stand_in.flash_attn_varlen_kvpacked_func(
        q.reshape(-1, h, d), torch.stack([k, v], 2).reshape(-1, 2, hk, d), cu, cu, s, s, causal=True
    )
    torch.testing.assert_close(var.view(b, s, h, d), dense)


def test_dropout_scales_kept_probabilities():
    lens = [64]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, hk=4)
    v = torch.ones_like(v)  # output = sum of kept probabilities / (1 - p): mean stays 1
    torch.manual_seed(0)
    out = stand_in.flash_attn_varlen_func(q.detach(), k.detach(), v, cu_q, cu_k, 64, 64, dropout_p=0.5)
    assert out.mean().item() == pytest.approx(1.0, abs=0.05) and (out != 1).any()


def test_gqa_head_count_must_divide():
    q, k, v, cu_q, cu_k = varlen_inputs([4], [4], h=6, hk=4)
    with pytest.raises(ValueError, match="6.*divisible.*4"):
        stand_in.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4)


def test_unpad_input_returns_flash_attn_27_five_tuple_and_pad_input_inverts_it():
    hidden = torch.randn(3, 5, 2, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    unpadded, indices, cu, max_len, used = unpad_input(hidden, mask)
    assert unpadded.shape == (8, 2) and cu.tolist() == [0, 3, 3, 8] and cu.dtype == torch.int32
    assert max_len == 5 and isinstance(max_len, int) and used.tolist() == [3, 0, 5]
    back = pad_input(unpadded, indices, 3, 5)
    torch.testing.assert_close(back, hidden * mask[..., None])
    back.sum().backward()
    torch.testing.assert_close(hidden.grad, mask[..., None].float().expand(3, 5, 2))
