"""Task heads as users run them (a sequence classifier in the HF Trainer, inputs_embeds, strict mode, a compiled
graph): where the head reads a padding position, the forward steps aside by name with transformers' numbers; where
it reads none, it runs patched with them. (Every served family's heads: tests/test_task_head_census.py.)"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import transformers
from test_lm_head import trainer_run
from test_task_head_census import differs, outputs, run_way

import patchkit
from patchkit.errors import PatchInputError

PAD = 0


def classifier(seed: int = 0, family: str = "Llama") -> torch.nn.Module:
    """A tiny `{family}ForSequenceClassification` on eager attention whose config pads with token 0 (Qwen2's with
    the q, k, v biases its checkpoints have)."""
    config = getattr(transformers, f"{family}Config")(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=PAD, num_labels=3)
    torch.manual_seed(seed)
    head = getattr(transformers, f"{family}ForSequenceClassification")
    return head._from_config(config, attn_implementation="eager").float()


def rows(pad_ids: int, seq: int = 12) -> list[dict]:
    """Eight right-padded rows of 5 to 12 tokens whose padding holds `pad_ids`, each with a class."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate((12, 7, 9, 5, 11, 6, 12, 8)):
        mask = (torch.arange(seq) < n).long()
        ids = torch.randint(3, 97, (seq,), generator=g).masked_fill(mask == 0, pad_ids)
        out.append(dict(input_ids=ids, attention_mask=mask, labels=torch.tensor(i % 3)))
    return out


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
@pytest.mark.parametrize("pad_ids", [PAD, 2], ids=["the config's pad token", "another token"])
def test_the_trainer_fine_tunes_a_classifier_as_unpatched(pad_ids, family, tmp_path):
    """The HF Trainer on a sequence classifier, 2 micro-batches a step (Qwen2's under gradient checkpointing, whose
    recompute follows the forward's choice). Padded with the config's token, every forward runs patched; padded with
    another (a tokenizer whose pad token the config does not name), the classifier pools each short row's last
    padding position, and every forward steps aside (`pooled_at_padding`). The losses and trained weights equal
    unpatched either way."""
    data = rows(pad_ids)
    checkpointing = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}) if (
        family == "Qwen2") else {}
    want, got = (trainer_run(classifier(family=family), data, way, tmp_path, max_steps=2,
                             per_device_train_batch_size=2, **checkpointing)
                 for way in (None, "model"))
    assert got[3] == ({} if pad_ids == PAD else {"pooled_at_padding": 4})
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("side", ["right", "left"])
def test_inputs_embeds_pool_the_last_column(side):
    """Under inputs_embeds a sequence classifier pools the last column: right-padded rows step aside there, left-
    padded rows pool a real token and run patched; the numbers are transformers' either way."""
    model = classifier()
    ids, mask = torch.randint(3, 97, (3, 10)), torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:] = 0 if side == "right" else 1
    if side == "left":
        mask[1, :4] = 0
    inputs = dict(inputs_embeds=model.get_input_embeddings()(ids).detach(), attention_mask=mask,
                  labels=torch.tensor([0, 1, 2]))
    want = outputs(model, inputs)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        with pytest.warns(RuntimeWarning, match=r"pools a padding position.*\(pooled_at_padding\)") if (
                side == "right") else _no_warning():
            got = outputs(model, inputs)
        assert handle.stepped_aside == ({"pooled_at_padding": 1} if side == "right" else {})
        assert handle.calls == (0 if side == "right" else 2)
    assert not differs(got, want), differs(got, want)


class _no_warning:  # noqa: N801 (a context manager, used as `with`)
    def __enter__(self) -> None:
        import warnings

        self.caught = warnings.catch_warnings()
        self.caught.__enter__()
        warnings.simplefilter("error", RuntimeWarning)

    def __exit__(self, *exc: object) -> None:
        self.caught.__exit__(*exc)


def gemma3_classifier() -> torch.nn.Module:
    """A tiny `Gemma3ForSequenceClassification` (a composite config: its pad token on its text config, 0)."""
    text = transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        pad_token_id=PAD)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=96, boi_token_index=94,
                                       eoi_token_index=95, num_labels=3)
    torch.manual_seed(0)
    return transformers.Gemma3ForSequenceClassification._from_config(config, attn_implementation="eager").float()


@pytest.mark.skipif(not hasattr(transformers, "Gemma3ForSequenceClassification"), reason="transformers 4.52+")
@pytest.mark.parametrize("where", ["text config", "composite config"])
def test_a_multimodal_classifier_pools_by_the_pad_token_its_forward_reads(where):
    """The tokenizer pads with 5. Set on the text config (where transformers' classifier reads it), the rows pool
    real tokens and run patched; set on the composite config alone (which transformers' forward does not read: it
    still pools by the text config's 0), the rows pool padding, so the forward steps aside (it ran patched, pooling
    zero hidden states, unwarned). The numbers are transformers' either way."""
    model = gemma3_classifier()
    target = model.config.get_text_config() if where == "text config" else model.config
    target.pad_token_id = 5
    stack = lambda rs: {k: torch.stack([r[k] for r in rs]) for k in rs[0]}  # noqa: E731
    inputs = stack(rows(5)[:3])
    want = outputs(copy.deepcopy(model), inputs)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = outputs(model, inputs)
        reads_text = "get_text_config().pad_token_id" in inspect.getsource(type(model).forward)
        if reads_text:
            assert handle.stepped_aside == ({} if where == "text config" else {"pooled_at_padding": 1})
    assert not differs(got, want), differs(got, want)


def test_strict_refuses_a_pooled_padding_position_with_the_fix_and_stays_patched():
    """strict=True refuses the forward that would pool a padding position, naming the config's pad token as the fix;
    the patch stays as it was: the same batch padded with that token then runs patched, as unpatched."""
    model = classifier()
    reference = copy.deepcopy(model)
    other, padded = rows(2)[:4], rows(PAD)[:4]
    stack = lambda rs: {k: torch.stack([r[k] for r in rs]) for k in rs[0]}  # noqa: E731
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        with pytest.raises(PatchInputError, match=r"pools a padding position.*config\.pad_token_id"):
            model(**stack(other))
        got = outputs(model, stack(padded))
        assert handle.calls == 2 and handle.stepped_aside == {}
    assert not differs(got, outputs(reference, stack(padded)))


def test_a_compiled_graph_that_may_not_break_steps_aside_for_a_padded_classifier():
    """torch.compile(fullgraph=True): whether the pooled token is padding is data the graph cannot branch on, so a
    padded batch through a sequence classifier steps aside there (`compiled_fullgraph`), with transformers' logits."""
    batch = {k: torch.stack([r[k] for r in rows(2)[:4]]) for k in ("input_ids", "attention_mask")}
    compiled_steps_aside(classifier().eval(), batch, "logits")


def compiled_steps_aside(model: torch.nn.Module, batch: dict, read: str) -> None:
    """`model` compiled with fullgraph=True, patched: the padded batch steps aside once (`compiled_fullgraph`), its
    output `read` as unpatched."""
    with torch.no_grad():
        want = getattr(model(**batch), read)
    torch._dynamo.reset()
    try:
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            compiled = torch.compile(model, fullgraph=True, backend="eager")
            with torch.no_grad(), pytest.warns(RuntimeWarning, match="compiled_fullgraph"):
                got = getattr(compiled(**batch), read)
            assert handle.stepped_aside == {"compiled_fullgraph": 1}
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def double_heads() -> torch.nn.Module:
    """A tiny GPT2DoubleHeadsModel on eager attention, no dropout (its summary's included)."""
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, pad_token_id=PAD,
                                     bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     summary_first_dropout=0.0)
    torch.manual_seed(0)
    return transformers.GPT2DoubleHeadsModel._from_config(config, attn_implementation="eager").float().train()


def choices() -> dict:
    """Two questions of two choices each, (batch, choices, tokens): one question's choices right-padded, one choice of
    the other left-padded, each with the choice's answer."""
    ids = torch.randint(3, 64, (2, 2, 8), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :, 6:] = 0
    mask[1, 1, :2] = 0
    return dict(input_ids=ids.masked_fill(mask == 0, PAD), attention_mask=mask, mc_labels=torch.tensor([0, 1]))


def choice_outputs(model: torch.nn.Module, inputs: dict) -> dict:
    """Both losses, the choice logits, the LM logits at real tokens and every gradient."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    (out.mc_loss + (out.loss if out.loss is not None else 0)).backward()
    got = dict(mc_loss=out.mc_loss.detach(), mc_logits=out.mc_logits.detach(),
               logits=out.logits.detach()[inputs["attention_mask"].bool()])
    if out.loss is not None:
        got["loss"] = out.loss.detach()
    got.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return got


@pytest.mark.parametrize("way", ["class", "instance", "registered name"])
def test_gpt2s_multiple_choice_head_reads_its_choice_positions_as_unpatched(way):
    """GPT-2's DoubleHeadsModel pools each choice's `mc_token_ids` position (the last column where None) and predicts
    its labels over (batch, choices, tokens) rows. A pooled padding position gave a choice loss 0.06 off, and labels
    predicted from padding an LM loss 0.03 off, silently: both step aside now, by name; choices read at their real
    tokens, labelled -100 at padding, run patched. Each as unpatched, every gradient included."""
    model = double_heads()
    batch = choices()
    last_real = torch.tensor([[5, 5], [7, 7]])
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[1, 1, 2] = -100  # the first real token after left padding: predicted from padding
    cases = [(dict(mc_token_ids=last_real, labels=labels), set()),
             ({}, {"choice_at_padding"}),
             (dict(mc_token_ids=last_real, labels=batch["input_ids"]), {"labels_from_padding"})]
    for extra, cause in cases:
        inputs = {**batch, **extra}
        want = choice_outputs(model, inputs)
        got, aside = run_way(way, "gpt2", model, inputs, choice_outputs)
        assert not differs(got, want), (sorted(extra), differs(got, want))
        assert set(aside) == cause, (sorted(extra), aside)


def test_a_compiled_graph_that_may_not_break_steps_aside_for_padded_choices():
    """torch.compile(fullgraph=True) of a DoubleHeadsModel: where its choices are padded, the pooled position is data
    the graph cannot branch on, so the forward steps aside there (`compiled_fullgraph`), with transformers' numbers."""
    compiled_steps_aside(double_heads().eval(), {k: v for k, v in choices().items() if k != "mc_labels"},
                         "mc_logits")
