"""PEFT LoRA fine-tuning of a tiny random LLaMA through patchkit's varlen attention, FastChat style.

    python examples/lora.py             # 20 steps
    python examples/lora.py --quick     # 3 steps (for tests)

The order is FastChat's train_lora.py with flash attention: patch first, build the model (in bf16, with
`patchkit.dtypes.default_dtype`), wrap it with LoRA, cast norms / lm_head / embed_tokens to the compute dtype
(`patchkit.dtypes.cast_for_training`), then train on a right-padded batch. The model is random (no hub); the
text ships below and is tokenized as bytes. On a machine without a CUDA GPU and flash-attn, the patch runs on
its torch-native sdpa backend (a warning says which gate failed).
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

import patchkit
from patchkit.dtypes import cast_for_training, default_dtype

try:
    import peft
except ImportError:  # pragma: no cover - depends on the environment
    peft = None

PAD, BOS, EOS, OFFSET = 0, 1, 2, 3
TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Padding tokens must never be attended to.",
    "Short rows are padded on the right in training.",
    "LoRA trains small adapters; the base weights stay frozen.",
]
LOSS_TOL = 3e-2  # bf16: patched vs unpatched loss of the same model and batch


def encode(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bytes + BOS/EOS, right-padded: input_ids, attention_mask (1 = real) and labels (-100 on padding)."""
    rows = [[BOS, *(b + OFFSET for b in text.encode()), EOS] for text in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def build_model(dtype: torch.dtype) -> torch.nn.Module:
    """A tiny random LLaMA built directly in `dtype` (ColossalAI's default-dtype practice), GQA 4:2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256 + OFFSET, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )
    torch.manual_seed(0)
    with default_dtype(dtype):
        model = LlamaForCausalLM(config)
    print(f"model built in {next(model.parameters()).dtype}; torch default dtype back to {torch.get_default_dtype()}")
    return model


def add_lora(model: torch.nn.Module) -> torch.nn.Module:
    """LoRA on the attention projections; PEFT keeps the adapter weights in fp32."""
    config = peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"LoRA: {trainable} trainable of {total} parameters")
    return model


def eval_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> float:
    ids, mask, labels = batch
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()


def apply_patch(backend: str, quiet: bool = False) -> patchkit.PatchHandle:
    """Patch LLaMA attention; print a one-line note (not the long warning) when flash-attn cannot run here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        handle = patchkit.apply_patch("llama2", backend=backend)
    failed = [g.name for g in handle.gates if not g.passed]
    if failed and not quiet:
        print(f"patch applied on the {handle.backend} backend (flash_attn gates failed here: {', '.join(failed)})")
    return handle


def train(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], steps: int) -> list[float]:
    ids, mask, labels = batch
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"step {step + 1:3d}/{steps}  loss {loss.item():.4f}")
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--quick", action="store_true", help="3 steps (for tests)")
    parser.add_argument("--backend", default="auto", choices=("auto", "flash_attn", "torch_varlen", "sdpa"))
    args = parser.parse_args(argv)
    if peft is None:
        print("examples/lora.py needs the peft package, which is not installed: pip install peft", file=sys.stderr)
        return 2
    steps = 3 if args.quick else args.steps
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)  # peft/HF
    torch.set_num_threads(min(torch.get_num_threads(), 2))

    handle = apply_patch(args.backend)  # first, as FastChat's train_mem.py does: every LLaMA built now uses it
    model = add_lora(build_model(torch.bfloat16))
    for name, module in model.named_modules():  # what prepare_model_for_kbit_training / keep-in-fp32 leave behind
        if name.endswith("norm"):
            module.float()
    cast = cast_for_training(model)
    short = ", ".join(name.split("model.")[-1] for name in cast)
    print(f"cast_for_training: {len(cast)} modules now {torch.bfloat16}: {short}")
    batch = encode(TEXT)
    print(f"batch: {tuple(batch[0].shape)}, real tokens {int(batch[1].sum())}/{batch[1].numel()} (right padding)")

    patched = eval_loss(model, batch)
    handle.revert()  # one unpatched forward of the same model and batch, for comparison
    unpatched = eval_loss(model, batch)
    handle = apply_patch(args.backend, quiet=True)
    diff = abs(patched - unpatched)
    print(f"initial loss: patched {patched:.4f}, unpatched {unpatched:.4f}, |diff| {diff:.1e} (tol {LOSS_TOL:.0e})")

    losses = train(model, batch, steps)
    layers = handle.check(model)
    print(handle.report())
    ok = diff <= LOSS_TOL and losses[-1] < losses[0] and layers == model.config.num_hidden_layers
    print("lora example: OK" if ok else "lora example: FAILED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
