"""Image conversations for the tiny vision-language models, built offline: a word-level tokenizer with a family's
vision tokens, the Qwen VL families' own processor class, and a dozen conversations with one random image each. No
patchkit in it."""

import numpy as np
import torch
import transformers
from datasets import Dataset
from PIL import Image
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

VOCAB = 97
SPECIALS = {"<|image_pad|>": VOCAB - 3, "<|video_pad|>": VOCAB - 2, "<|vision_start|>": VOCAB - 1, "<|vision_end|>": 3}
PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor",
              "qwen3_vl_moe": "Qwen3VLProcessor"}
# A chat template of the Qwen shape, word-level: an image part becomes vision start, image pad, vision end; the
# processor then repeats the image pad once per merged patch.
TEMPLATE = ("{% for m in messages %}{{ m.role }} {% for c in m.content %}{% if c.type == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|> {% else %}{{ c.text }} {% endif %}{% endfor %}</s> "
            "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")
LENGTHS = (3, 9, 5, 12, 4, 7)  # words per user turn; the assistant answers in about half as many
GRID = 4  # each image 4 x 4 patches, merged 2 x 2: 4 image tokens


def word_tokenizer(vocab: int = VOCAB, specials: dict[str, int] = SPECIALS, **options) -> PreTrainedTokenizerFast:
    """Word-level over a tiny model's vocabulary ('<pad>' 0, '<s>' 1, '</s>' 2, 'w3' ...), its vision tokens
    (`specials`, the Qwen ones by default) at the ids its config names; `options` for PreTrainedTokenizerFast."""
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)]
    for token, index in specials.items():
        words[index] = token
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w4"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   **options)


def processor(model_type: str, patch_size: int) -> transformers.ProcessorMixin:
    """The family's own processor class around the PIL image processor (no torchvision here) and no video processor
    (its classes need torchvision; images only)."""
    base = getattr(transformers, PROCESSORS[model_type])

    class ImagesOnly(base):
        def check_argument_for_proper_class(self, name: str, argument: object) -> object:
            if name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(name, argument)

    side = patch_size * GRID
    images = transformers.Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=2, temporal_patch_size=2,
                                                   size={"shortest_edge": side * side, "longest_edge": side * side})
    return ImagesOnly(image_processor=images, tokenizer=word_tokenizer(), chat_template=TEMPLATE)


def conversations(patch_size: int, prompt_completion: bool = False) -> Dataset:
    """A dozen conversations, one random image each, in TRL's "messages" shape or its prompt-completion shape."""
    g = torch.Generator().manual_seed(1)

    def words(n: int) -> str:
        return " ".join(f"w{int(t)}" for t in torch.randint(4, VOCAB - 3, (n,), generator=g))

    side = patch_size * GRID
    images = [[Image.fromarray((torch.rand(side, side, 3, generator=g).numpy() * 255).astype(np.uint8))]
              for _ in LENGTHS]
    users = [[{"role": "user", "content": words(n)}] for n in LENGTHS]
    answers = [[{"role": "assistant", "content": words(n // 2 + 1)}] for n in LENGTHS]
    rows = {"images": images, "prompt": users, "completion": answers} if prompt_completion else \
        {"images": images, "messages": [u + a for u, a in zip(users, answers)]}
    return Dataset.from_dict({k: v * 2 for k, v in rows.items()})
