"""LoRA on the LM head, fused with the loss under unpad="loss" (the `LowRank` terms of
`forward/loss/linear_cross_entropy.py`, `fused_head.lora`): each adapter's term as PEFT's lora.Linear adds it, and its
dropout kept out of the check."""

from __future__ import annotations

import pytest
import torch
from test_fused_head import (
    TRANSFORMS,
    assert_steps_as_unpatched,
    long_batch,
    loss_alone_steps,
    small_chunks,
    zero3_stand_in,
)
from test_lm_head import family, step
from transformers.loss.loss_utils import ForCausalLMLoss

from patchkit.forward.loss import linear_cross_entropy as lce
from patchkit.forward.loss.linear_cross_entropy import linear_cross_entropy
from patchkit.hooks.head import fused_head, lm_head


def lora_leaves(base: torch.dtype, adapters: torch.dtype, head_trains: bool) -> dict:
    """The rows, a head and two adapters (A, B; the second B with a bias), seeded, in their dtypes."""
    torch.manual_seed(0)
    leaves = dict(hidden=torch.randn(23, 16).to(base), weight=(torch.randn(70, 16) / 2).to(base),
                  a0=(torch.randn(4, 16) / 4).to(adapters), a1=(torch.randn(2, 16) / 4).to(adapters),
                  b0=(torch.randn(70, 4) / 4).to(adapters), b1=(torch.randn(70, 2) / 4).to(adapters),
                  b1_bias=torch.randn(70).to(adapters))
    return {k: t.requires_grad_(k != "weight" or head_trains) for k, t in leaves.items()}


def lora_terms(leaves: dict, adapters: torch.dtype) -> list:
    """Each adapter's term as PEFT's forward makes it: the rows cast to the adapter's dtype, through its A."""
    x = leaves["hidden"].to(adapters)
    return [lce.LowRank(x @ leaves["a0"].t(), leaves["b0"], None, 2.0),
            lce.LowRank(x @ leaves["a1"].t(), leaves["b1"], leaves["b1_bias"], 0.5)]


@pytest.mark.parametrize("dtypes", ["float32", "bfloat16 head, float32 adapters", "bfloat16", "float16"])
@pytest.mark.parametrize("head", ["frozen", "held", "recomputed"])
@pytest.mark.parametrize("weight_of_loss", [1.0, -2.5])
@pytest.mark.parametrize("transform", ["plain", "softcap"])
def test_a_lora_heads_terms_add_to_the_fused_logits_as_peft_adds_them(monkeypatch, dtypes, head, weight_of_loss,
                                                                       transform):
    """A LoRA head: two adapters' terms, `B(A(x)) * scaling` (one B with a bias), added to the head's logits in the
    promoted dtype and cast back, as PEFT's lora.Linear does (adapters in float32 beside a bfloat16 head: PEFT's
    default): the loss and the gradients of the rows, the head, each A and each B equal autograd's through the
    unfused sum (in half precision: within twice its error against float64), the head frozen (LoRA's) or training
    (gradients held or recomputed); the family's transform (Gemma's softcap) on the sum."""
    small_chunks(monkeypatch)
    monkeypatch.setattr(lce, "HOLD_DTYPES", (torch.float32, torch.bfloat16, torch.float16) if head == "held" else ())
    base, adapters = {"float32": (torch.float32,) * 2, "bfloat16": (torch.bfloat16,) * 2,
                      "bfloat16 head, float32 adapters": (torch.bfloat16, torch.float32),
                      "float16": (torch.float16,) * 2}[dtypes]
    labels = torch.randint(0, 70, (23,), generator=torch.Generator().manual_seed(1))
    labels[[2, 9, 10]] = -100

    def unfused(leaves: dict, adapters: torch.dtype) -> torch.Tensor:
        z = torch.nn.functional.linear(leaves["hidden"], leaves["weight"])
        terms = lora_terms(leaves, adapters)
        z = (z + sum(torch.nn.functional.linear(t.rows, t.weight, t.bias) * t.scale for t in terms)).to(z.dtype)
        return ForCausalLMLoss(TRANSFORMS[transform].apply(z)[None], None, 70, shift_labels=labels[None])

    def grads(loss: torch.Tensor, leaves: dict) -> dict:
        names = [k for k, t in leaves.items() if t.requires_grad]
        return dict(zip(names, torch.autograd.grad(loss * weight_of_loss, [leaves[k] for k in names])))

    leaves = lora_leaves(base, adapters, head != "frozen")
    want = unfused(leaves, adapters)
    want_grads = grads(want, leaves)
    got = linear_cross_entropy(leaves["hidden"], leaves["weight"], None, labels, TRANSFORMS[transform],
                               terms=lora_terms(leaves, adapters))
    got_grads = grads(got, leaves)
    truth_leaves = lora_leaves(torch.float64, torch.float64, head != "frozen")
    truth_grads = grads(unfused(truth_leaves, torch.float64), truth_leaves)
    exact = base == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5 if exact else 2e-3)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) == 7 - (head == "frozen")
    for name, w in want_grads.items():
        g = got_grads[name]
        assert g.dtype == w.dtype, name
        if exact:
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4, msg=name)
        else:  # rounded to half precision in another order than autograd's: no further from the truth than it
            truth = truth_grads[name]
            error, theirs = ((t.double() - truth).abs().max() for t in (g, w))
            assert error <= 2 * theirs + 1e-3 * truth.abs().max(), (name, error, theirs)


def test_a_lora_head_with_dropout_is_checked_without_its_masks_and_trains_with_them():
    """LoRA on the head with dropout (0.5 here; 0.05-0.1 in the usual recipes): the checking call's logits draw no
    dropout mask on the family's side nor on the check's (two masks would never agree: the head would never be
    served fused), and the dropouts are on again for the fused loss and after it: every step fused, each loss its own
    masks' (two seeded runs agree, and differ from the loss without dropout)."""
    peft = pytest.importorskip("peft")

    def run(dropout: float, seed: int) -> tuple[list, dict]:
        model = peft.get_peft_model(family("llama"), peft.LoraConfig(
            r=4, target_modules=["q_proj", "lm_head"], lora_dropout=dropout))
        head = model.get_output_embeddings()
        torch.nn.init.normal_(head.lora_B["default"].weight, std=0.5, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(seed)
        got, heads, _ = loss_alone_steps(model, long_batch(model))
        assert head.lora_dropout["default"].training  # on again after the steps
        return [float(loss) for loss, _ in got], heads

    masked, heads = run(0.5, seed=0)
    assert heads == {lm_head.FUSED: 2}
    assert run(0.5, seed=0)[0] == masked and masked != run(0.0, seed=0)[0]
    assert masked[0] != masked[1]  # each step draws its own masks


@pytest.mark.parametrize("adapters", ["float32", "bfloat16"], ids=["gradients in the forward", "in the backward"])
def test_a_lora_head_whose_weights_zero3_gathers_runs_fused_as_their_forwards(adapters):
    """LoRA on the head under DeepSpeed ZeRO-3: the base's, A's and B's weights exist only inside their forwards (and
    backwards). The fused loss runs as the base's forward with each B's forward inside it, so their hooks gather what
    it reads (A runs as a module on the rows): every step fused, with unpatched numbers, and B's weight released
    after each. A float32 model (the gradients written in the forward), or a bfloat16 one whose adapters stay in
    bfloat16 (B's gradient computed in the backward, B gathered again for it)."""
    peft = pytest.importorskip("peft")
    bf16 = adapters == "bfloat16"
    model = family("llama").to(torch.bfloat16 if bf16 else torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
                                autocast_adapter_dtype=not bf16)
    head = model.get_output_embeddings()
    torch.nn.init.normal_(head.lora_B["default"].weight, std=0.5, generator=torch.Generator().manual_seed(1))
    inputs = long_batch(model)
    for module in (head.base_layer, head.lora_A["default"], head.lora_B["default"]):
        zero3_stand_in(module)
    want = step(model, **inputs)
    got, heads, rows = loss_alone_steps(model, inputs)
    assert heads == {lm_head.FUSED: 2} and head.lora_B["default"].weight.numel() == 0
    assert head.lora_B["default"].weight.dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert_steps_as_unpatched(got, want, bf16=bf16)


LORA_KINDS = {  # LoraConfig arguments on top of r 4 on q_proj and lm_head; None: two adapters on the head, both active
    "B with a bias (lora_bias)": {"lora_bias": True},
    "rank-stabilised scaling (use_rslora)": {"use_rslora": True, "lora_alpha": 16},
    "PiSSA's initialisation (the base weight rewritten)": {"init_lora_weights": "pissa"},
    "two adapters active": None,
    "DoRA": {"use_dora": True},
}


@pytest.mark.parametrize("kind", LORA_KINDS)
def test_the_lora_kinds_users_put_on_a_head_train_as_unpatched(kind):
    """What PEFT's LoraConfig offers beside plain LoRA: each kind whose forward is still `base + sum of B(A(x)) *
    scaling` runs fused (the bias of B, rsLoRA's scale, PiSSA's rewritten base, several active adapters, each its own
    term); DoRA (a magnitude vector rescales the logits' columns) keeps the family's own head on the labelled rows.
    Loss and gradients as unpatched either way, B drawn (and its bias) so that each term counts."""
    peft = pytest.importorskip("peft")
    options = LORA_KINDS[kind]

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], **(options or {}))
        model = peft.get_peft_model(family("llama"), config, adapter_name="a")
        if options is None:
            model.add_adapter("b", peft.LoraConfig(r=2, target_modules=["lm_head"]))
            model.base_model.set_adapter(["a", "b"])
        head = model.get_output_embeddings()
        for name, b in head.lora_B.items():
            seeded = torch.Generator().manual_seed(len(name))
            torch.nn.init.normal_(b.weight, std=0.5, generator=seeded)
            if b.bias is not None:
                torch.nn.init.normal_(b.bias, std=0.5, generator=seeded)
        return model

    model = build()
    inputs = long_batch(model)
    want = step(model, **inputs)
    got, heads, _ = loss_alone_steps(build(), inputs)
    assert heads == {lm_head.LOSS_ONLY if kind == "DoRA" else lm_head.FUSED: 2}
    assert sum("lm_head.lora_B" in name for name in want[2]) == (2 if options is None or "lora_bias" in options else 1)
    assert_steps_as_unpatched(got, want)


def fsdp2_unit_stand_in(module: torch.nn.Module) -> None:
    """FSDP2's mark on a unit's module, as `fully_shard` leaves it: hooks from its `_fully_shard` package, by which
    patchkit knows them (they gather nothing here; the real ones: test_fsdp.py)."""
    def pre(*_) -> None:
        return None

    pre.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"
    module.register_forward_pre_hook(pre)


@pytest.mark.parametrize("tuning", ["modules_to_save", "lora on the head"])
def test_a_hook_of_the_users_inside_an_fsdp2_unit_keeps_the_familys_head(tuning):
    """FSDP2 holding PEFT's module of the head as a unit (accelerate's carving) is served fused; a forward hook of the
    user's on the nn.Linear inside it is not FSDP2's and may change the logits: the family's own head runs."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj"] + (["lm_head"] if "lora" in tuning else []),
                             modules_to_save=["lm_head"] if tuning == "modules_to_save" else None)
    model = peft.get_peft_model(family("llama"), config)
    unit = model.get_output_embeddings()
    fsdp2_unit_stand_in(unit)
    inner = unit.modules_to_save["default"] if tuning == "modules_to_save" else unit.base_layer
    assert fused_head.plain_head(model) is not None
    inner.register_forward_hook(lambda module, args, output: output * 2)
    assert fused_head.plain_head(model) is None
