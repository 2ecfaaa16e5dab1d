"""On a CUDA GPU: the flash_attn, flash_attn_4 and torch_varlen backends against HF eager and the sdpa backend, in bf16.

Every test here is marked `gpu` and skips without CUDA (and, for flash_attn and flash_attn_4, without the package:
the skip names the failed gate, e.g. `import flash_attn.cute failed`); `make gpu-test` runs them all. bf16 is judged
by flash-attn's own rule: no further from the fp32 truth than twice eager bf16's own error, plus a small floor.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import clone, labels_for, padded_batch, tiny_model

import patchkit
from patchkit import gates
from patchkit.backends.choice import backend_gates
from patchkit.hooks.head import lm_head

CUDA = torch.cuda.is_available()
BACKENDS = ["flash_attn", "torch_varlen"]
KERNELS = [*BACKENDS, "flash_attn_4"]  # flash-attn 4 where the tests ask no compiled step or offloaded cache of it


def require(backend: str) -> None:
    """Skip, naming the failed gate, unless `backend` passes every gate on this machine."""
    if not CUDA:
        pytest.skip("needs a CUDA device")
    failed = [g for g in backend_gates(backend, gates.probe_environment(), "2.1", "cache") if not g.passed]
    if failed:
        pytest.skip(f"{backend} not usable here: {failed[0].brief()}")


def gpu_model(kv_heads: int = 2) -> torch.nn.Module:
    """The tiny LLaMA with head_dim 128 (hidden 512, 4 heads), fp32 on the GPU: the truth the bf16 runs are judged
    by. 128 is the head dim of the models of the day, and the one bucket `make gpu-truth`'s flash-attn build keeps."""
    return tiny_model(hidden=512, heads=4, kv_heads=kv_heads).cuda()


def close_to_truth(ours: torch.Tensor, eager: torch.Tensor, truth: torch.Tensor, what: str) -> None:
    err = (ours.float() - truth).abs().max()
    ref = (eager.float() - truth).abs().max()
    assert err <= 2 * ref + 2e-3, f"{what}: error {float(err):.4g} vs eager bf16's {float(ref):.4g}"


def backward_step(model: torch.nn.Module, **inputs) -> tuple[Any, torch.Tensor]:
    """One forward and backward of the model's loss: its output and every gradient, flat, in float32."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def train_step(model: torch.nn.Module, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    out, grads = backward_step(model, **inputs)
    return out.logits.detach().float(), grads


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("backend", KERNELS)
def test_training_step_logits_and_gradients(backend, kv_heads):
    require(backend)
    truth_model = gpu_model(kv_heads).train()
    model = clone(truth_model).to(torch.bfloat16)
    ids, mask = (t.cuda() for t in padded_batch("mixed", seq=48))
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    truth, truth_grads = train_step(truth_model, **inputs)
    eager, eager_grads = train_step(model, **inputs)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        exact, exact_grads = train_step(model, **inputs)
    with patchkit.apply_patch("llama2", backend=backend, strict=True) as handle:
        ours, ours_grads = train_step(model, **inputs)
    assert handle.backend == backend and handle.layers_patched == model.config.num_hidden_layers
    real = mask.bool()
    close_to_truth(ours[real], eager[real], truth[real], "logits")
    close_to_truth(ours_grads, eager_grads, truth_grads, "gradients")
    close_to_truth(exact[real], eager[real], truth[real], "sdpa backend logits")  # the exact backend, same rule


def loss_step(model: torch.nn.Module, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    out, grads = backward_step(model, **inputs)  # under unpad="loss" no logits come back
    return out.loss.detach().float(), grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32],
                         ids=["bf16: gradients in the backward", "fp32: in the forward"])
def test_the_fused_head_and_loss_on_cuda(dtype):
    """unpad="loss" on the GPU: the head fused with the loss from the first step (checked there), the loss and every
    gradient by the rule above, in both of its ways of writing the gradients."""
    truth_model = gpu_model().train()
    model = clone(truth_model).to(dtype)
    ids, mask = (t.cuda() for t in padded_batch("mixed", seq=48))
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    truth, truth_grads = loss_step(truth_model, **inputs)
    eager, eager_grads = loss_step(model, **inputs)
    with patchkit.apply_patch("llama2", backend="sdpa", unpad="loss") as handle:
        steps = [loss_step(model, **inputs) for _ in range(2)]
    assert handle.heads == {lm_head.FUSED: 2}
    for ours, ours_grads in steps:
        close_to_truth(ours, eager, truth, "loss")
        close_to_truth(ours_grads, eager_grads, truth_grads, "gradients")


def same_greedy(ours: torch.Tensor, ref, prompt_len: int, tie: float = 0.125) -> None:
    """Greedy tokens equal the reference's, except after a step where the reference's top two logits were a bf16
    tie (there either token is right, and what follows is not comparable)."""
    for row in range(ours.shape[0]):
        for step, score in enumerate(ref.scores):
            want, got = ref.sequences[row, prompt_len + step], ours[row, prompt_len + step]
            if got != want:
                top = score[row].float().topk(2).values
                assert top[0] - top[1] <= tie, f"row {row} step {step}: {int(got)} != {int(want)}, no tie"
                break


def greedy_as_unpatched(model: torch.nn.Module, backend: str) -> None:
    """Greedy tokens from left-padded prompts, the instance patched on `backend` (strict), as unpatched's."""
    ids, mask = (t.cuda() for t in padded_batch("left", seq=32))
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = model.generate(input_ids=ids, output_scores=True, return_dict_in_generate=True, **kw)
    with patchkit.apply_patch(model=model, backend=backend, strict=True):
        got = model.generate(input_ids=ids, **kw)
    same_greedy(got, ref, ids.shape[1])


@pytest.mark.parametrize("backend", KERNELS)
def test_generation_tokens_match_eager(backend):
    require(backend)
    model = gpu_model().to(torch.bfloat16).eval()
    ids, mask = (t.cuda() for t in padded_batch("left", seq=32))
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    ref = model.generate(input_ids=ids, output_scores=True, return_dict_in_generate=True, **kw)
    with patchkit.apply_patch("llama2", backend=backend, strict=True):
        ours = model.generate(input_ids=ids, **kw)
    same_greedy(ours, ref, ids.shape[1])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "generate-compiled"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_static_cache_generation_tokens_match_eager(backend, compiled):
    """generate(cache_implementation="static"): the prefill packed into the static cache and the decode steps in
    place on it (generate()'s own compilation off), and as generate() runs it unasked on a GPU, the decode steps
    compiled (CUDA graphs) behind the patched prefill: HF eager's greedy tokens either way."""
    require(backend)
    model = gpu_model().to(torch.bfloat16).eval()
    ids, mask = (t.cuda() for t in padded_batch("left", seq=32))
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    ref = model.generate(input_ids=ids, output_scores=True, return_dict_in_generate=True, **kw)
    model.generation_config.disable_compile = not compiled
    with patchkit.apply_patch("llama2", backend=backend, strict=True) as handle:
        ours = model.generate(input_ids=ids, cache_implementation="static", **kw)
    layers = model.config.num_hidden_layers
    assert handle.calls == (layers if compiled else 16 * layers)  # compiled steps are not counted
    same_greedy(ours, ref, ids.shape[1])


@pytest.mark.parametrize("backend", KERNELS)
def test_packed_rows_never_attend_across_documents(backend):
    require(backend)
    truth_model = gpu_model().eval()
    model = clone(truth_model).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, 97, (n,), generator=g).cuda() for n in (17, 40, 9, 30)]
    row = torch.cat(docs).unsqueeze(0)
    positions = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0).cuda()
    with torch.no_grad():
        truth = torch.cat([truth_model(input_ids=d.unsqueeze(0)).logits[0] for d in docs])
        eager = torch.cat([model(input_ids=d.unsqueeze(0)).logits[0] for d in docs])
        with patchkit.apply_patch("llama2", backend=backend, strict=True):
            ours = model(input_ids=row, position_ids=positions).logits[0]
    close_to_truth(ours, eager, truth, "packed logits")


@pytest.mark.gpu
def test_a_decode_steps_metadata_costs_one_host_sync():
    """The lengths come to the host once; the indices are then taken at that known size, without a second sync."""
    if not CUDA:
        pytest.skip("needs a CUDA device")
    import warnings

    from patchkit.forward.masks import build_metadata

    mask = torch.ones(4, 40, dtype=torch.long, device="cuda")
    mask[1, :7] = mask[3, :20] = 0  # left padding: the keys are not dense, the one new token of each row is
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            meta = build_metadata(mask, 4, 1, 40, mask.device)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # torch 2.11 also warns, once, that the debug mode itself is a prototype: that line is no sync
    syncs = [w for w in seen if "synchroniz" in str(w.message) and "prototype" not in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert torch.equal(meta.indices_k, torch.nonzero(mask.reshape(-1)).flatten())


@pytest.mark.gpu
def test_a_head_dim_the_flash_attn_build_lacks_runs_on_sdpa():
    """On a flash-attn built by tools/build_flash_attn.py without some head dims, a model with one of them runs on
    the sdpa backend with a warning (the kernel would refuse it, or crash formatting the refusal); strict refuses."""
    require("flash_attn")
    from patchkit.gates import build_config

    build = build_config()
    if not build.get("head_dims_trimmed"):
        pytest.skip("this flash-attn build has every head dim")
    lacking = next(b for b in build["head_dim_buckets"] if b in build["head_dims_trimmed"])
    model = tiny_model(hidden=lacking * 2, heads=2, kv_heads=2).cuda().to(torch.bfloat16).eval()
    ids, mask = (t.cuda() for t in padded_batch("mixed", seq=48))
    with torch.no_grad():
        with patchkit.apply_patch("llama2", backend="sdpa"):
            exact = model(input_ids=ids, attention_mask=mask).logits
        with patchkit.apply_patch("llama2", backend="flash_attn"):
            with pytest.warns(RuntimeWarning, match=f"no kernels for head_dim {lacking}"):
                ours = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(ours, exact)
        with patchkit.apply_patch("llama2", backend="flash_attn", strict=True):
            with pytest.raises(patchkit.PatchGateError, match="flash_attn_build"):
                model(input_ids=ids, attention_mask=mask)


def windowed_model(model_type: str) -> torch.nn.Module:
    """A 2-layer model with head_dim 128 whose sliding window (5) bites on every test batch: Mistral (window only) or
    Gemma2 (window on layer 0, softcap 3.0 everywhere), fp32 on the GPU."""
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=128, attn_implementation="eager", pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, max_position_embeddings=256, sliding_window=5)
    torch.manual_seed(0)
    if model_type == "gemma2":
        config = tf.Gemma2Config(attn_logit_softcapping=3.0, query_pre_attn_scalar=128, **common)
        return tf.Gemma2ForCausalLM(config).cuda().eval()
    return tf.MistralForCausalLM(tf.MistralConfig(**common)).cuda().eval()


@pytest.mark.parametrize("backend, model_type", [("flash_attn", "gemma2"), ("flash_attn", "mistral"),
                                                 ("torch_varlen", "mistral")])
def test_windows_and_softcap_run_on_the_kernel(backend, model_type):
    """The window and softcap reach the kernel (strict: no per-call fallback), logits and greedy tokens as eager's."""
    require(backend)
    truth_model = windowed_model(model_type)
    model = clone(truth_model).to(torch.bfloat16)
    ids, mask = (t.cuda() for t in padded_batch("mixed", seq=48))
    with torch.no_grad():
        truth = truth_model(input_ids=ids, attention_mask=mask).logits
        eager = model(input_ids=ids, attention_mask=mask).logits.float()
        with patchkit.apply_patch(model_type, backend=backend, strict=True) as handle:
            ours = model(input_ids=ids, attention_mask=mask).logits.float()
    assert handle.backend == backend and handle.calls >= model.config.num_hidden_layers
    real = mask.bool()
    close_to_truth(ours[real], eager[real], truth[real], f"{model_type} logits")
    ids, mask = (t.cuda() for t in padded_batch("left", seq=32))
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = model.generate(input_ids=ids, output_scores=True, return_dict_in_generate=True, **kw)
    with patchkit.apply_patch(model_type, backend=backend, strict=True):
        got = model.generate(input_ids=ids, **kw)
    same_greedy(got, ref, ids.shape[1])


def sinks_model() -> torch.nn.Module:
    """A 2-layer GPT-OSS with head_dim 128: attention sinks on every layer (drawn from N(0, 1), so that they bite), a
    sliding window of 5 on its sliding layers, both experts taken by every token (no routing flip between bf16 and
    fp32), fp32 on the GPU."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GptOssConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=128, num_local_experts=2,
                             num_experts_per_tok=2, sliding_window=5, max_position_embeddings=131072, pad_token_id=0,
                             bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    model = tf.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model.cuda().eval()


def train_and_generate(model_type: str, backend: str) -> None:
    """A bf16 training step of `model_type` (gemma2, gpt_oss) on `backend` (strict: no per-call fallback): logits
    and every gradient (GPT-OSS's sinks' included) within 2x bf16 eager's own error against fp32, as the sdpa
    backend's are; then greedy tokens as eager's."""
    truth_model = (windowed_model("gemma2") if model_type == "gemma2" else sinks_model()).train()
    model = clone(truth_model).to(torch.bfloat16).train()
    ids, mask = (t.cuda() for t in padded_batch("mixed", seq=48))
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    truth, truth_grads = train_step(truth_model, **inputs)
    eager, eager_grads = train_step(model, **inputs)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True):
        exact, exact_grads = train_step(model, **inputs)
    with patchkit.apply_patch(model=model, backend=backend, strict=True) as handle:
        ours, ours_grads = train_step(model, **inputs)
    assert handle.backend == backend and handle.calls >= model.config.num_hidden_layers
    real = mask.bool()
    for what, logits, grads in ((backend, ours, ours_grads), ("sdpa backend", exact, exact_grads)):
        close_to_truth(logits[real], eager[real], truth[real], f"{model_type} {what} logits")
        close_to_truth(grads, eager_grads, truth_grads, f"{model_type} {what} gradients")
    model.eval()
    greedy_as_unpatched(model, backend)


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_flash_attn_4_trains_and_generates_with_windows_softcap_and_sinks(model_type):
    """What only flash-attn 4 takes on the kernel: Gemma2's window and softcap, and GPT-OSS's sinks
    (`learnable_sink`, with their gradient) beside its window; skips without CUDA or without flash-attn 4's
    `flash_attn.cute`, naming the failed gate."""
    require("flash_attn_4")
    train_and_generate(model_type, "flash_attn_4")


@pytest.mark.parametrize("cache", ["offloaded", "offloaded_static"])
@pytest.mark.parametrize("backend", ["sdpa", *BACKENDS])
def test_offloaded_cache_generation_matches_unpatched(backend, cache):
    """generate(cache_implementation="offloaded" / "offloaded_static"), which needs CUDA (each layer's keys and
    values go to the host after use and are prefetched back on a side stream): served through the cache's own
    update, every forward patched (strict). The sdpa backend in fp32 gives unpatched's tokens exactly; the kernel
    backends in bf16, HF eager's up to a bf16 tie."""
    if backend != "sdpa":
        require(backend)
    model = gpu_model().eval()
    if backend != "sdpa":
        model = model.to(torch.bfloat16)
    model.generation_config.disable_compile = True  # count every step's attention calls
    ids, mask = (t.cuda() for t in padded_batch("left", seq=32))
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation=cache)
    ref = model.generate(input_ids=ids, output_scores=True, return_dict_in_generate=True, **kw)
    with patchkit.apply_patch("llama2", backend=backend, strict=True) as handle:
        ours = model.generate(input_ids=ids, **kw)
    assert handle.calls == 12 * model.config.num_hidden_layers and not handle.stepped_aside
    if backend == "sdpa":
        assert torch.equal(ours, ref.sequences)
    else:
        same_greedy(ours, ref, ids.shape[1])


@pytest.mark.parametrize("loaded, backend, model_type", [
    ("flash_attention_2", "flash_attn", "llama"), ("flash_attention_4", "flash_attn_4", "llama"),
    ("flash_attention_4", "flash_attn_4", "gpt_oss"),  # transformers loads GPT-OSS on flash-attn 4, never on 2
])
def test_a_model_loaded_with_transformers_flash_attention_matches_unpatched(loaded, backend, model_type):
    """What GPU scripts load, then patch: transformers' own flash attention, patched on the matching backend. A bf16
    training step's logits and gradients within 2x unpatched flash attention's own error against fp32 eager; a
    packed row under a one-row mask of ones kept apart as transformers' flash attention keeps it (its documents run
    alone in fp32 are the truth); greedy tokens as unpatched's, up to a bf16 tie. The CPU runs the same through
    stand-ins under transformers' integration (tests/test_flash_attention_2_loaded.py, ..._4_loaded.py)."""
    from census import document_logits, packed_rows

    require(backend)
    truth_model = (gpu_model() if model_type == "llama" else sinks_model()).train()
    model = clone(truth_model).to(torch.bfloat16).train()
    model.config._attn_implementation = loaded
    ids, mask = (t.cuda() for t in padded_batch("mixed", seq=48))
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    truth, truth_grads = train_step(truth_model, **inputs)
    theirs, their_grads = train_step(model, **inputs)
    with patchkit.apply_patch(model=model, backend=backend, strict=True) as handle:
        ours, our_grads = train_step(model, **inputs)
    assert handle.backend == backend and handle.calls >= model.config.num_hidden_layers
    real = mask.bool()
    close_to_truth(ours[real], theirs[real], truth[real], f"{model_type} on {loaded}: logits")
    close_to_truth(our_grads, their_grads, truth_grads, f"{model_type} on {loaded}: gradients")

    model.eval()
    row, positions = (t[:1].cuda() for t in packed_rows())
    packed = dict(input_ids=row, position_ids=positions, attention_mask=torch.ones_like(row), use_cache=False)
    with torch.no_grad():
        apart = document_logits(truth_model.eval(), row).float()
        theirs = model(**packed).logits.float()
        with patchkit.apply_patch(model=model, backend=backend, strict=True):
            ours = model(**packed).logits.float()
    close_to_truth(ours, theirs, apart, f"{model_type} on {loaded}: a packed row under a mask of ones")
    greedy_as_unpatched(model, backend)
