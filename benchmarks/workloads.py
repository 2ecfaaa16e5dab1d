"""The benchmark's inputs: the fixed-seed length mixes, the modes' sizes, and padded or packed batches."""

from __future__ import annotations

import math
from typing import Any

# The realistic mix: lognormal(log 300, 0.9) lengths, seed 32, clipped to [16, 2048].
LOGNORMAL = {"median": 300, "sigma": 0.9, "seed": 32, "min": 16, "max": 2048}
MODEL = {"hidden": 256, "layers": 4, "heads": 8, "intermediate": 688, "vocab": 4096}
PAD = 0
FLOOR = "floor_perdoc_sdpa"  # packed rows, attention per document by plain SDPA calls, no patch

# Sizes per mode. reps: timed runs after one warm-up per provider; providers run round-robin within a run.
MODES: dict[str, dict[str, Any]] = {
    "smoke": {  # the test suite's mode: a toy model, seconds
        "model": {"hidden": 64, "layers": 1, "heads": 4, "intermediate": 128, "vocab": 128}, "reps": 1,
        "batch": 4, "scale": 0.1, "decode_tokens": 4, "pad_fracs": [], "pad_len": 64, "lengths": [128],
        "gqa": False, "decode": False, "mem_providers": ["patchkit_sdpa"],
    },
    "quick": {
        "model": MODEL, "reps": 2, "batch": 8, "scale": 0.5, "decode_tokens": 8, "pad_fracs": [0.0, 0.5],
        "pad_len": 256, "lengths": [512, 1024], "gqa": False, "decode": True,
    },
    "default": {
        "model": MODEL, "reps": 5, "batch": 8, "scale": 1.0, "decode_tokens": 32, "pad_fracs": [0.0, 0.25, 0.5, 0.75],
        "pad_len": 512, "lengths": [1024, 2048, 4096, 8192], "gqa": True, "decode": True,
        "gqa_providers": ["hf_sdpa", "patchkit_sdpa", FLOOR],  # eager and packed_cu on GQA only with --full
    },
    "cuda": {  # --device cuda without --quick/--full: 1B-class layers (head_dim 128): the GPU is timed, not the host
        "model": {"hidden": 2048, "layers": 4, "heads": 16, "intermediate": 5504, "vocab": 32000}, "reps": 5,
        "batch": 16, "scale": 1.0, "decode_tokens": 32, "pad_fracs": [0.0, 0.25, 0.5, 0.75], "pad_len": 2048,
        "lengths": [2048, 4096, 8192, 16384, 32768], "gqa": True, "decode": True,
        # eager's (B, H, N, N) weights: out of memory at N = 8192 on an H100, and a minute spent finding out
        "mem_providers": ["hf_sdpa", "hf_flash_attention_2", "hf_flash_attention_4", "patchkit_flash_attn",
                          "patchkit_flash_attn_4", "patchkit_torch_varlen"],
    },
    "full": {
        "model": MODEL, "reps": 7, "batch": 8, "scale": 1.0, "decode_tokens": 32,
        "pad_fracs": [0.0, 0.25, 0.5, 0.625, 0.75, 0.875], "pad_len": 1024,
        "lengths": [512, 1024, 2048, 4096, 8192, 16384], "gqa": True, "decode": True,
    },
}


# families.py's and compiled.py's models on the CPU, as HF config arguments (2 K/V heads)
HF_SIZE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)


def hf_size(device: str) -> dict[str, int]:
    """HF config arguments of families.py's and compiled.py's models: HF_SIZE on the CPU; on "cuda" the cuda mode's
    model (head_dim 128: a head dim the flash-attn build has), with HF_SIZE's 2 K/V heads."""
    if device != "cuda":
        return HF_SIZE
    cfg = MODES["cuda"]["model"]
    return dict(HF_SIZE, vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"])


def lognormal_lengths(batch: int, scale: float = 1.0) -> list[int]:
    """The fixed-seed realistic mix (median ~300, max 2048, ~55% padding at batch 8), optionally scaled."""
    import torch

    g = torch.Generator().manual_seed(LOGNORMAL["seed"])
    raw = torch.exp(torch.randn(batch, generator=g) * LOGNORMAL["sigma"] + math.log(LOGNORMAL["median"]))
    lens = raw.round().clamp(LOGNORMAL["min"], LOGNORMAL["max"]).long().tolist()
    return [max(4, round(n * scale)) for n in lens]


def padded_lengths(batch: int, max_len: int, pad_frac: float) -> list[int]:
    """One row of `max_len`, the others spread around the mean that gives `pad_frac` padding overall."""
    others = (batch * (1 - pad_frac) * max_len - max_len) / max(batch - 1, 1)
    width = max(0.0, min(0.5, max_len / max(others, 1) - 1))  # +-50% around the mean, narrower near max_len
    spread = [1 - width + 2 * width * i / max(batch - 2, 1) for i in range(batch - 1)]  # mean 1.0
    return [max_len] + [int(min(max_len, max(1, round(others * s)))) for s in spread]


def padding_fraction(lengths: list[int]) -> float:
    return 1 - sum(lengths) / (len(lengths) * max(lengths))


def make_tokens(lengths: list[int], vocab: int, seed: int = 0) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def padded_batch(docs: list[Any], left: bool = False) -> tuple[Any, Any, Any]:
    """input_ids, 2D mask, labels (-100 on padding) for a right- (or left-) padded batch."""
    import torch

    n = max(len(d) for d in docs)
    ids = torch.full((len(docs), n), PAD, dtype=torch.long)
    mask = torch.zeros(len(docs), n, dtype=torch.long)
    for row, d in enumerate(docs):
        sl = slice(n - len(d), n) if left else slice(0, len(d))
        ids[row, sl] = d
        mask[row, sl] = 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def packed_row(docs: list[Any]) -> dict[str, Any]:
    """All documents in one row, as DataCollatorWithFlattening builds it (positions restart, -100 at starts)."""
    import torch

    ids = torch.cat(docs).unsqueeze(0)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    labels = ids.clone()
    labels[pos == 0] = -100
    lens = torch.tensor([len(d) for d in docs], dtype=torch.int32)
    cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    return {"input_ids": ids, "position_ids": pos, "labels": labels, "cu": cu, "max_len": int(lens.max())}


def make_data(kind: str, docs: list[Any], device: Any) -> dict[str, Any]:
    """Model inputs for a data layout: padded (2D mask), left-padded (generation), packed by positions or cu_seqlens."""
    lens = [len(d) for d in docs]
    if kind in ("padded", "left"):
        ids, mask, labels = padded_batch(docs, left=kind == "left")
        out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    else:
        p = packed_row(docs)
        out = {"input_ids": p["input_ids"], "position_ids": p["position_ids"], "labels": p["labels"]}
        if kind == "packed_cu":
            out.update(cu_seq_lens_q=p["cu"], cu_seq_lens_k=p["cu"], max_length_q=p["max_len"],
                       max_length_k=p["max_len"])
    out = {k: v.to(device) if hasattr(v, "to") else v for k, v in out.items()}
    out["docs"] = lens
    return out

