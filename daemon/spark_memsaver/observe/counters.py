"""Parse the patched nvidia-uvm's live counters (``/sys/module/nvidia_uvm/parameters/uvm_pt_pack_stats``).

The format is an interface, versioned by its first line ``format 1`` and specified in uvm_patch/README.md
("Counters interface", formats 1 and 2): one ``key value`` pair per line.
"""

from __future__ import annotations

SUPPORTED_FORMATS = (1, 2)
CLASSES = ("c256", "c4096")
CLASS_KEYS = ("tables", "pages", "backing_bytes", "stock_bytes", "saved_bytes")
TOTAL_KEYS = ("backing_bytes", "stock_bytes", "saved_bytes")
_TEXT_KEYS = ("tier", "unpacked_reason")


class CountersError(ValueError):
    pass


def parse_stats(text: str) -> dict:
    """Return a dict of the counters; raises CountersError on anything that is not format 1 or 2.

    Format 2 differs from 1 only in the tier tokens (``4k`` became ``4k-all``; ``leaf`` is new); the token is
    returned as the module printed it (decide/policy.normalize_tier maps the old one)."""
    kv: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) != 2:
            raise CountersError(f"line {n}: expected 'key value', got {line!r}")
        kv[parts[0]] = parts[1].strip()
    try:
        fmt = int(kv.get("format", ""))
    except ValueError:
        raise CountersError("missing or non-numeric 'format' line")
    if fmt not in SUPPORTED_FORMATS:
        raise CountersError(f"counters format {fmt} is newer than this spark-memsaver understands")
    out: dict = {"format": fmt}
    for key, value in kv.items():
        if key == "format":
            continue
        if key in _TEXT_KEYS:
            out[key] = value
            continue
        try:
            out[key] = int(value)
        except ValueError:
            raise CountersError(f"counter '{key}' is not an integer: {value!r}")
    for key in ("tier",) + TOTAL_KEYS:
        if key not in out:
            raise CountersError(f"counter '{key}' is missing")
    out["classes"] = {
        cls[1:]: {k: out.get(f"{cls}_{k}", 0) for k in CLASS_KEYS} for cls in CLASSES
    }
    return out
