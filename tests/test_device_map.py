"""A model dispatched by accelerate's big-model inference (`from_pretrained(device_map=...)`, `dispatch_model`):
every module whose weights sit apart runs under accelerate's hook, which moves its inputs to its device and loads an
offloaded weight for its forward. patchkit runs inside those hooks: the numbers of the unpatched model dispatched the
same way, the head and loss on real tokens, and, under unpad="loss", the head fused with the loss (its weight read
while accelerate's hook holds it). On this machine's one device the hooks are forced (`force_hooks`), or weights are
offloaded to disk, which the hooks really load and unload around each forward."""

from __future__ import annotations

import pytest
import torch
from models import labels_for, padded_batch, tiny_model
from test_loss_alone import assert_grads

import patchkit
from patchkit.hooks.head import fused_head, lm_head, weight_holders

accelerate = pytest.importorskip("accelerate")

PLACES = {
    "hooks": {},  # every module on the one device, each under accelerate's hook (device_map="auto" across GPUs)
    "offload": {"model.layers.1": "disk", "lm_head": "disk"},  # a layer and the head loaded per forward
}


def dispatched(place: str, folder: str) -> torch.nn.Module:
    """The tiny LLaMA as `device_map` places it: one entry per module, as accelerate's auto map writes it."""
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu", **PLACES[place]}
    model = tiny_model().train()
    return accelerate.dispatch_model(model, device_map=device_map, offload_dir=folder, force_hooks=True)


def train_step(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    """Two forwards with labels (the fused head is checked on the first) and the second's gradients: those of the
    weights in place (an offloaded weight is a new tensor each forward; its gradient is dropped with it)."""
    ids, mask = padded_batch("right")
    labels = labels_for(ids, mask)
    model(input_ids=ids, attention_mask=mask, labels=labels)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("way", ["before dispatch", "after dispatch"])
@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_a_dispatched_model_trains_as_unpatched(tmp_path, place, way, unpad):
    """Loss and gradients equal the unpatched dispatched model's, with the head on real tokens (fused with the loss
    where the caller reads the loss alone), whether the class patch came before the dispatch or the instance patch
    after it (the LM's forward is then accelerate's hook around the family's own)."""
    want = train_step(dispatched(place, str(tmp_path / "want")))
    if way == "before dispatch":
        with patchkit.apply_patch("llama2", backend="sdpa", strict=True, unpad=unpad) as handle:
            got = train_step(dispatched(place, str(tmp_path / "got")))
    else:
        model = dispatched(place, str(tmp_path / "got"))
        with patchkit.apply_patch(model=model, backend="sdpa", strict=True, unpad=unpad) as handle:
            got = train_step(model)
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    assert want[1]
    assert_grads(got[1], want[1])
    # the first forward's output is dropped unread (not proven to be: the head on real tokens, unfused, under
    # unpad="model"); the second's caller reads its loss alone (`caller_code`): fused under either unpad
    assert handle.heads == ({lm_head.FUSED: 2} if unpad == "loss" else {lm_head.REAL_TOKENS: 1, lm_head.FUSED: 1})


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("place", PLACES)
def test_a_dispatched_model_generates_as_unpatched(tmp_path, place, cache):
    """generate() on a left-padded batch into either cache (a static one's layers are placed by the keys they first
    take, each on its layer's device): the unpatched dispatched model's tokens, nothing stepped aside."""
    ids, mask = padded_batch("left")

    def generate(model: torch.nn.Module) -> torch.Tensor:
        return model.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                     pad_token_id=0, cache_implementation=cache)

    want = generate(dispatched(place, str(tmp_path / "want")))
    model = dispatched(place, str(tmp_path / "got"))
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        torch.testing.assert_close(generate(model), want, atol=0, rtol=0)
        assert handle.calls and not handle.stepped_aside


def test_only_accelerates_placing_hooks_fuse_the_head(tmp_path):
    """A head under accelerate's hook is fused only where that hook places and computes nothing (AlignDevicesHook
    alone, or in a SequentialHook); under another hook of accelerate's the family's own head runs."""
    model = dispatched("hooks", str(tmp_path))
    assert fused_head.plain_head(model) is model.lm_head

    class Scaling(accelerate.hooks.ModelHook):
        def post_forward(self, module, output):
            return output * 2

    accelerate.hooks.add_hook_to_module(model.lm_head, Scaling(), append=True)
    assert type(model.lm_head._hf_hook).__name__ == "SequentialHook"
    assert fused_head.plain_head(model) is None
    accelerate.hooks.remove_hook_from_module(model.lm_head)
    assert fused_head.plain_head(model) is model.lm_head  # nn.Linear's own forward: plain again


def test_lora_on_a_dispatched_head_runs_fused_as_unpatched(tmp_path):
    """PEFT's LoRA on the head of a model `device_map` placed (QLoRA's `device_map="auto"` across GPUs, LoRA on
    `lm_head` too): the fused loss runs as the base layer's forward under accelerate's hook, which moves the rows to
    the head's device, where the adapters are; loss and gradients as unpatched, every step fused."""
    peft = pytest.importorskip("peft")

    def lora_model(folder: str) -> torch.nn.Module:
        model = peft.get_peft_model(dispatched("hooks", folder), peft.LoraConfig(r=4, target_modules=["q_proj",
                                                                                                      "lm_head"]))
        torch.nn.init.normal_(model.get_output_embeddings().lora_B["default"].weight, std=0.5,
                              generator=torch.Generator().manual_seed(1))  # drawn, not zero: the term counts
        return model

    want = train_step(lora_model(str(tmp_path / "want")))
    model = lora_model(str(tmp_path / "got"))
    assert weight_holders.hooks_of(model.get_output_embeddings().base_layer) == "accelerate"
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True, unpad="loss") as handle:
        got = train_step(model)
    assert handle.heads == {lm_head.FUSED: 2}
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    assert any("lm_head.lora_B" in name for name in want[1])
    assert_grads(got[1], want[1])


def split_onto_meta(model: torch.nn.Module) -> torch.nn.Module:
    """The model's second half (its last layer, the norm and the head) under accelerate's hook on the meta device, as
    `device_map` puts a model's second half on a second GPU: every tensor that crosses into it moves there. Numbers
    are gone there, but an op that meets tensors of both devices still fails, as on GPUs."""
    for name in ("model.layers.1", "model.norm", "lm_head"):
        module = model.get_submodule(name)
        accelerate.hooks.add_hook_to_module(module.to("meta"), accelerate.hooks.AlignDevicesHook("meta"))
    return model


def spy_on_devices(monkeypatch) -> list:
    """The devices each varlen call's q, k, v and cu_seqlens are on (its gather indices must be on q's)."""
    from patchkit.backends import SdpaBackend

    seen = []
    varlen = SdpaBackend.varlen

    def on_q_device(q, k, v, meta, **kw):
        seen.append({t.device for t in (q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k) if t is not None})
        assert all(t.device == q.device for t in (meta.indices_q, meta.indices_k) if t is not None)
        return varlen(q, k, v, meta, **kw)

    monkeypatch.setattr(SdpaBackend, "varlen", staticmethod(on_q_device))
    return seen


@pytest.mark.parametrize("unpad", ["attention", "model"])
def test_a_model_split_across_devices_runs_each_layer_on_its_own(monkeypatch, unpad):
    """A layer on the second device gets the forward's unpadding metadata on its device (moved once), the base
    model's outputs are repadded and the head's logits placed on the device they end on: the forward runs through,
    its loss on the second device, as the unpatched split model's. (unpad="loss" checks its labels on the host,
    which a meta tensor cannot answer.)"""
    seen = spy_on_devices(monkeypatch)
    ids, mask = padded_batch("right")
    labels = labels_for(ids, mask)
    want = split_onto_meta(tiny_model().train())(input_ids=ids, attention_mask=mask, labels=labels)
    assert want.loss.device.type == "meta"
    model = split_onto_meta(tiny_model().train())
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True, unpad=unpad) as handle:
        got = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert got.loss.device.type == "meta" and got.loss.shape == want.loss.shape
    assert got.logits.shape == want.logits.shape and got.logits.device.type == "meta"
    assert seen == [{torch.device("cpu")}, {torch.device("meta")}]
    assert handle.heads == ({} if unpad == "attention" else {lm_head.REAL_TOKENS: 1})


def test_a_split_model_under_the_attention_name_alone_runs_each_layer_on_its_own(monkeypatch):
    """`attn_implementation="patchkit"` (no class patched): the mask transformers builds reaches each layer through
    accelerate's hooks, and each layer unpads on its own device."""
    seen = spy_on_devices(monkeypatch)
    ids, mask = padded_batch("right")
    model = split_onto_meta(tiny_model().train())
    patchkit.register_attention(backend="sdpa")
    model.set_attn_implementation("patchkit")
    try:
        out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    finally:
        model.set_attn_implementation("eager")
        patchkit.register_attention(backend="auto")
    assert out.logits.device.type == "meta" and out.logits.shape == (*ids.shape, model.config.vocab_size)
    assert seen == [{torch.device("cpu")}, {torch.device("meta")}]


def split_at(model: torch.nn.Module, first: str, second: str) -> torch.nn.Module:
    """The model's first half (embeddings, layer 0) on `first`, its second half under accelerate's hook on `second`,
    and the model's outputs back on its inputs' device, as `dispatch_model` hooks the model itself."""
    model.to(first)
    for name in ("model.layers.1", "model.norm", "lm_head"):
        module = model.get_submodule(name).to(second)
        accelerate.hooks.add_hook_to_module(module, accelerate.hooks.AlignDevicesHook(torch.device(second)))
    return accelerate.hooks.add_hook_to_module(model, accelerate.hooks.AlignDevicesHook(io_same_device=True))


SPLITS = {"GPU, CPU": ("cuda:0", "cpu", 1), "two GPUs": ("cuda:0", "cuda:1", 2)}


@pytest.mark.gpu
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("unpad", ["attention", "model", "loss"])
def test_a_model_split_across_devices_trains_and_generates_as_unpatched(split, unpad):
    """Numbers, not only devices: a float32 model split between a GPU and the CPU, or across two GPUs: the unpatched
    split model's loss and gradients on a right-padded batch, and its tokens generated from a left-padded one."""
    first, second, gpus = SPLITS[split]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA device(s)")
    (ids, mask), (prompts, prompt_mask) = (tuple(t.to(first) for t in padded_batch(k)) for k in ("right", "left"))

    def run(model: torch.nn.Module) -> tuple:
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)).loss
        loss.backward()
        grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
        tokens = [model.eval().generate(input_ids=prompts, attention_mask=prompt_mask, max_new_tokens=4,
                                        do_sample=False, pad_token_id=0, cache_implementation=cache).cpu()
                  for cache in ("dynamic", "static")]  # a static cache's layers each on its layer's device
        return float(loss.detach()), grads, torch.stack(tokens)

    want = run(split_at(tiny_model(), first, second))
    model = split_at(tiny_model(), first, second)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True, unpad=unpad):
        got = run(model)
    assert got[0] == pytest.approx(want[0], abs=1e-4)
    assert_grads(got[1], want[1], atol=1e-4)
    torch.testing.assert_close(got[2], want[2], atol=0, rtol=0)


@pytest.mark.parametrize("q_len", [4, 1], ids=["prefill", "decode step"])
def test_the_metadata_moves_once_to_each_device(q_len):
    """A forward's metadata, a prefill's or a decode step's behind a cache (built lazily from its masks), is itself on
    its own device and one copy, made once, on another: every tensor a kernel or a gather reads, the host lengths
    as they were."""
    from patchkit.forward.masks import build_metadata

    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    meta = build_metadata(mask, 2, q_len, 4, torch.device("cpu"))
    assert meta.on(torch.device("cpu")) is meta
    moved = meta.on(torch.device("meta"))
    assert moved is meta.on(torch.device("meta")) and type(moved) is type(meta)
    tensors = (moved.cu_seqlens_q, moved.cu_seqlens_k, moved.indices_q, moved.indices_k, moved.key_lengths(),
               *moved.real_masks())
    assert {t.device.type for t in tensors if t is not None} == {"meta"}
    assert (moved.seqlens_q, moved.seqlens_k, moved.max_seqlen_k) == (meta.seqlens_q, meta.seqlens_k, meta.max_seqlen_k)


def test_from_pretrained_with_a_device_map_under_the_class_patch(tmp_path):
    """The way users get there: `apply_patch()`, then `from_pretrained(device_map=..., offload_folder=...)` with the
    head and a layer offloaded to disk: transformers dispatches the model itself, and its loss and gradients are the
    unpatched load's, the head fused."""
    tiny_model().save_pretrained(tmp_path / "tiny")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "disk"}

    def load(folder: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", device_map=device_map,
                                                    offload_folder=str(tmp_path / folder)).train()

    want = train_step(load("want"))
    with patchkit.apply_patch(backend="sdpa", strict=True, unpad="loss") as handle:
        got = train_step(load("got"))
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    assert want[1]
    assert_grads(got[1], want[1])
    assert handle.heads == {lm_head.FUSED: 2}
