"""Configuration: defaults in code, an optional YAML file that overrides them.

A missing file at the default location means "all defaults". A file named explicitly (``--config`` or
``SPARK_MEMSAVER_CONFIG``) must exist. Anything unreadable, non-YAML or wrongly typed is a ConfigError
naming the file, the key and what was expected.
"""

from __future__ import annotations

import os
import re
import stat
from spark_memsaver.record import Record, asdict, field

from .errors import ConfigError
from . import vocabulary as policy   # the tier/kernels vocabulary (a leaf; decide/policy re-exports it)
from .host.safetext import is_safe

DEFAULT_PATH = "/etc/spark-memsaver/config.yaml"
ENV_VAR = "SPARK_MEMSAVER_CONFIG"
SOURCE_FETCH_MODES = ("auto", "never")


class Config(Record, frozen=True):
    # Which kernels we build for: "64k-only" (arm64 with CONFIG_ARM64_64K_PAGES) or "all".
    kernels: str = "64k-only"
    # Packing tier (decide/policy.py): "leaf" (default, the hardware-validated scope), "4k-all" or "256"
    # (opt-in, not validated on hardware). The old name "4k" is read as "4k-all".
    tier: str = "leaf"
    # Monitoring sample interval in seconds.
    interval: int = 60
    # Path of a Prometheus textfile (node_exporter textfile collector); None = off.
    prometheus_textfile: str | None = None
    # Signing: None = DKMS's configured/default key; else explicit paths.
    signing_key: str | None = None
    signing_cert: str | None = None
    # Build automatically when a supported driver appears (daemon, postinst, hooks).
    auto_build: bool = True
    # Samples kept in the daemon's history ring.
    history_size: int = 1440
    # Driver source missing: "auto" = fetch that exact version with apt-get download into the cache;
    # "never" = do not, status names the exact apt-get install command instead.
    source_fetch: str = "auto"
    # Keep MemFree above this under memory pressure (a size such as "8G"); "off" by default (service/floor.py).
    memory_floor: str = "off"
    # Where this config came from ("defaults" or a path).
    source: str = field(default="defaults", compare=False)
    # Notes about the file that are not errors (an old tier name, ...): shown as info findings.
    notes: tuple = field(default=(), compare=False)
    # The file's error when it could not be used (load_for_safety): these are the built-in defaults then.
    invalid: dict | None = field(default=None, compare=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("invalid", None)       # not a setting: 'config show' prints a file that loads back
        return d


def _path(v: str) -> bool:
    """An absolute path without control or bidi characters (status shows it back; safetext)."""
    return v.startswith("/") and is_safe(v)


# key -> (type(s), validator or None, description of what is expected)
_SCHEMA = {
    "kernels": (str, lambda v: v in policy.KERNEL_POLICIES, "one of: " + ", ".join(policy.KERNEL_POLICIES)),
    "tier": ((str, int), lambda v: str(v) in policy.TIERS or str(v) in policy.RENAMED,
             "one of: " + policy.tier_values_text()),
    "interval": (int, lambda v: 5 <= v <= 86400, "an integer number of seconds between 5 and 86400"),
    "prometheus_textfile": ((str, type(None)), lambda v: v is None or v == "off" or _path(v),
                            "an absolute path, 'off', or null for node_exporter's directory when it exists"),
    "signing_key": ((str, type(None)), lambda v: v is None or _path(v), "an absolute path or null"),
    "signing_cert": ((str, type(None)), lambda v: v is None or _path(v), "an absolute path or null"),
    "auto_build": (bool, None, "true or false"),
    "history_size": (int, lambda v: 10 <= v <= 100000, "an integer between 10 and 100000"),
    "source_fetch": (str, lambda v: v in SOURCE_FETCH_MODES, "one of: " + ", ".join(SOURCE_FETCH_MODES)),
    "memory_floor": (str, lambda v: v == "off" or re.fullmatch(r"[1-9][0-9]{0,6}(\.[0-9]+)?[KMGT]?(i?B)?", v,
                                                              re.IGNORECASE) is not None,
                     "'off' or a size such as 8G (binary units: K, M, G, T)"),
}


# Reading is bounded before anything is built or formatted (issue 35): the file is at most MAX_BYTES, a regular
# file opened without blocking; the YAML holds no anchors or aliases (a ~1 KB nest of aliases expands to
# gigabytes) and nests no deeper than MAX_DEPTH; a value shown back in a message is cut at SHOWN_CHARS.
MAX_BYTES = 64 * 1024
MAX_DEPTH = 8
SHOWN_CHARS = 60


def _shown(value) -> str:
    """``value!r`` cut at SHOWN_CHARS: a message never formats a large value whole."""
    if isinstance(value, (str, int, float, bool, type(None))):
        text = repr(value)
    else:
        text = f"a {type(value).__name__}"
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _fail(source: str, message: str, line: int | None = None, **kw) -> ConfigError:
    where = f"{source}, line {line}: " if line else f"{source}: "
    return ConfigError(where + message, file=source, line=line, **kw)


def _bounded_node(text: str, source: str):
    """The document's node tree, after one pass over its events that refuses anchors, aliases and deep nesting
    (linear in the text; nothing is constructed before it passed)."""
    from spark_memsaver import yamlio

    cls = yamlio.loader()
    scan = cls(text)
    try:
        depth = 0
        while scan.check_event():
            ev = scan.get_event()
            line = ev.start_mark.line + 1 if ev.start_mark is not None else None
            kind = type(ev).__name__
            if kind == "AliasEvent" or getattr(ev, "anchor", None):
                raise _fail(source, "YAML anchors and aliases (&name, *name) are not accepted in the config", line)
            if kind in ("MappingStartEvent", "SequenceStartEvent"):
                depth += 1
                if depth > MAX_DEPTH:
                    raise _fail(source, f"nested deeper than {MAX_DEPTH} levels", line)
            elif kind in ("MappingEndEvent", "SequenceEndEvent"):
                depth -= 1
    finally:
        scan.dispose()
    loader = cls(text)
    try:
        return loader, loader.get_single_node()
    except BaseException:
        loader.dispose()
        raise


def parse(text: str, source: str) -> Config:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise _fail(source, f"larger than {MAX_BYTES // 1024} KiB (a config file is a few lines)")
    from spark_memsaver import yamlio

    if yamlio.is_empty(text):
        return Config(source=source)
    try:
        loader, node = _bounded_node(text, source)
        try:
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except (RecursionError, MemoryError):
        raise _fail(source, "too deeply nested to read")
    except Exception as e:   # yaml.YAMLError: yaml is imported only when the file holds more than comments
        if not isinstance(e, yamlio.yaml_error()):
            raise
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = str(getattr(e, "problem", None) or e)[:200]
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}", file=source,
                          line=mark.line + 1 if mark else None)
    if data is None:
        return Config(source=source)
    if not isinstance(data, dict):
        raise _fail(source, "expected a mapping of keys to values at the top level, "
                            f"found {type(data).__name__}", 1)
    lines = {}
    for k, _v in node.value:
        if isinstance(getattr(k, "value", None), str):       # a scalar key (a list as a key has no name)
            lines.setdefault(k.value, k.start_mark.line + 1)
    values = {}
    notes = []
    for key, value in data.items():
        line = lines.get(key) if isinstance(key, str) else None
        if key not in _SCHEMA:
            known = ", ".join(sorted(_SCHEMA))
            raise _fail(source, f"unknown key {_shown(key)} (known keys: {known})", line)
        types, ok, expected = _SCHEMA[key]
        if isinstance(value, bool) and types is not bool and bool not in (types if isinstance(types, tuple) else (types,)):
            raise _fail(source, f"key '{key}' must be {expected}, got {_shown(value)}", line)
        if not isinstance(value, types) or (ok is not None and not ok(value)):
            raise _fail(source, f"key '{key}' must be {expected}, got {_shown(value)}", line)
        if key == "tier":
            note = policy.tier_renamed(value)
            if note:
                notes.append(f"{source}: {note}")
            value = policy.normalize_tier(value)
        values[key] = value
    return Config(source=source, notes=tuple(notes), **values)


def load(path: str | None = None, root: str = "/") -> Config:
    """Load the config. ``path`` None means: $SPARK_MEMSAVER_CONFIG, else the default location."""
    explicit = path or os.environ.get(ENV_VAR)
    target = explicit or DEFAULT_PATH
    full = target if root == "/" or explicit else os.path.join(root, target.lstrip("/"))
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{full}: config file not found", file=full,
                              remedy="Give an existing file, or drop --config/SPARK_MEMSAVER_CONFIG to use defaults.")
        return Config()
    except OSError as e:
        raise ConfigError(f"{full}: cannot read config file: {e.strerror}", file=full,
                          remedy="Check the file's permissions (it should be readable by root).")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{full}: not a regular file", file=full,
                              remedy="Make it a plain file, or remove it to use the defaults.")
        if st.st_size > MAX_BYTES:
            raise _fail(full, f"larger than {MAX_BYTES // 1024} KiB (a config file is a few lines)")
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{full}: cannot read config file: {e.strerror}", file=full,
                          remedy="Check the file's permissions (it should be readable by root).")
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        raise _fail(full, f"larger than {MAX_BYTES // 1024} KiB (a config file is a few lines)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{full}: not UTF-8 text", file=full)
    return parse(text, full)


def load_for_safety(path: str | None = None, root: str = "/") -> Config:
    """The config of a safety path (rollback, remove, reconcile's removals, the APT door, status, metrics, mok
    status): the file's when it is valid; else the built-in defaults carrying the file's error in ``invalid``
    (code, message, file, line), which the planner reads as "no builds" and status shows as one
    ``config-invalid`` finding. Build and install use :func:`load` and refuse."""
    try:
        return load(path, root)
    except ConfigError as e:
        return Config(invalid=invalid_dict(e))


def invalid_dict(e: ConfigError) -> dict:
    d = e.details or {}
    return {"code": e.code, "message": e.message, "remedy": e.remedy, "file": d.get("file"), "line": d.get("line")}


def refuse_invalid(config: Config, what: str) -> None:
    """Build and install act on a configuration: with an invalid file they refuse (ConfigError, exit 2)."""
    bad = getattr(config, "invalid", None)
    if bad:
        raise ConfigError(f"{bad.get('message')} ({what} needs a valid configuration)",
                          remedy=bad.get("remedy") or None, file=bad.get("file"), line=bad.get("line"))
