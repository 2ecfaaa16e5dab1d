"""Image tokens that see each other both ways (Gemma 3's and Gemma 4's multimodal masks), served patched: each image's
block gets a non-causal pass of its own over its row's keys up to the block's end (`patchkit/forward/metadata.py`), read
off the masks the multimodal model builds and checked against them entry for entry. Training with images (loss,
logits, every gradient), windows that cut into a block, both unpad modes and ways in, generation, and TRL's SFT on
image conversations equal unpatched; blocks behind a past still step aside."""

from __future__ import annotations

import copy
import warnings

import fakes
import pytest
import torch
import transformers as tf
from families import FAMILIES_FROM
from flash4_stand_in import install_flash4_double
from packaging.version import Version

import patchkit
from patchkit.forward.metadata import block_queries

if Version(tf.__version__) < Version("5.0"):
    pytest.skip("the families' multimodal masks with image blocks: transformers 5.x", allow_module_level=True)

IMAGE, BOI, EOI = 94, 95, 96


def test_block_queries_take_each_block_and_its_keys_in_the_unpadded_rows():
    """A block is a run of real queries that reach the token right after the run (the block's last); its pass takes
    the run and that token as queries, the keys from the row's first real token on. What padding queries see is left
    out; anything else is no block."""
    real = torch.tensor([[1] * 8, [0, 0, 1, 1, 1, 1, 1, 1]]).bool()
    positions = torch.arange(8).expand(2, 8)
    reach = positions.clone()
    reach[0, 2:4] = 4  # row 0: a block at 2..4
    reach[1, 4:6] = 6  # row 1 (left-padded by 2, its unpadded rows from 8): a block at 4..6
    blocks = block_queries(reach, real)
    assert blocks.q_index.tolist() == [2, 3, 4, 10, 11, 12]
    assert blocks.k_index.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12]
    assert blocks.meta.seqlens_q == [3, 3] and blocks.meta.seqlens_k == [5, 5]
    beyond = reach.clone()
    beyond[0, 3] = 5  # one query of the run reaches further: no block
    assert block_queries(beyond, real) is None
    holed, holed_real = reach.clone(), real.clone()
    holed_real[0, 3] = False  # a padding hole inside row 0's block: the block is its real tokens 2, 4
    holed[0, 3] = 3
    got = block_queries(holed, holed_real)
    assert got.q_index.tolist() == [2, 3, 9, 10, 11] and got.k_index.tolist() == [0, 1, 2, 3, 7, 8, 9, 10, 11]
    padded = reach.clone()
    padded[1, 0] = 5  # a padding query that sees later keys (PaliGemma's left padding, of its prompt's block):
    got = block_queries(padded, real)  # its output is padding either way, and it is no block's
    assert got.q_index.tolist() == blocks.q_index.tolist() and got.k_index.tolist() == blocks.k_index.tolist()


def test_block_ids_and_the_mask_functions_that_or_them_into_causal_read_as_blocks():
    """transformers' three shapes of causal OR block ids, by the window's place (none, over the blocks too, under
    them); a block in pieces, or one off its row's start where a window lies under the blocks, is none served."""
    from transformers import masking_utils as mu

    from patchkit.forward.inputs.mask_functions import block_pattern
    from patchkit.forward.metadata import id_blocks

    ids = torch.tensor([[-1, -1, 1, 1, 1, -1, -1, -1], [0, 0, 0, 0, 0, 0, -1, -1]])
    blocks = mu.blockwise_overlay(ids)
    assert block_pattern(mu.or_masks(mu.causal_mask_function, blocks))[1] is None
    assert block_pattern(mu.and_masks(mu.or_masks(mu.causal_mask_function, blocks), mu.sliding_window_overlay(4)))[1]
    assert block_pattern(mu.or_masks(mu.sliding_window_causal_mask_function(4), blocks))[1] is False
    assert block_pattern(mu.or_masks(mu.causal_mask_function, lambda *a: True)) is None
    assert torch.equal(block_pattern(mu.or_masks(mu.causal_mask_function, blocks))[0], ids)
    real = torch.tensor([[1] * 8, [0, 0, 1, 1, 1, 1, 1, 1]]).bool()  # row 1: left padding of the prompt's block
    found = id_blocks(ids, real)
    assert found.q_index.tolist() == [2, 3, 4, 8, 9, 10, 11] and found.k_index.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11]
    assert id_blocks(ids, real, from_row_start=True) is False  # row 0's block starts at its third token
    assert id_blocks(torch.full((2, 8), -1), real) is None
    assert id_blocks(torch.tensor([[1, 1, -1, 1, 1, -1, -1, -1], [-1] * 8]), real) is False  # one block in two pieces


def gemma3(window: int, layer_types: list[str]) -> torch.nn.Module:
    """A tiny Gemma 3 vision-language model (SigLIP 2 x 2 patches, 4 image tokens), `window` on its sliding layers."""
    text = tf.Gemma3TextConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=window,
                               layer_types=layer_types, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               max_position_embeddings=256)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                             boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE)
    torch.manual_seed(0)
    return tf.Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager").float()


def image_batch(left: bool = False) -> dict:
    """Three rows of 16 with an image's 4 tokens each, one row right-padded and one left-padded (`left`: all three
    left-padded, for generation); labels -100 at padding, at images and after left padding."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 90, (3, 16), generator=g)
    mask = torch.ones_like(ids)
    if left:
        mask[1, :3], mask[2, :5] = 0, 0
    else:
        mask[1, 12:], mask[2, :3] = 0, 0
    for row, start in ((0, 2), (1, 5), (2, 6)):
        ids[row, start : start + 4] = IMAGE
    ids = ids.masked_fill(mask == 0, 0)
    types = (ids == IMAGE).long()
    labels = ids.masked_fill((mask == 0) | (mask.cumsum(-1) == 1) | (types == 1), -100)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels,
                pixel_values=torch.randn(3, 3, 28, 28, generator=g))


def train_step(model: torch.nn.Module, batch: dict) -> dict:
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    got = {"loss": out.loss.detach(), "logits": out.logits.detach()[batch["attention_mask"].bool()]}
    got.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return got


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():  # the tiny projector's gradients reach 1e5: a relative tolerance
        torch.testing.assert_close(got[name], value, atol=2e-5 * max(1.0, value.abs().max().item()), rtol=1e-4,
                                   msg=name)


@pytest.mark.parametrize("unpad", ["model", "attention"])
@pytest.mark.parametrize("way", ["instance", "class"])
@pytest.mark.parametrize("window, layer_types", [
    (2, ["sliding_attention", "sliding_attention"]),  # a window shorter than an image: it cuts into the block
    (3, ["sliding_attention", "full_attention"]),
    (16, ["full_attention", "sliding_attention"]),
], ids=["window 2", "window 3 and full", "full and window 16"])
def test_a_gemma3_training_step_with_images_runs_patched_as_unpatched(window, layer_types, way, unpad):
    model = gemma3(window, layer_types).train()
    batch = image_batch()
    want = train_step(model, batch)
    with patchkit.apply_patch(model=model if way == "instance" else None, backend="sdpa", strict=True,
                              unpad=unpad) as handle:
        got = train_step(model, batch)
        assert handle.stepped_aside == {} and handle.calls == len(layer_types)
    assert_same(got, want)


@pytest.mark.parametrize("unpad", ["model", "attention"])
def test_two_images_in_a_row_are_two_blocks_each_seeing_its_own_tokens_both_ways(unpad):
    """Rows with two images, a window of 2 cutting into them: back to back in row 0 (one block of 8, as Gemma 3 groups
    images with no text between), apart in row 2 (two blocks, each its own pass); the unpatched step."""
    model = gemma3(2, ["sliding_attention", "full_attention"]).train()
    batch = image_batch()
    batch["input_ids"][0, 6:10] = IMAGE
    batch["input_ids"][2, 11:15] = IMAGE
    batch["token_type_ids"] = (batch["input_ids"] == IMAGE).long()
    batch["labels"] = batch["labels"].masked_fill(batch["token_type_ids"] == 1, -100)
    batch["pixel_values"] = torch.randn(5, 3, 28, 28, generator=torch.Generator().manual_seed(4))
    want = train_step(model, batch)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True, unpad=unpad) as handle:
        got = train_step(model, batch)
        assert handle.stepped_aside == {} and handle.calls == 2
    assert_same(got, want)


def test_a_forward_stepped_aside_after_its_masks_were_read_runs_on_the_masks_it_was_given(monkeypatch):
    """The plan reads the multimodal model's masks back into a 2D mask in the forward's arguments; a cause found
    after that (a transformers newer than CI's whose family failed its check, sequence parallelism with blocks, a
    head patchkit does not wrap) stepped aside on that 2D mask, the images' blocks gone, silently. The aside runs on
    the masks the caller gave now: the unpatched step."""
    from patchkit.hooks.decide import plan

    model = gemma3(3, ["sliding_attention", "full_attention"]).train()
    batch = image_batch()
    want = train_step(model, batch)
    monkeypatch.setattr(plan, "untrusted_cause", lambda module, state: "untested_transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got = train_step(model, batch)
    assert handle.stepped_aside == {"untested_transformers": 1} and handle.calls == 0
    assert_same(got, want)


def test_gemma3_generates_from_images_patched_and_a_chunked_prefill_steps_aside():
    """Left-padded prompts with an image each: the prefill (its blocks) and the decode steps run patched, the tokens
    as unpatched. A prefill in chunks puts a block behind a past, which patchkit does not serve: it steps aside,
    exact."""
    model = gemma3(4, ["sliding_attention", "full_attention"]).eval()
    batch = image_batch(left=True)
    batch.pop("labels")
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(**batch, **options)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        assert torch.equal(model.generate(**batch, **options), want)
        assert handle.stepped_aside == {} and handle.calls == 2 * options["max_new_tokens"]
    chunked = dict(options, prefill_chunk_size=5)
    want = model.generate(**batch, **chunked)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got = model.generate(**batch, **chunked)
    assert handle.stepped_aside.get("bidirectional_image_tokens") == 1
    assert torch.equal(got, want)


def generates_patched_as_unpatched(model: torch.nn.Module, prompt: dict, layers: int, cache: str = "dynamic",
                                   steps: int = 5) -> None:
    """Greedy generate() from `prompt` into a `cache` cache, unpatched, then under a strict instance patch: the same
    tokens, and each step's `layers` attention layers patched. Skipped where transformers itself cannot generate so
    (Mllama's static cache in 5.16: its cross-attention layers' slots sized for the text)."""
    options = dict(max_new_tokens=steps, do_sample=False, pad_token_id=0)
    if cache == "static":
        options["cache_implementation"] = "static"
    try:
        want = model.generate(**prompt, **options)
    except Exception as unpatched:  # noqa: BLE001 - whatever transformers' own generate() raises
        pytest.skip(f"transformers {tf.__version__} does not generate this unpatched: {type(unpatched).__name__}: "
                    f"{str(unpatched).splitlines()[0][:120]}")
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got = model.generate(**prompt, **options)
        assert handle.stepped_aside == {} and handle.calls == steps * layers
    assert torch.equal(got, want)


@pytest.mark.parametrize("window, layer_types", [(4, ["sliding_attention", "full_attention"]),
                                                 (16, ["full_attention", "sliding_attention"])])
def test_gemma3_generates_from_images_into_a_static_cache_patched(window, layer_types):
    """generate(cache_implementation="static"): the prefill's masks span the cache's slots; cut to the filled ones
    (every later slot unseen), they are read back as the padding and image blocks they were made from. Before, that
    prefill stepped aside (static_cache_mask). Every forward patched, strict, the same tokens."""
    batch = image_batch(left=True)
    batch.pop("labels")
    generates_patched_as_unpatched(gemma3(window, layer_types).eval(), batch, len(layer_types), "static", steps=4)


def under_the_name(model: torch.nn.Module, run: object, strict: bool = True) -> tuple[object, int, dict]:
    """`run(model)` with the registered name for the language model alone, the towers on sdpa: (its result, the
    attention calls the name served, and those it stepped aside by cause)."""
    from patchkit.hooks.name import attention_interface

    patchkit.register_attention(backend="sdpa", strict=strict)
    try:
        state = attention_interface.route_state()
        calls, aside = state.calls, dict(state.stepped_aside)
        model.set_attn_implementation({"text_config": patchkit.ATTENTION_NAME,
                                       **{k: "sdpa" for k in type(model.config).sub_configs if k != "text_config"}})
        got = run(model)
        more = {k: v - aside.get(k, 0) for k, v in state.stepped_aside.items() if v != aside.get(k, 0)}
        return got, state.calls - calls, more
    finally:
        patchkit.register_attention(backend="auto", strict=False)


@pytest.mark.parametrize("window, layer_types", [(2, ["sliding_attention", "full_attention"]),
                                                 (16, ["full_attention", "sliding_attention"])])
def test_images_under_the_registered_name_alone_run_patched_as_unpatched(window, layer_types):
    """attn_implementation={'text_config': 'patchkit', ...}: the multimodal model builds its masks through patchkit's
    mask function, which reads the blocks from transformers' block ids (`hooks/name/named_blocks.py`); before, each
    such forward stepped aside (custom_mask_pattern). A training step and generation, strict, as unpatched; a
    chunked prefill's blocks behind a past step aside."""
    model = gemma3(window, layer_types).train()
    batch = image_batch()
    want = train_step(model, batch)
    got, calls, aside = under_the_name(model, lambda m: train_step(m, batch))
    assert calls == 2 and aside == {}
    assert_same(got, want)
    model = gemma3(window, layer_types).eval()
    prompt = {k: v for k, v in image_batch(left=True).items() if k != "labels"}
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    want = model.generate(**prompt, **options)
    got, calls, aside = under_the_name(model, lambda m: m.generate(**prompt, **options))
    assert torch.equal(got, want) and calls == 3 * 2 and aside == {}
    model = gemma3(window, layer_types).eval()
    want = model.generate(**prompt, **options, prefill_chunk_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, calls, aside = under_the_name(model, lambda m: m.generate(**prompt, **options, prefill_chunk_size=8),
                                           strict=False)
    assert torch.equal(got, want) and aside.get("bidirectional_image_tokens")


def test_gemma4s_sliding_layers_attend_to_their_images_both_ways_its_full_layers_causally():
    """Gemma 4 (`use_bidirectional_attention="vision"`) gives its sliding layers the image blocks and keeps its full
    layers causal: the blocks serve the sliding layers alone, and a training step equals unpatched."""
    from census import tiny_wrapper

    if Version(tf.__version__) < Version(FAMILIES_FROM):
        pytest.skip("families from data")
    built, why = tiny_wrapper("gemma4")
    if built is None:
        pytest.skip(why)
    config = copy.deepcopy(built.config)
    text = config.get_text_config()
    text.use_bidirectional_attention, text.sliding_window = "vision", 3
    torch.manual_seed(0)
    model = type(built)._from_config(config, attn_implementation="eager").float().train()
    batch = image_batch()
    batch["mm_token_type_ids"] = batch.pop("token_type_ids")
    batch.pop("pixel_values")  # the masks read the token types; no image features needed
    want = train_step(model, batch)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got = train_step(model, batch)
        assert handle.stepped_aside == {} and handle.calls == len(text.layer_types)
    assert_same(got, want)


def gemma3_processor(side: int) -> tf.ProcessorMixin:
    """Gemma 3's own processor around its PIL image processor and a word-level tokenizer with its image tokens at the
    tiny model's ids (an image's 4 soft tokens between its begin and end tokens)."""
    from user_scripts.vl_data import word_tokenizer

    names = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
    tokenizer = word_tokenizer(97, {"<image_soft_token>": IMAGE, "<start_of_image>": BOI, "<end_of_image>": EOI},
                               extra_special_tokens=names)
    template = ("{% for m in messages %}{{ m.role }} {% for c in m.content %}{% if c.type == 'image' %}"
                "<start_of_image> {% else %}{{ c.text }} {% endif %}{% endfor %}</s> {% endfor %}"
                "{% if add_generation_prompt %}assistant {% endif %}")
    return tf.Gemma3Processor(image_processor=tf.Gemma3ImageProcessorPil(size={"height": side, "width": side}),
                              tokenizer=tokenizer, image_seq_length=4, chat_template=template)


def image_conversations(side: int):
    """A dozen conversations, an image and a question each, a short answer."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    g = torch.Generator().manual_seed(1)

    def words(n: int) -> str:
        return " ".join(f"w{int(t)}" for t in torch.randint(4, 90, (n,), generator=g))

    lengths = (3, 9, 5, 12, 4, 7)
    images = [[Image.fromarray((torch.rand(side, side, 3, generator=g).numpy() * 255).astype(np.uint8))]
              for _ in lengths]
    messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": words(n)}]},
                 {"role": "assistant", "content": [{"type": "text", "text": words(n // 2 + 1)}]}] for n in lengths]
    return Dataset.from_dict({"images": images * 2, "messages": messages * 2})


def test_trl_sft_trains_gemma3_on_images_patched_as_unpatched(tmp_path):
    """TRL's SFTTrainer on image conversations with its defaults (gradient checkpointing on, its vision collator
    right-padding, token_type_ids marking the images): before, every step stepped aside to transformers' attention;
    now each runs patched, forward and recompute, with the unpatched losses."""
    pytest.importorskip("trl")
    from test_trl import STEPS, class_patched_as_unpatched, common_args, logged_losses
    from trl import SFTConfig, SFTTrainer

    def losses() -> list[float]:
        model = gemma3(4, ["sliding_attention", "full_attention"])
        args = SFTConfig(**common_args(tmp_path), max_length=None)
        assert args.gradient_checkpointing
        torch.manual_seed(0)
        trainer = SFTTrainer(model=model, args=args, train_dataset=image_conversations(28),
                             processing_class=gemma3_processor(28))
        batch = next(iter(trainer.get_train_dataloader()))
        assert (batch["token_type_ids"] == 1).any() and (batch["attention_mask"] == 0).any()
        trainer.train()
        return logged_losses(trainer)

    class_patched_as_unpatched(losses, "gemma3_text", STEPS * 2 * 2)  # 2 layers, forward and recompute


def kernel_step_as_sdpa(monkeypatch, backend: str, model: torch.nn.Module, batch: dict) -> object:
    """A bf16 training step of `model` (two layers) on `batch` through `backend`'s stand-in (its real signature and
    checks, the sdpa backend's math) equals the sdpa backend's, every gradient, strict and nothing aside; the
    stand-in (its recorded calls)."""
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True):
        want = train_step(model, batch)
    install = {"flash_attn": fakes.install_flash_double, "flash_attn_4": install_flash4_double,
               "torch_varlen": fakes.install_torch_varlen_double}[backend]
    fake = install(monkeypatch)
    with patchkit.apply_patch(model=model, backend=backend, strict=True) as handle:
        got = train_step(model, batch)
        assert handle.backend == backend and handle.stepped_aside == {} and handle.calls == 2
    assert got.keys() == want.keys()
    for name, value in want.items():  # torch's double spells a causal window as a non-causal one: bf16 rounding
        exact = backend != "torch_varlen"
        torch.testing.assert_close(got[name], value, rtol=0 if exact else 2e-2,
                                   atol=0 if exact else 2e-2 * max(1.0, value.abs().max().item()), msg=name)
    return fake


@pytest.mark.parametrize("backend", ["flash_attn", "flash_attn_4", "torch_varlen"])
def test_the_block_pass_reaches_each_kernel_non_causal_with_the_window_kept_on_its_left(monkeypatch, backend):
    """On a GPU the block pass runs on a kernel backend: through each kernel's stand-in (its real signature and
    checks, the sdpa backend's math), a bf16 step with images equals the sdpa backend's (`kernel_step_as_sdpa`); each
    layer makes one causal call over every real token and one non-causal call over the blocks, whose window keeps the
    layer's left edge and no right edge (flash-attn 2's -1, flash-attn 4's None, torch's -1)."""
    model = gemma3(3, ["sliding_attention", "full_attention"]).to(torch.bfloat16).train()
    batch = image_batch()
    fake = kernel_step_as_sdpa(monkeypatch, backend, model, batch)
    real = batch["attention_mask"].sum(-1).tolist()
    lengths = [call["cu_q"][-1] for call in fake.calls]  # the queries of each call
    assert lengths == [sum(real), 3 * 4] * 2  # a block per row: its 4 image tokens
    causal = [call.get("causal", call.get("window") in ((-1, 0), (2, 0))) for call in fake.calls]
    assert causal == [True, False] * 2
    windows = [call.get("window_size", call.get("window", (-1, -1))) for call in fake.calls[1::2]]  # FA2: omitted
    unbounded = {"flash_attn": -1, "flash_attn_4": None, "torch_varlen": -1}[backend]
    assert windows == [(2, unbounded), (unbounded, unbounded)], windows
