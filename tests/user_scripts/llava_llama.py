"""LLaVA-1.5's model (haotian-liu/LLaVA `llava/model/language_model/llava_llama.py` and `llava_arch.py`, reduced).

`LlavaLlamaForCausalLM` subclasses transformers' LlamaForCausalLM under a model_type of its own, "llava_llama", with
a CLIP vision tower and an MLP projector. Its forward splices the image features in place of each IMAGE_TOKEN_INDEX
(-200) and right-pads the rows itself, handing LLaMA a 2D mask of the caller's dtype (boolean from LLaVA's collator)
and `inputs_embeds`. No patchkit in it.
"""

import torch
import transformers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

IGNORE_INDEX = -100
IMAGE_TOKEN_INDEX = -200
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
              patch_size=7)  # 16 patches: 16 image tokens per image


class LlavaConfig(LlamaConfig):
    model_type = "llava_llama"


class CLIPVisionTower(nn.Module):
    """LLaVA's vision tower: CLIP's penultimate layer, patch features only, run without gradients."""

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.vision_tower = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**config.mm_vision_config))
        self.vision_tower.requires_grad_(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out = self.vision_tower(images, output_hidden_states=True)
        return out.hidden_states[-2][:, 1:].to(images.dtype)  # mm_vision_select_layer -2, select_feature "patch"


class LlavaLlamaModel(LlamaModel):
    config_class = LlavaConfig

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__(config)
        self.vision_tower = CLIPVisionTower(config)
        width = config.mm_vision_config["hidden_size"]
        self.mm_projector = nn.Sequential(nn.Linear(width, config.hidden_size), nn.GELU(),
                                          nn.Linear(config.hidden_size, config.hidden_size))  # mlp2x_gelu


class LlavaLlamaForCausalLM(LlamaForCausalLM):
    config_class = LlavaConfig

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__(config)
        self.model = LlavaLlamaModel(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, images=None, **kwargs):
        if inputs_embeds is None:
            (input_ids, position_ids, attention_mask, past_key_values, inputs_embeds,
             labels) = self.prepare_inputs_labels_for_multimodal(input_ids, position_ids, attention_mask,
                                                                 past_key_values, labels, images)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                               **kwargs)

    def prepare_inputs_labels_for_multimodal(self, input_ids, position_ids, attention_mask, past_key_values, labels,
                                             images):
        """LLaVA's: drop each row's padding, splice the image features in at IMAGE_TOKEN_INDEX, right-pad again."""
        image_features = self.model.mm_projector(self.model.vision_tower(images))
        _labels, _position_ids, _attention_mask = labels, position_ids, attention_mask
        attention_mask = attention_mask.bool()
        labels = torch.full_like(input_ids, IGNORE_INDEX) if labels is None else labels
        input_ids = [ids[mask] for ids, mask in zip(input_ids, attention_mask)]
        labels = [lab[mask] for lab, mask in zip(labels, attention_mask)]
        new_input_embeds, new_labels, image_idx = [], [], 0
        for ids, lab in zip(input_ids, labels):
            cuts = [-1] + torch.where(ids == IMAGE_TOKEN_INDEX)[0].tolist() + [ids.shape[0]]
            text_ids = [ids[cuts[i] + 1 : cuts[i + 1]] for i in range(len(cuts) - 1)]
            text_labels = [lab[cuts[i] + 1 : cuts[i + 1]] for i in range(len(cuts) - 1)]
            embeds = torch.split(self.model.embed_tokens(torch.cat(text_ids)), [len(t) for t in text_ids])
            row_embeds, row_labels = [], []
            for i in range(len(cuts) - 1):
                row_embeds.append(embeds[i])
                row_labels.append(text_labels[i])
                if i < len(cuts) - 2:
                    feature = image_features[image_idx]
                    image_idx += 1
                    row_embeds.append(feature)
                    row_labels.append(torch.full((feature.shape[0],), IGNORE_INDEX, dtype=lab.dtype))
            new_input_embeds.append(torch.cat(row_embeds))
            new_labels.append(torch.cat(row_labels))
        width = max(x.shape[0] for x in new_input_embeds)
        rows = len(new_input_embeds)
        padded_labels = torch.full((rows, width), IGNORE_INDEX, dtype=new_labels[0].dtype)
        attention_mask = torch.zeros((rows, width), dtype=attention_mask.dtype)
        position_ids = torch.zeros((rows, width), dtype=torch.long)
        padded_embeds = []
        for i, (embed, lab) in enumerate(zip(new_input_embeds, new_labels)):
            n = embed.shape[0]
            padded_embeds.append(torch.cat([embed, embed.new_zeros(width - n, embed.shape[1])]))
            padded_labels[i, :n] = lab
            attention_mask[i, :n] = True
            position_ids[i, :n] = torch.arange(n)
        labels = None if _labels is None else padded_labels
        attention_mask = attention_mask.to(dtype=_attention_mask.dtype)
        position_ids = None if _position_ids is None else position_ids
        return None, position_ids, attention_mask, past_key_values, torch.stack(padded_embeds), labels


def tiny_config(**overrides) -> LlavaConfig:
    """A 2-layer GQA LLaMA with a 2-layer CLIP tower (16 image tokens per image)."""
    fields = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0, mm_vision_config=VISION)
    return LlavaConfig(**{**fields, **overrides})
