"""Whether the code that called a causal LM reads nothing of its output but the loss, read off that code's bytecode.

A training loop of the user's own (`loss = model(**batch).loss`, or `outputs = model(**batch)` then `outputs.loss`
alone, as accelerate's and PyTorch's examples write it) never sees the logits: the LM can return its loss alone from the
head fused with the loss, and the (B, N, V) logits are never held. This holds only where it is provable from the calling
function's code: the call's result is read by `.loss` (or `["loss"]`, or `[0]`) at once, or stored in a local variable
that no closure shares and that nothing reads by name (`locals()`, `vars()`, `eval`, frame inspection), and that is read
by `.loss` alone on every path from the call until it is stored again (Python 3.11+: jumps, loops, exception handlers, a
`with` block that could swallow an exception; before 3.11, every read of it anywhere in the function). One branch is
known not to run: a Trainer subclass's `(loss, outputs) if return_outputs else loss` where `return_outputs` is False now
(the Trainer's training step). A function that returns the call's result as it is (at once, or from a local read for
nothing but its loss) passes it on (`result_read_at`): its caller's code is read instead. Anything else (an output
passed to another function, a tuple, `outputs.logits` where the call's output can reach it, module-level code, whose
names are global) keeps the logits.
"""
from __future__ import annotations

import bisect
import builtins
import dis
import functools
import inspect
import sys
from types import CodeType, FrameType
from typing import Optional, Sequence

LOSS = "loss"
# A causal LM output's fields: read of `x[0]`, they say `x` holds outputs, not one
OUTPUT_FIELDS = frozenset({LOSS, "logits", "past_key_values", "cache", "hidden_states", "attentions", "aux_loss",
                           "router_logits", "last_hidden_state"})
RETURNED = "returned"
# Globals and attributes whose use in a function can read its variables without naming them (`model.eval()` and
# `torch.stack` are attributes, not the builtin or inspect's)
FRAME_GLOBALS = frozenset({"locals", "vars", "eval", "exec", "breakpoint", "inspect", "currentframe", "stack",
                           "getouterframes", "getinnerframes", "trace"})
FRAME_ATTRIBUTES = frozenset({"locals", "vars", "_getframe", "f_locals", "currentframe", "_current_frames", "f_back",
                               "tb_frame", "set_trace"})  # pdb's, ipdb's, debugpy's: a debugger shows the locals
# ... and those that do so only on the builtins module (`builtins.eval`, pytest's rewritten asserts' `@py_builtins`)
BUILTIN_ATTRIBUTES = frozenset({"eval", "exec", "breakpoint"})
SKIPPED = frozenset({"CACHE", "EXTENDED_ARG", "NOP"})
# A Trainer subclass's compute_loss argument: False where the Trainer's caller takes the loss alone, so the branch of
# `(loss, outputs) if return_outputs else loss` that reads the outputs does not run
GUARDS = frozenset({"return_outputs"})
GUARD_JUMPS = frozenset({"POP_JUMP_IF_FALSE", "POP_JUMP_FORWARD_IF_FALSE"})
JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs) | frozenset(getattr(dis, "hasjump", ()))
# From 3.11 a function's exception handlers are a table of ranges, so every path its run can take is read off the
# code: a loop and an evaluation in one function that both name their output `outputs` are told apart
PATHS = sys.version_info >= (3, 11)
# Bytecode changes with every Python: these rules are checked on 3.9-3.13 and read against 3.14's opcodes; a newer
# Python's callers keep the logits until its opcodes are read
KNOWN = sys.version_info < (3, 15)
ENDS = frozenset({"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE"})
# `with torch.no_grad():` and its kin never swallow an exception (their __exit__ returns None): the handler's jump past
# the with block, where it would continue with the variables as they were, is never taken for them
NEVER_SUPPRESS = frozenset({"no_grad", "inference_mode", "enable_grad"})
# A generator's or coroutine's `return` ends its iteration: its value reaches no plain caller
NOT_RETURNED = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
ALWAYS = frozenset({"JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_ABSOLUTE", "JUMP", "JUMP_BACKWARD_NO_INTERRUPT",
                    "JUMP_NO_INTERRUPT"})


@functools.lru_cache(maxsize=512)
def _instructions(code: CodeType) -> tuple[dis.Instruction, ...]:
    return tuple(i for i in dis.get_instructions(code) if i.opname not in SKIPPED)


@functools.lru_cache(maxsize=512)
def _offsets(code: CodeType) -> tuple[int, ...]:
    return tuple(i.offset for i in _instructions(code))


@functools.lru_cache(maxsize=512)
def _entries(code: CodeType) -> tuple[tuple[int, int], ...]:
    """Where control enters other than by falling through: each jump's (offset, target), each handler's (-1, target)."""
    jumps = tuple((i.offset, i.argval) for i in _instructions(code) if i.opcode in JUMPS and isinstance(i.argval, int))
    return jumps + tuple((-1, e.target) for e in getattr(dis.Bytecode(code), "exception_entries", ()))


@functools.lru_cache(maxsize=512)
def _reads_by_name(code: CodeType) -> bool:
    """`code` can read its variables without naming them: `locals()`, `vars()`, `eval`, frame inspection."""
    instructions = _instructions(code)
    for at, i in enumerate(instructions):
        if i.opname in ("LOAD_GLOBAL", "LOAD_NAME") and i.argval in FRAME_GLOBALS:
            return True
        if i.opname in ("LOAD_ATTR", "LOAD_METHOD") and (i.argval in FRAME_ATTRIBUTES or i.argval in BUILTIN_ATTRIBUTES
                                                          and at and "builtins" in str(instructions[at - 1].argval)):
            return True
    return False


def _reads_loss_at(code: Sequence[dis.Instruction], at: int) -> bool:
    """Instructions from `at` on read the loss of the value on top of the stack, and nothing else of it."""
    first = code[at] if at < len(code) else None
    if first is None:
        return False
    if first.opname == "LOAD_ATTR" and first.argval == LOSS:
        return True
    key = first.argval if first.opname in ("LOAD_CONST", "LOAD_SMALL_INT") else None
    # `outputs[0]` is the loss wherever there is one: a ModelOutput's first field that is set, a tuple's first item;
    # unless an output's field is read of it (`outs[0].logits`, or `first = outs[0]` ... `first.logits`): `outs`
    # holds outputs (a list a C function such as `map` built from a helper's returns, whose frame is the helper's
    # caller's)
    first_of_many = type(key) is int and _field_read(code, at + 2, stored=True)
    return (key == LOSS or type(key) is int and key == 0 and not first_of_many) and _subscript(code, at + 1)


def _subscript(code: Sequence[dis.Instruction], at: int) -> bool:
    """The instruction at `at` subscripts (`x[k]`)."""
    found = code[at] if at < len(code) else None
    return found is not None and (found.opname == "BINARY_SUBSCR" or found.opname == "BINARY_OP"
                                  and found.argrepr == "[]")


def _field_read(code: Sequence[dis.Instruction], at: int, stored: bool = False) -> bool:
    """Instructions from `at` on read an output's field (`.logits`, `["logits"]`) of the value on top of the stack;
    `stored`: or store it in a local of which some instruction of `code` reads one."""
    then = code[at] if at < len(code) else None
    if then is None:
        return False
    if then.opname in ("LOAD_ATTR", "LOAD_METHOD"):
        return then.argval in OUTPUT_FIELDS
    if then.opname == "LOAD_CONST":
        return isinstance(then.argval, str) and then.argval in OUTPUT_FIELDS and _subscript(code, at + 1)
    stores = _names(then)[0]
    return stored and len(stores) == 1 and then.opname != "DELETE_FAST" and any(
        stores[0] in _names(i)[1][-1:] and _field_read(code, n + 1) for n, i in enumerate(code))


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


def _use(instructions: Sequence[dis.Instruction], at: int, variable: str) -> Optional[str]:
    """What the instruction at `at`, which loads the local `variable`, does with it: reads its loss (LOSS), returns it
    as it is (RETURNED), or anything else (None)."""
    _, loads = _names(instructions[at])
    if loads[-1] != variable or variable in loads[:-1]:
        return None
    if _reads_loss_at(instructions, at + 1):
        return LOSS
    after = instructions[at + 1] if at + 1 < len(instructions) else None
    return RETURNED if after is not None and after.opname == "RETURN_VALUE" else None


def _uses_anywhere(instructions: Sequence[dis.Instruction], variable: str,
                   skipped: frozenset[int]) -> Optional[frozenset[str]]:
    """What every instruction that reads the local `variable`, but those `skipped`, does with it (None: one reads
    more than its loss, or returns it as it is)."""
    uses = set()
    for at, instruction in enumerate(instructions):
        if at not in skipped and variable in _names(instruction)[1]:
            uses.add(_use(instructions, at, variable))
    return None if None in uses else frozenset(uses)


@functools.lru_cache(maxsize=512)
def _unsuppressed(code: CodeType) -> frozenset[int]:
    """The with-handlers' jumps past their block (an exception swallowed) that are never taken: those of a block whose
    manager is a zero-argument call of a NEVER_SUPPRESS name (3.11+: BEFORE_WITH, the handler's WITH_EXCEPT_START)."""
    instructions, offsets = _instructions(code), _offsets(code)
    handlers = getattr(dis.Bytecode(code), "exception_entries", ())
    never = set()
    for at, instruction in enumerate(instructions):
        if instruction.opname != "WITH_EXCEPT_START" or at == 0:
            continue
        jump = at + 2 if at + 1 < len(instructions) and instructions[at + 1].opname == "TO_BOOL" else at + 1
        starts = [e.start for e in handlers if e.target == instructions[at - 1].offset]
        if jump >= len(instructions) or "IF_TRUE" not in instructions[jump].opname or not starts:
            continue
        before = [i for i in instructions[:bisect.bisect_left(offsets, min(starts))]
                  if i.opname not in ("PRECALL", "PUSH_NULL")]  # 3.13: `torch.no_grad` of an imported module
        if (len(before) >= 3 and before[-1].opname == "BEFORE_WITH" and before[-2].opname == "CALL"
                and before[-2].argval == 0 and before[-3].argval in NEVER_SUPPRESS
                and before[-3].opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL")):
            never.add(jump)
    return frozenset(never)


@functools.lru_cache(maxsize=512)
def _uses_on_every_path(code: CodeType, variable: str, start: int, skipped: frozenset[int]) -> Optional[frozenset[str]]:
    """What each read of the local `variable` does with it on every path from instruction `start` (3.11+) until it is
    stored again (None: one reads more than its loss, or returns it as it is): jumps, falling through, and each
    instruction's exception handler, but `skipped`."""
    instructions, offsets = _instructions(code), _offsets(code)
    uses = set()
    handlers = getattr(dis.Bytecode(code), "exception_entries", ())
    unsuppressed = _unsuppressed(code)
    todo, seen = [start], set()
    while todo:
        at = todo.pop()
        if at in seen or at >= len(instructions) or at in skipped:
            continue
        seen.add(at)
        instruction = instructions[at]
        stores, loads = _names(instruction)
        if variable in loads:
            uses.add(_use(instructions, at, variable))
            if None in uses:
                return None
        todo.extend(bisect.bisect_left(offsets, e.target) for e in handlers if e.start <= instruction.offset < e.end)
        if variable in stores or instruction.opname in ENDS:
            continue
        if instruction.opcode in JUMPS and isinstance(instruction.argval, int) and at not in unsuppressed:
            todo.append(bisect.bisect_left(offsets, instruction.argval))
            if instruction.opname in ALWAYS:
                continue
        todo.append(at + 1)
    return frozenset(uses)


def _call_at(frame: FrameType) -> Optional[int]:
    """The index in `frame`'s instructions of the call it is making now."""
    instructions = _instructions(frame.f_code)
    # the call's own offset, or (3.11, a call of a Python function) that of one of its inline caches
    at = bisect.bisect_right(_offsets(frame.f_code), frame.f_lasti) - 1
    return at if at >= 0 and instructions[at].opname.startswith("CALL") else None


def _uses(frame: FrameType) -> Optional[frozenset[str]]:
    """What `frame`'s code does with the result of the call it is making now: reads its loss (LOSS), returns it as it
    is (RETURNED), both on different paths, nothing (an empty set), or more (None)."""
    code, at = frame.f_code, _call_at(frame)
    if at is None:
        return None
    instructions = _instructions(code)
    if _reads_loss_at(instructions, at + 1):
        return frozenset({LOSS})
    after = instructions[at + 1] if at + 1 < len(instructions) else None
    if after is not None and after.opname == "RETURN_VALUE":
        return frozenset({RETURNED})
    if after is None or after.opname not in ("STORE_FAST", "STORE_FAST_LOAD_FAST"):
        return None  # a global, a cell, an attribute, a tuple, an argument: read elsewhere
    (variable,), loaded = _names(after)[0][:1], _names(after)[1]
    if variable in code.co_cellvars or variable in code.co_freevars or _reads_by_name(code):
        return None  # a closure shares it, or the code can read it without naming it
    skipped = _skipped(frame, instructions)
    if not PATHS:
        return _uses_anywhere(instructions, variable, skipped)
    first = frozenset()
    if variable in loaded:  # STORE_FAST_LOAD_FAST (3.13) reads back what it stored
        use = _use(instructions, at + 1, variable)
        if use is None:
            return None
        first = frozenset({use})
    rest = _uses_on_every_path(code, variable, at + 2, skipped)
    return None if rest is None else first | rest


# What a call's callee may be made of to be read: a name, then attributes of it (`model`, `self.model`, `self.step`)
NAMES = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_GLOBAL",
                   "LOAD_NAME", "LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})
ATTRIBUTES = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
CALL_PARTS = frozenset({"PUSH_NULL", "KW_NAMES", "PRECALL"})


def calls_directly(frame: FrameType, child: FrameType) -> bool:
    """The call `frame` is making now calls `child`'s function itself, so what `child` returns is what `frame`'s code
    reads: not through a C function between them that keeps the output (`functools.lru_cache`), collects it
    (`list(map(step, batches))`) or hands it to a key function (`min(..., key=...)`), which no frame shows. Read off
    the call's callee expression (3.11+: a name and its attributes, by the instructions' source positions), looked
    up in `frame`; a callee it cannot read is not known to be direct. Before 3.11 a call is taken as direct."""
    if not PATHS:
        return True
    at = _call_at(frame)
    if at is None:
        return False
    callee = _callee(_instructions(frame.f_code), at)
    if callee is None:
        return False
    try:
        found = _look_up(frame, callee)
    except Exception:  # noqa: BLE001 - a name unbound since, or an attribute that raises: not known
        return False
    return _runs_as(found, child)


def _callee(instructions: Sequence[dis.Instruction], at: int) -> Optional[list[dis.Instruction]]:
    """The instructions that load the callee of the call at `at`: those of the call's source span that end before
    its arguments begin, if they are a name and attributes of it, else None."""
    span = instructions[at].positions
    if span is None or span.lineno is None or span.col_offset is None:
        return None
    start, end = (span.lineno, span.col_offset), (span.end_lineno, span.end_col_offset)
    parts, n = [], at - 1
    while n >= 0:
        where = instructions[n].positions
        if where is None or where.lineno is None or (where.lineno, where.col_offset) < start or (
                where.end_lineno, where.end_col_offset) > end:
            break
        parts.append(instructions[n])
        n -= 1
    parts.reverse()
    heads = [(i.positions.end_lineno, i.positions.end_col_offset) for i in parts
             if (i.positions.lineno, i.positions.col_offset) == start]
    ends = [e for e in heads if e < end]
    if not ends:
        return None
    last = max(ends)
    loads = [i for i in parts if (i.positions.end_lineno, i.positions.end_col_offset) <= last
             and i.opname not in CALL_PARTS]
    if not loads or loads[0].opname not in NAMES or any(i.opname not in ATTRIBUTES for i in loads[1:]):
        return None
    return loads


def _look_up(frame: FrameType, loads: Sequence[dis.Instruction]) -> object:
    """The value of a name and its attributes (`loads`) in `frame`, as its code looked it up."""
    first = loads[0]
    name = first.argval[0] if isinstance(first.argval, tuple) else first.argval
    if first.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
        scopes = ([frame.f_locals] if first.opname == "LOAD_NAME" else []) + [frame.f_globals]
        found = next((scope[name] for scope in scopes if name in scope), None)
        value = found if found is not None else getattr(builtins, name)
    else:
        value = frame.f_locals[name]
    for attribute in loads[1:]:
        value = getattr(value, attribute.argval)
    return value


def _runs_as(callee: object, child: FrameType) -> bool:
    """Calling `callee` runs `child`'s code first: a function, a method, a callable object (a module: its
    `_wrapped_call_impl`), through `functools.partial`, which passes the output on."""
    code = child.f_code
    while isinstance(callee, functools.partial):
        callee = callee.func
    function = getattr(callee, "__func__", callee)  # a bound method's function
    if getattr(function, "__code__", None) is code:
        return True
    call = inspect.getattr_static(type(callee), "__call__", None)
    return getattr(call, "__code__", None) is code and child.f_locals.get("self") is callee


def reads_what_it_keeps(frame: FrameType) -> bool:
    """`frame` keeps the result of the call it is making in a local and reads more of it than its loss, or passes
    it to another function (PEFT's CPT computes a loss of its own from the logits)."""
    at = _call_at(frame) if KNOWN else None
    instructions = _instructions(frame.f_code)
    if at is None or at + 1 >= len(instructions):
        return False
    return instructions[at + 1].opname in ("STORE_FAST", "STORE_FAST_LOAD_FAST") and _uses(frame) is None


def result_read_at(frame: Optional[FrameType]) -> Optional[str]:
    """What `frame`'s code does with the result of the call it is making now, read once: LOSS (reads nothing of it
    but the loss), RETURNED (passes it on: returns it as it is to its own caller on some path, as a helper of the
    user's, `def step(model, batch): return model(**batch)` or `outputs = model(**batch)` ... `return outputs`, a
    wrapper module's `forward` or a lambda does, and reads nothing of it but the loss on the others), or None."""
    if not KNOWN or frame is None:
        return None
    uses = _uses(frame)
    if uses is None:
        return None
    if RETURNED not in uses:
        return LOSS
    # a generator's or coroutine's return, or module-level code's, reaches no plain caller
    return None if frame.f_code.co_flags & NOT_RETURNED or frame.f_code.co_name == "<module>" else RETURNED


def reads_loss_alone_at(frame: Optional[FrameType]) -> bool:
    """`frame` is calling the LM now, and its code reads nothing of the call's result but the loss."""
    return result_read_at(frame) == LOSS
