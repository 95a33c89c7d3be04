"""The product's data directories and the kotool loaded from one of them (host layer: observe/ and act/ use it).

``dkms_dir()``: dkms/ (templates, kotool, depmod.d, force file): $SPARK_MEMSAVER_DKMS_DIR, the checkout, or the
installed copy under /usr/share/spark-memsaver/dkms. ``kotool()``: dkms/spark-memsaver-kotool imported as a module
(the same code DKMS's PRE_INSTALL guard runs): the stdlib ELF/.modinfo reader observe/modules.py reads modules with.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from pathlib import Path

from spark_memsaver.errors import MemsaverError


class DataMissing(MemsaverError):
    code = "dkms-conf-invalid"
    remedy = "Reinstall spark-memsaver (sudo apt-get install --reinstall spark-memsaver)."


def dkms_dir() -> Path:
    env = os.environ.get("SPARK_MEMSAVER_DKMS_DIR")
    cands = ([Path(env)] if env else []) + [Path(__file__).resolve().parents[3] / "dkms",
                                             Path("/usr/share/spark-memsaver/dkms")]
    for c in cands:
        if (c / "templates" / "dkms.conf.j2").is_file():
            return c
    raise DataMissing("DKMS templates not found (looked in: " + ", ".join(map(str, cands)) + ")")


_KOTOOL = None


def kotool():
    """dkms/spark-memsaver-kotool imported as a module, once per process."""
    global _KOTOOL
    if _KOTOOL is None:
        path = dkms_dir() / "spark-memsaver-kotool"
        loader = importlib.machinery.SourceFileLoader("spark_memsaver_kotool", str(path))
        spec = importlib.util.spec_from_loader(loader.name, loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        _KOTOOL = mod
    return _KOTOOL
