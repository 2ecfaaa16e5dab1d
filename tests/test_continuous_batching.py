"""Continuous batching (`generate_batch()`, `generate(cache_implementation="paged")`) runs patched: its requests are
packed documents, their lengths the varlen metadata, its 4D mask checked before it is trusted; generated tokens and
their log-probabilities equal the unpatched run's."""

from __future__ import annotations

import gc
import importlib
import logging
import warnings
import weakref
from unittest import mock

import pytest
import torch
import transformers
from families import FAMILIES, WINDOWED, any_model, set_attention
from models import CACHE

import patchkit
from patchkit.errors import PatchkitError

cb_config = getattr(transformers, "ContinuousBatchingConfig", None)
pytestmark = pytest.mark.skipif(cb_config is None or not hasattr(transformers.GenerationMixin, "generate_batch"),
                                reason="continuous batching with its own config: transformers 5.x")

# From transformers 5.24 a layer updates the paged cache itself (its `cache` argument) and hands attention every
# request's keys: patchkit serves the steps. Before, the cache went beside, to transformers' attention functions, which
# updated it themselves: each step steps aside, exact (a 4D mask of no past was once served as packed documents there,
# and the cache was never written).
SERVED = CACHE == "cache"
PROMPT_LENGTHS = (3, 17, 9, 30, 1, 12)  # longer than the window (5) and than a step's token budget: chunked prefill
NEW_TOKENS = 6


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def batch_run(model: torch.nn.Module, budget: int = 16) -> list[tuple[list[int], list[float]]]:
    """Each request's (generated tokens, their log-probabilities): steps of at most `budget` tokens, so prompts are
    prefilled in chunks behind their own past, beside other requests' decode tokens."""
    generation = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                                               pad_token_id=0)
    config = cb_config(num_blocks=32, max_batch_tokens=budget, return_logprobs=True)
    # its manager collects garbage twice a call, seconds in a test process that has made hundreds of models (the
    # census's workers): no number depends on it
    with warnings.catch_warnings(), mock.patch.object(gc, "collect", lambda *_: 0):
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate_batch(inputs=prompts(), generation_config=generation, continuous_batching_config=config,
                                   progress_bar=False)
    results = sorted(out.values(), key=lambda o: int(o.request_id.split("_")[-1]))
    assert len(results) == len(PROMPT_LENGTHS), "requests missing from the results (its log says why)"
    assert all(o.error is None for o in results), [o.error for o in results]
    return [(o.generated_tokens, o.logprobs) for o in results]


def started_manager(model: torch.nn.Module) -> object:
    """A continuous-batching manager of `model`, started, as `transformers serve` keeps one: greedy, steps of at most 16
    tokens."""
    manager = model.init_continuous_batching(
        generation_config=transformers.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0),
        continuous_batching_config=cb_config(num_blocks=32, max_batch_tokens=16))
    manager.start()
    return manager


def assert_patched(aside: dict, calls: int) -> None:
    """Every step through patchkit's layers; before transformers 5.24, every step stepped aside."""
    if SERVED:
        assert not aside and calls > 0
    else:
        assert set(aside) == {"continuous_batching"} and aside["continuous_batching"] > 0


def assert_same_requests(got: list, want: list, atol: float = 1e-5) -> None:
    assert len(got) == len(want) == len(PROMPT_LENGTHS)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens and len(tokens) == NEW_TOKENS
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=atol, rtol=0)


def model_for(family: str) -> torch.nn.Module:
    """The family's test model (`families.py`), else the census's tiny one (`census.py`), on sdpa where it has it
    (GPT-OSS has none: eager, which continuous batching runs as "paged|eager"), in eval."""
    if family == "llama" or family in FAMILIES:
        return any_model(family, "sdpa")
    from census import tiny_lm

    model, why = tiny_lm(family)
    if model is None:
        pytest.skip(why)
    try:
        return set_attention(model.eval(), "sdpa")
    except ValueError:
        return model


# beside the families' own: GPT-OSS's sinks, Gemma 3n's layers that read another layer's keys, multi-head latent
# attention's narrower values (DeepSeek-V3)
MORE = ["gpt_oss", "gemma3n_text", "deepseek_v3"]


@pytest.mark.parametrize("family", ["llama", *FAMILIES, *MORE])
def test_every_family_runs_continuous_batching_patched_as_unpatched(family: str) -> None:
    """Every step through patchkit's layers (prefill chunks behind a past, decode tokens, both in one step; sliding
    windows that bite, Gemma's two layer types, GPT-OSS's sinks), none stepped aside, the unpatched tokens."""
    model = model_for(family)
    try:
        want = batch_run(model)
    except Exception as unpatched:  # noqa: BLE001 - transformers' own (DeepSeek-V3's cache in 5.24, VL configs)
        pytest.skip(f"continuous batching does not run {family} unpatched here: {str(unpatched)[:160]}")
    with patchkit.apply_patch(backend="sdpa") as group:
        got = batch_run(model)
        aside, calls = dict(group.stepped_aside), group.calls
    assert_same_requests(got, want)
    assert_patched(aside, calls)
    if family in WINDOWED:  # the window bites: a prompt of 30 tokens against a window of 5
        assert max(PROMPT_LENGTHS) > model.config.sliding_window


def test_generate_with_a_paged_cache_runs_patched_as_unpatched() -> None:
    """generate(cache_implementation="paged") on a left-padded batch: continuous batching under generate()."""
    from models import padded_batch

    model = any_model("llama", "sdpa")
    ids, mask = padded_batch("left", batch=3, seq=14)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None,
              cache_implementation="paged", continuous_batching_config=cb_config(num_blocks=16, max_batch_tokens=64))
    want = model.generate(input_ids=ids, **kw)
    with patchkit.apply_patch(backend="sdpa") as group:
        got = model.generate(input_ids=ids, **kw)
        aside, calls = dict(group.stepped_aside), group.calls
    assert torch.equal(got, want) and got.shape[-1] > ids.shape[-1]
    assert_patched(aside, calls)


@pytest.mark.parametrize("family, attn", [("qwen2", "sdpa"), ("llama", "eager")])
def test_an_instance_patch_serves_continuous_batching(family: str, attn: str) -> None:
    """An instance patch too; on an eager model, which continuous batching switches to "paged|eager" for its steps
    (transformers' own switch, not a change of the user's the patch would refuse)."""
    model = any_model(family, attn)
    want = batch_run(model)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = batch_run(model)
        assert_patched(dict(handle.stepped_aside), handle.calls)
    assert_same_requests(got, want)
    assert model.config._attn_implementation == attn


def test_the_manager_transformers_serve_runs_serves_its_requests_patched() -> None:
    """`transformers serve` keeps a manager (`init_continuous_batching()`) and adds requests to it as they come:
    the same steps, patched, each request's tokens as generate_batch() gives them unpatched."""
    model = any_model("mistral", "sdpa")
    want = [tokens for tokens, _ in batch_run(model)]
    with patchkit.apply_patch(backend="sdpa") as group:
        manager = started_manager(model)
        try:
            ids = [manager.add_request(prompt, max_new_tokens=NEW_TOKENS) for prompt in prompts()]
            results = {}
            while len(results) < len(ids):
                out = manager.get_result(timeout=60)
                assert out is not None and out.error is None
                if out.is_finished():
                    results[out.request_id] = out.generated_tokens
        finally:
            manager.stop(block=True)
        aside, calls = dict(group.stepped_aside), group.calls
    assert [results[i] for i in ids] == want
    assert_patched(aside, calls)


def test_a_step_with_no_masks_block_tables_or_a_compile_steps_aside() -> None:
    """What patchkit's layers do not serve: a step on a flash attention (no masks: transformers' varlen kernels
    run it), a decode step read through block tables, a step being compiled, a cache handed beside the layers."""

    from patchkit.hooks.decide import step_aside

    class PagedAttentionCache:  # continuous batching's, by its name
        pass

    mask, cache = torch.zeros(1, 1, 3, 9), PagedAttentionCache()
    assert step_aside.paged_servable({"attention_mask": mask, "cache": cache}, {"block_table": None})
    assert step_aside.paged_servable({"attention_mask": {"full_attention": mask, "sliding_attention": mask},
                                      "cache": cache}, {})
    assert not step_aside.paged_servable({"attention_mask": None, "cache": cache}, {})
    assert not step_aside.paged_servable({"attention_mask": mask, "cache": cache}, {"block_table": torch.zeros(1, 2)})
    # transformers before 5.24: the cache goes beside, to attention functions that update it themselves
    assert not step_aside.paged_servable({"attention_mask": mask, "past_key_values": None}, {"cache": cache})
    with mock.patch.object(step_aside, "is_compiling", return_value=True):
        assert not step_aside.paged_servable({"attention_mask": mask, "cache": cache}, {})


def full_request_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Continuous batching's mask builder made to let every query see all its request's keys, later ones too."""
    module = importlib.import_module("transformers.generation.continuous_batching.input_outputs")
    original = module.build_attention_mask

    def build(attention_mask: torch.Tensor, cumulative_seqlens_q: list, cumulative_seqlens_k: list,
              sliding_window: int = 1) -> None:
        original(attention_mask, cumulative_seqlens_q, cumulative_seqlens_k, sliding_window)
        for i in range(len(cumulative_seqlens_q) - 1):
            block = attention_mask[..., cumulative_seqlens_q[i]:cumulative_seqlens_q[i + 1],
                                   cumulative_seqlens_k[i]:cumulative_seqlens_k[i + 1]]
            block.zero_()

    monkeypatch.setattr(module, "build_attention_mask", build)


def test_a_mask_other_than_the_requests_lengths_say_steps_aside_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mask that is not the causal pattern of the requests' lengths (here, made to see later keys) is what
    transformers' attention runs; patchkit's kernels would not: that step steps aside, named and counted."""
    full_request_masks(monkeypatch)
    model = any_model("llama", "sdpa")
    want = batch_run(model)
    with patchkit.apply_patch(backend="sdpa") as group, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = batch_run(model)
        aside, calls = dict(group.stepped_aside), group.calls
    assert_same_requests(got, want)
    # the prefill steps: a decode token sees every key of its request under either mask, and is served
    assert set(aside) == {"continuous_batching"} and 0 < aside["continuous_batching"]
    assert not SERVED or (calls > 0 and any("causal pattern its per-request lengths" in str(w.message)
                                            for w in caught))


def test_strict_refuses_such_a_mask_in_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """strict=True refuses that step in continuous batching's worker thread, whose loop logs and swallows every
    exception (the prompts came back with no new tokens): the refusal reaches the caller, and the next call and a
    revert find transformers' continuous batching as it was."""
    continuous_batching = importlib.import_module("transformers.generation.continuous_batching")
    original = vars(continuous_batching.ContinuousMixin)["generate_batch"]
    full_request_masks(monkeypatch)
    model = any_model("llama", "sdpa")
    want = batch_run(model)
    with patchkit.apply_patch("llama2", backend="sdpa", strict=True) as handle:
        with pytest.raises(PatchkitError, match="strict=True.*" + ("per-request lengths" if SERVED else "batching")):
            batch_run(model)
        handle.revert()
    assert vars(continuous_batching.ContinuousMixin)["generate_batch"] is original
    assert_same_requests(batch_run(model), want)


def test_a_refusal_no_generate_batch_reads_keeps_no_model_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager polled directly (`transformers serve`'s way) whose steps strict=True refused: its requests come back
    with the error, and once the model is dropped it is freed. The refusal kept for generate_batch held the worker's
    traceback, whose frames hold the model, which kept it alive for the process (GPU memory, on a server)."""
    full_request_masks(monkeypatch)

    def served_and_dropped() -> weakref.ref:
        model = any_model("llama", "sdpa")
        with patchkit.apply_patch("llama2", backend="sdpa", strict=True):
            manager = started_manager(model)
            try:
                ids = [manager.add_request(prompt, max_new_tokens=NEW_TOKENS) for prompt in prompts()]
                errors = [manager.get_result(timeout=60).error for _ in ids]
            finally:
                manager.stop(block=True)
        assert errors and all(errors)  # each step refused (before 5.24, as a step that steps aside)
        return weakref.ref(model)

    logging.disable(logging.CRITICAL)  # the worker logs each error with its traceback, which pytest's capture keeps
    try:
        model = served_and_dropped()
    finally:
        logging.disable(logging.NOTSET)
    gc.collect()
    assert model() is None


def test_the_registered_name_alone_runs_continuous_batching_patched() -> None:
    """A model loaded with attn_implementation="patchkit": transformers' continuous batching refused the name
    (`Implementation patchkit is not supported for continuous batching`); it keeps it now, and patchkit's attention
    serves every step from the requests' lengths, and says nothing of packed documents: its own masks keep its
    requests apart too."""
    from patchkit.forward import documents
    from patchkit.hooks.name import attention_interface

    model = any_model("mistral", "sdpa")
    want = batch_run(model)
    model.set_attn_implementation("patchkit")
    if not SERVED:  # its attention functions update the cache, which patchkit's does not: transformers' refusal
        with pytest.raises(ValueError, match="not supported"):
            batch_run(model)
        return
    state = attention_interface.route_state()
    calls, aside = state.calls, dict(state.stepped_aside)
    with mock.patch.object(documents, "_said", set()), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = batch_run(model)
    assert not [w for w in said if "kept apart" in str(w.message)]
    assert_same_requests(got, want)
    assert state.calls > calls and dict(state.stepped_aside) == aside
    assert model.config._attn_implementation == "patchkit"


@pytest.mark.parametrize("backend", ["flash_attn", "flash_attn_4", "torch_varlen"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_continuous_batching_on_the_kernel_backends(family: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model on each kernel backend (its recording double, `fakes.py`): the steps reach the kernel with the
    requests' cumulative lengths (queries one per request in a decode step, keys its whole past), and give the
    tokens of patchkit's exact backend."""
    from test_kernel_census import DOUBLES

    if not SERVED:
        pytest.skip("before transformers 5.24 continuous batching's steps step aside")
    model = any_model(family, "sdpa").to(torch.bfloat16)
    with patchkit.apply_patch(model=model, backend="sdpa"):
        want = batch_run(model)
    fake = DOUBLES[backend](monkeypatch)
    with patchkit.apply_patch(model=model) as handle:
        got = batch_run(model)
        assert handle.backend in (backend, "flash_attn") and not handle.stepped_aside
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    calls = [c for c in fake.calls if c.get("cu_q") is not None]
    assert calls, "no varlen kernel call"
    lengths = [(torch.tensor(c["cu_q"]).diff().tolist(), torch.tensor(c["cu_k"]).diff().tolist()) for c in calls]
    # a step of next tokens (a query per request, behind its past) and one with a prompt's chunk behind its past
    assert any(set(q) == {1} and len(q) > 1 and all(k > 1 for k in ks) for q, ks in lengths)
    assert any(any(1 < q < k for q, k in zip(qs, ks)) for qs, ks in lengths)


def test_a_layer_with_no_lengths_to_read_runs_the_loaded_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer call whose key lengths patchkit cannot tell (a layer type it finds no lengths for) runs the attention
    the model was loaded with over continuous batching's own mask, exact, named and counted once per step."""
    from patchkit.hooks.attention import paged

    if not SERVED:
        pytest.skip("before transformers 5.24 continuous batching's steps step aside whole")
    model = any_model("qwen2", "sdpa")
    want = batch_run(model)
    monkeypatch.setattr(paged, "paged_lengths", lambda module, kwargs: None)
    with patchkit.apply_patch(backend="sdpa") as group, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = batch_run(model)
        aside = dict(group.stepped_aside)
    assert_same_requests(got, want)
    assert set(aside) == {"continuous_batching"} and aside["continuous_batching"] >= NEW_TOKENS
    assert any("no key lengths of its own type" in str(w.message) for w in caught)


def test_requests_that_share_a_prompt_prefix_reuse_its_cached_pages_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block sharing (prefix caching, on by default): a later request whose prompt starts with cached pages of an
    earlier one's reads them as its past and prefills the rest, a query chunk behind keys it never computed; the
    unpatched tokens and log-probabilities, every step patched."""
    cache_module = importlib.import_module("transformers.generation.continuous_batching.cache")
    original = getattr(cache_module.PagedAttentionCache, "search_prefix_match", None)
    if original is None or not SERVED:
        pytest.skip("no prefix sharing in this transformers' continuous batching, or its steps step aside")
    matched: list[int] = []

    def search_prefix_match(self, *args, **kwargs) -> int:
        found = original(self, *args, **kwargs)
        matched.append(found)
        return found

    monkeypatch.setattr(cache_module.PagedAttentionCache, "search_prefix_match", search_prefix_match)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 90, (12,), generator=g).tolist()
    shared = [prefix + torch.randint(3, 90, (n,), generator=g).tolist() for n in (3, 9, 1, 14)]
    generation = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                                               pad_token_id=0)
    config = dict(num_blocks=64, page_size=4, max_batch_tokens=16, allow_block_sharing=True, return_logprobs=True)

    def run(model: torch.nn.Module) -> list:
        with mock.patch.object(gc, "collect", lambda *_: 0):
            out = model.generate_batch(inputs=shared, generation_config=generation,
                                       continuous_batching_config=cb_config(**config), progress_bar=False)
        return [(o.generated_tokens, o.logprobs) for o in sorted(out.values(), key=lambda o: o.request_id)]

    model = any_model("llama", "sdpa")  # full attention: a sliding window's pages are not shared
    want = run(model)
    matched.clear()
    with patchkit.apply_patch(backend="sdpa") as group:
        got = run(model)
        aside, calls = dict(group.stepped_aside), group.calls
    assert max(matched) >= 8  # pages of the shared prefix were found and read as a past
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-5, rtol=0)
    assert_patched(aside, calls)
