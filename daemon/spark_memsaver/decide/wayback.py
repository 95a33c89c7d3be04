"""What the way back to the stock nvidia-uvm needs, named by status (decide/status.py, section 1c). Pure.

- A program it runs is missing (observe/programs.py: the world's ``programs_missing``; ``dkms``): one finding per
  program, naming it and the Debian package that provides it.
- The module kmod selects for a kernel cannot be read (``uvm_selected.state`` unreadable: its index names a file
  that is gone or damaged, e.g. after a removal stopped before depmod): the load-time guard never loads it, and
  status does not call it stock without saying so.
"""

from __future__ import annotations

from spark_memsaver import remedy as rm

CODE = "program-missing"
UNREADABLE = "selection-unreadable"

_NEEDS = {"modprobe": "the load-time guard loads nvidia-uvm with it and a rollback reloads the stock module with it",
          "insmod": "the load-time guard loads the stock nvidia-uvm by path with it",
          "modinfo": "the load-time guard and every check of which nvidia-uvm is selected read modules with it",
          "depmod": "every removal (rollback, remove, the APT and dpkg hooks) selects the stock nvidia-uvm again "
                    "with it"}


def findings(snap) -> list[tuple]:
    """(code, severity, message, remedy[, kernel]): kmod's programs missing are errors (the guard and the way back
    stop without them); dkms missing while DKMS's tree still registers ours is a warning (a removal takes our files
    away and restores the stock module without it; DKMS's record of ours waits for it); an unreadable selection is
    a warning."""
    out: list[tuple] = []
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
    interrupted = {i.get("kernel") for i in snap.records.intents}
    for k in snap.kernels:
        sel = k.uvm_selected
        if sel is None or sel.state != "unreadable":
            continue
        fix = (f"{rm.run('spark-memsaver reconcile')}: it finishes the interrupted operation, which rebuilds the "
               "module index." if k.release in interrupted or None in interrupted else
               f"{rm.run(f'depmod -a {k.release}')} to rebuild the module index.")
        out.append((UNREADABLE, "warning",
                    f"The nvidia-uvm module loading selects for {k.release} cannot be read ({sel.error or 'unknown'}"
                    "): its module index names a file that is gone or damaged. The load-time guard never loads it "
                    "(it loads the verified stock module by path, or refuses).", fix, k.release))
    return out
