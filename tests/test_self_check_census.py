"""Every family patchkit serves passes its self-check from its default (checkpoint-sized) config, as it runs on a
transformers newer than CI's (a part of `make census`).

On such a transformers a family checks itself on a tiny copy of the user's config before its first forward, and
steps aside on every forward where the check fails. The census's tiny configs never reached what checkpoints carry:
dropout under other names, widths under other names, group-limited routing, KV sharing, shared blocks, caches of
their own, a Mamba state sized for a GPU. Each of those failed the check here once (`test_self_check.py` names
them); this runs the check on every served family's defaults. Where transformers' own model of the default config
cannot run (a default left None, no attention layer at all), the check cannot either, and the test asserts that
transformers fails there the same way, on the meta device.
"""

from __future__ import annotations

import warnings
from typing import Optional

import pytest
import torch
import transformers
from families import FAMILIES, MULTIMODAL_ROPE
from test_self_check import check_of, newer  # noqa: F401 - newer: a fixture

NEW_ENOUGH = int(transformers.__version__.split(".")[0]) >= 5
UNPATCHED = "the check's tiny model failed unpatched ("


def served() -> list[str]:
    """The model types of the language models served here: LLaMA's, the modules' families (a vision-language
    family's language model by its own, `{family}_text`), and the table's."""
    if not NEW_ENOUGH:
        return []
    from patches.table import VERIFIED

    return sorted({"llama", *(f + "_text" if f in MULTIMODAL_ROPE else f for f in FAMILIES), *VERIFIED})


def unpatched_failure(config) -> Optional[str]:
    """transformers' own base model of the whole `config`, built and run on the meta device (no memory, no
    numbers): the exception's type name where it fails, else None."""
    from census import base_model_name

    config._attn_implementation = "eager"
    ids = torch.ones(2, 6, dtype=torch.long, device="meta")
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            getattr(transformers, base_model_name(config.model_type))(config)(input_ids=ids,
                                                                               attention_mask=torch.ones_like(ids))
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises on its own defaults
        return type(exc).__name__
    return None


@pytest.mark.skipif(not NEW_ENOUGH, reason="families served from data: transformers 5.x")
@pytest.mark.parametrize("model_type", served())
def test_a_served_family_passes_its_self_check_on_its_default_config(newer, model_type):  # noqa: F811
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family = model_type.removesuffix("_text")
    why = check_of(CONFIG_MAPPING[model_type](), family if family in MULTIMODAL_ROPE else None)
    if why is None:
        return
    assert why.startswith(UNPATCHED), why  # patched, the check's model differed or raised: patchkit's fault
    failure = unpatched_failure(CONFIG_MAPPING[model_type]())
    assert failure is not None and why.startswith(UNPATCHED + failure + ":"), (
        f"the tiny copy failed ({why}) where transformers' model of the default config runs ({failure}): "
        "tiny_config broke it")
