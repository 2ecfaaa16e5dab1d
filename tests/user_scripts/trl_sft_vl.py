"""A user's TRL SFT script fine-tuning a tiny random Qwen2.5-VL on image conversations: TRL's defaults (gradient
checkpointing on, its vision collator), fp32 on CPU; no patchkit in it. Prints one RESULT line: the per-step losses
and how many attention calls ran through patchkit.
"""

import json
import tempfile

import torch
import transformers
from trl import SFTConfig, SFTTrainer
from vl_data import SPECIALS, VOCAB, conversations, processor

torch.manual_seed(0)
config = transformers.Qwen2_5_VLConfig(
    text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, rope_scaling={"type": "mrope",
                                                                                 "mrope_section": [1, 1, 2]}),
    vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0]),
    vocab_size=VOCAB, pad_token_id=0, image_token_id=SPECIALS["<|image_pad|>"],
    video_token_id=SPECIALS["<|video_pad|>"], vision_start_token_id=SPECIALS["<|vision_start|>"])
model = transformers.Qwen2_5_VLForConditionalGeneration(config)
with tempfile.TemporaryDirectory() as out:
    args = SFTConfig(output_dir=out, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, bf16=False,
                     use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0, max_length=None,
                     dataloader_num_workers=0, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=conversations(patch_size=14),
                         processing_class=processor("qwen2_5_vl", patch_size=14))
    trainer.train()
losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
try:
    import patchkit

    calls = sum(h.calls for h in patchkit.active_patches())
except ImportError:
    calls = 0
print("RESULT " + json.dumps({"losses": losses, "calls": calls}))
