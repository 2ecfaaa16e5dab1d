"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, GLM-4.1V, GLM-4.5V and Qwen3.5 (dense and MoE) with images:
patchkit serves the language model (multimodal RoPE rows, deepstack features, Qwen3.5's Gated DeltaNet layers) and
leaves the vision tower (on flash_attention_2 too)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import transformers
from families import TEXT_PATCH, family_model, packed_positions, served_here, set_attention
from models import VOCAB, padded_batch
from packaging.version import Version

import patchkit
from patchkit.errors import PatchkitError
from patchkit.hooks.name import attention_interface

if not served_here("qwen2_vl"):
    pytest.skip("patchkit serves Qwen2-VL and Qwen2.5-VL from transformers 4.54", allow_module_level=True)

# Qwen3-VL and Qwen3-VL-MoE from 4.57
FAMILIES = [f for f in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe", "qwen3_5",
                         "qwen3_5_moe") if served_here(f)]
QWEN3 = {"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"}
# 2D position_ids become Qwen3-VL's text row; Qwen2-VL's expand to RoPE rows, handed on as text positions before 4.57
TWO_D_PACKS = QWEN3 | ({"qwen2_vl", "qwen2_5_vl"} if Version(transformers.__version__) < Version("4.57") else set())
DEEPSTACK = {"qwen3_vl", "qwen3_vl_moe"}  # vision features added to the image tokens inside the language model
# The text model hands its layers the 3 RoPE rows as position_ids (GLM-4.5V's): transformers' flash_attention_2 reads
# them as packed positions, three times the tokens, and raises on packed rows (unpatched: nothing to compare there)
ROWS_TO_LAYERS = {"glm4v_moe"}


def layers(family: str) -> int:
    """The tiny model's attention layers: both, but Qwen3.5's first, a Gated DeltaNet (linear attention)."""
    return 1 if family in TEXT_PATCH else 2


IMAGE, START, END = VOCAB - 3, VOCAB - 1, 3  # family_model's image and vision-start tokens; END: any text token
GRID = torch.tensor([[1, 4, 4]])  # one frame of 4 x 4 patches, merged 2 x 2: 4 image tokens


def patch_size(model: torch.nn.Module) -> int:
    """Values per flattened image patch: channels x temporal patch x patch x patch (14 x 14 for Qwen2, 16 x 16 for
    Qwen3)."""
    vision = model.config.vision_config
    return getattr(vision, "in_channels", getattr(vision, "in_chans", 3)) * vision.temporal_patch_size * \
        vision.patch_size ** 2


def image_rows(model: torch.nn.Module, left: bool, lengths: tuple[int, ...] = (14, 10)) -> dict:
    """Rows of text around one image each (vision start, 4 image tokens, end), padded to the longest on the left
    (generation) or right (training), with the image's patches and grid (and the image-token map from 5.x)."""
    g = torch.Generator().manual_seed(7)
    seq = max(lengths)
    ids = torch.zeros(len(lengths), seq, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        tokens = torch.randint(4, VOCAB - 4, (n,), generator=g)
        tokens[2], tokens[3:7], tokens[7] = START, IMAGE, END
        span = slice(seq - n, seq) if left else slice(0, n)
        ids[row, span], mask[row, span] = tokens, 1
    batch = dict(input_ids=ids, attention_mask=mask, image_grid_thw=GRID.repeat(len(lengths), 1),
                 pixel_values=torch.randn(16 * len(lengths), patch_size(model), generator=g))
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
        batch["mm_token_type_ids"] = (ids == IMAGE).long()  # the processor's: 1 at image tokens (transformers 5.x)
    return batch


def train_step(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Loss, logits and gradients of one step; labels -100 at padding, at image tokens and right after padding."""
    model.zero_grad(set_to_none=True)
    pad = batch["attention_mask"] == 0
    after_pad = torch.zeros_like(pad)
    after_pad[:, 1:] = pad[:, :-1]
    labels = batch["input_ids"].masked_fill(pad | after_pad | (batch["input_ids"] == IMAGE), -100)
    out = model(**batch, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), None if out.logits is None else out.logits.detach(), grads


def assert_same_step(got: tuple, want: tuple, mask: torch.Tensor) -> None:
    torch.testing.assert_close(got[0], want[0], atol=3e-6, rtol=1e-5)
    torch.testing.assert_close(got[1][mask.bool()], want[1][mask.bool()], atol=3e-5, rtol=1e-4)
    assert got[2].keys() == want[2].keys()
    assert any(n.startswith("model.visual") for n in want[2])  # the vision tower trains too
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=3e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("way", ["instance", "class"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_step_with_images_equals_unpatched(family, way):
    """Right-padded rows with an image each: the model computes (3, B, S) RoPE rows from the image grid; the
    packed forward unpads each row with the batch. Loss, logits at real tokens and every gradient (vision tower
    included) equal unpatched sdpa, with both language layers, and only they, through the patch."""
    model = set_attention(family_model(family), "sdpa").train()
    batch = image_rows(model, left=False)
    want = train_step(model, batch)
    if way == "instance":
        handle = patchkit.apply_patch(model=model, backend="sdpa", strict=True)
    else:
        handle = patchkit.apply_patch(TEXT_PATCH.get(family, family), backend="sdpa", strict=True)
        model = set_attention(family_model(family), "sdpa").train()
    with handle:
        got = train_step(model, batch)
        assert handle.calls == layers(family) and not handle.stepped_aside and handle.check(model) == layers(family)
    assert_same_step(got, want, batch["attention_mask"])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loss_alone_with_images_equals_unpatched_and_runs_the_fused_head(family):
    """unpad="loss" on image rows (LLaMA-Factory's and TRL's Qwen-VL fine-tune): the multimodal model hands its
    causal LM the labelled rows alone (image tokens and padding are -100), checked on the first step and fused with
    the loss on the second; the loss and every gradient, the vision tower's included, equal unpatched. Where the
    family's forward computes its loss without transformers' loss_function (transformers before 5.0), each step
    keeps its own head and logits and the report says why."""
    from patchkit.hooks.head import lm_head
    from patchkit.hooks.install.forward_source import servable_forward

    model = set_attention(family_model(family), "sdpa").train()
    served = servable_forward(type(model).forward)
    batch = image_rows(model, left=False)
    want = train_step(model, batch)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True, unpad="loss") as handle:
        got = [train_step(model, batch) for _ in range(2)]
        why = f"{type(model).__name__}'s forward computes its loss without transformers' loss_function"
        assert handle.heads == ({lm_head.FUSED: 2} if served else {why: 2})
    for loss, logits, grads in got:
        assert (logits is None) == served
        torch.testing.assert_close(loss, want[0], atol=3e-6, rtol=1e-5)
        assert grads.keys() == want[2].keys()
        for name, grad in want[2].items():
            torch.testing.assert_close(grads[name], grad, atol=3e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_where_the_fused_heads_check_fails_the_lm_reruns_on_its_language_models_output(family):
    """The fused head's check on the first step fails (the config names a softcap that Qwen-VL's forward does not
    apply): the causal LM runs again with its own head on every labelled row, on the language model's output (its
    layers do not run again; the vision tower, between the two, does); the loss and every gradient equal
    unpatched, and every later step keeps the family's own head."""
    from patchkit.hooks.head import lm_head
    from patchkit.hooks.install.forward_source import servable_forward

    model = set_attention(family_model(family), "sdpa").train()
    if not servable_forward(type(model).forward):
        pytest.skip("this transformers' Qwen-VL computes its loss without loss_function: nothing fused to check")
    model.config.get_text_config().final_logit_softcapping = 0.5
    layers = []
    model.get_decoder().layers[0].register_forward_hook(patchkit.shape_free(lambda *_: layers.append(1)))
    batch = image_rows(model, left=False)
    want = train_step(model, batch)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True, unpad="loss") as handle:
        got = [train_step(model, batch) for _ in range(2)]
        assert handle.heads == {lm_head.LOSS_ONLY: 2} and len(layers) == 3
    for loss, logits, grads in got:
        assert logits is None
        torch.testing.assert_close(loss, want[0], atol=3e-6, rtol=1e-5)
        for name, grad in want[2].items():
            torch.testing.assert_close(grads[name], grad, atol=3e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f in DEEPSTACK])
def test_image_tokens_marked_padding_keep_the_padded_row_for_their_deepstack_features(family):
    """Qwen3-VL adds deepstack features to every image token, padding or not (`visual_pos_masks`); transformers' own
    tests mark image tokens as padding (random masks), and 37 of them failed patched: the packed row dropped those
    tokens and the features no longer fit. Such a forward keeps the padded row (attention still through the patch),
    equal to unpatched."""
    model = set_attention(family_model(family), "sdpa").train()
    batch = image_rows(model, left=False)
    batch["attention_mask"][1, 2:8] = 0  # the second row's image span (vision start, image tokens, end): a hole
    want = train_step(model, batch)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got = train_step(model, batch)
        assert handle.calls == layers(family) and not handle.stepped_aside
    assert_same_step(got, want, batch["attention_mask"])


@pytest.mark.parametrize("way", ["instance", "name"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_forward_with_images_and_no_mask_equals_one_with_a_full_mask(family, way):
    """No attention_mask: the model computes 3 RoPE rows, and before transformers 4.57 (Qwen2-VL) or 5.3 (Qwen3-VL)
    its text model hands the time row on as text positions, constant over the image's tokens. patchkit read that as
    a document start at every image token (logits off by 0.2-0.34, silently), under the patch and under the
    registered name alone; attention now never takes documents from a row that repeats a nonzero position: the
    logits equal the same row's with a full mask, unpatched."""
    model = set_attention(family_model(family), "sdpa")
    batch = image_rows(model, left=False, lengths=(14,))
    no_mask = {k: v for k, v in batch.items() if k != "attention_mask"}
    with torch.no_grad():
        want = model(**batch).logits
        if way == "instance":
            with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
                got = model(**no_mask).logits
                assert handle.calls == layers(family) and not handle.stepped_aside
        else:
            patchkit.register_attention(backend="sdpa", strict=True)
            try:
                state = attention_interface.route_state()
                model.set_attn_implementation({"text_config": patchkit.ATTENTION_NAME, "vision_config": "sdpa"})
                got = model(**no_mask).logits
                assert state.calls == layers(family) and not state.stepped_aside
            finally:
                patchkit.register_attention(backend="auto", strict=False)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_generation_with_images_equals_unpatched(family):
    """generate() on left-padded rows with an image each: the prefill runs packed (RoPE rows unpadded), the decode
    steps continue from the model's rope deltas; the same greedy tokens as unpatched."""
    model = set_attention(family_model(family), "sdpa")
    batch = image_rows(model, left=True)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = model.generate(**batch, **kw)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got = model.generate(**batch, **kw)
        assert handle.calls == layers(family) * 6  # the prefill and five decode steps, each attention layer
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_right_padded_generation_steps_aside_though_the_model_takes_no_logits_to_keep(family):
    """generate() reads a right-padded row's next token at its padding; patchkit knew generate()'s prefill by its
    `logits_to_keep`, which Qwen2-VL's forward does not take before transformers 5.0: the prefill ran packed and the
    next tokens came from zeros (other tokens than unpatched, silently). The prefill steps aside, counted."""
    ids, mask = padded_batch("right", batch=3, seq=14)
    model = set_attention(family_model(family), "sdpa")
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = model.generate(ids, **kw)
        assert handle.stepped_aside == {"right_padded_generation": 1} and handle.calls == layers(family) * 3
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_dimensional_and_text_row_positions_pack_as_in_transformers(family):
    """These models pack documents by a text row in front of the 3 RoPE rows. 2D position_ids are RoPE positions
    alone in Qwen2-VL and Qwen2.5-VL (expanded to 3 rows: nothing packs by them) and the text row in Qwen3-VL (they
    pack). patchkit does as transformers does in each; and packs by the text row whether or not a cache is kept
    (transformers, only without one: the reference runs without)."""
    model = family_model(family, seed=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, VOCAB - 4, (1, 20), generator=g)
    positions = torch.cat([torch.arange(n) for n in (9, 4, 7)])[None]
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        packed = model(input_ids=ids, position_ids=packed_positions(family, positions), use_cache=False).logits
        with patchkit.apply_patch(TEXT_PATCH.get(family, family), backend="sdpa", strict=True):
            got = model(input_ids=ids, position_ids=positions).logits
            got_packed = model(input_ids=ids, position_ids=packed_positions(family, positions)).logits
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(got_packed, packed, atol=3e-5, rtol=1e-4)
    apart = (got - got_packed)[:, 9:].abs().max()  # the later documents see the first unless packed
    assert apart < 1e-5 if family in TWO_D_PACKS else apart > 1e-2, apart


@pytest.mark.parametrize("way", ["class", "name"])
@pytest.mark.parametrize("family", FAMILIES)
def test_three_text_only_rows_without_a_mask_pack_as_in_transformers(family, way):
    """Text-only documents given as 3 RoPE rows and no text row (no repeated position: attention may read them):
    patched, under the class patch or the registered name alone, the logits equal unpatched, whichever way the
    version packs them (transformers hands the time row on as text positions in some versions, none in others)."""
    model = set_attention(family_model(family, seed=2), "sdpa")
    ids = torch.randint(4, VOCAB - 4, (1, 20), generator=torch.Generator().manual_seed(3))
    rows = torch.cat([torch.arange(n) for n in (9, 4, 7)])[None, None].expand(3, 1, 20)
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=rows, use_cache=False).logits
        if way == "class":
            with patchkit.apply_patch(TEXT_PATCH.get(family, family), backend="sdpa", strict=True) as handle:
                got = model(input_ids=ids, position_ids=rows, use_cache=False).logits
                assert handle.calls == layers(family)
        else:
            patchkit.register_attention(backend="sdpa", strict=True)
            try:
                state = attention_interface.route_state()
                model.set_attn_implementation({"text_config": patchkit.ATTENTION_NAME, "vision_config": "sdpa"})
                got = model(input_ids=ids, position_ids=rows, use_cache=False).logits
                assert state.calls == layers(family)
            finally:
                patchkit.register_attention(backend="auto", strict=False)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_registered_name_for_the_language_model_alone_equals_unpatched(family):
    """`set_attn_implementation({'text_config': 'patchkit', 'vision_config': 'sdpa'})`, no patch: the language
    model's attention and masks through the registered name, the vision tower on sdpa; the whole name refused."""
    model = set_attention(family_model(family), "sdpa").train()
    batch = image_rows(model, left=False)
    want = train_step(model, batch)
    patchkit.register_attention(backend="sdpa", strict=True)
    try:
        model.set_attn_implementation({"text_config": patchkit.ATTENTION_NAME, "vision_config": "sdpa"})
        got = train_step(model, batch)
        set_attention(model, patchkit.ATTENTION_NAME)
        with pytest.raises(PatchkitError, match="vision_config"):
            model(**batch)
    finally:
        patchkit.register_attention(backend="auto", strict=False)
    assert_same_step(got, want, batch["attention_mask"])


def trainer_rows(model: torch.nn.Module) -> list[dict]:
    """Six right-padded rows with an image each, as a dataset of single examples."""
    rows = []
    for extra in range(3):
        batch = image_rows(model, left=False, lengths=(14, 10 + extra))
        for i in range(2):
            row = {k: batch[k][i] for k in ("input_ids", "attention_mask", "mm_token_type_ids") if k in batch}
            row["labels"] = row["input_ids"].masked_fill((row["attention_mask"] == 0) | (row["input_ids"] == IMAGE),
                                                         -100)
            row["pixel_values"], row["image_grid_thw"] = batch["pixel_values"][16 * i:16 * (i + 1)], GRID
            rows.append(row)
    return rows


def collate(rows: list[dict]) -> dict:
    """Text fields stacked, every image's patches and grid concatenated (what the Qwen VL processors hand over)."""
    images = ("pixel_values", "image_grid_thw")
    out = {k: torch.stack([r[k] for r in rows]) for k in rows[0] if k not in images}
    return {**out, **{k: torch.cat([r[k] for r in rows]) for k in images}}


def trainer_losses(family: str, tmp_path, patched: bool) -> tuple[list[float], int]:
    """Per-step losses of 3 HF Trainer steps, gradient checkpointing on; and the attention calls through the patch."""
    import transformers as tf

    handle = patchkit.apply_patch(TEXT_PATCH.get(family, family), backend="sdpa", strict=True) if patched else None
    try:
        model = set_attention(family_model(family), "sdpa").train()
        args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                    learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
                                    seed=0, gradient_checkpointing=True, remove_unused_columns=False,
                                    dataloader_num_workers=0, disable_tqdm=True)
        trainer = tf.Trainer(model=model, args=args, train_dataset=trainer_rows(model), data_collator=collate)
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e], handle.calls if handle else 0
    finally:
        if handle is not None:
            handle.revert()


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_trainer_with_images_and_gradient_checkpointing_equals_unpatched(family, tmp_path):
    """The HF Trainer on image rows, gradient checkpointing on, the class patch applied before the model is built:
    each step's loss equals unpatched; every layer's forward and its checkpointed recompute ran through the patch."""
    want, _ = trainer_losses(family, tmp_path, patched=False)
    got, calls = trainer_losses(family, tmp_path, patched=True)
    assert got == pytest.approx(want, abs=1e-5), (got, want)
    assert calls == 3 * layers(family) * 2  # 3 steps, each attention layer, forward and recompute


def test_the_head_dim_gate_reads_the_language_model_not_the_vision_tower():
    """The kernel gates' head_dim is the language model's: a vision tower first in module order whose hidden size
    over its heads is 1024 (as the GPU benchmark's Qwen2-VL had: every kernel backend refused, wrongly) is not it."""
    from patchkit.hooks.install.model_walk import head_dim

    text = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                intermediate_size=64, vocab_size=128, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, embed_dim=32, hidden_size=1024, num_heads=1, mlp_ratio=2)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision)
    with torch.device("meta"):
        model = transformers.Qwen2VLForConditionalGeneration(config)
    assert model.config.vision_config.hidden_size // model.config.vision_config.num_heads == 1024
    assert head_dim(model, ("qwen2_vl",)) == 16
    assert head_dim(model) == 16  # no model_types given: the first config with a vocabulary


def on_flash_attention_2(model: torch.nn.Module) -> torch.nn.Module:
    """The model as `from_pretrained(attn_implementation="flash_attention_2")` leaves it: the vision tower too."""
    for config in (model.config, model.config.text_config, model.config.vision_config):
        config._attn_implementation = "flash_attention_2"
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_loaded_with_flash_attention_2_equals_unpatched(family, monkeypatch):
    """LLaMA-Factory's and TRL's Qwen-VL fine-tunes load flash_attention_2, whose vision tower patchkit leaves to it:
    transformers' own, on the CPU stand-in of flash-attn. A training step on image rows, text documents packed by
    the text row under a one-row mask of ones (flash_attention_2 keeps them apart, so patchkit does too) and
    left-padded generation with images equal the unpatched model, every language layer through the patch."""
    from fakes import install_transformers_flash_attention_2

    install_transformers_flash_attention_2(monkeypatch)
    model = on_flash_attention_2(family_model(family)).train()
    batch = image_rows(model, left=False)
    want = train_step(model, batch)
    with patchkit.apply_patch(TEXT_PATCH.get(family, family), backend="sdpa", strict=True) as handle:
        got = train_step(model, batch)
        assert handle.calls == layers(family)
    assert_same_step(got, want, batch["attention_mask"])

    model.eval()
    ids = torch.randint(4, VOCAB - 4, (1, 20), generator=torch.Generator().manual_seed(3))
    positions = packed_positions(family, torch.cat([torch.arange(n) for n in (9, 4, 7)])[None])
    packed = dict(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids))
    generate = dict(**image_rows(model, left=True), max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want_tokens = model.generate(**generate)
        with patchkit.apply_patch(TEXT_PATCH.get(family, family), backend="sdpa", strict=True):
            got_tokens = model.generate(**generate)
    assert torch.equal(got_tokens, want_tokens)
    if family in ROWS_TO_LAYERS:  # transformers' flash_attention_2 reads the rows as 3 x 20 packed positions
        with pytest.raises(ValueError, match="cu_seqlens cover 60 query"), torch.no_grad():
            model(**packed, use_cache=False)
        return
    with torch.no_grad():
        want_packed = model(**packed, use_cache=False).logits
        joined = set_attention(copy.deepcopy(model), "sdpa")(**packed, use_cache=False).logits
        with patchkit.apply_patch(TEXT_PATCH.get(family, family), backend="sdpa", strict=True):
            got_packed = model(**packed, use_cache=False).logits
    torch.testing.assert_close(got_packed, want_packed, atol=3e-5, rtol=1e-4)
    assert (got_packed - joined)[:, 9:].abs().max() > 1e-2  # the documents kept apart: sdpa joins them here
