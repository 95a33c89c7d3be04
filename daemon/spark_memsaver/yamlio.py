"""YAML reading for the product's files (config, manifest, hazards table): libyaml's C parser where PyYAML has
it (python3-yaml on Debian and Ubuntu does), PyYAML's pure-Python one otherwise. The same constructor and
resolver either way (safe types only), so the documents are the same; the C parser is ~20x faster.

``yaml`` is imported by the first call, not by importing this module.
"""

from __future__ import annotations

import re

# A text of blank lines and comments only is an empty YAML document (None) for either parser: say so without
# importing yaml (the shipped config file is all comments). YAML's line breaks are \n, \r, \x85, \u2028 and
# \u2029; a comment ends at any of them, and a tab or a byte-order mark leaves the decision to the parser.
_EMPTY = re.compile("(?: *(?:#[^\n\r\x85\u2028\u2029]*)?(?:\r\n|[\n\r\x85\u2028\u2029]))* *(?:#[^\n\r\x85\u2028\u2029]*)?")


def loader():
    """The safe loader class: ``yaml.CSafeLoader`` when libyaml is there, else ``yaml.SafeLoader``."""
    import yaml

    return getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def safe_load(text: str):
    """``yaml.safe_load(text)`` through the C parser when present; raises ``yaml.YAMLError`` as it does."""
    if _EMPTY.fullmatch(text):
        return None
    import yaml

    return yaml.load(text, Loader=loader())
