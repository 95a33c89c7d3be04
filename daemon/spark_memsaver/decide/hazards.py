"""Known hazards of the NVIDIA driver around our module (uvm_patch/hazards.yaml): pure decisions.

Nothing here reads the host: callers pass the table's text, the observed driver version, arch,
page size and (when the driver source is on the node) the text of the file the hazard's signature
names. The answer is an ``Assessment``:

- ``affected`` / ``not-affected`` / ``unknown``;
- ``decided_by``: ``platform`` (the arch or page size alone rules it out), ``content`` (the driver
  source is present: its text decides, whatever the version, so a fixed release is recognised
  without a table change) or ``version`` (no source, e.g. precompiled modules: the version range
  decides, and the reason says so).

The only signature kind today is ``submap-alignment``: a small C preprocessor evaluator finds the
object-like macro the signature names, follows the ``#if/#ifdef/#elif/#else`` structure around it for
each arm64 page size (``CONFIG_ARM64_<n>K_PAGES``, ``PAGE_SHIFT``) and computes its value. Conditions
it cannot decide (symbols from other headers, function-like macros) make the answer ``unknown`` only
when the macro's value depends on them. Odd or malformed text is ``unknown`` with a reason, never an
exception.
"""

from __future__ import annotations

import dataclasses
import re

import yaml

from spark_memsaver.errors import EXIT_USAGE, MemsaverError

FORMAT = 1

AFFECTED = "affected"
NOT_AFFECTED = "not-affected"
UNKNOWN = "unknown"

ARM64_PAGE_SIZES = (4096, 16384, 65536)
_ARCH_ALIASES = {"aarch64": "aarch64", "arm64": "aarch64", "x86_64": "x86_64", "amd64": "x86_64",
                 "ppc64le": "ppc64le", "ppc64el": "ppc64le", "riscv64": "riscv64"}


class HazardsInvalid(MemsaverError):
    code = "hazards-invalid"
    exit_code = EXIT_USAGE
    remedy = "Reinstall spark-memsaver (the hazards table ships in /usr/share/spark-memsaver/uvm_patch/)."


# ----------------------------------------------------------------------------------------------
# The table


@dataclasses.dataclass(frozen=True)
class Signature:
    kind: str
    files: tuple[str, ...]
    macro: str
    alignment: int
    reference_page_size: int


@dataclasses.dataclass(frozen=True)
class Hazard:
    id: str
    code: str
    reference: str
    url: str
    component: str
    arch: tuple[str, ...]
    page_sizes: tuple[int, ...]
    affected_min: tuple[int, ...]
    affected_below: tuple[int, ...] | None
    affected_text: str
    signature: Signature
    effect: str
    remedies: tuple[str, ...]


def parse_version(text) -> tuple[int, ...] | None:
    """'595.45.04' -> (595, 45, 4); a packaging suffix ('-0ubuntu1', '-sm0.1') is ignored; else None."""
    if not isinstance(text, str):
        return None
    m = re.match(r"\s*(\d+(?:\.\d+)+)(?:$|[-+~\s])", text)
    if not m:
        return None
    return tuple(int(p) for p in m.group(1).split("."))


def _req(d: dict, key: str, where: str, kind=None):
    if not isinstance(d, dict) or key not in d:
        raise HazardsInvalid(f"hazards table: {where} lacks '{key}'")
    v = d[key]
    if kind is not None and not isinstance(v, kind):
        raise HazardsInvalid(f"hazards table: {where}.{key} has the wrong type ({type(v).__name__})")
    return v


def load_hazards(text: str, source: str = "hazards.yaml") -> list[Hazard]:
    """Parse and check the table's text; HazardsInvalid (named, with a remedy) on any defect."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise HazardsInvalid(f"{source}: not valid YAML ({e.__class__.__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise HazardsInvalid(f"{source}: not a hazards table of format {FORMAT}")
    out = []
    seen = set()
    for i, h in enumerate(_req(doc, "hazards", source, list)):
        where = f"{source}: hazards[{i}]"
        hid = _req(h, "id", where, str)
        where = f"{source}: hazard {hid}"
        if hid in seen:
            raise HazardsInvalid(f"{where}: duplicate id")
        seen.add(hid)
        code = _req(h, "code", where, str)
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", code):
            raise HazardsInvalid(f"{where}: code {code!r} is not kebab-case")
        drivers = _req(h, "drivers", where, dict)
        rng = _req(drivers, "affected", where + ".drivers", dict)
        vmin = parse_version(_req(rng, "min", where + ".drivers.affected", str))
        below = rng.get("below")
        vbelow = parse_version(below) if below is not None else None
        if vmin is None or (below is not None and vbelow is None):
            raise HazardsInvalid(f"{where}: drivers.affected holds a version that is not dotted numbers")
        sig = _req(h, "signature", where, dict)
        kind = _req(sig, "kind", where + ".signature", str)
        if kind != "submap-alignment":
            raise HazardsInvalid(f"{where}: unknown signature kind {kind!r}")
        files = _req(sig, "file", where + ".signature")
        files = (files,) if isinstance(files, str) else tuple(files) if isinstance(files, list) else None
        if not files or not all(isinstance(f, str) and f and not f.startswith("/") and ".." not in f.split("/")
                                for f in files):
            raise HazardsInvalid(f"{where}: signature.file must be relative paths inside the driver source")
        align = _req(sig, "alignment", where + ".signature", int)
        ref_ps = _req(sig, "reference_page_size", where + ".signature", int)
        if align <= 0 or align & (align - 1) or ref_ps not in ARM64_PAGE_SIZES:
            raise HazardsInvalid(f"{where}: signature.alignment must be a power of two and "
                                 f"reference_page_size one of {ARM64_PAGE_SIZES}")
        arch = tuple(_ARCH_ALIASES.get(a, a) for a in _req(h, "arch", where, list))
        page_sizes = tuple(_req(h, "page_sizes", where, list))
        if not page_sizes or not all(isinstance(p, int) and p > 0 for p in page_sizes):
            raise HazardsInvalid(f"{where}: page_sizes must be byte counts")
        remedies = tuple(_req(h, "remedies", where, list))
        if not remedies or not all(isinstance(r, str) and r.strip() for r in remedies):
            raise HazardsInvalid(f"{where}: remedies must be non-empty text")
        affected_text = f"{rng['min']} and newer" if below is None else f"{rng['min']} up to (not including) {below}"
        out.append(Hazard(
            id=hid, code=code, reference=_req(h, "reference", where, str), url=str(h.get("url", "")),
            component=_req(h, "component", where, str), arch=arch, page_sizes=page_sizes,
            affected_min=vmin, affected_below=vbelow, affected_text=affected_text,
            signature=Signature(kind, files, _req(sig, "macro", where + ".signature", str), align, ref_ps),
            effect=" ".join(_req(h, "effect", where, str).split()),
            remedies=tuple(" ".join(r.split()) for r in remedies)))
    return out


# ----------------------------------------------------------------------------------------------
# Assessment


@dataclasses.dataclass(frozen=True)
class Assessment:
    hazard: str
    reference: str
    state: str                      # AFFECTED | NOT_AFFECTED | UNKNOWN
    decided_by: str | None          # "platform" | "content" | "version" | None (not decidable)
    reason: str
    driver_version: str | None
    arch: str | None
    page_size: int | None
    details: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _kib(n: int) -> str:
    return f"{n // 1024} KiB" if n % (1 << 20) else f"{n >> 20} MiB"


def _in_range(h: Hazard, v: tuple[int, ...]) -> bool:
    return v >= h.affected_min and (h.affected_below is None or v < h.affected_below)


def assess(hazard: Hazard, *, driver_version: str | None, arch: str | None, page_size: int | None,
           nv_linux_h_text: str | None) -> Assessment:
    """Decide whether this node meets the hazard. Pure; never raises for odd input."""
    norm_arch = _ARCH_ALIASES.get(arch, arch) if isinstance(arch, str) else None

    def result(state, by, reason, **details):
        return Assessment(hazard.id, hazard.reference, state, by, reason, driver_version, norm_arch,
                          page_size if isinstance(page_size, int) else None, details)

    if norm_arch is not None and norm_arch not in hazard.arch:
        return result(NOT_AFFECTED, "platform", f"{hazard.reference} needs {'/'.join(hazard.arch)}; "
                      f"this node is {norm_arch}")
    if isinstance(page_size, int) and page_size not in hazard.page_sizes:
        return result(NOT_AFFECTED, "platform", f"{hazard.reference} needs "
                      f"{' or '.join(_kib(p) for p in hazard.page_sizes)} pages; this kernel uses "
                      f"{_kib(page_size) if page_size > 0 else page_size}")
    if norm_arch is None or not isinstance(page_size, int):
        return result(UNKNOWN, None, "the node's architecture or page size was not observed")

    version = parse_version(driver_version)
    by_version = None
    if version is not None:
        by_version = AFFECTED if _in_range(hazard, version) else NOT_AFFECTED

    if nv_linux_h_text is not None:
        c = content_verdict(hazard.signature, nv_linux_h_text, page_size)
        if c.state == UNKNOWN:
            hint = ""
            if by_version is not None:
                hint = (f"; by version alone ({hazard.affected_text}) driver {driver_version} would be "
                        f"{by_version}")
            return result(UNKNOWN, "content", f"the driver source could not be read for "
                          f"{hazard.signature.macro}: {c.reason}{hint}", **c.details)
        return result(c.state, "content", c.reason, **c.details)

    if version is None:
        return result(UNKNOWN, None, "no driver source on this node and no readable driver version"
                      + (f" ({driver_version!r})" if driver_version else ""))
    return result(by_version, "version",
                  f"no driver source on this node (precompiled modules): decided by the version range "
                  f"{hazard.affected_text}, not by the source; driver {driver_version} is "
                  f"{'inside' if by_version == AFFECTED else 'outside'} it")


@dataclasses.dataclass(frozen=True)
class ContentVerdict:
    state: str
    reason: str
    details: dict


def content_verdict(sig: Signature, text: str, page_size: int) -> ContentVerdict:
    """The submap-alignment signature applied to a source text, at one arm64 page size."""
    if not isinstance(text, str) or not text.strip():
        return ContentVerdict(UNKNOWN, "the file is empty", {})
    if "\x00" in text:
        return ContentVerdict(UNKNOWN, "the file is not text (NUL bytes)", {})
    try:
        ref_pages = macro_value(text, sig.macro, sig.reference_page_size)
        pages = ref_pages if page_size == sig.reference_page_size else macro_value(text, sig.macro, page_size)
    except CEvalError as e:
        return ContentVerdict(UNKNOWN, str(e), {})
    ref_bytes, node_bytes = ref_pages * sig.reference_page_size, pages * page_size
    for ps, b in ((sig.reference_page_size, ref_bytes), (page_size, node_bytes)):
        if b <= 0 or b > 1 << 32:
            return ContentVerdict(UNKNOWN, f"{sig.macro} is {b // ps} pages at {_kib(ps)} pages "
                                  f"({b:#x} bytes), not a submap size of at most 4 GiB", {})
    details = {"macro": sig.macro, "submap_bytes": node_bytes, "reference_submap_bytes": ref_bytes,
               "alignment": sig.alignment}
    if ref_bytes % sig.alignment:
        return ContentVerdict(NOT_AFFECTED, (
            f"this tree keeps only {_kib(_lowbit(ref_bytes))} alignment for {sig.macro} on "
            f"{_kib(sig.reference_page_size)} kernels, so it does not rely on {_kib(sig.alignment)} "
            f"alignment (as in older drivers)"), details)
    if node_bytes % sig.alignment == 0:
        return ContentVerdict(NOT_AFFECTED, (
            f"this tree keeps {_kib(sig.alignment)} alignment for {sig.macro} at {_kib(page_size)} "
            f"pages ({node_bytes:#x} bytes): the fault is fixed in it"), details)
    return ContentVerdict(AFFECTED, (
        f"{sig.macro} at {_kib(page_size)} pages gives a {node_bytes:#x}-byte submap, not a multiple of "
        f"{_kib(sig.alignment)}, while this tree relies on {_kib(sig.alignment)} alignment "
        f"({ref_bytes:#x} bytes at {_kib(sig.reference_page_size)} pages)"), details)


def _lowbit(n: int) -> int:
    return n & -n


def finding(hazard: Hazard, a: Assessment) -> dict | None:
    """A status finding for an affected node; None otherwise."""
    if a.state != AFFECTED:
        return None
    where = ", ".join(x for x in (f"driver {a.driver_version}" if a.driver_version else "",
                                  "arm64" if a.arch == "aarch64" else (a.arch or ""),
                                  f"{_kib(a.page_size)} pages" if a.page_size else "") if x)
    how = {"content": "decided from nv-linux.h in the driver source",
           "version": f"decided by the driver version ({hazard.affected_text}): no driver source on this node"}
    msg = (f"GPU allocations of 4 GiB or more made with cudaMalloc/cuMemCreate fault just below each 4 GiB "
           f"boundary on this node ({where}): {hazard.reference}, a fault in {hazard.component}, not in "
           f"spark-memsaver; cudaMallocManaged is not affected ({how.get(a.decided_by, a.reason)}).")
    remedy = "; or ".join(hazard.remedies)
    remedy = remedy[0].upper() + remedy[1:] + f". Details: {hazard.url or hazard.reference}."
    return {"code": hazard.code, "severity": "warning", "message": msg, "remedy": remedy}


# ----------------------------------------------------------------------------------------------
# A small C preprocessor evaluator (object-like macros, conditionals, integer expressions)


class CEvalError(Exception):
    """The text cannot be evaluated; str() is the reason shown to the user."""


_BUILTINS = {
    "NV_U32_MAX": 0xFFFFFFFF, "NV_U16_MAX": 0xFFFF, "NV_U8_MAX": 0xFF, "NV_U64_MAX": (1 << 64) - 1,
    "U32_MAX": 0xFFFFFFFF, "UINT_MAX": 0xFFFFFFFF,
    **{f"SZ_{n}K": n << 10 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)},
    **{f"SZ_{n}M": n << 20 for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)},
    **{f"SZ_{n}G": n << 30 for n in (1, 2, 4)},
}
_UNSIGNED_CASTS = {"NvU8": 8, "NvU16": 16, "NvU32": 32, "NvU64": 64, "NvLength": 64, "u8": 8, "u16": 16,
                   "u32": 32, "u64": 64, "size_t": 64, "unsigned": 32, "unsigned int": 32,
                   "unsigned long": 64, "unsigned long long": 64, "uint32_t": 32, "uint64_t": 64}
_MAX_NESTING = 64
_MAX_TEXT = 4 << 20


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


def _strip_comments(text: str) -> str:
    """Remove /* */ and // comments (keeping newlines), aware of string and char literals."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == "/" and i + 1 < n and text[i + 1] == "*":
            j = text.find("*/", i + 2)
            if j < 0:
                raise CEvalError(f"unterminated /* comment at line {text.count(chr(10), 0, i) + 1}")
            out.append(" " + "\n" * text.count("\n", i, j))
            i = j + 2
        elif c == "/" and i + 1 < n and text[i + 1] == "/":
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        else:
            j = i
            while j < n and text[j] not in "/\"'":
                j += 1
            if j == i:
                out.append(c)
                j += 1
            else:
                out.append(text[i:j])
            i = j
    return "".join(out)


def _logical_lines(text: str):
    """(first line number, text) of each logical line: comments removed, continuations joined."""
    lines = _strip_comments(text).split("\n")
    i = 0
    while i < len(lines):
        start, buf = i + 1, lines[i]
        while buf.endswith("\\") and i + 1 < len(lines):
            i += 1
            buf = buf[:-1] + " " + lines[i]
        yield start, buf
        i += 1


_TOKEN = re.compile(r"\s*(?:(0[xX][0-9a-fA-F]+|\d+)([uUlL]*)|([A-Za-z_]\w*)|(<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%()<>&^|!~?:,]))")


def _tokens(expr: str) -> list:
    toks, pos = [], 0
    expr = expr.rstrip()
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise CEvalError(f"cannot read {expr.strip()!r} as an integer expression")
        num, _suffix, ident, op = m.groups()
        if num is not None:
            toks.append(("num", int(num, 16) if num[:2].lower() == "0x" else int(num, 8) if
                         len(num) > 1 and num[0] == "0" else int(num)))
        elif ident is not None:
            toks.append(("id", ident))
        else:
            toks.append(("op", op))
        pos = m.end()
    return toks


class _Unknown(Exception):
    """An operand whose value cannot be known here (tristate 'maybe')."""


_PREC = {"||": 1, "&&": 2, "|": 3, "^": 4, "&": 5, "==": 6, "!=": 6, "<": 7, ">": 7, "<=": 7, ">=": 7,
         "<<": 8, ">>": 8, "+": 9, "-": 9, "*": 10, "/": 10, "%": 10}


class _Expr:
    """Precedence-climbing evaluator over tokens. ident(name) resolves identifiers (may raise _Unknown)."""

    def __init__(self, toks, ident, allow_defined):
        self.t, self.i, self.ident, self.allow_defined = toks, 0, ident, allow_defined

    def peek(self):
        return self.t[self.i] if self.i < len(self.t) else (None, None)

    def take(self, op=None):
        tok = self.peek()
        if tok[0] is None or (op is not None and tok != ("op", op)):
            raise CEvalError(f"expected {op or 'an operand'} in an expression")
        self.i += 1
        return tok

    def parse(self):
        v = self.ternary()
        if self.i != len(self.t):
            raise CEvalError("trailing tokens in an expression")
        return v

    def ternary(self):
        c = self.binary(1)
        if self.peek() == ("op", "?"):
            self.take("?")
            a = self.ternary()
            self.take(":")
            b = self.ternary()
            if c is None:
                return a if a == b else None
            return a if c else b
        return c

    def binary(self, minp):
        lhs = self.unary()
        while True:
            kind, op = self.peek()
            if kind != "op" or op not in _PREC or _PREC[op] < minp:
                return lhs
            self.take()
            rhs = self.binary(_PREC[op] + 1)
            lhs = self.apply(op, lhs, rhs)

    @staticmethod
    def apply(op, a, b):
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
        return {"|": lambda: a | b, "^": lambda: a ^ b, "&": lambda: a & b, "==": lambda: int(a == b),
                "!=": lambda: int(a != b), "<": lambda: int(a < b), ">": lambda: int(a > b),
                "<=": lambda: int(a <= b), ">=": lambda: int(a >= b), "<<": lambda: a << b,
                ">>": lambda: a >> b, "+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b,
                "/": lambda: int(a / b) if (a < 0) != (b < 0) else a // b,
                "%": lambda: a - b * (int(a / b) if (a < 0) != (b < 0) else a // b)}[op]()

    def unary(self):
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
                raise _Unknown(f"it calls the function-like macro {v}()")
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


@dataclasses.dataclass
class _Def:
    state: bool | None          # True: certainly in effect, None: under an undecidable condition
    body: str | None            # None: #undef
    function_like: bool
    line: int
    why: str                    # the undecidable condition, when state is None


def _scan(text: str, cfg: dict) -> dict[str, list[_Def]]:
    """Run the conditional structure for one configuration; return each macro's definitions in order."""
    if len(text) > _MAX_TEXT:
        raise CEvalError(f"the file is larger than {_MAX_TEXT >> 20} MiB")
    defs: dict[str, list[_Def]] = {}
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
            return _resolve(name, defs, cfg, set())
        except (_Unknown, CEvalError):
            return None

    def evaluate(expr, line):
        if not expr.strip():
            raise CEvalError(f"line {line}: a conditional without an expression")
        try:
            return _Expr(_tokens(expr), ident, True).parse()
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

    for line, raw in _logical_lines(text):
        m = re.match(r"\s*#\s*(\w+)\s*(.*)$", raw)
        if not m:
            continue
        d, rest = m.group(1), m.group(2).strip()
        shown = f"#{d} {rest}".strip()
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


def _resolve(name: str, defs: dict, cfg: dict, active: set) -> int:
    """Value of an object-like macro after the whole file (the last definition in effect)."""
    if name in active:
        raise CEvalError(f"{name} refers to itself")
    ds = defs.get(name)
    if not ds:
        if name in cfg and not isinstance(cfg[name], bool):
            return cfg[name]
        if name in _BUILTINS:
            return _BUILTINS[name]
        raise _Unknown(f"{name} is not defined here and is not a known kernel or NVIDIA constant")
    last = ds[-1]
    if last.state is None:
        raise _Unknown(f"{name} (line {last.line}) is {'undefined' if last.body is None else 'defined'} "
                       f"under a condition this check cannot decide ({last.why})")
    if last.body is None:
        raise _Unknown(f"{name} is #undef'd at line {last.line}")
    if last.function_like:
        raise _Unknown(f"{name} (line {last.line}) is a function-like macro")
    if not last.body:
        raise CEvalError(f"{name} (line {last.line}) is defined without a value")
    active = active | {name}

    def ident(n, defined):
        if n in cfg and not isinstance(cfg[n], bool):
            return cfg[n]
        return _resolve(n, defs, cfg, active)

    try:
        v = _Expr(_tokens(last.body), ident, False).parse()
    except _Unknown as e:
        raise _Unknown(f"{name} (line {last.line}): {e}") from None
    except CEvalError as e:
        raise CEvalError(f"{name} (line {last.line}): {e}") from None
    if v is None:
        raise _Unknown(f"{name} (line {last.line}) depends on a value this check cannot decide")
    return v


def macro_value(text: str, macro: str, page_size: int) -> int:
    """The integer value of `macro` in `text` on an arm64 kernel with this page size (CEvalError if not known)."""
    if page_size not in ARM64_PAGE_SIZES:
        raise CEvalError(f"page size {page_size} is not an arm64 page size")
    cfg = _config(page_size)
    defs = _scan(text, cfg)
    if not defs.get(macro):
        raise CEvalError(f"{macro} is not defined in this file")
    try:
        return _resolve(macro, defs, cfg, set())
    except _Unknown as e:
        raise CEvalError(f"at {_kib(page_size)} pages: {e}") from None
    except RecursionError:
        raise CEvalError(f"{macro}: macros nested too deeply") from None


# ----------------------------------------------------------------------------------------------
# From the snapshot (observe/snapshot.py: observe_hazard_inputs gathers the inputs)


def findings_from_inputs(inputs: dict | None) -> list[dict]:
    """Status findings for every hazard this node meets.

    ``inputs``: ``{"table": {"path", "text" (None: not found), "error"}, "driver_version", "arch", "page_size",
    "sources": {relative path in the driver source: text}}``. No driver version and no source: nothing to say
    (there is no driver). A table that cannot be read is one info finding, never an exception.
    """
    if not inputs:
        return []
    table = inputs.get("table") or {}
    if table.get("text") is None:
        return [{"code": "hazards-table-unreadable", "severity": "info",
                 "message": "The known-hazards table could not be read ("
                            + (table.get("error") or f"not found: {table.get('path') or 'hazards.yaml'}")
                            + "): known NVIDIA driver faults are not checked.",
                 "remedy": HazardsInvalid.remedy}]
    try:
        table_hazards = load_hazards(table["text"], table.get("path") or "hazards.yaml")
    except HazardsInvalid as e:
        return [{"code": e.code, "severity": "info", "message": e.message + ": known NVIDIA driver faults are "
                 "not checked.", "remedy": e.remedy}]
    sources = inputs.get("sources") or {}
    if not inputs.get("driver_version") and not sources:
        return []
    out = []
    for h in table_hazards:
        text = next((sources[f] for f in h.signature.files if sources.get(f) is not None), None)
        a = assess(h, driver_version=inputs.get("driver_version"), arch=inputs.get("arch"),
                   page_size=inputs.get("page_size"), nv_linux_h_text=text)
        f = finding(h, a)
        if f is not None:
            out.append(f)
    return out
