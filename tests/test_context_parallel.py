"""torch's context_parallel shards each sequence and makes only torch's SDPA op ring attention: a patched model
under it is refused by name, never run shard-local (one process, a real context_parallel on a 1-rank gloo mesh)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from families import any_model, set_attention
from models import needs_mask_interface, padded_batch

import patchkit
from patchkit import PatchInputError

experimental = pytest.importorskip("torch.distributed.tensor.experimental")


@pytest.fixture
def mesh(tmp_path, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh

    # torch 2.6's context_parallel leaves SDPA replaced when its body raises (no finally): put it back after the test
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_patched_model_under_context_parallel_is_refused_by_name(family, mesh):
    model = any_model(family, "sdpa")
    ids, mask = padded_batch("left")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        with patchkit.apply_patch(family, backend="sdpa") as handle:
            with experimental.context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]):
                with pytest.raises(PatchInputError, match="context_parallel .* is active.*within each rank's shard"):
                    model(input_ids=ids, attention_mask=mask)
            got = model(input_ids=ids, attention_mask=mask).logits  # outside it: patched again
            assert handle.calls == 2
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=3e-5, rtol=1e-4)


@needs_mask_interface
def test_a_model_loaded_with_the_patchkit_name_under_context_parallel_is_refused_by_name(mesh):
    # no class patch, no route: the registered attention itself refuses (its per-document SDPA calls would each be
    # made ring attention over pieces that are not the sequence's shards)
    model = any_model("llama", "sdpa")
    ids, mask = padded_batch("left")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        set_attention(model, "patchkit")
        with experimental.context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]):
            with pytest.raises(PatchInputError, match="context_parallel .* is active.*within each rank's shard"):
                model(input_ids=ids, attention_mask=mask)
        got = model(input_ids=ids, attention_mask=mask).logits  # outside it: served again
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=3e-5, rtol=1e-4)
