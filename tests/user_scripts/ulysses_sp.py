"""A user's DeepSpeed Ulysses (ALST) sequence-parallel training step, or the one-process reference it must equal.

Run under `torchrun --nproc_per_node=N` (gloo, CPU): every rank holds the same tiny random model and a 1/N shard of
the sequence, `UlyssesSPAttentionHF.register_with_transformers` wraps the attention function registered under the
model's attention implementation, and the loss is aggregated across the SP ranks as transformers' Trainer does
(`deepspeed_sp_compute_loss`: each rank's mean loss over its shard, weighted by its label count, through a
differentiable all_gather) and the gradients are averaged over the ranks as the DeepSpeed engine does. Run as one
plain process it computes the same step on the full sequence without Ulysses: the reference.

    python ulysses_sp.py FAMILY WAY DATA[,DATA...] OUT_DIR
    torchrun --nproc_per_node 2 ulysses_sp.py FAMILY WAY DATA[,DATA...] OUT_DIR

FAMILY: llama, qwen2. WAY: how patchkit comes in: `interface` (attn_implementation="patchkit"), `class`
(patchkit.apply_patch() before the model is built), `env` (PATCHKIT_FLASH_ATTN=1 set by the caller: the startup
hook patches), `both` (the class patch and attn_implementation="patchkit"), `none` (unpatched sdpa);
`flash-class` (the class patch on a model loaded with "flash_attention_2") and `flash` (that model unpatched):
transformers' own flash attention on the CPU stand-in of flash-attn (tests/fakes.py).
DATA: `padded` (two right-padded rows, a 2D attention_mask), `packed` (one row of several documents told apart by
position_ids, no mask), or left-padded rows: `left` (position_ids 0..N-1), `left-restart` (position_ids restarting
at each row's first real token), `left-restart-labelled` (that, with the first real token labelled).

Each DATA in turn is one training step of a model built afresh from the same seed, in one process (a process start
costs more than a step): Ulysses is registered for each, with its batch's rows as its micro batch size, over the
attention functions as they were before the first (its state in DeepSpeed's parallel_state_sp is cleared between).
Rank 0 writes OUT_DIR/DATA.json: the loss, per-parameter gradient norms and sums, how often the Ulysses wrapper and
the core function it wraps ran (and the sequence lengths the core saw), every rank's attention calls by registered
name, and patchkit's active patches and their counters during that step; and OUT_DIR/DATA.pt, every gradient
(torch.save) for an exact comparison.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers as tf
from common import checked_way, end_process_group, flash_attention_2_stand_in
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import patchkit
from patchkit.hooks.name import attention_interface

DATA = ("padded", "packed", "left", "left-restart", "left-restart-labelled")
parser = argparse.ArgumentParser()
parser.add_argument("family", choices=["llama", "qwen2"])
parser.add_argument("way")
parser.add_argument("data", help=f"comma-separated, each one of {', '.join(DATA)}")
parser.add_argument("out", type=Path, help="a directory: DATA.json and DATA.pt for each DATA (rank 0)")
parser.add_argument("--seed", type=int, default=0)
opts = parser.parse_args()
opts.data = opts.data.split(",")
if not set(opts.data) <= set(DATA):
    parser.error(f"unknown data {sorted(set(opts.data) - set(DATA))}")

checked_way(opts.way, ("interface", "class", "env", "both", "none", "flash", "flash-class"))
if opts.way.startswith("flash"):
    flash_attention_2_stand_in()

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
VOCAB = 97
IGNORE = -100

# ---------------------------------------------------------------- distributed and Ulysses (only with WORLD > 1)
if WORLD > 1:
    import deepspeed
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp_state
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend="gloo")
RANK = int(os.environ.get("RANK", "0"))

# ---------------------------------------------------------------- the way in, the model
if opts.way in ("class", "both", "flash-class"):
    handle = patchkit.apply_patch()  # before the model is built, as the README says
ATTN = {"interface": "patchkit", "both": "patchkit"}.get(opts.way, "sdpa")


def build_model() -> tf.PreTrainedModel:
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  attn_implementation=ATTN)
    torch.manual_seed(opts.seed)
    if opts.family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    else:
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(attention_bias=True, **common))
    if opts.way.startswith("flash"):  # as from_pretrained(attn_implementation="flash_attention_2") leaves it
        model.config._attn_implementation = "flash_attention_2"
    return model.float().train()


# ---------------------------------------------------------------- the global batch (the same on every rank)
def global_batch(data: str) -> dict:
    g = torch.Generator().manual_seed(100 + opts.seed)
    if data == "padded":
        # two rows of 16, right padded (the collator's default side), positions 0..15 in every row as the Ulysses
        # docs ask; rank 0's half holds 16 real tokens, rank 1's 9: the shards differ in real-token count
        seq, lengths = 16, [16, 9]
        ids = torch.randint(3, VOCAB, (len(lengths), seq), generator=g)
        mask = torch.zeros(len(lengths), seq, dtype=torch.long)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, IGNORE)
        positions = torch.arange(seq).expand(len(lengths), seq).clone()
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels}
    if data.startswith("left"):
        # two rows of 16, left padded: the second row's padding fills rank 0's half and its real tokens rank 1's, so
        # at sp 2 no shard holds padding before a real token of its own; position_ids 0..15 (`left`) or, as
        # generate() makes them, restarting at the first real token (the mask's cumsum - 1, padding at 1); the first
        # real token, predicted from padding, has no label unless `-labelled`
        seq, lengths = 16, [16, 8]
        ids = torch.randint(3, VOCAB, (len(lengths), seq), generator=g)
        mask = torch.zeros(len(lengths), seq, dtype=torch.long)
        for row, n in enumerate(lengths):
            mask[row, seq - n:] = 1
        ids = ids.masked_fill(mask == 0, 0)
        first = (mask.cumsum(-1) == 1) & (data != "left-restart-labelled")
        labels = ids.masked_fill((mask == 0) | first, IGNORE)
        positions = torch.arange(seq).expand(len(lengths), seq).clone()
        if data != "left":
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels}
    # one row of 24: documents of 5, 9, 6 and 4 tokens; the second crosses the middle (the shard boundary at sp 2)
    docs = [5, 9, 6, 4]
    ids = torch.randint(3, VOCAB, (1, sum(docs)), generator=g)
    positions = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    labels = ids.masked_fill(positions == 0, IGNORE)  # no document predicts the next one's first token
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def shard(batch: dict, rank: int, world: int) -> dict:
    """What UlyssesSPDataLoaderAdapter hands each rank: labels shifted on the full sequence, then every tensor cut
    along the sequence into `world` equal parts."""
    batch = dict(batch)
    labels = batch.pop("labels")
    batch["shift_labels"] = F.pad(labels, (0, 1), value=IGNORE)[..., 1:].contiguous()
    seq = batch["input_ids"].shape[1]
    if seq % world:
        raise SystemExit(f"sequence length {seq} is not a multiple of the SP size {world}")
    chunk = seq // world
    return {k: v[:, chunk * rank: chunk * (rank + 1)].contiguous() for k, v in batch.items()}


# ---------------------------------------------------------------- Ulysses and the spies: which name ran, how long
ORIGINAL = {name: ALL_ATTENTION_FUNCTIONS[name] for name in {"patchkit", "sdpa", "flash_attention_2"}
            if name in ALL_ATTENTION_FUNCTIONS}


def spy_name(name: str, calls: collections.Counter) -> None:
    inner = ALL_ATTENTION_FUNCTIONS[name]

    def spy(module, query, *args, **kwargs):
        calls[f"{name}:{query.shape[2]}"] += 1
        return inner(module, query, *args, **kwargs)

    spy.__wrapped__ = inner
    ALL_ATTENTION_FUNCTIONS[name] = spy


def register(model: tf.PreTrainedModel, rows: int, calls: collections.Counter) -> tuple[dict, object]:
    """Ulysses registered for this step over the attention functions as they were at the start (a user's one
    registration per run), and the spies; what Ulysses saw (filled as the step runs) and the SP group."""
    for name, function in ORIGINAL.items():
        ALL_ATTENTION_FUNCTIONS[name] = function
    impl = model.config._attn_implementation  # what register_with_transformers compares its core name with
    ulysses = {"registered": False, "core_name": None, "wrapper_calls": 0, "core_calls": 0, "core_q_lens": [],
               "core_masks": [], "core_position_ids_len": []}
    group = None
    if WORLD > 1:
        sp_state._SEQUENCE_PARALLEL_GROUP = sp_state._SEQUENCE_DATA_PARALLEL_GROUP = None  # the previous step's
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=impl, sequence_parallel_size=WORLD,
            micro_batch_size=rows, seq_length_is_variable=True,
        )
        group = mpu.get_sequence_parallel_group()
        wrapper = ALL_ATTENTION_FUNCTIONS[impl]
        # the UlyssesSPAttentionHF instance lives in the wrapper's closure: count what it hands the core function
        uattn = next(c.cell_contents for c in wrapper.__closure__ or () if isinstance(c.cell_contents,
                                                                                     UlyssesSPAttentionHF))
        core = uattn.attn

        def core_spy(module, query, key, value, attention_mask, *args, **kwargs):
            ulysses["core_calls"] += 1
            ulysses["core_q_lens"].append(query.shape[2])
            ulysses["core_masks"].append(type(attention_mask).__name__)
            pos = kwargs.get("position_ids")
            ulysses["core_position_ids_len"].append(None if pos is None else pos.shape[-1])
            return core(module, query, key, value, attention_mask, *args, **kwargs)

        uattn.attn = core_spy

        @functools.wraps(wrapper)  # the convention patchkit follows to find Ulysses under a caller's own wrapper
        def counting_wrapper(*args, **kwargs):
            ulysses["wrapper_calls"] += 1
            return wrapper(*args, **kwargs)

        ALL_ATTENTION_FUNCTIONS[impl] = counting_wrapper
        ulysses.update(registered=True, core_name=impl, wrapper_qualname=wrapper.__qualname__,
                       core_function=f"{getattr(core, '__module__', '?')}.{getattr(core, '__qualname__', core)}")
    for name in sorted({"patchkit", "sdpa", impl}):
        spy_name(name, calls)
    return ulysses, group


# ---------------------------------------------------------------- one training step
def train_step(model: tf.PreTrainedModel, batch: dict, group: object) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The SP step's loss (aggregated over the ranks as the Trainer does), this rank's own loss and label count;
    the gradients averaged over the ranks as the DeepSpeed engine does."""
    inputs = {k: v for k, v in batch.items() if k != "shift_labels"}
    out = model(**inputs, labels=batch["shift_labels"], shift_labels=batch["shift_labels"], use_cache=False)
    good = (batch["shift_labels"] != IGNORE).sum()
    loss = out.loss
    if WORLD > 1:
        # transformers' deepspeed_sp_compute_loss: differentiable, weighted per-shard-loss aggregation across ranks
        losses = torch.stack(torch.distributed.nn.functional.all_gather(out.loss, group=group))
        goods = torch.stack(torch.distributed.nn.functional.all_gather(good, group=group))
        loss = (torch.where(goods > 0, losses, torch.zeros_like(losses)) * goods).sum() / goods.sum().clamp(min=1)
    loss.backward()
    if WORLD > 1:
        # the engine averages gradients over its (sequence-)data-parallel group; here that is the SP group: each
        # rank's gradient holds sp_size times its shard's part (the all_gather's backward sums the ranks' copies)
        for p in model.parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad, group=group)
                p.grad /= WORLD
    return loss, out.loss, int(good)


# ---------------------------------------------------------------- report
def patch_counters() -> dict:
    return {id(h): {"name": h.name, "backend": h.backend, "calls": h.calls, "layers_patched": h.layers_patched,
                    "stepped_aside": dict(h.stepped_aside), "origin": getattr(h, "origin", None)}
            for h in patchkit.active_patches()}


def during(before: dict, after: dict) -> list:
    """Each active patch as after the step, its calls and steps aside counted during the step alone."""
    rows = []
    for key, row in after.items():
        was = before.get(key, {"calls": 0, "stepped_aside": {}})
        aside = {why: n - was["stepped_aside"].get(why, 0) for why, n in row["stepped_aside"].items()}
        rows.append({**row, "calls": row["calls"] - was["calls"], "stepped_aside": {k: n for k, n in aside.items()
                                                                                    if n}})
    return rows


def route_calls() -> int | None:
    return None if attention_interface._state is None else attention_interface._state.calls


def run(data: str) -> None:
    start = time.perf_counter()
    model = build_model()
    batch = shard(global_batch(data), RANK, WORLD)
    calls: collections.Counter = collections.Counter()  # "name:q_len" -> calls, every registered name reached
    ulysses, group = register(model, batch["input_ids"].shape[0], calls)
    counters, routed = patch_counters(), route_calls()
    loss, local_loss, good = train_step(model, batch, group)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    mine = {
        "rank": RANK,
        "attention_calls": dict(sorted(calls.items())),
        "ulysses": ulysses,
        "patchkit_active": during(counters, patch_counters()),
        "patchkit_route_calls": None if routed is None else route_calls() - routed,
        "local_loss": local_loss.item(),
        "local_good_tokens": good,
        "local_seq": batch["input_ids"].shape[1],
    }
    every = [mine]
    if WORLD > 1:
        every = [None] * WORLD
        torch.distributed.all_gather_object(every, mine, group=group)
    if RANK != 0:
        return
    result = {
        "family": opts.family, "way": opts.way, "data": data, "world": WORLD,
        "transformers": tf.__version__, "torch": torch.__version__,
        "deepspeed": __import__("deepspeed").__version__ if WORLD > 1 else None,
        "config_attn_implementation": model.config._attn_implementation,
        "loss": loss.item(),
        "good_tokens": sum(r["local_good_tokens"] for r in every),
        "grad_norm": torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item(),
        "grad_norms": {n: g.norm().item() for n, g in grads.items()},
        "grad_sums": {n: g.sum().item() for n, g in grads.items()},
        "ulysses_wrapper_ran": all(r["ulysses"]["wrapper_calls"] > 0 for r in every) if WORLD > 1 else None,
        "ranks": every,
        "seconds": time.perf_counter() - start,
    }
    (opts.out / f"{data}.json").write_text(json.dumps(result, indent=1))
    torch.save(grads, opts.out / f"{data}.pt")
    print(f"ULYSSES_SP family={opts.family} way={opts.way} data={data} world={WORLD} loss={result['loss']:.9f} "
          f"wrapper_ran={result['ulysses_wrapper_ran']}", flush=True)


opts.out.mkdir(parents=True, exist_ok=True)
for data in opts.data:
    run(data)
end_process_group()
