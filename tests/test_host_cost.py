"""The decode path's host work: what a patched decode step does per layer, beyond the attention itself.

On a GPU a decode step is host-bound, so per-layer Python work is the cost users see. These tests pin the two
costs that were cut (each was more than the attention call's own Python work on transformers 5.x): a config write
per routed layer, and a module attribute write per call. `benchmarks/host_ops.py` counts the rest.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import padded_batch, tiny_model

import patchkit
from patchkit.forward import liveness
from patchkit.hooks import routing


def decode_inputs(model: torch.nn.Module) -> dict:
    """One new token per row behind a left-padded prefill in a DynamicCache."""
    from transformers import DynamicCache

    ids, mask = padded_batch("left")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(), use_cache=True)
    step_mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return dict(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=step_mask,
                position_ids=step_mask.sum(-1, keepdim=True) - 1, past_key_values=out.past_key_values, use_cache=True)


@pytest.mark.parametrize("way", ["class", "instance"])
def test_a_decode_step_writes_the_config_around_the_forward_not_per_layer(way, monkeypatch):
    model = tiny_model(layers=4)
    inputs = decode_inputs(model)
    with torch.no_grad():
        expected = model(**{**inputs, "past_key_values": copy.deepcopy(inputs["past_key_values"])}).logits
    with patchkit.apply_patch("llama2", backend="sdpa", model=model if way == "instance" else None) as handle:
        writes, setattrs = [], []
        config_type = type(model.config)
        original, set_name = config_type.__setattr__, routing.set_attn_name

        def counting(self, name, value):
            if name == "_attn_implementation":
                setattrs.append(value)
            original(self, name, value)

        def counting_writes(config, name):
            writes.append(name)
            set_name(config, name)

        monkeypatch.setattr(config_type, "__setattr__", counting)
        monkeypatch.setattr(routing, "set_attn_name", counting_writes)
        with torch.no_grad():
            got = model(**inputs).logits
        monkeypatch.undo()
        assert handle.calls == 4  # every layer ran through the patch
        assert writes == ["patchkit", "eager"]  # to patchkit's name and back, once a forward (was 2 + 2 per layer)
        # a plain field write where that is all the property does (transformers 5.x: it validated, ~30 calls each)
        assert setattrs == ([] if routing._fields(model.config) is not None else writes)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_attention_name_written_as_a_field_is_what_the_config_says():
    from transformers import LlamaConfig

    config = LlamaConfig(attn_implementation="sdpa")
    routing.set_attn_name(config, "patchkit")
    assert config._attn_implementation == "patchkit" and routing.attn_name(config) == "patchkit"
    config._attn_implementation = "eager"
    assert routing.attn_name(config) == "eager"


def test_a_config_with_sub_configs_still_hands_the_name_on():
    """A composite config's write goes through its property, which passes the name to each sub-config."""
    from transformers import LlamaConfig, LlavaConfig

    config = LlavaConfig(text_config=LlamaConfig().to_dict(), attn_implementation="sdpa")
    if not getattr(type(config), "sub_configs", None):
        pytest.skip("this transformers' configs have no sub_configs")
    assert routing._fields(config) is None
    routing.set_attn_name(config, "eager")
    assert config._attn_implementation == "eager" and config.text_config._attn_implementation == "eager"


def test_a_layer_is_marked_live_once_per_patch_not_once_per_call(monkeypatch):
    model = tiny_model(layers=2)
    inputs = decode_inputs(model)
    with patchkit.apply_patch("llama2", backend="sdpa", model=model) as handle:
        with torch.no_grad():
            model(**{**inputs, "past_key_values": copy.deepcopy(inputs["past_key_values"])})  # marks both layers
        marks = []
        original = torch.nn.Module.__setattr__

        def counting(self, name, value):
            if name == liveness.LIVE_MARK:
                marks.append(self)
            original(self, name, value)

        monkeypatch.setattr(torch.nn.Module, "__setattr__", counting)
        with torch.no_grad():
            model(**inputs)
        monkeypatch.undo()
        assert handle.calls == 4 and handle.layers_patched == 2
        assert marks == []  # later calls only read the mark (each call wrote it before)


def test_the_host_ops_benchmark_counts_both_providers(tmp_path):
    import csv
    import subprocess
    import sys

    from entrypoints import REPO

    out = tmp_path / "host_ops.csv"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_ops.py"), "--csv", str(out), "--blocks",
                           "2"], capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]
    with out.open() as f:
        rows = {r["provider"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"hf_sdpa", "patchkit_sdpa"}
    assert all(float(r["py_calls_per_layer"]) > 0 and float(r["aten_ops_per_layer"]) > 0 for r in rows.values())
    assert all(float(r["step_us"]) > 0 for r in rows.values()) and float(rows["hf_sdpa"]["vs_hf"]) == 1.0


def test_layers_are_counted_once_each_with_the_weak_set_asked_only_for_unmarked_layers(monkeypatch):
    """A layer's mark stands for 'in the state's set': later calls skip the WeakSet lookup (it builds a weak reference
    per call), and a deepcopy of a marked layer (its mark copied into a new object) is still counted as a new layer."""
    model = tiny_model(layers=2)
    inputs = decode_inputs(model)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        with torch.no_grad():
            model(**{**inputs, "past_key_values": copy.deepcopy(inputs["past_key_values"])})
        lookups = []
        original = type(handle.state.layers).__contains__
        monkeypatch.setattr(type(handle.state.layers), "__contains__", lambda s, m: lookups.append(m) or original(s, m))
        with torch.no_grad():
            model(**{**inputs, "past_key_values": copy.deepcopy(inputs["past_key_values"])})
        assert lookups == [] and handle.calls == 4 and handle.layers_seen == 2
        twin = copy.deepcopy(model)
        with torch.no_grad():
            twin(**inputs)
        monkeypatch.undo()
        assert len(lookups) == 2 and handle.calls == 6 and handle.state.layers_seen == 4


def test_the_family_check_reads_past_the_config_getattribute_and_an_instance_model_type_wins():
    from patchkit.errors import PatchInputError
    from patchkit.forward.arguments import check_family, model_type_of

    model = tiny_model(layers=1)
    attention = model.model.layers[0].self_attn
    assert model_type_of(attention) == model.config.model_type == "llama"
    check_family(attention, {"llama"})
    model.config.model_type = "bert"  # an instance's own field, over its class's
    assert model_type_of(attention) == "bert"
    with pytest.raises(PatchInputError, match="model_type 'bert'"):
        check_family(attention, {"llama"})
