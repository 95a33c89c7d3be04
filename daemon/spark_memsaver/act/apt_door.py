"""APT's DPkg::Pre-Install-Pkgs door: remove our override before dpkg unpacks a different NVIDIA driver.

Called by act/executor.py (op "apt-pre-install") under the "lifecycle" lock, so it never interleaves with
a build or install. The removals go on when no record can be written (defect 4): in this door a failed
record must never leave the override in place across a driver upgrade.
"""

from __future__ import annotations

from spark_memsaver.act import records_io as rio
from spark_memsaver.act import steps as st
from spark_memsaver.config import Config
from spark_memsaver.decide import plan as rc
from spark_memsaver.host import Host, intents
from spark_memsaver.observe import snapshot as observe


def changes(text: str) -> list[dict]:
    """The NVIDIA driver packages APT is about to change (parse errors are HookInputError)."""
    return rc.driver_changes(rc.parse_apt_hook(text))


def pre_install(host: Host, config: Config, chg: list[dict], progress=None, problems: list | None = None) -> dict:
    problems = [] if problems is None else problems
    snap = observe.snapshot(host)
    steps = rc.pre_install_plan(snap, chg)
    results = st.execute(host, config, steps, snap, progress, problems)
    # what the system looked like when we acted: proves the removal came before dpkg unpacked
    intents.append_history(host, {"event": "apt-pre-install", "time": intents.now(),
                                  "packages": [f"{c['name']} {c['old'] or '-'} -> {c['new'] or '-'}" for c in chg],
                                  "sources_seen": sorted(s["version"] for s in snap["driver"]["sources"]),
                                  "removed": [s.kernel for s, r in zip(steps, results) if r.get("ok")]})
    for s, r in zip(steps, results):
        if r.get("ok"):
            # say why in status even if the post step never runs (e.g. the upgrade is aborted)
            rio.write_rollback(host, s.kernel, s.reason, problems, code="driver-changing",
                               remedy="spark-memsaver rebuilds for the new driver after the upgrade when it is "
                               "supported.", driver_from=s.driver_from, driver_to=s.driver_to)
    return {"ok": all(r.get("ok") for r in results), "changes": chg, "steps": results}
