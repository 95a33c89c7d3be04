"""Decide: a pure function from the world (model.World) + config to a state and findings. No I/O here."""

from __future__ import annotations

import re

from spark_memsaver.config import Config
from spark_memsaver.decide import policy
from spark_memsaver.decide.policy import kernel_in_policy  # noqa: F401  (the one policy; old import path)
from spark_memsaver.decide.policy import verdict as policy_verdict
from spark_memsaver.decide.hazards import findings_from_inputs
from spark_memsaver.decide import hold as holds
from spark_memsaver.decide import ours
from spark_memsaver.decide import installability as inst_mod
from spark_memsaver import remedy as rm
from spark_memsaver.decide import mok as mok_decide
from spark_memsaver.decide import wayback
from spark_memsaver.decide.findings import SEVERITIES, Finding, Verdict, needs_first  # noqa: F401  (their home)
from spark_memsaver.decide.sbfindings import other_key_finding, secure_boot_findings  # noqa: F401

STATES = ("not-applicable", "stock", "built", "installed", "active", "inactive",
          "rolled-back", "needs-attention", "unverified")


def config_changed(snap, config: Config, support: dict | None = None) -> list[Finding]:
    """A kernel whose installed build was made with another tier or kernel policy than the config's now."""
    from spark_memsaver.decide.plan import build_record, rebuild_command
    out = []
    for k in snap.kernels:
        if not ours.is_ours(k.uvm_selected):
            continue
        diff = policy.settings_changed(build_record(snap, k.release), config)
        if not diff:
            continue
        ok, why = kernel_in_policy(k, config)
        if config.auto_build:
            auto, cmd = "spark-memsaverd does it by itself (auto_build: true); to do it now: ", \
                rm.sm("reconcile")
        else:
            auto = ""
            cmd = rebuild_command(k.release) if ok else rm.sm(f"remove --kernel {k.release}")
            missing = inst_mod.installability(snap, config, support, k.release)["missing"] if ok else []
            if missing:      # the rebuild would be refused: what it needs first (the same remedy install gives)
                cmd = f"{missing[0]['remedy'].rstrip('.')}; then: {cmd}"
        out.append(Finding("config-changed", "warning",
                           f"The installed nvidia-uvm for kernel {k.release} was built with other settings than "
                           f"the configuration's now ({', '.join(diff)})"
                           + ("" if ok else f"; {why}") + ": editing config.yaml alone changes nothing.",
                           f"{auto}{cmd}", k.release))
    return out


def _running(snap):
    for k in snap.kernels:
        if k.running:
            return k
    return None


def driver_present(snap) -> bool:
    if snap.driver.loaded_version or snap.driver.sources:
        return True
    return any(k.nvidia_selected and k.nvidia_selected.path for k in snap.kernels)


# Missing pieces said by their own sections below (one finding per piece, never two).
_SAID_ELSEWHERE = ("kernel-outside-policy", "headers-missing", "secure-boot-unknown")


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def install_findings(decision: dict) -> list[Finding]:
    """One finding per piece the running kernel lacks for an install (decide/installability.py): the same
    code and remedy an 'install' refused for it gives."""
    k = decision["kernel"]
    out = [Finding(m["code"], "warning", _cap(m["detail"]), m["remedy"], k)
           for m in decision["missing"] if m["code"] not in _SAID_ELSEWHERE]
    f = decision.get("fetch") if decision.get("needs_fetch") and decision["can_install"] else None
    if f:
        what = " ".join(x for x in (f.get("package"), f.get("deb_version")) if x)
        out.append(Finding("driver-source-fetchable", "info",
                           f"The NVIDIA open kernel-module source of {f['driver']} is not on this host; APT offers "
                           f"it ({what}): installing fetches it into /var/cache/spark-memsaver/sources first.",
                           f"Nothing to do: '{rm.sm('install')}' (or spark-memsaverd, with auto_build) fetches "
                           "it.", k))
    return out


def install_advice(decision: dict | None) -> tuple[str, str]:
    """(message, remedy) of the 'stock' finding: install is recommended only when it would proceed."""
    if decision is None:
        return ("The stock nvidia-uvm is selected.",
                "Nothing runs under this root: run 'spark-memsaver status' on the booted node to see whether "
                "it can be installed.")
    if decision["can_install"]:
        remedy = "Run 'sudo spark-memsaver install' to build and install the packing module"
        if decision.get("needs_fetch"):
            remedy += " (it fetches the NVIDIA source first)"
        for t in decision.get("then") or []:
            remedy += "; then " + inst_mod.ENROLL if t["code"] in ("mok-no-key", "mok-not-enrolled") \
                else "; " + t["remedy"][:1].lower() + t["remedy"][1:].rstrip(".")
        return "The stock nvidia-uvm is selected.", remedy + "."
    names = ", ".join(m["code"] for m in decision["missing"])
    return (f"The stock nvidia-uvm is selected; kernel {decision['kernel']} cannot get ours yet ({names}).",
            f"Nothing is broken: the stock nvidia-uvm is in use. Packing needs what the findings above name "
            f"first ({names}); each says how.")


def reload_remedy(holders) -> str:
    """loaded-driver-mismatch: reconcile reloads nvidia-uvm (the guard then loads the module built for the loaded
    driver) and holds nothing; rollback would hold the kernel on stock for good, which this state does not ask."""
    cmd = rm.run("spark-memsaver reconcile")
    if not holders:
        return (f"{cmd}: nothing uses /dev/nvidia-uvm, so it reloads nvidia-uvm (the guard loads the module "
                "built for the loaded driver); or reboot.")
    who = ", ".join(f"{h.comm}[{h.pid}]" for h in holders)
    return f"Stop the CUDA work using /dev/nvidia-uvm ({who}), then {cmd[:1].lower()}{cmd[1:]}; or reboot."


def evaluate(snap, config: Config, support: dict | None = None) -> Verdict:
    """``snap``: the world (model.World: world.facts). ``support``: the manifest's verdict per driver version
    (world/support.support_for); None when the caller has not consulted the manifest (the manifest check is then
    left out of the install advice)."""
    f: list[Finding] = []
    host = snap.host
    uvm = snap.uvm
    sb = snap.secure_boot if isinstance(snap.secure_boot, dict) else {}
    records = snap.records
    running = _running(snap)
    # the running kernel (also one whose /lib/modules is gone: unknown-kernel); None under an image root
    rk = running.release if running else host.kernel
    decision = inst_mod.installability(snap, config, support, rk) if rk else None

    # 0. A configuration file that cannot be used (config.load_for_safety): one finding, file and line; the
    #    built-in defaults stand in for what safety needs, and nothing is built until it is fixed.
    bad = getattr(config, "invalid", None)
    if bad:
        f.append(Finding("config-invalid", "warning",
                         f"{bad.get('message')}. The built-in defaults are in force for what safety needs "
                         "(removals, rollbacks, status); nothing is built or installed until the file is fixed.",
                         bad.get("remedy") or "Fix the file or remove it to use the defaults."))
    # 0b. Configuration notes (an old name still read).
    for note in getattr(config, "notes", ()) or ():
        f.append(Finding("config-renamed", "info", note[0].upper() + note[1:] + ".",
                         "Nothing to do; write the new name in the file to silence this note."))

    # 1. Nothing to do without an NVIDIA driver.
    if not driver_present(snap):
        f.append(Finding("no-nvidia-driver", "info",
                         "No NVIDIA driver is installed or loaded on this host, so there is no nvidia-uvm to patch.",
                         "Nothing to do. Install the NVIDIA open driver first if this node has an NVIDIA GPU."))
        return Verdict("not-applicable", f)

    # 1b. Known faults of the NVIDIA driver around our module (uvm_patch/hazards.yaml): shown on every
    #     path below, including not-applicable.
    f.extend(Finding(**x) for x in findings_from_inputs(snap.hazard_inputs))
    f.extend(Finding(*x) for x in wayback.findings(snap))   # 1c. what the way back needs (decide/wayback.py)

    # 2. Safety first: a patched module selected or loaded beside a different driver's nvidia.ko.
    mismatch = False
    for k in snap.kernels:
        if ours.driver_mismatch(k):           # the one predicate (decide/ours.py), as the planner's
            mismatch = True
            f.append(Finding("override-driver-mismatch", "error",
                             f"Our nvidia-uvm {k.uvm_selected.version} is selected for kernel {k.release} beside "
                             f"nvidia.ko {k.nvidia_selected.version}; the load-time guard will load the stock module "
                             "instead.",
                             f"{rm.run('spark-memsaver reconcile')} (or '{rm.RESTART_DAEMON}') to remove the stale "
                             "override and rebuild for the installed driver.", k.release))
    loaded_nv = snap.driver.loaded_version
    if ours.loaded_mismatch(uvm, loaded_nv):
        mismatch = True
        f.append(Finding("loaded-driver-mismatch", "error",
                         f"The loaded nvidia-uvm is ours for {uvm.version} but nvidia {loaded_nv} is loaded.",
                         reload_remedy(snap.holders)))

    # 2b. A build made with other settings than the config's now.
    f.extend(config_changed(snap, config, support))

    # 3. Interrupted operations.
    for intent in records.intents:
        f.append(Finding("operation-interrupted", "warning",
                         f"An interrupted '{intent.get('op', '?')}' operation was found "
                         f"(started {intent.get('started', '?')}).",
                         f"spark-memsaverd finishes or undoes it at start; or run '{rm.sm('reconcile')}'.",
                         intent.get("kernel")))
    for path in records.unreadable:
        f.append(Finding("state-record-unreadable", "warning", f"State record {path} is not valid JSON.",
                         f"{rm.run('spark-memsaver reconcile')}; it re-derives state from the system and rewrites it."))
    for q in records.quarantined:
        aside = f" and was set aside as {q['moved_to']}" if q.get("moved_to") else ""
        f.append(Finding("record-quarantined", "warning",
                         f"State record {q['path']} ({q.get('kind', '?')}) is not trusted: {q.get('reason', '?')}"
                         f"{aside}.",
                         "Nothing else is affected: spark-memsaver re-derives the state from the system; look at "
                         "the file set aside, then delete it." if q.get("moved_to") else
                         "Nothing else is affected: spark-memsaver re-derives the state from the system. "
                         "spark-memsaverd's next reconcile sets it aside (as <name>.bad-<time>), or now: "
                         "'sudo spark-memsaver reconcile'."))

    # 4. Secure Boot.
    sb_state = sb.get("state", "unknown")
    if sb_state == "unknown":
        f.append(Finding("secure-boot-unknown", "warning",
                         "Secure Boot / MOK state could not be read: " + (sb.get("reason") or "unknown reason") + ".",
                         inst_mod.secure_boot_unknown_remedy(sb)))
    other = other_key_finding(snap, sb, sb_state)      # ours signed with another key: rebuild before enrolling
    if other is not None:
        other = Finding(other.code, other.severity, other.message, needs_first(decision, other.remedy), other.kernel)
        f.append(other)
    if sb_state != "unknown" and not mok_decide.state_loadable(sb_state) and sb_state:
        why = f" ({sb['reason']})" if sb.get("reason") else ""
        remedy = sb.get("remedy") or "Run 'sudo spark-memsaver mok enroll' and confirm the key at the console on next boot."
        if sb_state == "not-enrolled" and decision is not None and not (running and ours.is_ours(running.uvm_selected)):
            pair = [m["remedy"] for m in decision["missing"] if m["code"] == "signing-key-incomplete"]
            if decision["can_install"]:           # nothing of ours yet: install's own order (install, then enroll)
                remedy = install_advice(decision)[1]
            elif pair:                            # the key to sign with first: enrolling a certificate alone signs nothing
                remedy = f"{pair[0]} Then 'spark-memsaver status' names the next step (install, then enrolling the key)."
        f.append(Finding(f"mok-{sb_state}", "warning",
                         f"Secure Boot is enforcing and {inst_mod.key_phrase(sb_state)}{why}: "
                         "a module we sign will not load until the key is enrolled.", needs_first(decision, remedy)))

    # 4b. The kernel refused our module at the last load (the guard loaded stock) or does not trust our key.
    f.extend(secure_boot_findings(snap, sb, sb_state))

    # 5. Policy for the running kernel.
    ours_selected = bool(running and ours.is_ours(running.uvm_selected))
    if running is None and decision is not None:
        f.extend(install_findings(decision))
    if running is not None:
        pv = policy_verdict(running, config)
        if not pv.ok and not ours_selected and not (uvm.loaded and ours.is_ours(uvm)):
            f.append(Finding("kernel-outside-policy", "info", pv.why.capitalize() + ".",
                             inst_mod.policy_remedy(config, pv), running.release))
            if host.page_size != 65536 and config.kernels == "64k-only":
                return Verdict("needs-attention" if mismatch else "not-applicable", f)
        if not running.headers:
            f.append(Finding("headers-missing", "warning" if pv.ok else "info",
                             f"Kernel headers for {running.release} are not installed; nothing can be built for it.",
                             f"sudo apt-get install linux-headers-{running.release}", running.release))
        if not ours_selected:
            f.extend(install_findings(decision))
    for k in snap.kernels:
        if k.running:
            continue
        ok, _ = kernel_in_policy(k, config)
        if ok and not k.headers:
            f.append(Finding("headers-missing", "info",
                             f"Kernel headers for {k.release} are not installed; it stays stock.",
                             f"sudo apt-get install linux-headers-{k.release}", k.release))

    if mismatch:
        return Verdict("needs-attention", f)

    # 6. Loaded module.
    if uvm.loaded and ours.is_ours(uvm):
        if running is not None and not ours_selected:
            # removed or rolled back while /dev/nvidia-uvm was in use: ours keeps packing until it is unloaded
            hold = holds.held(records, rk) if rk else None
            f.append(Finding("ours-loaded-stock-selected", "info",
                             f"Our nvidia-uvm is still loaded, but it is no longer selected for kernel {rk}"
                             + (f" ({holds.origin(hold)})" if hold else "")
                             + ": the selected module takes its place when nvidia-uvm is next loaded.",
                             "Reload nvidia-uvm while no CUDA work runs: 'sudo modprobe -r nvidia_uvm && sudo "
                             "modprobe nvidia_uvm', or reboot.", rk))
        packing = uvm.packing or {}
        if "error" in packing or not packing:
            from spark_memsaver.decide.plan import rebuild_command
            f.append(Finding("counters-unreadable", "warning",
                             "Our nvidia-uvm is loaded but its counters could not be read: "
                             + packing.get("error", "missing") + ".",
                             "Our loaded module and this spark-memsaver disagree on the counters' format: update "
                             "spark-memsaver ('sudo apt-get install --only-upgrade spark-memsaver'), or rebuild our "
                             "module from this version: "
                             + (f"'{rebuild_command(rk)}'" if rk else f"'{rm.sm('reconcile')}'")
                             + ", then reload nvidia-uvm while no CUDA work runs ('sudo modprobe -r nvidia_uvm && "
                             "sudo modprobe nvidia_uvm') or reboot.", rk))
            return Verdict("needs-attention", f)
        if packing.get("tier") == "off":
            f.append(Finding("packing-disabled", "info", "Our nvidia-uvm is loaded with packing turned off "
                             "(uvm_pt_pack=0).",
                             "Remove uvm_pt_pack=0 where it is set (an 'options nvidia_uvm' line under "
                             "/etc/modprobe.d/, "
                             "or nvidia_uvm.uvm_pt_pack=0 on the kernel command line), then reboot, or reload "
                             "nvidia-uvm while no CUDA work runs: 'sudo modprobe -r nvidia_uvm && sudo modprobe "
                             "nvidia_uvm'."))
            return Verdict("inactive", f)
        if packing.get("trees_packed", 0) == 0 and packing.get("trees_unpacked", 0) > 0:
            f.append(Finding("packing-predicates-unmet", "warning",
                             "Our nvidia-uvm is loaded but the GPU did not qualify for packing "
                             f"(reason: {packing.get('unpacked_reason', 'unknown')}).",
                             "Packing applies only to integrated GPUs without vidmem on DMA-coherent systems "
                             f"(DGX Spark / GB10): nothing is saved on this GPU. Go back to the stock module with "
                             f"'{rm.sm('rollback')}' (held until '{rm.sm('install')}')."))
            return Verdict("inactive", f)
        if sb_state == "unknown":
            return Verdict("unverified", f)
        return Verdict("active", f)

    # 7. Rolled back (a driver update removed our override and we could not rebuild), or held by the
    #    administrator's rollback/remove (decide/hold.py): then nothing brings the patch back by itself.
    hold = holds.held(records, rk) if rk else None
    if hold and not ours_selected:
        resume = holds.resume_command(hold, rk, rk)
        if decision is not None and decision["missing"]:    # the install that resumes would be refused: first this
            resume = needs_first(decision, f"'{resume}'", "then")
        f.append(Finding("held", "info", f"Kernel {rk} is {holds.describe(hold, rk, rk)}: spark-memsaverd and "
                         "the APT/dpkg/kernel hooks leave it on the stock nvidia-uvm.", resume, rk))
    rollbacks = records.rollbacks
    if rollbacks and not ours_selected:
        last = sorted(rollbacks, key=lambda r: str(r.get("time", "")))[-1]
        remedy = last.get("remedy") or ("Nothing is broken: the stock module is in use. The patch comes back by "
                                        "itself when a supported driver is installed.")
        if hold:
            remedy = f"Nothing is broken: the stock module is in use; {holds.resume_command(hold, rk, rk)} resumes."
        elif decision is not None and not decision["can_install"] and re.search(r"spark-memsaver (install|build)",
                                                                                 remedy):
            remedy = install_advice(decision)[1]   # the record's advice would be refused now: what is missing
        reason = last.get("reason", "no reason recorded")
        f.append(Finding("rolled-back", "warning", f"Rolled back to the stock nvidia-uvm: {reason}"
                         + (f"; {holds.describe(hold, rk, rk)}" if hold else "") + ".", remedy))
        return Verdict("rolled-back", f)

    # 8. On disk.
    if ours_selected:
        if not mok_decide.state_loadable(sb_state):
            if sb_state != "unknown":
                f.append(Finding("installed-awaiting-key", "info",
                                 "Our nvidia-uvm is installed — it becomes active after the key is enrolled and the "
                                 "node rebooted; the stock nvidia-uvm stays in use until then." if other is None else
                                 "Our nvidia-uvm is installed but signed with another key than the one to enroll: "
                                 "it becomes active once rebuilt, the key enrolled and the node rebooted.",
                                 mok_decide.enrollment_remedy(sb) if other is None else other.remedy, rk))
            return Verdict("unverified", f)
        if any(x.code in ("ours-load-failed", "mok-not-trusted-by-kernel") for x in f):
            return Verdict("needs-attention", f)
        if uvm.loaded:      # what activate would do (decide/activation.py): its refusals are not a Next
            from spark_memsaver.decide import activation
            f.append(Finding("activation-pending", "info", *activation.pending(snap, running)))
        return Verdict("installed", f)
    if any(b.built for r in snap.dkms.registrations for b in r.builds):
        # built, not installed: install's dry run plans the install (it reuses the build), so Next says it
        message, remedy = install_advice(decision)
        if decision is not None and decision["can_install"]:
            message = "Our nvidia-uvm is built but not installed; the stock nvidia-uvm is selected."
        f.append(Finding("stock", "info", message, remedy))
        return Verdict("built", f)

    if not any(x.code == wayback.UNREADABLE and x.kernel == rk for x in f):   # then nothing readable is selected:
        message, remedy = install_advice(decision)                          # its finding says so, not "stock"
        f.append(Finding("stock", "info", message, remedy))
    return Verdict("stock", f)
