"""Which causal LMs run the fused head and loss under unpad="loss": a plain head, checked on the family's own logits.

The fused loss (`forward/loss/linear_cross_entropy.py`) computes the family's logits itself: the head's weight and bias,
then the logit transform its config names (`transform_of`). Nothing of the family's forward runs there, so a family
whose forward does something else to its logits would get another loss. An LM is therefore served fused only after
one of its own training forwards showed, on its first rows and on probe rows (`probes`), that its logits are exactly
those (`check`): until then, and wherever the check failed or the head is not a plain `nn.Linear` (a quantized
head, a head under hooks or with a forward of its own), its own head runs on the labelled rows as before. A family
whose forward runs a module of its own before the head (`PRE_HEADS`) has it run on the rows first.
PEFT's `modules_to_save` copy of the head is a plain one; its trainable tokens (`trainable_token_indices`) over a
plain head are served with their weight as PEFT's forward builds it (`FusedHead.weight`), and LoRA on the head
(`target_modules` naming it, as continued pretraining does) with each active adapter's term (`FusedHead.terms`).

Where hooks hold the head's weight (DeepSpeed ZeRO-3, FSDP2, accelerate's device map: `weight_holders.py`), what
reads it here (the probes, the check, the fused loss) runs as the forward of the module they hold it on (`held`);
under FSDP2, inside the family's own call of that module (`in_its_call`), so that every rank calls it alike.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from patchkit.dtypes import autocast_dtype
from patchkit.forward.inputs.module_hooks import global_hooks, hooked
from patchkit.forward.loss.linear_cross_entropy import LogitTransform, LowRank, linear_cross_entropy, logits_of
from patchkit.hooks.head.weight_holders import (
    accelerate_hooks,
    device_of,
    fsdp2_held,
    fsdp2_holder,
    gathering_hooks,
    held,
    held_weight,
    hooks_of,
    is_linear,
    own_class,
    own_forward,
    zero3_held,
    zero3_partitioned,
)

CHECK_ROWS = 16  # the first labelled rows compared, besides the probes
PROBE_LOGITS = (64.0, 8.0, -8.0, -64.0)  # a probe row's logit at its own token: past any softcap, scale or bias
_checked: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, bool]] = weakref.WeakKeyDictionary()


# transformers' nn.Linear subclasses whose forward runs a vocabulary head in float32: the rows rounded to the weight's
# dtype (where `cast_input_to_weight_dtype`), both operands upcast, no bias, autocast off (Ergo's, 5.25). Served
# fused with those operands (`FusedHead.operands`): the head's own forward writes (n, V) float32 logits and keeps a
# float32 copy of its weight for the backward
FLOAT32_HEADS = frozenset({"ErgoLinearWithFP32Output"})
# transformers' nn.Linear subclasses whose forward multiplies the head's float32 output by a learned (V,) vector: that
# vector as their forward makes it (Dory's, 5.25), fused as the loss's `column_scale`
SCALED_HEADS: dict[str, Callable[[nn.Module], torch.Tensor]] = {
    "DoryLMHead": lambda head: head.logit_scale.float() * head.logit_scale_factor,
}

# causal LMs whose forward runs a module of their own on the hidden rows before the output embeddings: class name ->
# that module's attribute (ModernBERT-decoder's `decoder(lm_head(hidden))`: dense, activation, LayerNorm). The fused
# loss runs it on the labelled rows, as a module (its hooks, its gradients), then the output embeddings
PRE_HEADS = {"ModernBertDecoderForCausalLM": "lm_head"}

# `logits_scaling` divides the logits (Granite's, MiniCPM3's), except in these families, where it multiplies them
SCALING_MULTIPLIES = frozenset({"hyperclovax"})


def transform_of(lm: nn.Module) -> LogitTransform:
    """The logit transform a causal LM's config names, as transformers' forwards apply it: read where they read it,
    the LM's or its base model's attribute (Cohere's `self.logit_scale`, Falcon-H1's `self.model.lm_head_multiplier`,
    copied from the config when built and changeable after), else the config."""
    config = lm.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    base = getattr(lm, getattr(lm, "base_model_prefix", "") or "model", None)

    def read(key: str) -> Any:
        for holder in (lm, base):
            value = getattr(holder, key, None) if isinstance(holder, nn.Module) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return value
        return getattr(text, key, None)

    multiply = next((v for k in ("logit_scale", "lm_head_multiplier", "output_multiplier")
                     if (v := read(k)) is not None), None)
    softcap = next((v for k in ("final_logit_softcapping", "logits_soft_cap")  # RecurrentGemma's
                    if (v := read(k)) is not None), None)
    scaling = read("logits_scaling")
    if scaling is not None and getattr(text, "model_type", None) in SCALING_MULTIPLIES:
        return LogitTransform(multiply=scaling if multiply is None else multiply * scaling, softcap=softcap)
    return LogitTransform(multiply=multiply, divide=scaling, softcap=softcap)


class FusedHead:
    """One call's fused head: the LM's head and transform; `checked`: its logits were found to be these. `linear`: the
    nn.Linear under the head (the head itself, or the base of PEFT's trainable tokens); `hooks`: whose hooks place its
    weight around its forward ("zero3", "fsdp2", "accelerate"), or "" for none; `holder`: the module whose hooks
    those are (`linear`, or under FSDP2 the outermost of the output embeddings' modules a unit holds)."""

    __slots__ = ("lm", "head", "linear", "hooks", "holder", "transform", "key", "checked", "lora", "kind", "pre")

    def __init__(self, lm: nn.Module, head: nn.Module, linear: nn.Linear, hooks: str, transform: LogitTransform,
                 key: tuple, checked: bool, holder: Optional[nn.Module] = None, lora_head: bool = False,
                 pre: Optional[nn.Module] = None) -> None:
        self.lm, self.head, self.linear, self.hooks, self.holder = lm, head, linear, hooks, holder or linear
        self.pre = pre  # the LM's module before its output embeddings (`PRE_HEADS`), else None
        self.transform, self.key, self.checked = transform, key, checked
        self.lora = lora_head  # LoRA on the head: its adapters' terms add to the logits
        self.kind = head_of_its_own(linear)  # a class of FLOAT32_HEADS or SCALED_HEADS, else ""

    @property
    def weight(self) -> torch.Tensor:
        """The head's weight as it is now: accelerate's offloading hooks set a new one on each forward; PEFT's
        trainable tokens write their rows into a copy of the base weight on each forward, as here."""
        if self.head is self.linear or self.lora:
            return self.linear.weight
        return self.head.get_merged_weights(self.head.active_adapters)

    @property
    def bias(self) -> Optional[torch.Tensor]:
        if self.head is self.linear or self.lora:
            return self.linear.bias
        return None  # trainable tokens' F.linear takes no bias

    def head_input(self, rows: torch.Tensor) -> torch.Tensor:
        """The (n, H) hidden rows the base model hands its LM, as they reach the output embeddings: through the LM's
        module before them (`PRE_HEADS`), where it has one."""
        return rows if self.pre is None else self.pre(rows)

    def operands(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(rows, weight, bias) as the head's forward multiplies them: a float32 head's (`FLOAT32_HEADS`) upcast."""
        if self.kind not in FLOAT32_HEADS:
            return rows, self.weight, self.bias
        if getattr(self.linear, "cast_input_to_weight_dtype", False):
            rows = rows.to(self.weight.dtype)
        return rows.float(), self.weight.to(rows.dtype).float(), None

    def computing(self, rows: torch.Tensor) -> contextlib.AbstractContextManager:
        """The context the head's matmul runs in: autocast off for a float32 head, as its forward turns it off."""
        return torch.autocast(rows.device.type, enabled=False) if self.kind in FLOAT32_HEADS else (
            contextlib.nullcontext())

    def column_scale(self) -> Optional[torch.Tensor]:
        """A scaled head's (V,) factor of its float32 output (`SCALED_HEADS`), else None."""
        return SCALED_HEADS[self.kind](self.linear) if self.kind in SCALED_HEADS else None

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The family's logits of the hidden `rows` as the fused loss computes them: the module before the head, the
        head's operands, terms and transform."""
        rows = self.head_input(rows)
        with self.computing(rows):
            return logits_of(*self.operands(rows), self.transform, self.terms(rows), self.column_scale())

    def loss(self, rows: torch.Tensor, labels: torch.Tensor, ignore_index: int, num_items_in_batch: Any
             ) -> torch.Tensor:
        """ForCausalLMLoss's number over the hidden `rows` and their `labels`, from the logits `logits` gives, never
        written whole (`linear_cross_entropy`)."""
        rows = self.head_input(rows)
        with self.computing(rows):
            return linear_cross_entropy(*self.operands(rows), labels, self.transform, ignore_index,
                                        num_items_in_batch, self.terms(rows), self.column_scale())

    def terms(self, rows: torch.Tensor) -> list[LowRank]:
        """A LoRA head's terms of `rows`' logits, as PEFT's lora.Linear forward makes them: for each active adapter,
        the rows cast to its A's dtype (and kept so for the next), through its dropout and its A; its B and scaling.
        Empty for any other head."""
        if not self.lora:
            return []
        head, terms = self.head, []
        for name in head.active_adapters:
            if name in head.lora_A:
                rows = head._cast_input_dtype(rows, head.lora_A[name].weight.dtype)
                b = head.lora_B[name]
                terms.append(LowRank(head.lora_A[name](head.lora_dropout[name](rows)), b.weight, b.bias,
                                     head.scaling[name]))
        return terms

    def adapters(self) -> list[nn.Module]:
        """A LoRA head's active B layers, whose whole weights its terms read (A runs as a module on the rows)."""
        return [self.head.lora_B[name] for name in self.head.active_adapters if name in self.head.lora_A] if (
            self.lora) else []

    def dropouts_off(self) -> Callable[[], None]:
        """Turn a LoRA head's training dropouts off for the checking call (the family's head on the checked rows
        and the check's own logits draw no mask: the same logits; the loss's rows are not among them); returns what
        turns them on again."""
        off = [m for name in (self.head.active_adapters if self.lora else ())
               for m in [self.head.lora_dropout[name]] if isinstance(m, nn.Dropout) and m.training and m.p > 0]
        for m in off:
            m.training = False

        def restore() -> None:
            for m in off:
                m.training = True

        return restore


def saved_copy(head: Optional[nn.Module]) -> Optional[nn.Module]:
    """The head that runs: PEFT's `modules_to_save` wrapper (a LoRA run that trains the head too, as adding tokens
    needs) runs its one active adapter's copy of the head, which is then the head; its `trainable_token_indices`
    wrapper runs its token adapter (`trainable_tokens`)."""
    if type(head).__name__ == "TrainableTokensWrapper" and isinstance(getattr(head, "token_adapter", None), nn.Module):
        plain = "forward" not in vars(head) and not hooked(head)
        return head.token_adapter if plain else head
    copies = getattr(head, "modules_to_save", None)
    if own_class(head).__name__ != "ModulesToSaveWrapper" or not isinstance(copies, nn.ModuleDict):
        return head
    active = getattr(head, "active_adapters", None)
    others = not gathering_hooks(head)  # ZeRO-3's hold no weight; FSDP2's gather the copy's (`fsdp2_holder`)
    if getattr(head, "disable_adapters", True) or others or not (
            isinstance(active, list) and len(active) == 1 and active[0] in copies):
        return head  # the original head, several adapters or hooks: not one plain head
    return copies[active[0]]


class HeadParts(NamedTuple):
    """A `plain_head`'s parts: the head that runs, its nn.Linear (itself, or the base of trainable tokens or of LoRA),
    whether it is LoRA, and under FSDP2 the module whose unit holds its weight (`fsdp2_holder`), else None."""
    head: nn.Module
    linear: nn.Linear
    lora: bool
    holder: Optional[nn.Module]


def head_parts(lm: nn.Module) -> Optional[HeadParts]:
    """The LM's output embeddings where they are a plain nn.Linear whose weight the fused loss can read as it is, or
    PEFT's trainable tokens or LoRA over one (`trainable_tokens`, `lora`), with their parts; else None."""
    outer = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    head = saved_copy(outer)
    is_lora = lora(head)
    linear = head.base_layer if is_lora or trainable_tokens(head) else head
    own = head_of_its_own(linear)
    if own and linear is not head:
        return None  # PEFT's layers over such a head: their sum is not served
    if not (is_linear(linear) or own) or ("forward" in vars(linear) and not (
            own_forward(linear, vars(linear)["forward"]) or accelerate_hooks(linear))):
        return None
    if next(global_hooks(), None) is not None:  # a hook on every module: on the head too
        return None
    holder = fsdp2_holder(outer, head, linear)  # a DTensor outside its unit's forward, inside one
    weight = held_weight(linear)
    if torch.nn.utils.parametrize.is_parametrized(linear) or type(weight) not in (
            nn.Parameter, torch.Tensor) and (holder is None or type(weight).__name__ != "DTensor"):
        return None  # a tensor subclass (quantized, DTensor); a plain tensor is FSDP1's view of its gathered weight
    if linear is not head and hooks_of(linear) and not is_lora:
        return None  # trainable tokens over a head whose weight hooks place
    if hooked(linear):
        plain = zero3_held(linear) and len(getattr(weight, "ds_shape", ())) == 2 or (
            fsdp2_held(linear) and weight.dim() == 2)  # its own hooks, FSDP2's alone
    else:
        plain = weight.dim() == 2 and weight.numel() > 0
    return HeadParts(head, linear, is_lora, holder) if plain else None


def head_of_its_own(module: nn.Module) -> str:
    """The class name of one of transformers' vocabulary heads served with a forward of its own (`FLOAT32_HEADS`,
    `SCALED_HEADS`), straight over nn.Linear; else ""."""
    cls = own_class(module)
    known = (cls.__name__ in FLOAT32_HEADS or cls.__name__ in SCALED_HEADS) and cls.__bases__ == (nn.Linear,)
    return cls.__name__ if known and cls.__module__.startswith("transformers.") else ""


def plain_head(lm: nn.Module) -> Optional[nn.Module]:
    """The head of `head_parts`, or None."""
    parts = head_parts(lm)
    return None if parts is None else parts.head


def trainable_tokens(head: Optional[nn.Module]) -> bool:
    """`head` is PEFT's trainable tokens (`trainable_token_indices`: new tokens' rows trained, as when a chat template
    adds tokens; tied to the embeddings' where those are) over an nn.Linear, active and unmerged, with nothing of its
    own around it: its forward is `F.linear(x, base weight with the tokens' rows written in)`, no bias."""
    if type(head).__name__ != "TrainableTokensLayer" or not type(head).__module__.startswith("peft."):
        return False
    active = getattr(head, "active_adapters", None)
    return (not getattr(head, "disable_adapters", True) and not getattr(head, "merged", True)
            and isinstance(active, list) and len(active) > 0 and callable(getattr(head, "get_merged_weights", None))
            and isinstance(getattr(head, "base_layer", None), nn.Linear) and "forward" not in vars(head)
            and not hooked(head))


def lora(head: Optional[nn.Module]) -> bool:
    """`head` is PEFT's LoRA layer over an nn.Linear, active and unmerged, each active adapter plain LoRA (no DoRA or
    other variant), its A and B plain nn.Linear and its dropout torch's, nothing of anyone's own on any of them
    (ZeRO-3's hooks, on all of base and B or none, only gather): its forward is the base layer's logits plus each
    adapter's `lora_B(lora_A(dropout(x))) * scaling`."""
    if own_class(head).__name__ != "Linear" or not own_class(head).__module__.startswith("peft.tuners.lora"):
        return False
    active = getattr(head, "active_adapters", None)
    if (getattr(head, "disable_adapters", True) or getattr(head, "merged", True) or getattr(head, "fan_in_fan_out", 1)
            or not isinstance(active, list) or not active or not isinstance(getattr(head, "base_layer", None),
                                                                               nn.Linear)
            or not callable(getattr(head, "_cast_input_dtype", None))):  # PEFT before it added in the base's dtype
        return False
    names = [a for a in active if a in getattr(head, "lora_A", {})]
    if not names or any(a in getattr(head, "lora_variant", {}) or getattr(head, "use_dora", {}).get(a) for a in names):
        return False
    parts = [head] + [m for a in names for m in (head.lora_A[a], head.lora_B[a], head.lora_dropout[a])]
    return all(type(m) in (nn.Linear, nn.Dropout, nn.Identity) for m in parts[1:]) and all(
        "forward" not in vars(m) and gathering_hooks(m) for m in parts) and all(
        isinstance(head.scaling.get(a), (int, float)) for a in names) and (
        zero3_partitioned(head.base_layer) == all(zero3_partitioned(head.lora_B[a]) for a in names))


def fused_head(lm: nn.Module) -> Optional[FusedHead]:
    """This call's fused head (checked, or to be checked on this call), or None: the LM's own head runs."""
    parts = head_parts(lm)
    if parts is None:
        return None
    head, linear, is_lora, holder = parts
    hooks = "fsdp2" if holder is not None else hooks_of(linear)
    autocast = autocast_dtype(device_of(linear, hooks).type)
    transform = transform_of(lm)
    pre = pre_head(lm)
    adapters = tuple(getattr(head, "active_adapters", ()))
    key = (id(head), held_weight(linear).dtype, autocast, transform, adapters, id(pre))
    seen = _checked.get(lm)
    if seen is not None and seen[0] == key and not seen[1]:
        return None  # its logits were not these: its own head, from now on
    return FusedHead(lm, head, linear, hooks, transform, key, checked=seen is not None and seen[0] == key,
                     holder=holder, lora_head=is_lora, pre=pre)


def pre_head(lm: nn.Module) -> Optional[nn.Module]:
    """The LM's module before its output embeddings (`PRE_HEADS`, by the class whose forward it runs), or None (the
    check then finds whether its logits are the head's alone)."""
    name = next((PRE_HEADS[c.__name__] for c in type(lm).__mro__ if c.__name__ in PRE_HEADS), None)
    module = getattr(lm, name, None) if name is not None else None
    return module if isinstance(module, nn.Module) else None


def probes(weight: torch.Tensor) -> torch.Tensor:
    """(k, H) hidden rows whose logit at token i is PROBE_LOGITS[i] before the transform: rows the family's head
    and transform run beside the real ones on the checking call, so that a transform the config does not name
    shows even where the real rows' logits are still small (a softcap at 30 is near the identity below 3). They
    are labelled -100: no loss term, no gradient."""
    w = weight.detach()[: len(PROBE_LOGITS)].float()
    wanted = torch.tensor(PROBE_LOGITS[: w.shape[0]], device=w.device)
    return (w * (wanted / w.square().sum(1).clamp(min=1e-12))[:, None]).to(weight.dtype)


def probed(hidden: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    """The (1, k, H) `hidden` rows handed on the checking call with their last rows (placeholders) made the (n, H)
    `probe` rows: in the head's own call, where hooks gather its weight only there (FSDP2: `in_its_call`)."""
    return torch.cat([hidden[:, : -probe.shape[0]], probe.to(hidden.device, hidden.dtype)[None]], 1)


def checked_rows(hidden: torch.Tensor, labelled: int, n: int) -> torch.Tensor:
    """The rows of the checking call's (1, k, H) `hidden` that the check compares: the first of its `labelled` rows
    and the `n` probes (the last rows)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    first = min(CHECK_ROWS, labelled)
    return torch.cat([torch.arange(first), torch.arange(flat.shape[0] - n, flat.shape[0])]).to(flat.device)


def check(fused: FusedHead, logits: torch.Tensor, hidden: torch.Tensor, labelled: int, n: int,
          ours: Optional[torch.Tensor] = None) -> bool:
    """Compare the family's `logits` of the `hidden` rows handed to it, at the first of its `labelled` rows and at
    the `n` probes (the last rows), with the fused loss's (`ours`, where its own call of the head computed them);
    remember and return whether they are the same."""
    try:
        with torch.no_grad():
            flat_h, flat_l = hidden.reshape(-1, hidden.shape[-1]), logits.reshape(-1, logits.shape[-1])
            pick = checked_rows(hidden, labelled, n)
            ours = held(fused, fused.logits, flat_h[pick]) if ours is None else ours
            theirs = flat_l[pick]
            tol = 1e-5 if theirs.dtype == torch.float32 and ours.dtype == torch.float32 else 1e-2  # 2-3 ulps
            scale = max(1.0, float(theirs.float().abs().max()))
            same = n > 0 and flat_h.shape[0] == flat_l.shape[0] and ours.shape == theirs.shape and (
                float((ours.float() - theirs.float()).abs().max()) <= tol * scale)
    except (RuntimeError, ValueError, IndexError):  # shapes or dtypes that do not meet: not these logits
        same = False
    _checked[fused.lm] = (fused.key, same)
    return same
