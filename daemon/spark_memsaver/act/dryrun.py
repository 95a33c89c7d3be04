"""--dry-run of build, install, remove and rollback: the plan the real run follows, from the same decisions.

The real run (act/executor.py -> act/override.py, act/build.py, act/rollback.py) picks its kernels with
installable.targets, override.remove_targets / remove_plan and rollback._targets and refuses with
installable.require; the dry run calls those same
functions (nothing written, no lock, no fetch), so a dry run that names a kernel is a run that acts on it, and a
refusal is the same named error with the same remedy. Each step is ``{"action", "kernel", "reason"}``, the
shape reconcile's plan prints.
"""

from __future__ import annotations

from spark_memsaver.act import installable
from spark_memsaver.config import Config
from spark_memsaver.host import Host


def _step(action: str, kernel: str | None, reason: str) -> dict:
    return {"action": action, "kernel": kernel, "reason": reason}


def _built_version(host: Host, kernel: str) -> str | None:
    from spark_memsaver.observe.dkms import kernels_of, registered_versions
    return next((v for v in registered_versions(host) if kernel in kernels_of(host, v)), None)


def _install_steps(host: Host, config: Config, kernel: str, decision: dict) -> list[dict]:
    out = []
    if decision.get("needs_fetch"):
        f = decision.get("fetch") or {}
        out.append(_step("fetch-source", kernel, f"NVIDIA {f.get('driver')} source: apt-get download "
                         f"{f.get('package')}={f.get('deb_version')} into the source cache"))
    built = _built_version(host, kernel)
    out.append(_step("build", kernel, f"reuse spark-memsaver-uvm/{built} (already built)" if built else
                     "dkms build spark-memsaver-uvm for the installed nvidia.ko, signed with the DKMS key"))
    out += [_step("install", kernel, "dkms install: our nvidia-uvm under updates/dkms, the stock one recorded"),
            _step("depmod", kernel, "select ours over the driver package's"),
            _step("initramfs", kernel, "update-initramfs -u -k " + kernel),
            _step("verify", kernel, "modinfo -k: ours is the nvidia-uvm modprobe selects")]
    return out


def _remove_steps(host: Host, config: Config, kernel: str | None, all_kernels: bool) -> list[dict]:
    """act/executor._remove then act/override.remove, step for step: the hold, then for each kernel the one
    per-kernel plan (override.remove_plan) that the run executes -- the same for --kernel K and for --all."""
    from spark_memsaver.act import dkms_run, override
    k = None if all_kernels else (kernel or dkms_run.running_kernel(host))     # executor._target
    steps = [_step("hold", k, f"automation leaves {k or 'every kernel'} on the stock nvidia-uvm until "
                              "'sudo spark-memsaver install'")]
    prep = override.remove_prepare(host, k, all_kernels)       # what the run prepares before its first step
    for kk in prep["kernels"]:
        steps += prep["plans"][kk]
    if override.reloads_after(host, prep["kernels"]):
        steps.append(_step("reload-uvm", None, "load the stock nvidia-uvm when /dev/nvidia-uvm is unused "
                                               "(in use: at next boot)"))
    return steps


def build(host: Host, config: Config, kernel=None, force=False, all_kernels=False, **_) -> tuple[list, list]:
    """(steps, skipped) of ``build``: the fetch and the build install's plan would have; executor._build: --all is
    --kernel K for each kernel targets lets get ours."""
    from spark_memsaver.act import override
    skipped: list[dict] = []
    if all_kernels:
        decided, skipped = installable.targets(host, config, None, True, ignore=("secure-boot-unknown",))
    else:
        k = kernel or override.running_kernel(host)
        decided = [installable.require(host, config, k, ignore=("secure-boot-unknown",), fetch=False)]
    steps: list[dict] = []
    for d in decided:
        k = d["kernel"]
        own = [s for s in _install_steps(host, config, k, d) if s["action"] in ("fetch-source", "build")]
        if force and own[-1]["reason"].startswith("reuse"):
            own[-1] = _step("build", k, "rebuild (--force) although an identical build exists")
        steps += own
    return steps, skipped


def install(host: Host, config: Config, kernel=None, all_kernels=False, **_) -> tuple[list, list]:
    """(steps, skipped) of ``install``: the hold released, then each kernel's steps (executor._install's targets)."""
    from spark_memsaver.act import dkms_run
    from spark_memsaver.host import holds
    steps: list[dict] = []
    target = None if all_kernels else (kernel or dkms_run.running_kernel(host))     # executor._install's
    released = holds.releasable(host, target)
    if released:                   # executor._install ends the administrator's hold before it acts
        steps.append(_step("release-hold", target, "the administrator's hold ends (" + ", ".join(released)
                           + "): automation may act on it again"))
    decided, skipped = installable.targets(host, config, target, bool(all_kernels))    # executor._install's
    for d in decided:
        steps += _install_steps(host, config, d["kernel"], d)
    return steps, skipped


def remove(host: Host, config: Config, kernel=None, all_kernels=False, **_) -> tuple[list, list]:
    return _remove_steps(host, config, kernel, bool(all_kernels)), []


def rollback(host: Host, config: Config, kernel=None, reason=None, **_) -> tuple[list, list]:
    from spark_memsaver.act import rollback as rb
    from spark_memsaver import world
    snap = world.snapshot(host, config)
    targets = rb._targets(snap, kernel)
    steps: list[dict] = []
    for k in targets:
        steps += [_step("remove", k.release, "take our nvidia-uvm away; the stock one is selected"),
                  _step("record", k.release, f"rollback record: {reason or 'requested'} "
                                                "(automation never undoes it; 'install' does)")]
    if rb.reloads(snap, targets):         # act/rollback.rollback's own rule
        steps.append(_step("reload-uvm", None, "load the stock nvidia-uvm when /dev/nvidia-uvm is unused"))
    return steps, []


def plan(op: str, planner, host: Host, config: Config, **args) -> dict:
    """The dry-run document of ``op``: what the run recovers first, then ``planner``'s steps (one of the functions
    above: the executor's table names each operation's, act/executor.TABLE)."""
    steps, skipped = planner(host, config, **args)
    # what executor.perform recovers first (an interrupted operation, a record to set aside): the run does it
    # before the steps above, which are planned from the node as it is now
    from spark_memsaver.act import recovery
    first = [s.to_dict() for s in recovery.recovery_steps(recovery.plan_now(host, config, rebuild=False)[2])]
    return {"dry_run": True, "op": op, "steps": first + steps, "skipped": skipped, "ok": True,
            **({"recovery": len(first)} if first else {})}
