"""Integer expressions of the C preprocessor, read from text: a tokenizer and an evaluator.

Pure text parsing, no I/O (used by decide/c_macros.py). ``Expr`` evaluates with three-valued logic: an
operand that cannot be known here is ``None`` (propagated through arithmetic; ``&&``/``||`` short-circuit
on a known side) or, where its value matters outside a conditional, ``Undecidable``.

Bounded for hostile text (nv-linux.h is input, not code): a shared :class:`Limits` caps the nesting depth
(parentheses, unary operators and macro levels together, far below Python's recursion limit), the work per
file and the length of a number literal; a value past 128 bits is out of range (the preprocessor computes in
intmax_t). Passing a limit raises :class:`CLimitError` (a CEvalError): the text could not be read.
"""

from __future__ import annotations

import re

class CEvalError(Exception):
    """The text cannot be evaluated; str() is the reason shown to the user."""


class CLimitError(CEvalError):
    """The text passes a limit of this reader (depth, size, work): it could not be read, whatever it says."""


MAX_DEPTH = 300             # nesting units: one per ternary/binary/unary level and per macro level
MAX_STEPS = 100_000         # operands per file and page size (NVIDIA's nv-linux.h: ~130)
MAX_TOKENS = 10_000         # tokens of one expression (NVIDIA's longest: ~20)
MAX_LITERAL = 64            # characters of one number literal (a 64-bit value needs at most 24)
_MAX_BITS = 128             # |value| below 2**128


class Limits:
    """Depth and work shared by every expression evaluated for one file (nested macro bodies included)."""

    def __init__(self, max_depth: int = MAX_DEPTH, max_steps: int = MAX_STEPS):
        self.depth, self.steps, self.max_depth, self.max_steps = 0, 0, max_depth, max_steps

    def enter(self):
        self.depth += 1
        if self.depth > self.max_depth:
            raise CLimitError(f"expressions or macros nested deeper than {self.max_depth} levels")

    def leave(self):
        self.depth -= 1

    def step(self):
        self.steps += 1
        if self.steps > self.max_steps:
            raise CLimitError(f"more than {self.max_steps} operands to evaluate")


def _tdiv(a: int, b: int) -> int:
    """C division: truncated toward zero (exact for any size, unlike int(a / b))."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


_OPS = {"|": lambda a, b: a | b, "^": lambda a, b: a ^ b, "&": lambda a, b: a & b,
        "==": lambda a, b: int(a == b), "!=": lambda a, b: int(a != b), "<": lambda a, b: int(a < b),
        ">": lambda a, b: int(a > b), "<=": lambda a, b: int(a <= b), ">=": lambda a, b: int(a >= b),
        "<<": lambda a, b: a << b, ">>": lambda a, b: a >> b, "+": lambda a, b: a + b,
        "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": _tdiv,
        "%": lambda a, b: a - b * _tdiv(a, b)}


def _checked(v):
    if v is not None and (v >= 0 and v.bit_length() > _MAX_BITS or v < 0 and (-v).bit_length() > _MAX_BITS):
        raise CEvalError(f"a value out of range (over {_MAX_BITS} bits) in an expression")
    return v


_UNSIGNED_CASTS = {"NvU8": 8, "NvU16": 16, "NvU32": 32, "NvU64": 64, "NvLength": 64, "u8": 8, "u16": 16,
                   "u32": 32, "u64": 64, "size_t": 64, "unsigned": 32, "unsigned int": 32,
                   "unsigned long": 64, "unsigned long long": 64, "uint32_t": 32, "uint64_t": 64}


_TOKEN = re.compile(r"\s*(?:(0[xX][0-9a-fA-F]+|\d+)([uUlL]*)|([A-Za-z_]\w*)|(<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%()<>&^|!~?:,]))")


def tokens(expr: str) -> list:
    toks, pos = [], 0
    expr = expr.rstrip()
    end = len(expr)
    match = _TOKEN.match
    while pos < end:
        m = match(expr, pos)
        if not m or m.end() == pos:
            shown = expr.strip()
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise CEvalError(f"cannot read {shown!r} as an integer expression")
        num, _suffix, ident, op = m.groups()
        if num is not None:
            if len(num) > MAX_LITERAL:
                raise CLimitError(f"a number literal of {len(num)} digits (at most {MAX_LITERAL} are read)")
            try:
                toks.append(("num", int(num, 16) if num[:2].lower() == "0x" else int(num, 8) if
                             len(num) > 1 and num[0] == "0" else int(num)))
            except ValueError:              # "08": not an octal number (found by tests/test_fuzz.py)
                raise CEvalError(f"{num!r} is not a number") from None
        elif ident is not None:
            toks.append(("id", ident))
        else:
            toks.append(("op", op))
        if len(toks) > MAX_TOKENS:
            raise CLimitError(f"an expression of more than {MAX_TOKENS} tokens")
        pos = m.end()
    return toks


class Undecidable(Exception):
    """An operand whose value cannot be known here (tristate 'maybe')."""


_PREC = {"||": 1, "&&": 2, "|": 3, "^": 4, "&": 5, "==": 6, "!=": 6, "<": 7, ">": 7, "<=": 7, ">=": 7,
         "<<": 8, ">>": 8, "+": 9, "-": 9, "*": 10, "/": 10, "%": 10}


class Expr:
    """Precedence-climbing evaluator over tokens. ident(name) resolves identifiers (may raise Undecidable)."""

    def __init__(self, toks, ident, allow_defined, limits: Limits | None = None):
        self.t, self.i, self.ident, self.allow_defined = toks, 0, ident, allow_defined
        self.limits = limits if limits is not None else Limits()

    def peek(self):
        return self.t[self.i] if self.i < len(self.t) else (None, None)

    def take(self, op=None):
        tok = self.peek()
        if tok[0] is None or (op is not None and tok != ("op", op)):
            raise CEvalError(f"expected {op or 'an operand'} in an expression")
        self.i += 1
        return tok

    def parse(self):
        depth = self.limits.depth           # levels left open by an exception are closed here, once
        try:
            v = self.ternary()
        finally:
            self.limits.depth = depth
        if self.i != len(self.t):
            raise CEvalError("trailing tokens in an expression")
        return v

    def ternary(self):
        self.limits.enter()
        c = self.binary(1)
        if self.peek() == ("op", "?"):
            self.take("?")
            a = self.ternary()
            self.take(":")
            b = self.ternary()
            c = (a if a == b else None) if c is None else (a if c else b)
        self.limits.leave()
        return c

    def binary(self, minp):
        self.limits.enter()
        lhs = self.unary()
        while True:
            kind, op = self.peek()
            if kind != "op" or op not in _PREC or _PREC[op] < minp:
                self.limits.leave()
                return lhs
            self.take()
            rhs = self.binary(_PREC[op] + 1)
            lhs = self.apply(op, lhs, rhs)

    @staticmethod
    def apply(op, a, b):
        return _checked(Expr._apply(op, a, b))

    @staticmethod
    def _apply(op, a, b):
        if op == "&&":
            if a == 0 or b == 0:
                return 0
            return None if a is None or b is None else 1
        if op == "||":
            if (a is not None and a != 0) or (b is not None and b != 0):
                return 1
            return None if a is None or b is None else 0
        if a is None or b is None:
            return None
        if op in ("/", "%") and b == 0:
            raise CEvalError("division by zero in an expression")
        if op in ("<<", ">>") and not 0 <= b < 128:
            raise CEvalError(f"shift by {b} in an expression")
        return _OPS[op](a, b)

    def unary(self):
        self.limits.enter()
        self.limits.step()
        v = _checked(self.operand())
        self.limits.leave()
        return v

    def operand(self):
        kind, v = self.peek()
        if kind == "op" and v in "+-!~":
            self.take()
            x = self.unary()
            if x is None:
                return None
            return {"+": x, "-": -x, "!": int(not x), "~": ~x}[v]
        if kind == "op" and v == "(":
            width = self.cast_width()
            if width is not None:
                x = self.unary()
                return None if x is None else x & ((1 << width) - 1)
            self.take("(")
            x = self.ternary()
            self.take(")")
            return x
        if kind == "num":
            self.take()
            return v
        if kind == "id":
            self.take()
            if v == "defined":
                if not self.allow_defined:
                    raise CEvalError("'defined' outside a conditional")
                paren = self.peek() == ("op", "(")
                if paren:
                    self.take("(")
                k, name = self.take()
                if k != "id":
                    raise CEvalError("'defined' without a name")
                if paren:
                    self.take(")")
                return self.ident(name, defined=True)
            if self.peek() == ("op", "("):
                depth = 0
                while True:                 # skip the arguments: the call's value is not known here
                    k, o = self.take()
                    depth += (o == "(") - (o == ")") if k == "op" else 0
                    if depth == 0:
                        break
                if self.allow_defined:
                    return None
                raise Undecidable(f"it calls the function-like macro {v}()")
            return self.ident(v, defined=False)
        raise CEvalError("an expression ends early or holds an unexpected token")

    def cast_width(self):
        """If the tokens at '(' are a known unsigned type cast, consume it and return its width."""
        j, words = self.i + 1, []
        while j < len(self.t) and self.t[j][0] == "id":
            words.append(self.t[j][1])
            j += 1
        if words and j < len(self.t) and self.t[j] == ("op", ")") and " ".join(words) in _UNSIGNED_CASTS:
            # "(X)" alone is a parenthesised identifier unless a unary operand follows.
            nxt = self.t[j + 1] if j + 1 < len(self.t) else (None, None)
            if nxt[0] in ("num", "id") or nxt in (("op", "("), ("op", "+"), ("op", "-"), ("op", "~"), ("op", "!")):
                self.i = j + 1
                return _UNSIGNED_CASTS[" ".join(words)]
        return None
