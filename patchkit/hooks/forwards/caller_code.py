"""Whether the code that called a causal LM reads nothing of its output but the loss, read off that code's bytecode.

A training loop of the user's own (`loss = model(**batch).loss`, or `outputs = model(**batch)` then `outputs.loss`
alone, as accelerate's and PyTorch's examples write it) never sees the logits: the LM can return its loss alone from
the head fused with the loss, and the (B, N, V) logits are never held. This holds only where it is provable from the
calling function's code: the call's result is read by `.loss` (or `["loss"]`) at once, or stored in a local variable
that every instruction of the function reads by `.loss` alone, that no closure shares, and that nothing reads by name
(`locals()`, `vars()`, `eval`, frame inspection). One branch is known not to run: a Trainer subclass's
`(loss, outputs) if return_outputs else loss` where `return_outputs` is False now (the Trainer's training step).
Anything else (a return, a tuple, `outputs.logits` anywhere in the function, module-level code, whose names are
global) keeps the logits.
"""

from __future__ import annotations

import dis
import functools
from types import CodeType, FrameType
from typing import Optional, Sequence

LOSS = "loss"
# Names whose use in a function can read its variables without naming them
BY_NAME = frozenset({"locals", "vars", "eval", "exec", "_getframe", "currentframe", "stack", "getframeinfo",
                     "getouterframes", "f_locals"})
SKIPPED = frozenset({"CACHE", "EXTENDED_ARG", "NOP"})
# A Trainer subclass's compute_loss argument: False where the Trainer's caller takes the loss alone, so the branch of
# `(loss, outputs) if return_outputs else loss` that reads the outputs does not run
GUARDS = frozenset({"return_outputs"})
GUARD_JUMPS = frozenset({"POP_JUMP_IF_FALSE", "POP_JUMP_FORWARD_IF_FALSE"})
JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs) | frozenset(getattr(dis, "hasjump", ()))


@functools.lru_cache(maxsize=512)
def _instructions(code: CodeType) -> tuple[dis.Instruction, ...]:
    return tuple(i for i in dis.get_instructions(code) if i.opname not in SKIPPED)


@functools.lru_cache(maxsize=512)
def _entries(code: CodeType) -> tuple[tuple[int, int], ...]:
    """Where control enters other than by falling through: each jump's (offset, target), each handler's (-1, target)."""
    jumps = tuple((i.offset, i.argval) for i in _instructions(code) if i.opcode in JUMPS and isinstance(i.argval, int))
    return jumps + tuple((-1, e.target) for e in getattr(dis.Bytecode(code), "exception_entries", ()))


def _reads_loss_at(code: Sequence[dis.Instruction], at: int) -> bool:
    """Instructions from `at` on read the loss of the value on top of the stack, and nothing else of it."""
    first = code[at] if at < len(code) else None
    if first is None:
        return False
    if first.opname == "LOAD_ATTR" and first.argval == LOSS:
        return True
    subscript = code[at + 1] if at + 1 < len(code) else None
    return first.opname == "LOAD_CONST" and first.argval == LOSS and subscript is not None and (
        subscript.opname == "BINARY_SUBSCR" or subscript.opname == "BINARY_OP" and subscript.argrepr == "[]")


def _names(instruction: dis.Instruction) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The local variables `instruction` stores (or deletes), and those it loads, in the order it pushes them."""
    name, value = instruction.opname, instruction.argval
    both = tuple(value) if isinstance(value, tuple) else (value,)
    if name in ("STORE_FAST", "DELETE_FAST", "STORE_FAST_STORE_FAST", "STORE_FAST_MAYBE_NULL"):
        return both, ()
    if name == "STORE_FAST_LOAD_FAST":
        return both[:1], both[1:]
    if name.startswith("LOAD_FAST"):
        return (), both
    return (), ()


def _skipped(frame: FrameType, instructions: Sequence[dis.Instruction]) -> frozenset[int]:
    """The instructions this run of `frame` cannot reach: the branch of an `if return_outputs` (or of a conditional
    expression on it) whose guard is False now and never stored, entered by no jump or handler from outside."""
    code, skipped = frame.f_code, set()
    for at, jump in enumerate(instructions):
        guard = instructions[at - 2 if at > 1 and instructions[at - 1].opname == "TO_BOOL" else at - 1]
        if jump.opname not in GUARD_JUMPS or at == 0 or guard.opname != "LOAD_FAST" or guard.argval not in GUARDS:
            continue
        name, start, end = guard.argval, jump.offset, jump.argval
        if (frame.f_locals.get(name) is not False or name in code.co_cellvars or end <= start
                or any(name in _names(i)[0] for i in instructions)
                or any(start < target < end and not start < source < end for source, target in _entries(code))):
            continue
        skipped.update(n for n, i in enumerate(instructions) if start < i.offset < end)
    return frozenset(skipped)


def _read_for_loss_alone(code: CodeType, instructions: Sequence[dis.Instruction], variable: str,
                         skipped: frozenset[int]) -> bool:
    """Every instruction of `code` that reads the local `variable`, but those `skipped`, reads its loss alone."""
    if variable in code.co_cellvars or variable in code.co_freevars or BY_NAME.intersection(code.co_names):
        return False
    for at, instruction in enumerate(instructions):
        _, loads = _names(instruction)
        if at not in skipped and variable in loads and (loads[-1] != variable or variable in loads[:-1]
                                  or not _reads_loss_at(instructions, at + 1)):
            return False
    return True


def reads_loss_alone_at(frame: Optional[FrameType]) -> bool:
    """`frame` is calling the LM now, and its code reads nothing of the call's result but the loss."""
    if frame is None:
        return False
    code = frame.f_code
    instructions = _instructions(code)
    at = next((n for n, i in enumerate(instructions) if i.offset == frame.f_lasti), None)
    if at is None or not instructions[at].opname.startswith("CALL"):
        return False
    if _reads_loss_at(instructions, at + 1):
        return True
    after = instructions[at + 1] if at + 1 < len(instructions) else None
    if after is None or after.opname not in ("STORE_FAST", "STORE_FAST_LOAD_FAST"):
        return False  # a global, a cell, an attribute, a tuple, a return, an argument: read elsewhere
    return _read_for_loss_alone(code, instructions, _names(after)[0][0], _skipped(frame, instructions))
