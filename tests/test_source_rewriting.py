"""Frameworks that rewrite the attention forward from its source (axolotl's LoRA kernels, unsloth) compose with
the class patch: they find the family's own code, and their rewritten forward runs through patchkit.

axolotl (`lora_qkv_kernel` / `lora_o_kernel`, on by default for LoRA) reads `inspect.getsource(LlamaAttention.forward)`,
replaces the stock q/k/v and o projection lines, execs the copy in the modeling module and sets it on the class.
Under the env var or the launcher the class's forward was patchkit's routing wrapper: `AssertionError: Original QKV
code not found` at load. The wrapper now shows the family's source (`__wrapped__`), and the base model's forward
wraps a forward set on the class after the patch, so it routes to patchkit, checkpoint recomputes included.
"""

from __future__ import annotations

import inspect
import sys
import textwrap

import pytest
import torch
from families import any_model
from models import labels_for, padded_batch

import patchkit
from patchkit.hooks.install.routing import routes_to

QKV = "query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)"
O_PROJ = "attn_output = self.o_proj(attn_output)"


def apply_qkv(self, hidden_states):  # axolotl's fallback, the projections as they are
    return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)


def apply_o(self, attn_output):
    return self.o_proj(attn_output)


def rewrite(cls: type) -> None:
    """What axolotl's patch_self_attn_lora does: the class forward's source, its projections replaced, exec'd in
    the modeling module's namespace and set on the class (the rewritten code calls `self.apply_qkv`/`apply_o`)."""
    source = textwrap.dedent(inspect.getsource(cls.forward))
    assert QKV in source and O_PROJ in source, "the family's own code was not found"
    source = source.replace(QKV, "query_states, key_states, value_states = self.apply_qkv(hidden_states); "
                                 "query_states = query_states.view(hidden_shape).transpose(1, 2)")
    source = source.replace("key_states = self.k_proj(hidden_states).view", "key_states = key_states.view")
    source = source.replace("value_states = self.v_proj(hidden_states).view", "value_states = value_states.view")
    source = source.replace(O_PROJ, "attn_output = self.apply_o(attn_output)").replace("def forward(", "def rw(", 1)
    namespace = dict(vars(sys.modules[cls.__module__]))
    exec(source, namespace)  # noqa: S102 - the framework's own mechanism, reproduced
    cls.forward = namespace["rw"]
    cls.apply_qkv, cls.apply_o = apply_qkv, apply_o


def train_step(model, ids, mask) -> tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_forward_rewritten_from_its_source_after_the_class_patch_runs_patched(family):
    model = any_model(family, "sdpa").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, mask = padded_batch("right")
    want = train_step(model, ids, mask)
    cls = type(model.model.layers[0].self_attn)
    stock = vars(cls)["forward"]
    handle = patchkit.apply_patch(family if family != "llama" else "llama2", backend="sdpa")
    try:
        rewrite(cls)  # under the class patch, as axolotl does at load under the env var or the launcher
        rewritten = vars(cls)["forward"]
        got = train_step(model, ids, mask)
        assert routes_to(vars(cls)["forward"], handle.state), "the rewritten forward does not route to patchkit"
        assert handle.calls == 4 and not handle.stepped_aside  # 2 layers, each recomputed once in backward
    finally:
        handle.revert()
        reverted = vars(cls)["forward"]
        cls.forward = stock
        for name in ("apply_qkv", "apply_o"):
            if name in vars(cls):
                delattr(cls, name)
    assert reverted is rewritten  # revert leaves the framework's forward, as the class would be without patchkit
    torch.testing.assert_close(got[0], want[0], atol=2e-6, rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, atol=3e-5, rtol=1e-3)


def test_axolotl_lora_kernels_on_a_class_patched_model_equal_unpatched(tmp_path):
    """axolotl's own patch functions (where axolotl installs: it pins its own transformers), LoRA on q/k/v/o with
    its QKV and O kernels (the MLP kernel needs Triton on CUDA): the losses and LoRA gradients equal unpatched."""
    lora_kernels = pytest.importorskip("axolotl.monkeypatch.lora_kernels")
    peft = pytest.importorskip("peft")
    from axolotl.utils.dict import DictDefault

    torch.manual_seed(0)
    any_model("llama").save_pretrained(tmp_path)
    cfg = DictDefault(base_model=str(tmp_path), lora_qkv_kernel=True, lora_o_kernel=True, lora_mlp_kernel=False)
    ids, mask = padded_batch("right")

    def run() -> tuple[torch.Tensor, list]:
        from transformers import AutoModelForCausalLM

        lora_kernels.patch_self_attn_lora(cfg)
        model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").train()
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM",
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        torch.manual_seed(1)  # the adapters' initial weights
        model = lora_kernels.apply_lora_kernel_patches(peft.get_peft_model(model, lora), cfg)
        return train_step(model, ids, mask)

    from transformers.models.llama.modeling_llama import LlamaAttention

    stock = vars(LlamaAttention)["forward"]

    def restore() -> None:
        LlamaAttention.forward = stock
        if hasattr(LlamaAttention, "_original_forward"):
            del LlamaAttention._original_forward

    try:
        want = run()
        restore()
        with patchkit.apply_patch("llama2", backend="sdpa") as handle:
            got = run()
            assert handle.calls == 2 and not handle.stepped_aside
    finally:
        restore()
    torch.testing.assert_close(got[0], want[0], atol=2e-6, rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, atol=3e-5, rtol=1e-3)
