"""Hooks on a model's modules under the packed forward see the batch as transformers gives it: NEFTune's noise on the
input embedding is drawn over the padded batch (its scale reads the padded shape); a hook of the user's on a layer
keeps the (B, S, H) layout in the layers, said once. Hooks known to read no shape (PEFT's input-gradient switch,
frameworks', those marked `patchkit.shape_free`) keep the packed row of real tokens."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from models import clone, labels_for, padded_batch, tiny_model
from test_lm_head import assert_trained_alike, family, trainer_run

import patchkit
from patchkit.forward.inputs import module_hooks
from patchkit.hooks.head import lm_head

try:  # 5.x; the Trainer's own module before it
    from transformers.integrations.neftune import neftune_post_forward_hook
except ImportError:
    from transformers.trainer_utils import neftune_post_forward_hook

ALPHA = 5.0  # NEFTune's alpha: noise of at most alpha / sqrt(S * H) per element, S the padded length


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(module_hooks, "_warned", set())


def neftune(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """NEFTune's hook on the input embedding, as the Trainer adds it (`neftune_noise_alpha`), and the shapes it sees."""
    embedding = model.get_input_embeddings()
    embedding.neftune_noise_alpha = ALPHA
    seen: list[tuple[int, ...]] = []
    embedding.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    embedding.register_forward_hook(neftune_post_forward_hook)
    return seen


def assert_steps_alike(got: tuple, want: tuple) -> None:
    """`seeded_step`'s loss and gradients as unpatched."""
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=2e-6, rtol=1e-4, msg=name)


def two_patched_steps(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, unpad: str
                      ) -> tuple[tuple, dict[str, int], list[str]]:
    """Two seeded steps of `model` patched (the second after the fused head's check): the last's loss and gradients,
    the forwards' head counts by why, and patchkit's hook warnings."""
    with warnings.catch_warnings(record=True) as caught, patchkit.apply_patch(model=model, backend="sdpa",
                                                                             unpad=unpad) as handle:
        warnings.simplefilter("always")
        got = [seeded_step(model, ids, mask) for _ in range(2)][-1]
        heads = dict(handle.heads)
        assert handle.layers_patched > 0
    return got, heads, hook_warnings(caught)


def seeded_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor,
                                                                                                       dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # NEFTune: the same noise both ways, drawn over the same (B, S, H)
    out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask), **kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("unpad", ["model", "loss"])
@pytest.mark.parametrize("kind", ["right", "left"])
def test_neftune_draws_its_noise_over_the_padded_batch_as_unpatched(unpad, kind):
    """NEFTune scales its noise by the embedding output's size (alpha / sqrt(S * H)): on one packed row of real
    tokens it would be sqrt(B * S / nnz) times smaller, silently. Its hook sees the padded batch, and the loss and
    gradients equal unpatched (the same noise), while the layers after it run on real tokens."""
    model = tiny_model(kv_heads=2).train()
    ref = clone(model)
    ids, mask = padded_batch(kind)
    want_seen, seen = neftune(ref), neftune(model)
    want = seeded_step(ref, ids, mask)
    layers: list[int] = []
    observe = patchkit.shape_free(lambda m, args: layers.append(args[0].shape[1]))  # a hook that is not NEFTune's
    model.model.layers[0].register_forward_pre_hook(observe)
    with patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad) as handle:
        got = seeded_step(model, ids, mask)
        assert handle.calls > 0 and handle.stepped_aside == {}
    assert seen == want_seen == [tuple(ids.shape) + (64,)]
    assert layers == [int(mask.sum())]  # the decoder on real tokens only
    assert_steps_alike(got, want)
    hooks = model.get_input_embeddings()
    assert len(hooks._forward_hooks) == 2 and not hooks._forward_pre_hooks  # the user's two, none of patchkit's


def test_the_trainers_neftune_trains_as_unpatched(tmp_path):
    """The HF Trainer with `neftune_noise_alpha` (TRL's SFTConfig passes it on), 2 padded rows a micro-batch: the
    losses and trained weights equal unpatched, and every micro-batch ran the fused head. Plain SGD: Adam's first
    steps would magnify float-order differences in near-zero gradients past the weights' tolerance."""
    ids, mask = padded_batch("right", batch=4, seq=16)
    rows = [dict(input_ids=i, attention_mask=m, labels=lab) for i, m, lab in zip(ids, mask, labels_for(ids, mask))]
    want, got = (trainer_run(family("llama"), rows, way, tmp_path, max_steps=2, per_device_train_batch_size=2,
                             optim="sgd", neftune_noise_alpha=ALPHA)
                 for way in (None, "model"))
    assert got[2] == {lm_head.FUSED: 4}  # 2 steps x 2 micro-batches
    assert_trained_alike(got, want)


def make_inputs_require_grad(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
    """PEFT's and TRL's copy of transformers' hook, by its name there."""
    out.requires_grad_(True)


@pytest.mark.parametrize("switch", ["transformers", "peft"])
def test_an_input_gradient_switch_keeps_the_embedding_on_real_tokens(switch):
    """`enable_input_require_grads` (PEFT with gradient checkpointing, every LoRA run that checkpoints) or PEFT's
    and TRL's own copy hook the embedding to mark its output as requiring grad, whatever its shape: the embedding
    still runs on real tokens."""
    model = tiny_model(kv_heads=2).train()
    ref = clone(model)
    for m in (model, ref):
        if switch == "transformers":
            m.enable_input_require_grads()
        else:
            m.get_input_embeddings().register_forward_hook(make_inputs_require_grad)
        m.model.embed_tokens.weight.requires_grad_(False)  # frozen, as under LoRA: the hook gives the layers grads
    seen: list[tuple[int, ...]] = []
    embedding = model.get_input_embeddings()
    embedding.forward = patchkit.shape_free(  # no hook; a spy of the test's own, said to read no shape
        lambda ids, plain=embedding.forward: seen.append(tuple(ids.shape)) or plain(ids))
    ids, mask = padded_batch("mixed")
    want = seeded_step(ref, ids, mask)
    with patchkit.apply_patch(model=model, backend="sdpa"):
        got = seeded_step(model, ids, mask)
    assert seen == [(1, int(mask.sum()))]
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    assert got[1].keys() == want[1].keys()


def last_positions(model: torch.nn.Module, hook_wrapper=lambda hook: hook) -> list[torch.Tensor]:
    """A user's hook on layer 1 that keeps each row's last hidden state (`out[:, -1]`: what a probe or a steering
    vector's fit reads), and what it kept."""
    kept: list[torch.Tensor] = []

    def keep_last(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        kept.append((out[0] if isinstance(out, tuple) else out)[:, -1].detach().clone())

    model.model.layers[1].register_forward_hook(hook_wrapper(keep_last))
    return kept


def hook_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "patchkit: a hook (" in str(w.message)]


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_users_hook_on_a_layer_sees_the_padded_rows_and_the_numbers_are_unpatched(mode):
    """On the packed row the hook's `out[:, -1]` would be one vector, the last real token of the last row, not one
    per row: silently. The forwards it sees keep their (B, S, H) layout in the layers (attention patched), with one
    warning naming the hook, where it sits and the fix."""
    model = tiny_model(kv_heads=2, layers=2).train(mode == "train")
    ref = clone(model)
    ids, mask = padded_batch("left")
    want_kept, kept = last_positions(ref), last_positions(model)
    want = seeded_step(ref, ids, mask) if mode == "train" else ref(input_ids=ids, attention_mask=mask, use_cache=False)
    with warnings.catch_warnings(record=True) as caught, patchkit.apply_patch(model=model, backend="sdpa") as handle:
        warnings.simplefilter("always")
        for _ in range(2):
            got = (seeded_step(model, ids, mask) if mode == "train"
                   else model(input_ids=ids, attention_mask=mask, use_cache=False))
        assert handle.calls == 2 * 2 and handle.stepped_aside == {}
    said = hook_warnings(caught)
    assert len(said) == 1 and "keep_last" in said[0] and "'layers.1'" in said[0] and "shape_free" in said[0], said
    assert [k.shape for k in kept] == [want_kept[0].shape] * 2 == [(4, 64)] * 2
    torch.testing.assert_close(kept[0], want_kept[0], atol=2e-5, rtol=1e-4)
    if mode == "train":
        assert_steps_alike(got, want)
    else:
        real = mask.bool()
        torch.testing.assert_close(got.logits[real], want.logits[real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_a_users_hook_on_the_head_sees_every_positions_logits_and_the_numbers_are_unpatched(unpad):
    """The head is outside the base model: a hook on it (the logits' norm at real tokens, read through the batch's
    mask) saw the packed row, or the labelled rows alone, and failed. The head now runs on the padded batch where
    such a hook sits, said once; marked `shape_free`, it sees the rows patchkit hands the head."""
    model = tiny_model(kv_heads=2, layers=2).train()
    ref = clone(model)
    ids, mask = padded_batch("left")
    norms: dict[str, list] = {"want": [], "got": []}

    def hook_on(m: torch.nn.Module, key: str) -> None:
        m.lm_head.register_forward_hook(lambda mod, args, out: norms[key].append(out[mask.bool()].norm(dim=-1)))

    hook_on(ref, "want")
    hook_on(model, "got")
    want = seeded_step(ref, ids, mask)
    got, heads, said = two_patched_steps(model, ids, mask, unpad)
    assert list(heads) == ["a hook on its head that may read the (B, S, V) layout"]
    assert len(said) == 1 and "'lm_head'" in said[0] and "shape_free" in said[0], said
    torch.testing.assert_close(norms["got"][-1], norms["want"][0], atol=2e-5, rtol=1e-4)
    assert_steps_alike(got, want)
    rows: list = []
    marked = clone(ref)
    marked.lm_head._forward_hooks.clear()
    marked.lm_head.register_forward_hook(patchkit.shape_free(lambda mod, args, out: rows.append(out.shape[:-1])))
    with patchkit.apply_patch(model=marked, backend="sdpa", unpad=unpad) as handle:
        marked(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)).loss.backward()
        assert "a hook on its head that may read the (B, S, V) layout" not in handle.heads
    assert rows and rows[0].numel() < mask.numel()  # real tokens only (the labelled ones, fused: its checking call)


@pytest.mark.parametrize("where", ["head", "layer", "every module"])
@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_a_users_backward_hook_sees_the_padded_gradients_and_the_numbers_are_unpatched(unpad, where):
    """A backward hook that weighs each row's gradient (read by the batch's layout) on the head, on a layer or on
    every module. The fused head never called the head's module in the backward, so its hook did not run (every
    gradient 0.67 off, silently), and one on the packed head saw (1, nnz + 1, V) and failed. Backward hooks are
    read as forward hooks are: the module runs on the padded batch, said once."""
    model = tiny_model(kv_heads=2, layers=2).train()
    ref = clone(model)
    ids, mask = padded_batch("left")
    weights = torch.tensor([3.0, 0.5, 1.0, 2.0])[: ids.shape[0]]

    def weigh(module: torch.nn.Module, grad_output: tuple) -> tuple:
        return (grad_output[0] * weights.view(-1, *[1] * (grad_output[0].dim() - 1)),)

    def hook_on(m: torch.nn.Module) -> list:
        handles = []
        if where == "every module":
            handles.append(torch.nn.modules.module.register_module_full_backward_pre_hook(
                lambda mod, go: weigh(mod, go) if mod is m.lm_head else None))
        else:
            handles.append((m.lm_head if where == "head" else m.model.layers[1]).register_full_backward_pre_hook(weigh))
        return handles

    handles = hook_on(ref)
    want = seeded_step(ref, ids, mask)
    for h in handles:
        h.remove()
    handles = hook_on(model)
    try:
        got, heads, said = two_patched_steps(model, ids, mask, unpad)
    finally:
        for h in handles:
            h.remove()
    assert len(said) == 1, said
    assert_steps_alike(got, want)
    if where != "layer":
        assert list(heads) == ["a hook on its head that may read the (B, S, V) layout"] or where == "every module"


@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_a_users_hook_on_the_base_model_sees_its_padded_output_and_steers_the_loss_as_unpatched(unpad):
    """A forward hook on the base model (a steering hook scaling its last hidden state in place) saw the packed row,
    or the labelled rows alone, where the causal LM took its base model's rows for the head: in a loop that reads
    the loss alone its edit missed the loss (4.604 for 4.586), and the next step failed. The base model now repads
    its output where such a hook sits, said once; the layers still run on real tokens."""
    model = tiny_model(kv_heads=2, layers=2).train()
    ref = clone(model)
    ids, mask = padded_batch("left")
    shapes: list = []

    def scale(mod: torch.nn.Module, args: tuple, out) -> None:
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        shapes.append(tuple(hidden.shape))
        hidden.mul_(0.5)

    def steer(m: torch.nn.Module) -> None:
        m.model.register_forward_hook(scale)

    steer(ref)
    steer(model)
    want = seeded_step(ref, ids, mask)
    got, heads, said = two_patched_steps(model, ids, mask, unpad)
    assert list(heads) == ["a hook on its base model that may read the (B, S, H) layout"]
    assert set(shapes) == {tuple(ids.shape) + (64,)}, shapes
    assert len(said) == 1
    assert_steps_alike(got, want)


def test_a_hook_marked_shape_free_and_a_frameworks_hooks_keep_the_packed_row():
    """`patchkit.shape_free(hook)`: the user says the hook reads no shape. torch's pruning re-derives a weight in a
    pre-hook (a framework's hook: `torch.nn.utils`). Both forwards run their layers on the packed row, unannounced,
    with the unpatched numbers."""
    from torch.nn.utils import prune

    class Probe:
        def __init__(self) -> None:
            self.seen: list[tuple[int, ...]] = []

        def hook(self, module: torch.nn.Module, args: tuple) -> None:
            self.seen.append(tuple(args[0].shape))

    model = tiny_model(kv_heads=2, layers=2)
    ref = clone(model)
    for m in (model, ref):
        prune.l1_unstructured(m.model.layers[0].self_attn.q_proj, "weight", amount=0.3)
    kept = last_positions(model, patchkit.shape_free)
    probe = Probe()
    model.model.layers[0].register_forward_pre_hook(patchkit.shape_free(probe.hook))  # a bound method, marked
    ids, mask = padded_batch("left")
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with warnings.catch_warnings(record=True) as caught, patchkit.apply_patch(model=model, backend="sdpa"):
            warnings.simplefilter("always")
            got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert hook_warnings(caught) == []
    assert [k.shape for k in kept] == [(1, 64)]  # the packed row's last token: the marked hook saw the packed row
    assert probe.seen == [(1, int(mask.sum()), 64)]
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


def test_a_global_hook_keeps_the_layout_and_torchs_module_tracker_keeps_the_packed_row():
    """A hook on every module (`register_module_forward_hook`: a probe reading each decoder layer's `out[:, -1]`)
    sees the layers' outputs as any hook does: the forwards keep their (B, S, H) layout, with one warning saying it
    is a global hook. torch's FlopCounterMode tracks modules by global hooks that read no shape: the packed row."""
    from torch.nn.modules.module import register_module_forward_hook
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny_model(kv_heads=2, layers=2)
    ids, mask = padded_batch("left")
    layers = set(model.model.layers)
    kept: list[torch.Tensor] = []

    def keep_last(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        if module in layers:
            kept.append((out[0] if isinstance(out, tuple) else out)[:, -1].detach().clone())

    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        handle = register_module_forward_hook(keep_last)
        try:
            want_hooked = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            want_kept, kept[:] = list(kept), []
            with warnings.catch_warnings(record=True) as caught, patchkit.apply_patch(model=model, backend="sdpa"):
                warnings.simplefilter("always")
                got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        finally:
            handle.remove()
        said = hook_warnings(caught)
        assert len(said) == 1 and "keep_last" in said[0] and "global hook" in said[0], said
        assert [k.shape for k in kept] == [k.shape for k in want_kept] == [(4, 64)] * 2
        for k, w in zip(kept, want_kept):
            torch.testing.assert_close(k, w, atol=2e-5, rtol=1e-4)
        seen = last_positions(model, patchkit.shape_free)
        with warnings.catch_warnings(record=True) as caught, patchkit.apply_patch(model=model, backend="sdpa"):
            warnings.simplefilter("always")
            with FlopCounterMode(display=False):
                counted = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert hook_warnings(caught) == [] and [s.shape for s in seen] == [(1, 64)]  # the packed row
    real = mask.bool()
    for logits in (want_hooked, got, counted):
        torch.testing.assert_close(logits[real], want[real], atol=2e-5, rtol=1e-4)


class Steering(torch.nn.Module):
    """repeng's ControlModule (vgel/repeng, control.py), operator add: adds a vector to a layer's output from each
    row's first position on, read off position_ids and the output's (B, S) shape."""

    def __init__(self, block: torch.nn.Module, control: torch.Tensor) -> None:
        super().__init__()
        self.block, self.control = block, control

    def forward(self, *args, **kwargs):
        output = self.block(*args, **kwargs)
        hidden = output[0] if isinstance(output, tuple) else output
        positions = kwargs["position_ids"]
        start = (positions == 0).cumsum(1).argmax(1, keepdim=True)
        columns = torch.arange(positions.size(1)).unsqueeze(0)
        hidden = hidden + self.control.reshape(1, 1, -1) * (columns >= start).float().reshape(*hidden.shape[:2], 1)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


class SoftPrompt(torch.nn.Module):
    """A soft-prompt embedding of the tutorials': learned vectors in each row's first `n` columns."""

    def __init__(self, embedding: torch.nn.Embedding, n: int = 2) -> None:
        super().__init__()
        self.embedding, self.n = embedding, n
        self.prompt = torch.nn.Parameter(torch.randn(n, embedding.embedding_dim, generator=torch.Generator()
                                                     .manual_seed(3)) * 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rest = self.embedding(tokens[:, self.n:])
        return torch.cat([self.prompt.expand(tokens.shape[0], -1, -1), rest], 1)


@pytest.mark.parametrize("part", ["layer", "embedding"])
def test_a_scripts_own_module_around_a_layer_or_as_the_embedding_sees_the_padded_rows(part):
    """A steering wrapper around a decoder layer (it reads position_ids and the (B, S) output) and a soft-prompt
    embedding (it splices each row's first columns) ran on the packed row: the vector and the prompt reached one
    row (logits 0.52 and 0.45 off, silently). The layer's wrapper keeps the layers' layout, said once; the
    embedding runs on the padded ids; both give unpatched's numbers."""
    model = tiny_model(kv_heads=2, layers=2)
    if part == "layer":
        model.model.layers[0] = Steering(model.model.layers[0], torch.randn(64, generator=torch.Generator()
                                                                            .manual_seed(2)) * 0.5)
    else:
        model.set_input_embeddings(SoftPrompt(model.get_input_embeddings()))
    ref = clone(model)
    ids, mask = padded_batch("right")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    want = seeded_step(ref, ids, mask, position_ids=positions)
    with warnings.catch_warnings(record=True) as caught, patchkit.apply_patch(model=model, backend="sdpa") as handle:
        warnings.simplefilter("always")
        got = seeded_step(model, ids, mask, position_ids=positions)
        assert handle.calls == 2 and handle.stepped_aside == {}
    said = [str(w.message) for w in caught if "a forward of the script's own around a decoder layer" in str(w.message)]
    assert len(said) == (part == "layer") and all("Steering.forward on 'layers.0'" in s for s in said), said
    assert_steps_alike(got, want)
