"""What a compiled step does on the chip, read from its optimized HLO: the audit behind ``jaxserve plan``.

XLA's ``cost_analysis`` counts one trip of a loop and the dearest branch of a conditional, and it is None for a GPU
compiled without one, so it is not a step's traffic. :func:`audit` walks the optimized module instead: the entry
computation, every ``while`` body times its trip count (XLA's ``known_trip_count``, or the bound of its condition; the
layers' scan), every branch of a ``conditional`` (the dearest taken, and the conditional counted), and prices each
instruction that runs on the chip (a fusion, a custom call such as a Pallas kernel, a copy, a collective: on a GPU, a
kernel launch) at the bytes it reads and writes:

- an operand that is a whole stack carried by the loop (its leading dimension the trip count: a layer's weights read
  in place by a fusion or a kernel given the layer's index) counts one trip's share, a layer;
- the KV pool (``kv_shapes``) is not priced by its operands, which are the whole pool wherever a kernel reads a few
  pages or writes a few rows: the caller adds the KV a step reads (``StepAudit.bytes`` leaves it out).

A **weight copy** is an instruction that only moves data (``copy``, or a fusion of nothing but slices, bitcasts and
copies) of what its computation was given (an argument of the step, a stack its loop carries), through other moves,
and writes at least ``min_copy_bytes``: on a GPU, the layer scan's slice of each weight stack copied before a product
reads it; on a TPU, a slice copied to be concatenated with others.
"""

from __future__ import annotations

import dataclasses
import math
import re

_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
# Instructions that launch nothing: bookkeeping of buffers and tuples.
_FREE = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id", "replica-id",
    "opt-barrier", "add-dependency", "domain", "get-dimension-size", "iota",
}  # fmt: skip
_MOVES = {"parameter", "constant", "slice", "dynamic-slice", "bitcast", "copy", "reshape", "transpose", "tuple"}
_COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)


def _itemsize(dtype: str) -> float:
    if dtype.startswith("f8"):
        return 1
    return _ITEMSIZE.get(dtype, 0)


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """The (dtype, shape) of every array in an HLO type: one, or a tuple's."""
    return [(m[1], tuple(int(d) for d in m[2].split(",") if d)) for m in _ARRAY.finditer(type_text)]


def nbytes(type_text: str) -> int:
    return int(sum(_itemsize(d) * math.prod(s) for d, s in arrays(type_text)))


@dataclasses.dataclass
class Instruction:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str
    args: str = ""  # the text between the parentheses (a parameter's number)


def _split_top(text: str) -> tuple[str, str]:
    """'a, (b, c)), rest' -> ('a, (b, c)', ', rest'): up to the parenthesis that closes the one before ``text``."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            if depth == 0:
                return text[:i], text[i + 1 :]
            depth -= 1
    return text, ""


def parse(hlo: str) -> tuple[dict[str, list[Instruction]], str]:
    """An optimized HLO module's text -> ({computation: its instructions}, the entry computation's name)."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if current is None:
            m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
            if m:
                current = comps.setdefault(m[2], [])
                entry = m[2] if m[1] else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
        if not m:
            continue
        name, rest = m[1], m[2]
        if rest.startswith("("):
            inner, rest = _split_top(rest[1:])
            type_text = f"({inner})"
        else:
            type_text, _, rest = rest.partition(" ")
        rest = rest.lstrip()
        op = re.match(r"([\w\-]+)\(", rest)
        if not op:
            continue
        args, attrs = _split_top(rest[op.end() :])
        operands = re.findall(r"%([\w.\-]+)", args)
        current.append(Instruction(name, type_text, op[1], operands, attrs, args))
    return comps, entry


@dataclasses.dataclass
class StepAudit:
    """Per step, loops times their trips: what runs on the chip and the bytes it moves (see the module)."""

    bytes: float = 0.0  # read and written by the instructions, the KV pool left out
    kernels: int = 0  # instructions that run on the chip (GPU: kernel launches; TPU: ops)
    weight_copies: int = 0
    weight_copy_bytes: float = 0.0  # written by them
    conditionals: int = 0
    whiles: int = 0
    collectives: int = 0
    collective_bytes: float = 0.0  # the collectives' results
    unknown_trips: int = 0  # while loops without a known trip count (counted once)

    def merged(self, other: StepAudit, times: float = 1) -> StepAudit:
        out = dataclasses.replace(self)
        for f in dataclasses.fields(self):
            setattr(out, f.name, getattr(self, f.name) + times * getattr(other, f.name))
        return out

    def summary(self, floor: float | None = None, kv_bytes: float = 0.0) -> str:
        moved = self.bytes + kv_bytes
        ratio = f" ({moved / floor:.2f}x the floor of {floor / 2**30:.2f} GiB)" if floor else ""
        return (
            f"{moved / 2**30:.2f} GiB moved per step{ratio}; {self.kernels:,} kernels, {self.weight_copies} weight "
            f"copies ({self.weight_copy_bytes / 2**30:.2f} GiB), {self.conditionals} conditionals, {self.whiles} while "
            f"loops, {self.collectives} collectives ({self.collective_bytes / 2**20:.1f} MiB)"
        )


def _trip_count(attrs: str, condition: list[Instruction]) -> int | None:
    """XLA's ``known_trip_count`` (GPU), else N of a condition ``counter < N`` (a scan's, counting from 0: TPU)."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
    if m:
        return int(m[1])
    consts = {i.name: i.args.strip() for i in condition if i.opcode == "constant"}
    for i in condition:
        if i.opcode == "compare" and "direction=LT" in i.attrs and len(i.operands) == 2 and i.operands[1] in consts:
            value = consts[i.operands[1]]
            return int(value) if value.isdigit() else None
    return None


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(rf"{key}=\{{([^}}]*)\}}", attrs)
    if m:
        return re.findall(r"%?([\w.\-]+)", m[1])
    m = re.search(rf"{key}=%?([\w.\-]+)", attrs)
    return [m[1]] if m else []


def audit(hlo: str, kv_shapes: tuple[tuple[int, ...], ...] | None = None, min_copy_bytes: int = 1 << 20) -> StepAudit:
    """The audit of one compiled step's optimized HLO (``compiled.as_text()``); ``kv_shapes``: the KV pool's arrays'
    shapes (per chip), whose bytes the caller prices (see the module); default: the arrays the step donates and
    updates in place (the module's ``input_output_alias``), which are the engine step's pools."""
    comps, entry = parse(hlo)
    # the pool in any view (a TPU's drops a unit dimension): by its number of elements
    kv = {math.prod(s) for s in (donated_shapes(hlo, comps, entry) if kv_shapes is None else kv_shapes)}
    named = {c: {i.name: i for i in body} for c, body in comps.items()}  # each computation's instructions by name

    def moves_only(comp: str) -> bool:
        """A fused computation that only moves data: slices, copies, bitcasts (and the index arithmetic of its
        slices, on a few elements)."""
        body = [i for i in comps.get(comp, ()) if sum(math.prod(s) for _, s in arrays(i.type)) > 64]
        return all(i.opcode in _MOVES for i in body) and any(
            i.opcode in ("copy", "dynamic-slice", "slice") for i in body
        )

    def is_move(ins: Instruction) -> bool:
        calls = _called(ins.attrs, "calls")
        return ins.opcode in ("copy", "bitcast") or (ins.opcode == "fusion" and bool(calls) and moves_only(calls[0]))

    def of_weights(ins: Instruction, local: dict[str, Instruction]) -> bool:
        """Whether a move copies what the computation was given (a weight, a stack the loop carries), through
        other moves, rather than something the step computed (logits, activations)."""
        seen = set()
        while ins is not None and ins.name not in seen:
            seen.add(ins.name)
            if ins.opcode in ("parameter", "get-tuple-element"):
                return True
            if not is_move(ins) or not ins.operands:
                return False
            ins = local.get(ins.operands[0])
        return False

    def walk(comp: str, trips: int | None, stacked: set[str]) -> StepAudit:
        out = StepAudit()
        local = named.get(comp, {})
        for ins in comps.get(comp, ()):
            if ins.opcode in _FREE:
                continue
            if ins.opcode == "while":
                body = _called(ins.attrs, "body")
                n = _trip_count(ins.attrs, comps.get(next(iter(_called(ins.attrs, "condition")), ""), []))
                inner = walk(body[0], n, _carried(comps.get(body[0], ()), n)) if body else StepAudit()
                out = out.merged(inner, n or 1)
                out.whiles += 1
                out.unknown_trips += n is None
                continue
            if ins.opcode == "conditional":
                branches = _called(ins.attrs, "branch_computations") or [
                    *_called(ins.attrs, "true_computation"),
                    *_called(ins.attrs, "false_computation"),
                ]
                taken = [walk(b, trips, stacked) for b in branches]
                out = out.merged(max(taken, key=lambda a: a.bytes, default=StepAudit()))
                out.conditionals += 1
                continue
            if ins.opcode == "call":
                for c in _called(ins.attrs, "to_apply"):
                    out = out.merged(walk(c, trips, stacked))
                continue
            if ins.opcode.endswith("-done") or ins.opcode.endswith("-update"):
                continue  # the -start of an async pair carries its work
            out.kernels += 1
            result = arrays(ins.type)
            calls = _called(ins.attrs, "calls")
            sliced = _sliced_params(comps.get(calls[0], ())) if calls else {}
            total = 0.0
            for k, name in enumerate(ins.operands):
                operand = local.get(name)
                for dtype, shape in arrays(operand.type if operand else ""):
                    if math.prod(shape) in kv:
                        continue
                    b = _itemsize(dtype) * math.prod(shape)
                    if k in sliced:
                        b = min(b, sliced[k])  # the fusion reads only the rows it gathers or slices
                    elif name in stacked and trips and shape and shape[0] == trips:
                        b /= trips  # a layer of a stack the loop carries, read in place
                    total += b
            written = sum(_itemsize(d) * math.prod(s) for d, s in result if math.prod(s) not in kv)
            out.bytes += total + written
            if any(ins.opcode.startswith(c) for c in _COLLECTIVES):
                out.collectives += 1
                out.collective_bytes += written
            if written >= min_copy_bytes and is_move(ins) and of_weights(ins, local):
                out.weight_copies += 1
                out.weight_copy_bytes += written
        return out

    return walk(entry, None, set())


def donated_shapes(hlo: str, comps: dict | None = None, entry: str = "") -> set[tuple[int, ...]]:
    """The shapes of the entry's parameters that an output takes the place of (``input_output_alias``)."""
    if comps is None:
        comps, entry = parse(hlo)
    m = re.search(r"input_output_alias=\{(.*?)\}\s*(?:,\s*\w+=|$)", hlo.split("\n", 1)[0])
    numbers = {int(n) for n in re.findall(r":\s*\((\d+),", m[1])} if m else set()
    params = {int(i.args): i.type for i in comps.get(entry, ()) if i.opcode == "parameter" and i.args.strip().isdigit()}
    return {shape for n in numbers for _, shape in arrays(params.get(n, ""))}


def _sliced_params(fused: list[Instruction]) -> dict[int, float]:
    """A fused computation's parameters (by number) read only through gathers and slices (as the sliced operand),
    with the bytes those read: an embedding's looked-up rows, a layer's slice of a stack."""
    number = {}
    for i in fused:
        if i.opcode == "parameter":
            number[i.name] = int(i.args) if i.args.strip().isdigit() else None
    uses: dict[str, list[Instruction]] = {}
    for i in fused:
        for pos, n in enumerate(i.operands):
            if n in number:
                uses.setdefault(n, []).append((pos, i))
    out = {}
    for name, k in number.items():
        used = uses.get(name, [])
        if (
            k is not None
            and used
            and all(op.opcode in ("gather", "dynamic-slice", "slice") and pos == 0 for pos, op in used)
        ):
            out[k] = sum(nbytes(op.type) for _, op in used)
    return out


def _carried(body: list[Instruction], trips: int | None) -> set[str]:
    """The names in a loop body that stand for arrays the loop carries (its parameter's tuple elements) with a leading
    dimension of the trip count: stacks indexed by the loop."""
    if not trips:
        return set()
    params = {i.name for i in body if i.opcode == "parameter"}
    out = set()
    for i in body:
        if i.opcode == "get-tuple-element" and set(i.operands) <= params:
            shapes = arrays(i.type)
            if shapes and shapes[0][1][:1] == (trips,):
                out.add(i.name)
    # bitcasts of them read the same buffer
    for i in body:
        if i.opcode == "bitcast" and i.operands and i.operands[0] in out:
            out.add(i.name)
    return out
