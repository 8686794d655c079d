"""SASS: ``cuobjdump -sass`` text parsed into instructions with their control bits,
instruction classes, loops from back edges, tensor FLOPs and bytes per memory instruction."""
from __future__ import annotations

import dataclasses
import re

from .common import ModelError


@dataclasses.dataclass(frozen=True)
class Inst:
    addr: int
    text: str       # the instruction without predicate guard, e.g. "LDG.E.128 R4, [R2.64]"
    op: str         # mnemonic with modifiers, e.g. "LDG.E.128"
    base: str       # mnemonic, e.g. "LDG"
    stall: int      # control bits: cycles before this warp's next instruction may issue
    wbar: int       # scoreboard set when the result is written (7: none)
    rbar: int       # scoreboard set when the sources are read (7: none)
    wait: int       # mask of scoreboards waited on before issue
    cls: str        # instruction class (CLASSES)
    guarded: bool = False  # under a predicate (@P / @!P)


CLASSES = ("hmma", "fp32", "fp16", "int", "conv", "mufu", "lds", "sts", "ldg", "stg", "shfl",
           "sync", "ctrl", "misc")
_CLASS_OF = {}
for _c, _ops in {
    "hmma": "HMMA HGMMA IMMA DMMA",
    "fp32": "FFMA FADD FMUL FMNMX FSETP FSEL FSET FCHK FSWZADD FMUL32I FADD32I FFMA32I",
    "fp16": "HADD2 HFMA2 HMUL2 HMNMX2 HSETP2 HSET2",
    "int": "IMAD IMUL IADD3 IADD LOP3 LOP SHF SHL SHR ISETP ISET SEL LEA IMNMX IABS MOV PRMT "
           "BMSK SGXT P2R R2P PLOP3 VIADD VIMNMX VIADDMNMX IDP FLO POPC BREV IMAD32I IADD32I "
           "LOP32I MOV32I",
    "conv": "F2F F2I I2F F2FP I2FP FRND I2I",
    "mufu": "MUFU",
    "lds": "LDS LDSM",
    "sts": "STS",
    "ldg": "LDG LDGSTS LD LDL",
    "stg": "STG ST STL RED ATOM ATOMG ATOMS",
    "shfl": "SHFL",
    "sync": "BAR DEPBAR WARPSYNC MEMBAR ARRIVES LDGDEPBAR WARPGROUP ERRBAR CCTL SYNCS",
    "ctrl": "BRA EXIT BSSY BSYNC NOP CALL RET JMP BREAK YIELD BRX JMX KILL",
}.items():
    for _o in _ops.split():
        _CLASS_OF[_o] = _c

_INST_RE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]{16}) \*/")
_HI_RE = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
_FUNC_RE = re.compile(r"Function\s*:\s*(\S+)")


def classify(base: str) -> str:
    return _CLASS_OF.get(base, "misc")


def decode_control(hi: int) -> tuple[int, int, int, int]:
    """(stall, write scoreboard, read scoreboard, wait mask) from the high 64 bits of a
    Volta+ instruction (control bits 105..125 of the 128)."""
    c = hi >> 41
    return c & 0xF, (c >> 5) & 7, (c >> 8) & 7, (c >> 11) & 0x3F


def parse_sass(text: str) -> dict[str, list[Inst]]:
    """``cuobjdump -sass`` output -> {function name: instructions in address order}."""
    funcs: dict[str, list[Inst]] = {}
    cur: list[Inst] | None = None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        fm = _FUNC_RE.search(line)
        if fm:
            cur = funcs.setdefault(fm.group(1), [])
            continue
        m = _INST_RE.search(line)
        if m is None or cur is None:
            continue
        hm = _HI_RE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if hm is None:
            raise ModelError(f"SASS line {i + 1}: no control word after {line.strip()!r}")
        body = m.group(2).strip()
        guarded = body.startswith("@")
        if guarded:
            body = body.split(None, 1)[1]
        op = body.split()[0]
        base = op.split(".")[0]
        stall, wbar, rbar, wait = decode_control(int(hm.group(1), 16))
        cur.append(Inst(int(m.group(1), 16), body, op, base, stall, wbar, rbar, wait,
                        classify(base), guarded))
    return funcs


@dataclasses.dataclass(frozen=True)
class Loop:
    start: int   # address of the first instruction (the back edge's target)
    end: int     # address of the back-edge branch

    def contains(self, addr: int) -> bool:
        return self.start <= addr <= self.end


def find_loops(insts: list[Inst]) -> list[Loop]:
    """Loops from backward branches, largest first (one per back-edge target)."""
    spans: dict[int, int] = {}
    for ins in insts:
        if ins.base == "BRA":
            m = re.search(r"BRA\s+(?:`\(\S+\)\s*)?(0x[0-9a-f]+)", ins.text)
            if m:
                tgt = int(m.group(1), 16)
                # A branch to itself is the trap after EXIT, not a loop.
                if tgt < ins.addr:
                    spans[tgt] = max(spans.get(tgt, 0), ins.addr)
    loops = [Loop(s, e) for s, e in spans.items()]
    return sorted(loops, key=lambda lp: (-(lp.end - lp.start), lp.start))


def hmma_flops(ins: Inst) -> int:
    """Dense FLOPs of one warp's tensor instruction (HGMMA: the warp's quarter)."""
    m = re.search(r"\.(\d+)x(\d+)x(\d+)", ins.op)
    if ins.base == "HGMMA" and m:
        return 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) // 4
    m = re.search(r"\.(\d)(\d)(\d+)\b", ins.op)  # HMMA.16816 / .1688 / .884
    if m:
        digits = ins.op.split(".")[1]
        shapes = {"16816": (16, 8, 16), "1688": (16, 8, 8), "884": (8, 8, 4), "16832": (16, 8, 32)}
        if digits in shapes:
            a, b, c = shapes[digits]
            return 2 * a * b * c
    raise ModelError(f"unknown tensor instruction shape: {ins.text}")


def access_bytes(ins: Inst) -> int:
    """Bytes one warp moves through L1/shared memory for a memory instruction."""
    if ins.base == "LDSM":
        n = 4 if ".4" in ins.op.split(".M88")[-1] else 2 if ".2" in ins.op.split(".M88")[-1] else 1
        return 128 * n
    width = 4
    for mod, w in ((".128", 16), (".64", 8), (".U8", 1), (".S8", 1), (".U16", 2), (".S16", 2)):
        if mod in ins.op:
            width = w
            break
    return 32 * width
