"""TRL's SFTTrainer under patchkit: a few steps per family and mode, per-step losses equal to the unpatched run."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
import torch
from entrypoints import clean_env, launch, run
from families import family_model
from models import VOCAB, tiny_model

import patchkit

pytest.importorskip("trl")
pytest.importorskip("peft")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import (  # noqa: E402
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
)

SCRIPT = Path(__file__).parent / "user_scripts" / "trl_sft.py"
STEPS = 3
LAYERS = 2
# mistral: sliding_window=5 on rows of 7 to 20 tokens (EOS included). Mixtral and Qwen3-MoE: TRL itself asks for the
# router logits and adds the config's router_aux_loss_coef (0.5) times the load-balancing loss (about 1.0 of 5.6 here)
FAMILIES = ["llama", "qwen2", "mistral", "mixtral", "qwen3_moe", "phi"]
LENGTHS = (6, 14, 9, 19, 7, 12)  # words per row, before TRL appends EOS; each row twice: a dozen examples
MODES = {  # SFTConfig fields per mode; everything else is TRL's default (gradient checkpointing on)
    "padded": {},  # DataCollatorForLanguageModeling, right padding, 2D attention mask
    "padding_free": {"padding_free": True, "max_length": None},  # one row, position_ids restart, cu_seq_lens kwargs
    "packing": {"packing": True, "max_length": 32},  # bfd packing, which implies padding-free
}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: on tiny matrices more threads only spin (8x slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' vocabulary: '<pad>' 0, '<s>' 1, '</s>' 2, 'w3' ... 'w96'."""
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, VOCAB)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w3"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def dataset() -> Dataset:
    """A dozen short text examples of random words (TRL tokenizes them and appends EOS)."""
    g = torch.Generator().manual_seed(1)
    rows = [" ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (n,), generator=g)) for n in LENGTHS]
    return Dataset.from_dict({"text": rows * 2})


def build(family: str) -> torch.nn.Module:
    """The family's tiny 2-layer GQA model, seeded, eager attention, fp32 (the sliding window bites for mistral)."""
    return tiny_model(kv_heads=2, layers=LAYERS) if family == "llama" else family_model(family, layers=LAYERS)


def common_args(tmp_path: Path) -> dict:
    """What every trainer test asks of TrainingArguments: fp32 on CPU, seeded, a loss logged every step."""
    return dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2,
                bf16=False, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0,
                dataloader_num_workers=0, disable_tqdm=True)


def logged_losses(trainer: object) -> list[float]:
    """The training loss the trainer logged at each step."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def sft_losses(model: torch.nn.Module, tmp_path: Path, before_trainer: Optional[Callable] = None,
               peft_config: Optional[LoraConfig] = None, **fields) -> list[float]:
    """Per-step training losses of STEPS SFTTrainer steps: fp32 on CPU, TRL's defaults otherwise."""
    args = SFTConfig(**common_args(tmp_path), **fields)
    assert args.gradient_checkpointing  # TRL's default, kept
    if before_trainer is not None:
        before_trainer(model)
    torch.manual_seed(0)  # LoRA's A matrices are drawn when the trainer wraps the model
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset(), processing_class=tokenizer(),
                         peft_config=peft_config)
    trainer.train()
    losses = logged_losses(trainer)
    assert len(losses) == STEPS
    return losses


def assert_same_losses(got: list[float], want: list[float]) -> None:
    assert got == pytest.approx(want, abs=1e-5), f"patched {got} != unpatched {want}"


def class_patched_as_unpatched(losses: Callable[[], list[float]], family: str, calls: int) -> None:
    """`losses()` (a trainer's, its model built inside) under a strict class patch equals it unpatched: `family`'s
    patch ran `calls` attention calls and stepped nothing aside."""
    want = losses()
    with patchkit.apply_patch(backend="sdpa", strict=True) as group:
        got = losses()
        handle = next(h for h in group if h.name == family)
        assert handle.stepped_aside == {} and handle.calls == calls, handle.report()
    assert_same_losses(got, want)


def assert_ran_through_patch(handle: patchkit.PatchHandle) -> None:
    """Every layer's attention in every step ran through the patch: its forward and its checkpointed recompute."""
    assert handle.calls == STEPS * LAYERS * 2, handle.report()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_sft_class_patch_matches_unpatched(family: str, mode: str, tmp_path: Path) -> None:
    """`apply_patch(backend="sdpa")` before the model is built: the same losses in each collator mode."""
    want = sft_losses(build(family), tmp_path, **MODES[mode])
    handle = patchkit.apply_patch(backend="sdpa")
    try:
        got = sft_losses(build(family), tmp_path, **MODES[mode])
        assert_ran_through_patch(handle)
    finally:
        handle.revert()
    assert_same_losses(got, want)


@pytest.mark.parametrize("mode", ["padding_free", "packing"])
@pytest.mark.parametrize("family", ["llama", "gpt_bigcode", "biogpt"])
def test_sft_on_a_model_loaded_with_flash_attention_2_matches_unpatched(family: str, mode: str, tmp_path: Path,
                                                                       monkeypatch) -> None:
    """TRL's padding-free modes are meant for flash attention (TRL warns otherwise): the model loaded with
    transformers' own flash_attention_2 (on the CPU stand-in of flash-attn), patched, gives the unpatched losses to
    the bit. GPT-BigCode's layers are handed no position_ids; BioGPT makes a mask of ones for the packed row."""
    from census import tiny_lm
    from fakes import install_transformers_flash_attention_2

    install_transformers_flash_attention_2(monkeypatch)

    def built() -> torch.nn.Module:
        model, why = tiny_lm(family)
        assert model is not None, why
        model.config._attn_implementation = "flash_attention_2"
        return model

    want = sft_losses(built(), tmp_path, **MODES[mode])
    handle = patchkit.apply_patch(backend="sdpa")
    try:
        got = sft_losses(built(), tmp_path, **MODES[mode])
        assert handle.calls == STEPS * LAYERS * 2 and not handle.stepped_aside, handle.report()
    finally:
        handle.revert()
    assert got == want


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_lora_matches_unpatched(family: str, tmp_path: Path) -> None:
    """LoRA through `peft_config` (TRL wraps the model in a PeftModel and makes the inputs require grad)."""
    want = sft_losses(build(family), tmp_path, peft_config=lora())
    handle = patchkit.apply_patch(backend="sdpa")
    try:
        got = sft_losses(build(family), tmp_path, peft_config=lora())
        assert_ran_through_patch(handle)
    finally:
        handle.revert()
    assert_same_losses(got, want)


@pytest.mark.parametrize("mode", ["padded", "packing"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sft_instance_patch_matches_unpatched(family: str, mode: str, tmp_path: Path) -> None:
    """`apply_patch(model=model)` before the trainer is built (TRL then wraps `model.forward` in its fused LM head)."""
    want = sft_losses(build(family), tmp_path, **MODES[mode])
    handles: list[patchkit.PatchHandle] = []
    try:
        patch = lambda m: handles.append(patchkit.apply_patch(model=m, backend="sdpa"))  # noqa: E731
        got = sft_losses(build(family), tmp_path, patch, **MODES[mode])
        assert_ran_through_patch(handles[0])
    finally:
        for handle in handles:
            handle.revert()
    assert_same_losses(got, want)


@pytest.mark.parametrize("mode", ["padded", "padding_free"])
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_sft_under_the_registered_name_alone_matches_unpatched(family: str, mode: str, tmp_path: Path) -> None:
    """attn_implementation="patchkit" set on the model, no patch: its mask function reads each step's causal-LM call
    (labels -100 at padding by TRL's collator: nothing steps aside) inside SFTTrainer's checkpointed steps."""
    from families import set_attention

    from patchkit.hooks.name import attention_interface

    want = sft_losses(build(family), tmp_path, **MODES[mode])
    patchkit.register_attention(backend="sdpa", strict=True)
    try:
        state = attention_interface.route_state()
        got = sft_losses(build(family), tmp_path, lambda m: set_attention(m, patchkit.ATTENTION_NAME), **MODES[mode])
        assert state.calls == STEPS * LAYERS * 2 and not state.stepped_aside
    finally:
        patchkit.register_attention(backend="auto", strict=False)
    assert_same_losses(got, want)


@pytest.mark.heavy  # make test-heavy
@pytest.mark.parametrize("mode, backend", [("padded", "inductor"), ("packing", "aot_eager")])
def test_sft_with_torch_compile_matches_unpatched(mode: str, backend: str, tmp_path: Path) -> None:
    """`torch_compile=True` on windowed Mistral with TRL's gradient checkpointing: each step's loss equals the
    unpatched compiled run's, every layer through the patch. Inductor (the Trainer's default) once; packing on
    aot_eager (dynamo and AOT autograd, where a patch could break; 2 minutes less of cold C++ compiling). The
    inductor run pads every batch to one width, so each run compiles its graphs once, not again per batch shape."""
    from torch._dynamo.utils import counters

    width = {"pad_to_multiple_of": 32} if backend == "inductor" else {}
    fields = dict(MODES[mode], torch_compile=True, torch_compile_backend=backend, **width)
    torch._dynamo.reset()
    want = sft_losses(build("mistral"), tmp_path, **fields)
    torch._dynamo.reset()
    counters.clear()
    handle = patchkit.apply_patch("mistral", backend="sdpa")
    try:
        got = sft_losses(build("mistral"), tmp_path, **fields)
        assert_ran_through_patch(handle)
        assert counters["stats"]["unique_graphs"] > 0  # compiled, not run eagerly
    finally:
        handle.revert()
        torch._dynamo.reset()
    assert_same_losses(got, want)


def preferences() -> Dataset:
    """A dozen prompt / chosen / rejected triples of random words, of unequal lengths."""
    g = torch.Generator().manual_seed(1)
    words = lambda n: " ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (n,), generator=g))  # noqa: E731
    rows = [dict(prompt=words(a), chosen=words(b), rejected=words(c))
            for a, b, c in ((4, 6, 3), (7, 2, 9), (3, 11, 5), (9, 4, 4), (2, 8, 6), (5, 5, 12))]
    return Dataset.from_list(rows * 2)


def preference_losses(trainer_class: type, args: object, model: object) -> list[float]:
    torch.manual_seed(0)
    trainer = trainer_class(model=model, args=args, train_dataset=preferences(), processing_class=tokenizer())
    trainer.train()
    return logged_losses(trainer)


@pytest.mark.parametrize("padding_free", [False, True])
def test_dpo_matches_unpatched(padding_free: bool, tmp_path: Path) -> None:
    """DPOTrainer from a saved model path (it loads the policy and its reference model itself), chosen and
    rejected concatenated, gradient checkpointing on: the same losses; the policy's layers (forward and recompute)
    and the reference model's (forward) all ran through the patch."""
    path = tmp_path / "model"
    build("mistral").save_pretrained(path)
    args = DPOConfig(**common_args(tmp_path), model_init_kwargs={"dtype": torch.float32}, padding_free=padding_free)
    assert args.gradient_checkpointing
    want = preference_losses(DPOTrainer, args, str(path))
    handle = patchkit.apply_patch(backend="sdpa", strict=True)
    try:
        got = preference_losses(DPOTrainer, args, str(path))
        assert handle.calls == STEPS * LAYERS * 3, handle.report()
    finally:
        handle.revert()
    assert_same_losses(got, want)


@pytest.mark.parametrize("trainer_name", ["ORPO", "CPO"])
def test_orpo_and_cpo_train_as_unpatched_and_say_their_padding_metrics_differ(trainer_name: str,
                                                                              tmp_path: Path) -> None:
    """TRL's ORPO and CPO trainers (trl.experimental) log `logits/chosen` and `logits/rejected` as the mean of the
    logits over every position, padding included: patched, those at padding are the head's of a zero hidden state.
    Said once, by name; the losses, log-probabilities and rewards they log are the unpatched ones."""
    import warnings

    experimental = pytest.importorskip(f"trl.experimental.{trainer_name.lower()}")
    config, trainer_class = (getattr(experimental, f"{trainer_name}{kind}") for kind in ("Config", "Trainer"))

    def logged() -> dict:
        torch.manual_seed(0)
        args = config(**{**common_args(tmp_path), "max_steps": 1})
        trainer = trainer_class(model=build("llama"), args=args, train_dataset=preferences(),
                                processing_class=tokenizer())
        trainer.train()
        return trainer.state.log_history[0]

    want = logged()
    with warnings.catch_warnings(record=True) as caught, patchkit.apply_patch(backend="sdpa") as handle:
        warnings.simplefilter("always")
        got = logged()
        assert handle.calls > 0 and handle.stepped_aside == {}
    said = [str(w.message) for w in caught if f"TRL's {trainer_name}Trainer logs" in str(w.message)]
    assert len(said) == 1 and "logits/chosen and logits/rejected" in said[0], said
    exact = [k for k in want if k.startswith(("loss", "logps/", "rewards/", "nll_loss", "log_odds"))]
    assert "loss" in exact and "logps/chosen" in exact
    assert {k: got[k] for k in exact} == pytest.approx({k: want[k] for k in exact}, abs=1e-5)


def test_reward_trainer_on_a_sequence_classifier_matches_unpatched(tmp_path: Path) -> None:
    """RewardTrainer on Qwen2ForSequenceClassification (its score read at each row's last real token, from the
    repadded hidden states): the same losses, every layer through the patch."""
    import transformers

    def classifier() -> torch.nn.Module:
        config = build("qwen2").config
        config.num_labels = 1
        torch.manual_seed(0)
        return transformers.Qwen2ForSequenceClassification(config).float()

    args = RewardConfig(**common_args(tmp_path))
    want = preference_losses(RewardTrainer, args, classifier())
    handle = patchkit.apply_patch(backend="sdpa", strict=True)
    try:
        got = preference_losses(RewardTrainer, args, classifier())
        assert handle.calls == STEPS * LAYERS * 2, handle.report()
    finally:
        handle.revert()
    assert_same_losses(got, want)


def test_grpo_samples_and_trains_as_unpatched(tmp_path: Path) -> None:
    """GRPOTrainer on windowed Mistral: it samples 4 completions per left-padded prompt with transformers'
    generate(), scores them, and trains on the padded prompt + completion rows (gradient checkpointing on). The
    same completions (their mean length and reward) and the same losses, every step's forwards through the patch."""
    path = tmp_path / "model"
    build("mistral").save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (n,), generator=g)) for n in (3, 7, 5, 9)]
    args = GRPOConfig(**common_args(tmp_path), model_init_kwargs={"dtype": torch.float32}, num_generations=4,
                      max_completion_length=6)
    assert args.gradient_checkpointing

    def run() -> list[tuple]:
        torch.manual_seed(0)
        trainer = GRPOTrainer(model=str(path), reward_funcs=lambda completions, **_: [len(c) / 10 for c in completions],
                              args=args, train_dataset=Dataset.from_dict({"prompt": prompts * 2}),
                              processing_class=tokenizer())
        trainer.train()
        logs = [e for e in trainer.state.log_history if "loss" in e]
        return [(e["loss"], e["reward"], e["completions/mean_length"]) for e in logs]

    want = run()
    handle = patchkit.apply_patch(backend="sdpa", strict=True)
    try:
        got = run()
        assert handle.calls > STEPS * LAYERS * 2 and not handle.stepped_aside, handle.report()
    finally:
        handle.revert()
    assert [g[1:] for g in got] == [w[1:] for w in want]  # the same sampled completions
    assert_same_losses([g[0] for g in got], [w[0] for w in want])


def script_result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


@pytest.mark.heavy  # make test-heavy
def test_env_var_and_launcher_run_an_unmodified_trl_script_as_unpatched(tmp_path: Path) -> None:
    """The user script (padded, then packed) unpatched, under PATCHKIT_FLASH_ATTN=1 and under the launcher: the same
    losses (Mistral, window 5). The three processes run side by side."""
    env = dict(FAMILY="Mistral")
    with ThreadPoolExecutor(3) as pool:
        python = [sys.executable, SCRIPT]
        procs = [pool.submit(run, python, env=clean_env(**env), cwd=tmp_path),
                 pool.submit(run, python, env=clean_env(PATCHKIT_FLASH_ATTN="1", **env), cwd=tmp_path),
                 pool.submit(launch, "--backend", "sdpa", SCRIPT, env=clean_env(**env), cwd=tmp_path)]
        plain, by_env, by_launcher = (script_result(p.result()) for p in procs)
    assert plain["calls"] == 0
    for got in (by_env, by_launcher):
        assert got["calls"] == 2 * STEPS * LAYERS * 2  # two runs; forward + checkpointed recompute, every layer
        for mode in ("padded", "packing"):
            assert_same_losses(got["losses"][mode], plain["losses"][mode])

