"""The census: every causal LM of the installed transformers, served exactly every way in or refused by name.

For each model type in transformers' causal-LM mapping: a family patchkit serves (a module in patches/ or the table,
`patches/table.py`) is built tiny and compared with transformers' eager attention through the class patch (and its
non-reentrant gradient checkpointing), the instance patch and the registered name (logits at real tokens, loss and
every gradient on a mixed-padded batch; packed rows, but for the instance patch, which runs the class patch's path;
left-padded greedy generation through the class patch), and the loss alone (two training steps under unpad="loss", and
an eval forward whose caller reads the loss alone: the unpatched loss, no logits and no cache the family only
stores); a family it does not serve is refused with the feature that stops it.
No other outcome passes: on CI's transformers the table's VERIFIED list is exactly the families found exact here.
`python tests/census.py` prints the table.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any, Optional
from unittest import mock

import pytest
import torch
import transformers
from census import OWN_HEAD, causal_lm_types, document_logits, packed_rows, tiny_config, tiny_lm
from models import completion_labels, labels_for, padded_batch
from packaging.version import Version
from patchkit.patches import table

import patchkit
from patchkit.errors import PatchkitError, PatchTargetError
from patchkit.hooks.decide import self_check
from patchkit.hooks.decide.causes import CAUSES
from patchkit.hooks.forwards import lm_forward
from patchkit.hooks.generation.filled_cache import cache_is_storage
from patchkit.hooks.head import lm_head
from patchkit.hooks.install.registry import PATCH_MODULES, for_model_type
from patchkit.hooks.name import attention_interface

PINNED = transformers.__version__ == self_check.TESTED_TRANSFORMERS  # the version VERIFIED was made on
NEW_ENOUGH = Version(transformers.__version__) >= Version("5.0")  # the table serves transformers 5.x's interface
ATOL = 5e-5
# the hybrids whose mixers run packed documents each from a zero state: each one whose attention masks read the
# documents from position_ids (GraniteMoeHybrid's model hands its mask builders none: one document a row everywhere)
DOCUMENT_MIXERS = set(table.ROW_MIXERS) - {"granitemoehybrid"}
pytestmark = pytest.mark.skipif(not NEW_ENOUGH, reason="families from data: transformers 5.x")


def record(model_type: str, outcome: str, detail: str = "") -> None:
    """One census row, appended to $PATCHKIT_CENSUS_OUT when set (`python tests/census.py` prints the table)."""
    path = os.environ.get("PATCHKIT_CENSUS_OUT")
    if path:
        line = json.dumps({"model_type": model_type, "outcome": outcome, "detail": detail}) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # one write per row: workers share the file
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def serving(model_type: str):
    try:
        return for_model_type(model_type), ""
    except PatchTargetError as stop:
        return None, str(stop)


def train_step(model, **inputs) -> tuple[Optional[torch.Tensor], dict, torch.Tensor]:
    """The logits (None where the loss came alone), every gradient and the loss of one training step."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return None if out.logits is None else out.logits.detach(), grads, out.loss.detach()


def token_types(model, ids: torch.Tensor) -> dict:
    """`token_type_ids` for a family whose forward takes them (GPT-2, GPT-BigCode, CodeGen, ...), as real checkpoints'
    callers pass them: one type per token, every row its own."""
    if "token_type_ids" not in inspect.signature(model.forward).parameters:
        return {}
    return {"token_type_ids": torch.randint(0, 3, ids.shape, generator=torch.Generator().manual_seed(5))}


def census_batch(model, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The census's padded batch: rows padded on either side, on the right alone where the family's recurrent layers
    read the padding positions (`PADDING_INTO_MIXERS`: a left-padded row steps aside, and the census would compare
    transformers with itself)."""
    from patchkit.hooks.install.registry import padding_into_mixers

    return padded_batch("right" if padding_into_mixers(model.config) else "mixed", batch=3, seq=seq)


def runs(model, packed: bool = True) -> dict:
    """The comparisons' numbers on `model` as it is now (patched or not): a padded step, and packed rows."""
    ids, mask = census_batch(model, 16)
    ids = ids.clamp(max=model.config.vocab_size - 1)
    out = {"padded": train_step(model, input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask),
                                **token_types(model, ids))}
    if packed:
        rows, positions = packed_rows()
        out["packed"] = train_step(model, input_ids=rows, position_ids=positions, labels=rows)
    return out


def same(got: dict, want: dict, mask: torch.Tensor) -> str:
    """'' when every number agrees, else what differed. Packed rows agree with transformers' eager attention on
    them or, where that joins the documents (a family that does not read documents from position_ids), with each
    document run alone: the padding-free contract flash_attention_2 keeps. A hybrid's (`documents_only`) agree with
    each document run alone: unpatched, its mixers carry their state across the documents."""
    for key in ("padded", "packed"):
        if key not in got:
            continue
        if key == "packed" and "documents" in want:
            docs = (got[key][0] - want["documents"]).abs().max().item()
            if docs <= ATOL * max(1.0, want["documents"].abs().max().item()):
                continue
            if want.get("documents_only"):
                return f"packed documents differ from each document run alone by {docs:.2g}"
        (gl, gg, _), (wl, wg, _) = got[key], want[key]
        real = mask.bool() if key == "padded" else torch.ones(wl.shape[:2], dtype=torch.bool)
        diff = (gl[real] - wl[real]).abs().max().item()
        if not diff <= ATOL * max(1.0, wl[real].abs().max().item()):
            return f"{key} logits differ by {diff:.2g}"
        for name in wg:
            d = (gg[name] - wg[name]).abs().max().item()
            if not d <= ATOL * max(1.0, wg[name].abs().max().item()):
                return f"{key} gradient of {name} differs by {d:.2g}"
    return ""


def completion_step(model) -> tuple:
    """`train_step` of a padded batch with completion-only labels (a prompt unlabelled in each row), long enough
    that unpad="loss" runs the fused head and loss (`fused_head.py`) once it checked the family's logits."""
    ids, mask = census_batch(model, 48)
    ids = ids.clamp(max=model.config.vocab_size - 1)
    return train_step(model, input_ids=ids, attention_mask=mask, labels=completion_labels(ids, mask),
                      **token_types(model, ids))


def loss_alone(model_type: str, model, want: tuple, handle) -> str:
    """unpad="loss" on completion-only labels, two steps (the first checks the family's logits on a few rows and runs
    the fused head and loss where they were found the same, else reruns the LM with its own head; the second runs
    the way the first found): the loss and every gradient as `want`'s (the unpatched
    step's), and no logits where the head ran on the labelled tokens ('' when so, else what differed)."""
    served = (lm_head.LOSS_ONLY, lm_head.LOSS_ONLY_KEPT, lm_head.FUSED)
    for run in ("first", "second"):
        logits, grads, loss = completion_step(model)
        if (logits is None) != any(key in handle.heads for key in served):
            return f"logits {'absent' if logits is None else 'returned'} with the head counted as {handle.heads}"
        if not (loss - want[2]).abs().item() <= ATOL * max(1.0, want[2].abs().item()):
            return f"the loss alone differs by {(loss - want[2]).abs().item():.2g} ({run} step, {handle.heads})"
        for name in want[1]:
            d = (grads[name] - want[1][name]).abs().max().item()
            if not d <= ATOL * max(1.0, want[1][name].abs().max().item()):
                return f"loss alone: gradient of {name} differs by {d:.2g} ({run} step, {handle.heads})"
    if lm_head.FUSED in handle.heads:
        FUSED.add(model_type)
    return ""


def eval_forward(model) -> tuple[Optional[torch.Tensor], torch.Tensor, bool]:
    """An eval forward (no grad, the config's use_cache) of a padded batch with completion-only labels, as the HF
    Trainer's evaluation runs it: its logits (None where the loss came alone), its loss, and whether it kept a cache."""
    ids, mask = census_batch(model, 48)
    ids = ids.clamp(max=model.config.vocab_size - 1)
    model.eval()
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, labels=completion_labels(ids, mask),
                        **token_types(model, ids))
    finally:
        model.train()
    cache = any(out.get(k) is not None for k in ("past_key_values", "cache", "cache_params"))
    return out.logits, out.loss, cache


def eval_loss_alone(model_type: str, model, want: tuple, handle) -> str:
    """An eval forward under the default unpad whose caller reads the loss alone (the HF Trainer's evaluation without
    metrics, `loss_reader`'s proof: taken as given here): the unpatched loss; no logits, the head run on the
    labelled tokens, wherever unpad="loss"'s training step ran fused; and then no KV cache where the family's cache
    only stores keys and values ('' when so, else what differed)."""
    with mock.patch.object(lm_forward, "reads_loss_alone", lambda: True):
        logits, loss, cache = eval_forward(model)
    served = any(key in handle.heads for key in (lm_head.LOSS_ONLY, lm_head.LOSS_ONLY_KEPT, lm_head.FUSED))
    if model_type in FUSED and not served:
        return f"eval: the logits returned to a caller that reads the loss alone ({handle.heads})"
    if (logits is None) != served:
        return f"eval: logits {'absent' if logits is None else 'returned'} with the head counted as {handle.heads}"
    if not (loss - want[1]).abs().item() <= ATOL * max(1.0, want[1].abs().item()):
        return f"eval: the loss alone differs by {(loss - want[1]).abs().item():.2g} ({handle.heads})"
    if served and cache != (want[2] and not cache_is_storage(model)):
        return f"eval: a cache {'kept' if cache else 'dropped'} (unpatched kept {'one' if want[2] else 'none'})"
    return ""


def eval_outputs(model, asked: Optional[dict] = None) -> tuple[dict, Any]:
    """An eval forward of a padded batch with no cache that returns every hidden state (and a mixture of experts'
    router logits where transformers' own run can: `asked` unset), the fields a caller reads beside the logits; and
    what it asked for."""
    ids, mask = census_batch(model, 16)
    if asked is None:
        asked = {"output_hidden_states": True}
        if "output_router_logits" in inspect.signature(model.forward).parameters:
            try:  # a tiny config with no expert layer: transformers' load-balancing loss reads an empty tuple
                return eval_outputs(model, {**asked, "output_router_logits": True})
            except IndexError:
                pass
    model.eval()
    try:
        with torch.no_grad():
            return asked, model(input_ids=ids.clamp(max=model.config.vocab_size - 1), attention_mask=mask,
                                use_cache=False, **asked, **token_types(model, ids))
    finally:
        model.train()


def output_tensors(out, path: str = "out") -> dict:
    """Every tensor of a model output by where it sits (its cache left out)."""
    if isinstance(out, torch.Tensor):
        return {path: out}
    if hasattr(out, "keys"):
        return {k: v for key in out.keys() if key not in ("past_key_values", "cache", "cache_params")
                for k, v in output_tensors(out[key], f"{path}.{key}").items()}
    if isinstance(out, (tuple, list)):
        return {k: v for i, item in enumerate(out) for k, v in output_tensors(item, f"{path}[{i}]").items()}
    return {}


def outputs_alike(got, want, mask: torch.Tensor) -> str:
    """'' when the patched output has the unpatched one's fields, each of its shape and equal at real tokens (a
    (..., B, S, ...) field at its (B, S) place, a (B * S, E) one by row), else what differed."""
    got, want = output_tensors(got), output_tensors(want)
    if got.keys() != want.keys():
        return f"output fields {sorted(set(got) ^ set(want))} differ"
    real = mask.bool()
    for path, w in want.items():
        g = got[path]
        if g.shape != w.shape:
            return f"{path} is {tuple(g.shape)}, unpatched {tuple(w.shape)}"
        if w.dim() == 2 and w.shape[0] == real.numel():
            g, w = g.view(*real.shape, -1), w.view(*real.shape, -1)
        at = next((i for i in range(w.dim() - 1) if tuple(w.shape[i:i + 2]) == tuple(real.shape)), None)
        if at is None or not w.is_floating_point():
            continue
        g, w = g.movedim((at, at + 1), (0, 1))[real], w.movedim((at, at + 1), (0, 1))[real]
        diff = (g - w).abs().max().item() if w.numel() else 0.0
        if not diff <= ATOL * max(1.0, w.abs().max().item() if w.numel() else 0.0):
            return f"{path} differs at real tokens by {diff:.2g}"
    return ""


def cached_packed(model, want: dict) -> str:
    """Packed rows in an eval forward that makes a cache (use_cache=True; 5.x makes one from the config): each
    document alone, or transformers' run of the rows without a cache, where it joins them too (a hybrid's mixers,
    which keep one state per row, are warned about instead: not compared). '' when so, else what differed."""
    rows, positions = packed_rows()
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=rows, position_ids=positions, use_cache=True).logits
    finally:
        model.train()
    diffs = [(logits - ref).abs().max().item() for ref in (want["documents"], want["packed"][0])]
    if any(d <= ATOL * max(1.0, ref.abs().max().item()) for d, ref in zip(diffs, (want["documents"],
                                                                                want["packed"][0]))):
        return ""
    return f"packed rows behind an eval forward's cache differ from each document alone by {diffs[0]:.2g}"


FUSED: set[str] = set()  # the families whose second loss-alone step ran the fused head and loss (this process's)


def generated(model) -> torch.Tensor:
    ids, mask = padded_batch("left", batch=3, seq=16)
    model.eval()
    try:
        with torch.no_grad():
            return model.generate(input_ids=ids.clamp(max=model.config.vocab_size - 1), attention_mask=mask,
                                  max_new_tokens=4, do_sample=False, pad_token_id=0)
    finally:
        model.train()


def patched_outcomes(model_type: str, model, want: dict, want_tokens, mask) -> dict:
    """What differed from `want` (or '') through the class patch, the instance patch and the registered name."""
    outcomes = {}
    with patchkit.apply_patch(model_type, backend="sdpa") as handle:  # the class patch (the model built before it)
        outcomes["class"] = same(runs(model), want, mask)
        if want_tokens is not None and not outcomes["class"]:
            got_tokens = generated(model)
            outcomes["class"] = "" if torch.equal(got_tokens, want_tokens) else "generated tokens differ"
        if model_type not in table.ROW_MIXERS and not outcomes["class"]:
            outcomes["cached packed"] = cached_packed(model, want)
        assert handle.calls > 0 or handle.stepped_aside, "no forward went through the class patch"
        if handle.stepped_aside.get(self_check.UNVERIFIED):  # exact only because its failed check stepped aside
            return {"self-check": f"patch {model_type!r}: {self_check.untrusted_what(model.base_model)}"}
        if model.supports_gradient_checkpointing and not outcomes["class"]:  # recomputed in backward, after the
            # model's forward returned: its layers must still route to the patch (ZAYA's mapping of masks did not)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            try:
                outcomes["checkpointed"] = same(runs(model, packed=False), want, mask)
            finally:
                model.gradient_checkpointing_disable()
        padded_heads = lm_head.padded(handle.heads)
        if padded_heads:  # a batch unpadded at the model whose LM head and loss ran on the padded batch
            outcomes["head"] = f"LM head on the padded batch: {padded_heads}"
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        outcomes["instance"] = same(runs(model, packed=False), want, mask)  # the class patch's path, per instance
        asked, outputs = want["outputs"]
        outcomes["outputs"] = outputs_alike(eval_outputs(model, asked)[1], outputs, mask)
        assert handle.calls > 0 or handle.stepped_aside, "no forward went through the instance patch"
    with patchkit.apply_patch(model=model, backend="sdpa", unpad="loss") as handle:
        outcomes["loss alone"] = loss_alone(model_type, model, want["completion"], handle)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        outcomes["eval loss alone"] = eval_loss_alone(model_type, model, want["eval"], handle)
    attention_interface.register(backend="sdpa")
    model.set_attn_implementation(attention_interface.ATTENTION_NAME)
    try:
        outcomes["registered name"] = same(runs(model), want, mask)
    finally:
        model.set_attn_implementation("eager")
        attention_interface.register(backend="auto")
    return outcomes


@pytest.mark.parametrize("model_type", causal_lm_types())
def test_census(model_type, monkeypatch):
    spec, why = serving(model_type)
    if spec is None:  # refused by name: the feature that stops it, never served silently
        assert model_type not in table.VERIFIED, f"{model_type} is in VERIFIED but not served: {why}"
        if model_type in table.REFUSED:
            assert table.REFUSED[model_type] in why
        with pytest.raises(ValueError, match="unknown patch"):
            patchkit.apply_patch(model_type, backend="sdpa")
        record(model_type, "refused", why)
        pytest.skip(f"not served: {why}")
    model, why = tiny_lm(model_type)
    if model is None:
        assert model_type not in table.VERIFIED, f"{model_type} is in VERIFIED but has {why}"
        record(model_type, "untested", why)
        pytest.skip(why)
    ids, mask = census_batch(model, 16)
    try:
        want = runs(model)
        want["documents"] = document_logits(model, packed_rows()[0])
        want["documents_only"] = model_type in DOCUMENT_MIXERS
        want["completion"] = completion_step(model)
        want["eval"] = eval_forward(model)
        want["outputs"] = eval_outputs(model)
    except Exception as exc:  # transformers' own eager attention cannot run this tiny model: nothing to compare
        assert model_type not in table.VERIFIED, f"{model_type} is in VERIFIED but its eager run raised {exc!r}"
        record(model_type, "untested", f"transformers' eager run of the tiny model raised {type(exc).__name__}")
        pytest.skip(f"eager run raised {exc!r}")
    try:
        want_tokens = generated(model)
    except Exception:  # a tiny config transformers' own generate() cannot run: the census compares the steps only
        want_tokens = None
    try:
        outcomes = patched_outcomes(model_type, model, want, want_tokens, mask)
    except PatchkitError as refused:  # a family the census has not seen, refused at its first forward by name
        assert model_type not in table.VERIFIED, f"{model_type} is in VERIFIED but raised {refused}"
        record(model_type, "self-checked", str(refused).split(".")[0])
        pytest.skip(f"refused: {refused}")
    if "self-check" in outcomes:  # a family the census has not seen, every forward stepped aside by its check
        assert model_type not in table.VERIFIED, f"{model_type} is in VERIFIED but {outcomes['self-check']}"
        record(model_type, "self-checked", outcomes["self-check"])
        pytest.skip(outcomes["self-check"])
    differed = {way: what for way, what in outcomes.items() if what}
    if model_type in table.VERIFIED or model_type in PATCH_MODULES or PINNED:
        assert not differed, f"{model_type} differs from transformers' eager attention: {differed}"
    notes = list(differed.values()) or (
        ["unpadded inside attention only"] if table.mixes_outside_attention(model_type) else [])
    if model_type in table.REFUSED_CONFIGS:  # served, but for the configs with this field (Falcon-RW's ALiBi)
        field = table.REFUSED_CONFIGS[model_type][0]
        assert field in CAUSES, f"the step-aside cause {field!r} of {model_type}'s refused configs is not in CAUSES"
        notes.append(f"`{field}=True` configs step aside ({field})")
    record(model_type, "exact" if not differed else "self-checked", "; ".join(
        notes + ([] if model_type in FUSED else [OWN_HEAD])))
    if PINNED and model_type not in PATCH_MODULES:
        assert spec.verified, f"{model_type} is exact every way in: add it to patches/table.py VERIFIED"


def olmo() -> torch.nn.Module:
    model, why = tiny_lm("olmo")
    assert model is not None, why
    return model


@pytest.fixture
def unverified_olmo(monkeypatch):
    """OLMo as a family transformers added after CI's version would be: served from data, not in the census."""
    from patchkit.hooks.install import registry

    monkeypatch.setattr(table, "VERIFIED", table.VERIFIED - {"olmo"})
    monkeypatch.setattr(registry, "_TABLE_SPECS", {})
    monkeypatch.setattr(self_check, "unverified", set())
    self_check.forget()
    yield
    self_check.forget()


def test_a_family_the_census_has_not_seen_is_served_after_its_self_check(unverified_olmo):
    model = olmo()
    ids, mask = padded_batch("mixed", batch=3, seq=16)
    want = train_step(model, input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    with patchkit.apply_patch(backend="sdpa") as group:  # every family: OLMo's adopted as its model is built
        model = olmo()
        assert "olmo" in group.model_types and "olmo" in self_check.unverified
        got = train_step(model, input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
        assert not group.stepped_aside and group.calls > 0
    assert not same({"padded": got}, {"padded": want}, mask)
    assert list(self_check.seconds) == [type(model.model), type(model)]  # checked once, before the first forward:
    # the base model, then the causal LM's head and loss


def test_an_unseen_family_whose_self_check_differs_steps_aside_by_name(unverified_olmo, monkeypatch):
    monkeypatch.setattr(self_check, "check_family", lambda *args: "training step outputs differ by 0.5")
    model = olmo()
    ids, mask = padded_batch("mixed", batch=3, seq=16)
    want = train_step(model, input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    handle = patchkit.apply_patch("olmo", backend="sdpa")
    with pytest.warns(RuntimeWarning, match="census has not verified, and its self-check found: training step"):
        got = train_step(model, input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    assert handle.stepped_aside == {"unverified_family": 1}
    assert not same({"padded": got}, {"padded": want}, mask)
    handle.revert()


def test_a_family_that_cannot_be_adopted_is_built_and_runs_unpatched_saying_why(monkeypatch):
    from patchkit import api

    real = api._apply

    def failing(spec, *args, **kwargs):
        if spec.name == "olmo":
            raise PatchkitError("olmo's gate failed here")
        return real(spec, *args, **kwargs)

    # the family as a process meets it first when one of its models is built (an earlier test imported its module,
    # which apply_patch() would take on up front: tests/test_every_family.py covers that path)
    monkeypatch.setattr(api, "imported_table_types", lambda: [])
    with patchkit.apply_patch(backend="sdpa") as group:
        monkeypatch.setattr(api, "_apply", failing)
        with pytest.warns(RuntimeWarning, match=r"\(model_type 'olmo'\) runs unpatched: olmo's gate failed here"):
            transformers.OlmoForCausalLM(tiny_config("olmo"))  # (tiny_lm keeps its builds quiet)
        assert "olmo" not in group.model_types


@pytest.mark.skipif(not PINNED, reason="docs/families.md is the census of the pinned transformers")
def test_the_families_page_is_this_census():
    """docs/families.md (written by `python tests/census.py --markdown docs/families.md`) lists every causal LM of
    the pinned transformers, and the ones it calls exact are exactly those patchkit serves verified: a family added
    to or dropped from VERIFIED or patches/ without the page rewritten fails here."""
    from pathlib import Path

    from patchkit.hooks.install.registry import resolve

    page = Path(__file__).resolve().parents[1] / "docs" / "families.md"
    rows = {line.split(" | ")[0][3:-1]: line.split(" | ")[1] for line in page.read_text().splitlines()
            if line.startswith("| `")}
    types = set(causal_lm_types())
    assert set(rows) == types
    served = set(table.VERIFIED) | {t for name in PATCH_MODULES for t in resolve(name).model_types}
    assert {t for t, outcome in rows.items() if outcome == "exact"} == served & types
    assert f"transformers {transformers.__version__}," in page.read_text()


def test_every_language_model_listed_under_its_composite_is_in_the_table():
    """A composite's causal LM whose config is its text model's (Mllama's, Emu3's), where that text model_type is no
    key of transformers' causal-LM mapping: the table names it (`TEXT_MODELS`), so the census and the patches find it
    by its own model_type; a new one in a transformers release fails here until it is listed."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    under_composite = set()
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        config = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
        text = (getattr(config, "sub_configs", None) or {}).get("text_config")
        text_type = getattr(text, "model_type", None)
        if text_type is not None and text_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            under_composite.add(text_type)
    assert under_composite == set(table.TEXT_MODELS)
