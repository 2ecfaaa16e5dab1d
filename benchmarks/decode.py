"""Generation: prefill of a left-padded batch plus greedy decode, patchkit against HF sdpa and eager.

The main benchmark's tiny LLaMA (hidden 256, 4 layers, 8 heads) and its batch of 8 lognormal lengths, left-padded,
fp32 on CPU; `generate()` with 64 new tokens (min_new_tokens, so every run decodes all of them). Providers run
round-robin, one warm-up round first, medians kept; every provider must produce the same tokens as HF sdpa.
Throughput counts real tokens: the prompts' plus batch x new tokens. A `generate()` of one new token is timed too,
so the table also splits prefill from decode (decode tok/s: new tokens after the first per second of the rest).

    python benchmarks/decode.py [--new-tokens 64] [--reps 5] [--kv-heads 8] [--scale 1.0] [--csv FILE]

`--device cuda` runs bench.py's CUDA model (hidden 2048, 16 heads of 128) in bf16 and adds what bench.py's probe
finds usable there: HF's flash_attention_2 and patchkit's flash_attn and torch_varlen backends. Ratios stay against
HF sdpa; `vs_hf_fa2` is each provider against HF flash_attention_2 where that ran. There bf16 kernels may pick
another token at a near tie of random weights, so the share of tokens equal to HF sdpa's is printed rather than
required.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from providers import HF_PROVIDERS, add_run_args, no_cuda, probed, timed  # noqa: E402
from report import write_rows  # noqa: E402
from workloads import MODEL, MODES, lognormal_lengths, make_tokens, padded_batch, padding_fraction  # noqa: E402

import patchkit  # noqa: E402

TARGET = 1.2  # prefill + 64-token decode: at least 1.2x HF sdpa
CSV = Path(__file__).resolve().parent / "results" / "decode.csv"
PROVIDERS = ("hf_eager", "hf_sdpa", "patchkit_sdpa")
FA2 = "hf_flash_attention_2"
NAMED = "patchkit_named_"  # attn_implementation="patchkit" alone, no patch
BATCH = 8  # bench.py's lognormal batch, on either device


def model_config(device: torch.device) -> tuple[dict[str, int], torch.dtype]:
    """The model's sizes and dtype: bench.py's CUDA model in bf16 on a GPU, its tiny LLaMA in fp32 on the CPU."""
    if device.type == "cuda":
        return MODES["cuda"]["model"], torch.bfloat16
    return MODEL, torch.float32


@functools.cache
def providers(device: torch.device) -> tuple[str, ...]:
    """PROVIDERS, plus each other provider bench.py's probe finds usable here (on a GPU: HF flash_attention_2 and
    patchkit's flash_attn and torch_varlen backends, where installed and their gates pass)."""
    ok = probed(device)[0]
    return PROVIDERS + tuple(p for p in ok if p not in PROVIDERS)


def base_model(kv_heads: int, device: torch.device, window: int | None = None) -> torch.nn.Module:
    """The random model (seed 0) every provider copies, in eval mode on `device` in its dtype: a LLaMA, or with a
    `window`, a Mistral of the same size whose every layer slides over that many keys."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    cfg, dtype = model_config(device)
    kind, model_class = (LlamaConfig, LlamaForCausalLM) if window is None else (MistralConfig, MistralForCausalLM)
    config = kind(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"], num_key_value_heads=kv_heads,
        max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
        **({} if window is None else {"sliding_window": window, "head_dim": cfg["hidden"] // cfg["heads"]}),
    )
    torch.manual_seed(0)
    return model_class(config).eval().to(device, dtype)


def provider_model(base: torch.nn.Module, name: str, strict: bool = True) -> torch.nn.Module:
    """A copy of `base` running as provider `name`: an HF attention implementation (hf_*), patchkit instance-patched
    on backend <b> (patchkit_<b>, over HF sdpa), or `attn_implementation="patchkit"` alone on backend <b>
    (patchkit_named_<b>); how it is compiled (a `_compiled` suffix) is left to the caller. `strict`: a forward
    patchkit would step aside for raises (False where the caller counts what stepped aside)."""
    name = name.split("_generate_compiled")[0].removesuffix("_compiled")
    model = copy.deepcopy(base)
    if name.startswith(NAMED):
        patchkit.register_attention(backend=name.removeprefix(NAMED), strict=strict)
        model.set_attn_implementation(patchkit.ATTENTION_NAME)
        return model
    model.set_attn_implementation(HF_PROVIDERS.get(name, "sdpa"))
    if name.startswith("patchkit_"):
        patchkit.apply_patch(model=model, backend=name.removeprefix("patchkit_"), strict=strict)  # its family's
    return model


def build(kv_heads: int, device: torch.device, window: int | None = None) -> dict[str, torch.nn.Module]:
    """One model per provider, the same weights."""
    base = base_model(kv_heads, device, window)
    return {name: provider_model(base, name) for name in providers(device)}


def add_common_args(parser: argparse.ArgumentParser, reps: int, smoke_scale: float, budget: bool = False) -> None:
    """The arguments decode.py and static_decode.py share (`budget`: --budget-s too)."""
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[MODEL["heads"]],
                        help="key/value heads, one run each (8: MHA as in bench.py; 2: GQA)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help=f"multiply the prompt lengths ({smoke_scale} for a smoke run)")
    parser.add_argument("--window", type=int, default=None,
                        help="a Mistral of the same size whose layers slide over this many keys (default: LLaMA)")
    add_run_args(parser, budget)


def where(device: torch.device) -> str:
    if device.type == "cuda":
        return f"bf16 on {torch.cuda.get_device_name()}"
    return f"fp32, {torch.get_num_threads()} threads"


def start(
    prog: str, args: argparse.Namespace, into: str = "", settings: str = ""
) -> tuple[torch.device, list[int]] | None:
    """A run's device and prompt lengths, its first line printed (`into`: where the tokens go, `settings`: what
    else the run holds fixed); None, said, for --device cuda on a machine without one."""
    if no_cuda(prog, args.device):
        return None
    device = torch.device(args.device)
    lengths = lognormal_lengths(BATCH, args.scale)
    print(f"left-padded batch of {BATCH}, lengths {lengths}, {padding_fraction(lengths):.1%} padding; "
          f"{args.new_tokens} greedy tokens{into}; {where(device)}, torch {torch.__version__}; {args.reps} round-robin "
          f"reps, medians{settings}")
    return device, lengths


def ratios(total: dict[str, list[float]], name: str, fa2_name: str = FA2) -> dict[str, Any]:
    """vs_hf_sdpa and vs_hf_fa2 (against `fa2_name`, HF flash_attention_2 as the caller runs it; empty when that did
    not run): ratios of medians, higher is faster."""
    med = statistics.median(total[name])
    fa2 = round(statistics.median(total[fa2_name]) / med, 2) if total.get(fa2_name) else ""
    return dict(vs_hf_sdpa=round(statistics.median(total["hf_sdpa"]) / med, 2), vs_hf_fa2=fa2)


class Table:
    """The printed table: one line per row, a `vs HF fa2` column only when HF flash_attention_2 runs, and any
    `extra` integer columns (name, CSV key) after `same tokens`."""

    def __init__(self, width: int, fa2: bool, extra: tuple[tuple[str, str], ...] = ()) -> None:
        self.width, self.fa2, self.extra = width, fa2, extra
        print(f"{'provider':<{width}}{'kv':>4}{'median s':>10}{'prefill s':>11}{'real tok/s':>12}{'decode tok/s':>14}"
              f"{'vs HF sdpa':>12}" + (f"{'vs HF fa2':>11}" if fa2 else "") + f"{'same tokens':>13}"
              + "".join(f"{title:>{len(title) + 2}}" for title, _ in extra))

    def row(self, row: dict[str, Any]) -> None:
        fa2 = "" if not self.fa2 else f"{'':>11}" if row["vs_hf_fa2"] == "" else f"{row['vs_hf_fa2']:>10.2f}x"
        extra = "".join(f"{row[key]!s:>{len(title) + 2}}" for title, key in self.extra)
        print(f"{row['provider']:<{self.width}}{row['kv_heads']:>4}{row['median_s']:>10.3f}{row['prefill_s']:>11.3f}"
              f"{row['real_tokens_per_s']:>12.1f}{row['decode_tokens_per_s']:>14.1f}{row['vs_hf_sdpa']:>11.2f}x"
              f"{fa2}{row['same_tokens']:>12.1%}{extra}", flush=True)


def timed_generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int) -> tuple[float, Any]:
    """Seconds for a greedy generate() of exactly `new` tokens, and the sequences."""
    with torch.no_grad():
        seconds, _, out = timed(lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                                       min_new_tokens=new, do_sample=False, pad_token_id=0), ids.device)
    return seconds, out


class _Clock:
    """A logits processor that stamps the time each forward's logits reach it (after a CUDA sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.stamps = device, [time.perf_counter()]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def clocked_generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int,
                     ) -> tuple[float, list[float], Any]:
    """A greedy generate() of exactly `new` tokens, clocked inside: the seconds to the first logits (the prefill),
    each decode step's seconds after it (measured, never a difference of two runs' totals), and the sequences."""
    from transformers import LogitsProcessorList

    clock = _Clock(ids.device)
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    clock.stamps[0] = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    gaps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    return gaps[0], gaps[1:], out


def measure(lengths: list[int], new: int, reps: int, kv_heads: int, device: torch.device,
            window: int | None = None) -> list[dict]:
    """Round-robin medians of prefill + decode and of prefill + one token, per provider; tokens checked equal."""
    ids, mask, _ = padded_batch(make_tokens(lengths, model_config(device)[0]["vocab"]), left=True)
    ids, mask = ids.to(device), mask.to(device)
    models = build(kv_heads, device, window)
    names = tuple(models)
    total: dict[str, list[float]] = {name: [] for name in names}
    prefill: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, torch.Tensor] = {}
    for rep in range(reps + 1):  # the first round warms up
        for name, model in models.items():
            seconds, out = timed_generate(model, ids, mask, new)
            first, _ = timed_generate(model, ids, mask, 1)
            tokens[name] = out
            if rep:
                total[name].append(seconds)
                prefill[name].append(first)
    same = {name: (tokens[name] == tokens["hf_sdpa"]).float().mean().item() for name in names}
    for name in names:
        if same[name] < 1 and device.type != "cuda":
            raise SystemExit(f"{name} generated other tokens than hf_sdpa: the comparison would be meaningless")
    real = sum(lengths) + len(lengths) * new
    rows = []
    for name in names:
        med, first = statistics.median(total[name]), statistics.median(prefill[name])
        rows.append(dict(
            provider=name, kv_heads=kv_heads, window=window or "", new_tokens=new, median_s=round(med, 4),
            min_s=round(min(total[name]), 4),
            max_s=round(max(total[name]), 4), prefill_s=round(first, 4),
            real_tokens_per_s=round(real / med, 1),
            decode_tokens_per_s=round(len(lengths) * (new - 1) / max(med - first, 1e-9), 1),
            **ratios(total, name), same_tokens=round(same[name], 4), reps=reps, device=device.type,
            threads=torch.get_num_threads(), torch=torch.__version__,
        ))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/decode.py", description=__doc__.split("\n\n")[0])
    add_common_args(parser, reps=5, smoke_scale=0.1)
    parser.add_argument("--csv", type=Path, default=CSV, help=f"where to write the rows (default {CSV})")
    args = parser.parse_args(argv)
    run = start("decode", args)
    if run is None:
        return 0
    device, lengths = run
    table = Table(22, fa2=FA2 in providers(device))
    rows = []
    for kv_heads in args.kv_heads:
        for row in measure(lengths, args.new_tokens, args.reps, kv_heads, device, args.window):
            rows.append(row)
            table.row(row)
    judged = args.scale == 1.0 and args.new_tokens == 64 and device.type == "cpu"
    for row in (r for r in rows if r["provider"] == "patchkit_sdpa"):
        verdict = ("ok" if row["vs_hf_sdpa"] >= TARGET else "MISS") if judged else "not judged (not the stated run)"
        print(f"target prefill + 64-token decode >= {TARGET}x HF sdpa, kv_heads {row['kv_heads']}: "
              f"{row['vs_hf_sdpa']}x {verdict}")
    write_rows(args.csv, rows)
    print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
