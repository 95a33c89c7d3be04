"""A small C preprocessor evaluator: object-like macros under #if/#ifdef/#elif/#else, per arm64 page size.

Pure text parsing, no I/O: callers pass the text (decide/hazards.py, for nv-linux.h of the driver source).
``macro_value(text, macro, page_size)`` follows the conditional structure for one arm64 configuration
(``CONFIG_ARM64_<n>K_PAGES``, ``PAGE_SHIFT``) and computes the macro's value; ``CEvalError`` (its str() the
reason shown to the user) when it cannot be known.
"""

from __future__ import annotations

import functools
import re

from spark_memsaver.decide.c_expr import CEvalError, CLimitError, Expr, Limits, Undecidable, tokens
from spark_memsaver.hazard_table import ARM64_PAGE_SIZES  # noqa: F401  (the one definition)
from spark_memsaver.record import Record


def kib(n: int) -> str:
    return f"{n // 1024} KiB" if n % (1 << 20) else f"{n >> 20} MiB"


_BUILTINS = {
    "NV_U32_MAX": 0xFFFFFFFF, "NV_U16_MAX": 0xFFFF, "NV_U8_MAX": 0xFF, "NV_U64_MAX": (1 << 64) - 1,
    "U32_MAX": 0xFFFFFFFF, "UINT_MAX": 0xFFFFFFFF,
    **{f"SZ_{n}K": n << 10 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)},
    **{f"SZ_{n}M": n << 20 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)},
    **{f"SZ_{n}G": n << 30 for n in (1, 2, 4)},
}
_MAX_NESTING = 64
_MAX_TEXT = 2 << 20             # NVIDIA's nv-linux.h: ~60 KiB (observe/snapshot.py reads no more)


def _config(page_size: int) -> dict:
    """Symbols an arm64 kernel build defines (True), or certainly does not (False), at this page size."""
    shift = page_size.bit_length() - 1
    cfg = {f"CONFIG_ARM64_{n}K_PAGES": (n << 10) == page_size for n in (4, 16, 64)}
    cfg.update({"CONFIG_ARM64": True, "NVCPU_AARCH64": True, "NVCPU_ARM": False, "NVCPU_X86_64": False,
                "NVCPU_X86": False, "NVCPU_PPC64LE": False, "NVCPU_RISCV64": False, "CONFIG_X86": False,
                "CONFIG_X86_64": False, "CONFIG_PPC64": False, "CONFIG_RISCV": False})
    cfg["PAGE_SHIFT"] = shift
    cfg["PAGE_SIZE"] = page_size
    return cfg


_PIECES = re.compile(r"""/\*.*?\*/|//[^\n]*|/\*|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?|[^/"']+|/""", re.S)


def _strip_comments(text: str) -> str:
    """Remove /* */ and // comments (keeping newlines), aware of string and char literals. Linear."""
    out = []
    for m in _PIECES.finditer(text):
        piece = m.group()
        if piece.startswith("/*"):
            if piece == "/*":
                raise CEvalError(f"unterminated /* comment at line {text.count(chr(10), 0, m.start()) + 1}")
            out.append(" " + "\n" * piece.count("\n"))
        elif not piece.startswith("//"):
            out.append(piece)
    return "".join(out)


def _logical_lines(text: str):
    """(first line number, text) of each logical line: comments removed, continuations joined (linear)."""
    lines = _strip_comments(text).split("\n")
    i = 0
    while i < len(lines):
        start, parts = i + 1, [lines[i]]
        while parts[-1].endswith("\\") and i + 1 < len(lines):
            i += 1
            parts[-1] = parts[-1][:-1]
            parts.append(lines[i])
        yield start, " ".join(parts)
        i += 1


@functools.lru_cache(maxsize=4)
def _directives(text: str) -> tuple:
    """(line, directive, rest) of each preprocessor line of ``text``; made once per text (status asks for the
    same header at two page sizes)."""
    out = []
    for line, raw in _logical_lines(text):
        m = re.match(r"\s*#\s*(\w+)\s*(.*)$", raw)
        if m:
            out.append((line, m.group(1), m.group(2).strip()))
    return tuple(out)


class _Def(Record):
    state: bool | None          # True: certainly in effect, None: under an undecidable condition
    body: str | None            # None: #undef
    function_like: bool
    line: int
    why: str                    # the undecidable condition, when state is None


def _scan(text: str, cfg: dict) -> dict[str, list[_Def]]:
    """Run the conditional structure for one configuration; return each macro's definitions in order."""
    if len(text) > _MAX_TEXT:
        raise CLimitError(f"the file is larger than {_MAX_TEXT >> 20} MiB")
    defs: dict[str, list[_Def]] = {}
    limits = Limits()
    memo: dict = {}             # values of macros as defined so far: emptied by each #define/#undef
    # frame: [state of this group (True/False/None), any earlier group taken (True/False/None),
    #         line, directive text, saw #else]
    stack: list[list] = []
    first_directive = True
    guard = None

    def known(name):
        """Definedness of a name at this point: True/False, or None (undecidable)."""
        if name in cfg:
            v = cfg[name]
            return None if v is None else (v is not False)
        for d in reversed(defs.get(name, [])):
            if d.state is True:
                return d.body is not None
            return None
        if name == guard:
            return False
        return None

    def ident(name, defined, depth=0):
        if defined:
            k = known(name)
            return None if k is None else int(k)
        if name in cfg and not isinstance(cfg[name], bool):
            return cfg[name]
        if name in cfg:
            return int(bool(cfg[name]))
        try:
            return _resolve(name, defs, cfg, set(), limits, memo)
        except CLimitError:
            raise
        except (Undecidable, CEvalError):
            return None

    def evaluate(expr, line):
        if not expr.strip():
            raise CEvalError(f"line {line}: a conditional without an expression")
        try:
            return Expr(tokens(expr), ident, True, limits).parse()
        except CLimitError:
            raise
        except CEvalError:
            return None                     # undecidable here; matters only if the macro sits under it

    def current():
        s = True
        why = ""
        for fr in stack:
            if fr[0] is False:
                return False, ""
            if fr[0] is None and s is True:
                s, why = None, f"line {fr[2]}: {fr[3]}"
        return s, why

    for line, d, rest in _directives(text):
        shown = f"#{d} {rest}".strip()
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        if d in ("if", "ifdef", "ifndef"):
            if len(stack) >= _MAX_NESTING:
                raise CEvalError(f"line {line}: conditionals nested deeper than {_MAX_NESTING}")
            if d == "if":
                v = evaluate(rest, line)
            else:
                name = rest.split()[0] if rest.split() else ""
                if not re.fullmatch(r"[A-Za-z_]\w*", name):
                    raise CEvalError(f"line {line}: #{d} without a macro name")
                if d == "ifndef" and first_directive:
                    guard = name          # include guard: not defined before the first #define of it
                k = known(name)
                v = None if k is None else int(k if d == "ifdef" else not k)
            st = None if v is None else bool(v)
            stack.append([st, st, line, shown, False])
        elif d in ("elif", "else"):
            if not stack:
                raise CEvalError(f"line {line}: #{d} without #if")
            fr = stack[-1]
            if fr[4]:
                raise CEvalError(f"line {line}: #{d} after #else")
            prior = fr[1]
            if d == "else":
                fr[4] = True
                st = None if prior is None else (not prior)
            else:
                v = evaluate(rest, line)
                c = None if v is None else bool(v)
                st = False if (prior is True or c is False) else (None if (prior is None or c is None) else True)
            fr[0], fr[2], fr[3] = st, line, shown
            fr[1] = True if (prior is True or st is True) else (None if (prior is None or st is None) else False)
        elif d == "endif":
            if not stack:
                raise CEvalError(f"line {line}: #endif without #if")
            stack.pop()
        elif d in ("define", "undef"):
            mm = re.match(r"([A-Za-z_]\w*)(\()?(.*)$", rest)
            if not mm:
                raise CEvalError(f"line {line}: #{d} without a macro name")
            state, why = current()
            if state is not False:
                memo.clear()
                name = mm.group(1)
                if d == "undef":
                    defs.setdefault(name, []).append(_Def(state, None, False, line, why))
                else:
                    defs.setdefault(name, []).append(
                        _Def(state, mm.group(3).strip(), mm.group(2) is not None, line, why))
        first_directive = False
    if stack:
        raise CEvalError(f"line {stack[-1][2]}: {stack[-1][3]} is never closed by #endif")
    return defs


def _resolve(name: str, defs: dict, cfg: dict, active: set, limits: Limits, memo: dict) -> int:
    """Value of an object-like macro after the whole file (the last definition in effect).

    ``memo`` holds each macro's outcome (value or exception) while ``defs`` stays the same: a macro used
    many times is evaluated once (a chain of ``#define M<i+1> (M<i>+M<i>)`` is linear, not exponential).
    A macro whose resolution meets one still ``active`` is on a cycle, so its failure is memoised too."""
    hit = memo.get(name)
    if hit is not None:
        if isinstance(hit, Exception):
            raise hit
        return hit
    try:
        v = _resolve_uncached(name, defs, cfg, active, limits, memo)
    except CLimitError:
        raise                               # the whole read stops; nothing to remember
    except (Undecidable, CEvalError) as e:
        memo[name] = e
        raise
    memo[name] = v
    return v


def _resolve_uncached(name: str, defs: dict, cfg: dict, active: set, limits: Limits, memo: dict) -> int:
    if name in active:
        raise CEvalError(f"{name} refers to itself")
    ds = defs.get(name)
    if not ds:
        if name in cfg and not isinstance(cfg[name], bool):
            return cfg[name]
        if name in _BUILTINS:
            return _BUILTINS[name]
        raise Undecidable(f"{name} is not defined here and is not a known kernel or NVIDIA constant")
    last = ds[-1]
    if last.state is None:
        raise Undecidable(f"{name} (line {last.line}) is {'undefined' if last.body is None else 'defined'} "
                       f"under a condition this check cannot decide ({last.why})")
    if last.body is None:
        raise Undecidable(f"{name} is #undef'd at line {last.line}")
    if last.function_like:
        raise Undecidable(f"{name} (line {last.line}) is a function-like macro")
    if not last.body:
        raise CEvalError(f"{name} (line {last.line}) is defined without a value")
    active = active | {name}

    def ident(n, defined):
        if n in cfg and not isinstance(cfg[n], bool):
            return cfg[n]
        return _resolve(n, defs, cfg, active, limits, memo)

    limits.enter()
    try:
        v = Expr(tokens(last.body), ident, False, limits).parse()
    except CLimitError:
        raise
    except Undecidable as e:
        raise Undecidable(f"{name} (line {last.line}): {_short(e)}") from None
    except CEvalError as e:
        raise CEvalError(f"{name} (line {last.line}): {_short(e)}") from None
    finally:
        limits.leave()
    if v is None:
        raise Undecidable(f"{name} (line {last.line}) depends on a value this check cannot decide")
    return v


def _short(e: Exception, n: int = 400) -> str:
    """A long chain of macro names keeps its ends: the outer macros and the reason at the bottom."""
    s = str(e)
    return s if len(s) <= n else s[:n // 3] + " ... " + s[-(2 * n // 3):]


def macro_value(text: str, macro: str, page_size: int) -> int:
    """The integer value of `macro` in `text` on an arm64 kernel with this page size (CEvalError if not known)."""
    if page_size not in ARM64_PAGE_SIZES:
        raise CEvalError(f"page size {page_size} is not an arm64 page size")
    cfg = _config(page_size)
    try:
        defs = _scan(text, cfg)
        if not defs.get(macro):
            raise CEvalError(f"{macro} is not defined in this file")
        return _resolve(macro, defs, cfg, set(), Limits(), {})
    except Undecidable as e:
        raise CEvalError(f"at {kib(page_size)} pages: {e}") from None
    except RecursionError:                  # a last resort: the limits keep far below Python's own
        raise CLimitError("expressions or macros nested too deeply") from None
