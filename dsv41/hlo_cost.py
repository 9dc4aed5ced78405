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
(read and write), not the buffer. Asynchronous copies and slices (`copy-start`/`-done`, `slice-start`/`-done`:
the backend's prefetches into on-chip memory, whose readers count what they read) and the plumbing
(parameters, tuples, bitcasts, constants) move nothing here.
"""

from __future__ import annotations

import dataclasses
import math
import re

# Bytes per element of HLO's element types (sub-byte types packed two per byte).
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
          "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_HOST = "S(5)"  # a layout's memory space 5: host memory, not the chip's HBM
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->\s*.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_FREE = {"custom-call-done", "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "while", "call", "conditional", "opt-barrier", "add-dependency", "copy-start", "copy-done",
         "slice-start", "slice-done",
         "all-gather-done", "all-reduce-done", "collective-permute-done", "async-done", "send-done", "recv-done",
         "get-dimension-size", "domain"}
_SLICING = {"dynamic-slice", "slice", "gather"}
_TRANSPARENT = {"copy", "bitcast", "convert", "reshape", "transpose", "bitcast-convert"}  # element for element
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode: the operand holding the update (scatter: its last)


def element_bytes(dtype: str) -> float:
    if dtype.startswith("f8"):
        return 1
    if dtype.startswith("f4"):
        return 0.5
    if dtype not in _BYTES:
        raise ValueError(f"HLO element type: {dtype!r}: expected one of {sorted(_BYTES)} or an f8/f4 type")
    return _BYTES[dtype]


def shape_bytes(shape: str, host: bool = False) -> float:
    """Bytes of an HLO shape (an array, or a tuple of them: their sum): those in the chip's memory, or with
    `host` those whose layout puts them in host memory."""
    return sum(element_bytes(t) * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims, layout in _ARRAY.findall(shape) if (_HOST in layout) == host)


def _elements(shape: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d) for _, dims, _ in _ARRAY.findall(shape))


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
    inside = re.sub(r"/\*.*?\*/", "", rest[paren + 1:close - 1])  # the printer's /*index=5*/ comments
    operands = [p.split()[-1].lstrip("%") for p in _split_top(inside) if p]
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
        if line.startswith("}"):
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


def _int_constant(ins: Instr) -> int | None:
    """The value of an integer scalar constant instruction, else None."""
    if ins.opcode != "constant" or not re.match(r"[su]\d+\[\]", ins.shape) or not ins.operands:
        return None
    return int(ins.operands[0]) if re.fullmatch(r"-?\d+", ins.operands[0]) else None


def dot_flops_of(ins: Instr, shapes: dict[str, str]) -> float:
    """2 · output elements · contracted size of a dot or convolution (0 for anything else)."""
    out = math.prod(dims_of(ins.shape))
    if ins.opcode == "dot":
        lhs = dims_of(shapes[ins.operands[0]])
        contracting = ins.attr("lhs_contracting_dims") or "{}"
        return 2.0 * out * math.prod(lhs[int(c)] for c in contracting.strip("{}").split(",") if c)
    if ins.opcode == "convolution":
        # Each output element meets the kernel's input features at every window tap that lands on data: with
        # lhs_dilate d over a window of size k, at most ceil(k / d) of them, and at most the n input positions
        # along that dimension (TPU writes a batched matmul as a window of G taps that meets one: size=G,
        # lhs_dilate=G; and an output dimension as a window of k taps over one padded input position).
        lhs = dims_of(shapes[ins.operands[0]])
        rhs = dims_of(shapes[ins.operands[1]])
        labels = ins.attr("dim_labels") or ""
        kernel = labels.split("_")[1].split("->")[0] if "_" in labels else ""
        i = kernel.find("i")
        window = re.search(r"window=\{([^}]*)\}", ins.attrs)
        fields = dict(f.split("=", 1) for f in window.group(1).split()) if window else {}
        sizes = [int(v) for v in fields.get("size", "").split("x") if v]
        dilate = [int(v) for v in fields.get("lhs_dilate", "").split("x") if v] or [1] * len(sizes)
        lhs_labels = labels.split("_")[0] if "_" in labels else ""
        extent = [lhs[lhs_labels.index(str(j))] if str(j) in lhs_labels else k for j, k in enumerate(sizes)]
        taps = math.prod(min(-(-k // d), n) for k, d, n in zip(sizes, dilate, extent))
        return 2.0 * out * (rhs[i] if 0 <= i < len(rhs) else 1) * taps
    return 0.0


class Program:
    """A parsed HLO module, costed (`ops`: every costed instruction, with its execution count)."""

    def __init__(self, hlo_text: str):
        self.computations, self.entry = parse(hlo_text)
        self.unknown_trip_counts = 0
        self.ops = self._walk(self.entry, 1)

    def _shapes(self, comp: str) -> dict[str, str]:
        return {i.name: i.shape for i in self.computations[comp]}

    def trip_count(self, ins: Instr, defined: dict[str, Instr]) -> int | None:
        """How many times a `while` instruction (of the computation whose instructions are `defined`) runs its
        body, where the program says: None for a loop whose bound is computed at run time."""
        m = _TRIP.search(ins.attrs)
        if m:
            return int(m.group(1))
        # A scan's condition: compare(counter, bound), direction=LT, the counter a tuple element starting at a
        # constant of the loop's initial tuple (0 for a scan).
        cond = {i.name: i for i in self.computations.get((ins.attr("condition") or "").lstrip("%"), [])}
        root = next((i for i in cond.values() if i.root), None)
        if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
            return None
        counter, bound = (cond.get(o) for o in root.operands)
        if bound is None or counter is None or counter.opcode != "get-tuple-element":
            return None
        end = _int_constant(bound)
        start = 0
        init = defined.get(ins.operands[0]) if ins.operands else None
        index = int(counter.attr("index") or 0)
        if init is not None and init.opcode == "tuple" and index < len(init.operands):
            first = defined.get(init.operands[index])
            while first is not None and first.opcode in ("copy", "bitcast") and first.operands:
                first = defined.get(first.operands[0])
            start = _int_constant(first) if first is not None else None
        return None if end is None or start is None else max(end - start, 0)

    def _walk(self, comp: str, count: int) -> list[Op]:
        shapes = self._shapes(comp)
        defined = {i.name: i for i in self.computations[comp]}
        ops: list[Op] = []
        for ins in self.computations[comp]:
            if ins.opcode == "while":
                trips = self.trip_count(ins, defined)
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
        for pname in params:
            if pname != in_place:
                read += self._param_read(body, pname)
        if in_place is not None:
            read += written
        return Op(comp, ins.name, "fusion", ins.shape, scope, flops, read + written, count)

    def _param_read(self, comp: str, pname: str) -> float:
        """Bytes a fused computation reads of its parameter `pname`: what its slices read where the parameter
        is only sliced (after layout copies, bitcasts and converts, also inside nested fusions), else all of it."""
        shape = next(i.shape for i in self.computations[comp] if i.name == pname)
        read = self._elements_read(comp, pname)
        whole = _elements(shape)
        return shape_bytes(shape) * (min(read, whole) / whole if whole else 0.0)

    def _elements_read(self, comp: str, name: str) -> float:
        inner = self.computations[comp]
        whole = _elements(next(i.shape for i in inner if i.name == name))
        total = 0.0
        for u in (i for i in inner if name in i.operands):
            if u.opcode in _SLICING and u.operands[0] == name and name not in u.operands[1:]:
                total += _elements(u.shape)
            elif u.opcode in _TRANSPARENT or (u.opcode == "fusion" and len(u.operands) == 1
                                              and "kind=kLoop" in u.attrs):
                total += self._elements_read(comp, u.name)  # an elementwise copy: read as much as it is
            elif u.opcode == "fusion" and u.operands.count(name) == 1:
                nested = u.attr("calls").lstrip("%")
                index = str(u.operands.index(name))
                param = next((i.name for i in self.computations[nested]
                              if i.opcode == "parameter" and i.operands and i.operands[0] == index), None)
                total += whole if param is None else self._elements_read(nested, param)
            else:
                return whole
        return total

    def totals(self) -> dict:
        return {"flops": sum(o.total_flops for o in self.ops), "bytes": sum(o.total_bytes for o in self.ops),
                "unknown_trip_counts": self.unknown_trip_counts}


def dot_flops(hlo_text: str) -> float:
    """The FLOPs of every dot and convolution in an HLO module's text, loop bodies times their trip count."""
    return Program(hlo_text).totals()["flops"]


_PLUMBING = re.compile(r"^(jit\(.*\)|pjit|while|body|cond|closed_call|shard_map|checkpoint|remat\w*|"
                       r"branch_\d+_fun|switch|vmap\(.*\)|transpose\(.*\))$")


def scope_of(op_name: str) -> str:
    """The named scopes of an instruction's `op_name` ("layers 3,4 reuse/attention/indexer"): the
    transformations' own components (jit, while/body, closed_call, shard_map, …) and the primitive dropped."""
    parts = [p for p in op_name.split("/")[:-1] if p and not _PLUMBING.match(p)]
    return "/".join(parts)


def breakdown(program: Program, top: int = 12) -> dict:
    """Where a compiled program's bytes and FLOPs go: totals, per named scope (descending bytes), and the
    `top` instructions by bytes and by FLOPs (each with its execution count and scope)."""
    scopes: dict[str, list[float]] = {}
    for o in program.ops:
        s = scopes.setdefault(scope_of(o.scope) or "(no scope)", [0.0, 0.0])
        s[0] += o.total_bytes
        s[1] += o.total_flops

    def row(o: Op) -> dict:
        return {"op": o.opcode, "shape": re.sub(r"\{[^}]*\}", "", o.shape)[:80], "count": o.count,
                "bytes": o.total_bytes, "flops": o.total_flops, "scope": scope_of(o.scope) or "(no scope)",
                "primitive": o.scope.rsplit("/", 1)[-1] if o.scope else ""}

    return {**program.totals(),
            "by_scope": [{"scope": k, "bytes": b, "flops": f}
                         for k, (b, f) in sorted(scopes.items(), key=lambda kv: -kv[1][0])],
            "top_bytes": [row(o) for o in sorted(program.ops, key=lambda o: -o.total_bytes)[:top]],
            "top_flops": [row(o) for o in sorted(program.ops, key=lambda o: -o.total_flops)[:top] if o.flops]}
