"""Activate: load our installed nvidia-uvm in place of the loaded stock one, if nothing uses the device.

Called by act/executor.py (op "activate"; under the "lifecycle" lock unless it is a dry run). Never forced:
with holders it says "at next boot"; a loaded nvidia of another driver version refuses.
"""

from __future__ import annotations

from spark_memsaver.act import records_io as rio
from spark_memsaver.act import steps as st
from spark_memsaver.config import Config
from spark_memsaver.decide import plan as rc
from spark_memsaver.errors import EXIT_FAILED, MemsaverError, SafetyRefusal
from spark_memsaver.host import Host
from spark_memsaver.observe import snapshot as observe
from spark_memsaver import world

UVM_DEVICE = "/dev/nvidia-uvm"


class ActivationRefused(SafetyRefusal):
    code = "activation-refused"
    remedy = "Run 'spark-memsaver status' to see what is selected and loaded."


class ActivationFailed(MemsaverError):
    code = "activation-failed"
    exit_code = EXIT_FAILED
    remedy = ("The guard loads a safe nvidia-uvm on the next 'sudo modprobe nvidia_uvm' or at boot; "
              "run 'spark-memsaver status' and the kernel log (journalctl -k) for the reason.")


def _install_first(host: Host, config: Config, rel: str) -> str:
    """The remedy when ours is not selected: install, if install would proceed (decide/installability.py),
    else what install is missing, so the remedy never names a command that would be refused."""
    try:
        from spark_memsaver.act import installable
        from spark_memsaver.decide.installability import installability
        snap, support = installable.observe(host, config)
        d = installability(snap, config, support, rel)
    except Exception:   # the remedy must never hide the refusal itself
        return "See 'spark-memsaver status' for what installing needs on this kernel."
    if d["can_install"]:
        return f"Run 'sudo spark-memsaver install --kernel {rel}' first."
    first = d["missing"][0]
    return f"Installing is not possible yet ({first['detail']}): {first['remedy']}"


def secure_boot_allows(sb: dict) -> None:
    """Refuse (also a dry run) unless the kernel will take a module signed by our key: before enrollment a
    reload would only make the guard fall back to stock; the remedy is the enrollment path, in order."""
    from spark_memsaver.decide import mok as dm
    state = sb.get("state") or "unknown"
    if state == "unknown":
        raise ActivationRefused("the Secure Boot / MOK state cannot be read (" + (sb.get("reason") or "not observed")
                                + "): whether the kernel would take our module is not known",
                                remedy=sb.get("remedy") or None)
    if not dm.state_loadable(state):
        from spark_memsaver.decide.installability import key_phrase     # status's own sentence for the state
        raise ActivationRefused(f"Secure Boot is enforcing and {key_phrase(state)}: the "
                                "kernel would refuse our module, so the stock nvidia-uvm stays loaded",
                                remedy=dm.enrollment_remedy(sb))
    if (sb.get("kernel") or {}).get("trusted_by_kernel") == "no" and sb.get("efi") and sb.get("secure_boot"):
        raise ActivationRefused("the firmware has our signing key enrolled but the running kernel does not trust "
                                "it (" + (sb["kernel"].get("trust_reason") or "not in its keyrings") + ")",
                                remedy=dm.KERNEL_DISTRUST_REMEDY)


def activate(host: Host, config: Config, progress=None, *, uvm_device: str = UVM_DEVICE,
             proc_host: Host | None = None, dry_run: bool = False) -> dict:
    from spark_memsaver.decide import ours
    snap = world.snapshot(host, config)
    rel = snap.host.kernel
    k = snap.kernel(rel)
    sel = k.uvm_selected if k else None
    if not ours.is_ours(sel):
        raise ActivationRefused(f"our nvidia-uvm is not selected for the running kernel {rel} "
                                f"(selected: {(sel.path if sel else None) or 'none'})",
                                remedy=_install_first(host, config, rel))
    secure_boot_allows(snap.secure_boot if isinstance(snap.secure_boot, dict) else {})
    drv = rc.base_version(sel.version)
    loaded_nv = rc.base_version(snap.driver.loaded_version)
    disk_nv = rc.base_version(k.nvidia_selected.version) if k.nvidia_selected else None
    if loaded_nv and loaded_nv != drv:
        if disk_nv and disk_nv == drv:
            # the driver on disk is newer than the running one and ours is built for it: a reboot loads both
            remedy = (f"Reboot: nvidia.ko {disk_nv} on disk (and our nvidia-uvm for it) loads at boot in place "
                      f"of the running {loaded_nv}.")
        else:
            # ours is stale (built for a driver that is neither running nor on disk): rebuild, never reboot
            remedy = (f"Run 'sudo spark-memsaver reconcile': it removes our nvidia-uvm built for {drv} and "
                      f"rebuilds it for the installed driver {disk_nv or loaded_nv}; then run "
                      "'sudo spark-memsaver activate'.")
        raise ActivationRefused(f"the loaded nvidia is {loaded_nv} but our nvidia-uvm is built for {drv}",
                                remedy=remedy)
    uvm = snap.uvm
    if uvm.loaded and uvm.srcversion and uvm.srcversion == sel.srcversion:
        from spark_memsaver.decide.packing import packing_active
        # loaded is not packing: inactive (uvm_pt_pack=0, a GPU that does not qualify) is no "active"
        return {"activated": True, "already": True, "srcversion": uvm.srcversion, "path": sel.path,
                "packing": packing_active(uvm.as_json())}
    holders = observe.uvm_holders(proc_host or host, uvm_device)
    if holders:
        names = ", ".join(f"{h['comm']}[{h['pid']}]" for h in holders)
        return {"activated": False, "at_next_boot": True, "holders": holders,
                "message": f"{uvm_device} is in use by {names}; our module is selected and will be loaded at "
                           "next boot (or run 'sudo spark-memsaver activate' again after those processes exit)."}
    cmds = []
    if uvm.loaded:
        cmds.append(["modprobe", "-r", "nvidia_uvm"])
    cmds.append(["modprobe", "nvidia_uvm"])
    if dry_run or not host.is_live:
        return {"activated": False, "dry_run": True, "would_run": cmds, "expect_srcversion": sel.srcversion}
    # an unload without a reload would leave no nvidia-uvm: the intent lets reconcile load one after a kill
    with rio.safe_intent(host, "activate", rel, removal=False, srcversion=sel.srcversion):
        for argv in cmds:
            st.say(progress, "running " + " ".join(argv))
            r = host.run(argv, timeout=120)
            if not r.ok:
                raise ActivationFailed(f"'{' '.join(argv)}' failed: {(r.stderr or r.stdout).strip()[-300:]}")
        loaded = (host.read_text("/sys/module/nvidia_uvm/srcversion") or "").strip()
        if loaded != sel.srcversion:
            raise ActivationFailed(f"after loading, /sys/module/nvidia_uvm/srcversion is {loaded or 'absent'}, "
                                   f"not {sel.srcversion} of {sel.path}")
    return {"activated": True, "srcversion": loaded, "path": sel.path}
