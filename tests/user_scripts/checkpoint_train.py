"""A user's plain PyTorch loop with gradient checkpointing on (TRL's and LLaMA-Factory's default); no patchkit in it.

FAMILY names the class prefix (Llama, Mistral, Qwen2, ...), REENTRANT=1 asks for reentrant checkpointing. Prints one
RESULT line: the losses of three AdamW steps on a padded batch, and how many attention calls ran through patchkit.
"""

import json
import os

import torch
import transformers

family = os.environ.get("FAMILY", "Llama")
torch.manual_seed(0)
config = getattr(transformers, family + "Config")(
    vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, pad_token_id=0, sliding_window=5, attn_implementation=os.environ.get("ATTN", "sdpa"))
model = getattr(transformers, family + "ForCausalLM")(config).train()
enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
enable({"use_reentrant": os.environ.get("REENTRANT") == "1"})
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
ids = torch.randint(3, 97, (3, 12), generator=g)
mask = torch.ones(3, 12, dtype=torch.long)
mask[1, 8:] = 0
mask[2, 4:] = 0
labels = ids.masked_fill(mask == 0, -100)
losses = []
for _ in range(3):
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
try:
    import patchkit

    calls = sum(h.calls for h in patchkit.active_patches())
except ImportError:
    calls = 0
print("RESULT " + json.dumps({"losses": losses, "calls": calls}))
