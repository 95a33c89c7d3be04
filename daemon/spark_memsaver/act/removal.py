"""What ``remove`` does, decided before its first step: the kernels it acts on (:func:`remove_targets`), each
kernel's plan step for step (:func:`remove_plan`: what the run executes and the dry run prints), whether ours is
reloaded after (:func:`reloads_after`), all of it read once (:func:`remove_prepare`: the executor's, the reconcile
step's and the dry run's). act/override.remove executes it; reads only."""

from __future__ import annotations

import re

from spark_memsaver.act.dkms_errors import DkmsMissing
from spark_memsaver.act.dkms_run import _SUFFIXES, dkms_present, dkms_version, running_kernel
from spark_memsaver.decide.ours import built_here, is_ours
from spark_memsaver.host import Host, paths, records
from spark_memsaver.observe import modules
from spark_memsaver.observe.dkms import DKMS_TREE, PACKAGE, built_module, installed_version, kernels_of, registered_versions


def _stock_record(host: Host, kernel: str) -> dict | None:
    """The stock record, typed (host/records.py), or None when absent or bad."""
    return records.one(host, "stock", paths.stock_record(kernel))


def remove_targets(host: Host, kernel: str | None, all_kernels: bool) -> list[str]:
    """The kernels ``remove`` acts on: the one named (default: the running one), or with --all every installed
    kernel and every kernel DKMS still keeps something of ours for (a kernel whose /lib/modules is gone)."""
    if kernel and all_kernels:
        from spark_memsaver.errors import UsageError
        raise UsageError("--kernel and --all exclude each other", remedy="Give one of them.")
    if not all_kernels:
        return [kernel or running_kernel(host)]
    from spark_memsaver.observe.snapshot import installed_kernels
    ks = set(installed_kernels(host))
    for ver in registered_versions(host):
        ks.update(kernels_of(host, ver))
    for link in host.path(f"{DKMS_TREE}/{PACKAGE}").glob("kernel-*"):
        ks.add(re.sub(r"-[^-]+$", "", link.name[len("kernel-"):]))
    return sorted(ks)


def reloads_after(host: Host, kernels: list[str]) -> bool:
    """Whether taking ours away from ``kernels`` ends with reloading nvidia-uvm: ours is loaded and the running
    kernel is one of them (act/executor._remove runs act/steps.reload_uvm; the dry run plans "reload-uvm")."""
    from spark_memsaver.observe.snapshot import observe_uvm
    uvm = observe_uvm(host)
    return bool(uvm.get("loaded") and is_ours(uvm)) and running_kernel(host) in kernels


def _leftovers(host: Host, kernel: str) -> list[str]:
    """Copies of ours at our install path that DKMS does not account for (installed by hand, DKMS's tree lost):
    those restore_stock takes away (decide/ours.built_here, the same owner)."""
    return [paths.dkms_installed(kernel, s) for s in _SUFFIXES if host.path(paths.dkms_installed(kernel, s)).is_file()
            and built_here(modules.read_file(host, paths.dkms_installed(kernel, s)))]


def has_dkms(host: Host) -> bool:
    """dkms runs here (remove then uninstalls and unbuilds through it; without it, our files still go): the
    engine asks it for its version, its first dkms run. The plan (:func:`remove_prepare`) only looks for it."""
    try:
        dkms_version(host)
        return True
    except DkmsMissing:
        return False


def remove_plan(host: Host, kernel: str, have_dkms: bool = True) -> list[dict]:
    """What ``remove`` does for ONE kernel, step for step ({"action", "kernel", "reason"}, DKMS's steps with
    "version"): the plan the run executes (:func:`remove`) and the dry run prints (act/dryrun.py), for
    --kernel K and for each kernel of --all alike."""
    def step(action, reason, **kw):
        return {"action": action, "kernel": kernel, "reason": reason, **kw}
    out = []
    versions = registered_versions(host) if have_dkms else []
    inst = installed_version(host, kernel) if versions else None
    for v in versions:
        if inst == v:
            out.append(step("uninstall", f"dkms uninstall {PACKAGE}/{v}", version=v))
        if kernel in kernels_of(host, v):
            out.append(step("unbuild", f"dkms unbuild {PACKAGE}/{v}", version=v))
    rec = _stock_record(host, kernel)
    left = _leftovers(host, kernel)
    if not out and not rec and not left and not host.exists(paths.legacy_stock_record(kernel)):
        return [step("restore-stock", "nothing of ours is registered: any copy of ours left goes"),
                step("depmod", "select the stock nvidia-uvm again; verify it is selected")]
    why = ("the recorded stock nvidia-uvm back where the driver package put it, checked by SHA-256" if rec else
           "no stock record: any copy of ours left goes")
    if left:
        why += "; our copy not registered in DKMS goes: " + ", ".join(left)
    return out + [step("restore-stock", why), step("depmod", "select the stock nvidia-uvm again; verify it is selected"),
                  step("initramfs", "update-initramfs -u -k " + kernel)]


def remove_prepare(host: Host, kernel: str | None, all_kernels: bool, have_dkms: bool | None = None) -> dict:
    """What ``remove`` does, read before its first step (the executor's, the reconcile step's and the dry run's):
    {"have_dkms", "registered", "kernels" (remove_targets), "plans" {kernel: remove_plan}, "built" {(version,
    kernel): DKMS's built module}}. Whether ours is reloaded after is the caller's (:func:`reloads_after`: remove
    and its dry run ask; the reconcile and APT doors' removals never do, and never fail on it)."""
    from spark_memsaver.world import refresh
    if have_dkms is None:            # toward stock never waits for dkms: our files go, the stock one is restored
        have_dkms = dkms_present(host)
    kernels = remove_targets(host, kernel, all_kernels)
    tree = refresh.dkms(host) if have_dkms else {"registered": [], "kernels": {}}
    plans = {k: remove_plan(host, k, have_dkms) for k in kernels}
    built = {(s["version"], k): built_module(host, s["version"], k) for k, p in plans.items() for s in p
             if s["action"] == "uninstall"}
    return {"have_dkms": have_dkms, "registered": tree["registered"], "kernels": kernels, "plans": plans,
            "built": built}
