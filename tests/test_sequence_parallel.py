"""DeepSpeed Ulysses sequence parallelism (ALST) on two gloo ranks: each way into patchkit against one process.

`UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation=NAME)` replaces
`ALL_ATTENTION_FUNCTIONS[NAME]` with a wrapper that all-to-alls q/k/v from sequence shards to head shards, drops the
attention mask and gathers position_ids, so that NAME's function sees the whole sequence. Each way into patchkit
runs tests/user_scripts/ulysses_sp.py in its own `torch.distributed.run` pair (a collective size mismatch aborts a
rank), a training step on each of its data layouts, and compares each step's loss and every gradient with the same
script run as one plain process on the full sequence, unpatched (sdpa): the loss within 1e-6, the gradients within
fp32 noise, and the Ulysses wrapper must have run on every rank (a patch that goes round it leaves each rank's
attention shard-local, silently). Left-padded batches are served exactly where position_ids restart at each row's
first real token, and refused by name on every rank where they do not (patchkit/hooks/parallel/ulysses_padding.py).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from entrypoints import REPO, clean_env, run_group, torchrun

from patchkit.hooks.head import lm_head

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed not installed (Ulysses SP needs deepspeed >= 0.19)")

SCRIPT = REPO / "tests" / "user_scripts" / "ulysses_sp.py"
SP = 2
# The first start builds DeepSpeed's CPU shared-memory comm op (a JIT C++ build, cached in ~/.cache/torch_extensions,
# about 40 s on 2 cores); later starts take about 8 s.
TIMEOUT = 420
LOSS_ATOL = 1e-6
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5  # fp32 noise: the reorderings measured are < 1e-7 absolute
# Left padding: Ulysses drops the mask, so a real token after padding attends to it unless position_ids restart there.
LEFT_LOSS_RTOL = 4 * torch.finfo(torch.float32).eps  # the per-rank loss aggregation rounds: measured <= 2 ulps

# (family, way): the data layouts one launch trains, a step each (a process start costs more than a step). Every way
# on LLaMA, Qwen2 (q/k/v bias, a family of its own under the class patch) through the class patch; `both`: the class
# patch on a model loaded with "patchkit"; `flash-class`: the class patch on a model loaded with "flash_attention_2"
# (transformers' own, on the CPU stand-in of flash-attn), Ulysses wrapping that name. `left-restart`: left-padded
# rows whose position_ids restart at each row's first real token (generate()'s convention): attention starts a
# document there and the padding drops out; unpatched Ulysses (sdpa, no mask) is off by 3e-4 in the loss, 0.08 in the
# gradients for llama, 1e-3 and 0.5 for qwen2 (measured); unpatched flash_attention_2 runs each of the two rows whole
# (it reads documents from position_ids only in a batch of one row): 7e-5 off in the loss for llama (measured).
CASES = {
    ("llama", "interface"): ["packed", "padded", "left-restart"],
    ("llama", "class"): ["packed", "padded"],
    ("llama", "env"): ["packed", "padded", "left-restart"],
    ("llama", "both"): ["packed", "padded"],
    ("qwen2", "class"): ["packed", "padded", "left-restart"],
    ("llama", "flash-class"): ["packed", "padded", "left-restart"],
}
Results = dict[str, tuple[dict, dict]]  # data -> (rank 0's JSON, its gradients)


def launch(tmp: Path, family: str, way: str, data: list[str], world: int) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the script (one process, or `world` ranks under torch.distributed.run); its process and output folder."""
    out = tmp / f"{family}-{way}-{world}"
    env = clean_env(**({"PATCHKIT_FLASH_ATTN": "1"} if way == "env" else {}))
    script = [SCRIPT, family, way, ",".join(data), out]
    cmd = [sys.executable, *script] if world == 1 else torchrun(world, *script)
    return run_group(cmd, env, TIMEOUT), out


def run_script(tmp: Path, family: str, way: str, data: list[str], world: int) -> Results:
    """The script's JSON and gradients (rank 0) per data layout; asserts it exited cleanly."""
    start = time.perf_counter()
    proc, out = launch(tmp, family, way, data, world)
    assert proc.returncode == 0 and all((out / f"{d}.json").exists() for d in data), (
        f"{family}/{way}/{data} on {world} process(es) exited {proc.returncode}:\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    print(f"{family}/{way} {data} on {world} process(es): {time.perf_counter() - start:.1f} s")
    return {d: (json.loads((out / f"{d}.json").read_text()), torch.load(out / f"{d}.pt")) for d in data}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process, the full sequence, unpatched sdpa: every layout a family's cases train, computed on first use."""
    tmp, cache = tmp_path_factory.mktemp("ulysses_ref"), {}

    def get(family: str) -> Results:
        if family not in cache:
            data = sorted({d for (f, _), layouts in CASES.items() if f == family for d in layouts})
            cache[family] = run_script(tmp, family, "none", data, 1)
        return cache[family]

    return get


def grad_diff(got: dict, want: dict) -> tuple[float, list[str]]:
    """The largest absolute gradient difference, and the parameters outside fp32 noise."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    worst, off = 0.0, []
    for name, w in want.items():
        g = got[name]
        worst = max(worst, (g - w).abs().max().item())
        if not torch.allclose(g, w, atol=GRAD_ATOL, rtol=GRAD_RTOL):
            off.append(name)
    return worst, off


def problems_of(got: dict, grads: dict, ref: dict, ref_grads: dict, patched: bool) -> list[str]:
    """What differs from the one-process reference: the loss (to LOSS_ATOL, or to a few ulps on left padding), any
    gradient outside fp32 noise, a rank without the Ulysses wrapper (world > 1) or, where `patched`, without
    patchkit's attention during this step."""
    worst, off = grad_diff(grads, ref_grads)
    ranks, problems = got["ranks"], []
    summary = (
        f"{got['family']}/{got['way']}/{got['data']}: loss 1-proc {ref['loss']:.9f} sp{got['world']} "
        f"{got['loss']:.9f} (diff {abs(got['loss'] - ref['loss']):.2e}); max grad diff {worst:.2e} ({len(off)} of "
        f"{len(grads)} parameters outside fp32 noise); Ulysses wrapper calls per rank "
        f"{[r['ulysses']['wrapper_calls'] for r in ranks]}, core q lengths "
        f"{[sorted(set(r['ulysses']['core_q_lens'])) for r in ranks]}; attention calls "
        f"{[r['attention_calls'] for r in ranks]}; config._attn_implementation={got['config_attn_implementation']!r}"
    )
    print(summary)
    if got["world"] > 1 and not got["ulysses_wrapper_ran"]:
        problems.append("the Ulysses wrapper did not run on every rank")
    left = got["data"].startswith("left")
    if got["loss"] != pytest.approx(ref["loss"], **({"rel": LEFT_LOSS_RTOL, "abs": 0} if left else
                                                    {"abs": LOSS_ATOL})):
        problems.append("the loss differs from one process")
    if off:
        problems.append(f"gradients differ: {off[:4]}")
    if patched and not all(any(p["calls"] for p in r["patchkit_active"]) for r in ranks):
        problems.append("patchkit's attention did not run on every rank")
    return [f"{got['data']}: {p}" for p in problems] + ([summary] if problems else [])


@pytest.mark.parametrize("family, way", list(CASES))
def test_ulysses_two_ranks_equal_one_process(family, way, references, tmp_path):
    ref, got = references(family), run_script(tmp_path, family, way, CASES[family, way], SP)
    problems = [p for data, (result, grads) in got.items()
                for p in problems_of(result, grads, *ref[data], patched=way != "interface")]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_process_class_patch_equals_reference(family, references, tmp_path):
    # The harness's own check: on one process the class patch matches unpatched sdpa, so a two-rank difference is
    # sequence parallelism's, not the data's or the patch's.
    ref = references(family)
    got = run_script(tmp_path, family, "class", list(ref), 1)
    problems = [p for data, (result, grads) in got.items() for p in problems_of(result, grads, *ref[data], True)]
    assert not problems, "\n".join(problems)


def refusals(proc: subprocess.CompletedProcess, message: str) -> int:
    """How many ranks ended on a PatchInputError starting with `message` (their tracebacks' last lines)."""
    return (proc.stdout + proc.stderr).count(f"patchkit.errors.PatchInputError: {message}")


@pytest.mark.parametrize("family, way", [("llama", "env"), ("qwen2", "class")])
def test_left_padding_without_restarting_positions_is_refused_on_every_rank(family, way, tmp_path):
    # the second row's padding is all on rank 0 and its real tokens all on rank 1: neither shard alone shows
    # padding before a real token, so only the gathered masks tell; every rank reaches the same verdict and stops
    proc, out = launch(tmp_path, family, way, ["left"], SP)
    assert proc.returncode != 0 and not (out / "left.json").exists(), proc.stdout[-2000:]
    assert refusals(proc, "padding before real tokens (left padding, or a hole) under DeepSpeed Ulysses") == SP, (
        proc.stderr[-6000:])
    assert "Pad on the right" in proc.stderr


def test_left_padding_that_would_step_aside_is_refused(tmp_path):
    # the first real token is labelled: rank 0 (which holds the padding predicting it) would run transformers'
    # attention, which Ulysses runs without the mask; it refuses instead (its peer is then torn down)
    proc, out = launch(tmp_path, "llama", "class", ["left-restart-labelled"], SP)
    assert proc.returncode != 0 and not (out / "left-restart-labelled.json").exists(), proc.stdout[-2000:]
    assert refusals(proc, "under DeepSpeed Ulysses, a batch with padding before real tokens would step aside") >= 1, (
        proc.stderr[-6000:])
    assert "labels_from_padding" in proc.stderr


# The HF Trainer route: accelerate's ParallelismConfig registers Ulysses under "sdpa" and shards the batches itself.
TRAINER_SCRIPT = REPO / "tests" / "user_scripts" / "ulysses_trainer.py"


def run_trainer(tmp: Path, way: str, zero_stage: int = 0, attention: str = "sdpa") -> tuple[dict, dict]:
    """tests/user_scripts/ulysses_trainer.py on SP ranks, the model and Ulysses on `attention`: rank 0's JSON and its
    parameters after training."""
    out = tmp / f"trainer-{way}-zero{zero_stage}-{attention}.json"
    env = clean_env(**({"PATCHKIT_FLASH_ATTN": "1"} if way == "env" else {}))
    proc = run_group(torchrun(SP, TRAINER_SCRIPT, way, out, zero_stage, attention), env, TIMEOUT)
    assert proc.returncode == 0 and out.exists(), f"{way}: exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), torch.load(out.with_suffix(".pt"))


def needs_parallelism_config() -> None:
    pytest.importorskip("accelerate.utils", reason="accelerate is a test extra")
    from accelerate import utils

    if not hasattr(utils, "DeepSpeedSequenceParallelConfig"):
        pytest.skip("this accelerate has no DeepSpeedSequenceParallelConfig (ParallelismConfig sp_backend)")


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory):
    """The unpatched Trainer run on an attention name, computed on first use."""
    needs_parallelism_config()
    tmp, cache = tmp_path_factory.mktemp("ulysses_trainer"), {}

    def get(attention: str) -> tuple[dict, dict]:
        if attention not in cache:
            cache[attention] = run_trainer(tmp, "none", attention=attention)
        return cache[attention]

    return get


# The Trainer's steps read the loss alone, so under patchkit each rank's shard's loss comes from the fused head (its
# partitioned weight gathered for it under ZeRO-3). The head's gradient is summed in another order, and AdamW's first
# step moves a weight by about its rate wherever fp32 noise flips a near-zero gradient's sign (measured: up to 1.7e-5
# at lr 1e-2; a gradient of the wrong sign moves it by 2e-2). The losses stay within LOSS_ATOL.
TRAINED_ATOL = 1e-4


def assert_trained_as(got: dict, params: dict, ref: dict, ref_params: dict, atol: float = TRAINED_ATOL) -> None:
    """Ulysses wrapped the model's attention both times, patchkit ran only in `got`: the same losses and parameters
    after training."""
    assert ref["ulysses_wrapped"] and got["ulysses_wrapped"]
    assert ref["patchkit_calls"] == 0 and got["patchkit_calls"] > 0, got
    assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL), (got["losses"], ref["losses"])
    off = [n for n, p in ref_params.items() if not torch.allclose(params[n], p, atol=atol, rtol=GRAD_RTOL)]
    worst = max((params[n] - p).abs().max().item() for n, p in ref_params.items())
    assert not off, (worst, off)


# "flash_attention_2": what ALST's and TRL's docs load on a GPU (sp_attn_implementation), transformers' own on the CPU
# stand-in of flash-attn; the class patch serves the wrapped name
@pytest.mark.parametrize("way, attention", [("class", "sdpa"), ("env", "sdpa"), ("class", "flash_attention_2")])
def test_trainer_parallelism_config_runs_patchkit_inside_ulysses(way, attention, trainer_reference, tmp_path):
    # two optimizer steps: the second loss and the parameters after both carry the first step's gradients
    got, params = run_trainer(tmp_path, way, attention=attention)
    assert got["config_attn_implementation"] == attention
    assert_trained_as(got, params, *trainer_reference(attention))
    assert got["heads"] == {lm_head.FUSED: len(got["losses"])}, got["heads"]  # the Trainer reads the loss alone


def test_ulysses_with_zero3_partitioned_at_load_runs_patchkit_as_unpatched(tmp_path):
    # ALST's recipe: Ulysses with ZeRO-3, the model built inside zero.Init (its weights (0,) placeholders outside each
    # module's forward, gathered by DeepSpeed's hooks), the parameters gathered after training for the comparison;
    # zero.Init draws the initial weights its own way, so the reference is an unpatched ZeRO-3 run
    needs_parallelism_config()
    ref, ref_params = run_trainer(tmp_path, "none", zero_stage=3)
    got, params = run_trainer(tmp_path, "class", zero_stage=3)
    assert ref["partitioned"] and got["partitioned"]
    assert_trained_as(got, params, ref, ref_params)
    # the Trainer reads the loss alone: each rank's shard's loss from the fused head, its partitioned weight gathered
    assert got["heads"] == {lm_head.FUSED: len(got["losses"])}, got["heads"]
