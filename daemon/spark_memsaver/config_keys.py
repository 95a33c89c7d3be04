"""What each configuration key means, beside the code that gives its default (config.Config) and its check
(config._SCHEMA): the README's table and spark-memsaver(8)'s CONFIGURATION section are generated from here
(tools/gen-docs), so a default written in the documents is the default the code uses.

Text is Markdown-light: `code` and **bold** only (tools/gen-docs turns them into roff for the man page).
"""

from __future__ import annotations

from spark_memsaver.record import fields

from spark_memsaver.config import _SCHEMA, Config
from spark_memsaver import vocabulary as policy   # the tier/kernels vocabulary (decide/policy re-exports it)

MEANING = {
    "kernels": "`64k-only`: build for arm64 kernels with 64 KiB pages only (packing saves nothing with 4 KiB "
               "pages); `all`: every kernel with headers (testing)",
    "tier": "`leaf`: 256 B leaf tables of user trees in 4 KiB slots (the seed project's hardware-validated scope); "
            "`4k-all`: every non-root table incl. UVM's kernel tree, 4 KiB slots, opt-in, **not validated on "
            "hardware**; `256`: 256 B slots, opt-in, **not validated on hardware**; the old name `4k` means "
            "`4k-all`",
    "interval": "seconds between monitoring samples (5-86400)",
    "prometheus_textfile": "where the daemon writes the Prometheus exposition: unset (null) means node_exporter's "
                           "textfile directory `/var/lib/prometheus/node-exporter/spark-memsaver.prom` when that "
                           "directory exists; an absolute path; `off` for nowhere",
    "signing_key": "absolute path of the module-signing key; null means DKMS's configured key",
    "signing_cert": "absolute path of the module-signing certificate; null means DKMS's configured certificate",
    "auto_build": "build automatically when a supported driver appears (daemon, package installation, hooks); "
                  "`false`: the hooks only keep the node safe, they never build",
    "history_size": "samples the daemon holds in memory for D-Bus `GetHistory`/`GetHistorySince` (10-100000); the "
                    "on-disk history `spark-memsaver history` reads (`/var/lib/spark-memsaver/history`) is kept 7 "
                    "days at the interval, whatever this says",
    "source_fetch": "driver source missing (precompiled modules): `auto` downloads exactly that version with "
                    "`apt-get download` into `/var/cache/spark-memsaver/sources` (SHA256 from APT's lists, nothing "
                    "installed, only installed drivers' sources kept); `never`: `status` names the exact "
                    "`apt-get install <pkg>=<version>`",
    "memory_floor": "`off`, or a size such as `8G`: the daemon registers a PSI trigger on `/proc/pressure/memory` "
                    "(woken only under pressure, no timer) and, when it fires with MemFree below the floor, reclaims "
                    "up to the floor (as `reclaim --need`, at most once a minute; each action one line in the "
                    "journal); costs page-cache hits (docs/memory.md); read at daemon start",
}


def default_text(key: str) -> str:
    v = getattr(Config(), key)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def keys() -> list[dict]:
    """Every key of the file, in Config's order: name, default (as YAML writes it), meaning, accepted values."""
    out = []
    for name in fields(Config):
        if name not in _SCHEMA:
            continue                 # source, notes: not keys of the file
        out.append({"key": name, "default": default_text(name), "meaning": MEANING[name],
                    "expected": _SCHEMA[name][2]})
    return out


assert policy.DEFAULT_TIER == Config().tier
