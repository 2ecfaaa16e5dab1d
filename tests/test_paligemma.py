"""PaliGemma's prompt prefix, served patched: its Gemma is not causal by its config (`use_bidirectional_attention`)
and attends as the masks PaliGemma builds say, the image and prompt both ways and the suffix causally. Each forward
reads those masks back (`hooks/decide/model_masks.py`), the prefix a block of its own; a forward whose mask says
anything else, or that has none (sdpa's skip: both ways everywhere), steps aside as before. Training (both
paddings, both ways in, both unpad modes, PaliGemma 2's window shorter than its prefix), generation, and the HF
Trainer on PaliGemma's own processor equal unpatched."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from packaging.version import Version
from test_image_blocks import (
    assert_same,
    generates_patched_as_unpatched,
    kernel_step_as_sdpa,
    train_step,
    under_the_name,
)
from test_multimodal_wrappers import IMAGE, TEXT, VISION, embedding_gemma

import patchkit
from patchkit.errors import PatchGateError, PatchInputError

if Version(tf.__version__) < Version("5.0"):
    pytest.skip("PaliGemma's prefix as block_sequence_ids in its masks: transformers 5.x", allow_module_level=True)

PREFIX, LENGTH = 10, 16  # 4 image tokens, then <bos> and the prompt; the suffix after


def paligemma(attention: str = "eager", window: int | None = None, **gemma2: object) -> torch.nn.Module:
    """PaliGemma around a Gemma (`window` None), or PaliGemma 2 around a Gemma 2 with that sliding window (and
    `gemma2`'s config fields)."""
    text = tf.GemmaConfig(**TEXT) if window is None else tf.Gemma2Config(**TEXT, sliding_window=window, **gemma2)
    config = tf.PaliGemmaConfig(text_config=text.to_dict(), projection_dim=32, image_token_index=IMAGE,
                                vision_config=tf.SiglipVisionConfig(**VISION).to_dict())
    torch.manual_seed(0)
    return tf.PaliGemmaForConditionalGeneration._from_config(config, attn_implementation=attention).train()


def prefix_batch(side: str, suffix: bool = True) -> dict:
    """Three rows as PaliGemma's processor lays them out: 4 image tokens, <bos>, the prompt (token type 0), then the
    suffix (type 1, labelled); rows 1 and 2 padded by 3 and 5 on `side`, padding of type 0 (the tokenizer's pad
    type: of the prompt's group, whose padding queries see all of the prompt). Without `suffix`, every real token is
    the prompt (a generation's)."""
    g = torch.Generator().manual_seed(1)
    rows, types, masks = [], [], []
    for pad in (0, 3, 5):
        real = LENGTH - pad
        ids = torch.randint(3, 100, (real,), generator=g)
        ids[:4], ids[4] = IMAGE, 1
        kind = (torch.arange(real) >= (PREFIX - pad if suffix else real)).long()
        zeros = torch.zeros(pad, dtype=torch.long)
        if side == "left":
            rows.append(torch.cat([zeros, ids])), types.append(torch.cat([zeros, kind]))
            masks.append(torch.cat([zeros, torch.ones(real, dtype=torch.long)]))
        else:
            rows.append(torch.cat([ids, zeros])), types.append(torch.cat([kind, zeros]))
            masks.append(torch.cat([torch.ones(real, dtype=torch.long), zeros]))
    ids, types, mask = torch.stack(rows), torch.stack(types), torch.stack(masks)
    labels = ids.masked_fill((types == 0) | (mask == 0), -100)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels,
                pixel_values=torch.randn(3, 3, 28, 28, generator=g))


MODELS = {"paligemma eager": ("eager", None), "paligemma sdpa": ("sdpa", None),
          "paligemma 2, window 4 inside the prefix": ("eager", 4), "paligemma 2, window 32": ("eager", 32)}


@pytest.mark.parametrize("unpad", ["model", "attention"])
@pytest.mark.parametrize("way", ["instance", "class"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_training_step_with_a_prompt_prefix_runs_patched_as_unpatched(name, side, way, unpad):
    """Before, every PaliGemma forward stepped aside (use_bidirectional_attention) and apply_patch(model=...) refused
    the model. PaliGemma 2's sliding masks let its prefix see all of itself past the window: its block pass keeps no
    window there."""
    attention, window = MODELS[name]
    model, batch = paligemma(attention, window), prefix_batch(side)
    want = train_step(model, batch)
    with patchkit.apply_patch(model=model if way == "instance" else None, backend="sdpa", strict=True,
                              unpad=unpad) as handle:
        got = train_step(model, batch)
        assert handle.stepped_aside == {} and handle.calls == TEXT["num_hidden_layers"]
    assert_same(got, want)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_padding_hole_inside_the_prompt_keeps_its_block_whole(name):
    """A padding position inside a row's prompt (transformers' own tests draw such rows): the prompt's block is its
    real tokens on either side, read in the unpadded rows; PaliGemma 2's window of 4, which spans the hole in
    positions but not in tokens, steps aside for it as for any sliding window (window_over_padding_hole)."""
    attention, window = MODELS[name]
    model, batch = paligemma(attention, window), prefix_batch("left")
    batch["attention_mask"][0, 6] = 0
    want = train_step(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got = train_step(model, batch)
    bites = window is not None and window < LENGTH
    assert handle.stepped_aside == ({"window_over_padding_hole": 1} if bites else {})
    assert_same(got, want)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_paligemma_generates_from_left_padded_prompts_patched_as_unpatched(attention, cache):
    """generate() with images: the prefill's prompt both ways, then each new token causally (a decode step's one
    query sees the same keys either way); every forward patched, the same tokens. A static cache's prefill masks span
    its slots, cut to the filled ones to be read (before, that prefill stepped aside)."""
    prompt = {k: v for k, v in prefix_batch("left", suffix=False).items() if k != "labels"}
    generates_patched_as_unpatched(paligemma(attention).eval(), prompt, TEXT["num_hidden_layers"], cache)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", ["paligemma eager", "paligemma 2, window 4 inside the prefix"])
def test_paligemma_under_the_registered_name_alone_runs_patched_as_unpatched(name, side):
    """The name for the language model alone: PaliGemma builds its masks through patchkit's mask function, the
    prefix read from its block ids and the mask handed on to its Gemma kept as made; before, every forward stepped
    aside (use_bidirectional_attention). A training step and generation, strict."""
    attention, window = MODELS[name]
    model, batch = paligemma(attention, window), prefix_batch(side)
    want = train_step(model, batch)
    got, calls, aside = under_the_name(model, lambda m: train_step(m, batch))
    assert calls == TEXT["num_hidden_layers"] and aside == {}
    assert_same(got, want)
    model = paligemma(attention, window).eval()
    prompt = {k: v for k, v in prefix_batch("left", suffix=False).items() if k != "labels"}
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    want = model.generate(**prompt, **options)
    got, calls, aside = under_the_name(model, lambda m: m.generate(**prompt, **options))
    assert torch.equal(got, want) and calls == 3 * TEXT["num_hidden_layers"] and aside == {}


def test_a_forward_without_the_mask_that_decides_steps_aside_by_its_config():
    """PaliGemma under sdpa with no padding and no token_type_ids: transformers skips the mask, and its non-causal
    layers attend both ways over every token. That forward steps aside, exact; strict refuses it by name. Under eager
    the same forward gets the causal mask, and runs patched."""
    batch = {k: v[:1] for k, v in prefix_batch("left").items() if k != "token_type_ids"}
    for attention, aside in (("sdpa", {"use_bidirectional_attention": 1}), ("eager", {})):
        model = paligemma(attention)
        want = train_step(model, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with patchkit.apply_patch(model=model, backend="sdpa") as handle:
                got = train_step(model, batch)
        assert handle.stepped_aside == aside, attention
        assert_same(got, want)
    with patchkit.apply_patch(model=paligemma("sdpa"), backend="sdpa", strict=True) as handle:
        with pytest.raises(PatchInputError, match="use_bidirectional_attention"):
            handle._model()(**batch)


def test_the_gate_passes_a_paligemma_and_still_refuses_an_encoder_of_its_own():
    """apply_patch(model=...) reads PaliGemma's masks per forward (the gate says so in the report); a bidirectional
    Gemma 3 text model (EmbeddingGemma's encoder) builds no such masks, and is refused as before."""
    with patchkit.apply_patch(model=paligemma(), backend="sdpa") as handle:
        assert "read per forward off the masks PaliGemmaForConditionalGeneration builds" in handle.report()
    with pytest.raises(PatchGateError, match=r"use_bidirectional_attention=True: bidirectional attention"):
        patchkit.apply_patch(model=embedding_gemma(), backend="sdpa")


def paligemma_processor() -> tf.ProcessorMixin:
    """PaliGemma's own processor around SigLIP's image processor (2 x 2 patches: 4 image tokens) and a word-level
    tokenizer with its <image> token at the tiny model's id, padding on the left."""
    from user_scripts.vl_data import word_tokenizer

    tokenizer = word_tokenizer(TEXT["vocab_size"], {"<image>": IMAGE}, padding_side="left",
                               extra_special_tokens={"image_token": "<image>"})
    images = tf.SiglipImageProcessorPil(size={"height": 28, "width": 28})
    images.image_seq_length = 4
    return tf.PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer)


def test_the_hf_trainer_fine_tunes_paligemma_on_its_processors_batches_patched_as_unpatched(tmp_path):
    """As HF's PaliGemma fine-tuning guide runs it: a collator calling the processor with prompts, images and
    suffixes (labels -100 over the prefix and padding), the HF Trainer with gradient checkpointing. Every forward
    and recompute runs patched; the losses are the unpatched ones."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image
    from test_trl import STEPS, class_patched_as_unpatched, common_args, logged_losses

    g = torch.Generator().manual_seed(2)

    def words(n: int) -> str:
        return " ".join(f"w{int(t)}" for t in torch.randint(4, 100, (n,), generator=g))

    lengths = (3, 9, 5, 12, 4, 7)
    data = Dataset.from_dict({
        "image": [Image.fromarray((torch.rand(28, 28, 3, generator=g).numpy() * 255).astype(np.uint8))
                  for _ in lengths] * 2,
        "prompt": [words(n) for n in lengths] * 2, "answer": [words(n // 2 + 1) for n in lengths] * 2})
    processor = paligemma_processor()

    def collate(examples: list[dict]) -> dict:
        return processor(text=["<image>answer en " + e["prompt"] for e in examples],
                         images=[e["image"].convert("RGB") for e in examples],
                         suffix=[e["answer"] for e in examples], return_tensors="pt", padding="longest")

    batch = collate([data[i] for i in range(4)])
    assert (batch["attention_mask"] == 0).any() and (batch["token_type_ids"] == 1).any()

    def losses() -> list[float]:
        model = paligemma()
        args = tf.TrainingArguments(**common_args(tmp_path), gradient_checkpointing=True, remove_unused_columns=False)
        trainer = tf.Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        trainer.train()
        return logged_losses(trainer)

    class_patched_as_unpatched(losses, "gemma", STEPS * TEXT["num_hidden_layers"] * 2)  # forward and recompute


@pytest.mark.parametrize("backend", ["flash_attn", "flash_attn_4", "torch_varlen"])
def test_paligemma_2s_prefix_pass_reaches_each_kernel_non_causal_with_no_window(monkeypatch, backend):
    """On a GPU the prefix's pass runs on a kernel backend: through each kernel's stand-in, a bf16 step of PaliGemma 2
    (its window of 4 inside the prefix of 10, softcapping off for torch's kernel) equals the sdpa backend's; each
    layer makes a causal call over every real token and a non-causal one over the prefixes, with no window on the
    sliding layer either (flash-attn 2's and torch's (-1, -1), flash-attn 4's (None, None))."""
    model = paligemma("eager", window=4, attn_logit_softcapping=None).to(torch.bfloat16)
    batch = prefix_batch("left")
    fake = kernel_step_as_sdpa(monkeypatch, backend, model, batch)
    real = batch["attention_mask"].sum(-1).tolist()
    assert [call["cu_q"][-1] for call in fake.calls] == [sum(real), sum(PREFIX - pad for pad in (0, 3, 5))] * 2
    unbounded = (None, None) if backend == "flash_attn_4" else (-1, -1)
    blocks = [call.get("window_size", call.get("window", (-1, -1))) for call in fake.calls[1::2]]
    assert blocks == [unbounded, unbounded]


def test_colpali_s_retrieval_head_reads_every_position_and_steps_aside_on_padded_batches():
    """ColPali L2-normalizes each position's embedding before it masks padding. Patched, a padding position's hidden
    state was its embedding's (zeros for the pad token) or zeros: with its projection's bias zero (as transformers
    initializes a new head) 0 / 0 made NaN there, which its multi-vector scores sum over. A head patchkit does not
    wrap steps aside on a padded batch now (`unwrapped_head`): every embedding equals unpatched, padding's zeros
    included; a batch without padding runs patched."""
    pg = tf.PaliGemmaConfig(text_config=tf.GemmaConfig(**TEXT).to_dict(), projection_dim=32, image_token_index=IMAGE,
                            vision_config=tf.SiglipVisionConfig(**VISION).to_dict())
    config = tf.ColPaliConfig(vlm_config=pg.to_dict(), embedding_dim=16)

    def colpali() -> torch.nn.Module:
        torch.manual_seed(0)
        return tf.ColPaliForRetrieval._from_config(config, attn_implementation="eager").eval()

    batch = {k: v for k, v in prefix_batch("left", suffix=False).items() if k != "labels"}
    whole = {k: v[:1] for k, v in batch.items()}  # row 0: no padding
    with torch.no_grad():
        want, want_whole = colpali()(**batch).embeddings, colpali()(**whole).embeddings
        with warnings.catch_warnings(record=True) as caught, patchkit.apply_patch(backend="sdpa") as group:
            warnings.simplefilter("always")
            model = colpali()
            assert not model.embedding_proj_layer.bias.any()
            got = model(**batch).embeddings
            handle = next(h for h in group if h.name == "gemma")
            assert handle.stepped_aside == {"unwrapped_head": 1} and handle.calls == 0
            got_whole = model(**whole).embeddings
            assert handle.calls == TEXT["num_hidden_layers"]
    assert any("(unwrapped_head)" in str(w.message) for w in caught)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got_whole, want_whole, atol=1e-5, rtol=1e-4)
