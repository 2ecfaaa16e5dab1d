"""DeepSpeed ZeRO-3 on two gloo ranks: the model partitioned as it loads, trained and generated from under patchkit.

FastChat's and LLaVA's recipes train with `--deepspeed zero3.json`: transformers then loads the model inside
`deepspeed.zero.Init`, so each rank holds a shard of every weight (`weight.shape == (0,)` outside a forward) and
DeepSpeed's hooks gather a module's weights around its forward; every rank must run the same modules in the same
order, or the gathers deadlock. Each way into patchkit must give the unpatched run's losses, eval loss and
parameters, and generate() with `synced_gpus` (ranks finishing at different steps) the unpatched tokens.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from entrypoints import REPO, clean_env, run_group, torchrun

from patchkit.hooks.head import lm_head

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed not installed (make sp-test builds it)")

TRAINER = REPO / "tests" / "user_scripts" / "zero3_trainer.py"
GENERATE = REPO / "tests" / "user_scripts" / "zero3_generate.py"
WORLD, TIMEOUT = 2, 420
PEFT = importlib.util.find_spec("peft") is not None  # a test extra: the LoRA cases run where it is installed
LOSS_ATOL = 1e-5
# AdamW divides by the gradient's running RMS, so fp32 noise in a near-zero gradient element moves its weight by
# up to ~2e-6 over three steps at lr 1e-2 (measured: one element of 1024 in each q_proj, patched vs unpatched).
PARAM_ATOL, PARAM_RTOL = 1e-5, 1e-5


def saved_llama(path: Path, tied: bool = False) -> Path:
    """A tiny GQA LLaMA saved to disk (ZeRO-3 partitions a model only when from_pretrained loads it); `tied`: its
    head is its input embedding (Llama 3.2 1B/3B, Qwen2.5's small ones, Gemma)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied)
    tf.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return saved_llama(tmp_path_factory.mktemp("zero3") / "model")


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> Path:
    return saved_llama(tmp_path_factory.mktemp("zero3_tied") / "model", tied=True)


Runs = dict[str, tuple[dict, dict]]  # case -> (rank 0's JSON, the parameters after training)


def train(tmp: Path, way: str, cases: dict[str, tuple[Path, str]], unpad: str = "model") -> Runs:
    """zero3_trainer.py on two ranks (under the launcher for way 'launcher'), its cases (name: model dir, flags) in
    one launch: rank 0's JSON and parameters per case."""
    out = tmp / f"train-{way}-{unpad}"
    script = ["-m", "patchkit.launch", TRAINER] if way == "launcher" else [TRAINER]
    env = clean_env(PATCHKIT_UNPAD=unpad, **({"PATCHKIT_FLASH_ATTN": "1"} if way == "env" else {}))
    args = [arg for name, (directory, flags) in cases.items() for arg in ("--case", name, directory, flags)]
    proc = run_group(torchrun(WORLD, *script, way, out, *args), env, TIMEOUT)
    assert proc.returncode == 0 and all((out / f"{name}.json").exists() for name in cases), (
        f"{way}: exit {proc.returncode}\n{proc.stderr[-6000:]}")
    return {name: (json.loads((out / f"{name}.json").read_text()), torch.load(out / f"{name}.pt")) for name in cases}


@pytest.fixture(scope="module")
def reference(model_dir, tied_dir, tmp_path_factory):
    """The unpatched fp32 runs, in one launch on first use: plain, LoRA, LoRA training a copy of the head, LoRA on
    the head too, tied."""
    cache: Runs = {}

    def get(name: str) -> tuple[dict, dict]:
        if not cache:
            cases = {"plain": (model_dir, "-"), "tied": (tied_dir, "-")}
            if PEFT:
                cases.update({"lora": (model_dir, "lora"), "lora-head": (model_dir, "lora,train-head"),
                              "lora-on-head": (model_dir, "lora,head-lora")})
            cache.update(train(tmp_path_factory.mktemp("zero3_ref"), "none", cases))
        return cache[name]

    return get


def assert_same_training(got: tuple[dict, dict], want: tuple[dict, dict], loss_atol: float = LOSS_ATOL,
                         param_atol: float = PARAM_ATOL, param_rtol: float = PARAM_RTOL) -> None:
    (result, params), (ref, ref_params) = got, want
    assert ref["partitioned"] and result["partitioned"], "zero.Init did not partition the model at load"
    assert ref["patchkit_calls"] == 0 and result["patchkit_calls"] > 0, result
    assert result["losses"] == pytest.approx(ref["losses"], abs=loss_atol), (result["losses"], ref["losses"])
    assert result["eval_loss"] == pytest.approx(ref["eval_loss"], abs=loss_atol)
    assert_same_parameters(params, ref_params, param_atol, param_rtol)


def assert_same_parameters(params: dict, want: dict, atol: float = PARAM_ATOL, rtol: float = PARAM_RTOL) -> None:
    assert params.keys() == want.keys()
    off = [n for n, p in want.items() if not torch.allclose(params[n], p, atol=atol, rtol=rtol)]
    assert not off, off


@pytest.mark.parametrize("way", ["class", "instance", "env", "launcher"])
def test_zero3_trainer_equals_unpatched(way, model_dir, reference, tmp_path):
    """Each way in; under the launcher, LoRA on the partitioned model too: its frozen head is gathered for the fused
    head (the Trainer's steps read the loss alone)."""
    lora = way == "launcher" and PEFT
    got = train(tmp_path, way, {"plain": (model_dir, "-"), **({"lora": (model_dir, "lora")} if lora else {})})
    for name, run in got.items():
        assert_same_training(run, reference(name))
    if lora:  # 3 steps, and the held-out `model(**held_out).loss`, which reads the loss alone (`caller_code`)
        assert got["lora"][0]["heads"].get(lm_head.FUSED) == 4, got["lora"][0]["heads"]


def test_zero3_lora_under_the_launcher_with_the_loss_unpadded_equals_unpatched(model_dir, reference, tmp_path):
    """LoRA on the partitioned model under unpad="loss"; its frozen head, or the copy of it PEFT trains
    (`modules_to_save`, as adding tokens needs), is gathered for the fused head; with LoRA on the head too, its base
    and each adapter's B are gathered for the fused loss (A runs as a module on the rows), and B trains as unpatched."""
    pytest.importorskip("peft")
    got = train(tmp_path, "launcher", {"lora": (model_dir, "lora"), "lora-head": (model_dir, "lora,train-head"),
                                       "lora-on-head": (model_dir, "lora,head-lora")}, unpad="loss")
    for name, run in got.items():
        assert_same_training(run, reference(name))
        # 3 steps, and the script's held-out `model(**held_out).loss`, which reads the loss alone (`caller_code`)
        assert run[0]["heads"].get(lm_head.FUSED) == 4, (name, run[0]["heads"])


@pytest.mark.parametrize("case", ["fp32", "bf16"])
def test_zero3_the_fused_head_gathers_its_partitioned_weight_and_equals_unpatched(case, model_dir, tied_dir,
                                                                                 reference, tmp_path):
    """unpad="loss" on a partitioned model: the head's weight is a shard on each rank, so the probes, the check and
    the fused loss run as the head's forward, under DeepSpeed's hooks, which gather the weight for them and again
    before the backward (in bf16 the head's gradients are computed there; tied, the weight is the embedding's,
    gathered by both modules). Every step runs the fused head, the first one checked, and trains as unpatched."""
    if case == "fp32":
        got = train(tmp_path, "class", {"plain": (model_dir, "-"), "tied": (tied_dir, "-")}, unpad="loss")
        for name, run in got.items():
            assert run[0]["heads"].get(lm_head.FUSED) == 4, (name, run[0]["heads"])  # 3 steps and the held-out loss
            assert_same_training(run, reference(name))
        return
    # In bf16 patchkit's attention rounds otherwise than sdpa's, and AdamW's first steps move a weight by about its
    # rate wherever that flips a near-zero gradient's sign (measured: up to 0.029 after three steps at lr 1e-2, with
    # or without the fused head). The losses are the unpatched ones to bf16's rounding; the parameters are those of
    # patchkit with the family's own head on the same rows (a hook on the head: not fused): equal as in fp32.
    got = train(tmp_path, "class", {"bf16": (model_dir, "bf16"), "own": (model_dir, "bf16,own-head")}, unpad="loss")
    (result, params), (own, own_params) = got["bf16"], got["own"]
    assert result["heads"].get(lm_head.FUSED) == 4, result["heads"]
    ref, _ = train(tmp_path, "none", {"bf16": (model_dir, "bf16")})["bf16"]
    assert result["losses"] == pytest.approx(ref["losses"], abs=2e-3), (result["losses"], ref["losses"])
    # 3 steps and the held-out forward, whose caller reads its loss alone (`caller_code`)
    assert own["heads"] == {lm_head.LOSS_ONLY: 4}, own["heads"]
    assert result["losses"] == pytest.approx(own["losses"], abs=LOSS_ATOL)
    assert_same_parameters(params, own_params)


DIVERGE = REPO / "tests" / "user_scripts" / "zero3_diverge.py"


def diverging(tmp: Path, way: str, unpad: str) -> list[dict]:
    out = tmp / f"diverge-{way}-{unpad}"
    proc = run_group(torchrun(WORLD, DIVERGE, way, unpad, out), clean_env(), TIMEOUT)
    assert proc.returncode == 0, f"{way} {unpad}: exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_zero3_ranks_whose_forwards_take_other_paths_gather_alike_and_train_as_unpatched(unpad, tmp_path):
    """Rank 1 steps aside on step 0 and has no labelled token on step 1 while rank 0 fuses its head and loss. The
    fused head read its partitioned weight's type outside the head's call, which gathered it (DeepSpeed gathers a
    parameter read outside its module's forward): one collective that rank 1 did not run, and gloo aborted on the
    ranks' mismatched gathers. It now reads the weight as the module holds it; every rank trains as unpatched."""
    want, got = diverging(tmp_path, "none", unpad), diverging(tmp_path, "class", unpad)
    for ref, result in zip(want, got):
        assert result["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL), (result, ref)
    assert got[0]["heads"].get(lm_head.FUSED) == 3 and not got[0]["stepped_aside"], got[0]
    assert got[1]["stepped_aside"] == {"labels_from_padding": 1}, got[1]


def generate(model_dir: Path, tmp: Path, way: str) -> list[dict]:
    out = tmp / f"generate-{way}.json"
    proc = run_group(torchrun(WORLD, GENERATE, way, model_dir, out), clean_env(), TIMEOUT)
    assert proc.returncode == 0, f"{way}: exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return [json.loads((tmp / f"generate-{way}-{rank}.json").read_text()) for rank in range(WORLD)]


def test_zero3_generate_with_synced_gpus_equals_unpatched(model_dir, tmp_path):
    want, got = generate(model_dir, tmp_path, "none"), generate(model_dir, tmp_path, "class")
    for ref, result in zip(want, got):
        assert ref["partitioned"] and result["partitioned"]
        assert result["tokens"] == ref["tokens"], result["rank"]
        # every forward of either rank through the patch: rank 1's four tokens and its 8 synced forwards after them
        assert result["patchkit_calls"] == 2 * 12, result


def test_the_zero3_head_benchmark_runs_the_fused_head_to_the_unpatched_loss(tmp_path):
    """benchmarks/sharded_head.py at a toy vocabulary and a tenth of its lengths: the fused loss alone trains the same
    step to HF sdpa's loss. Two of its four providers, a two-rank launch each: patchkit's other two ways under ZeRO-3,
    the logits and the family's own head on the labelled rows, are the ZeRO-3 tests above."""
    out = tmp_path / "zero3_head.csv"
    env = clean_env(PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    proc = run_group([sys.executable, REPO / "benchmarks" / "sharded_head.py", "--vocab", "512", "--scale", "0.1",
                      "--providers", "hf_sdpa", "patchkit_loss", "--csv", out], env, TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = list(csv.DictReader(out.open()))
    assert [r["provider"] for r in rows] == ["hf_sdpa", "patchkit_loss"]
    assert len({int(r["real_tokens"]) for r in rows}) == 1 and int(rows[0]["real_tokens"]) > 0
    losses = [float(r["loss"]) for r in rows]
    assert max(losses) - min(losses) <= 1e-5, losses
