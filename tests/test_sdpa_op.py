"""patchkit::varlen_sdpa, the sdpa backend as one op for compiled graphs: outputs and gradients equal the loop's."""

from __future__ import annotations

import pytest
import torch

from patchkit.backends import sdpa, sdpa_op

if not sdpa_op.served(0.0):
    pytest.skip("torch.library.custom_op: torch 2.4+", allow_module_level=True)

CASES = {  # (query lengths, key lengths): a chunk behind a past, an empty document, a query that sees no key
    "training": ([5, 1, 7], [5, 1, 7]),
    "behind_a_past": ([2, 3], [6, 3]),
    "empty_and_unseen": ([0, 4, 3], [0, 4, 1]),
}


def inputs(lens_q: list[int], lens_k: list[int], heads: int, kv_heads: int, extra_rows: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    tq, tk = sum(lens_q) + extra_rows, sum(lens_k) + extra_rows  # rows past the last document: untouched

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32) for lens in (lens_q, lens_k)]
    return rand(tq, heads, 8), rand(tk, kv_heads, 8), rand(tk, kv_heads, 8), *cu


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal, window, softcap", [(True, (-1, -1), 0.0), (False, (-1, -1), 0.0),
                                                     (True, (2, 0), 0.0), (True, (-1, -1), 1.5)],
                         ids=["causal", "bidirectional", "window", "softcap"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_op_and_its_gradients_equal_the_loop(case, causal, window, softcap, kv_heads):
    """The op's output and its written-out backward against autograd through the eager loop, in float64."""
    lens_q, lens_k = CASES[case]
    q, k, v, cu_q, cu_k = inputs(lens_q, lens_k, 4, kv_heads, extra_rows=2, dtype=torch.float64)
    want, _ = sdpa.varlen_attention(q, k, v, lens_q, lens_k, 0.0, 0.3, causal, window, softcap)
    got = sdpa_op.varlen_sdpa(q, k, v, cu_q, cu_k, 0.3, causal, window, softcap)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10, msg=f"d{name}")


def test_bf16_gradients_within_the_loops_error():
    """bf16 q/k/v: the op computes in fp32 like the loop's math path; against the float64 truth its error is no
    larger than twice the loop's (the flash-attn test rule)."""
    lens = [9, 4, 11]
    q, k, v, cu_q, cu_k = inputs(lens, lens, 4, 2, extra_rows=0, dtype=torch.bfloat16)
    truth = [t.detach().double().requires_grad_() for t in (q, k, v)]
    grad = torch.randn(sum(lens), 4, 8, dtype=torch.float64)
    ref, _ = sdpa.varlen_attention(*truth, lens, lens, 0.0, None, True)
    ref_grads = torch.autograd.grad(ref, truth, grad)
    loop, _ = sdpa.varlen_attention(q, k, v, lens, lens, 0.0, 8 ** -0.5, True)
    loop_grads = torch.autograd.grad(loop, (q, k, v), grad.bfloat16())
    op_grads = torch.autograd.grad(sdpa_op.varlen_sdpa(q, k, v, cu_q, cu_k, 8 ** -0.5, True, (-1, -1), 0.0),
                                   (q, k, v), grad.bfloat16())
    for name, o, lp, r in zip("qkv", op_grads, loop_grads, ref_grads):
        op_err, loop_err = (o.double() - r).abs().max(), (lp.double() - r).abs().max()
        assert op_err <= 2 * loop_err + 1e-3, (name, op_err.item(), loop_err.item())


def test_the_op_passes_torch_library_checks():
    """Its fake (meta) kernel, autograd registration and schema agree with the real kernel (`opcheck`)."""
    opcheck = getattr(torch.library, "opcheck", None)
    if opcheck is None:
        pytest.skip("torch.library.opcheck: torch 2.4+")
    q, k, v, cu_q, cu_k = inputs([3, 5], [3, 5], 4, 2, extra_rows=1, dtype=torch.float32)
    opcheck(torch.ops.patchkit.varlen_sdpa.default, (q, k, v, cu_q, cu_k, 0.3, True, -1, -1, 0.0))


def test_attention_dropout_is_not_served_by_the_op():
    """Dropout keeps the traced loop (the op has no random mask to replay in its backward)."""
    assert not sdpa_op.served(0.1)
