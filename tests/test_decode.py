"""Decode steps attend to the padded KV cache in place: no gather of the cache, the unpatched model's numbers."""

from __future__ import annotations

import copy

import pytest
import torch
from census import tiny_config
from families import WINDOW, family_model
from models import cache_tensors, decode_logits, needs_set_attn_implementation, padded_batch, static_decode, tiny_model

import patchkit
from patches.table import serves_here
from patchkit.forward import decode, decode_plan, masks, metadata, padding
from patchkit.hooks.attention import attend as attention_module
from patchkit.hooks.decide import plan

ATOL, RTOL = 2e-5, 1e-4
# The references switch a copy's attention with set_attn_implementation (transformers 4.56+). Before it, by hand
# on 4.48.3: StaticCache decode is refused with a misleading message and a Gemma2 window case fails (known, open).
pytestmark = needs_set_attn_implementation  # the unpatched references switch a copy's attention
FROM_DATA = pytest.mark.skipif(not serves_here(), reason="families served from data: the table's transformers")


@pytest.fixture
def gathers(monkeypatch):
    """The row counts of every unpad gather (attention's unpad_rows, and any index_first_axis) while patched."""
    seen: list[tuple[str, int]] = []
    unpad_rows, index_first_axis = attention_module.unpad_rows, padding.index_first_axis

    def counting_unpad(x, indices):
        if indices is not None:  # a gather; without indices it is a reshape of rows already real (a packed row)
            seen.append(("unpad_rows", x.shape[1]))  # (B, S, ...): S is the prompt, a chunk, or the cache length
        return unpad_rows(x, indices)

    def counting_gather(x, indices):
        seen.append(("index_first_axis", x.shape[0]))
        return index_first_axis(x, indices)

    monkeypatch.setattr(attention_module, "unpad_rows", counting_unpad)
    monkeypatch.setattr(padding, "index_first_axis", counting_gather)
    return seen


def prompt_only(gathers: list[tuple[str, int]], batch: int, seq: int) -> bool:
    """Every gather was the prompt's ((B, seq) for unpad_rows, B * seq flat rows), none the cache's."""
    return bool(gathers) and all(rows == (seq if name == "unpad_rows" else batch * seq) for name, rows in gathers)


def generate(model, ids, mask, n):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


def with_attention(model, implementation: str):
    other = copy.deepcopy(model)
    other.set_attn_implementation(implementation)
    return other


def windowed_lm(model_type: str) -> torch.nn.Module:
    """The census's tiny causal LM of `model_type`, its sliding layers' window WINDOW (shorter than the steps)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    config.sliding_window = WINDOW
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


CASES = [  # (patch, model builder, new tokens, unpatched references)
    pytest.param("llama2", lambda: tiny_model(kv_heads=4, seed=3), 32, ("eager", "sdpa"), id="llama2-mha"),
    pytest.param("llama2", lambda: tiny_model(kv_heads=2, seed=3), 32, ("eager", "sdpa"), id="llama2-gqa"),
    pytest.param("llama2", lambda: tiny_model(kv_heads=1, seed=3), 12, ("eager",), id="llama2-mqa"),
    pytest.param("mistral", lambda: family_model("mistral", seed=1), 3 * WINDOW, ("eager", "sdpa"), id="mistral"),
    pytest.param("gemma2", lambda: family_model("gemma2", seed=1), 3 * WINDOW, ("eager",), id="gemma2-softcap"),
    # one more logit per head in every softmax (GPT-OSS's sinks): the cache's attention with its log-sum-exp, in place
    pytest.param("gpt_oss", lambda: windowed_lm("gpt_oss"), 3 * WINDOW, ("eager",), id="gpt_oss-sinks",
                 marks=FROM_DATA),
]


@pytest.mark.parametrize("split", [False, True], ids=["one-masked-call", "per-row-calls"])
@pytest.mark.parametrize("patch, build, steps, references", CASES)
def test_greedy_tokens_and_per_step_logits_match_unpatched_without_gathering_the_cache(
    patch, build, steps, references, split, gathers, monkeypatch
):
    """Left-padded greedy generation (across the sliding window for Mistral and Gemma2): the same tokens, every
    step's logits within fp32 rounding, and the only gathers are the prefill's (the prompt length, never a cache).
    The tiny models never reach ROW_SPLIT_BYTES: `split` lowers it to 0 to run the per-row SDPA calls too."""
    monkeypatch.setattr(decode_plan, "ROW_SPLIT_BYTES", {"cpu": 0} if split else {})
    model = build()
    ids, mask = padded_batch("left", batch=3, seq=14)
    wanted = {name: generate(with_attention(model, name), ids, mask, steps) for name in references}
    with patchkit.apply_patch(patch, backend="sdpa") as handle:
        tokens, logits = generate(model, ids, mask, steps)
        assert handle.calls == model.config.num_hidden_layers * steps  # prefill and every step went through it
    for name, (want_tokens, want_logits) in wanted.items():
        assert torch.equal(tokens, want_tokens), name
        torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=RTOL, msg=name)
    assert prompt_only(gathers, 3, 14), gathers


@pytest.mark.parametrize("family, per_step", [("llama", 1), ("gemma2", 2)])
def test_a_decode_steps_later_layers_take_the_kernel_call_its_first_layer_settled_on(family, per_step, monkeypatch):
    """A decode step is host-bound on a GPU: its first layer decides the kernel call (metadata, keys in use,
    backend, plan) and the later layers of its signature take it as it is (`hooks/attention/lanes.py`): one full
    path a step for LLaMA, one per window for Gemma2's sliding and global layers, which must not share theirs. A
    DynamicCache made without the config keeps every layer's keys, so both kinds hand over keys of one shape, and
    the window bites: a shared call would give the global layers the sliding ones' keys (each kind's mask keeps its
    own calls, and the window is part of a call's signature besides). Logits are eager's."""
    from patchkit.hooks.attention import varlen

    model = tiny_model(kv_heads=2, layers=4, seed=3) if family == "llama" else family_model("gemma2", seed=1)
    ids, mask = padded_batch("left", batch=3, seq=14)
    steps = 3 * WINDOW
    want, fed = decode_logits(with_attention(model, "eager"), ids, mask, steps)
    calls = []
    core = varlen.varlen_core
    monkeypatch.setattr(varlen, "varlen_core", lambda *a, **k: calls.append(a[2].shape[2]) or core(*a, **k))
    with torch.no_grad(), patchkit.apply_patch("llama2" if family == "llama" else family, backend="sdpa") as handle:
        got, _ = decode_logits(model, ids, mask, steps, feed=fed)
        assert handle.calls == model.config.num_hidden_layers * (steps + 1)  # every layer counted, lane or not
    layers = model.config.num_hidden_layers
    assert calls[:layers] == [int(mask.sum())] * layers  # the packed prefill's every layer: no decode step
    assert calls[layers:] == [1] * (per_step * steps)  # then one full path per step and window
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_metadata_and_decode_plan_are_built_once_per_forward(monkeypatch):
    model = tiny_model(kv_heads=2, layers=4, seed=3)
    ids, mask = padded_batch("left", batch=3, seq=14)
    built = {"metadata": 0, "plan": 0}
    build_metadata = masks.build_metadata

    def counting_metadata(*args, **kwargs):
        built["metadata"] += 1
        return build_metadata(*args, **kwargs)

    class CountingPlan(decode.DecodePlan):
        def __init__(self, *args, **kwargs) -> None:
            built["plan"] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(masks, "build_metadata", counting_metadata)
    monkeypatch.setattr(plan, "build_metadata", counting_metadata)  # the packed prefill's, model-level
    monkeypatch.setattr(decode, "DecodePlan", CountingPlan)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        decode_logits(model, ids, mask, 5)
    assert built == {"metadata": 1 + 5, "plan": 5}  # prefill and each step once, not once per layer


@pytest.mark.parametrize("kind", ["left", "right", "mixed"])
@pytest.mark.parametrize("q_len", [1, 3, 20])
def test_metadata_behind_a_past_equals_the_masks_own(kind, q_len):
    """Metadata behind cached keys builds its gather indices and cu_seqlens on first use: they, the lengths, the
    masks the decode plan reads and `holes` are what the 2D mask says."""
    _, mask = padded_batch(kind, batch=4, seq=24)
    mask[0, 3] = 0  # a hole
    meta = masks.build_metadata(mask, 4, q_len, 24, torch.device("cpu"))
    real_q, real_k = mask[:, -q_len:].bool(), mask.bool()
    lens_q, lens_k = real_q.sum(-1), real_k.sum(-1)
    assert meta.seqlens_q == lens_q.tolist() and meta.seqlens_k == lens_k.tolist() and meta.holes
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (lens_q.max(), lens_k.max())
    assert torch.equal(meta.key_lengths(), lens_k)
    want_q = None if real_q.all() else real_q
    got_q, got_k = meta.real_masks()
    assert (got_q is None) == (want_q is None) and (want_q is None or torch.equal(got_q, want_q))
    assert torch.equal(got_k, real_k)
    assert "indices_k" not in vars(meta) and "cu_seqlens_k" not in vars(meta)  # not built until asked for
    for got, real in ((meta.indices_q, real_q), (meta.indices_k, real_k)):
        assert (got is None) == bool(real.all()) and (got is None or torch.equal(got, real.flatten().nonzero()[:, 0]))
    for got, lens in ((meta.cu_seqlens_q, lens_q), (meta.cu_seqlens_k, lens_k)):
        assert got.dtype == torch.int32 and got.tolist() == [0, *lens.cumsum(0).tolist()]


def test_decode_steps_build_no_gather_indices(monkeypatch):
    """A decode step on the padded cache reads the masks: the gather indices only the varlen path needs are never
    built (the host work of a step), and the tokens are the unpatched model's."""
    model = tiny_model(kv_heads=2, layers=2, seed=3)
    ids, mask = padded_batch("left", batch=3, seq=14)
    want, fed = decode_logits(model, ids, mask, 4)
    built = []
    real_indices = metadata.real_indices
    for module in (metadata, masks):  # where it is defined, and any module holding its own name for it
        if hasattr(module, "real_indices"):
            monkeypatch.setattr(module, "real_indices", lambda *a: built.append(a) or real_indices(*a))
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got, _ = decode_logits(model, ids, mask, 4, fed)
    assert built == []
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", ["right", "mixed"])
def test_holes_and_all_padding_rows_decode_exactly_with_zeros_not_nan(kind, gathers):
    """A right-padded prompt leaves a hole before the new tokens (no window: served exactly); the mixed batch's last
    row is all padding, and a step whose new token is padding too sees no real key: zeros, never NaN. The prefill
    of a row that is all padding steps aside (its next token is read at padding, as in generate())."""
    model = tiny_model(kv_heads=2, seed=5)
    ids, mask = padded_batch(kind, batch=4, seq=16)
    feed = torch.randint(3, 90, (4, 4), generator=torch.Generator().manual_seed(1))
    want, _ = decode_logits(model, ids, mask, 4, feed)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        got, _ = decode_logits(model, ids, mask, 4, feed)
        aside = handle.stepped_aside
    last_real = mask[:, -1].bool()  # the prefill's last logits: a padding position in right-padded rows
    torch.testing.assert_close(got[last_real, 0], want[last_real, 0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[:, 1:], want[:, 1:], atol=ATOL, rtol=RTOL)
    if kind == "mixed":
        assert aside == {"right_padded_generation": 1} and gathers == []  # the decode steps gather no cache
        torch.testing.assert_close(got[-1, 0], want[-1, 0], atol=ATOL, rtol=RTOL)
    else:
        assert not aside and prompt_only(gathers, 4, 16), gathers

    attn_in: list[torch.Tensor] = []
    hook = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
        patchkit.shape_free(lambda m, a: attn_in.append(a[0])))
    step_mask = torch.cat([mask, torch.tensor([[1], [1], [1], [0]])], 1)
    with torch.no_grad(), patchkit.apply_patch("llama2", backend="sdpa"):
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        step = model(input_ids=feed[:, :1], attention_mask=step_mask, past_key_values=out.past_key_values)
    hook.remove()
    want_step = model(input_ids=torch.cat([ids, feed[:, :1]], 1), attention_mask=step_mask).logits[:, -1].detach()
    assert torch.isfinite(step.logits).all()
    torch.testing.assert_close(step.logits[:3, -1], want_step[:3], atol=ATOL, rtol=RTOL)
    if kind == "mixed":
        assert torch.equal(attn_in[-1][3], torch.zeros_like(attn_in[-1][3]))  # the padding query's attention


@pytest.mark.parametrize("first_row_padded", [False, True], ids=["first row full", "first row padded"])
@pytest.mark.parametrize("full_mask", [True, False], ids=["full-length mask", "short mask"])
def test_static_cache_decode_takes_the_cache_path_exactly(full_mask, first_row_padded, gathers):
    """Greedy from a right-padded prompt starts at a padding position's logits, which patchkit zeroes: left only.
    With the first row padded: transformers 4.56-5.x count a StaticCache's filled slots as the first row's nonzero
    keys (no cache_position here, so both the model and patchkit place the step by that count); the packed prefill
    left zeros at padding slots, which made that count short and the decode steps wrong (up to 0.26, no error)."""
    model = tiny_model(kv_heads=2, seed=3)
    ids, mask = padded_batch("left", batch=4, seq=16)
    if first_row_padded:
        ids, mask = ids.flip(0), mask.flip(0)
    want = static_decode(model, ids, mask, steps=5, max_len=24, full_mask=full_mask)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got = static_decode(model, ids, mask, steps=5, max_len=24, full_mask=full_mask)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert prompt_only(gathers, 4, 16), gathers


def test_chunks_up_to_the_decode_limit_use_the_cache_and_longer_ones_the_varlen_path(gathers):
    """A chunk of DECODE_MAX_Q new tokens behind a cache attends in place; one token more gathers (both exact)."""
    model = tiny_model(kv_heads=2, seed=4)
    limit = decode.DECODE_MAX_Q
    ids, mask = padded_batch("left", batch=3, seq=14 + 2 * limit + 1)
    position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    want = model(input_ids=ids, attention_mask=mask, position_ids=position).logits.detach()
    bounds = [(0, 14), (14, 14 + limit), (14 + limit, 14 + 2 * limit + 1)]
    with torch.no_grad(), patchkit.apply_patch("llama2", backend="sdpa"):
        from transformers import DynamicCache

        cache, chunks = DynamicCache(), []
        for start, stop in bounds:
            gathers.clear()
            chunks.append(model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache,
                                position_ids=position[:, start:stop], use_cache=True).logits)
            layers = model.config.num_hidden_layers
            if stop - start <= limit and start:
                assert gathers == [], (start, stop, gathers)
            elif not start:  # the prefill into an empty cache runs packed: the prompt's tokens gathered once
                assert gathers and all(g == ("index_first_axis", 3 * stop) for g in gathers), gathers
            else:  # a chunk over the limit: queries, then the keys of the whole cache, gathered
                assert ("unpad_rows", stop) in gathers and len(gathers) >= 2 * layers, (start, stop, gathers)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(chunks, 1)[real], want[real], atol=ATOL, rtol=RTOL)


def test_a_decode_step_with_gradients_matches_eager():
    """The cache path is differentiable: a step's parameter gradients equal the unpatched model's."""
    model = tiny_model(kv_heads=2, seed=6)
    ids, mask = padded_batch("mixed", batch=4, seq=16)
    step_mask = torch.cat([mask, torch.tensor([[1], [1], [1], [0]])], 1)
    nxt = torch.randint(3, 90, (4, 1), generator=torch.Generator().manual_seed(3))

    def grads(patched: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        handle = patchkit.apply_patch("llama2", backend="sdpa") if patched else None
        with torch.no_grad():
            past = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        logits = model(input_ids=nxt, attention_mask=step_mask, past_key_values=past).logits
        logits[:3].square().mean().backward()  # the padding row's logits are not comparable: leave them out
        if handle is not None:
            handle.revert()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, got = grads(False), grads(True)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=3e-5, rtol=1e-3, msg=name)


def test_a_window_over_a_padding_hole_steps_aside_when_decoding():
    """Mistral counts padding columns inside its window, varlen kernels count real tokens: the decode step (whose mask
    has the right-padded prompt's hole) runs on transformers' attention, exactly."""
    model = family_model("mistral")
    ids, mask = padded_batch("right", batch=3, seq=14)
    want, fed = decode_logits(model, ids, mask, 2)
    with patchkit.apply_patch("mistral", backend="sdpa") as handle:
        got, _ = decode_logits(model, ids, mask, 2, fed)
        assert handle.stepped_aside == {"window_over_padding_hole": 2}
    # the prefill's last column is padding for the short rows (zeros patched; generate() steps aside for it)
    torch.testing.assert_close(got[:, 1:], want[:, 1:], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_windows_over_a_full_cache_and_chunks_behind_a_sliding_one_match_eager(family, gathers):
    """The window must hide keys when the cache keeps more than it: a DynamicCache made without the config keeps
    every key, and a chunk of 3 new tokens behind a sliding cache sees window - 1 + 3 keys."""
    model = family_model(family, seed=2)
    ids, mask = padded_batch("left", batch=3, seq=14)
    feed = torch.randint(3, 90, (3, 2 * WINDOW), generator=torch.Generator().manual_seed(5))
    want, _ = decode_logits(model, ids, mask, 2 * WINDOW, feed)
    with patchkit.apply_patch(family, backend="sdpa"):
        got, _ = decode_logits(model, ids, mask, 2 * WINDOW, feed)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert prompt_only(gathers, 3, 14), gathers

    full = torch.cat([ids, feed], 1)
    full_mask = torch.cat([mask, torch.ones_like(feed)], 1)
    position = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 1)
    want = model(input_ids=full, attention_mask=full_mask, position_ids=position).logits.detach()
    with torch.no_grad(), patchkit.apply_patch(family, backend="sdpa"):
        out = model(input_ids=ids, attention_mask=mask, position_ids=position[:, :14], use_cache=True)
        cache, chunks = out.past_key_values, [out.logits]
        for start in range(14, full.shape[1], 3):
            stop = min(start + 3, full.shape[1])
            chunks.append(model(input_ids=full[:, start:stop], attention_mask=full_mask[:, :stop],
                                position_ids=position[:, start:stop], past_key_values=cache).logits)
    real = full_mask.bool()
    torch.testing.assert_close(torch.cat(chunks, 1)[real], want[real], atol=ATOL, rtol=RTOL)


def test_a_prefill_into_an_empty_cache_runs_packed_and_fills_it_as_transformers_does():
    """generate()'s prefill runs on real tokens only (model-level unpad); the cache gets each layer's keys and
    values repadded, equal to the unpatched cache at every real position, and its own update method back."""
    from transformers import DynamicCache

    model = tiny_model(kv_heads=2, seed=5)
    ids, mask = padded_batch("left", batch=3, seq=14)
    want_cache = DynamicCache()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, past_key_values=want_cache, use_cache=True).logits
        with patchkit.apply_patch("llama2", backend="sdpa") as handle:
            cache = DynamicCache()
            got = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    assert "update" not in vars(cache)
    assert handle.calls == model.config.num_hidden_layers
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=RTOL)
    assert cache.get_seq_length() == want_cache.get_seq_length() == 14
    for ours_kv, theirs_kv in zip(cache_tensors(cache), cache_tensors(want_cache), strict=True):
        for ours, theirs in zip(ours_kv, theirs_kv):
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours.transpose(1, 2)[real], theirs.transpose(1, 2)[real], atol=ATOL, rtol=RTOL)


@FROM_DATA
def test_a_latent_attention_decode_step_pads_no_cache_to_the_keys_width(monkeypatch):
    """Multi-head latent attention (DeepSeek-V3: values narrower than queries and keys) on the sdpa backend: a decode
    step hands the cache's values to SDPA at their own width, where padding them to the keys' width for a kernel
    copied the whole cache per layer per token; the same tokens and per-step logits as eager, and only the prompt's
    tensors padded (its real tokens in one row, the model unpadded)."""
    model = tiny_config("deepseek_v3")
    assert model.v_head_dim != model.qk_nope_head_dim + model.qk_rope_head_dim  # the shapes this test is about
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(model, attn_implementation="eager").eval()
    ids, mask = padded_batch("left", batch=3, seq=14)
    want_tokens, want_logits = generate(model, ids, mask, 6)
    padded, pad = [], torch.nn.functional.pad

    def counting_pad(x, widths, *args, **kwargs):
        if x.dim() == 4:  # q, k or v (B, H, S, D): S is the prompt, or the cache's length on a decode step
            padded.append(x.shape[-2])
        return pad(x, widths, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "pad", counting_pad)
    with patchkit.apply_patch("deepseek_v3", backend="sdpa"):
        tokens, logits = generate(model, ids, mask, 6)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=RTOL)
    assert padded and set(padded) == {int(mask.sum())}, padded  # the packed prompt's q, k, v per layer; no cache
