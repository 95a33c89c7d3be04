"""YAML reading for the product's files (config, manifest, hazards table): libyaml's C parser where PyYAML has
it (python3-yaml on Debian and Ubuntu does), PyYAML's pure-Python one otherwise. The same constructor and
resolver either way (safe types only), so the documents are the same; the C parser is ~20x faster.

``yaml`` is imported by the first parse, not by importing this module. The product's own data files (the patch
manifest, the hazards table) are parsed once per version of their text: :func:`load_data` keeps the parsed value
as JSON together with the exact text it came from in ``/var/cache/spark-memsaver/parsed/`` (root writes it, the
status child or any root command; everyone reads it), so `status` needs no yaml while the files are unchanged.
"""

from __future__ import annotations

import json
import os
import re

DATA_CACHE = "/var/cache/spark-memsaver/parsed"     # host/paths.CACHE_DIR + /parsed (the live system's)

# A text of blank lines and comments only is an empty YAML document (None) for either parser: say so without
# importing yaml (the shipped config file is all comments). YAML's line breaks are \n, \r, \x85, \u2028 and
# \u2029; a comment ends at any of them, and a tab or a byte-order mark leaves the decision to the parser.
_EMPTY = re.compile("(?: *(?:#[^\n\r\x85\u2028\u2029]*)?(?:\r\n|[\n\r\x85\u2028\u2029]))* *(?:#[^\n\r\x85\u2028\u2029]*)?")


def loader():
    """The safe loader class: ``yaml.CSafeLoader`` when libyaml is there, else ``yaml.SafeLoader``."""
    import yaml

    return getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def is_empty(text: str) -> bool:
    """Blank lines and comments only: an empty document, decided without yaml."""
    return _EMPTY.fullmatch(text) is not None


def safe_load(text: str):
    """``yaml.safe_load(text)`` through the C parser when present; raises ``yaml.YAMLError`` as it does."""
    if _EMPTY.fullmatch(text):
        return None
    import yaml

    return yaml.load(text, Loader=loader())


def yaml_error():
    """``yaml.YAMLError`` for an except clause: Python evaluates it only while an exception is handled, so a
    caller that parsed nothing never imports yaml for it."""
    import yaml

    return yaml.YAMLError


def _trusted(path: str) -> bool:
    """Only a copy root (or we) wrote and nobody else can change is believed: the manifest decides which drivers
    are supported (host/fsutil.trusted_copy)."""
    from spark_memsaver.host.fsutil import trusted_copy
    return trusted_copy(path)


def _same_as_json(value) -> bool:
    """The value survives JSON exactly (str keys, no dates, no NaN): else it is not kept."""
    try:
        return json.loads(json.dumps(value, allow_nan=False)) == value
    except (TypeError, ValueError, RecursionError):
        return False


def load_data(text: str, name: str):
    """``safe_load(text)`` for the product's data file ``name`` ("manifest", "hazards"), through the parsed copy
    in :data:`DATA_CACHE` when it was made from exactly this text; as root, the copy is (re)written."""
    path = os.path.join(DATA_CACHE, f"{name}.json")
    if _trusted(path):
        try:
            with open(path, encoding="utf-8") as f:
                kept = json.load(f)
            if kept.get("format") == 1 and kept.get("text") == text:
                return kept["value"]
        except (OSError, ValueError, AttributeError, KeyError):
            pass
    value = safe_load(text)
    if os.geteuid() == 0 and os.path.isdir(os.path.dirname(DATA_CACHE)) and _same_as_json(value):
        try:
            os.makedirs(DATA_CACHE, mode=0o755, exist_ok=True)
            from spark_memsaver.host.fsutil import atomic_write
            atomic_write(path, json.dumps({"format": 1, "text": text, "value": value}), 0o644, durable=False)
        except OSError:
            pass   # best effort: the next run parses again
    return value
