"""Host work of one decode step per layer, counted: Python calls and torch ops, patchkit against HF sdpa.

On a GPU a decode step is host-bound (the GPU run found ~5 ms of host for ~1.5 ms of GPU work, 8 tokens, 4 layers),
and on a loaded CPU its time is noise. Counts are not: each provider runs the same step (one new token per row
behind a left-padded prefill in a DynamicCache) under `sys.setprofile`, counting Python function calls (and calls
into C), and under a TorchDispatchMode counting the aten ops that reach a kernel. The difference between two
layer counts, divided by the difference in layers, is the cost of one decoder layer; the rest is the model's
per-step overhead (embedding, mask, norm, head). Then the same step is timed on a LLaMA so small that its
arithmetic is nothing (hidden 64): its wall time is host work, what a GPU's decode step waits on (`step_us`, the
least of several round-robin block medians, and `vs_hf` = HF's time / patchkit's). Prints a table, writes a CSV.

    python benchmarks/host_ops.py [--kv-heads 2] [--blocks 20] [--csv FILE]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_rows  # noqa: E402
from workloads import MODEL, make_tokens, padded_batch  # noqa: E402

import patchkit  # noqa: E402
from patchkit.forward.inputs.arguments import cache_parameter  # noqa: E402

CSV = Path(__file__).resolve().parent / "results" / "host_ops.csv"
LENGTHS = [24, 9, 17, 32]  # a left-padded batch of 4 prompts
HOST_BOUND = {"vocab": 128, "hidden": 64, "intermediate": 128, "heads": 4}  # arithmetic ~ nothing: time is host work
STEPS_PER_BLOCK = 15


class AtenCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count(make: Callable[[], Callable[[], Any]]) -> tuple[int, int, int]:
    """(Python calls, calls into C, aten ops) of one step: two runs of it, each counter alone (neither counts the
    other's own work)."""
    calls = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        calls[event] += 1

    step = make()
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    step = make()
    with AtenCounter() as aten:
        step()
    return calls["call"], calls["c_call"] - 1, sum(aten.ops.values())  # less the call of setprofile(None)


def models(layers: int, kv_heads: int, dims: dict = MODEL) -> dict[str, torch.nn.Module]:
    """The benchmark's tiny LLaMA with `layers` layers: HF sdpa, and the same weights instance-patched (sdpa)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=dims["vocab"], hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
        num_hidden_layers=layers, num_attention_heads=dims["heads"], num_key_value_heads=kv_heads,
        max_position_embeddings=512, pad_token_id=0, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval()
    patched = copy.deepcopy(base)
    patchkit.apply_patch("llama2", model=patched, backend="sdpa", strict=True)
    return {"hf_sdpa": base, "patchkit_sdpa": patched}


def decode_step(model: torch.nn.Module) -> tuple[Callable[[], Any], torch.Tensor]:
    """A maker of one decode step after a left-padded prefill (a fresh copy of the cache each), and its logits."""
    from transformers import DynamicCache

    ids, mask, _ = padded_batch(make_tokens(LENGTHS, model.config.vocab_size), left=True)
    with torch.no_grad():
        name = cache_parameter(inspect.signature(model.forward).parameters)  # `cache` from transformers 5.24
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{name: DynamicCache(config=model.config)})
    prefilled = copy.deepcopy(out.past_key_values)
    nxt = out.logits[:, -1:].argmax(-1)
    step_mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    positions = (step_mask.sum(-1, keepdim=True) - 1)

    def step() -> Callable[[], Any]:
        cache = copy.deepcopy(prefilled)  # outside what is counted

        def run() -> Any:
            with torch.no_grad():
                return model(input_ids=nxt, attention_mask=step_mask, position_ids=positions, use_cache=True,
                             **{name: cache}).logits

        return run

    return step, step()()


def step_times(kv_heads: int, blocks: int) -> dict[str, float]:
    """Per provider, the least block median of a decode step's wall time (us) on the host-bound model, providers
    round-robin block by block (a fresh copy of the prefilled cache per step, outside the time)."""
    built = models(MODEL["layers"], kv_heads, HOST_BOUND)
    steps = {name: decode_step(model)[0] for name, model in built.items()}
    medians: dict[str, list[float]] = {name: [] for name in steps}
    for block in range(blocks + 1):  # the first block warms up
        for name, step in steps.items():
            times = []
            for _ in range(STEPS_PER_BLOCK):
                run = step()
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            if block:
                medians[name].append(statistics.median(times) * 1e6)
    return {name: min(m) for name, m in medians.items()}


def measure(kv_heads: int, blocks: int) -> list[dict]:
    """Counts at 2 and 4 layers per provider: per layer, and the per-step rest; logits checked equal."""
    rows, by = [], {}
    for layers in (2, 4):
        built = models(layers, kv_heads)
        logits = {}
        for name, model in built.items():
            step, logits[name] = decode_step(model)
            step()()  # warm: lazily built state (the patch's first call) is not per-step work
            by[name, layers] = list(count(step))
        torch.testing.assert_close(logits["patchkit_sdpa"], logits["hf_sdpa"], atol=1e-4, rtol=1e-4)
    times = step_times(kv_heads, blocks)
    for name in ("hf_sdpa", "patchkit_sdpa"):
        per_layer = [(b - a) / 2 for a, b in zip(by[name, 2], by[name, 4])]
        rest = [a - 2 * p for a, p in zip(by[name, 2], per_layer)]
        rows.append(dict(provider=name, kv_heads=kv_heads, py_calls_per_layer=per_layer[0],
                         c_calls_per_layer=per_layer[1], aten_ops_per_layer=per_layer[2], py_calls_rest=rest[0],
                         c_calls_rest=rest[1], aten_ops_rest=rest[2], step_us=round(times[name], 1),
                         vs_hf=round(times["hf_sdpa"] / times[name], 3), torch=torch.__version__))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/host_ops.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=20, help="timed blocks of the host-bound step per provider")
    parser.add_argument("--csv", type=Path, default=CSV)
    args = parser.parse_args(argv)
    rows = measure(args.kv_heads, args.blocks)
    keys = ["py_calls_per_layer", "c_calls_per_layer", "aten_ops_per_layer", "py_calls_rest", "c_calls_rest",
            "aten_ops_rest", "step_us", "vs_hf"]
    print(f"one decode step (4 rows, left-padded, {args.kv_heads} K/V heads): counts per layer and the rest; "
          f"step_us: the step's wall time on the hidden-64 model (host work), {MODEL['layers']} layers")
    print(f"{'provider':<15}" + "".join(f"{k:>20}" for k in keys))
    for row in rows:
        print(f"{row['provider']:<15}" + "".join(f"{row[k]:>20}" for k in keys))
    write_rows(args.csv, rows)
    print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
