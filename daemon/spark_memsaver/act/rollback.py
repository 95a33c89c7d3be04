"""Rollback: take our module away from a kernel (or every kernel where it is selected) and record why.

Called by act/executor.py under the "lifecycle" lock (op "rollback"). Moving toward stock is always safe:
it goes on when no record can be written, and says so (defect 4).
"""

from __future__ import annotations

from spark_memsaver.act import records_io as rio
from spark_memsaver.act import steps as st
from spark_memsaver.config import Config
from spark_memsaver.decide import plan as rc
from spark_memsaver.decide import ours
from spark_memsaver.errors import MemsaverError, UsageError
from spark_memsaver.host import Host
from spark_memsaver import world


def unknown_kernel(kernel: str) -> MemsaverError:
    return UsageError(f"kernel {kernel} is not installed (no /lib/modules/{kernel})",
                      remedy="List kernels with 'spark-memsaver status'.")


def _targets(snap, kernel: str | None) -> list:
    """The world's kernels (all, or ``kernel``) that select ours or have an installed build of ours."""
    from spark_memsaver.decide import ours
    regs = snap.dkms.registrations
    return [k for k in snap.kernels if (kernel is None or k.release == kernel)
            and (ours.is_ours(k.uvm_selected)
                 or any(b.kernel == k.release and b.installed for r in regs for b in r.builds))]


def reloads(snap, targets: list) -> bool:
    """Rollback ends with reloading nvidia-uvm when ours is loaded and either it took ours away from a kernel or
    the running kernel selects another nvidia-uvm already (ours loaded beside another driver, or removed while
    in use): then there is nothing selected to take away, and the reload is what goes back to stock."""
    uvm = snap.uvm
    running = next((k for k in snap.kernels if k.running), None)
    return bool(uvm.loaded and ours.is_ours(uvm)) and (bool(targets) or running is None
                                                  or not ours.is_ours(running.uvm_selected))


def rollback(host: Host, config: Config, reason: str = "requested by the administrator", progress=None, *,
             kernel: str | None = None, code: str = "requested", remedy: str = "",
             problems: list | None = None, snap=None) -> dict:
    """Take ours away from ``kernel`` (None: every kernel that has it), each under its intent, and record why.
    ``snap``: the operation's world when it is still the host's state (else observed here); each kernel's removal
    is planned before its first step (act/removal.remove_prepare)."""
    problems = [] if problems is None else problems
    snap = snap if snap is not None else world.snapshot(host, config)
    if kernel is not None and snap.kernel(kernel) is None:
        raise unknown_kernel(kernel)
    targets = _targets(snap, kernel)
    reload_after = reloads(snap, targets)      # decided from the same world, before anything changes
    done = []
    for k in targets:
        rel = k.release
        frm = rc.base_version(k.uvm_selected.version) if k.uvm_selected else None
        to = rc.base_version(k.nvidia_selected.version) if k.nvidia_selected else None
        try:
            prep = st.engine_override().remove_prepare(host, rel, False)
            with rio.safe_intent(host, "rollback", rel, removal=True, problems=problems, reason=reason, code=code,
                                 remedy=remedy, driver_from=frm, driver_to=to):
                st.remove(host, config, rel, progress, prep)
                if st.still_ours(host, rel):
                    raise st.StepFailed(f"kernel {rel}: our nvidia-uvm is still selected after removal")
                rio.write_rollback(host, rel, reason, problems, remedy=remedy, code=code, driver_from=frm,
                                   driver_to=to)
            done.append({"kernel": rel, "ok": True})
        except MemsaverError as e:
            done.append({"kernel": rel, "ok": False, "error": e.to_dict()})
    reload = None
    if reload_after:                   # the step its dry run plans (act/dryrun.py); reload_uvm itself skips it,
        reload = st.reload_uvm(host, progress)      # and says so, under a root prefix
    return {"ok": all(d["ok"] for d in done), "kernels": done, "reason": reason, "reload": reload,
            "nothing_to_do": not targets}
