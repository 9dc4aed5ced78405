"""What an XLA program costs, read from its HLO text: the FLOPs of every dot and convolution and the bytes
each top-level instruction moves, every loop body counted as often as it runs, each labelled with the named
scope it was traced in (`dsv41 compile-report --breakdown`, the analytic FLOP count's tests).

XLA's own `cost_analysis()` gives one total and counts a loop body once; this walks the module from its
entry computation instead: a `while` multiplies its body by the trip count (the backend's
`known_trip_count`, else the integer bound its condition compares the counter with), a `call` and a fusion
are entered once, a `conditional` counts its costliest branch. Bytes follow XLA's convention per
instruction (operands read + result written), with the cases that would otherwise count whole buffers for a
slice: a fusion parameter read only through `dynamic-slice` / `slice` / `gather` counts what those read,
and an in-place `dynamic-update-slice` or `scatter` (a fusion's root, or on its own) counts its update twice
(read and write), not the buffer. Asynchronous copies (`copy-start`/`-done`: the backend's prefetches) and
the plumbing (parameters, tuples, bitcasts, constants) move nothing here.
"""

from __future__ import annotations

import dataclasses
import math
import re

# Bytes per element of HLO's element types (sub-byte types packed two per byte).
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
          "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->\s*.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "while", "call", "conditional", "opt-barrier", "add-dependency", "copy-start", "copy-done",
         "all-gather-done", "all-reduce-done", "collective-permute-done", "async-done", "send-done", "recv-done",
         "get-dimension-size", "domain"}
_SLICING = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode: the operand holding the update (scatter: its last)


def element_bytes(dtype: str) -> float:
    if dtype.startswith("f8"):
        return 1
    if dtype.startswith("f4"):
        return 0.5
    if dtype not in _BYTES:
        raise ValueError(f"HLO element type: {dtype!r}: expected one of {sorted(_BYTES)} or an f8/f4 type")
    return _BYTES[dtype]


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape (an array, or a tuple of them: their sum)."""
    return sum(element_bytes(t) * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims in _ARRAY.findall(shape))


def dims_of(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool

    @property
    def scope(self) -> str:
        m = _OP_NAME.search(self.attrs)
        return m.group(1) if m else ""

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{re.escape(key)}=(\{{[^}}]*\}}|[\w.\-%]+)", self.attrs)
        return m.group(1) if m else None


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"HLO text: unbalanced brackets in {text[:120]!r}")


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts]


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    if rest.startswith("("):  # a tuple shape
        end = _balanced(rest, 0)
    else:
        end = rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    # The layout may follow an array shape: f32[4,8]{1,0}.
    if rest.startswith("{"):
        rest = rest[_balanced(rest, 0):].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren].strip()
    close = _balanced(rest, paren)
    operands = [p.split()[-1].lstrip("%") for p in _split_top(rest[paren + 1:close - 1]) if p]
    return Instr(name, shape, opcode, operands, rest[close:], root)


def parse(hlo_text: str) -> tuple[dict[str, list[Instr]], str]:
    """({computation: its instructions}, the entry computation's name) of an HLO module's text."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith(("HloModule", " ")):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            comps[current].append(ins)
    if entry is None:
        raise ValueError("HLO text: no ENTRY computation: expected a module's text (`as_text()`)")
    return comps, entry


@dataclasses.dataclass
class Op:
    """One costed instruction: its FLOPs and bytes for one execution, and how often it runs."""
    computation: str
    name: str
    opcode: str
    shape: str
    scope: str
    flops: float
    bytes: float
    count: int

    @property
    def total_flops(self) -> float:
        return self.flops * self.count

    @property
    def total_bytes(self) -> float:
        return self.bytes * self.count


def dot_flops_of(ins: Instr, shapes: dict[str, str]) -> float:
    """2 · output elements · contracted size of a dot or convolution (0 for anything else)."""
    out = math.prod(dims_of(ins.shape))
    if ins.opcode == "dot":
        lhs = dims_of(shapes[ins.operands[0]])
        contracting = ins.attr("lhs_contracting_dims") or "{}"
        return 2.0 * out * math.prod(lhs[int(c)] for c in contracting.strip("{}").split(",") if c)
    if ins.opcode == "convolution":
        rhs = dims_of(shapes[ins.operands[1]])
        labels = ins.attr("dim_labels") or ""
        kernel = labels.split("_")[1].split("->")[0] if "_" in labels else ""
        o = kernel.find("o")
        return 2.0 * out * math.prod(rhs) / (rhs[o] if 0 <= o < len(rhs) else 1)
    return 0.0


class Program:
    """A parsed HLO module, costed (`ops`: every costed instruction, with its execution count)."""

    def __init__(self, hlo_text: str):
        self.computations, self.entry = parse(hlo_text)
        self.unknown_trip_counts = 0
        self.ops = self._walk(self.entry, 1)

    def _shapes(self, comp: str) -> dict[str, str]:
        return {i.name: i.shape for i in self.computations[comp]}

    def trip_count(self, ins: Instr) -> int | None:
        m = _TRIP.search(ins.attrs)
        if m:
            return int(m.group(1))
        cond = self.computations.get((ins.attr("condition") or "").lstrip("%"), [])
        bounds = {int(i.operands[0]) for i in cond if i.opcode == "constant" and re.fullmatch(r"[su]\d+\[\]", i.shape)
                  and i.operands and re.fullmatch(r"-?\d+", i.operands[0])}
        return bounds.pop() if len(bounds) == 1 else None

    def _walk(self, comp: str, count: int) -> list[Op]:
        shapes = self._shapes(comp)
        ops: list[Op] = []
        for ins in self.computations[comp]:
            if ins.opcode == "while":
                trips = self.trip_count(ins)
                if trips is None:
                    self.unknown_trip_counts += 1
                    trips = 1
                ops += self._walk(ins.attr("body").lstrip("%"), count * trips)
            elif ins.opcode == "call":
                ops += self._walk(ins.attr("to_apply").lstrip("%"), count)
            elif ins.opcode == "conditional":
                ops += max((self._walk(b, count) for b in self._branches(ins)),
                           key=lambda branch: (sum(o.total_flops for o in branch), sum(o.total_bytes for o in branch)),
                           default=[])
            elif ins.opcode == "fusion":
                ops.append(self._fusion(comp, ins, shapes, count))
            elif ins.opcode not in _FREE:
                ops.append(Op(comp, ins.name, ins.opcode, ins.shape, ins.scope, dot_flops_of(ins, shapes),
                              self._bytes(ins, shapes), count))
        return ops

    def _branches(self, ins: Instr) -> list[str]:
        listed = ins.attr("branch_computations")
        if listed:
            return [b.strip().lstrip("%") for b in listed.strip("{}").split(",")]
        return [ins.attr(k).lstrip("%") for k in ("true_computation", "false_computation") if ins.attr(k)]

    @staticmethod
    def _bytes(ins: Instr, shapes: dict[str, str]) -> float:
        if ins.opcode in _SLICING:
            return 2 * shape_bytes(ins.shape)
        if ins.opcode in _IN_PLACE:
            update = ins.operands[-1] if ins.opcode == "scatter" else ins.operands[1]
            return 2 * shape_bytes(shapes[update])
        return shape_bytes(ins.shape) + sum(shape_bytes(shapes[o]) for o in ins.operands if o in shapes)

    def _fusion(self, comp: str, ins: Instr, shapes: dict[str, str], count: int) -> Op:
        body = ins.attr("calls").lstrip("%")
        inner = self.computations[body]
        inner_shapes = self._shapes(body)
        flops = sum(dot_flops_of(i, inner_shapes) for i in inner)
        dots = [i for i in inner if i.opcode in ("dot", "convolution")]
        scope = dots[0].scope if dots and dots[0].scope else ins.scope
        params = {i.name: int(i.operands[0]) if i.operands else 0 for i in inner if i.opcode == "parameter"}
        root = next((i for i in inner if i.root), inner[-1])
        written = shape_bytes(ins.shape)
        in_place = None
        if root.opcode in _IN_PLACE and root.operands[0] in params:
            in_place = root.operands[0]
            update = root.operands[-1] if root.opcode == "scatter" else root.operands[1]
            written = shape_bytes(inner_shapes[update])
        read = 0.0
        for pname, index in params.items():
            if pname == in_place:
                continue
            users = [i for i in inner if pname in i.operands]
            if users and all(u.opcode in _SLICING and u.operands[0] == pname for u in users):
                read += sum(shape_bytes(u.shape) for u in users)
            elif index < len(ins.operands) and ins.operands[index] in shapes:
                read += shape_bytes(shapes[ins.operands[index]])
            else:
                read += shape_bytes(inner_shapes[pname])
        if in_place is not None:
            read += written
        return Op(comp, ins.name, "fusion", ins.shape, scope, flops, read + written, count)

    def totals(self) -> dict:
        return {"flops": sum(o.total_flops for o in self.ops), "bytes": sum(o.total_bytes for o in self.ops),
                "unknown_trip_counts": self.unknown_trip_counts}


def dot_flops(hlo_text: str) -> float:
    """The FLOPs of every dot and convolution in an HLO module's text, loop bodies times their trip count."""
    return Program(hlo_text).totals()["flops"]
