"""An instance patch applied to a model a framework has already wrapped: DDP, FSDP2, FSDP1 and torch.compile.

`apply_patch(model=wrapper)` after wrapping, as users call it: the same seeded tiny LLaMA (GQA) is wrapped twice
alike, one copy instance-patched through its wrapper (unpad "model" and "loss"), and two SGD steps on a mixed-padded
batch with labels give the unpatched wrapped model's losses, gradients and parameters. Every attention layer ran
through the patch, nothing stepped aside, and `revert()` puts back every module's forward, the wrapper's and the
inner model's, by identity.

DDP, FSDP2 (`fully_shard` on each decoder layer, then the root, as accelerate shards) and FSDP1
(`FullyShardedDataParallel(..., use_orig_params=True)`, each decoder layer a unit, as the HF Trainer's
`--fsdp "full_shard auto_wrap"`) run in tests/user_scripts/wrapped_instances.py under torchrun, not in this process:
a process group initialised here would leave its default group, device mesh and gloo threads (which can abort the
interpreter's exit, see `common.end_process_group`) to every later test of this pytest or xdist worker process. One
torchrun start serves the nine runs (three wrappers, unpatched and two unpad modes; ~10 s). It runs two ranks, not
one: on one rank torch switches FSDP1's FULL_SHARD to NO_SHARD (with a warning), so no flat parameter would ever be
gathered or freed. Each rank gets the whole batch, so the gradients averaged over the ranks are one process's, and
the script gathers them (and the parameters) whole before it writes them.

torch.compile needs no process group: its cases run here (backend "aot_eager", so the backward is AOT autograd's;
"eager" for the case that compiles the model before the patch, which only has to recompile).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

import pytest
import torch
from entrypoints import REPO, clean_env, run_group, torchrun
from models import labels_for, padded_batch, tiny_model

import patchkit
from patchkit.errors import PatchTargetError
from patchkit.hooks.head import lm_head

SCRIPT = REPO / "tests" / "user_scripts" / "wrapped_instances.py"
WORLD = 2
STEPS = 2  # the script's too
LAYERS = 2  # tiny_model's
HEADS = {"model": lm_head.REAL_TOKENS, "loss": lm_head.FUSED}  # where the head and loss ran, by unpad mode
LLAMA_FORWARDS = ["LlamaAttention", "LlamaAttention", "LlamaForCausalLM", "LlamaModel"]  # the instance's forwards
ATOL, RTOL = 2e-5, 1e-3  # models.assert_same's for gradients: fp32 varlen sdpa on real tokens vs eager attention


def parameter_names() -> list[str]:
    return [n for n, _ in tiny_model(kv_heads=2).named_parameters()]


def assert_tensors_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every parameter's gradient at each step and its value after the steps, with the unpatched run's."""
    assert sorted(got) == sorted(want) == sorted(f"{what}.{name}" for name in parameter_names()
                                                 for what in ("param", *(f"grad{s}" for s in range(STEPS))))
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=ATOL, rtol=RTOL, msg=key)


def forwards(module: torch.nn.Module) -> dict[str, tuple[Any, Any]]:
    """Each module's own `forward` attribute (None: its class's) and its class's forward, by module name."""
    return {name: (vars(m).get("forward"), type(m).forward) for name, m in module.named_modules()}


def not_restored(before: dict[str, tuple[Any, Any]], module: torch.nn.Module) -> list[str]:
    after = forwards(module)
    assert after.keys() == before.keys()
    return sorted(n for n in before if after[n][0] is not before[n][0] or after[n][1] is not before[n][1])


# ---------------------------------------------------------------------------------------------------------------
# DDP, FSDP2, FSDP1: two gloo ranks under torchrun


@pytest.fixture(scope="module")
def wrapped_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, torch.Tensor]]:
    """The script's results by case ("fsdp2-loss", "ddp-unpatched", ...) and its tensors ("CASE/grad0.NAME")."""
    out = tmp_path_factory.mktemp("wrapped") / "wrapped.json"
    proc = run_group(torchrun(WORLD, SCRIPT, out), env=clean_env(), timeout=240)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return json.loads(out.read_text()), torch.load(out.with_suffix(".pt"))


def case_tensors(tensors: dict[str, torch.Tensor], case: str) -> dict[str, torch.Tensor]:
    return {k.split("/", 1)[1]: t for k, t in tensors.items() if k.startswith(case + "/")}


@pytest.mark.heavy  # starts Python processes: make test-heavy
@pytest.mark.parametrize("unpad", ["model", "loss"])
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2", "fsdp1"])
def test_instance_patch_through_a_distributed_wrapper_equals_unpatched(
    wrapped_runs: tuple[dict, dict], wrapper: str, unpad: str
) -> None:
    results, tensors = wrapped_runs
    want, got = results[f"{wrapper}-unpatched"], results[f"{wrapper}-{unpad}"]
    assert "error" not in want, want["error"]
    assert "error" not in got, got["error"]
    assert len(want["losses"]) == STEPS and want["losses"][1] < want["losses"][0]  # it trained
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-6, abs=1e-6)
    assert_tensors_equal(case_tensors(tensors, f"{wrapper}-{unpad}"), case_tensors(tensors, f"{wrapper}-unpatched"))
    if wrapper == "fsdp1":  # really sharded: a flat parameter gathered and freed around each unit's forward
        assert got["sharding"] == want["sharding"] == "ShardingStrategy.FULL_SHARD"
    # every layer through the patch on every forward, seen through the wrapper and on the inner model alike
    assert (got["layers_patched"], got["check_wrapper"], got["check_model"]) == (LAYERS, LAYERS, LAYERS)
    assert got["calls"] == LAYERS * STEPS
    # the script's loop reads the loss alone (`caller_code`): the head fused with the loss under either unpad
    assert got["heads"] == {lm_head.FUSED: STEPS} and got["stepped_aside"] == {}
    # the instance patch replaced the LM's, base model's and attention layers' instance forwards, never the wrapper's
    assert got["replaced"] == LLAMA_FORWARDS
    assert got["not_restored"] == [] and got["calls_after_revert"] == 0
    assert "is live in 0 of 2 attention layers" in got["check_after_revert"]
    assert "(the patch was reverted)" in got["check_after_revert"]


# ---------------------------------------------------------------------------------------------------------------
# torch.compile: an OptimizedModule, in this process


def compiled_run(
    unpad: Optional[str], backend: str = "aot_eager", patch_after: int = 0,
    check: Optional[Callable[[torch.nn.Module, Any], None]] = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS SGD steps of torch.compile(tiny LLaMA): losses, every gradient and the parameters after them. With
    `unpad`, `apply_patch(model=compiled)` after `patch_after` compiled steps; `check(compiled, handle)` runs
    before the revert; the revert is checked to restore every module's forward."""
    torch._dynamo.reset()
    model = tiny_model(kv_heads=2).train()
    compiled = torch.compile(model, backend=backend)
    assert type(compiled).__name__ == "OptimizedModule"
    before = forwards(compiled)
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.5)
    ids, mask = padded_batch("mixed")
    labels = labels_for(ids, mask)
    losses, tensors, handle = [], {}, None
    try:
        for step in range(STEPS):
            if unpad is not None and step == patch_after:
                handle = patchkit.apply_patch(model=compiled, backend="sdpa", unpad=unpad)
            out = compiled(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
            out.loss.backward()
            losses.append(out.loss.item())
            tensors.update({f"grad{step}.{n}": p.grad.clone() for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
        tensors.update({f"param.{n}": p.detach().clone() for n, p in model.named_parameters()})
        if handle is not None and check is not None:
            check(compiled, handle)
    finally:
        if handle is not None:
            handle.revert()
    if handle is not None:
        assert not_restored(before, compiled) == []  # "" among them: the OptimizedModule's own compiled forward
        with pytest.raises(PatchTargetError, match="the patch was reverted"):
            handle.check(compiled)
    return losses, tensors


@pytest.fixture(scope="module")
def compiled_unpatched() -> tuple[list[float], dict[str, torch.Tensor]]:
    return compiled_run(None)


def patched_layers(steps: int, unpad: str) -> Callable[[torch.nn.Module, Any], None]:
    """Checks that every layer ran through the patch (compiled calls are not counted in `calls`) and the head and
    loss of each of `steps` patched forwards ran where `unpad` puts them."""

    def check(compiled: torch.nn.Module, handle: Any) -> None:
        assert handle.layers_patched == LAYERS
        assert handle.check(compiled) == handle.check(compiled._orig_mod) == LAYERS
        assert handle.heads == {HEADS[unpad]: steps} and handle.stepped_aside == {}

    return check


@pytest.mark.heavy  # make test-heavy
@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_instance_patch_through_torch_compile_equals_unpatched(
    compiled_unpatched: tuple[list[float], dict], unpad: str
) -> None:
    want_losses, want = compiled_unpatched
    losses, got = compiled_run(unpad, check=patched_layers(STEPS, unpad))
    assert losses == pytest.approx(want_losses, rel=1e-6, abs=1e-6)
    assert_tensors_equal(got, want)


def test_instance_patch_of_a_compiled_model_that_already_ran_recompiles_through_the_patch(
    compiled_unpatched: tuple[list[float], dict],
) -> None:
    """Patched after a compiled step: dynamo's guards see the new instance forwards, the next step runs patched."""
    want_losses, want = compiled_unpatched
    losses, got = compiled_run("model", backend="eager", patch_after=1, check=patched_layers(STEPS - 1, "model"))
    assert losses == pytest.approx(want_losses, rel=1e-6, abs=1e-6)
    assert_tensors_equal(got, want)
