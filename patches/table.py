"""Every other decoder LM, served from data: its classes found in its modeling module, the census's verdicts here.

A family whose attention module calls transformers' attention interface (`ALL_ATTENTION_FUNCTIONS`) and whose
base model and causal LM are in transformers' auto mappings is served by `family_route` with no module of its own:
`find_classes` reads its attention, base model and causal-LM classes from the installed transformers. The census
(`tests/test_census.py`) runs every such family through every way in against transformers' eager attention; what
it found exact is `VERIFIED`. A family it has not seen (a model type transformers added after CI's version) is
served too, after its self-check (`patchkit.hooks.decide.self_check`) on a tiny model of the user's config passes;
`REFUSED` names the families the varlen path cannot serve, with the feature that stops each.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Optional

from packaging.specifiers import SpecifierSet
from torch import nn

from patchkit.errors import PatchTargetError
from patchkit.hooks.decide import self_check
from patchkit.hooks.install.patching import unpatched
from patchkit.hooks.install.registry import PatchSpec, config_gate

TABLE_TRANSFORMERS = ">=5.0,<6"  # where the census runs: every family's attention through the interface

# Served exactly by the census on CI's transformers (every way in: class, instance, registered name; padded and
# packed training steps, left-padded generation). The explicit modules in patches/ are verified the same way.
VERIFIED = frozenset({
    "afmoe", "apertus", "arcee", "aria_text", "beam", "bitnet", "codegen", "cohere", "cohere2", "cohere2_moe",
    "cwm", "diffllama", "dots1", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "flex_olmo",
    "glm", "glm4_moe", "gpt2", "gpt_neox", "gptj", "granitemoe", "granitemoeshared", "helium",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "hyperclovax", "internlm3", "iquestcoder", "jais2", "jetmoe", "kolibri1",
    "laguna", "mellum", "minimax_m2", "ministral", "ministral3", "modernbert-decoder", "nanochat",
    "nemotron", "olmo", "olmo3", "olmoe", "phimoe", "sarvam_moe", "seed_oss", "solar_open", "stablelm",
    "vaultgemma", "apertus1p5_text", "gpt-sw3", "hy_v3", "dbrx", "gemma3n_text",
    # new in transformers 5.25 (Ergo: sliding layers with RoPE, full ones without, DeepSeek-V3's MoE)
    "ergo", "minicpm5_moe", "param2moe",
    # Dory (5.25): a recurrent section of layers run in loops, each loop on cache layers of its own
    "dory",
    # Cohere Compass's text model (5.25): sliding and full layers, RoPE parameters per layer type
    "cohere_compass_text",
    # through the attention interface from 5.25: its rotary configs (the ALiBi ones step aside, `REFUSED_CONFIGS`)
    "falcon",
    # attention sinks (`s_aux`), exact on the sdpa path: the attention times sigmoid(lse - sink)
    "gpt_oss", "flint", "granite_swa", "granitemoe_swa", "mimo_v2_flash",
    # multi-head latent attention (values narrower than queries and keys): zero columns to one head size
    "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "sarvam_mla", "youtu", "axk1", "longcat_flash",
    # sparse attention (DSA): served where no query sees more keys than its indexer keeps (`SPARSE_INDEXERS`)
    "deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4",
    # dots3's text model: DSA layers among sliding ones, each kind its own head counts (`per_layer_config`)
    "dots3_note_text",
    # Kolibri-1.1: its indexer keeps top-k keys, sink and local ones besides, from a pool of an earlier layer's
    "kolibri1_1",
    # Qwen4-Exp's text model: QSA's indexer keeps whole blocks of pooled keys; linear-attention and PLE layers beside
    "qwen4_exp_text",
    # DeepSeek-V4: a sliding window's keys and compressed entries under their compressor's bias (`COMPRESSORS`)
    "deepseek_v4",
    # per-layer configs: Gemma4's full-attention layers have wider heads than its sliding ones, each layer its own
    "gemma4_text", "gemma4_unified_text",
    # packed documents read from transformers' mask function, for layers not handed position_ids
    "ctrl", "gpt_bigcode", "moshi", "persimmon",
    # chunked attention (documents cut at the chunk size), NoPE layers whose temperature reads the row's length
    "llama4_text",
    # Llama 3.2 Vision's language model: its cross-attention layers (to the image tiles) run transformers' attention
    "mllama_text_model",
    # Emu3's language model (its images are tokens of the text stream, from its VQ-VAE)
    "emu3_text_model",
    # language models served inside their multimodal model (`WRAPPED_TEXT_MODELS`; the multimodal census checks them)
    "glm_ocr_text", "granite_docling_text", "paddleocr_vl_text", "qwen2_5_omni_text", "qwen3_omni_moe_text",
    "hunyuan_vl_text",
    # Mistral Large 4's: sparse attention (`SPARSE_INDEXERS`), its layers' latent keys shared with later layers
    "mistral_large4_text",
    # one stack's layers run many times a forward (HRM-Text's H/L cycles, a cache slot for each); its prefix-LM block
    # (token_type_ids) is a mask pattern beyond causal, stepped aside for
    "hrm_text",
    # the base model reads the mask itself (positions counted from it), served with the padded batch, unpadded inside
    # attention alone; or mixes tokens outside attention (linear attention, state-space or convolution layers), the
    # packed row's rows in groups of similar length (ROW_MIXERS)
    *("biogpt", "opt", "lfm3", "falcon_h1", "lara_mini", "minimax", "nemotron_h", "olmo_hybrid", "lfm2", "qwen3_next",
      "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear", "bailing_hybrid"),
    # Mamba, recurrent (RG-LRU) or convolution layers beside attention ones (Zamba's and ZAYA's hybrid layers hold both)
    *("bamba", "jamba", "zamba", "zamba2", "zaya", "recurrent_gemma", "lfm2_moe", "granitemoehybrid"),
})
# Served with the padded batch (their base model counts positions from the mask); so is, by its default config's
# `layer_types`, any other family with layers of MIXER_LAYER_TYPES (RecurrentGemma's RG-LRU) not in ROW_MIXERS
ATTENTION_UNPAD = frozenset({"biogpt", "opt"})
# Language models whose causal LM transformers' auto mappings list under their composite's model_type (Llama 3.2
# Vision's `mllama`, Emu3's `emu3`): model_type -> (causal LM, base model)
TEXT_MODELS = {"mllama_text_model": ("MllamaForCausalLM", "MllamaTextModel"),
               "emu3_text_model": ("Emu3ForCausalLM", "Emu3TextModel")}
# Layers that attend from the text to another tower's tokens (Mllama's image tiles) under a (B, 1, N, tiles) mask of
# the batch's own: no key-padding mask says which tiles a token sees, so they run the attention the model was loaded
# with (`hooks/attention/cross_layers.py`), exactly, and their decoder layers run on the padded batch inside a packed
# forward (`hooks/forwards/padded_layers.py`). model_type -> (the attention class, its decoder layer class)
# Language models with no causal LM of their own in transformers: their multimodal model holds the head (GLM-OCR's,
# Granite-Docling's). Served inside it, verified by the multimodal census (`tests/test_wrapper_census.py`: training,
# generation, the reads at padding, unpad="loss", the registered name); model_type -> its base model's class name,
# or (that, its attention's) where the module's other towers' attention goes through the interface too.
# Not listed: GLM-5-Next's (it builds 4D masks of its own)
WRAPPED_TEXT_MODELS = {"glm_ocr_text": "GlmOcrTextModel", "granite_docling_text": "GraniteDoclingTextModel",
                       "paddleocr_vl_text": "PaddleOCRTextModel",
                       "qwen2_5_omni_text": ("Qwen2_5OmniThinkerTextModel", "Qwen2_5OmniAttention"),
                       "qwen3_omni_moe_text": "Qwen3OmniMoeThinkerTextModel", "hunyuan_vl_text": "HunYuanVLTextModel",
                       "mistral_large4_text": "MistralLarge4TextModel"}
CROSS_LAYERS = {"mllama_text_model": ("MllamaTextCrossAttention", "MllamaCrossAttentionDecoderLayer")}
# Hybrids whose token mixers (gated delta rule, Mamba, short convolutions, lightning attention) run on the packed row,
# its rows in groups of similar length (`hooks/forwards/mixer_rows.py`): transformers zeroes their padding's hidden
# states, so each row, alone or right-padded beside others, is what the padded batch computed at its real tokens; the
# census checks each. Their mixer classes, by model_type
ROW_MIXERS = {
    "qwen3_next": "Qwen3NextGatedDeltaNet", "qwen3_5_text": "Qwen3_5GatedDeltaNet",
    "qwen3_5_moe_text": "Qwen3_5MoeGatedDeltaNet", "olmo_hybrid": "OlmoHybridGatedDeltaNet",
    "lara_mini": "LaraMiniGatedDeltaNet", "kimi_linear": "KimiLinearDeltaAttention",
    "bailing_hybrid": "BailingHybridDeltaAttention", "lfm2": "Lfm2ShortConv", "lfm2_moe": "Lfm2MoeShortConv",
    "lfm3": "Lfm3ShortConv", "bamba": "BambaMixer", "jamba": "JambaMambaMixer", "zamba": "ZambaMambaMixer",
    "zamba2": "Zamba2MambaMixer", "nemotron_h": "NemotronHMamba2Mixer", "falcon_h1": "FalconH1Mixer",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer", "minimax": "MiniMaxLightningAttention",
    "zaya": "ZayaCCAProjection",  # its attention's q/k convolution and the value delayed by one token
    "qwen4_exp_text": ("Qwen4ExpTextGatedDeltaNet", "Qwen4ExpTextPLELayer"),  # and its n-gram embeddings' (PLE)
}
# Sparse attention (DeepSeek-V3.2's DSA): an indexer keeps each query's `index_topk` best-scored keys. A query that
# sees no more keys than that keeps them all, and attends densely: forwards where every query does are served, their
# indexers storing their keys in the cache and scoring none (`hooks/attention/sparse_indexer.py`); a forward with a
# query past `index_topk` keys steps aside (`sparse_attention`). model_type -> its indexer class
SPARSE_INDEXERS = {"deepseek_v32": "DeepseekV32Indexer", "glm_moe_dsa": "GlmMoeDsaIndexer", "axk2": "AXK2Indexer",
                   "hy_v4": "HYV4Indexer", "mistral_large4_text": "MistralLarge4TextIndexer",
                   "dots3_note_text": "Dots3NoteTextIndexer", "kolibri1_1": "Kolibri1_1Indexer",
                   "qwen4_exp_text": "Qwen4ExpTextQSAIndexer"}
# where their indexers were read and run (5.23.0, 5.24.0, 5.25.0); before, transformers' DSA layers had another layer
# type and mask (5.16's "deepseek_sparse_attention"), which the census has not run: refused there by name
SPARSE_TRANSFORMERS = ">=5.23"
# Compressed KV entries appended to a layer's keys, each query seeing them under its compressor's bias (DeepSeek-V4's
# heavily compressed and compressed sparse attention: `hooks/attention/compressed_kv.py`): model_type -> the classes
COMPRESSORS = {"deepseek_v4": ("DeepseekV4HCACompressor", "DeepseekV4CSACompressor")}
MIXER_LAYER_TYPES = ("mamba", "linear_attention", "conv", "ssm", "recurrent", "lightning", "hybrid")

# a bias of the scores a family's attention hands transformers' (Inkling's, by the keyword): no varlen kernel takes one
SCORE_BIAS = "a relative position bias added to the attention scores (`position_bias`)"
REFUSED = {
    **dict.fromkeys(("glm5_next", "minimax_m3_vl_text"),
                    "sparse attention: an indexer selects the keys each query sees (DeepSeek-V3.2's DSA, MiniMax-M3's "
                    "blocks), which a key-padding mask cannot express"),
    "inkling_text": SCORE_BIAS,
    "doge": "dynamic mask attention (a learned bias on every score, read from the mask)",
}

# Mixers that read padding (RecurrentGemma's RG-LRU: not zeroed; DeepSeek-V4's compressors pool by column), or, with
# the config's field, their input projection's bias there (through the short convolution): what transformers computes
# at padding before a real token reaches the real tokens; varlen rows have none. Left padding steps aside there
PADDING_INTO_MIXERS = frozenset({"recurrent_gemma", "deepseek_v4"})
MIXER_INPUT_BIAS = {**dict.fromkeys(("bamba", "falcon_h1", "jamba", "zamba", "granitemoehybrid"), "mamba_proj_bias"),
                    **dict.fromkeys(("lfm2", "lfm2_moe", "lfm3"), "conv_bias"), "zamba2": "add_bias_linear",
                    "nemotron_h": "use_bias"}

# Families served but for configs with a feature the varlen path cannot take: model_type -> (the config field, which
# names the step-aside cause where true, and the feature): run on transformers' attention, warned and counted;
# apply_patch(model=...) refuses it by its gate. Falcon (the interface from 5.25): its rotary configs are exact, its
# ALiBi ones (Falcon-RW) add the bias to the mask in bfloat16, which no varlen kernel's ALiBi reproduces.
REFUSED_CONFIGS = {"falcon": ("alibi", "ALiBi (Falcon-RW), a position bias the model adds to the attention mask")}


def serves_here() -> bool:
    """Whether the installed transformers is one the table serves (the census's)."""
    return installed_in(TABLE_TRANSFORMERS)


def installed_in(releases: str) -> bool:
    """Whether the installed transformers is among `releases` (a version specifier)."""
    import transformers

    return transformers.__version__ in SpecifierSet(releases)


def verified_here() -> frozenset[str]:
    """VERIFIED where this transformers is one the table serves, else nothing."""
    return VERIFIED if serves_here() else frozenset()


def imported_types() -> list[str]:
    """The causal-LM model types whose modeling module this process has imported already: a model of these may be
    built before `apply_patch()` (its `post_init`, where a family is adopted, has run); none where the table is off."""
    if not serves_here():
        return []
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    loaded = {name.split(".")[2] for name in list(sys.modules)
              if name.startswith("transformers.models.") and ".modeling_" in name}
    return [t for t in (*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *TEXT_MODELS, *WRAPPED_TEXT_MODELS)
            if model_type_to_module_name(t) in loaded]


def class_names(model_type: str) -> tuple[Optional[str], Optional[str]]:
    """(causal LM, base model) class names of `model_type`: transformers' auto mappings', or `TEXT_MODELS`' for a
    language model they list under its composite (`WRAPPED_TEXT_MODELS`': no causal LM); None where a mapping has
    none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    if model_type in TEXT_MODELS:
        return TEXT_MODELS[model_type]
    if model_type in WRAPPED_TEXT_MODELS:
        named = WRAPPED_TEXT_MODELS[model_type]
        return None, named if isinstance(named, str) else named[0]
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type), MODEL_MAPPING_NAMES.get(model_type)


def find_classes(model_type: str) -> tuple[type, type, Optional[type]]:
    """(attention, base model, causal LM) of `model_type` in the installed transformers, or `PatchTargetError`
    naming what is missing: not a causal LM, no base model beside it, no attention through the interface."""
    from transformers.models.auto import modeling_auto as auto

    for kind in ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                 "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"):
        if model_type in getattr(auto, kind, {}):
            raise PatchTargetError(f"model_type {model_type!r} is an encoder or encoder-decoder family; patchkit "
                                   "serves decoder-only causal LMs")
    lm_name, base_name = class_names(model_type)
    if model_type in WRAPPED_TEXT_MODELS:
        return wrapped_text_classes(model_type, base_name)
    if not isinstance(lm_name, str) or not isinstance(base_name, str):
        raise PatchTargetError(f"model_type {model_type!r} has no causal LM with a base model in this transformers")
    if lm_name.endswith("ForConditionalGeneration"):
        raise PatchTargetError(f"{lm_name} is a multimodal model: patchkit serves its language model by that "
                               "model's own model_type")
    composite = composite_of(model_type)
    if composite:
        raise PatchTargetError(f"{lm_name} is a composite model (its config holds {composite}): patchkit serves "
                               "decoder language models under their own model_type")
    if base_name.endswith("Encoder"):
        raise PatchTargetError(f"{base_name} is an encoder; patchkit serves decoder-only causal LMs")
    import transformers

    lm = getattr(transformers, lm_name)
    base = getattr(transformers, base_name)
    module = sys.modules[lm.__module__]
    if base.__module__ != module.__name__:
        raise PatchTargetError(f"{lm_name} wraps a model of another family ({base.__module__})")
    if any(passes(c, "position_bias") for c in interface_classes(module)):
        raise PatchTargetError(f"model_type {model_type!r} uses {SCORE_BIAS}")
    attention = interface_attention(module, lm_name.removesuffix("ForCausalLM"))
    if attention is None and not any("Attention" in n for n, c in vars(module).items() if isinstance(c, type)):
        raise PatchTargetError(f"{lm_name} has no attention layer (a state-space or recurrent model): there is no "
                               "attention for patchkit to serve; run it as it is")
    if attention is None:
        raise PatchTargetError(f"{lm_name}'s attention does not go through transformers' attention interface "
                               "(its own code computes it): run it without patchkit")
    return attention, mask_builder(module, base), lm


def wrapped_text_classes(model_type: str, base_name: str) -> tuple[type, type, None]:
    """(attention, base model, no causal LM) of a `WRAPPED_TEXT_MODELS` language model: its multimodal model, beside
    it in its modeling module, is the head patchkit wraps (`family_route.vision_lms`). The base model is read from
    that module (transformers does not export every one: Qwen2.5-Omni's thinker's)."""
    import importlib

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config_module = CONFIG_MAPPING[model_type].__module__
        module = importlib.import_module(config_module.replace(".configuration_", ".modeling_"))
    except (KeyError, ImportError):
        module = None
    base = getattr(module, base_name, None)
    named = WRAPPED_TEXT_MODELS[model_type]
    if base is not None and not isinstance(named, str):
        attention = getattr(module, named[1], None)
    else:
        attention = interface_attention(module, base_name.removesuffix("Model")) if base is not None else None
    if attention is None:
        raise PatchTargetError(f"{base_name} is not in this transformers, or its attention does not go through "
                               "transformers' attention interface: run it without patchkit")
    return attention, base, None


TOWERS = ("text_config", "vision_config", "audio_config", "decoder", "decoder_config")


def composite_of(model_type: str) -> str:
    """The towers a composite model's config holds (a language model beside a vision, audio or patch encoder), as
    words, with the language model's own model_type where the config names it; '' for a plain decoder's config."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    subs = (getattr(CONFIG_MAPPING[model_type], "sub_configs", None) if model_type in CONFIG_MAPPING else None) or {}
    if not any(name in subs for name in TOWERS):
        return ""
    text = getattr(subs.get("text_config"), "model_type", None)
    return ", ".join(sorted(subs)) + (f"; its language model's model_type is {text!r}" if text else "")


def mask_builder(module: object, base: type) -> type:
    """The model whose forward builds the masks: the base model, or the one class of its module that does where the
    causal LM calls past the base model (OPT's `self.model.decoder`)."""
    if builds_masks(base):
        return base
    found = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, nn.Module)
             and c.__module__ == module.__name__ and builds_masks(c)]
    return found[0] if len(found) == 1 else base


def builds_masks(cls: type) -> bool:
    return any(n == "_update_causal_mask" or (n.startswith("create_") and "mask" in n) for n in forward_names(cls))


def interface_attention(module: object, stem: str) -> Optional[type]:
    """The attention class of a modeling module: one whose forward calls transformers' attention interface (the
    text one, `{stem}Attention` or `{stem}TextAttention`, where a vision tower's does too), else None."""
    found = interface_classes(module)
    named = [c for c in found if c.__name__ in (f"{stem}Attention", f"{stem}TextAttention")]
    text = [c for c in found if not any(w in c.__name__ for w in ("Vision", "Audio", "Cross", "Encoder"))]
    return (named or (text if len(text) == 1 else [None]))[0]


def interface_classes(module: object) -> list[type]:
    """The modules a modeling module defines whose forward calls transformers' attention interface."""
    return [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, nn.Module)
            and c.__module__ == module.__name__ and calls_interface(c)]


def passes(cls: type, keyword: str) -> bool:
    """`cls`'s own forward passes `keyword=` in a call (the keyword names of its calls are constants of its code)."""
    code = forward_code(cls)
    return code is not None and any(isinstance(c, tuple) and keyword in c for c in code.co_consts)


def forward_code(cls: type) -> Optional[types.CodeType]:
    """The code of `cls`'s own forward, transformers' own under a patch of ours (none where it defines no forward)."""
    forward = cls.__dict__.get("forward")
    return getattr(inspect.unwrap(unpatched(forward)), "__code__", None) if forward is not None else None


def forward_names(cls: type) -> tuple[str, ...]:
    """The global and attribute names `cls`'s own forward reads (none where it defines no forward), transformers' own
    under a patch of ours: read while a class patch is active (an instance patch under `apply_patch()`), the patched
    base model's forward read none, and Moshi's depth decoder or OPT's outer model was taken for its mask builder."""
    code = forward_code(cls)
    return code_names(code) if code is not None else ()


def code_names(code: types.CodeType) -> tuple[str, ...]:
    """The names `code` reads, with those of the functions it defines (dots3's mask builders are lambdas)."""
    return code.co_names + tuple(n for c in code.co_consts if isinstance(c, types.CodeType) for n in code_names(c))


def calls_interface(cls: type) -> bool:
    return "ALL_ATTENTION_FUNCTIONS" in forward_names(cls)


def mixes_outside_attention(model_type: str) -> bool:
    """A family whose layers mix tokens outside attention (its default config's `layer_types` say so)."""
    if model_type in ATTENTION_UNPAD:
        return True
    if model_type in ROW_MIXERS:
        return False  # its mixers run the packed row's rows in groups of similar length
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        kinds = getattr(CONFIG_MAPPING[model_type](), "layer_types", None) or ()
    except Exception:  # a config that will not build on defaults: say nothing of it
        return False
    return any(isinstance(k, str) and k.startswith(MIXER_LAYER_TYPES) for k in kinds)


def spec(model_type: str) -> PatchSpec:
    """The PatchSpec serving `model_type` from data, or `PatchTargetError` with the feature that stops it."""
    if model_type in REFUSED:
        raise PatchTargetError(f"model_type {model_type!r} uses {REFUSED[model_type]}")
    if not serves_here():
        raise PatchTargetError(f"families served from data need transformers{TABLE_TRANSFORMERS} (the census's)")
    if model_type in SPARSE_INDEXERS and not installed_in(SPARSE_TRANSFORMERS):
        raise PatchTargetError(f"model_type {model_type!r} uses sparse attention (an indexer selects the keys each "
                               f"query sees), which patchkit serves on transformers{SPARSE_TRANSFORMERS}")
    find_classes(model_type)  # what stops it, said now rather than at the first forward
    verified = model_type in VERIFIED
    if not verified:
        self_check.unverified.add(model_type)  # checked on a tiny model of the user's config before its first forward
    # Imported here: importing family_route registers patchkit's attention name, which reads REFUSED from this module
    # (`registry.refusal`); at module level that import ran into family_route half-initialised, and the name stayed
    # unregistered (`from patchkit import apply_patch` then attn_implementation="patchkit" was refused).
    from patchkit.hooks.family_route import family_spec_of

    return family_spec_of(
        model_type, lambda: find_classes(model_type),
        f"{model_type}: served from data" + ("" if verified else " (not in the census: self-checked first)"),
        transformers=TABLE_TRANSFORMERS, unpad="attention" if mixes_outside_attention(model_type) else None,
        verified=verified, mixers=lambda: mixer_classes(model_type), check_model=config_gate(model_type),
        model_gate=f"{REFUSED_CONFIGS[model_type][0]}=False" if model_type in REFUSED_CONFIGS else "",
        padded_layers=lambda: cross_decoder_layers(model_type), indexers=lambda: indexer_classes(model_type),
        compressors=lambda: compressor_classes(model_type),
    )


def modeling_classes(model_type: str, names: tuple[str, ...], of: int = 1) -> tuple[type, ...]:
    """The classes `names` in the modeling module of `model_type`'s base model (`of=1`: a wrapped language model has
    no causal LM of its own) or causal LM (`of=2`)."""
    owner = find_classes(model_type)[of] if names else None
    return tuple(getattr(sys.modules[owner.__module__], name) for name in names)


def mixer_classes(model_type: str) -> tuple[type, ...]:
    """The token mixer classes of `model_type` that run the packed row's rows in groups (`ROW_MIXERS`)."""
    names = ROW_MIXERS.get(model_type, ())
    return modeling_classes(model_type, (names,) if isinstance(names, str) else names, of=2)  # one name, or several


def indexer_classes(model_type: str) -> tuple[type, ...]:
    """The sparse-attention indexer class of `model_type` (`SPARSE_INDEXERS`)."""
    return modeling_classes(model_type, (SPARSE_INDEXERS[model_type],) if model_type in SPARSE_INDEXERS else ())


def compressor_classes(model_type: str) -> tuple[type, ...]:
    """The KV compressor classes of `model_type` (`COMPRESSORS`)."""
    return modeling_classes(model_type, COMPRESSORS.get(model_type, ()))


def cross_decoder_layers(model_type: str) -> tuple[type, ...]:
    """The decoder layer classes of `model_type`'s cross-attention layers (`CROSS_LAYERS`)."""
    return modeling_classes(model_type, (CROSS_LAYERS[model_type][1],) if model_type in CROSS_LAYERS else (), of=2)
