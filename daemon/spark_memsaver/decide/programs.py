"""A program the way back needs is missing (observe/programs.py, the snapshot's ``programs_missing`` and
``dkms``): one finding per program, naming it and the Debian package that provides it. Pure."""

from __future__ import annotations

from spark_memsaver import remedy as rm

CODE = "program-missing"

_NEEDS = {"modprobe": "the load-time guard loads nvidia-uvm with it and a rollback reloads the stock module with it",
          "insmod": "the load-time guard loads the stock nvidia-uvm by path with it",
          "modinfo": "the load-time guard and every check of which nvidia-uvm is selected read modules with it",
          "depmod": "every removal (rollback, remove, the APT and dpkg hooks) selects the stock nvidia-uvm again "
                    "with it"}


def findings(snap) -> list[tuple[str, str, str, str]]:
    """(code, severity, message, remedy) for each missing program: kmod's are errors (the guard and the way back
    to the stock module stop without them); dkms while DKMS's tree still registers ours is a warning (a removal
    takes our files away and restores the stock module without it; DKMS's record of ours waits for it)."""
    out = []
    for p in snap.programs_missing:
        out.append((CODE, "error",
                    f"{p.name} is not installed (Debian package {p.package}): "
                    f"{_NEEDS.get(p.name, 'spark-memsaver runs it')}.",
                    f"{rm.run(f'apt-get install {p.package}')}."))
    regs = snap.dkms.registrations
    if not snap.dkms.available and regs:
        out.append((CODE, "warning",
                    "dkms is not installed (Debian package dkms) but its tree still registers our module ("
                    + ", ".join(sorted(r.version for r in regs)) + "): removals take our files away and select "
                    "the stock nvidia-uvm without it; DKMS's record of ours stays until dkms is back.",
                    f"{rm.run('apt-get install dkms')}."))
    return out
