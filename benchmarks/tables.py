"""The performance tables of the docs, written from the CSVs the benchmarks leave in benchmarks/results/.

    python benchmarks/tables.py            # rewrite docs/performance.md and README.md between their markers
    python benchmarks/tables.py --check    # exit 1 if either differs from what the CSVs give

A table sits between `<!-- table:NAME -->` and `<!-- /table:NAME -->`; everything outside the markers is prose,
kept as written. tests/test_docs.py keeps both pages equal to this script's output, so a number the docs quote
is a number a benchmark wrote.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPO = HERE.parent
PAGES = [REPO / "docs" / "performance.md", REPO / "README.md"]
PATCHKIT_ORDER = ("patchkit_flash_attn", "patchkit_torch_varlen", "patchkit_sdpa")  # as benchmarks/report.py judges
sys.path.insert(0, str(REPO / "tools"))
from gpu_truth_goals import goals, median, read_csv  # noqa: E402  (the gpu-truth run's goals, measured once)


def read(name: str) -> list[dict[str, str]]:
    with (RESULTS / name).open(newline="") as f:
        return list(csv.DictReader(f))


def x(value: float) -> str:
    return f"{value:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


class Run:
    """One `patchkit bench` run of a results.csv (its latest, by timestamp): medians by (provider, workload, x)."""

    def __init__(self, name: str) -> None:
        rows = read(name)
        stamp = max(r["timestamp"] for r in rows)
        self.rows = [r for r in rows if r["timestamp"] == stamp]
        self.meta = self.rows[0]
        self.median = {(r["provider"], r["workload"], r["x"]): float(r["median"]) for r in self.rows if r["median"]}
        self.patch = next(p for p in PATCHKIT_ORDER if any(k[:2] == (p, "train_padded") for k in self.median))
        self.padding = float(next(k[2] for k in self.median if k[:2] == (self.patch, "train_padded")))

    def get(self, provider: str, workload: str, at: str = "") -> float | None:
        for (p, w, x_), value in self.median.items():
            if (p, w) == (provider, workload) and (not at or x_ == at):
                return value
        return None

    def ratio(self, a: tuple[str, str], b: tuple[str, str], at: str = "") -> str:
        num, den = self.get(*a, at), self.get(*b, at)
        return x(num / den) if num and den else "-"

    def machine(self) -> str:
        m = self.meta
        return (f"{m['device']}, {m['threads']} threads, {m['dtype']}, torch {m['torch']}, transformers "
                f"{m['transformers']}, run {m['timestamp'][:16].replace('T', ' ')} UTC")


def bench_table(name: str) -> str:
    run = Run(name)
    pk = run.patch
    sweep = sorted({k[2] for k in run.median if k[1] == "train_pad_sweep"}, key=float)
    mem_n = max((k[2] for k in run.median if k[1] == "long_peak_mem"), key=int, default="")
    rows = [
        ["padded train step", "HF sdpa / HF eager",
         f"{run.ratio((pk, 'train_padded'), ('hf_sdpa', 'train_padded'))} / "
         f"{run.ratio((pk, 'train_padded'), ('hf_eager', 'train_padded'))}"],
        ["padded train step, GQA (2 K/V heads)", "HF sdpa",
         run.ratio((pk, "train_padded_gqa2"), ("hf_sdpa", "train_padded_gqa2"))],
        ["the same sequences packed into one row: `position_ids` / `cu_seq_lens`", "HF sdpa on the padded batch",
         f"{run.ratio((pk, 'train_packed_pos'), ('hf_sdpa', 'train_padded'))} / "
         f"{run.ratio((pk, 'train_packed_cu'), ('hf_sdpa', 'train_padded'))}"],
        ["packed rows", "per-document plain SDPA (the cost floor)",
         run.ratio((pk, "train_packed_pos"), ("floor_perdoc_sdpa", "train_packed_pos"))],
    ]
    if sweep:
        rows.append([f"padded train step at {' / '.join(f'{float(s):.0%}' for s in sweep)} padding", "HF sdpa",
                     " / ".join(run.ratio((pk, "train_pad_sweep"), ("hf_sdpa", "train_pad_sweep"), s)
                                for s in sweep)])
    if mem_n:
        eager = run.get("hf_eager", "long_peak_mem", mem_n) or run.get("hf_eager", "long_peak_mem_predicted", mem_n)
        mine = run.get(pk, "long_peak_mem", mem_n)
        predicted = "" if run.get("hf_eager", "long_peak_mem", mem_n) else " (HF eager extrapolated)"
        rows.append([f"peak step memory, N = {mem_n}{predicted}", "HF sdpa / HF eager",
                     f"{run.ratio((pk, 'long_peak_mem'), ('hf_sdpa', 'long_peak_mem'), mem_n)} / "
                     f"{x(mine / eager) if mine and eager else '-'}"])
    decode = run.ratio((pk, "prefill_decode"), ("hf_sdpa", "prefill_decode"))
    rows.append(["prefill + greedy decode", "HF sdpa", decode])
    return (f"`{name}`, `{pk}`: {run.machine()}; a batch with {run.padding:.1%} padding; ratios of medians.\n\n"
            + table(["workload", "vs", "ratio"], rows))


def cpu_bench() -> str:
    return bench_table("results.csv")


def gpu_bench() -> str:
    return bench_table("cuda/results.csv")


def families() -> str:
    rows: dict[str, dict[str, dict[str, str]]] = {}
    for r in read("families.csv"):
        rows.setdefault(r["family"], {})[r["provider"]] = r
    out = []
    for family, by in rows.items():
        base = next(k for k in by if k.startswith("hf_"))
        packed = by.get("patchkit packed")
        out.append([f"`{family}`", f"{base.split()[0][3:]} {float(by[base]['real_tokens_per_s']):.0f}",
                    x(float(by["patchkit padded"]["vs_hf"])), x(float(packed["vs_hf"])) if packed else "-"])
    return "`families.csv`\n\n" + table(["family", "HF tokens/s", "patchkit padded", "patchkit packed"], out)


def decode() -> str:
    out = []
    for r in read("decode.csv"):
        out.append([r["provider"], r["kv_heads"], f"{float(r['real_tokens_per_s']):.0f}", x(float(r["vs_hf_sdpa"]))])
    meta = read("decode.csv")[0]
    return (f"`decode.csv`: {meta['device']}, {meta['threads']} threads, torch {meta['torch']}\n\n"
            + table(["provider", "K/V heads", "tokens/s", "vs HF sdpa"], out))


def family_decode() -> str:
    rows = read("family_decode.csv")
    out = [[f"`{r['family']}`", r["provider"], f"{float(r['prefill_s']):.3f}", f"{float(r['step_ms']):.2f}",
            x(float(r["prefill_vs_hf"])), x(float(r["step_vs_hf"]))] for r in rows]
    meta = rows[0]
    return (f"`family_decode.csv`: {meta['device']}, {meta['threads']} threads, {meta['new_tokens']} new tokens\n\n"
            + table(["family", "provider", "prefill s", "decode step ms", "prefill vs HF", "step vs HF"], out))


def static_decode() -> str:
    out = []
    for name in ("static_decode.csv", "static_decode_window.csv"):
        for r in read(name):
            out.append([r["provider"], r["kv_heads"], r["window"] or "-", f"{float(r['real_tokens_per_s']):.0f}",
                        x(float(r["vs_hf_same"]))])
    return ("`static_decode.csv`, `static_decode_window.csv`\n\n"
            + table(["provider", "K/V heads", "window", "tokens/s", "vs HF sdpa run the same way"], out))


def compiled() -> str:
    out = [[r["provider"], f"{float(r['real_tokens_per_s']):.0f}", x(float(r["vs_hf"]))] for r in read("compiled.csv")]
    return "`compiled.csv`\n\n" + table(["step", "tokens/s", "vs HF sdpa compiled the same way"], out)


def vocab() -> str:
    """The large-vocabulary step (benchmarks/vocab.py): patchkit's speed and memory against HF sdpa and eager."""
    from vocab import ratios

    rows = [{k: (float(v) if k in NUMERIC and v else v) for k, v in r.items()} for r in read("vocab.csv")]
    return "`vocab.csv`\n\n" + "\n".join(ratios(rows))


NUMERIC = ("vocab", "real_tokens", "padding", "seconds", "real_tok_per_s", "loss", "peak_mib")


def gpu_fa2_rows() -> dict[str, dict[str, dict[str, str]]]:
    by: dict[str, dict[str, dict[str, str]]] = {}
    for r in read("cuda/train_pad_sweep_fa2.csv"):
        by.setdefault(r["padding"], {})[r["provider"]] = r
    return by


def gpu_fa2() -> str:
    by = gpu_fa2_rows()
    meta = next(iter(next(iter(by.values())).values()))
    cols = ["hf_flash_attention_2", "patchkit_flash_attn", "patchkit_torch_varlen", "hf_sdpa"]
    out = [[f"{float(p):.0%}"] + [f"{float(by[p][c]['median_s']):.3f} s ({x(float(by[p][c]['vs_hf_fa2']))})"
                                   for c in cols] for p in by]
    return (f"`cuda/train_pad_sweep_fa2.csv`: {meta['gpu']}, torch {meta['torch']}, transformers "
            f"{meta['transformers']}, flash-attn {meta['flash_attn'].split('+')[0]}, bf16\n\n"
            + table(["padding", "HF flash_attention_2", "patchkit `flash_attn`", "patchkit `torch_varlen`", "HF sdpa"],
                    out))


def gpu_decode() -> str:
    out = [[r["provider"], r["kv_heads"], x(float(r["vs_hf_sdpa"])), x(float(r["vs_hf_fa2"]))]
           for r in read("cuda/decode.csv")]
    return "`cuda/decode.csv`\n\n" + table(["provider", "K/V heads", "vs HF sdpa", "vs HF flash_attention_2"], out)


def truth_facts() -> str:
    """The `make gpu-truth` run's machine line, from the summary it wrote."""
    facts = dict(line.strip("|").split("|")[:2] for line in (RESULTS / "cuda/truth/summary.md").read_text().splitlines()
                 if line.startswith("| ") and line.count("|") == 3)
    facts = {k.strip(): v.strip() for k, v in facts.items()}
    return (f"`cuda/truth/`: {facts['gpu']}, torch {facts['torch']}, transformers {facts['transformers']}, "
            f"{facts['flash-attn'].split(' from ')[0]}, bf16")


def gpu_truth() -> str:
    """The issues' goals against the `make gpu-truth` run (tools/gpu_truth_goals.py measures them)."""
    return truth_facts() + "\n\n" + "\n".join(goals(RESULTS / "cuda/truth"))


def gpu_families() -> str:
    out = [[r["family"], r["provider"], f"{float(r['real_tokens_per_s']):.0f}", x(float(r["vs_hf"])),
            x(float(r["vs_hf_fa2"])) if r["vs_hf_fa2"] else "-", r["backend"], f"{float(r['peak_mib']):.0f}"]
           for r in read("cuda/truth/families.csv") if r["real_tokens_per_s"]]
    header = ["family", "run", "tokens/s", "vs HF sdpa", "vs HF flash_attention_2", "backend", "peak MiB"]
    return "`cuda/truth/families.csv`\n\n" + table(header, out)


def headline() -> str:
    """The README's two lines: one CPU, one GPU, each naming its machine."""
    run = Run("results.csv")
    fa2 = gpu_fa2_rows()
    gpu = fa2[max(fa2, key=float)]["patchkit_flash_attn"]
    half = fa2["0.5"]["patchkit_flash_attn"] if "0.5" in fa2 else gpu
    return (f"- **CPU** (2 cores, fp32, a tiny LLaMA, a batch with {run.padding:.1%} padding): a padded "
            f"training step {run.ratio((run.patch, 'train_padded'), ('hf_sdpa', 'train_padded'))} HF sdpa, "
            f"{run.ratio((run.patch, 'train_packed_pos'), ('hf_sdpa', 'train_padded'))} packed.\n"
            f"- **GPU** ({gpu['gpu']}, bf16, 1B-class layers, batch 16 of up to 2048 tokens): a padded training step "
            f"{x(float(half['vs_hf_fa2']))} HF `flash_attention_2` at 50% padding, "
            f"{x(float(gpu['vs_hf_fa2']))} at {float(gpu['padding']):.0%}; packed rows "
            f"{truth_ratio('train_packed_pos')} HF's own padding-free path (`flash_attention_2` on the same rows), "
            f"{truth_ratio('train_packed_cu')} when they carry `cu_seq_lens`.")


def truth_ratio(workload: str) -> str:
    """patchkit flash_attn over HF flash_attention_2 on the gpu-truth run's `workload` (MHA)."""
    rows = read_csv(RESULTS / "cuda/truth/train/results.csv")
    return x(median(rows, "patchkit_flash_attn", workload) / median(rows, "hf_flash_attention_2", workload))


def fused_loss(name: str = "fused_loss.csv") -> str:
    """The head and loss alone, three ways (benchmarks/fused_loss.py): time and peak memory against unfused."""
    rows = read(name)
    unfused = {(r["vocab"], r["dtype"]): r for r in rows if r["way"] == "unfused"}
    body = []
    for r in rows:
        base = unfused[(r["vocab"], r["dtype"])]
        peak = f"{float(r['peak_mib']):.0f}" if r["peak_mib"] else "-"
        share = f"{float(r['peak_mib']) / float(base['peak_mib']):.2f}" if r["peak_mib"] and float(
            base["peak_mib"]) else "-"
        body.append([r["vocab"], r["dtype"], r["way"], f"{float(r['seconds']):.3f}", x(float(r["vs_unfused"])),
                     peak, share])
    head = rows[0]
    lora = f", LoRA r {head['lora']} on the frozen head" if int(head.get("lora") or 0) else ""
    return (f"`{name}` ({head['rows']} rows, hidden {head['hidden']}{lora}, {head['device']})\n\n"
            + table(["vocab", "dtype", "way", "seconds", "x unfused", "peak MiB", "of unfused's"], body))


def sharded_head(name: str) -> str:
    """A ZeRO-3 or FSDP2 step's peak per rank by where the head ran (benchmarks/sharded_head.py), against HF sdpa."""
    rows = read(name)
    hf = next(r for r in rows if r["provider"] == "hf_sdpa")
    body = [[r["provider"], r["real_tokens"], f"{float(r['seconds']):.2f}", x(float(hf["seconds"]) / float(
        r["seconds"])), f"{float(r['peak_mib']):.0f}", x(float(r["peak_mib"]) / float(hf["peak_mib"])),
        f"{float(r['loss']):.4f}"] for r in rows]
    return (f"`{name}` (vocabulary {rows[0]['vocab']}, two gloo ranks)\n\n"
            + table(["provider", "real tokens", "step s", "speed x HF sdpa", "peak MiB per rank", "x HF sdpa",
                     "loss"], body))


def peft_head() -> str:
    """A PEFT fine-tune's step peak by how its head is tuned and where it ran (benchmarks/peft_head.py)."""
    rows = read("peft_head.csv")
    hf = {r["tuning"]: float(r["peak_mib"]) for r in rows if r["provider"] == "hf_sdpa"}
    body = [[r["tuning"], r["provider"], f"{float(r['peak_mib']):.0f}", x(float(r["peak_mib"]) / hf[r["tuning"]]),
             f"{float(r['loss']):.4f}"] for r in rows]
    return (f"`peft_head.csv` (vocabulary {rows[0]['vocab']}, {rows[0]['real_tokens']} real tokens)\n\n"
            + table(["tuning", "provider", "peak MiB", "x HF sdpa", "loss"], body))


def prepared_head() -> str:
    """A model prepared by accelerate, then instance-patched: a step's peak (benchmarks/prepared_head.py)."""
    rows = read("prepared_head.csv")
    hf = float(next(r["peak_mib"] for r in rows if r["provider"] == "hf_sdpa"))
    body = [[r["provider"], f"{float(r['peak_mib']):.0f}", x(float(r["peak_mib"]) / hf), f"{float(r['loss']):.4f}"]
            for r in rows]
    return (f"`prepared_head.csv` (vocabulary {rows[0]['vocab']}, {rows[0]['real_tokens']} real tokens)\n\n"
            + table(["provider", "peak MiB", "x HF sdpa", "loss"], body))


def trainer_head() -> str:
    """The HF Trainer's (and a custom loop's) evaluation and training step peaks under the default unpad
    (benchmarks/trainer_head.py)."""
    rows = read("trainer_head.csv")
    body = []
    for r in rows:
        hf = next(h for h in rows if h["provider"] == "hf_sdpa" and h.get("family") == r.get("family")
                  and h.get("loop") == r.get("loop"))
        body.append([r.get("loop", "trainer"), r.get("family", "llama"), r["provider"],
                     *(cell for key in ("eval_peak_mib", "train_peak_mib")
                       for cell in (f"{float(r[key]):.0f}", x(float(r[key]) / float(hf[key])))),
                     f"{float(r['eval_loss']):.4f}"])
    return (f"`trainer_head.csv` (vocabulary {rows[0]['vocab']}, {rows[0]['real_tokens']} real tokens)\n\n"
            + table(["loop", "family", "provider", "evaluate() peak MiB", "x HF sdpa", "train() peak MiB", "x HF sdpa",
                     "eval loss"], body))


def mixer_groups() -> str:
    out = [[r["batch"], f"{r['rows']} rows, {float(r['padding']):.0%} padding", r["provider"].replace("patchkit ", ""),
            r["calls_per_layer"], f"{float(r['real_tokens_per_s']):.0f}", x(float(r["vs_hf"]))]
           for r in read("mixer_groups.csv")]
    return "`mixer_groups.csv` (Qwen3.5 text, hidden 256, cpu)\n\n" + table(
        ["batch", "rows", "provider", "calls a layer", "tok/s", "x HF sdpa"], out)


def image_blocks() -> str:
    rows = read("image_blocks.csv")
    body = [[r.get("model", "gemma3"), r["provider"], f"{float(r['median_s']):.3f}",
             f"{float(r['real_tokens_per_s']):.0f}", x(float(r["vs_hf_sdpa"])), r["stepped_aside"]] for r in rows]
    first = rows[0]
    return (f"`image_blocks.csv` (hidden 256, {first['rows']} rows, {first['real_tokens']} real tokens, "
            f"an image of {first['image_tokens']} tokens each, {float(first['padding']):.1%} padding, cpu)\n\n"
            + table(["model", "provider", "median s", "tok/s", "x HF sdpa", "forwards aside"], body))


def cross_attention() -> str:
    rows = read("cross_attention.csv")
    body = [[r["provider"], f"{float(r['median_s']):.3f}", f"{float(r['real_tokens_per_s']):.0f}",
             x(float(r["vs_hf_sdpa"])), r["stepped_aside"]] for r in rows]
    first = rows[0]
    return (f"`cross_attention.csv` (Mllama, hidden 256, {first['rows']} rows, {first['real_tokens']} real tokens, "
            f"{float(first['padding']):.1%} padding, cpu)\n\n"
            + table(["provider", "median s", "tok/s", "x HF sdpa", "forwards aside"], body))


def continuous_batching() -> str:
    rows = [r for r in read("continuous_batching.csv") if not r.get("skipped")]
    body = [[f"{r['requests']} x {int(r['prompt_tokens']) // int(r['requests'])} (longest {r['longest_prompt']})",
             r["provider"], f"{float(r['median_s']):.3f}", f"{float(r['real_tokens_per_s']):.0f}",
             x(float(r["vs_hf_sdpa"])), f"{float(r['forward_s']):.3f}", x(float(r["forward_vs_hf_sdpa"])),
             r["stepped_aside"], r["same_tokens"]] for r in rows]
    first = rows[0]
    return (f"`continuous_batching.csv` (LLaMA hidden 256, {first['new_tokens']} new tokens a request, steps of "
            f"<= {first['step_budget']} tokens, {first['device']})\n\n"
            + table(["requests x mean prompt", "provider", "generate_batch s", "tok/s", "x HF sdpa", "forward s",
                     "x HF sdpa", "steps aside", "HF sdpa's tokens"], body))


TABLES: dict[str, Callable[[], str]] = {
    "headline": headline, "cpu-bench": cpu_bench, "gpu-bench": gpu_bench, "families": families, "decode": decode,
    "static-decode": static_decode, "family-decode": family_decode, "compiled": compiled, "gpu-fa2": gpu_fa2,
    "gpu-decode": gpu_decode,
    "gpu-truth": gpu_truth, "gpu-families": gpu_families, "vocab": vocab,
    "fused-loss": fused_loss, "fused-loss-lora": lambda: fused_loss("fused_loss_lora.csv"),
    "zero3-head": lambda: sharded_head("zero3_head.csv"), "fsdp2-head": lambda: sharded_head("fsdp2_head.csv"),
    "peft-head": peft_head, "prepared-head": prepared_head,
    "trainer-head": trainer_head, "mixer-groups": mixer_groups, "image-blocks": image_blocks,
    "cross-attention": cross_attention, "continuous-batching": continuous_batching,
}
MARKED = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)


def render(text: str) -> str:
    """The page with every marked table written from the CSVs (an unknown name raises KeyError)."""
    return MARKED.sub(lambda m: m.group(1) + "\n" + TABLES[m.group(2)]() + "\n\n" + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page differs")
    args = parser.parse_args(argv)
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = render(text)
        if new != text:
            stale.append(page.relative_to(REPO))
            if not args.check:
                page.write_text(new)
    verb = "differ from the CSVs" if args.check else "rewritten"
    print(f"{', '.join(map(str, stale))}: {verb}" if stale else "every table equals the CSVs")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
