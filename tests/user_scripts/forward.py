"""A user's plain script: build a tiny LLaMA, save it, load it back with --attn, train one padded step.

It knows nothing of patchkit (attention_spy is the tests' instrumentation).
"""

import argparse
import sys
import tempfile

import attention_spy
import torch
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--attn", default=None, help="attn_implementation for from_pretrained (default: transformers')")
parser.add_argument("--set-attn", default=None, help="then model.set_attn_implementation(this), once loaded")
parser.add_argument("--labels-at-padding", action="store_true", help="labels = the tokens, padding included")
args = parser.parse_args()

attention_spy.install()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, pad_token_id=0)
with tempfile.TemporaryDirectory() as path:
    LlamaForCausalLM(config).save_pretrained(path)
    kwargs = {} if args.attn is None else {"attn_implementation": args.attn}
    model = LlamaForCausalLM.from_pretrained(path, **kwargs)
attention_spy.mark("loaded")
if args.set_attn is not None:
    model.set_attn_implementation(args.set_attn)
ids = torch.randint(3, 97, (3, 12))
mask = torch.ones(3, 12, dtype=torch.long)
mask[1, 7:] = 0
mask[2, 9:] = 0
labels = ids if args.labels_at_padding else ids.masked_fill(mask == 0, -100)
loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
loss.backward()
attention_spy.report(impl=model.config._attn_implementation, loss=loss.item(), argv=sys.argv[1:])
