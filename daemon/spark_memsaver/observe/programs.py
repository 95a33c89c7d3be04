"""Which programs the safety paths run are not installed here: kmod's modprobe, modinfo and insmod (the load-time
guard and the reload after a rollback) and depmod (every removal refreshes the module selection with it). Looked up
as Host.run looks them up (host/runner.search_path), so status names the missing one and its Debian package
(decide/wayback.py) instead of a command failing later with a generic error. dkms is observe/snapshot's
``dkms.available``."""

from __future__ import annotations

from spark_memsaver.host import Host
from spark_memsaver.host.runner import PACKAGES

SAFETY = ("modprobe", "depmod", "modinfo", "insmod")


def missing(host: Host) -> list[dict]:
    """[{"name", "package"}] for each program of SAFETY this host cannot run, in SAFETY's order (the package:
    host/runner.PACKAGES, the one table)."""
    return [{"name": n, "package": PACKAGES[n]} for n in SAFETY if not host.runner.which(n)]
