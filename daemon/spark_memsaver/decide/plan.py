"""Reconcile: what must change so that no kernel selects a UVM built for another driver. Pure; no I/O.

Input: the world (model.World: world.observe_for_plan), the config, the manifest's verdict per driver version
(``support = {"550.163.01": {"supported": True}, "9.9": {"supported": False, "reason": "..."}}``) and
optionally the intent/rollback records (they are in the world's ``records``). Output: a plan, an
ordered list of steps that act/steps.py executes through the DKMS engines.

The path a newcomer looks for, "driver upgrade -> rollback" (5 modules):
  apt (systemd/apt/) or dpkg trigger (systemd/dpkg/) or the daemon -> cli/lifecycle.py (click) or service/
    -> act/executor.py perform("apt-pre-install" | "reconcile")   [lock, intent, act, verify, record]
    -> decide/plan.py plan() / pre_install_plan()                  [this module: decides]
    -> act/steps.py execute() -> act/override.py remove()/install(), act/build.py build()   [acts]
    -> decide/status.py: status shows `rolled-back` with the reason from the rollback record
and, independent of all of them at module load time, systemd/guard/uvm-guard (docs/lifecycle.md).

Order of a plan: recover interrupted operations first, then every safety removal (a selected override
whose driver differs from the kernel's nvidia.ko), then rollback records, then rebuilds. A rebuild is
only ever planned for the driver version installed for that kernel, and only when the manifest
supports it; anything else stays stock with a reason.
"""

from __future__ import annotations


from spark_memsaver.config import Config
from spark_memsaver.decide import hold as holds
from spark_memsaver.decide import ours as ours_
from spark_memsaver.decide import policy
from spark_memsaver.decide.installability import ENROLL, installability  # noqa: F401
from spark_memsaver.decide.policy import kernel_in_policy
# Rollback codes after which we do not retry the same driver automatically (would fail again).
NO_AUTO_RETRY = ("build-failed", "patch-failed", "install-failed")
from spark_memsaver.decide.apt import DRIVER_VERSION_RE  # noqa: E402,F401


from spark_memsaver.decide.step import ACTING, INFO, Step, base_version  # noqa: E402,F401  (one Step, one base_version)


def _rollback_for(records, kernel: str) -> dict | None:
    found = [r for r in records.rollbacks if r.get("kernel") == kernel]
    return sorted(found, key=lambda r: str(r.get("time", "")))[-1] if found else None


def stock_reason(k, snap, config: Config, support: dict) -> tuple[str, str, str] | None:
    """None if the planner may build for kernel ``k`` now; else (reason, code, remedy) it stays stock.
    The reason, code and remedy are those of the one installability decision (decide/installability.py),
    so status, install and reconcile say the same; on top of it the automatic path never builds a module
    that would not load (Secure Boot enforcing, key not trusted yet) and needs dkms on the host."""
    rel = k.release
    d = installability(snap, config, support, rel)
    if d["missing"]:     # the first piece decides code and remedy; the reason names every piece
        m = d["missing"][0]
        return "; and ".join(x["detail"] for x in d["missing"]), m["code"], m["remedy"]
    if d["then"]:
        t = d["then"][0]
        remedy = (f"Install by hand: 'sudo spark-memsaver install --kernel {rel}'; then {ENROLL}."
                  if t["code"] in ("mok-no-key", "mok-not-enrolled") else t["remedy"])
        return f"{t['detail']}; automatic builds wait for a trusted key", t["code"], remedy
    if not snap.dkms.available:
        return "dkms is not installed", "dkms-missing", "sudo apt-get install dkms"
    return None


def why_not_build(k, snap, config: Config, support: dict) -> str | None:
    """None if we can build for kernel ``k`` now; else the reason it stays stock (see :func:`stock_reason`)."""
    r = stock_reason(k, snap, config, support)
    return r[0] if r else None


def _build_steps(k, snap, config: Config, support: dict, build: Step, fetched: set) -> list[Step]:
    """``build``, preceded by a fetch-source step when the driver's source must be fetched first (once per
    driver version in a plan)."""
    d = installability(snap, config, support, k.release)
    f = d.get("fetch") if d.get("needs_fetch") else None
    if not f or f["driver"] in fetched:
        return [build]
    fetched.add(f["driver"])
    what = " ".join(x for x in (f.get("package"), f.get("deb_version")) if x) or "its source package"
    return [Step("fetch-source", k.release, f"the NVIDIA open kernel-module source of {f['driver']} is not on "
                 f"this host: fetching {what} into the source cache", driver=f["driver"]), build]


def _intent_steps(snap, alive_pids: set[int] | None) -> tuple[list[Step], set[str]]:
    """Steps for interrupted operations; also the kernels whose state they touch."""
    steps: list[Step] = []
    touched: set[str] = set()
    records = snap.records
    for path in records.unreadable:
        steps.append(Step("drop-record", path=path,
                          reason="record is not valid JSON; it is set aside and state re-derived from the system"))
    for q in records.quarantined:     # read but not trusted (host/records.py): set aside now
        if isinstance(q, dict) and q.get("path") and not q.get("moved_to"):
            steps.append(Step("drop-record", path=q["path"], code=q.get("kind"),
                              reason=f"record is not trusted ({q.get('reason')}); it is set aside and state "
                              "re-derived from the system" if q.get("kind") != "hold" else
                              f"hold record is not readable ({q.get('reason')}); it is set aside and a readable "
                              "hold of the same kernel(s) takes its place (the administrator's hold is kept)"))
    for it in sorted(records.intents, key=lambda r: str(r.get("started", ""))):
        iid = it.get("id") or f"{it.get('op')}-{it.get('kernel') or 'all'}"
        op, kern = it.get("op"), it.get("kernel")
        if alive_pids is not None and it.get("pid") in alive_pids:
            steps.append(Step("blocked", kern, f"'{op}' is still running (pid {it.get('pid')})", intent=iid))
            continue
        k = snap.kernel(kern) if kern else None
        nv = base_version(k.nvidia_selected.version) if k and k.nvidia_selected else None
        consistent = ours_.selection(k) == "consistent"
        if kern and op != "activate" and not (op == "install" and consistent):
            touched.add(kern)
        if op in ("remove", "rollback"):
            # Taking our module away is always safe to repeat: finish it.
            steps.append(Step("finish-intent", kern, f"interrupted '{op}' is finished (override removed, stock "
                              "verified)", intent=iid, driver_from=it.get("driver_from"),
                              driver_to=it.get("driver_to"), code=it.get("code") if op == "rollback" else None,
                              remedy=it.get("remedy", "")))
        elif op == "install" and consistent:
            steps.append(Step("clear-intent", kern, "interrupted 'install' had completed: our module is "
                              f"selected and matches nvidia.ko {nv}", intent=iid))
        elif op == "activate":
            steps.append(Step("reload-uvm", kern, "interrupted 'activate': make sure an nvidia-uvm is loaded "
                              "(the guard picks the right one)", intent=iid))
        else:
            # register/build/install half-done: undo to stock; the per-kernel plan rebuilds if it can.
            steps.append(Step("undo-intent", kern, f"interrupted '{op}' is undone (partial build/installation "
                              "removed, stock verified)", intent=iid, driver_to=it.get("driver_version")))
    return steps, touched


AUTO_BUILD_OFF = "automatic builds are off (auto_build: false)"


def no_rebuild(config: Config, rebuild: bool | None = None, why: str | None = None) -> tuple[str, str] | None:
    """Why this plan builds nothing, as (reason, code), or None when it may build: a configuration file that
    cannot be used (its error; never overridden), the caller's own reason for ``rebuild`` False (--no-rebuild,
    dpkg still running), else ``auto_build: false`` when the caller left it to the configuration."""
    bad = getattr(config, "invalid", None)
    if bad:
        where = ", ".join(str(x) for x in (bad.get("file"), bad.get("line") and f"line {bad['line']}") if x)
        return (f"the configuration file cannot be used ({where or 'see status'}): only safety steps run until "
                "it is fixed", "config-invalid")
    if rebuild is False:
        return (why or "only the safety steps were asked for (--no-rebuild)", "no-rebuild")
    if rebuild is None and not config.auto_build:
        return AUTO_BUILD_OFF, "auto-build-off"
    return None


def plan(snap, config: Config, support: dict | None = None, *, alive_pids: set[int] | None = None,
         kernels: list[str] | None = None, rebuild: bool | None = None, why: str | None = None) -> list[Step]:
    """The reconcile plan. ``kernels`` limits it to those releases; ``rebuild`` False plans only safety (``why``:
    the caller's reason, recorded); an invalid configuration (``config.invalid``) plans only safety too."""
    support = support or {}
    off = no_rebuild(config, rebuild, why)
    rebuild = off is None
    records = snap.records
    steps, undone = _intent_steps(snap, alive_pids)
    if any(s.action == "blocked" for s in steps):
        return steps  # another operation is running: do nothing else now
    removals: list[Step] = []
    records_out: list[Step] = []
    builds: list[Step] = []
    fetched: set[str] = set()
    running = next((k.release for k in snap.kernels if k.running), None)
    for k in snap.kernels:
        rel = k.release
        if kernels is not None and rel not in kernels:
            continue
        sel = k.uvm_selected
        nv = base_version(k.nvidia_selected.version) if k.nvidia_selected else None
        built_for = ours_.built_for(sel)
        rb = _rollback_for(records, rel)
        hold = holds.held(records, rel)   # the administrator's rollback/remove: no build, safety only
        if sel and sel.error:
            steps.append(Step("stay-stock", rel, f"cannot read module selection: {sel.error}"))
            continue
        if ours_.selection(k) == "consistent" and rel not in undone:
            if rb:
                records_out.append(Step("clear-rollback", rel, "the patched module is back", driver_to=nv))
            changed = config_change(k, snap, config, support, rebuild, off)
            if hold and changed is not None and changed.action == "build-install":
                changed = Step("held", rel, f"{changed.reason.split('; ')[0]}; no rebuild: "
                               + holds.describe(hold, rel, running), remedy=holds.resume_command(hold, rel, running))
            if changed is None:
                steps.append(Step("ok", rel, f"our nvidia-uvm for {nv} is selected beside nvidia.ko {nv}",
                                  driver_to=nv))
            elif changed.action == "build-install":
                builds.extend(_build_steps(k, snap, config, support, changed, fetched))
            else:
                (removals if changed.action == "remove-override" else steps).append(changed)
            continue
        removed_reason = None
        if ours_.selection(k) == "mismatch":
            if not nv:
                removed_reason = f"no nvidia.ko is installed for kernel {rel} any more (override was for {built_for})"
            elif not built_for:
                removed_reason = f"our module's version string is unreadable ({sel.version!r})"
            else:
                removed_reason = f"NVIDIA driver changed from {built_for} to {nv}"
            if rel not in undone:
                removals.append(Step("remove-override", rel, removed_reason, driver_from=built_for, driver_to=nv))
        if hold:
            why = holds.describe(hold, rel, running)
            if removed_reason:
                records_out.append(Step("record-rollback", rel, f"{removed_reason}; {why}", driver_from=built_for,
                                        driver_to=nv, code="stock-selected", remedy=holds.resume_command(hold, rel, running)))
            else:
                steps.append(Step("held", rel, f"stays stock: {why}", driver_to=nv, code="held",
                                  remedy=holds.resume_command(hold, rel, running)))
            continue
        # an unusable configuration file: its error is the reason (the defaults' policy is no verdict on it)
        stock = None if off and off[1] == "config-invalid" else stock_reason(k, snap, config, support)
        why, code, remedy = stock if stock else (None, None, "")
        no_retry = False
        if why is None and rb and rb.get("code") in NO_AUTO_RETRY and base_version(rb.get("driver_to")) == nv:
            why = (f"the last build for driver {nv} failed ({rb.get('reason')}); "
                   "run 'sudo spark-memsaver install' to retry")
            code, remedy, no_retry = rb.get("code"), f"sudo spark-memsaver install --kernel {rel}", True
        if why is None and not rebuild:
            why, code = off
            remedy = (f"Fix the configuration file, then 'sudo spark-memsaver install --kernel {rel}'"
                      if code == "config-invalid" else f"sudo spark-memsaver install --kernel {rel}")
        if why is None:
            builds.extend(_build_steps(k, snap, config, support, Step(
                "build-install", rel, (removed_reason + "; rebuilding for " + nv) if removed_reason
                else f"our module is built for kernel {rel} but not installed: installing it" if _built(snap, rel)
                else f"no build of our module for kernel {rel} and driver {nv}", driver_from=built_for,
                driver_to=nv), fetched))
        elif removed_reason:
            records_out.append(Step("record-rollback", rel, f"{removed_reason}; {why}", driver_from=built_for,
                                    driver_to=nv, code=_rollback_code(code), remedy=remedy))
        elif rb is not None and not no_retry:
            # Already rolled back (e.g. by the APT pre-hook, before the new driver was unpacked): keep the
            # record, but say why it stays stock *now*, so status gives the real reason.
            frm = base_version(rb.get("driver_from"))
            reason = (f"NVIDIA driver changed from {frm} to {nv}; {why}" if frm and nv and frm != nv else why)
            if rb.get("reason") != reason or rb.get("code") != _rollback_code(code):
                records_out.append(Step("record-rollback", rel, reason, driver_from=frm, driver_to=nv,
                                        code=_rollback_code(code), remedy=remedy))
            else:
                steps.append(Step("stay-stock", rel, why, driver_to=nv, code=code, remedy=remedy))
        else:
            steps.append(Step("stay-stock", rel, why, driver_to=nv, code=code, remedy=remedy))
    # Loaded modules: a patched UVM loaded beside a different nvidia (only possible if forced by hand).
    uvm = snap.uvm
    loaded_nv = base_version(snap.driver.loaded_version)
    if ours_.loaded_mismatch(uvm, loaded_nv):
        holders = snap.holders
        if holders:
            steps.append(Step("blocked", None, "a patched nvidia-uvm for {} is loaded beside nvidia {} and is in use "
                              "by {}".format(base_version(uvm.version), loaded_nv,
                                             ", ".join(f"{h.comm}[{h.pid}]" for h in holders)),
                              remedy="Stop the CUDA processes, then run 'sudo spark-memsaver reconcile' (it reloads "
                              "nvidia-uvm and holds nothing), or reboot."))
        else:
            removals.append(Step("reload-uvm", None, "a patched nvidia-uvm for {} is loaded beside nvidia {}: "
                                 "unloading it (no users) and loading the selected one".format(
                                     base_version(uvm.version), loaded_nv)))
    recover = [s for s in steps if s.action in ACTING]
    info = [s for s in steps if s.action in INFO]
    return recover + removals + records_out + builds + info


def _built(snap, kernel: str) -> bool:
    """DKMS holds a build of ours for ``kernel`` (not installed: the override is not selected)."""
    return any(b.built and b.kernel == kernel for r in snap.dkms.registrations for b in r.builds)


def build_record(snap, kernel: str) -> dict | None:
    return next((b for b in snap.records.builds or []
                 if isinstance(b, dict) and b.get("kernel") == kernel), None)


def config_change(k, snap, config: Config, support: dict, rebuild: bool,
                  off: tuple[str, str] | None = None) -> Step | None:
    """For a kernel whose override is consistent: the step a configuration change since its build calls
    for (rebuild, removal when the kernel left the policy, or an explanation), else None. ``off``: why no
    rebuild (:func:`no_rebuild`)."""
    if getattr(config, "invalid", None):
        return None      # the built-in defaults stand in for an unusable file: they are no change to act on
    off_why = (off or (AUTO_BUILD_OFF, ""))[0]
    rel = k.release
    nv = base_version(k.nvidia_selected.version) if k.nvidia_selected else None
    diff = policy.settings_changed(build_record(snap, rel), config)
    if not diff:
        return None
    what = ", ".join(diff)
    ok, why_policy = kernel_in_policy(k, config)
    if not ok:
        if rebuild:
            return Step("remove-override", rel, f"configuration changed since the build ({what}): {why_policy}",
                        driver_from=nv, driver_to=nv, code="config-changed")
        return Step("config-changed", rel, f"configuration changed since the build ({what}): {why_policy}; "
                    + off_why, driver_to=nv, code="config-changed",
                    remedy=f"sudo spark-memsaver remove --kernel {rel}")
    why = why_not_build(k, snap, config, support)
    if why is None and rebuild:
        return Step("build-install", rel, f"configuration changed since the build ({what}); rebuilding",
                    driver_from=nv, driver_to=nv, code="config-changed")
    return Step("config-changed", rel, f"configuration changed since the build ({what}); "
                + (why or off_why), driver_to=nv, code="config-changed",
                remedy=rebuild_command(rel))


def rebuild_command(kernel: str) -> str:
    """build --force runs only as root (it never goes through the daemon): the command says sudo."""
    return f"sudo spark-memsaver build --kernel {kernel} --force && sudo spark-memsaver install --kernel {kernel}"


# Rollback record codes (docs/lifecycle.md): the installability code where one decided, else stock-selected.
ROLLBACK_CODES = ("driver-unsupported", "driver-source-missing", "driver-source-corrupt", "headers-missing",
                  "nvidia-ko-missing", "kernel-outside-policy", "secure-boot-unknown", "build-failed",
                  "patch-failed", "install-failed")


def _rollback_code(code: str | None) -> str:
    return code if code in ROLLBACK_CODES else "stock-selected"


def summarize(steps: list[Step]) -> dict:
    return {"acting": sum(1 for s in steps if s.action in ACTING),
            "steps": [s.to_dict() for s in steps]}


# The APT door's protocol and its plan live in decide/apt.py; their names stay importable from here.
from spark_memsaver.decide.apt import (DRIVER_PACKAGE_RE, HookInputError, driver_changes,  # noqa: E402,F401
                                       parse_apt_hook, pre_install_plan, upstream_of_deb)
