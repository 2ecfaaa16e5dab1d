"""The decode path's host work: what a patched decode step does per layer, beyond the attention itself.

On a GPU a decode step is host-bound, so per-layer Python work is the cost users see. These tests pin the two
costs that were cut (each was more than the attention call's own Python work on transformers 5.x): a config write
per routed layer, and a module attribute write per call. `benchmarks/host_ops.py` counts the rest.
"""

from __future__ import annotations

import copy

import pytest
import torch
from families import set_attention
from models import padded_batch, tiny_model

import patchkit
from patchkit.forward import liveness
from patchkit.hooks.install import routing


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


def test_a_decode_step_reads_no_callers_frames_for_the_trainers_labels(monkeypatch):
    """Once the HF Trainer is imported, a prefill reads its callers' frames for the labels a Trainer's
    `compute_loss` popped; a decode step's one token predicts nothing from padding, so it walks no frames."""
    import transformers.trainer  # noqa: F401  (what makes the walk possible)

    from patchkit.hooks.decide import step_aside

    model = tiny_model(layers=2)
    inputs = decode_inputs(model)
    ids, mask = padded_batch("left")
    with torch.no_grad():
        expected = model(**{**inputs, "past_key_values": copy.deepcopy(inputs["past_key_values"])}).logits
    walks, walk = [], step_aside.trainer_labels
    monkeypatch.setattr(step_aside, "trainer_labels", lambda: walks.append(1) or walk())
    with patchkit.apply_patch("llama2", backend="sdpa"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        prefill = len(walks)
        got = model(**inputs).logits
    assert prefill == 1 and len(walks) == 1  # the prefill walked once; the decode step not at all
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


@pytest.mark.heavy  # starts Python processes: make test-heavy
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
    from patchkit.forward.inputs.arguments import model_type_of
    from patchkit.hooks.attention.varlen import check_family, family_rule

    model = tiny_model(layers=1)
    attention = model.model.layers[0].self_attn
    assert model_type_of(attention) == model.config.model_type == "llama"
    check_family(attention, family_rule({"llama"}))
    model.config.model_type = "bert"  # an instance's own field, over its class's
    assert model_type_of(attention) == "bert"
    with pytest.raises(PatchInputError, match="model_type 'bert'"):
        check_family(attention, family_rule({"llama"}))


class HostSyncs:
    """Counts the reads that make the host wait for the device (on a GPU, a sync each), by caller: patchkit or not.

    A TorchDispatchMode sees every op that reaches a kernel, backward included: `_local_scalar_dense` is what
    `.item()`, `bool()`, `int()`, `float()` and `__index__` of a tensor run; `nonzero`, `masked_select`, `unique`, a
    boolean-mask index and a `repeat_interleave` without `output_size` size their output from the data; `equal`
    answers a Python bool. `Tensor.tolist` reads the data without dispatching, so it is wrapped instead. CPU-only:
    torch.cuda.set_sync_debug_mode counts nothing here, these are the calls that would sync there.
    """

    DATA_SIZED = frozenset({"_local_scalar_dense", "nonzero", "equal", "masked_select", "unique", "_unique",
                            "_unique2", "unique_dim", "unique_consecutive"})

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import os

        from torch.utils._python_dispatch import TorchDispatchMode

        self.root = os.path.dirname(patchkit.__file__) + os.sep
        self.monkeypatch = monkeypatch
        self.total = self.patchkit = 0
        self.sites: list[str] = []
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if counter.syncs(func.overloadpacket.__name__, args, kwargs):
                    counter.count(func.overloadpacket.__name__)
                return func(*args, **kwargs)

        self.mode = Mode()

    def syncs(self, name: str, args: tuple, kwargs: dict) -> bool:
        if name in self.DATA_SIZED:
            return True
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())
        if name == "repeat_interleave":  # repeats as a tensor, (repeats) or (self, repeats, ...): summed to size it
            repeats = args[1] if len(args) > 1 else args[0]
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        return False

    def count(self, name: str) -> None:
        import sys

        self.total += 1
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.root):
                self.patchkit += 1
                self.sites.append(f"{name} at {frame.f_code.co_filename[len(self.root):]}:{frame.f_lineno}")
                return
            frame = frame.f_back

    def __enter__(self) -> HostSyncs:
        tolist = torch.Tensor.tolist

        def counting_tolist(tensor):
            self.count("tolist")
            return tolist(tensor)

        self.monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
        self.monkeypatch.undo()


def host_syncs_of_a_forward(case: str, layers: int, monkeypatch: pytest.MonkeyPatch) -> tuple[HostSyncs, int]:
    """One patched run, counted after a warm-up run: a padded training step (forward and backward) under
    unpad='model' or 'attention', or a left-padded greedy generate() of 3 tokens (a prefill and 2 decode steps).
    Returns the counts and how many attention calls went through the patch in the counted run."""
    from models import labels_for

    model = tiny_model(layers=layers)
    if case == "generate":
        ids, mask = padded_batch("left")

        def run():
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3,
                               do_sample=False, pad_token_id=0)
    else:
        model.train()
        ids, mask = padded_batch("mixed")
        labels = labels_for(ids, mask)

        def run():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

    unpad = "model" if case == "generate" else case.removeprefix("train-unpad-")
    with patchkit.apply_patch("llama2", backend="sdpa", unpad=unpad, model=model) as handle:
        run()  # first-call work (liveness marks, lazy imports) is not per forward
        before = handle.calls
        with HostSyncs(monkeypatch) as syncs:
            run()
        return syncs, handle.calls - before


@pytest.mark.parametrize("case", ["train-unpad-model", "train-unpad-attention", "generate"])
def test_host_syncs_of_a_forward_do_not_grow_with_the_number_of_layers(case, monkeypatch):
    """The unpadding metadata (indices, cu_seqlens, max_seqlen) is read to the host once per model forward, never once
    per layer: a 2-layer and an 8-layer LLaMA make the same number of host-syncing reads, patchkit's and in all.
    Measured (torch 2.13, transformers 5.25): training 7 (unpad='model': 4 before the layers run, then which rows are
    labelled and whether their labels are in the vocabulary) and 4 (unpad='attention'), all patchkit's; generate()
    17, of which patchkit's 9 (5 in the prefill, 2 per decode step: whether the step's last column is padding, and its
    metadata) and generate()'s own 8."""
    shallow, shallow_calls = host_syncs_of_a_forward(case, 2, monkeypatch)
    deep, deep_calls = host_syncs_of_a_forward(case, 8, monkeypatch)
    forwards = 3 if case == "generate" else 1
    assert (shallow_calls, deep_calls) == (2 * forwards, 8 * forwards)  # every layer ran through the patch
    assert shallow.patchkit > 0, "the counter saw none of patchkit's own host reads: it counts nothing"
    assert (deep.patchkit, deep.total) == (shallow.patchkit, shallow.total), (
        f"host syncs grew with depth: 2 layers {shallow.total} (patchkit {shallow.sites}), "
        f"8 layers {deep.total} (patchkit {deep.sites})")


def test_a_decode_step_waits_on_the_device_no_more_often_than_transformers_own(monkeypatch):
    """A decode step's padding lengths are read to the host once (its metadata), where transformers' sdpa reads once
    too (whether the mask can be skipped): the step's decisions read nothing else of the device (the plan's check for
    a head that reads every position asks the model first, the mask's padding only for such a head)."""
    model = set_attention(tiny_model(layers=2), "sdpa")  # transformers' sdpa reads the mask once, its eager never
    inputs = decode_inputs(model)

    def step() -> torch.Tensor:
        with torch.no_grad():
            return model(**{**inputs, "past_key_values": copy.deepcopy(inputs["past_key_values"])}).logits

    step()
    with HostSyncs(monkeypatch) as plain:
        expected = step()
    with patchkit.apply_patch("llama2", backend="sdpa", model=model) as handle:
        step()  # first-call work is not per step
        with HostSyncs(monkeypatch) as patched:
            got = step()
        assert handle.calls == 4
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert plain.total >= 1 and patched.patchkit == 1, patched.sites
    assert patched.total <= plain.total, (plain.total, patched.sites)
