"""default_dtype always restores torch's default dtype; cast_for_training casts exactly FastChat's modules."""

from __future__ import annotations

import logging

import pytest
import torch
from models import tiny_model

from patchkit.dtypes import cast_for_training, default_dtype, training_compute_dtype
from patchkit.hooks.attention.varlen import compute_dtype

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
LAYERS = 2
CAST_NAMES = [
    "base_model.model.model.embed_tokens",
    *(
        f"base_model.model.model.layers.{i}.{norm}"
        for i in range(LAYERS)
        for norm in ("input_layernorm", "post_attention_layernorm")
    ),
    "base_model.model.model.norm",
    "base_model.model.lm_head",
]


@pytest.fixture
def restore_default_dtype():
    previous = torch.get_default_dtype()
    yield
    torch.set_default_dtype(previous)


@pytest.mark.usefixtures("restore_default_dtype")
@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_default_dtype_sets_and_restores(dtype, name):
    for spec in (dtype, name):
        with default_dtype(spec) as active:
            assert active is dtype and torch.get_default_dtype() is dtype
            assert torch.nn.Linear(2, 2).weight.dtype is dtype
        assert torch.get_default_dtype() is torch.float32


@pytest.mark.usefixtures("restore_default_dtype")
def test_default_dtype_restores_on_error_and_when_nested():
    torch.set_default_dtype(torch.float64)
    with pytest.raises(RuntimeError, match="boom"):
        with default_dtype(torch.bfloat16):
            with default_dtype(torch.float16):
                raise RuntimeError("boom")
    assert torch.get_default_dtype() is torch.float64


@pytest.mark.usefixtures("restore_default_dtype")
@pytest.mark.parametrize("bad", [torch.int64, torch.bool, torch.complex64, "int8", 3])
def test_default_dtype_rejects_non_float(bad):
    with pytest.raises(TypeError, match="floating point|unknown dtype name|expected a torch.dtype"):
        with default_dtype(bad):
            pass
    assert torch.get_default_dtype() is torch.float32


def lora_model(dtype: torch.dtype, targets: tuple[str, ...] = ("q_proj", "v_proj")):
    peft = pytest.importorskip("peft", reason="peft is needed for the LoRA tests (pip install peft)")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), task_type="CAUSAL_LM")
    return peft.get_peft_model(tiny_model(dtype=dtype, layers=LAYERS), config)


def dtypes_by_name(model) -> dict[str, torch.dtype]:
    return {name: p.dtype for name, p in model.named_parameters()}


def test_cast_for_training_casts_exactly_norms_lm_head_and_embed_tokens(caplog):
    model = lora_model(torch.float32)
    before = dtypes_by_name(model)
    with caplog.at_level(logging.INFO, logger="patchkit"):
        cast = cast_for_training(model, torch.bfloat16)
    assert cast == CAST_NAMES
    after = dtypes_by_name(model)
    changed = {name for name in after if after[name] != before[name]}
    assert changed == {f"{prefix}.weight" for prefix in CAST_NAMES}
    assert all(after[name] is torch.bfloat16 for name in changed)
    assert all("lora_" not in name for name in changed), "LoRA adapter weights must stay fp32"
    assert "cast base_model.model.lm_head from torch.float32 to torch.bfloat16" in caplog.text


def test_cast_for_training_reads_the_compute_dtype_from_the_base_weights():
    """A bf16 model under LoRA: PEFT keeps adapters fp32, and norms were upcast (prepare_model_for_kbit_training)."""
    model = lora_model(torch.bfloat16)
    for name, module in model.named_modules():
        if name.endswith("norm"):
            module.float()
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    assert training_compute_dtype(model) is torch.bfloat16
    assert cast_for_training(model) == CAST_NAMES
    dtypes = dtypes_by_name(model)
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}


def test_cast_for_training_leaves_adapters_on_lm_head_alone():
    model = lora_model(torch.float32, targets=("q_proj", "lm_head"))
    assert cast_for_training(model, "fp16") == CAST_NAMES
    lm_head = model.base_model.model.lm_head
    assert lm_head.base_layer.weight.dtype is torch.float16
    assert {p.dtype for p in lm_head.lora_A.parameters()} | {p.dtype for p in lm_head.lora_B.parameters()} == {
        torch.float32
    }


def test_compute_dtype_defaults_to_bf16_without_float_linear_weights():
    assert training_compute_dtype(torch.nn.Sequential(torch.nn.LayerNorm(4))) is torch.bfloat16
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 4), "final_norm": torch.nn.LayerNorm(4)}).half()
    assert training_compute_dtype(model) is torch.float16
    assert cast_for_training(model, torch.float32) == ["final_norm"]
    assert model["final_norm"].bias.dtype is torch.float32 and model["proj"].weight.dtype is torch.float16


def test_a_layers_compute_dtype_reads_weights_deepspeed_zero3_partitioned():
    # Outside its forward a ZeRO-3 layer holds each weight as a (0,) placeholder of the weight's dtype, the real shape
    # in `ds_shape`: the fp16 layer of a config that says float32 casts fp32 q/k/v (LoRA's) to fp16, not bf16.
    model = tiny_model(dtype=torch.float16)
    model.config.torch_dtype = torch.float32
    attention = model.model.layers[0].self_attn
    for param in attention.parameters():
        param.ds_shape = param.shape
        param.data = torch.empty(0, dtype=param.dtype)
    assert compute_dtype(attention, "cpu") is torch.float16
