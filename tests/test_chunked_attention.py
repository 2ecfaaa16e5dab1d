"""Llama 4's chunked attention, NoPE layers and their temperature, served from data: equal to transformers' eager.

A chunked layer's query sees the keys of its own chunk only (`attention_chunk_size`, counted from each document's
first real token): the varlen path cuts every document into chunks (`split_at_chunks`). Its NoPE layers scale
queries by a temperature read from each token's column in the padded batch: a padded batch unpads at the model (every
layer, its MoE too, on real tokens) and those layers' queries are scaled by the columns the packed row's tokens had
(`forward/inputs/temperature.py`). Where a chunk boundary falls behind a KV cache (generation past the first chunk)
or in a row with a padding hole, the forward steps aside to transformers' attention, by name.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from models import assert_same, padded_batch, step
from packaging.version import Version

import patchkit
from patchkit.forward.metadata import dense_metadata, split_at_chunks

pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version("5.0"),
                                reason="Llama 4 is served from data on transformers 5.x")
CHUNK = 6


def llama4(seed: int = 0) -> torch.nn.Module:
    """A tiny Llama 4 text model: a chunked layer, a NoPE layer whose temperature bites from position 3, MoE."""
    config = transformers.Llama4TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
        attention_chunk_size=CHUNK, no_rope_layers=[1, 0], floor_scale=4, pad_token_id=0,
        layer_types=["chunked_attention", "full_attention"],
    )
    torch.manual_seed(seed)
    return transformers.Llama4ForCausalLM._from_config(config, attn_implementation="eager").float().train()


@pytest.mark.parametrize("kind", ["right", "left", "mixed"])
def test_a_padded_training_step_equals_eager_with_chunks_and_nope_temperature(kind):
    model = llama4()
    ids, mask = padded_batch(kind, batch=3, seq=16)
    want = step(model, ids, mask)
    with patchkit.apply_patch("llama4_text", backend="sdpa") as handle:
        got = step(model, ids, mask)
    assert handle.calls > 0 and not handle.stepped_aside
    assert_same(got, want, mask)


@pytest.mark.parametrize("kind", ["left", "mixed"])
def test_a_padded_step_runs_every_layer_on_real_tokens_with_each_tokens_own_temperature(kind):
    """Llama 4 unpadded inside attention only before 2026-12-05 (its MoE ran on padding). Now its feed-forward layers
    see the real tokens alone; the NoPE layer's temperature, by the padded column (a left-padded row's first real
    token sits at column 5 or more), is transformers' own: a training step's logits and gradients, and a left-padded
    prompt's greedy tokens and logits in float32 and bfloat16."""
    model = llama4()
    ids, mask = padded_batch(kind, batch=3, seq=16)
    want = step(model, ids, mask)
    tokens: list[int] = []
    hooks = [layer.feed_forward.register_forward_hook(
        patchkit.shape_free(lambda _m, args, _o: tokens.append(args[0].shape[:-1].numel())))
        for layer in model.model.layers]
    with patchkit.apply_patch("llama4_text", backend="sdpa") as handle:
        got = step(model, ids, mask)
    for hook in hooks:
        hook.remove()
    assert handle.calls > 0 and not handle.stepped_aside
    assert tokens == [int(mask.sum())] * len(model.model.layers)
    assert_same(got, want, mask)
    prompts, prompt_mask = padded_batch("left", batch=3, seq=16)
    prompts, prompt_mask = prompts[:, -5:].clamp(max=95), prompt_mask[:, -5:]  # within the first chunk of 6
    for dtype in (torch.float32, torch.bfloat16):
        model = model.eval().to(dtype)
        kw = dict(max_new_tokens=1, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        with torch.no_grad():
            want = model.generate(input_ids=prompts, attention_mask=prompt_mask, **kw)
            with patchkit.apply_patch("llama4_text", backend="sdpa") as handle:
                got = model.generate(input_ids=prompts, attention_mask=prompt_mask, **kw)
        assert handle.calls > 0 and not handle.stepped_aside
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(got.logits[0], want.logits[0], atol=2e-5 if dtype == torch.float32 else 2e-2,
                                   rtol=1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("way", ["class", "registered name"])
def test_packed_documents_are_cut_into_chunks_from_their_own_start(way):
    """Two rows of packed documents (position_ids restarting, no mask): each document's chunks count from its own
    first token, as transformers' packed mask counts them; the registered name alone reads the documents from the
    mask transformers was asked for (Llama 4's layers are not handed position_ids)."""
    model = llama4()
    lengths = [[9, 7, 8], [13, 11]]
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    ones = torch.ones_like(ids)

    def run() -> tuple:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = run()
    if way == "class":
        with patchkit.apply_patch("llama4_text", backend="sdpa") as handle:
            got = run()
        assert handle.calls > 0 and not handle.stepped_aside
    else:
        patchkit.register_attention(backend="sdpa")
        model.set_attn_implementation("patchkit")
        try:
            got = run()
        finally:
            model.set_attn_implementation("eager")
            patchkit.register_attention(backend="auto")
    assert_same(got, want, ones)


def test_generation_past_the_first_chunk_steps_aside_by_name_with_the_same_tokens():
    model = llama4().eval()
    ids, mask = padded_batch("left", batch=3, seq=16)
    kwargs = dict(input_ids=ids.clamp(max=95), attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(**kwargs)
    with patchkit.apply_patch("llama4_text", backend="sdpa") as handle:
        with pytest.warns(RuntimeWarning, match="chunk boundary falls behind the KV cache"):
            got = model.generate(**kwargs)
    assert torch.equal(got, want)
    assert handle.calls > 0 and handle.stepped_aside.get("chunk_behind_cache", 0) > 0


def test_a_padding_hole_wider_than_a_chunk_steps_aside_by_name():
    model = llama4()
    ids, mask = padded_batch("right", batch=3, seq=16)
    mask[0, 4:7] = 0  # padding between real tokens: transformers counts those columns inside the chunk
    want = step(model, ids, mask)
    with patchkit.apply_patch("llama4_text", backend="sdpa") as handle:
        with pytest.warns(RuntimeWarning, match="chunked attention"):
            got = step(model, ids, mask)
    assert "chunk_behind_cache" in handle.stepped_aside
    assert_same(got, want, mask)


def test_documents_are_cut_every_chunk_from_their_first_token():
    meta = dense_metadata(2, 7, 7, torch.device("cpu"))
    cut = split_at_chunks(meta, 3)
    assert cut.seqlens_q == [3, 3, 1, 3, 3, 1] and cut.packed and cut.max_seqlen_q == 3
    assert cut.cu_seqlens_q.tolist() == [0, 3, 6, 7, 10, 13, 14] and cut.indices_q is None
    assert split_at_chunks(meta, 7) is meta and split_at_chunks(meta, None) is meta


def test_packed_documents_that_start_off_a_chunk_boundary_step_aside_by_name():
    """transformers counts a packed document's chunks by its positions: one starting at position 3 has its first
    boundary 3 tokens earlier than a cut from its first token. Such a forward runs on transformers' attention, by
    name, with its numbers."""
    model = llama4()
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(3, 13), torch.arange(10)])[None]
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        with patchkit.apply_patch("llama4_text", backend="sdpa") as handle:
            with pytest.warns(RuntimeWarning, match="chunk boundary"):
                got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert handle.stepped_aside.get("chunk_behind_cache", 0) > 0
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
