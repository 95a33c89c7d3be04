"""What each installed build of ours was made with (reads only): the build records
(``/var/lib/spark-memsaver/builds/<kernel>.json``, host/records.py's "build" kind, written by act/records_io.py)
and, for a build made by 0.1.0 (no record), our rendered DKMS tree's spark-memsaver.json ("dkms-tree")."""

from __future__ import annotations

from spark_memsaver.host import paths, records


def read_builds(host) -> list[dict]:
    """Build records by kernel; one that is not a JSON object of strings is ignored (re-derived)."""
    return [{k: v for k, v in r.items() if k != "_path"} for r in records.read_dir(host, "build", [], paths.BUILDS)]


def dkms_meta(host, driver: str | None) -> dict | None:
    """Settings of a build made by 0.1.0 (no build record): our rendered DKMS tree's spark-memsaver.json."""
    if not driver:
        return None
    for name in host.listdir("/usr/src"):
        if name.startswith(f"spark-memsaver-uvm-{driver}-sm"):
            meta = records.one(host, "dkms-tree", f"/usr/src/{name}/spark-memsaver.json")
            if meta and meta.get("driver_version") == driver:
                return {"tier": meta.get("tier"), "kernels": meta.get("kernels_policy"), "from": "dkms-tree"}
    return None
