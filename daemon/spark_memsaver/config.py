"""Configuration: defaults in code, an optional YAML file that overrides them.

A missing file at the default location means "all defaults". A file named explicitly (``--config`` or
``SPARK_MEMSAVER_CONFIG``) must exist. Anything unreadable, non-YAML or wrongly typed is a ConfigError
naming the file, the key and what was expected.
"""

from __future__ import annotations

import os
from spark_memsaver.record import Record, asdict, field

from .errors import ConfigError
from . import vocabulary as policy   # the tier/kernels vocabulary (a leaf; decide/policy re-exports it)

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
    # Where this config came from ("defaults" or a path).
    source: str = field(default="defaults", compare=False)
    # Notes about the file that are not errors (an old tier name, ...): shown as info findings.
    notes: tuple = field(default=(), compare=False)

    def to_dict(self) -> dict:
        return asdict(self)


# key -> (type(s), validator or None, description of what is expected)
_SCHEMA = {
    "kernels": (str, lambda v: v in policy.KERNEL_POLICIES, "one of: " + ", ".join(policy.KERNEL_POLICIES)),
    "tier": ((str, int), lambda v: str(v) in policy.TIERS or str(v) in policy.RENAMED,
             "one of: " + policy.tier_values_text()),
    "interval": (int, lambda v: 5 <= v <= 86400, "an integer number of seconds between 5 and 86400"),
    "prometheus_textfile": ((str, type(None)), lambda v: v is None or v == "off" or v.startswith("/"),
                            "an absolute path, 'off', or null for node_exporter's directory when it exists"),
    "signing_key": ((str, type(None)), lambda v: v is None or v.startswith("/"), "an absolute path or null"),
    "signing_cert": ((str, type(None)), lambda v: v is None or v.startswith("/"), "an absolute path or null"),
    "auto_build": (bool, None, "true or false"),
    "history_size": (int, lambda v: 10 <= v <= 100000, "an integer between 10 and 100000"),
    "source_fetch": (str, lambda v: v in SOURCE_FETCH_MODES, "one of: " + ", ".join(SOURCE_FETCH_MODES)),
}


def parse(text: str, source: str) -> Config:
    from spark_memsaver import yamlio

    try:
        data = yamlio.safe_load(text)
    except Exception as e:   # yaml.YAMLError: yaml is imported only when the file holds more than comments
        import yaml
        if not isinstance(e, yaml.YAMLError):
            raise
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{source}: not valid YAML{where}: {getattr(e, 'problem', e)}")
    if data is None:
        return Config(source=source)
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys to values at the top level, "
                          f"found {type(data).__name__}")
    values = {}
    notes = []
    for key, value in data.items():
        if key not in _SCHEMA:
            known = ", ".join(sorted(_SCHEMA))
            raise ConfigError(f"{source}: unknown key '{key}' (known keys: {known})")
        types, ok, expected = _SCHEMA[key]
        if isinstance(value, bool) and types is not bool and bool not in (types if isinstance(types, tuple) else (types,)):
            raise ConfigError(f"{source}: key '{key}' must be {expected}, got {value!r}")
        if not isinstance(value, types) or (ok is not None and not ok(value)):
            raise ConfigError(f"{source}: key '{key}' must be {expected}, got {value!r}")
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
        with open(full, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{full}: config file not found",
                              remedy="Give an existing file, or drop --config/SPARK_MEMSAVER_CONFIG to use defaults.")
        return Config()
    except OSError as e:
        raise ConfigError(f"{full}: cannot read config file: {e.strerror}",
                          remedy="Check the file's permissions (it should be readable by root).")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{full}: not UTF-8 text")
    return parse(text, full)
