"""Static-cache generation: prefill of a left-padded batch plus greedy decode, patchkit against HF sdpa and eager.

decode.py times the default dynamic cache; this times `generate(cache_implementation="static")`, which hands the
model a 4D mask before it runs, into one StaticCache per provider sized prompt + new tokens: eager, and compiled
the two ways HF users compile it: `model.forward = torch.compile(model.forward, fullgraph=True)` (`_compiled`: the
prefill in the graph too), and generate()'s own compilation (`_generate_compiled`: a `compile_config`; generate()
runs the prefill eager and each decode step's call compiled; on a GPU it does this unasked for a static cache, so
every other provider here turns it off). The main benchmark's tiny LLaMA and its batch of 8 lognormal lengths,
left-padded, fp32 on CPU; 64 new tokens. Providers run round-robin after one warm-up round (which also compiles),
medians kept. Throughput counts real tokens: the prompts' plus batch x new tokens. Eager providers must produce HF
sdpa's tokens; compiled ones print their share.

    python benchmarks/static_decode.py [--new-tokens 64] [--reps 3] [--kv-heads 8] [--scale 1.0] [--csv FILE]
        [--device cpu|cuda] [--compile-backend inductor] [--compile-mode reduce-overhead]

`--device cuda` is decode.py's: bench.py's CUDA model in bf16, the same batch, and the GPU kernel providers
(HF flash_attention_2, patchkit flash_attn and torch_varlen) where bench.py's probe finds them usable; tokens are
compared, not required. There patchkit runs on its best backend whose gates pass (flash_attn, else torch_varlen) in
every way it is compiled, HF flash_attention_2 runs with the same static cache eager and compiled by generate() (a
way that raises is a `skipped` row with the reason), and the rows add `peak_mib` (generate()'s peak memory above what
was allocated before it) and `note`. `--compile-mode` is torch.compile's mode ("reduce-overhead": CUDA graphs, as HF
users run static-cache decode on a GPU). `--budget-s` stops warming up further providers (those are left out) and
starting further rounds once spent (a provider warmed up gets one timed round); the CSV is written after each
`--kv-heads` run and on the way out, so the rows measured are kept. Each compiled provider's `recompiles` (graphs
dynamo compiled during the timed rounds, after the warm-up round compiled prefill and decode) and `graph_breaks` are
counted: a serving path must show 0 and 0.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import (  # noqa: E402
    FA2,
    Table,
    add_common_args,
    base_model,
    model_config,
    provider_model,
    providers,
    ratios,
    start,
)
from providers import Budget, one_line, patchkit_backends, probed, timed  # noqa: E402
from report import write_rows  # noqa: E402
from workloads import make_tokens, padded_batch  # noqa: E402

from patchkit.forward.inputs.arguments import cache_parameter  # noqa: E402

CSV = Path(__file__).resolve().parent / "results" / "static_decode.csv"
PROVIDERS = ("hf_eager", "hf_sdpa", "patchkit_sdpa", "patchkit_named_sdpa", "hf_sdpa_compiled",
             "patchkit_sdpa_compiled", "hf_sdpa_generate_compiled", "patchkit_sdpa_generate_compiled",
             "patchkit_named_sdpa_generate_compiled")
BY_GENERATE = "_generate_compiled"  # generate() compiles the decode steps itself (compile_config), prefill eager
FLASH = (FA2, "patchkit_flash_attn", "patchkit_torch_varlen")  # eager only, where bench.py's probe finds them (CUDA)


def static_providers(device: torch.device) -> tuple[str, ...]:
    """PROVIDERS on the CPU. On CUDA, most telling first (a --budget-s drops the last): HF sdpa, HF flash_attention_2
    where the probe finds it, and patchkit on its best backend, eager, then compiled by generate(), then with
    `model.forward` compiled (HF sdpa and patchkit only); then the other patchkit backends that run, and HF eager."""
    if device.type != "cuda":
        return PROVIDERS + tuple(p for p in providers(device) if p in FLASH)
    # the best backend that is also compiled: not flash_attn_4 (its CuTe kernels under torch.compile are untried),
    # which runs eager among the rest
    best = f"patchkit_{next(b for b in patchkit_backends(device) if b != 'flash_attn_4')}"
    fa2 = (FA2,) if FA2 in providers(device) else ()
    first = ("hf_sdpa", *fa2, best, "hf_sdpa" + BY_GENERATE, *(f + BY_GENERATE for f in fa2), best + BY_GENERATE,
             "hf_sdpa_compiled", best + "_compiled")
    rest = (p for p in providers(device) if p.startswith("patchkit_") and p not in first)
    return tuple(dict.fromkeys((*first, *rest, "hf_eager")))


def skipped_fa2(device: torch.device) -> dict[str, str]:
    """On CUDA without a usable HF flash_attention_2: its providers here, each with the probe's reason."""
    why = dict(probed(device)[1]).get(FA2) if device.type == "cuda" else None
    return {FA2: why, FA2 + BY_GENERATE: why} if why else {}


def build(kv_heads: int, device: torch.device, compile_backend: str, compile_mode: str | None,
          window: int | None = None, skipped: dict[str, str] | None = None) -> dict[str, torch.nn.Module]:
    """One model per provider, the same weights (decode.py's): `_compiled` ones with `model.forward` compiled after
    the patch, as a user would; `_generate_compiled` ones with a `compile_config`, so that generate() compiles each
    decode step's call and runs the prefill eager. Every other provider has generate()'s own compilation turned off:
    on a GPU it compiles a static cache's decode steps unasked (CUDA graphs), which would time compiled decode
    under an eager name. On CUDA a provider whose attention does not load is left out, its reason in `skipped`."""
    base = base_model(kv_heads, device, window)
    models = {}
    for name in static_providers(device):
        try:
            model = provider_model(base, name, strict=not name.endswith("_compiled"))  # compiled: its decode steps
            # (and the prefill in `model.forward`'s graph) run transformers' attention, said as compiled_4d_mask
        except (ValueError, ImportError) as exc:  # e.g. HF flash_attention_2 refusing this model
            if device.type != "cuda" or skipped is None:
                raise
            skipped[name] = one_line(exc)
            continue
        if name.endswith(BY_GENERATE):
            model.generation_config.compile_config = generate_compile_config(compile_backend, compile_mode)
        else:
            model.generation_config.disable_compile = True
            if name.endswith("_compiled"):
                model.forward = torch.compile(model.forward, backend=compile_backend, mode=compile_mode,
                                              fullgraph=True)
        models[name] = model
    return models


def suffix(name: str) -> str:
    """How provider `name` is compiled: "", "_compiled" or "_generate_compiled"."""
    return next((s for s in (BY_GENERATE, "_compiled") if name.endswith(s)), "")


def hf_counterpart(name: str) -> str:
    """The HF sdpa provider compiled the way `name` is: hf_sdpa, hf_sdpa_compiled or hf_sdpa_generate_compiled."""
    return "hf_sdpa" + suffix(name)


def generate_compile_config(backend: str, mode: str | None) -> Any:
    """transformers' CompileConfig for generate(): fullgraph, `backend` and `mode`, on any device (generate()
    compiles on accelerators only unless told)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, backend=backend, mode=mode or "default")
    config._compile_all_devices = True
    return config


def static_cache(model: torch.nn.Module, batch: int, max_len: int) -> Any:
    """A StaticCache of `max_len` slots, its tensors made now on the model's device and dtype (as generate() makes
    its own): made lazily they would be made inside the compiled prefill (under CUDA graphs, in its memory pool)."""
    from transformers import StaticCache

    config = model.config
    cache = StaticCache(config=config, max_cache_len=max_len)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache.early_initialization(batch_size=batch, num_heads=config.num_key_value_heads, head_dim=head_dim,
                               dtype=model.dtype, device=model.device)
    return cache


def compile_counts() -> tuple[int, int]:
    """(graphs dynamo has compiled, graph breaks it has met) so far in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def cache_name(model: torch.nn.Module) -> str:
    """generate()'s cache argument in this transformers: `cache` from 5.24, `past_key_values` before."""
    return cache_parameter(inspect.signature(model.forward).parameters)


def timed_generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int, cache: Any) -> tuple[
        float, float | None, Any]:
    """Seconds for a greedy generate() of exactly `new` tokens into `cache` (a StaticCache, emptied first: one size
    for every call, so a compiled forward keeps its two graphs, prefill and decode), its peak memory on CUDA (MiB,
    else None), and the sequences."""
    cache.reset()
    with torch.no_grad():
        return timed(lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                            do_sample=False, pad_token_id=0, **{cache_name(model): cache}), ids.device)


def measure(lengths: list[int], new: int, reps: int, kv_heads: int, device: torch.device, compile_backend: str,
            compile_mode: str | None = None, window: int | None = None, budget: Budget | None = None) -> list[dict]:
    """Round-robin medians of prefill + decode and of prefill + one token, per provider; tokens compared; for the
    compiled providers, graphs compiled and graph breaks met in the timed rounds. Once `budget` is spent no further
    provider is warmed up and no further round started; on CUDA a provider failing in its warm-up is a skipped row."""
    budget = budget or Budget(None)
    ids, mask, _ = padded_batch(make_tokens(lengths, model_config(device)[0]["vocab"]), left=True)
    ids, mask = ids.to(device), mask.to(device)
    skipped = skipped_fa2(device)
    models = build(kv_heads, device, compile_backend, compile_mode, window, skipped)
    caches = {name: static_cache(m, len(lengths), ids.shape[1] + new) for name, m in models.items()}
    total: dict[str, list[float]] = {name: [] for name in models}
    prefill: dict[str, list[float]] = {name: [] for name in models}
    peak = dict.fromkeys(models, 0.0)
    recompiles = dict.fromkeys(models, 0)
    breaks = dict.fromkeys(models, 0)
    tokens: dict[str, torch.Tensor] = {}
    for rep in range(reps + 1):  # the first round warms up (and compiles)
        if rep > 1 and budget.spent(f"kv_heads {kv_heads}: rounds {rep}-{reps} of {reps}"):
            break
        for name, model in list(models.items()):
            if not rep and name != "hf_sdpa" and budget.spent(f"kv_heads {kv_heads}: {name}"):
                del models[name]
                continue
            graphs, broken = compile_counts()
            try:
                seconds, used, tokens[name] = timed_generate(model, ids, mask, new, caches[name])
                first, _, _ = timed_generate(model, ids, mask, 1, caches[name])
            except Exception as exc:  # noqa: BLE001 - on CUDA a provider failing its warm-up is a skipped row
                if rep or device.type != "cuda" or name == "hf_sdpa":
                    raise
                skipped[name] = one_line(exc)
                del models[name]
                continue
            if rep:
                total[name].append(seconds)
                prefill[name].append(first)
                peak[name] = max(peak[name], used or 0.0)
                graphs_now, broken_now = compile_counts()
                recompiles[name] += graphs_now - graphs
                breaks[name] += broken_now - broken
    same = {name: (tokens[name] == tokens["hf_sdpa"]).float().mean().item() for name in models}
    for name in (n for n in models if not n.endswith("_compiled") and same[n] < 1 and device.type != "cuda"):
        raise SystemExit(f"{name} generated other tokens than hf_sdpa: the comparison would be meaningless")
    real = sum(lengths) + len(lengths) * new
    rows = []
    for name in models:
        med, first = statistics.median(total[name]), statistics.median(prefill[name])
        compiled = name.endswith("_compiled")
        twin = total.get(hf_counterpart(name))
        rows.append(dict(
            provider=name, kv_heads=kv_heads, window=window or "", new_tokens=new, median_s=round(med, 4),
            min_s=round(min(total[name]), 4),
            max_s=round(max(total[name]), 4), prefill_s=round(first, 4), real_tokens_per_s=round(real / med, 1),
            decode_tokens_per_s=round(len(lengths) * (new - 1) / (med - first), 1) if med > first else float("nan"),
            **ratios(total, name, FA2 + suffix(name)),
            vs_hf_same=round(statistics.median(twin) / med, 2) if twin else "",
            same_tokens=round(same[name], 4), reps=len(total[name]),
            compile_backend=compile_backend if compiled else "", compile_mode=(compile_mode or "default") if compiled
            else "", recompiles=recompiles[name] if compiled else "", graph_breaks=breaks[name] if compiled else "",
            device=device.type, threads=torch.get_num_threads(), torch=torch.__version__,
            **(dict(peak_mib=round(peak[name], 1), note="") if device.type == "cuda" else {}),
        ))
    blank = dict.fromkeys(rows[0], "") if rows else {}
    rows += [dict(blank, provider=name, kv_heads=kv_heads, new_tokens=new, reps=0, device=device.type,
                  note=f"skipped: {reason}") for name, reason in skipped.items()]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/static_decode.py", description=__doc__.split("\n\n")[0])
    add_common_args(parser, reps=3, smoke_scale=0.05, budget=True)
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (eager: a smoke run)")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile mode (default: its default; reduce-overhead: CUDA graphs)")
    parser.add_argument("--csv", type=Path, default=CSV, help=f"where to write the rows (default {CSV})")
    args = parser.parse_args(argv)
    run = start("static_decode", args, " into a static cache", f"; compiled: {args.compile_backend}, mode "
                f"{args.compile_mode or 'default'}, fullgraph")
    if run is None:
        return 0
    device, lengths = run
    budget = Budget(args.budget_s)
    cuda = device.type == "cuda"
    table = Table(38, fa2=FA2 in static_providers(device),
                  extra=(("vs HF same", "vs_hf_same"), ("recompiles", "recompiles"), ("graph breaks", "graph_breaks"))
                  + ((("peak MiB", "peak_mib"),) if cuda else ()))
    rows: list[dict] = []
    try:
        for kv_heads in args.kv_heads:
            if rows and budget.spent(f"kv_heads {kv_heads}"):
                continue
            for row in measure(lengths, args.new_tokens, args.reps, kv_heads, device, args.compile_backend,
                               args.compile_mode, args.window, budget):
                rows.append(row)
                if row.get("note", "").startswith("skipped"):
                    print(f"{row['provider']:<38}{row['kv_heads']:>4}  {row['note']}", flush=True)
                else:
                    table.row(row)
            write_rows(args.csv, rows)  # after every run: a budget or a failure keeps what was measured
    finally:
        budget.report("static_decode")
    bad = [f"{r['provider']} (kv {r['kv_heads']}): {r['recompiles']} recompiles, {r['graph_breaks']} graph breaks"
           for r in rows if r["recompiles"] not in ("", 0) or r["graph_breaks"] not in ("", 0)]
    print("compiled providers: " + ("; ".join(bad) if bad else "0 recompiles and 0 graph breaks after warm-up"))
    judged = args.scale == 1.0 and args.new_tokens == 64
    for row in (r for r in rows if r["provider"].startswith("patchkit_") and r["provider"].endswith("_compiled")):
        verdict = ("ok" if row["vs_hf_same"] >= 1.0 else "MISS") if judged else "not judged (not the stated run)"
        print(f"target {row['provider']} >= {hf_counterpart(row['provider'])}, kv_heads {row['kv_heads']}: "
              f"{row['vs_hf_same']}x {verdict}")
    print(f"rows written to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
