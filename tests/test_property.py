"""Property: every input is served exactly (equal to unpatched eager on real tokens) or refused with PatchkitError.

Hypothesis draws one `Case`: a batch (right, left, mixed padding, holes inside a row, all-padding rows, no padding,
or packed rows of several documents, batch 1 to 3), a position_ids convention (None, the generation convention
`mask.cumsum(-1) - 1` with padding filled by 1, arange with padding positions kept; packed rows restart at 0, their
padding holding 0, 1 or continued positions, optionally with cu_seq_lens_q/k), a cache (none, use_cache left to the
model, a DynamicCache passed in or made by the model and handed on, a StaticCache whose 2D mask covers past + q_len
columns or every max_cache_len slot; prefill, then chunks and decode steps), train or eval mode (gradient
checkpointing in training), MHA, GQA or MQA, input_ids or inputs_embeds, the mask's dtype, and the route into
patchkit (class patch with unpad "model" or "attention", instance patch, the registered attn_implementation).

The reference is the unpatched eager model with the same weights: the same call in one forward (chunks and decode
steps must add up to the single pass), and for packed rows each document run alone (unpatched transformers may
let packed documents attend across each other; that is its bug, not the reference). In training mode the loss
(labels exclude padding and positions predicted from padding or from another document) and every parameter's
gradient must match too.

A `patchkit.PatchkitError` is accepted only where `refusable` says the input cannot be served; any other refusal,
any other exception, and any mismatch fail. Profiles (tests/conftest.py): 200 derandomized examples per property
by default (CI-reproducible), 1000 random ones with --runslow. The regression tests at the end pin the bugs the
properties found first.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
import transformers
from families import WINDOW, WINDOWED, family_model, set_attention
from models import VOCAB, labels_for, needs_mask_interface, static_cache, tiny_model
from packaging.version import Version
from transformers import DynamicCache

import patchkit
from patchkit.forward.masks import build_metadata
from patchkit.hooks.name import attention_interface

given = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (pip install -e .[test])").given
st = pytest.importorskip("hypothesis.strategies")

MAX_SEQ = 12
ATOL, RTOL, GRAD_RTOL = 2e-5, 1e-4, 1e-3
SINGLE, CACHED = ("none", "default"), ("dynamic", "implicit", "static_short", "static_full")
# attn_implementation="patchkit" is registered through transformers' mask interface (4.53+); before it, only the
# class and instance patches exist
HAS_MASK_INTERFACE = not needs_mask_interface.args[0]
ROUTES = ("class", "instance", "registered") if HAS_MASK_INTERFACE else ("class", "instance")
OLD_CACHES = Version(transformers.__version__) < Version("4.56")  # caches without layers (no rolling flag)
GEMMA2_DROPS_TRAINING_CACHE = Version(transformers.__version__) < Version("5.0")


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


@dataclasses.dataclass
class Case:
    kv_heads: int
    train: bool
    checkpointing: bool  # gradient checkpointing (non-reentrant), training mode without a cache only
    route: str  # "class", "instance" (apply_patch(model=...)) or "registered" (attn_implementation="patchkit")
    unpad: str  # "model" or "attention" (class and instance routes)
    # "none" (use_cache=False), "default" (left to the model), "dynamic" (a DynamicCache passed in), "implicit"
    # (use_cache=True, then each step gets the previous output's past_key_values), "static_short", "static_full"
    cache: str
    chunks: list  # tokens per forward: one entry is a single forward (or a prefill), more are chunks/decode steps
    extra_slots: int  # StaticCache slots beyond the sequence
    extra: str  # "none", "output_attentions", "hidden_states" or "4d_mask"
    embeds: bool  # inputs_embeds instead of input_ids
    mask_dtype: str  # the dtype the 2D mask is passed in: "long", "bool" or "float"
    cu_seq_lens: bool  # packed documents also described by cu_seq_lens_q/k (DataCollatorWithFlattening's kwargs)
    pos_kind: Optional[str]
    ids: torch.Tensor
    mask: Optional[torch.Tensor]  # None: no attention_mask argument at all (no padding anywhere)
    positions: Optional[torch.Tensor]
    docs: list  # packed rows: (row, start, length) of every document; [] for padded rows
    family: str = "llama"  # another model type: tests/families.py's model of it (2 K/V heads of 4), its own patch

    def __repr__(self) -> str:
        def show(t):
            return None if t is None else t.tolist()

        return (
            f"Case(family={self.family!r}, kv_heads={self.kv_heads}, train={self.train}, "
            f"checkpointing={self.checkpointing}, route={self.route!r}, unpad={self.unpad!r}, "
            f"cache={self.cache!r}, chunks={self.chunks}, extra_slots={self.extra_slots}, extra={self.extra!r}, "
            f"embeds={self.embeds}, mask_dtype={self.mask_dtype!r}, cu_seq_lens={self.cu_seq_lens}, "
            f"pos_kind={self.pos_kind!r}, docs={self.docs},\n     mask={show(self.mask)},\n"
            f"     positions={show(self.positions)}, ids.shape={tuple(self.ids.shape)})"
        )

    @property
    def real(self) -> torch.Tensor:
        return torch.ones_like(self.ids, dtype=torch.bool) if self.mask is None else self.mask.bool()


def refusable(case: Case) -> Optional[str]:
    """Why patchkit may refuse this case, or None when the case can be served and must be.

    - output_attentions=True with packed documents: patchkit steps aside for it (transformers' own attention runs
      it), which would let packed documents attend to each other. Without packing it must be served (stepped
      aside, exactly); so must a 4D mask, whose pattern here keeps the documents apart itself.
    - A sliding window shorter than the batch over a row with a padding hole, through the registered name:
      transformers counts the hole's columns inside the window, varlen kernels cannot, and the registered name has
      no attention of the model's own to step aside to (the class and instance patches step aside: served).
    - Through the registered name, a windowed model's StaticCache with a mask over every slot: its sliding layers
      hold fewer slots than the mask, and transformers' mask sizes cannot tell that mask from one with past columns
      prepended (the FastChat bug, refused). The class and instance patches cut it at the model's forward: served.
      Before 4.56 (caches without layers, which may roll), a windowed model's static cache there: they step aside.
    - Gemma2 before 5.0 in training keeps no cache even when asked: the next chunk's mask is longer than its keys.
    Everything else drawn here (any 2D padding pattern, any of the position conventions, packed rows restarting at
    0, DynamicCache and StaticCache with either mask length) is expressible as key padding + causal + document
    boundaries and must be served.
    """
    if case.extra == "output_attentions" and (separate_documents(case) or case.route == "registered"):
        return ("output_attentions=True with packed documents (transformers' attention would mix them), or through "
                "the registered name, which has no transformers attention of the model's own to step aside to")
    if case.route == "registered" and case.family in WINDOWED and case.extra != "4d_mask" and has_a_hole(case):
        return "a biting sliding window over a padding hole, through the registered name"
    if case.family == "gemma2" and case.train and case.cache == "implicit" and GEMMA2_DROPS_TRAINING_CACHE:
        return ("Gemma2 before 5.0 keeps no cache in training, asked or not: the next chunk's mask is longer than its "
                "keys, which patchkit refuses (transformers reads the mask's first columns)")
    if case.route == "registered" and case.family in WINDOWED and case.cache.startswith("static") and OLD_CACHES:
        return ("a static cache on a model with a sliding window before transformers 4.56, through the registered "
                "name: its sliding layers may roll a buffer (a model forward under apply_patch steps aside)")
    if case.route == "registered" and case.family in WINDOWED and case.cache == "static_full":
        return ("a mask over every slot of a static cache whose sliding layers hold fewer slots, through the "
                "registered name, whose mask function cannot tell it from a mask with past columns prepended")
    return None


def has_a_hole(case: Case) -> bool:
    """Some row of the mask has padding between real tokens, and the window is shorter than the row."""
    if case.mask is None or WINDOW >= case.mask.shape[-1]:
        return False
    rows = [row.nonzero().flatten().tolist() for row in case.mask]
    return any(real and real[-1] - real[0] + 1 != len(real) for real in rows)


# ---------------------------------------------------------------------------------------------------- strategies

ROW_KINDS = ("full", "right", "left", "gap", "holes", "empty")


@st.composite
def padded_rows(draw, batch: int, seq: int, allow_no_mask: bool):
    """mask (B, S), position_ids or None, and the convention's name: padding of every kind, one kind per row."""
    rows = []
    for _ in range(batch):
        kind = draw(st.sampled_from(ROW_KINDS))
        if kind == "full":
            row = [1] * seq
        elif kind in ("right", "left"):
            n = draw(st.integers(1, max(1, seq - 1)))
            row = [1] * n + [0] * (seq - n) if kind == "right" else [0] * (seq - n) + [1] * n
        elif kind == "gap" and seq >= 3:  # [pad] real.. pad.. real.. [pad]: one hole between two runs
            lead = draw(st.integers(0, seq - 3))
            first = draw(st.integers(1, seq - lead - 2))
            hole = draw(st.integers(1, seq - lead - first - 1))
            second = draw(st.integers(1, seq - lead - first - hole))
            row = [0] * lead + [1] * first + [0] * hole + [1] * second
            row += [0] * (seq - len(row))
        elif kind in ("gap", "holes"):  # any pattern at all
            row = [int(b) for b in draw(st.lists(st.booleans(), min_size=seq, max_size=seq))]
        else:
            row = [0] * seq
        rows.append(row)
    mask = torch.tensor(rows)
    pos_kind = draw(st.sampled_from(("generation", None, "arange")))  # generation first: the usual, and the riskiest
    if pos_kind is None:
        positions = None
    elif pos_kind == "generation":  # what generate() builds for a padded batch
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    else:  # arange, padding positions kept; an offset (a continued context) and transformers' (1, S) shape drawn
        positions = torch.arange(seq) + draw(st.integers(0, 3))
        positions = positions[None] if draw(st.booleans()) else positions.expand(batch, seq).clone()
    if allow_no_mask and bool(mask.all()) and draw(st.booleans()):
        mask = None  # no padding: no mask argument at all
    return mask, positions, pos_kind


@st.composite
def packed_rows(draw, batch: int, allow_no_mask: bool):
    """Rows of documents with positions restarting at 0, padding before, between and after them."""
    fill = draw(st.sampled_from(("zero", "one", "continue")))  # what position_ids hold at padding
    rows = []
    for r in range(batch):
        segments = []
        left = draw(st.integers(0, 1))
        if left:
            segments.append(("pad", left))
        for _ in range(draw(st.integers(1 if r == 0 else 0, 3))):
            segments.append(("doc", draw(st.integers(1, 4))))
            gap = draw(st.integers(0, 1))
            if gap:
                segments.append(("pad", gap))
        rows.append(segments)
    width = max(1, max(sum(n for _, n in segs) for segs in rows))
    mask = torch.zeros(batch, width, dtype=torch.long)
    positions = torch.zeros(batch, width, dtype=torch.long)
    docs = []
    for r, segments in enumerate(rows):
        at, last = 0, -1
        for kind, n in segments + [("pad", width - sum(n for _, n in segments))]:
            if kind == "doc":
                mask[r, at : at + n] = 1
                positions[r, at : at + n] = torch.arange(n)
                docs.append((r, at, n))
                last = n - 1
            else:
                for i in range(at, at + n):
                    last = {"zero": 0, "one": 1, "continue": last + 1}[fill]
                    positions[r, i] = last
            at += n
    if allow_no_mask and bool(mask.all()) and draw(st.booleans()):
        mask = None
    return mask, positions, docs, f"packed/{fill}"


@st.composite
def cases(draw, caches: tuple, families: tuple = ("llama",)):
    family = families[0] if len(families) == 1 else draw(st.sampled_from(families))
    cache = draw(st.sampled_from(caches))
    route = draw(st.sampled_from(ROUTES))
    # cached runs take packed rows as a prefill only: there, mostly padded rows with chunks and decode steps
    layout = draw(st.sampled_from(("padded", "packed") if cache in SINGLE else ("padded",) * 3 + ("packed",)))
    batch = draw(st.integers(1, 3))
    docs = []
    allow_no_mask = cache != "static_full"  # a mask over every slot needs a mask; no mask is static_short's case
    if layout == "padded":
        tiny = draw(st.sampled_from((False,) * 4 + (True,)))  # the 1- and 2-token edges, now and then
        seq = draw(st.integers(1, 2) if tiny else st.integers(3, MAX_SEQ))
        mask, positions, pos_kind = draw(padded_rows(batch, seq, allow_no_mask))
    else:
        mask, positions, docs, pos_kind = draw(packed_rows(batch, allow_no_mask))
        seq = positions.shape[-1]
    chunks = [seq]
    if cache in CACHED and layout == "padded":  # packed rows: a prefill only (a cache cannot keep the documents)
        first = seq - draw(st.integers(0, seq - 1))
        chunks, left = [first], seq - first
        while left:
            step = draw(st.integers(1, min(3, left)))
            chunks.append(step)
            left -= step
    extras = ["none"] * 6 + ["output_attentions"] + (["hidden_states", "4d_mask"] if cache in SINGLE else [])
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    train = draw(st.booleans())
    # one row of documents, no padding: what DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives
    cu_seq_lens = bool(docs) and batch == 1 and mask is None and cache in SINGLE and draw(st.booleans())
    if cu_seq_lens and draw(st.booleans()):
        positions, pos_kind = None, "packed/cu_seq_lens only"  # the kwargs alone must separate the documents
    return Case(
        family=family,
        kv_heads=draw(st.sampled_from((4, 2, 1))) if family == "llama" else 2,
        train=train,
        checkpointing=train and cache in SINGLE and draw(st.booleans()),  # it turns caches off in training
        route=route,
        unpad=draw(st.sampled_from(("model", "attention"))) if route != "registered" else "-",
        cache=cache,
        chunks=chunks,
        extra_slots=draw(st.integers(0, 3)) if cache.startswith("static") else 0,
        extra=draw(st.sampled_from(extras)),
        embeds=draw(st.booleans()),
        mask_dtype=draw(st.sampled_from(("long", "bool", "float"))),
        cu_seq_lens=cu_seq_lens,
        pos_kind=pos_kind,
        ids=torch.randint(3, VOCAB, (batch, seq), generator=gen),
        mask=mask,
        positions=positions,
        docs=docs,
    )


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


def separate_documents(case: Case) -> bool:
    """Packed documents that must not see each other: cu_seq_lens, or restarting position_ids without a mask (a 2D
    mask is padding only, as in transformers, and its rows' documents attend to each other)."""
    return bool(case.docs) and (case.mask is None or case.cu_seq_lens)


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


# ---------------------------------------------------------------------------------------------------- properties


@given(case=cases(SINGLE))
def test_single_forward_is_served_exactly_or_refused(case):
    """No cache kept (use_cache=False) or use_cache left to the model: logits, and in training loss and grads."""
    check(case)


@given(case=cases(("dynamic", "implicit")))
def test_dynamic_cache_prefill_and_decode_are_served_exactly_or_refused(case):
    """A DynamicCache (passed in, or made by the model and handed on): prefill, chunks and decode steps whose logits
    add up to the single pass."""
    check(case)


@given(case=cases(("static_short",)))
def test_static_cache_with_a_past_plus_q_len_mask_is_served_exactly_or_refused(case):
    """A StaticCache, its 2D mask over past + q_len columns (or no mask at all): prefill, chunks, decode steps."""
    check(case)


@given(case=cases(("static_full",)))
def test_static_cache_with_a_mask_over_every_slot_is_served_exactly_or_refused(case):
    """A StaticCache, its 2D mask over all max_cache_len slots (1 filled real, 0 padding and the unfilled tail)."""
    check(case)


# ---------------------------------------------------------------------------------------------------- regressions
# The two bugs the properties found first, pinned as plain tests that name them.


def test_static_cache_decode_with_a_mask_over_every_slot_matches_eager():
    """Known bug (1): a StaticCache's 2D mask covers all max_cache_len slots (1 filled, 0 the unfilled tail).

    Decode steps must take their queries at the cache position, not from the mask's last q_len columns (the
    unfilled tail: the new token is taken for padding, wrong logits, no error). Found by
    test_static_cache_with_a_mask_over_every_slot_is_served_exactly_or_refused, shrunk to a one-token prefill
    into StaticCache(max_cache_len=2) with the mask [[1, 0]].
    """
    model = tiny_model(seed=11, kv_heads=2, heads=4, hidden=32, layers=2)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 8, [0, 0, 1, 1, 1, 1, 1, 1]])  # left padding, as generate() has it
    slots = 12
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with patchkit.apply_patch("llama2", backend="sdpa"):
            cache = static_cache(model, 2, slots)
            prefill = model(input_ids=ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache).logits
            steps = [
                model(input_ids=ids[:, t : t + 1], attention_mask=F.pad(mask[:, : t + 1], (0, slots - t - 1)),
                      past_key_values=cache).logits
                for t in (6, 7)
            ]
    real = mask.bool()
    torch.testing.assert_close(prefill[real[:, :6]], want[:, :6][real[:, :6]], atol=ATOL, rtol=RTOL)
    for t, got in zip((6, 7), steps):
        torch.testing.assert_close(got[:, 0], want[:, t], atol=ATOL, rtol=RTOL, msg=lambda m, t=t: f"decode {t}: {m}")


def test_a_hole_beside_generation_positions_is_one_document():
    """Known bug (3): mask [1,0,1,1,1,1] with the generation convention's positions [0,1,1,2,3,4] is one sequence.

    A document restarts where a real token's position does not increase over the previous *real* token's; the
    padding position beside it (filled with 1) must not count, or the row is split into [1] + [4] tokens and the
    second part stops seeing the first. Found by test_single_forward_is_served_exactly_or_refused, shrunk to the
    mask [[1, 0, 1]] with positions [[0, 1, 1]].
    """
    mask = torch.tensor([[1, 0, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    assert positions.tolist() == [[0, 1, 1, 2, 3, 4]]
    assert build_metadata(mask, 1, 6, 6, torch.device("cpu"), positions).seqlens_q == [5]
    model = tiny_model(seed=11, kv_heads=2, heads=4, hidden=32, layers=2)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        with patchkit.apply_patch("llama2", backend="sdpa"):
            got = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=ATOL, rtol=RTOL)


# Found by the properties beyond the two known bugs.


def test_static_cache_without_a_mask_matches_eager():
    """No attention_mask with a StaticCache: all max_cache_len slots reach the kernel as keys, bottom-right causal.

    The queries then sit at the end of the slots and attend to the unfilled (zero) ones: wrong logits, no error.
    Shrunk by test_static_cache_with_a_past_plus_q_len_mask_is_served_exactly_or_refused to one token into
    StaticCache(max_cache_len=2).
    """
    model = tiny_model(seed=11, kv_heads=2, heads=4, hidden=32, layers=2)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        with patchkit.apply_patch("llama2", backend="sdpa"):
            cache = static_cache(model, 2, 8)
            got = torch.cat([model(input_ids=ids[:, :3], past_key_values=cache).logits]
                            + [model(input_ids=ids[:, t : t + 1], past_key_values=cache).logits for t in (3, 4)], 1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@needs_mask_interface
@pytest.mark.parametrize("mask_len", ["past_plus_q_len", "every_slot"])
def test_registered_route_serves_a_static_cache(mask_len):
    """attn_implementation="patchkit" receives all max_cache_len slots from transformers' attention and never trims.

    A past + q_len mask is refused as if past columns had been prepended ("attention_mask has shape (1, 1) but ...
    2 keys"); a mask over every slot gives wrong logits like known bug (1).
    """
    model = tiny_model(seed=11, kv_heads=2, heads=4, hidden=32, layers=2)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 5, [0, 1, 1, 1, 1]])
    slots = 8
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        set_attention(model, patchkit.ATTENTION_NAME)
        cache = static_cache(model, 2, slots)
        got = []
        for start, stop in ((0, 3), (3, 4), (4, 5)):
            step_mask = mask[:, :stop] if mask_len == "past_plus_q_len" else F.pad(mask[:, :stop], (0, slots - stop))
            got.append(model(input_ids=ids[:, start:stop], attention_mask=step_mask, past_key_values=cache).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(got, 1)[real], want[real], atol=ATOL, rtol=RTOL)


# Found by running the properties on transformers 4.48.3 and 4.52.4 (the era sweep); fixed since.


@pytest.mark.parametrize("variant", ["no_mask", "output_attentions"])
def test_a_training_forward_asked_for_a_cache_keeps_it_and_the_next_step_is_exact(variant):
    """Every version, before the fix: in training mode, a prefill with use_cache=True, then one more token fed with
    the prefill's past_key_values, as unpatched transformers serves it (it keeps a DynamicCache in training).

    patchkit kept no KV cache in training even when asked, so the prefill handed back past_key_values=None. With no
    mask the next token then attended to itself alone (logits off by 0.19, no error); with output_attentions=True
    (stepped aside) the same on 4.48-5.0, and a RuntimeError inside transformers' eager attention on 5.23. An asked
    for cache is now kept (`_keep_no_cache_in_training`); a config's default use_cache still makes none.
    """
    model = tiny_model(seed=11, kv_heads=4, heads=4, hidden=32, layers=2).train()
    ids, mask = torch.tensor([[37, 24, 44]]), torch.tensor([[1, 1, 1]])
    kw = {"output_attentions": True} if variant == "output_attentions" else {}
    masks = (None, None) if variant == "no_mask" else (mask[:, :2], mask)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        with patchkit.apply_patch("llama2", backend="sdpa"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the step-aside warning, and 4.57's about output_attentions
            first = model(input_ids=ids[:, :2], attention_mask=masks[0], use_cache=True, **kw)
            assert first.past_key_values is not None
            second = model(input_ids=ids[:, 2:], attention_mask=masks[1], past_key_values=first.past_key_values,
                           use_cache=True, **kw)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), want, atol=ATOL, rtol=RTOL)


def test_a_4d_mask_under_gradient_checkpointing_keeps_its_documents():
    """Transformers 4.48.3 before the fix (4.52.4 and later passed): a caller's 4D block-diagonal mask (two
    documents of 2) with gradient checkpointing in training mode.

    patchkit turns the 4D mask into cu_seq_lens kwargs and drops the mask (`take_documents`), but 4.48's
    LlamaModel calls `_gradient_checkpointing_func(decoder_layer.__call__, ...)` without **flash_attn_kwargs: the
    attention got neither mask nor cu_seq_lens and the documents attended to each other (logits off by 0.23, no
    error). The documents now ride the mask object (`documents_metadata`), as a checkpoint's recompute does.
    """
    model = tiny_model(seed=11, kv_heads=4, heads=4, hidden=32, layers=2).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, doc = torch.tensor([[37, 24, 50, 8]]), torch.tensor([0, 0, 1, 1])
    allowed = torch.ones(4, 4).tril().bool() & (doc[:, None] == doc[None, :])
    four_d = torch.zeros(1, 1, 4, 4).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=four_d, use_cache=False).logits
        with patchkit.apply_patch("llama2", backend="sdpa"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            got = model(input_ids=ids, attention_mask=four_d, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_restarting_positions_under_a_causal_4d_mask_and_checkpointing_stay_one_document():
    """The converse of the test above (transformers 4.48-4.51, before the fix): a plain causal 4D mask (one
    document) with position_ids restarting at 0, gradient checkpointing on. patchkit turned the mask into
    cu_seq_lens that 4.48's checkpointed layers never got, and the layers, given no mask, split the row at the
    restart: two documents where transformers serves one. The documents now ride the mask object."""
    model = tiny_model(seed=11, kv_heads=4, heads=4, hidden=32, layers=2).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, positions = torch.tensor([[37, 24, 50, 8]]), torch.tensor([[0, 1, 0, 1]])
    causal = torch.zeros(1, 1, 4, 4).masked_fill(~torch.ones(4, 4).tril().bool(), torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=causal, position_ids=positions, use_cache=False).logits
        with patchkit.apply_patch("llama2", backend="sdpa"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            got = model(input_ids=ids, attention_mask=causal, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
