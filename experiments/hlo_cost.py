"""FLOPs, bytes accessed and kernels of a compiled program, every loop counted as often as it runs.

XLA's cost analysis (``compiled.cost_analysis()``) counts a ``while`` body once, whatever its trip
count, so a program whose decoder blocks run under one ``lax.scan`` (the pretrained presets) reports one
block; on a GPU it reports nothing at all for a compile-only target. ``program_cost`` therefore reads the
optimized HLO the target compiler produced (``compiled.as_text()``) and runs XLA's own
``HloCostAnalysis`` on it through a host client, once for the program and once per loop body (each body
made the entry of a copy of the module), then adds each loop's body ``trip count - 1`` more times:

    total(c) = xla(c) + sum over the loops w of c of [ n_w x total(body_w) - xla(body_w) ]

A loop's trip count is the GPU compiler's ``known_trip_count``, else read from its condition
(``counter < N``, the counter starting from a constant, as ``lax.scan`` and ``fori_loop`` build them);
a loop that ends on data (the decode chunk's ``while``:
``step < chunk and not all done``) is counted once, so a decode program's numbers are those of one step.

Library and Pallas kernels are custom calls, which XLA's analysis counts as zero FLOPs; their FLOPs are
counted from their shapes: cuBLAS GEMMs from their dot dimensions, cuDNN's fused attention from its two
batched products (x 2.5 for the backward pass, x 0.5 with a causal mask), a TPU Pallas kernel from the
cost estimate it carries, else from the attention shapes of its operands. ``kernels`` lists the custom-call
targets (the TPU's ``tpu_custom_call`` by kernel name, e.g. ``tpu_custom_call:splash_mha_fwd``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64|c64|c128)"
                    r"\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
          "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16}
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
"""cuBLAS GEMMs: a dot the GPU compiler hands to the library."""


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    text: str
    """Everything after ``name = ``: result type, opcode, operands, attributes."""

    @property
    def result(self) -> str:
        return self.text[:_OPCODE.search(self.text).start()]

    def operands(self) -> list[str]:
        """The operand names (``%x``, without the ``%``)."""
        start = _OPCODE.search(self.text).end()
        depth, end = 1, start
        while depth and end < len(self.text):
            depth += {"(": 1, ")": -1}.get(self.text[end], 0)
            end += 1
        return re.findall(r"%([\w.\-]+)", self.text[start:end - 1])

    def attribute(self, key: str) -> str | None:
        match = re.search(rf"[ ,]{key}=(%?[\w.\-$]+|\{{[^}}]*\}}|\"[^\"]*\")", self.text)
        return None if match is None else match.group(1).lstrip("%")

    def backend_config(self) -> dict[str, Any]:
        match = re.search(r"backend_config=(\{.*\})(?:, [a-z_]+=|$)", self.text)
        if match is None:
            return {}
        text = match.group(1)
        for end in range(len(text), 0, -1):  # the JSON object ends at its own closing brace
            if text[end - 1] == "}":
                try:
                    return json.loads(text[:end])
                except ValueError:
                    continue
        return {}


@dataclasses.dataclass(frozen=True)
class Module:
    """The computations of an optimized HLO module's text, by name, and its entry's name."""

    text: str
    computations: dict[str, list[Instruction]]
    entry: str

    @classmethod
    def parse(cls, text: str) -> Module:
        text = unwrap_async_fusions(text)
        computations: dict[str, list[Instruction]] = {}
        entry, current, pending = "", None, None

        def flush() -> None:
            if current is not None and pending is not None and _OPCODE.search(pending[1]):
                current.append(Instruction(pending[0], _OPCODE.search(pending[1]).group(1), pending[1]))

        for line in text.splitlines():
            header = _HEADER.match(line)
            if header is not None and line.rstrip().endswith("{"):
                flush()
                current, pending = computations.setdefault(header.group(2), []), None
                entry = header.group(2) if header.group(1) else entry
                continue
            if current is None:
                continue
            found = _INSTRUCTION.match(line)
            if found is not None:
                flush()
                pending = (found.group(1), found.group(2))
            elif line.rstrip() == "}":
                flush()
                current, pending = None, None
            elif pending is not None:  # an attribute that spans lines (a kernel's metadata)
                pending = (pending[0], pending[1] + "\n" + line)
        flush()
        return cls(text, computations, entry)

    def by_name(self, computation: str) -> dict[str, Instruction]:
        return {i.name: i for i in self.computations[computation]}

    def as_entry(self, computation: str) -> str:
        """The module's text with ``computation`` as its entry (to cost one loop body; the entry itself
        too). The header keeps only the module's name: the entry's layout, aliasing and donors are not a
        body's, and the schedule (``is_scheduled``) is not checked again, which async pairs can fail."""
        out = []
        for line in self.text.split("\n"):
            if line.startswith("HloModule "):
                line = line.split(",")[0]
            elif line.startswith("ENTRY %") and computation != self.entry:
                line = line[len("ENTRY "):]
            elif line.startswith(f"%{computation} (") and computation != self.entry:
                line = "ENTRY " + line
            out.append(line)
        return "\n".join(out)


_FUSION_START = re.compile(r"^(\s+(?:ROOT )?%\S+ = )(\(.*?) fusion-start\(")
_FUSION_DONE = re.compile(r"^(\s+(?:ROOT )?%\S+ = \S+) fusion-done\(")


def unwrap_async_fusions(text: str) -> str:
    """The GPU compiler runs some fusions asynchronously (``fusion-start`` / ``fusion-done``); XLA's
    analysis then misses that a fusion whose root is a dynamic-update-slice or scatter writes in place
    and counts the whole buffer. Written back as the plain fusion they wrap (the done a bitcast)."""
    out = []
    for line in text.split("\n"):
        start = _FUSION_START.match(line)
        if start is not None:
            result = _tuple_elements(start.group(2))[1]
            line = f"{start.group(1)}{result} fusion(" + line[start.end():]
        else:
            done = _FUSION_DONE.match(line)
            if done is not None:
                line = f"{done.group(1)} bitcast(" + line[done.end():]
        out.append(line)
    return "\n".join(out)


def _tuple_elements(type_text: str) -> list[str]:
    """The top-level elements of an HLO tuple type ``(a, (b, c), d)``."""
    inner, parts, depth, current = type_text.strip()[1:-1], [], 0, ""
    for ch in inner:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return [*parts, current.strip()]


def array_shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in an HLO type (a tuple gives several)."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(type_text)]


def type_bytes(type_text: str) -> float:
    return sum(_BYTES[dtype] * math.prod(dims) for dtype, dims in array_shapes(type_text))


# ----------------------------------------------------------------------------------------------
# loops


def trip_count(module: Module, parent: str, loop: Instruction) -> int | None:
    """The trip count of ``while`` instruction ``loop`` of computation ``parent``: ``N - start`` when its
    condition is ``counter < N`` (or ``N > counter``) for a constant N and the counter starts from a
    constant (or the GPU compiler's ``known_trip_count``); None when the loop ends on data."""
    known = loop.backend_config().get("known_trip_count", {}).get("n")
    if known is not None:
        return int(known)
    condition = module.by_name(loop.attribute("condition"))
    root = module.computations[loop.attribute("condition")][-1]
    if root.opcode != "compare":
        return None
    direction = root.attribute("direction")
    a, b = (condition.get(n) for n in root.operands())
    if direction == "GT":
        a, b = b, a
    elif direction != "LT":
        return None
    if a is None or b is None or a.opcode != "get-tuple-element" or b.opcode != "constant":
        return None
    bound = _constant(b)
    index = int(a.attribute("index"))
    start = 0
    init = module.by_name(parent).get(loop.operands()[0])
    if init is not None and init.opcode == "tuple":
        value = _resolve_constant(module.by_name(parent), init.operands()[index])
        start = 0 if value is None else value
    return None if bound is None else max(bound - start, 0)


def _constant(instruction: Instruction) -> int | None:
    match = re.search(r"constant\((-?\d+)\)", instruction.text)
    return None if match is None else int(match.group(1))


def _resolve_constant(instructions: Mapping[str, Instruction], name: str) -> int | None:
    for _ in range(4):  # through copies and bitcasts
        instruction = instructions.get(name)
        if instruction is None:
            return None
        if instruction.opcode == "constant":
            return _constant(instruction)
        if instruction.opcode not in ("copy", "bitcast", "convert"):
            return None
        name = instruction.operands()[0]
    return None


# ----------------------------------------------------------------------------------------------
# custom calls (library and Pallas kernels)


def custom_call_flops(instruction: Instruction, shapes: Mapping[str, str]) -> float:
    """FLOPs of one library or Pallas kernel call (module docstring); ``shapes``: operand name -> type."""
    target = instruction.attribute("custom_call_target").strip('"')
    operands = [array_shapes(shapes.get(n, "")) for n in instruction.operands()]
    operands = [o[0][1] if o else () for o in operands]
    config = instruction.backend_config()
    if target in GEMM_TARGETS:
        dims = config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
        contracting = [int(d) for d in dims.get("lhs_contracting_dimensions", [])]
        out = array_shapes(instruction.result)
        if not out or not operands or not operands[0]:
            return 0.0
        return 2.0 * math.prod(out[0][1]) * math.prod(operands[0][d] for d in contracting)
    if target.startswith("__cudnn$fmha"):
        fmha = config.get("cudnn_fmha_backend_config", {})
        dims = fmha.get("bmm1_dot_dimension_numbers", {})
        backward = "Backward" in target
        # bmm1 is Q.K^T (forward) / its recomputation (backward): lhs Q [.., T, .., D], rhs K [.., S, .., D]
        q, k = operands[0], operands[1]
        batch = [int(d) for d in dims.get("lhs_batch_dimensions", [])]
        q_contract = [int(d) for d in dims.get("lhs_contracting_dimensions", [])]
        k_batch = [int(d) for d in dims.get("rhs_batch_dimensions", [])]
        k_contract = [int(d) for d in dims.get("rhs_contracting_dimensions", [])]
        if not q or not k or not batch:
            return 0.0
        t = math.prod(q[d] for d in range(len(q)) if d not in batch + q_contract)
        s = math.prod(k[d] for d in range(len(k)) if d not in k_batch + k_contract)
        bmm = 2.0 * math.prod(q[d] for d in batch) * t * s * math.prod(q[d] for d in q_contract)
        causal = "CAUSAL" in str(fmha.get("mask_type", ""))
        return bmm * (5 if backward else 2) * (0.5 if causal else 1.0)
    if target == "tpu_custom_call":
        estimate = (config.get("custom_call_config", {}).get("cost_estimate") or config.get("cost_estimate")
                    or {})
        if estimate.get("flops"):
            return float(estimate["flops"])
        name = kernel_name(instruction).split(":", 1)[-1]
        if name.startswith("splash_mha"):  # q [.., H, T, D] and k [.., Hkv, S, D]: the first float operands
            q, k = ([o for o, n in zip(operands, instruction.operands())
                     if len(o) >= 3 and _float(shapes.get(n, ""))] + [(), ()])[:2]
            if not q or not k:
                return 0.0
            bmm = 2.0 * math.prod(q[:-1]) * k[-2] * q[-1]
            products = 4 if "dkv" in name else 3 if "dq" in name else 2  # forward: Q.K^T and P.V
            causal = 0.5  # every plan's attention is causal: splash skips the blocks above the diagonal
            return bmm * products * causal
    return 0.0


def _float(type_text: str) -> bool:
    shapes = array_shapes(type_text)
    return bool(shapes) and shapes[0][0] in ("bf16", "f16", "f32", "f64")


def kernel_name(instruction: Instruction) -> str:
    """The custom call's target; a TPU Pallas kernel with its name (``tpu_custom_call:NAME``)."""
    target = instruction.attribute("custom_call_target").strip('"')
    if target == "tpu_custom_call":  # a Pallas kernel: the instruction is named after it
        return target + ":" + re.sub(r"[.]\d+$", "", instruction.name)
    return target


# ----------------------------------------------------------------------------------------------
# the program


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """Per device: FLOPs and bytes accessed of one run of a program (one step of a loop that ends on
    data), the custom-call kernels it calls (name -> calls in the HLO), and its loops' trip counts."""

    flops: float
    bytes_accessed: float
    kernels: dict[str, int]
    loops: list[int | None]
    """Trip count of every ``while`` (None: ends on data, counted once)."""


@functools.lru_cache(maxsize=1)
def _host_client() -> Any:
    from jax._src.lib import xla_client

    return xla_client.make_cpu_client()


def _xla_cost(text: str) -> tuple[float, float]:
    """(flops, bytes accessed) of XLA's HloCostAnalysis of a module's entry (loop bodies once)."""
    from jax._src.lib import xla_client
    from jaxlib import _hlo

    for _ in range(10_000):  # each pass drops one attribute the host's parser rejects
        try:
            module = _hlo.hlo_module_from_text(text)
            break
        except Exception as err:  # noqa: BLE001 - the parser's error names what it rejects
            text = _without_rejected_attribute(text, str(err))
    cost = xla_client._xla.hlo_module_cost_analysis(_host_client(), module)
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


_REJECTED = re.compile(r'parsing (\d+):\d+: error: unexpected attribute "(\w+)"')


def _without_rejected_attribute(text: str, error: str) -> str:
    """``text`` without the attribute the HLO parser rejected at the line its ``error`` names (a GPU's
    ``all-reduce-start`` carries ``output_to_operand_aliasing``, which a CPU build's parser does not
    take there; no attribute changes what the analysis counts). Any other error is raised again."""
    match = _REJECTED.search(error)
    if match is None:
        raise ValueError(f"the host's HLO parser rejected a module: {error[:500]}")
    number, name = int(match.group(1)) - 1, match.group(2)
    lines = text.split("\n")
    line = lines[number]
    start = line.find(f", {name}=")
    if start < 0:
        raise ValueError(f"the host's HLO parser rejected a module: {error[:500]}")
    end, depth = start + len(f", {name}="), 0
    while end < len(line):  # the value: balanced braces / parentheses, up to the next top-level comma
        char = line[end]
        if char in "{(":
            depth += 1
        elif char in "})":
            depth -= 1
        elif char == "," and depth == 0:
            break
        end += 1
    lines[number] = line[:start] + line[end:]
    return "\n".join(lines)


def program_cost(hlo_text: str, platform: str = "tpu", data_loop_trips: int = 1) -> ProgramCost:
    """The ``ProgramCost`` of an optimized HLO module's text (``compiled.as_text()``) from the compiler
    of ``platform`` (``tpu``, ``gpu`` or ``cpu``), a loop that ends on data run ``data_loop_trips``
    times (a decode chunk's steps: divide by them for a step that carries its share of the chunk's
    entry and exit, e.g. a cache relaid out around the loop)."""
    module = Module.parse(hlo_text)
    loops: dict[str, list[tuple[str, int | None]]] = {}  # computation -> its while bodies, trip counts
    for name, instructions in module.computations.items():
        for i in instructions:
            if i.opcode == "while":
                loops.setdefault(name, []).append((i.attribute("body"), trip_count(module, name, i)))
    xla: dict[str, tuple[float, float]] = {}

    def xla_of(computation: str) -> tuple[float, float]:
        if computation not in xla:
            xla[computation] = _xla_cost(module.as_entry(computation))
        return xla[computation]

    def inline(computation: str) -> list[str]:
        """``computation`` and what it calls other than loop bodies (conditional branches, calls): XLA
        counts these once per run of ``computation``, loops inside them included."""
        seen, pending = [computation], [computation]
        while pending:
            for i in module.computations.get(pending.pop(), []):
                for callee in _callees(i, loops=False):
                    if callee in module.computations and callee not in seen:
                        seen.append(callee)
                        pending.append(callee)
        return seen

    @functools.cache
    def total(computation: str) -> tuple[float, float]:
        flops, bytes_ = xla_of(computation)
        for body, n in (loop for c in inline(computation) for loop in loops.get(c, [])):
            n = data_loop_trips if n is None else n  # a loop that ends on data, its own loops at their counts
            body_flops, body_bytes = total(body)
            once_flops, once_bytes = xla_of(body)
            flops += n * body_flops - once_flops
            bytes_ += n * body_bytes - once_bytes
        return flops, bytes_

    flops, bytes_ = total(module.entry)
    # custom calls: XLA counts no FLOPs for them; each is counted as often as its computation runs
    runs = _runs(module, loops, data_loop_trips)
    kernels: Counter[str] = Counter()
    for name, instructions in module.computations.items():
        shapes = {i.name: i.result for i in instructions}
        for i in instructions:
            if i.opcode == "custom-call":
                kernels[kernel_name(i)] += 1
                flops += runs.get(name, 0) * custom_call_flops(i, shapes)
            elif i.opcode == "fusion":
                excess = _gather_excess(module, i)
                if platform != "tpu":
                    excess += _in_place_scatter_excess(module, i, shapes)
                bytes_ -= runs.get(name, 0) * excess
    return ProgramCost(flops, bytes_, dict(sorted(kernels.items())),
                       [n for body in loops.values() for _, n in body])


def _in_place_scatter_excess(module: Module, fusion: Instruction, shapes: Mapping[str, str]) -> float:
    """Bytes XLA's analysis over-counts for a fusion whose root scatters into one of its operands: the
    GPU and CPU compilers write it in place (their HLO does not say so; the TPU's does), so the buffer
    is neither read nor written whole, only the updated rows (read and written) and the indices."""
    body = module.computations.get(fusion.attribute("calls") or "", [])
    if not body or body[-1].opcode != "scatter":
        return 0.0
    by_name = {i.name: i for i in body}
    target, indices, updates = (by_name.get(n) for n in body[-1].operands()[:3])
    if target is None or target.opcode != "parameter":
        return 0.0
    whole = type_bytes(body[-1].result)
    touched = 2 * type_bytes(updates.result if updates is not None else "") + type_bytes(
        indices.result if indices is not None else "")
    return max(2 * whole - touched, 0.0)


def _gather_excess(module: Module, fusion: Instruction) -> float:
    """Bytes XLA's analysis counts for a fusion that gathers rows of a table it takes whole (an embedding
    lookup of a few tokens reads those rows, not the table): the table's bytes beyond the rows its
    gathers read, for each fusion parameter that only gathers use."""
    body = module.computations.get(fusion.attribute("calls") or "", [])
    users: dict[str, list[Instruction]] = {}
    for i in body:
        for operand in i.operands():
            users.setdefault(operand, []).append(i)
    excess = 0.0
    for p in (i for i in body if i.opcode == "parameter"):
        uses = users.get(p.name, [])
        if uses and all(u.opcode == "gather" and u.operands()[0] == p.name for u in uses):
            excess += max(type_bytes(p.result) - sum(type_bytes(u.result) for u in uses), 0.0)
    return excess


def _runs(module: Module, loops: Mapping[str, list[tuple[str, int | None]]],
          data_loop_trips: int) -> dict[str, float]:
    """How many times each computation runs per run of the entry (loops ending on data:
    ``data_loop_trips``)."""
    runs: dict[str, float] = {module.entry: 1.0}
    pending = [module.entry]
    while pending:
        name = pending.pop()
        trips = {body: n for body, n in loops.get(name, [])}
        for i in module.computations.get(name, []):
            for callee in _callees(i):
                if callee in module.computations and callee not in runs:
                    trip = (trips.get(callee) or data_loop_trips) if callee in trips else 1
                    runs[callee] = runs[name] * trip
                    pending.append(callee)
    return runs


def _callees(instruction: Instruction, *, loops: bool = True) -> list[str]:
    """The computations ``instruction`` calls (``loops``: a while's body and condition too). A
    conditional names its branches ``branch_computations={...}`` (XLA:CPU) or, when boolean,
    ``true_computation`` / ``false_computation`` (the GPU and TPU compilers)."""
    names = []
    called = ("calls", "to_apply", "true_computation", "false_computation")
    for key in ("body", "condition", *called) if loops else called:
        value = instruction.attribute(key)
        if value is not None:
            names.append(value)
    branches = re.search(r"branch_computations=\{([^}]*)\}", instruction.text)
    if branches:
        names += re.findall(r"%([\w.\-]+)", branches.group(1))
    return names
