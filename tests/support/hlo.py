"""Reading a compiled program's optimized HLO text: which instructions make
the operands of the library's custom calls, so a test can assert that none
of them is a copy XLA had to make first (on the GPU a copy kernel, or a
memcpy node, before every call)."""
from __future__ import annotations

import dataclasses
import re

# Instructions that only move bytes already in memory: handed to a custom
# call, each is a buffer of its own that XLA fills before the call.
MOVES = {"copy", "copy-start", "copy-done", "slice", "dynamic-slice", "transpose",
         "concatenate", "reshape", "pad", "reverse"}
# What a fusion of moves may hold beside them and still only move bytes.
PLUMBING = {"parameter", "bitcast", "tuple", "get-tuple-element"}


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    operands: list[str]
    line: str

    @property
    def calls(self) -> str | None:
        m = re.search(r"\bcalls=%([\w.\-]+)", self.line)
        return m.group(1) if m else None

    @property
    def target(self) -> str | None:
        m = re.search(r'custom_call_target="([^"]+)"', self.line)
        return m.group(1) if m else None


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in {text!r}")


def parse_instruction(line: str) -> Instruction | None:
    """`%name = TYPE opcode(operands), attrs` -> Instruction, else None."""
    m = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):                    # a tuple type
        rest = rest[_closing(rest, 0) + 1:].lstrip()
    else:
        rest = rest.split(None, 1)[1]
    op = re.match(r"([a-z][\w\-]*)\(", rest)
    if not op:
        return None
    args = rest[op.end() - 1:_closing(rest, op.end() - 1) + 1]
    return Instruction(m.group(1), op.group(1), re.findall(r"%([\w.\-]+)", args), line)


def parse_module(hlo: str) -> tuple[dict[str, Instruction], dict[str, list[Instruction]]]:
    """(every instruction by name, every computation's instructions by name)."""
    instructions, computations, current = {}, {}, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if head and " = " not in line.split("{", 1)[0]:
            current = computations.setdefault(head.group(1), [])
            continue
        ins = parse_instruction(line)
        if ins is not None:
            instructions[ins.name] = ins
            if current is not None:
                current.append(ins)
    return instructions, computations


def only_moves(ins: Instruction, instructions, computations) -> bool:
    """Whether `ins` only moves bytes: a move that is no copy of a literal
    constant (XLA materializes the scan counter's start so, and hands the
    same buffer to the calls that take that constant), or a fusion of
    nothing but moves and plumbing."""
    if ins.opcode == "copy":
        return not all(instructions[o].opcode == "constant" for o in ins.operands
                       if o in instructions)
    if ins.opcode in MOVES:
        return True
    if ins.opcode == "fusion" and ins.calls in computations:
        ops = {i.opcode for i in computations[ins.calls]}
        return bool(ops & MOVES) and ops <= MOVES | PLUMBING
    return False


def copied_operands(hlo: str, prefix: str = "dsv4_") -> list[str]:
    """One line per operand of a custom call whose target starts with
    `prefix` that an instruction which only moves bytes makes (seen through
    bitcasts and get-tuple-elements of such a fusion): empty when every
    operand is handed over where it already lies."""
    instructions, computations = parse_module(hlo)
    found = []
    for call in instructions.values():
        if call.opcode != "custom-call" or not (call.target or "").startswith(prefix):
            continue
        for k, name in enumerate(call.operands):
            src = instructions.get(name)
            while src is not None and src.opcode in ("bitcast", "get-tuple-element") \
                    and src.operands and src.operands[0] in instructions \
                    and (src.opcode == "bitcast"
                         or instructions[src.operands[0]].opcode == "fusion"):
                src = instructions[src.operands[0]]
            if src is not None and only_moves(src, instructions, computations):
                found.append(f"{call.target} %{call.name} operand {k}: %{name} <- "
                             f"{src.opcode} %{src.name}: {src.line.strip()[:200]}")
    return found
