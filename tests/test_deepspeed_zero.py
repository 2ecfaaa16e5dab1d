"""DeepSpeed ZeRO-3 on two gloo ranks: the model partitioned as it loads, trained and generated from under patchkit.

FastChat's and LLaVA's recipes train with `--deepspeed zero3.json`: transformers then loads the model inside
`deepspeed.zero.Init`, so each rank holds a shard of every weight (`weight.shape == (0,)` outside a forward) and
DeepSpeed's hooks gather a module's weights around its forward; every rank must run the same modules in the same
order, or the gathers deadlock. Each way into patchkit must give the unpatched run's losses, eval loss and
parameters, and generate() with `synced_gpus` (ranks finishing at different steps) the unpatched tokens.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from entrypoints import REPO, clean_env, run_group, torchrun

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed not installed (make sp-test builds it)")

TRAINER = REPO / "tests" / "user_scripts" / "zero3_trainer.py"
GENERATE = REPO / "tests" / "user_scripts" / "zero3_generate.py"
WORLD, TIMEOUT = 2, 420
LOSS_ATOL = 1e-5
# AdamW divides by the gradient's running RMS, so fp32 noise in a near-zero gradient element moves its weight by
# up to ~2e-6 over three steps at lr 1e-2 (measured: one element of 1024 in each q_proj, patched vs unpatched).
PARAM_ATOL, PARAM_RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny GQA LLaMA saved to disk: ZeRO-3 partitions a model only when from_pretrained loads it."""
    import transformers as tf

    path = tmp_path_factory.mktemp("zero3") / "model"
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)
    tf.LlamaForCausalLM(config).save_pretrained(path)
    return path


def train(model_dir: Path, tmp: Path, way: str, lora: bool = False) -> tuple[dict, dict]:
    """zero3_trainer.py on two ranks (under the launcher for way 'launcher'): rank 0's JSON and parameters."""
    out = tmp / f"train-{way}-{int(lora)}.json"
    script = ["-m", "patchkit.launch", TRAINER] if way == "launcher" else [TRAINER]
    env = clean_env(**({"PATCHKIT_FLASH_ATTN": "1"} if way == "env" else {}))
    proc = run_group(torchrun(WORLD, *script, way, model_dir, out, *(["--lora"] if lora else [])), env, TIMEOUT)
    assert proc.returncode == 0 and out.exists(), f"{way}: exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), torch.load(out.with_suffix(".pt"))


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """The unpatched run per LoRA setting, computed on first use."""
    tmp, cache = tmp_path_factory.mktemp("zero3_ref"), {}

    def get(lora: bool) -> tuple[dict, dict]:
        if lora not in cache:
            cache[lora] = train(model_dir, tmp, "none", lora)
        return cache[lora]

    return get


def assert_same_training(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    (result, params), (ref, ref_params) = got, want
    assert ref["partitioned"] and result["partitioned"], "zero.Init did not partition the model at load"
    assert ref["patchkit_calls"] == 0 and result["patchkit_calls"] > 0, result
    assert result["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL), (result["losses"], ref["losses"])
    assert result["eval_loss"] == pytest.approx(ref["eval_loss"], abs=LOSS_ATOL)
    assert params.keys() == ref_params.keys()
    off = [n for n, p in ref_params.items() if not torch.allclose(params[n], p, atol=PARAM_ATOL, rtol=PARAM_RTOL)]
    assert not off, off


@pytest.mark.parametrize("way", ["class", "instance", "env", "launcher"])
def test_zero3_trainer_equals_unpatched(way, model_dir, reference, tmp_path):
    assert_same_training(train(model_dir, tmp_path, way), reference(False))


def test_zero3_lora_under_the_launcher_equals_unpatched(model_dir, reference, tmp_path):
    pytest.importorskip("peft")
    assert_same_training(train(model_dir, tmp_path, "launcher", lora=True), reference(True))


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
