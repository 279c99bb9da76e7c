"""No loop of the library lets a signal handler's exception skip its clean-up.

Python 3.13 checks for pending signals at a loop's back-edge, and looks up the
handler for an exception raised there at the jump itself. Its compiler leaves some
back-edges out of the enclosing ``with``/``try`` block's exception table: the
jump back from a ``while`` condition repeated at the loop's bottom, and from an
``if`` that ends a loop body (list comprehensions, inlined since 3.12, included).
A signal handler's exception raised there (a Celery soft time limit, a
``KeyboardInterrupt``) leaves the function without running the block's
``__exit__``, ``finally`` or broad ``except``: a ``threading.Lock`` stays held for
good (a waiter hung in ``readers.Link.ask``: CPython issues 108214 and 130279).
Shapes that keep their back-edges covered: ``if ...: continue`` / ``break``
guards, ``while True`` with a ``break``, generator expressions, helpers.

This test reads the bytecode the running interpreter compiled for every module
of the package; the interruption tests (test_holds) fire the signals for real.
"""

from __future__ import annotations

import dis
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import redlock_django

PACKAGE = Path(redlock_django.__file__).parent

#: Functions where the skip costs nothing, and why. Keyed by module path and
#: qualified name.
HARMLESS = {
    # Run only in the wake-up reader's own threads (its poll loop, a node's
    # connect) or the confirmation timer's: Python runs signal handlers in the
    # main thread, so no handler's exception is raised in them.
    ("wake.py", "Hub.wanted"): "the wake-up reader's and its connect threads",
    ("wake.py", "Hub.confirmed"): "the wake-up reader's thread",
    ("wake.py", "Hub.deliver"): "the wake-up reader's thread",
    ("wake.py", "Hub.overdue"): "the wake-up reader's thread",
    ("confirm.py", "_Timer._next"): "the confirmation timer's thread",
    # A contextlib.suppress() block: an exception it does not name passes
    # through its __exit__ unchanged, so skipping the __exit__ changes nothing.
    ("runner.py", "Runner.let_go"): "contextlib.suppress(LockError)",
    ("runner.py", "_group_alive"): "contextlib.suppress(ChildProcessError)",
}

_BROAD = {"Exception", "BaseException"}


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _skipped_clean_ups(code: types.CodeType) -> list[tuple[int | None, str]]:
    """The back-edges of ``code`` whose exception skips a clean-up handler that
    covers the loop's head: (line, what is skipped)."""
    instructions = list(dis.get_instructions(code))
    at = {ins.offset: n for n, ins in enumerate(instructions)}
    table = dis._parse_exception_table(code)  # type: ignore[attr-defined]

    def covering(offset: int) -> Any:
        return next((e for e in table if e.start <= offset < e.end), None)

    def chain(entry: Any) -> list[int]:
        """The handlers an exception raised under ``entry`` goes through, by the
        offset of their code: a handler's own code is covered by the handler it
        passes the exception on to (the enclosing block's)."""
        found: list[int] = []
        while entry is not None and entry.target not in found:
            found.append(entry.target)
            entry = covering(entry.target)
        return found

    def clean_up(target: int) -> str | None:
        """What the handler at ``target`` runs for any exception: a ``with``
        block's exit, a ``finally``, a bare or broad ``except``; None for the rest
        (a narrow ``except``, a comprehension's or generator's plumbing)."""
        n = at[target]
        if instructions[n].opname != "PUSH_EXC_INFO":
            return None
        body = instructions[n + 1 : n + 8]
        names = [ins.opname for ins in body]
        if names[0] == "WITH_EXCEPT_START":
            return "a with block's exit"
        if "CHECK_EXC_MATCH" in names:
            loaded = {ins.argval for ins in body[: names.index("CHECK_EXC_MATCH")]}
            broad = loaded & _BROAD
            return f"except {broad.pop()}" if broad else None
        return "a finally"

    skipped = []
    for jump in instructions:
        if jump.opname != "JUMP_BACKWARD":
            continue
        own = chain(covering(jump.offset))
        for target in chain(covering(jump.argval)):
            if target not in own and (what := clean_up(target)) is not None:
                line = jump.positions.lineno if jump.positions else None
                skipped.append((line, what))
                break
    return skipped


def _escapes() -> dict[tuple[str, str], list[str]]:
    """Each function's back-edges that skip a clean-up, by (module, qualname)."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE))
        top = compile(path.read_text(), str(path), "exec")
        for code in _code_objects(top):
            for line, what in _skipped_clean_ups(code):
                found.setdefault((module, code.co_qualname), []).append(
                    f"{module}:{line} {code.co_qualname}: skips {what}"
                )
    return found


@pytest.mark.skipif(
    sys.version_info < (3, 13),
    reason="Python 3.11 and 3.12 look the handler up at the instruction before "
    "the jump, which their compilers keep covered (measured: no leak)",
)
def test_no_loop_lets_a_signal_handlers_exception_skip_its_clean_up() -> None:
    found = _escapes()
    escapes = sorted(
        {line for key, lines in found.items() if key not in HARMLESS for line in lines}
    )
    assert escapes == [], (
        f"{len(escapes)} loop back-edges fall outside the with/try around them; "
        "an interruption raised there skips its clean-up:\n" + "\n".join(escapes)
    )


@pytest.mark.skipif(sys.version_info < (3, 13), reason="as above")
def test_every_function_let_off_still_needs_it() -> None:
    """HARMLESS lists only functions that have such a back-edge: one rewritten
    leaves it."""
    assert set(HARMLESS) - set(_escapes()) == set()


def _leaks(lock: object, xs: list[int]) -> None:
    with lock:  # type: ignore[attr-defined]
        for x in xs:
            if x < 0:
                xs.append(x)


@pytest.mark.skipif(sys.version_info < (3, 13), reason="as above")
def test_the_check_finds_a_loop_that_skips_its_with_block() -> None:
    """The check can fail: it flags the shape that hung ``readers.Link.ask``."""
    assert _skipped_clean_ups(_leaks.__code__) == [
        (_leaks.__code__.co_firstlineno + 3, "a with block's exit")
    ]
