"""The ways the benchmark runs the model: HF attention implementations, patchkit on a backend, the SDPA floor."""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any, Callable, Optional

from workloads import FLOOR, PAD

# patchkit_<backend>, best first as backend="auto" orders them on sm90/sm100 (flash_attn_4 only where installed)
PATCHKIT_BACKENDS = ("flash_attn_4", "flash_attn", "torch_varlen", "sdpa")
HF_PROVIDERS = {"hf_eager": "eager", "hf_sdpa": "sdpa", "hf_flash_attention_2": "flash_attention_2",
                "hf_flash_attention_4": "flash_attention_4"}
HF_KERNELS = ("hf_flash_attention_2", "hf_flash_attention_4")  # HF's flash-attn paths: CUDA only, each if it loads


def device_and_dtype(device: Optional[str] = None) -> tuple[Any, Any]:
    """(device, compute dtype): CUDA in bf16, else CPU in fp32; `device` None or "auto" takes CUDA when present."""
    import torch

    if device == "cuda" or (device in (None, "auto") and torch.cuda.is_available()):
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def build_model(cfg: dict[str, int], kv_heads: int, attn: str, device: Any, dtype: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"], num_key_value_heads=kv_heads,
        max_position_embeddings=32768, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, attn_implementation=attn,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 1B-class model's CPU init took seconds per provider
        return LlamaForCausalLM(config).to(dtype=dtype)


_FLOOR_LENGTHS: list[int] = []


def floor_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: Optional[float] = None,
                    dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
    """Plain per-document SDPA on a packed row (B = 1): the cost floor of varlen attention, no patch glue."""
    import torch.nn.functional as F

    outs, start = [], 0
    gqa = key.shape[1] != query.shape[1]
    for n in _FLOOR_LENGTHS:
        sl = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(
            query[:, :, sl], key[:, :, sl], value[:, :, sl], is_causal=True, scale=scaling, enable_gqa=gqa
        ))
        start += n
    import torch

    return torch.cat(outs, dim=2).transpose(1, 2), None


def register_floor() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(FLOOR, floor_attention)


class Provider:
    """One way of running the model: an HF attention implementation, patchkit with a backend, or the floor."""

    def __init__(self, name: str, cfg: dict[str, int], kv_heads: int, device: Any, dtype: Any) -> None:
        self.name = name
        self.backend = name.split("_", 1)[1] if name.startswith("patchkit_") else None
        attn = HF_PROVIDERS.get(name, FLOOR if name == FLOOR else "sdpa")
        if name == FLOOR:
            register_floor()
        self.model = build_model(cfg, kv_heads, attn, device, dtype)
        self.handle: Any = None

    def __enter__(self) -> Provider:
        if self.backend:
            import patchkit

            self.handle = patchkit.apply_patch("llama2", backend=self.backend, strict=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.revert()
            self.handle = None


def step_fn(provider: Provider, workload: str, data: dict[str, Any], decode_tokens: int) -> Callable[[], None]:
    """A closure running one timed unit of work (a train step, or prefill + greedy decode)."""
    import torch

    model = provider.model
    if workload == "decode":
        model.eval()

        def run() -> None:
            with torch.no_grad():
                model.generate(
                    input_ids=data["input_ids"], attention_mask=data["attention_mask"], max_new_tokens=decode_tokens,
                    min_new_tokens=decode_tokens, do_sample=False, pad_token_id=PAD,
                )
        return run

    model.train()
    kwargs = {k: v for k, v in data.items() if k not in ("docs",)}

    def run() -> None:
        global _FLOOR_LENGTHS
        _FLOOR_LENGTHS = data["docs"]
        model(**kwargs).loss.backward()
        model.zero_grad(set_to_none=True)
    return run


def first_line(exc: BaseException, limit: int = 160) -> str:
    """The first `limit` characters of an exception's first line ("" for an empty message)."""
    return str(exc).splitlines()[0][:limit] if str(exc) else ""


def one_line(exc: BaseException, limit: int = 160) -> str:
    """An exception in one line for a skipped row: its type and the first `limit` characters of its first line."""
    return f"{type(exc).__name__}: {first_line(exc, limit)}"


def probe_hf_flash(device: Any, implementation: str = "flash_attention_2") -> Optional[str]:
    """None when HF's `implementation` (flash_attention_2 or _4) loads and runs one forward on `device`, else why."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if device.type != "cuda":
        return f"{implementation} runs on CUDA only (this run is on the CPU)"
    try:
        # head_dim 128, as the CUDA model's: a flash-attn built for some head dims only is probed on one it has
        cfg = LlamaConfig(hidden_size=256, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          vocab_size=16, attn_implementation=implementation)
        model = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
        model(input_ids=torch.ones(1, 4, dtype=torch.long, device=device))
    except Exception as exc:  # noqa: BLE001 - any load failure means "not available here"
        return one_line(exc)
    return None


@functools.cache
def probed(device: Any) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """probe_providers(device), probed once per process: (usable providers, (provider, why not) pairs)."""
    ok, skipped = probe_providers(device)
    return tuple(ok), tuple(skipped.items())


def patchkit_backends(device: Any) -> list[str]:
    """patchkit's backends for a script's patched provider on `device`, best first: on CUDA each whose gates pass
    (flash_attn, torch_varlen), sdpa last; on the CPU sdpa alone. A caller takes the first a model accepts."""
    if device.type != "cuda":
        return ["sdpa"]
    ok = probed(device)[0]
    return [b for b in PATCHKIT_BACKENDS if b != "sdpa" and f"patchkit_{b}" in ok] + ["sdpa"]


def patch_on_best(patch: str, model: Any, device: Any, strict: bool,
                  exclude: tuple[str, ...] = (), **options: Any) -> tuple[Any, str, str]:
    """`model` patched by `patch` on the best of patchkit_backends that takes it: (handle, the backend it runs on,
    why the better ones did not). Without `strict` a failed gate falls back inside apply_patch, which the handle's
    backend says. `options`: apply_patch's others (unpad)."""
    import patchkit
    from patchkit.errors import PatchkitError

    refused = []
    for backend in [b for b in patchkit_backends(device) if b not in exclude]:
        try:
            handle = patchkit.apply_patch(patch, model=model, backend=backend, strict=strict, **options)
        except PatchkitError as exc:
            refused.append(f"{backend}: {first_line(exc)}")
            continue
        return handle, handle.backend, "; ".join(refused)
    raise RuntimeError(f"{patch}: no patchkit backend takes the model: {'; '.join(refused)}")


def add_run_args(parser: argparse.ArgumentParser, budget: bool = True) -> None:
    """--device (and --budget-s), as the benchmark scripts share them."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: bf16 on the GPU at a size the GPU is timed at, HF flash_attention_2 as a baseline "
                        "and patchkit's best kernel backend, where usable (without CUDA: says so, exits 0)")
    if budget:
        parser.add_argument("--budget-s", type=float, default=None,
                            help="stop starting measurements once this many seconds are spent; the rows measured "
                            "are written and what was left out is printed")


def add_sweep_args(parser: argparse.ArgumentParser, reps: int) -> None:
    """--reps (rounds timed), --scale (the lengths times this) and --csv, as families.py and mixer_groups.py take
    them."""
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the sequence lengths (0.1 for a smoke run)")
    parser.add_argument("--csv", type=Path, default=None)


def no_cuda(prog: str, device: str) -> bool:
    """True, said in one line, when the run asks for CUDA on a machine without it (the script then exits 0)."""
    import torch

    if device != "cuda" or torch.cuda.is_available():
        return False
    print(f"{prog}: --device cuda: no CUDA device here (torch {torch.__version__}); nothing was run.", flush=True)
    return True


class Budget:
    """--budget-s: a measurement asks `spent(what)` before it starts; what was left out is printed by `report`."""

    def __init__(self, seconds: Optional[float]) -> None:
        self.seconds, self.start = seconds, time.monotonic()
        self.left_out: list[str] = []

    def spent(self, what: str) -> bool:
        """Whether the budget is spent, `what` (the measurement not started) noted as left out if so."""
        over = self.seconds is not None and time.monotonic() - self.start >= self.seconds
        if over:
            self.left_out.append(what)
        return over

    def report(self, prog: str) -> None:
        if self.left_out:
            print(f"{prog}: --budget-s {self.seconds:g} spent ({time.monotonic() - self.start:.0f} s); left out: "
                  + "; ".join(self.left_out), flush=True)


def timed(fn: Callable[[], Any], device: Any) -> tuple[float, Optional[float], Any]:
    """fn()'s seconds (synchronized before and after on CUDA), its peak memory above what was allocated before it
    (MiB; None on the CPU), and its result."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return seconds, (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None, out


def probe_providers(device: Any) -> tuple[list[str], dict[str, str]]:
    """Which providers can run on `device`: HF flash_attention_2 and _4 where each loads; patchkit backends whose
    gates pass."""
    import patchkit
    from patchkit.errors import PatchkitError

    ok, skipped = ["hf_eager", "hf_sdpa"], {}
    for name in HF_KERNELS:
        why = probe_hf_flash(device, HF_PROVIDERS[name])
        if why is None:
            ok.append(name)
        else:
            skipped[name] = why
    for backend in PATCHKIT_BACKENDS:
        if backend != "sdpa" and device.type != "cuda":
            skipped[f"patchkit_{backend}"] = f"the {backend} backend runs on CUDA only (this run is on the CPU)"
            continue
        try:
            patchkit.apply_patch("llama2", backend=backend, strict=True).revert()
            ok.append(f"patchkit_{backend}")
        except PatchkitError as exc:
            skipped[f"patchkit_{backend}"] = first_line(exc, 200)
    return ok, skipped
