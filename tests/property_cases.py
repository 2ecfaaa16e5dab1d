"""The property tests' drawn inputs: the `Case` Hypothesis draws, its strategies, and which cases may be refused.

Shared by tests/test_property.py and tests/test_family_property.py (which draws the same cases for every family);
tests/property_check.py runs a case against the unpatched reference. Importing it skips the importing test file
where hypothesis is not installed.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
import transformers
from families import WINDOW, WINDOWED
from models import VOCAB, needs_mask_interface
from packaging.version import Version

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
    if case.extra == "output_attentions" and separate_documents(case):
        return "output_attentions=True with packed documents (transformers' attention would mix them)"
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


def separate_documents(case: Case) -> bool:
    """Packed documents that must not see each other: cu_seq_lens, or restarting position_ids without a mask (a 2D
    mask is padding only, as in transformers, and its rows' documents attend to each other)."""
    return bool(case.docs) and (case.mask is None or case.cu_seq_lens)


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
