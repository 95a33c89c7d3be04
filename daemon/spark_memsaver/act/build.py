"""The build engine: preflight (headers, policy, nvidia.ko, source, patch) -> signing -> render -> dkms add/build
-> verify the built module. Takes no lock and writes no intent (act/executor.py does both)."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path


from spark_memsaver.act import signing as sig
from spark_memsaver.decide import policy
from spark_memsaver.host import Host
from spark_memsaver.act.dkms_run import BUILD_TIMEOUT, LOG_DIR, PATCH_ID, _dkms, _modinfo_path, _noop, _raise_for_dkms, _require_root, _scaled, _uninstall_kernel, dkms_version, find_driver_source, kernel_config, kotool, running_kernel, selected
from spark_memsaver.act.dkms_errors import BuiltModuleMissing, DriverMismatch, DriverSourceCorrupt, HeadersMissing, KernelOutsidePolicy, NoNvidiaDriver, VerificationFailed
from spark_memsaver.observe.dkms import DKMS_TREE, MODULE, PACKAGE, SRC_ROOT, _arch_dirs, built_module, dkms_version_string, installed_version, kernels_of
from spark_memsaver.act.render import _forget_registration, recover_broken, render


def _preflight(host: Host, config, kernel: str, driver_version: str | None) -> dict:
    """Every check that can refuse before anything is written or compiled."""
    from spark_memsaver.act import patch as uvm_patch
    if not host.exists(f"/lib/modules/{kernel}/build/Makefile"):
        raise HeadersMissing(f"kernel headers for {kernel} are not installed (/lib/modules/{kernel}/build)",
                             remedy=f"sudo apt-get install linux-headers-{kernel}", kernel=kernel)
    pv = policy.verdict(policy.kernel_of(kernel, kernel_config(host, kernel)), config)   # the one policy
    if not pv.ok:
        from spark_memsaver.decide.installability import policy_remedy
        raise KernelOutsidePolicy(pv.why, remedy=policy_remedy(config, pv), kernel=kernel)   # the why names the kernel
    nv = selected(host, kernel, "nvidia", digest=False)
    if nv is None or not nv.get("version"):
        raise NoNvidiaDriver(f"no nvidia.ko is installed for kernel {kernel}", kernel=kernel)
    driver = nv["version"]
    if driver_version and driver_version != driver:
        raise DriverMismatch(f"kernel {kernel} loads nvidia.ko {driver} ({nv['path']}), not {driver_version}",
                             kernel=kernel, driver=driver)
    src = find_driver_source(host, driver)
    try:
        chk = uvm_patch.check_source(host.path(src), runner=host.runner)
    except uvm_patch.SourceTreeInvalid as e:
        raise DriverSourceCorrupt(f"{src}: {e.message}", source=src) from None
    chk.pop("_selection", None)
    return {"kernel": kernel, "driver": driver, "nvidia_ko": nv["path"], "source": src, "patch": chk}


def _signing_for(host: Host, config, kernel: str) -> dict:
    # Through the kotool the PRE_INSTALL guard runs, for a --root host too (its <root>/lib/modules/K/build/.config
    # or <root>/boot/config-K); a config that cannot be read is KernelSigningUnknown (named), never "unsigned".
    signs = sig.kernel_signs(host, kernel)
    if not signs:
        return {"applies": False, "reason": f"kernel {kernel} does not check module signatures (CONFIG_MODULE_SIG unset)"}
    s = sig.ensure(host, config)
    s["applies"] = True
    return s


def _progress_poller(host: Host, ver: str, progress):
    logp = host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}/build/make.log")
    state = {"total": 0, "frac": 0.0, "msg": "starting dkms build"}

    def poll():
        try:
            text = logp.read_text(errors="replace")
        except OSError:
            return
        for m in re.finditer(r"^spark-memsaver-progress-total: (\d+)", text, re.M):
            state["total"] = int(m.group(1))
        marks = re.findall(r"^spark-memsaver-progress: ([0-9.]+) (.*)$", text, re.M)
        if marks:
            state["frac"], state["msg"] = max(state["frac"], float(marks[-1][0])), marks[-1][1]
        # kbuild prints the object relative to the module directory (6.x: "CC [M]  nvidia-uvm/uvm.o") or
        # absolute (older): both count; conftest and modpost objects do not
        cc = len(re.findall(r"^\s+CC \[M\]\s+(?:\S*/)?nvidia-uvm/\S+\.o$", text, re.M))
        frac, msg = state["frac"], state["msg"]
        if state["total"] and cc:
            frac = max(frac, 0.10 + 0.85 * min(1.0, cc / state["total"]))
            # one counted stage (cli/lifecycle.ProgressLines prints it per 10 %)
            msg = f"compiling nvidia-uvm: {min(cc, state['total'])}/{state['total']} files"
        if "LD [M]" in text and "nvidia-uvm.ko" in text:
            frac, msg = max(frac, 0.96), "linking nvidia-uvm.ko"
        progress(frac, msg)
    return poll


def _save_log(host: Host, ver: str, kernel: str) -> str | None:
    for cand in (f"{DKMS_TREE}/{PACKAGE}/{ver}/build/make.log",
                 *[str(a / "log" / "make.log") for a in _arch_dirs(host, ver, kernel)]):
        p = host.path(cand) if cand.startswith("/var") else Path(cand)
        if p.is_file():
            dst = host.path(f"{LOG_DIR}/dkms-build-{ver}-{kernel}.log")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, dst)
            return f"{LOG_DIR}/dkms-build-{ver}-{kernel}.log"
    return None


def _verify_built(host: Host, ver: str, kernel: str, driver: str, signing: dict, state: dict | None = None,
                  nvidia_ko: str | None = None) -> dict:
    """The built module checked by the kotool against the kernel, the driver and the signing record. ``state``:
    world/refresh.kernel read since the build (its built module), ``nvidia_ko``: the preflight's nvidia.ko."""
    ko = state["built"].get(ver) if state is not None else built_module(host, ver, kernel)
    if ko is None:
        raise BuiltModuleMissing(f"DKMS reports a build for {kernel} but no {MODULE}.ko is in its tree")
    nv = nvidia_ko if state is not None else _modinfo_path(host, kernel, "nvidia")
    record = sig.read_record(host) if signing.get("applies") else None
    # a --root host: whether its kernel signs was read from its config (_signing_for), never the machine's own
    signs = None if host.is_live else bool(signing.get("applies"))
    res = kotool().verify(str(ko), kernel, driver, nvidia_ko=str(host.path(nv)) if nv else None,
                          signing=record, tag=PATCH_ID, signs=signs)
    if signing.get("applies") and not res["facts"].get("signing_applies") and host.is_live:
        res["problems"].append("the kernel signs modules but the signing check did not run")
        res["ok"] = False
    res["module"] = str(ko)
    return res


def _unbuild(host: Host, ver: str, kernel: str) -> None:
    r = _dkms(host, ["unbuild", "-m", PACKAGE, "-v", ver, "-k", kernel], timeout=600)
    if not r.ok and built_module(host, ver, kernel) is not None:
        _raise_for_dkms(r, f"dkms unbuild {PACKAGE}/{ver} -k {kernel}")


def _drop_if_empty(host: Host, ver: str, kernels: list[str] | None = None) -> None:
    """Remove the registration (and our /usr/src tree) when no kernel has a build of it. ``kernels``: those with
    a build of ``ver`` (world/refresh.dkms, read after the removals), else read now."""
    if kernels_of(host, ver) if kernels is None else kernels:
        return
    if host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}").exists():
        r = _dkms(host, ["remove", "-m", PACKAGE, "-v", ver, "--all"], timeout=600)
        if not r.ok and host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}").exists():
            _forget_registration(host, ver, kernels)
    src = host.path(f"{SRC_ROOT}/{PACKAGE}-{ver}")
    if src.is_dir() and (src / "spark-memsaver.json").exists():
        shutil.rmtree(src)
    base = host.path(f"{DKMS_TREE}/{PACKAGE}")
    if base.is_dir() and not any(base.iterdir()):
        base.rmdir()


def _jobs() -> str:
    env = os.environ.get("SPARK_MEMSAVER_BUILD_JOBS", "")
    return env if env.isdigit() and int(env) > 0 else str(os.cpu_count() or 1)


def _build_locked(host: Host, config, kernel: str, driver_version: str | None, progress, force: bool,
                  prep: dict | None = None) -> dict:
    """``prep``: what act/installable.prepare read before the operation's first step (the preflight's answer or
    its refusal, our tree to render, the kernel's state); DKMS's tree is read again (world/refresh) only after a
    step changed it. Without it (a build on its own, a reconcile step), everything is read here."""
    from spark_memsaver.world import refresh
    t0 = time.monotonic()
    progress = progress or _noop
    progress(0.0, f"checking {kernel}")
    dv = dkms_version(host)
    state = prep["state"] if prep else refresh.kernel(host, kernel)
    recovered = recover_broken(host, config, state["registered"])
    if recovered:
        state = refresh.kernel(host, kernel)          # recover_broken changed DKMS's tree
    pre = prep["preflight"] if prep else _preflight(host, config, kernel, driver_version)
    if isinstance(pre, Exception):
        raise pre                                     # the preflight's refusal, where it always was
    driver = pre["driver"]
    planned = prep["tree"] if prep else None
    ver = dkms_version_string(driver) if planned is None or isinstance(planned, Exception) else planned["version"]
    progress(0.01, "settling the signing key")
    signing = _signing_for(host, config, kernel)
    if isinstance(planned, Exception):
        raise planned                                 # rendering our tree failed, where it always did
    rendered = render(host, config, driver, pre["source"], planned)
    result = {"kernel": kernel, "driver": driver, "dkms_version": ver, "dkms": dv, "package": PACKAGE,
              "source": rendered["path"], "nvidia_source": pre["source"], "patch": pre["patch"],
              "signing": {k: signing.get(k) for k in ("applies", "reason", "key", "cert", "subject", "serial",
                                                       "sha256", "created", "changes_global_signing", "replaces")
                          if k in signing},
              "recovered": recovered}
    if not force and not rendered["changed"] and state["built"].get(ver) is not None:
        v = _verify_built(host, ver, kernel, driver, signing, state, pre["nvidia_ko"])
        if v["ok"]:
            result.update(status="already-built", module=v["module"], verification=v, seconds=0.0,
                          log=None)
            progress(1.0, "already built" + (" and installed" if state["installed"] == ver else ""))
            return result
    if not host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}").exists():
        r = _dkms(host, ["add", "-m", PACKAGE, "-v", ver], timeout=120)
        if not r.ok:
            _raise_for_dkms(r, f"dkms add {PACKAGE}/{ver}")
    if state["installed"] == ver:
        _uninstall_kernel(host, ver, kernel)  # rebuilding: `install` puts the new build in place
        result["uninstalled_for_rebuild"] = True
    if ver in state["build_dirs"]:
        _unbuild(host, ver, kernel)
    progress(0.02, "dkms build")
    res = _dkms(host, ["build", "-m", PACKAGE, "-v", ver, "-k", kernel, "-j", _jobs()], timeout=BUILD_TIMEOUT,
                poll=_progress_poller(host, ver, _scaled(progress, 0.02, 0.97)))
    logp = _save_log(host, ver, kernel)
    result["log"] = logp
    if not res.ok:
        try:
            _raise_for_dkms(res, f"dkms build {PACKAGE}/{ver} for {kernel}", str(host.path(logp)) if logp else None)
        finally:
            if kernel in kernels_of(host, ver) and built_module(host, ver, kernel) is None:
                _unbuild(host, ver, kernel)
            _drop_if_empty(host, ver)
    ver_res = _verify_built(host, ver, kernel, driver, signing, refresh.kernel(host, kernel), pre["nvidia_ko"])
    result["verification"] = ver_res
    if not ver_res["ok"]:
        _unbuild(host, ver, kernel)
        _drop_if_empty(host, ver)
        raise VerificationFailed(f"the module DKMS built for {kernel} failed verification: "
                                 + "; ".join(ver_res["problems"]), problems=ver_res["problems"], log=logp)
    if signing.get("applies"):
        sig.record_signed(host, {"module": ver_res["module"], "dkms_version": ver, "kernel": kernel,
                                 "signer": ver_res["facts"].get("signer"), "serial": ver_res["facts"].get("sig_key"),
                                 "cert": signing.get("cert"), "cert_sha256": signing.get("sha256")})
    result.update(status="built", module=ver_res["module"], seconds=round(time.monotonic() - t0, 1))
    progress(1.0, f"built {PACKAGE}/{ver} for {kernel}")
    return result


def build(host: Host, config, kernel: str | None = None, driver_version: str | None = None, progress=None,
          force: bool = False, prep: dict | None = None) -> dict:
    """Render, register and build the patched nvidia-uvm for `kernel` (default: the running kernel).

    The driver version is the version of the nvidia.ko selected for that kernel; ``driver_version``, when
    given, must equal it. Returns a dict (kernel, driver, dkms_version, module, log, signing, verification,
    seconds, status 'built'|'already-built'). Raises a named error, leaving nothing registered that was
    not there before, when anything refuses or fails. ``prep``: act/installable.prepare's answer for ``kernel``
    and ``driver_version``, read before the operation's first step.
    """
    _require_root(host)
    kernel = kernel or running_kernel(host)
    return _build_locked(host, config, kernel, driver_version, progress, force, prep)


# ------------------------------------------------------------------------------------------------
# Install / remove
