"""Generation per model family: a decode step behind a left-padded prefill, patchkit against HF's own attention.

The text families of `families.py` at its size (hidden 256, 4 layers, 8 heads, 2 K/V heads; each family's special
feature biting: windows, softcap, GPT-OSS's sinks, DeepSeek-V4's compressed entries, the hybrids' recurrent layers)
in eval mode, on a left-padded batch of 8 lognormal lengths (a quarter of the main benchmark's, by default). A greedy
`generate()` of `--new-tokens` is clocked inside (a logits processor stamps each forward's logits), providers
alternating: the prefill is the time to the first logits, a decode step the median gap between later ones. HF's
attention is sdpa, or eager where transformers has no sdpa path for the family (GPT-OSS, DeepSeek-V4, Gemma2). Every
provider must generate HF's tokens on the CPU. A decode step has no padding query, so varlen saves nothing there:
this measures what patchkit costs or saves per step (its decode kernel on the padded cache, its Python per layer and
per forward).

    python benchmarks/family_decode.py [--families gpt_oss deepseek_v4 llama] [--reps 5] [--new-tokens 32]
        [--scale 0.25] [--csv out.csv] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import clocked_generate  # noqa: E402
from families import VL, build, text_config  # noqa: E402
from providers import add_run_args, no_cuda, one_line, patch_on_best  # noqa: E402
from report import write_rows  # noqa: E402
from workloads import hf_size, lognormal_lengths, make_tokens, padded_batch, padding_fraction  # noqa: E402

CSV = Path(__file__).resolve().parent / "results" / "family_decode.csv"
DEFAULT = ["llama", "mistral", "gemma2", "gpt_oss", "deepseek_v3", "deepseek_v4", "llama4_text", "qwen3_next",
           "jamba"]


def measure(family: str, lengths: list[int], new: int, reps: int, device: torch.device) -> list[dict]:
    """Round-robin medians of the prefill and of a decode step, HF and patchkit; the tokens checked equal."""
    reference, implementation = build(family, device)
    reference.eval()
    ids, mask, _ = padded_batch(make_tokens(lengths, hf_size(device.type)["vocab_size"]), left=True)
    ids, mask = ids.to(device), mask.to(device)
    model = copy.deepcopy(reference)
    handle, backend, _ = patch_on_best("llama2" if family == "llama" else family, model, device, strict=False)
    hf = f"hf_{implementation}"
    models = {hf: reference, "patchkit": model}
    steps: dict[str, list[float]] = {name: [] for name in models}
    first: dict[str, list[float]] = {name: [] for name in models}
    tokens: dict[str, torch.Tensor] = {}
    try:
        for rep in range(reps + 1):  # the first round warms up
            for name, net in models.items():
                prefill, gaps, tokens[name] = clocked_generate(net, ids, mask, new)
                if rep:
                    first[name].append(prefill)
                    steps[name].extend(gaps)
    finally:
        handle.revert()
    same = (tokens["patchkit"] == tokens[hf]).float().mean().item()
    if same < 1 and device.type != "cuda":
        raise SystemExit(f"{family}: patchkit generated other tokens than {hf}: the comparison would be meaningless")
    step = {name: statistics.median(steps[name]) for name in models}
    rows = []
    for name in models:
        prefill = statistics.median(first[name])
        rows.append(dict(
            family=family, provider=name, backend=backend if name == "patchkit" else implementation,
            new_tokens=new, prefill_s=round(prefill, 4), step_ms=round(step[name] * 1e3, 3),
            prefill_vs_hf=round(statistics.median(first[hf]) / prefill, 2), step_vs_hf=round(step[hf] / step[name], 2),
            same_tokens=round(same, 4), reps=reps, device=device.type, threads=torch.get_num_threads(),
        ))
        print(f"{family:<16}{name:<12}{prefill:>10.3f}{rows[-1]['step_ms']:>10.2f}{rows[-1]['prefill_vs_hf']:>11.2f}x"
              f"{rows[-1]['step_vs_hf']:>10.2f}x", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/family_decode.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=DEFAULT)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--scale", type=float, default=0.25, help="multiply the main benchmark's prompt lengths")
    parser.add_argument("--csv", type=Path, default=CSV, help=f"where to write the rows (default {CSV})")
    add_run_args(parser, budget=False)
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: a decode step is timed after the first token")
    if no_cuda("family_decode", args.device):
        return 0
    unknown = [f for f in args.families if f in VL or not _known(f)]
    if unknown:
        parser.error(f"not a text family of benchmarks/families.py: {', '.join(unknown)}")
    device = torch.device(args.device)
    lengths = lognormal_lengths(8, args.scale)
    print(f"left-padded batch of 8, lengths {lengths}, {padding_fraction(lengths):.1%} padding; {args.new_tokens} "
          f"greedy tokens; {args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}; {args.reps} "
          "round-robin reps, medians")
    print(f"{'family':<16}{'provider':<12}{'prefill s':>10}{'step ms':>10}{'prefill x':>12}{'step x':>11}")
    rows: list[dict] = []
    failed: dict[str, str] = {}
    for family in args.families:
        try:
            rows += measure(family, lengths, args.new_tokens, args.reps, device)
        except Exception as exc:  # noqa: BLE001 - one family failing must not cost the others' rows
            failed[family] = one_line(exc, 300)
            print(f"{family:<16}failed: {failed[family]}", flush=True)
        if rows:
            write_rows(args.csv, rows)  # after every family: a failure keeps what was measured
    print(f"wrote {args.csv}")
    if failed:
        print(f"family_decode: {len(failed)} failed: {', '.join(failed)}")
    return 1 if failed else 0


def _known(family: str) -> bool:
    try:
        text_config(family, hf_size("cpu"))
    except KeyError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
