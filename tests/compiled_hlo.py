"""Reading a compiled step's optimized HLO (`compiled.as_text()`): its instructions, and which of them run in a
loop (the body of a while, such as a lax.scan's, or a computation that body calls: a fusion, a reducer)."""

import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.-]+) .*?\{\n(.*?)^\}", re.S | re.M)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.-]+ = (.*?) ([a-z][\w-]*)\(", re.M)
_CALLED = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.-]+)")


def instructions(hlo: str) -> list[tuple[str, bool, list[str]]]:
    """(opcode, whether it runs in a loop, the shapes of its result (one per array of a tuple, as "f32[384,256]"))
    of every instruction."""
    bodies = dict(_COMPUTATION.findall(hlo))
    looped = set(re.findall(r"body=%([\w.-]+)", hlo))
    while True:
        called = {c for name in looped for c in _CALLED.findall(bodies[name])}
        if called <= looped:
            break
        looped |= called
    return [(op.removesuffix("-start"), name in looped, re.findall(r"\w+\[[\d,]*\]", result))
            for name, body in bodies.items() for result, op in _INSTRUCTION.findall(body)]
