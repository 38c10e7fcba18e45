"""Reading a step's HLO text: a compiled step's optimized HLO (`compiled.as_text()`), its instructions and which of
them run in a loop (the body of a while, such as a lax.scan's, or a computation that body calls: a fusion, a
reducer); and the element types of the dots of a lowered one (`lowered.as_text()`, StableHLO), traced for a platform
(`traced_for`)."""

import contextlib
import re

from jaxtrain import autocast, kernel_choice
from jaxtrain import step

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.-]+) .*?\{\n(.*?)^\}", re.S | re.M)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.-]+ = (.*?) ([a-z][\w-]*)\(", re.M)
_CALLED = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.-]+)")


def instructions(hlo: str) -> list[tuple[str, bool, list[str]]]:
    """(opcode, whether it runs in a loop, the shapes of its result (one per array of a tuple, as "f32[384,256]"))
    of every instruction."""
    bodies = dict(computations(hlo))
    looped = set(re.findall(r"body=%([\w.-]+)", hlo))
    while True:
        called = {c for name in looped for c in _CALLED.findall(bodies[name])}
        if called <= looped:
            break
        looped |= called
    return [(op.removesuffix("-start"), name in looped, re.findall(r"\w+\[[\d,]*\]", result))
            for name, body in bodies.items() for result, op in _INSTRUCTION.findall(body)]


def computations(hlo: str) -> list[tuple[str, str]]:
    """(name, body text) of every computation of a compiled program: the entry, fused computations, reducers."""
    return _COMPUTATION.findall(hlo)


def dot_types(hlo: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) element types of every dot_general in StableHLO text."""
    sig = re.findall(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)", hlo)
    return [tuple(re.fullmatch(r"tensor<(?:\d+x)*(\w+)>", t).group(1) for t in s) for s in sig]


def traced_for(platform: str) -> contextlib.ExitStack:
    """autocast.compiling_for(platform); "cpu-onednn": a CPU whose dots are oneDNN's (autocast.onednn_dots)."""
    stack = contextlib.ExitStack()
    stack.enter_context(autocast.compiling_for(platform.removesuffix("-onednn")))
    stack.enter_context(autocast.onednn_dots(platform.endswith("-onednn")))
    return stack


def options_for(platform: str, precision: str = "bf16") -> dict:
    """The compile options of a program traced_for(platform), as the step's (step.compiler_options) on this
    machine: for "cpu-onednn" oneDNN's dots, every rounding kept; none for the others (a GPU's trace runs here on
    XLA:CPU). On a jaxlib below kernel_choice.ONEDNN_BF16_JAXLIB, where jaxtrain never asks for oneDNN's dots (its
    experimental oneDNN path crashed a run, benchmarks/NOTES.md CPU step 6, and aborted a test's compile in a CI run
    on 2026-12-01), the trace compiles on XLA's own dots."""
    if platform != "cpu-onednn":
        return {}
    dots = step.ONEDNN_DOTS if kernel_choice.jaxlib_takes_onednn_dots() else {}
    return {**autocast.rounding_options("cpu", precision, onednn=True), **dots}
