"""Why a forward steps aside to transformers' attention: each cause in full (strict errors) and in brief (warnings)."""

from __future__ import annotations

# cause -> (what the forward asks for, what would keep it patched)
CAUSES = {
    "labels_from_padding": (
        "a label is predicted from a padding position (labels not -100 at padding, or right after left padding), "
        "and transformers computes those positions' logits, which varlen kernels skip",
        "set labels to -100 at padding and at the first real token after left padding (TRL's and transformers' "
        "collators do)",
    ),
    "right_padded_generation": (
        "generate() on a right-padded prompt, or generate() or a hand-written decode loop's prefill into its cache "
        "with a row that is all padding (in generate()'s chunked prefill, prefill_chunk_size, a chunk that is all "
        "padding for a short left-padded row), reads a row's next token from a padding position, which varlen "
        "kernels skip",
        "pad prompts on the left for generation (tokenizer.padding_side = 'left'), and give every row a token; a "
        "chunked prefill's chunks of padding need nothing (they run exact on transformers' attention)",
    ),
    "custom_4d_mask": (
        "the model was given a 4D attention mask (a custom attention pattern; a vision-language model's own masks, "
        "such as Gemma3's, whose image tokens see each other both ways; or one generate() built before the "
        "model ran for a cache patchkit does not place: a static cache before transformers 4.56, or 4.57 on a model "
        "with a sliding window, sliding-window caches), which a key-padding mask cannot "
        "express",
        "pass the 2D [batch, seq] padding mask (and position_ids restarting at 0 for packed documents); a "
        "vision-language model that builds its own masks stays exact on transformers' attention",
    ),
    "static_cache_mask": (
        "generate() built the model's 4D masks for its static cache before the model ran, over cache layers whose "
        "masks patchkit does not read back as a padding mask (Llama 4's chunked attention in a sliding layer, a "
        "hybrid's linear-attention-and-attention layers, a sparse attention's indexed layers: DeepSeek-V3.2's, "
        "GLM-5's)",
        "none needed: such a generate() stays exact on transformers' attention; with the default dynamic cache "
        "(no cache_implementation='static') it runs patched",
    ),
    "bool_mask_on_eager": (
        "a boolean 4D attention mask on a model loaded with attn_implementation='eager', whose attention adds the "
        "mask to the scores (True as +1, False as 0), so it masks nothing; patchkit's kernels would mask",
        "pass the 2D [batch, seq] padding mask, or the 4D mask as additive floats (0 where a key is seen, the "
        "dtype's minimum elsewhere), or load the model with attn_implementation='sdpa', which reads a boolean mask "
        "as a mask",
    ),
    "continuous_batching": (
        "continuous batching (generate_batch(), or generate(cache_implementation='paged')) ran a step that "
        "patchkit's layers do not serve: on a flash attention (no masks: transformers' own varlen kernels serve it), "
        "a decode step read through block tables, a step compiled or captured in a CUDA graph, or one on a "
        "transformers before 5.24, whose attention functions update the paged cache themselves",
        "none needed: continuous batching stays exact on transformers' paged attention; with the model loaded with "
        "attn_implementation='sdpa', no compile and transformers 5.24 or newer, its steps run patched",
    ),
    "bidirectional_image_tokens": (
        "a vision-language model's own masks (Gemma 3's, Gemma 4's, from token_type_ids) let image tokens see each "
        "other both ways in a pattern patchkit's image blocks do not serve: blocks behind a past (a prefill in "
        "chunks), or layer types whose blocks differ otherwise than Gemma 4's (sliding layers only)",
        "none needed for exactness; a prefill in one piece (no prefill_chunk_size) runs its images patched",
    ),
    "window_under_4d_mask": (
        "the model was given a 4D attention mask, which transformers takes as the whole pattern (it applies no "
        "sliding window over it), and a document or row is longer than the model's sliding window, which patchkit's "
        "kernels would apply",
        "pass the 2D [batch, seq] padding mask (and position_ids restarting at 0 for packed documents); transformers "
        "then applies the window too",
    ),
    "window_rolling_cache": (
        "a static, hybrid or sliding-window cache on a model with a sliding window, before transformers 4.56 (whose "
        "caches have no layers that say how their slots are placed): its sliding layers may roll a buffer of the "
        "window's length, which patchkit does not place",
        "use the default dynamic cache, or transformers >= 4.56",
    ),
    "cross_attention": (
        "the decoder was given encoder_hidden_states (cross-attention, a GPT-2 style decoder built with "
        "add_cross_attention), whose layers attend to the encoder's tokens under the encoder's own mask, beside "
        "causal self-attention; patchkit serves decoder-only self-attention",
        "none needed: an encoder-decoder forward stays exact on the attention the model was loaded with",
    ),
    "custom_mask_pattern": (
        "transformers was asked for a mask beyond causal and padding (a bidirectional span, an or_mask_function / "
        "and_mask_function, or block_sequence_ids in no pattern of blocks patchkit serves), which a key-padding "
        "mask cannot express",
        "not possible for this pattern, which needs transformers' attention",
    ),
    "chunk_behind_cache": (
        "chunked attention (Llama 4's attention_chunk_size) where a chunk boundary falls behind the KV cache, at a "
        "packed document's position rather than its first token, or "
        "inside a row with padding between real tokens, which transformers counts and varlen kernels do not",
        "none needed: generation past the first chunk runs on transformers' attention; pad on one side only",
    ),
    "window_over_padding_hole": (
        "a sliding window over a row with padding between real tokens (generate() on a right-padded prompt makes "
        "one): transformers counts the padding columns inside the window, varlen kernels count real tokens only",
        "pad on one side only (left for generation), or pack documents with position_ids and no mask",
    ),
    "named_unseen": (
        "the model got attn_implementation='patchkit' where patchkit could not see it (its config's "
        "_attn_implementation_internal written directly, or the model built before patchkit was imported and then "
        "named by its config field), so patchkit cannot read its calls (whether a label is predicted from padding)",
        "load it with attn_implementation='patchkit', call model.set_attn_implementation('patchkit'), or import "
        "patchkit before building the model",
    ),
    "jit_trace": (
        "torch.jit.trace records the forward: every host read of the batch patchkit's path makes (its rows' lengths, "
        "the splits by them) would become a constant of the trace, which a batch of other lengths would reuse",
        "none needed: the trace runs transformers' attention, as it does unpatched; torch.compile runs patched",
    ),
    "legacy_static_cache": (
        "a static kind of cache (generate(cache_implementation='static'), StaticCache, SlidingWindowCache) on "
        "transformers < 4.48, where patchkit's LLaMA patch replaces the attention forward itself and does not place "
        "the cache's preallocated slots",
        "none needed; the default dynamic cache runs patched, and so does a static cache from transformers 4.48",
    ),
    "functorch_transform": (
        "a torch.func transform (torch.func.grad, vmap, jacrev, functional per-sample gradients) runs the forward: "
        "unpadding reads the mask's lengths on the host, which vmap refuses, and patchkit's fused head-and-loss "
        "function does not take part in the transforms",
        "none needed: the forward runs as transformers' does; outside the transform it runs patched",
    ),
    "unserved_argument": (
        "the forward was given a keyword argument that its layers hand on to the attention function and that "
        "patchkit's varlen attention does not take (a collator's other keys in `model(**batch)`: "
        "special_tokens_mask, length); transformers' own attention ignores it",
        "drop the key from the batch (the Trainer drops what the forward does not name: remove_unused_columns=True) "
        "to run patched",
    ),
    "own_attention_forward": (
        "an attention module's forward is not transformers' own (a subclass's, or one a script set on its class or "
        "on the module, as FastChat's and xformers' old patches do): it may read the (B, S, H) layout and the 4D "
        "mask transformers builds, and need not call the attention function patchkit serves, so it cannot be "
        "handed one packed row of real tokens",
        "none needed: such a forward runs as transformers' does, on its own attention; remove the script's own "
        "attention patch (patchkit replaces it) to run patched",
    ),
    "rows_mixed_by_a_module": (
        "a module in the model computes each row's output from every row it is handed: torch's dynamically quantized "
        "layers (torch.ao.quantization.quantize_dynamic) scale their input by the whole tensor's range, and "
        "bitsandbytes' LLM.int8() layers (load_in_8bit) compute in full precision the columns where any row passes "
        "their outlier threshold, padding's included, so on the real tokens alone they would compute otherwise",
        "none needed: the forward runs as transformers' does; a per-row (per-token) quantization, as torchao's "
        "dynamic activation quantization, runs patched",
    ),
    "contrastive_search": (
        "generate()'s contrastive search (penalty_alpha, top_k; transformers up to 4.56) ranks each candidate by its "
        "cosine similarity to every position's last hidden state of the prompt, padding's included, which varlen "
        "kernels do not compute (a zero vector there gives not a number, and another token)",
        "none needed: its prefill runs on transformers' attention, exact, and its decode steps run patched",
    ),
    "short_mask": (
        "the 2D attention_mask has no column for this forward's new tokens (it is as wide as the cache's past, or "
        "narrower), as a hand-written decode loop gives it when it does not extend the mask; transformers reads the "
        "keys it lacks as padding, where patchkit would have to guess them",
        "extend the mask by a column of ones per new token each step, as generate() does "
        "(torch.cat([mask, mask.new_ones(batch, q_len)], dim=-1))",
    ),
    "quantized_cache": (
        "a forward writes padding into a quantized KV cache (cache_implementation='quantized'), whose scales are "
        "shared across slots and rows (fp8's per tensor, HQQ's and quanto's per group): transformers stores the pad "
        "tokens' keys and values there, which varlen kernels never compute, and they change how every real key is "
        "quantized",
        "none needed: the prefill runs on transformers' attention, exact, and the decode steps run patched; an "
        "unpadded batch runs patched throughout",
    ),
    "mask_shape": (
        "the 2D attention_mask has more rows than the batch or more columns than the keys (past + new tokens; a "
        "mask of another batch, or past columns prepended to a mask that had them), whose first rows and columns "
        "transformers' masks read, where patchkit does not guess which",
        "pass a [batch, past + q_len] mask, one row per sequence and one column per key",
    ),
    "sparse_attention": (
        "a forward of several queries a row, one of which sees more keys than the sparse attention's indexer keeps "
        "(DeepSeek-V3.2's DSA, GLM-5's: config.index_topk; Kolibri-1.1's sink and local keys besides; Qwen4-Exp's "
        "QSA: config.indexer_budget): transformers attends to the top-k keys its indexer scores for each query, "
        "which a varlen kernel over a key-padding mask does not select; queries that see index_topk keys or fewer "
        "keep every key and run patched, and so do decode steps on a growing cache, on the keys the indexer selects",
        "none needed: rows and documents of index_topk tokens or fewer, and generation's decode steps, run patched",
    ),
    "padding_into_mixer": (
        "a row has padding before a real token (left padding) in a model whose recurrent layers or KV compressors "
        "read the padding positions' hidden states (RecurrentGemma's RG-LRU, DeepSeek-V4's compressed entries; for "
        "DeepSeek-V4 also a padded row whose position_ids run past its real tokens): the attention output "
        "transformers computes at that padding flows into the real tokens, and varlen kernels compute none there",
        "pad on the right (a left-padded generate()'s prefill runs on transformers' attention, exact, and its "
        "decode steps run patched)",
    ),
    "joined_documents": (
        "a row's position_ids restart (packed documents) under an attention mask that joins them, with no cache, in "
        "a model whose KV compressors pool by column (DeepSeek-V4): transformers pools their compressed entries "
        "across the documents while each document's rotary positions start again; patchkit's compressors pool each "
        "document alone",
        "pass no attention_mask to keep the documents apart (padding-free, patched), or position_ids that count "
        "through the row to join them",
    ),
    "cache_over_padding": (
        "an eval forward without labels keeps its cache with a row ending in padding, in a model whose cache keeps "
        "KV entries pooled from windows of columns (DeepSeek-V4's compressors): the tokens a loop appends after that "
        "padding see every entry, and those pooled from the padding hold the attention output transformers computes "
        "there, which varlen kernels compute none of",
        "pad prompts on the left, or pass use_cache=False where the cache is not continued",
    ),
    "alibi": (
        "the model's config uses ALiBi (Falcon-RW's alibi=True), a position bias transformers adds to the attention "
        "mask in bfloat16, which no varlen kernel's ALiBi reproduces",
        "none needed: such a model runs on transformers' attention; Falcon's rotary configs run patched",
    ),
    "use_bidirectional_attention": (
        "the model's config sets use_bidirectional_attention (PaliGemma's, an encoder's): its layers are not causal, "
        "and this forward has no mask that says what they attend to (sdpa attends both ways where transformers "
        "skipped it), or one in a pattern patchkit does not read; only transformers' attention reproduces it",
        "none needed: PaliGemma's forwards with their own masks (token_type_ids, or padding) run patched; "
        "apply_patch(model=...) refuses an encoder of its own",
    ),
    "head_outside_patch": (
        "the base model is called by a head patchkit did not wrap: a multimodal model of another modeling module "
        "(LLaVA's around LLaMA's) built before the class patch, or only its language model patched; or a causal "
        "LM whose forward a framework set on the instance before the class patch (accelerate's mixed-precision "
        "wrapper at prepare()). That head reads the logits at every position (labels predicted from padding, "
        "generate()'s next token), which its base model cannot see",
        "apply_patch() before loading the model, or apply_patch(model=...) on the whole model: patchkit then wraps "
        "its head, and its padded batches run patched",
    ),
    "unwrapped_head": (
        "the base model runs under a model with a head of its own that patchkit does not wrap and that does not "
        "generate (ColPali's retrieval head, a user's own), which reads the hidden state at every position, padding "
        "included; varlen attention computes nothing at padding, and such a head may divide by it (ColPali "
        "normalizes each position before it masks padding: 0 / 0 where its projection has no bias)",
        "none needed: a batch without padding runs patched; a head of transformers' task classes, or a causal LM "
        "around the base model, is wrapped",
    ),
    "pooled_at_padding": (
        "a sequence classifier pools a padding position: it reads the last token that is not config.pad_token_id "
        "(the last column under inputs_embeds), and this batch's padding holds other ids (the tokenizer pads with "
        "another token than the config names) or ends a row; transformers computes a hidden state there, which "
        "varlen kernels skip",
        "pad with the token the config names (model.config.pad_token_id = tokenizer.pad_token_id; a multimodal "
        "model's: model.config.get_text_config().pad_token_id), or pad on the left",
    ),
    "choice_at_padding": (
        "a multiple-choice head (GPT-2's DoubleHeadsModel) pools a padding position of a choice: mc_token_ids, or "
        "the last column where it is None; transformers computes a hidden state there, which varlen kernels skip",
        "give mc_token_ids at each choice's last real token, or pad on the left",
    ),
    "softmax_over_padding": (
        "a question-answering loss over a padded batch: its softmax over start and end positions spans every "
        "position, padding included, whose logits transformers computes and varlen kernels skip",
        "none needed for exactness: such a batch runs on transformers' attention; unpadded rows (a batch of one, or "
        "rows of one length) run patched",
    ),
    "unread_cache": (
        "the forward was given `past_key_values`, which this family's forward does not read: it takes its cache as "
        "`cache`, and transformers renames the old name for most families but not this one, so it runs on no past",
        "pass the cache as `cache=` (the forward then reads it, patched)",
    ),
    "output_attentions": (
        "output_attentions=True (on the call or the config) asks for the attention weights, which varlen kernels "
        "never form",
        "leave output_attentions off",
    ),
    "compiled_4d_mask": (
        "a compiled forward was given a 4D mask (generate()'s for a static cache, in the decode steps it compiles by "
        "itself on a GPU or in a model.forward you compiled; or the caller's own, packed documents as a block-diagonal "
        "mask among them), which patchkit reads back as a padding mask only on the host, outside a graph",
        "none needed: it stays exact on transformers' attention; uncompiled (generate(..., disable_compile=True)) or "
        "with the default dynamic cache it runs patched, and packed documents compile patched as position_ids with "
        "no mask",
    ),
    "compiled_fullgraph": (
        "torch.compile(fullgraph=True) traces the model into one graph, whose plan cannot read tensor values",
        "compile without fullgraph=True (the graph breaks at patchkit's host reads, the model stays patched); for a "
        "padded batch with labels, pass packed rows without a mask, or use apply_patch() (which sees the labels)",
    ),
    "untested_transformers": (
        "this transformers is newer than patchkit was tested with, and this family's self-check differed there",
        "use a transformers patchkit was tested with, or a patchkit release that serves this one",
    ),
    "unverified_family": (
        "this family is served from data (no module of its own) and patchkit's census has not verified it; its "
        "self-check on a tiny model of its config differed",
        "load it with attn_implementation='sdpa' or 'eager' (exact), and tell patchkit's maintainers the family",
    ),
    "unchecked_in_graph": (
        "this family must check itself first (a transformers newer than patchkit was tested with, or a family the "
        "census has not verified), and its self-check, which cannot run inside a compiled graph, had not run when "
        "this graph was traced",
        "run one forward uncompiled before the compiled one (the check runs there), or name a transformers you "
        "verified in PATCHKIT_TESTED_TRANSFORMERS",
    ),
}

# cause -> (what, in a few words, as the warning says it; the fix, as short): the long forms above are for strict
# errors, the full table is docs/never-silently-wrong.md#the-causes
BRIEF = {
    "labels_from_padding": ("a label is predicted from a padding position", "-100 at padding and at the first real "
                            "token after left padding"),
    "right_padded_generation": ("generate() on a right-padded prompt, or generate() or a decode loop with a row "
                                "that is all padding (or a chunked prefill's chunk that is), reads a next token at "
                                "padding", "pad prompts on the left; a chunked prefill's chunks need none"),
    "custom_4d_mask": ("a 4D attention mask reached the model (the caller's, or one generate() built for a static "
                       "kind of cache before transformers 4.56)",
                       "pass the 2D padding mask; with generate(), the default dynamic cache runs patched"),
    "static_cache_mask": ("generate()'s 4D masks for a static cache over layers patchkit does not place",
                          "none needed; the default dynamic cache runs patched"),
    "bool_mask_on_eager": ("a boolean 4D mask on eager attention, which adds it to the scores (masks nothing)",
                           "the 2D padding mask, or an additive float 4D mask"),
    "continuous_batching": ("a continuous-batching step on a flash attention, block tables, a compile or a CUDA "
                            "graph", "none needed; loaded with sdpa, its steps run patched"),
    "bidirectional_image_tokens": ("image tokens that see each other both ways behind a past (a chunked "
                                   "prefill), or in a pattern of no image blocks",
                                   "none needed; a prefill in one piece runs patched"),
    "window_under_4d_mask": ("a 4D attention mask on a sliding-window model (transformers applies no sliding "
                             "window over it)", "pass the 2D padding mask"),
    "window_rolling_cache": ("a static or sliding-window cache on a sliding-window model before transformers 4.56",
                             "the dynamic cache, or transformers >= 4.56"),
    "functorch_transform": ("a torch.func transform (grad, vmap, jacrev) runs the forward", "none needed"),
    "jit_trace": ("torch.jit.trace records the forward", "none needed; torch.compile runs patched"),
    "legacy_static_cache": ("a static kind of cache on transformers < 4.48, whose preallocated slots patchkit's "
                            "LLaMA patch there does not place", "none needed; the default dynamic cache runs patched"),
    "unserved_argument": ("the forward was given a keyword argument its layers hand on to attention, which "
                          "transformers' attention ignores and patchkit's does not take (a collator's other keys: "
                          "special_tokens_mask, length)", "drop the key from the batch (or the Trainer's "
                          "remove_unused_columns=True) to run patched"),
    "own_attention_forward": ("an attention module's forward is not transformers' own (a subclass's, a script's "
                              "patch)", "none needed; remove the script's own attention patch to run patched"),
    "rows_mixed_by_a_module": ("a module computes each row from every row it is handed (torch's dynamic "
                               "quantization, bitsandbytes' LLM.int8() outliers)", "none needed"),
    "contrastive_search": ("generate()'s contrastive search ranks its tokens by the prompt's hidden states at "
                           "padding too", "none needed"),
    "cross_attention": ("cross-attention over encoder_hidden_states", "none needed"),
    "custom_mask_pattern": ("a mask beyond causal and padding (a bidirectional span, an or/and mask function)",
                            "none: this pattern needs transformers' attention"),
    "chunk_behind_cache": ("chunked attention: a chunk boundary falls behind the KV cache, off a packed "
                           "document's start, or in a padding hole", "none needed"),
    "window_over_padding_hole": ("a sliding window over a row with a padding hole", "pad on one side only"),
    "named_unseen": ("the model was named 'patchkit' where patchkit could not see it",
                     "attn_implementation='patchkit' at load, or model.set_attn_implementation('patchkit')"),
    "quantized_cache": ("padding written into a quantized KV cache, whose scales it shares with real tokens",
                        "none needed; decode steps and unpadded batches run patched"),
    "mask_shape": ("the 2D attention_mask has more rows than the batch or more columns than the keys",
                   "pass a [batch, past + q_len] mask"),
    "short_mask": ("the 2D attention_mask has no column for the new tokens",
                   "extend the mask by a column of ones per new token"),
    "sparse_attention": ("a forward of several queries a row sees more keys than the sparse attention's index_topk",
                         "none needed; documents of index_topk tokens or fewer, and decode steps, run patched"),
    "padding_into_mixer": ("padding before a real token (left padding, a hole) in a model whose recurrent layers or "
                           "compressors read padding positions",
                           "pad on the right"),
    "joined_documents": ("packed documents joined by the mask, with no cache, in a model whose compressors pool by "
                         "column", "no attention_mask (padding-free)"),
    "cache_over_padding": ("a cache kept over a row ending in padding, in a model whose cache pools padding "
                           "into entries later tokens see", "pad on the left, or pass use_cache=False"),
    "alibi": ("ALiBi (alibi=True), a position bias transformers adds to the attention mask", "none needed"),
    "use_bidirectional_attention": ("attention layers that are not causal (PaliGemma's, an encoder's)",
                                    "none needed"),
    "head_outside_patch": ("a head patchkit did not wrap (a multimodal model's, or a causal LM's forward a framework "
                           "set on the instance before the class patch, accelerate's prepare()) reads every position",
                           "apply_patch() before loading, or apply_patch(model=...) on the whole model"),
    "unwrapped_head": ("a model patchkit does not wrap reads every position's hidden state (ColPali's head)",
                       "none needed"),
    "pooled_at_padding": ("a sequence classifier pools a padding position (padding ids are not "
                          "config.pad_token_id, or inputs_embeds ends a row in padding)",
                          "pad with config.pad_token_id (a multimodal model's text config's), or on the left"),
    "choice_at_padding": ("a multiple-choice head pools a padding position (mc_token_ids, or the last column)",
                          "mc_token_ids at each choice's last real token"),
    "softmax_over_padding": ("a question-answering loss normalises over every position, padding included",
                             "none needed; unpadded rows run patched"),
    "unread_cache": ("`past_key_values`, which this family's forward does not read (it takes `cache`)",
                     "pass the cache as `cache=`"),
    "output_attentions": ("output_attentions=True asks for attention weights", "leave output_attentions off"),
    "compiled_4d_mask": ("a compiled forward given a 4D mask (the caller's, or generate()'s for a static cache)",
                         "none needed; uncompiled, or the dynamic cache, runs patched"),
    "compiled_fullgraph": ("torch.compile(fullgraph=True) of a forward whose plan reads tensor values",
                           "compile without fullgraph=True, or pass packed rows without a mask"),
    "untested_transformers": ("this transformers is newer than patchkit was tested with and the self-check differed",
                              "a tested transformers"),
    "unverified_family": ("a family the census has not verified, whose self-check differed",
                          "attn_implementation='sdpa'"),
    "unchecked_in_graph": ("a family whose self-check had not run when its compiled graph was traced",
                           "one uncompiled forward first"),
}
