"""The property tests' check: one drawn `Case` run patched and on the unpatched eager reference, compared.

Shared by tests/test_property.py, tests/test_family_property.py and tests/test_property_regressions.py, which import
its module-scoped autouse fixtures (one torch thread, the registered name on the sdpa backend) with it.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from families import family_model, set_attention
from models import VOCAB, labels_for, static_cache, tiny_model
from property_cases import ATOL, CACHED, GRAD_RTOL, RTOL, SINGLE, Case, refusable, separate_documents
from transformers import DynamicCache

import patchkit
from patchkit.hooks.name import attention_interface


@functools.cache
def base_model(kv_heads: int, family: str = "llama"):
    """One tiny model per head layout (MHA 4, GQA 2, MQA 1 K/V heads of 4) and family, built once; each example
    deep-copies it."""
    if family != "llama":
        return family_model(family, seed=11)
    return tiny_model(seed=11, kv_heads=kv_heads, heads=4, hidden=32, layers=2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and far steadier on a shared machine (5x under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def sdpa_route():
    """The registered route runs on the sdpa backend here (no warning about flash-attn on CPU)."""
    attention_interface.register(backend="sdpa")
    yield
    attention_interface.register(backend="auto", strict=False)  # the import-time default


# ---------------------------------------------------------------------------------------------------- running


def labels(case: Case) -> torch.Tensor:
    """labels_for(ids, mask), and for packed rows no target predicted from the previous document either."""
    out = labels_for(case.ids, case.real.long())
    for row, start, _ in case.docs:
        out[row, start] = -100
    return out


def four_d_mask(case: Case) -> torch.Tensor:
    """The eager-style additive (B, 1, S, S) mask of the same pattern: causal, key padding, same document."""
    batch, seq = case.ids.shape
    allowed = torch.ones(seq, seq).tril().bool()[None] & case.real[:, None, :]
    if separate_documents(case):
        doc_of = torch.full((batch, seq), -1)
        for n, (row, start, length) in enumerate(case.docs):
            doc_of[row, start : start + length] = n
        allowed &= doc_of[:, :, None] == doc_of[:, None, :]
    zero = torch.zeros(batch, 1, seq, seq)
    return zero.masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)


def grads_of(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def tokens(model, case: Case, ids: torch.Tensor) -> dict:
    """input_ids, or their embeddings as inputs_embeds (inside the graph: the embedding still gets its gradient)."""
    return {"inputs_embeds": model.get_input_embeddings()(ids)} if case.embeds else {"input_ids": ids}


def as_passed(case: Case, mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    dtype = {"long": torch.long, "bool": torch.bool, "float": torch.float32}[case.mask_dtype]
    return None if mask is None else mask.to(dtype)


def packing_kwargs(case: Case) -> dict:
    if not case.cu_seq_lens:
        return {}
    lengths = torch.tensor([n for _, _, n in case.docs])
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def run_case(model, case: Case, *, with_grad: bool):
    """The case through `model` as the user would call it: (logits (B, S, V), hidden states or None), loss, grads."""
    kw = {"output_attentions": True} if case.extra == "output_attentions" else {}
    if case.extra == "hidden_states":
        kw["output_hidden_states"] = True
    if case.cache in SINGLE:
        if case.cache == "none":
            kw["use_cache"] = False
        mask = four_d_mask(case) if case.extra == "4d_mask" else as_passed(case, case.mask)
        model.zero_grad(set_to_none=True)
        out = model(
            **tokens(model, case, case.ids), attention_mask=mask, position_ids=case.positions,
            labels=labels(case) if with_grad else None, **packing_kwargs(case), **kw,
        )
        if kw.get("output_attentions"):
            assert out.attentions is not None and all(a is not None for a in out.attentions), "attentions dropped"
        hidden = None if out.hidden_states is None else [h.detach() for h in out.hidden_states]
        if with_grad and out.loss is not None and torch.isfinite(out.loss):
            out.loss.backward()
            return (out.logits.detach(), hidden), out.loss.detach(), grads_of(model)
        return (out.logits.detach(), hidden), None, {}
    batch, seq = case.ids.shape
    slots = seq + case.extra_slots
    cache = {
        "dynamic": lambda: DynamicCache(),
        "implicit": lambda: None,
        "static_short": lambda: static_cache(model, batch, slots),
        "static_full": lambda: static_cache(model, batch, slots),
    }[case.cache]()
    logits, stop = [], 0
    for n in case.chunks:
        start, stop = stop, stop + n
        mask = None
        if case.mask is not None:
            mask = case.mask[:, :stop]  # past + q_len columns
            if case.cache == "static_full":  # every slot: 1 for a filled real slot, 0 for padding and the tail
                mask = F.pad(mask, (0, slots - stop))
        positions = None if case.positions is None else case.positions[:, start:stop]
        out = model(
            **tokens(model, case, case.ids[:, start:stop]), attention_mask=as_passed(case, mask),
            position_ids=positions, past_key_values=cache, use_cache=True, **kw,
        )
        logits.append(out.logits.detach())
        cache = out.past_key_values if case.cache == "implicit" else cache
    return (torch.cat(logits, dim=1), None), None, {}

def reference(model, case: Case, *, with_grad: bool):
    """Unpatched eager: the whole padded batch in one forward (with the case's 4D mask where it has one), or every
    packed document alone."""
    model.zero_grad(set_to_none=True)
    if case.extra == "4d_mask" or not separate_documents(case):
        # a 4D mask is the whole pattern, unpatched too: transformers applies no sliding window over it
        mask = four_d_mask(case) if case.extra == "4d_mask" else case.mask
        out = model(
            **tokens(model, case, case.ids), attention_mask=mask, position_ids=case.positions, use_cache=False,
            labels=labels(case) if with_grad else None, output_hidden_states=case.extra == "hidden_states",
        )
        hidden = None if out.hidden_states is None else [h.detach() for h in out.hidden_states]
        if with_grad and torch.isfinite(out.loss):
            out.loss.backward()
            return (out.logits.detach(), hidden), out.loss.detach(), grads_of(model)
        return (out.logits.detach(), hidden), None, {}
    logits = torch.zeros(*case.ids.shape, VOCAB)
    targets = int((labels(case) != -100).sum())
    total = 0.0
    for row, start, n in case.docs:
        doc = case.ids[row, start : start + n][None]
        out = model(**tokens(model, case, doc), use_cache=False, labels=doc if with_grad and n > 1 else None)
        logits[row, start : start + n] = out.logits[0].detach()
        if out.loss is not None:
            total = total + out.loss * (n - 1) / targets  # the packed loss is the mean over all targets
    if with_grad and targets:
        total.backward()
        return (logits, None), total.detach(), grads_of(model)
    return (logits, None), None, {}


def patched(model, case: Case):
    """Apply the case's route; a context manager that puts everything back."""
    if case.route == "registered":
        return _Registered(model)
    name = "llama2" if case.family == "llama" else case.family
    instance = model if case.route == "instance" else None
    return patchkit.apply_patch(name, backend="sdpa", unpad=case.unpad, model=instance)


class _Registered:
    def __init__(self, model) -> None:
        self.model = model

    def __enter__(self):
        set_attention(self.model, patchkit.ATTENTION_NAME)

    def __exit__(self, *exc) -> None:
        set_attention(self.model, "eager")


def unpatched_run(case: Case):
    """The case's own calls (chunks and steps too) on the unpatched model."""
    model = copy.deepcopy(base_model(case.kv_heads, case.family)).train(case.train)
    return run_case(model, case, with_grad=case.train and case.cache in SINGLE)


def chunks_add_up(case: Case, single_pass: torch.Tensor) -> bool:
    """Whether unpatched transformers' chunks and decode steps give its single pass's logits. Where they do not
    (Gemma2 before 5.0 keeps no cache in training, asked or not), patchkit must give unpatched's chunked numbers
    or refuse: there are no right numbers to keep."""
    if case.cache not in CACHED:
        return True
    with torch.no_grad():
        chunked = unpatched_run(case)[0][0]
    return torch.allclose(chunked[case.real], single_pass[case.real], atol=ATOL, rtol=RTOL)


def check(case: Case) -> None:
    model = copy.deepcopy(base_model(case.kv_heads, case.family)).train(case.train)
    if case.checkpointing:
        with warnings.catch_warnings():  # 5.x renames it activation_checkpointing_enable; 4.x has only this name
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with_grad = case.train and case.cache in SINGLE
    with torch.set_grad_enabled(with_grad):
        (want_logits, want_hidden), want_loss, want_grads = reference(model, case, with_grad=with_grad)
        try:
            with patched(model, case):
                (got_logits, got_hidden), got_loss, got_grads = run_case(model, case, with_grad=with_grad)
        except patchkit.PatchkitError as err:
            assert refusable(case) or not chunks_add_up(case, want_logits), (
                f"refused an input that can be served: {type(err).__name__}: {err}")
            return
        except Exception as err:  # transformers' own failure is no patchkit bug: unpatched must fail the same way
            with pytest.raises(type(err)):
                unpatched_run(case)
            return
    real = case.real
    assert got_logits.shape == want_logits.shape
    close = torch.allclose(got_logits[real], want_logits[real], atol=ATOL, rtol=RTOL)
    if not close and not chunks_add_up(case, want_logits):  # no right numbers: be unpatched's
        want_logits = unpatched_run(case)[0][0]
    torch.testing.assert_close(got_logits[real], want_logits[real], atol=ATOL, rtol=RTOL, msg=lambda m: f"logits: {m}")
    if want_hidden is not None:  # padded rows: every layer's hidden states on real tokens (packed: logits only)
        assert got_hidden is not None and len(got_hidden) == len(want_hidden), "hidden states dropped"
        for i, (got, want) in enumerate(zip(got_hidden, want_hidden)):
            assert got.shape == want.shape
            torch.testing.assert_close(
                got[real], want[real], atol=ATOL, rtol=RTOL, msg=lambda m, i=i: f"hidden state {i}: {m}"
            )
    if with_grad:
        assert (got_loss is None) == (want_loss is None), (got_loss, want_loss)
        if want_loss is not None:
            torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5, msg=lambda m: f"loss: {m}")
        assert got_grads.keys() == want_grads.keys()
        for name, want in want_grads.items():
            torch.testing.assert_close(
                got_grads[name], want, atol=ATOL, rtol=GRAD_RTOL, msg=lambda m, name=name: f"grad {name}: {m}"
            )
