"""The ONE installability decision: can kernel K get our nvidia-uvm now, and if not, what exactly is missing.
Pure: the world (model.World) + config + the manifest's verdict (``support``) in, a plain dict out; no I/O.

Read by decide/status.py (the recommendation: ``spark-memsaver install`` only when ``can_install``),
decide/plan.py (why a kernel stays stock; the ``fetch-source`` step), act/installable.py (``install`` refuses
with the same code and remedy as status) and through them by ``reconcile`` and the daemon.

    installability(snap, config, support, kernel_release) ->
      {"kernel": K, "can_install": bool, "needs_fetch": bool,     # can_install is True also when needs_fetch;
                                                                  # needs_fetch: the source is fetchable (said
                                                                  # even when another piece is missing)
       "driver": "580.142"|None, "qualification": "compile-verified"|"untested"|None,
       "fetch": {"driver", "package", "deb_version"}|None,          # what the fetch-source step gets
       "missing": [{"what", "code", "detail", "remedy"}],          # each one blocks install (can_install False)
       "then": [{"what": "signing-key", "code", "detail", "remedy"}]}   # install proceeds; needed to load

Checked in this order (each ``what`` with its stable ``code``, the same code the refusal carries):
  kernel         unknown-kernel          no /lib/modules/K (only this one is reported then)
  driver         nvidia-ko-missing       no nvidia.ko for K, so no driver version to build against
  kernel-policy  kernel-outside-policy   decide/policy.verdict (64k-only, PREEMPT_RT)
  manifest       driver-unsupported      the driver is not in this release's patch manifest ("untested"
                                         drivers are installable: the zero-fuzz dry run decides at build time)
  driver-source  driver-source-missing / driver-source-corrupt: no open tree of exactly that version, and
                 it cannot be fetched (World.driver_sources, observe/sources.py; a missing key is "unknown,
                 not fetchable"); fetchable -> needs_fetch, not missing
  headers        headers-missing         linux-headers-K (Debian and Ubuntu name them alike)
  secure-boot    secure-boot-unknown     installing is refused while the state cannot be read
  signing-key    mok-<state>             Secure Boot enforcing and our key not trusted yet: install proceeds
                                         today (it signs, creating the key if needed) and the key must then be
                                         enrolled; listed under "then", never under "missing"
Remedies are exact commands that work for the user who reads them (``sudo`` where root is needed).
``support`` None means the manifest was not consulted: the manifest check is left out, the others apply.
"""

from __future__ import annotations



CODES = {"kernel": "unknown-kernel", "driver": "nvidia-ko-missing", "kernel-policy": "kernel-outside-policy",
         "manifest": "driver-unsupported", "driver-source": "driver-source-missing", "headers": "headers-missing",
         "secure-boot": "secure-boot-unknown", "dkms": "dkms-missing", "signing-key": "signing-key-incomplete"}
#: a certificate without its private key (or the reverse): the remedy of status's finding and of the build's refusal
SIGNING_PAIR_REMEDY = ("Restore the missing file of the pair from a backup (if the certificate is enrolled), or remove "
                       "both files to let spark-memsaver create a new key (which then needs enrolling).")

# "Secure Boot is enforcing and <phrase>": the signing key's MOK state (decide/mok.py) as a sentence
KEY_PHRASES = {"no-key": "there is no signing key", "not-enrolled": "the signing key is not enrolled",
               "pending-enroll": "the signing key's enrollment waits for the console at the next boot",
               "pending-delete": "the signing key is being deleted at the next boot",
               "blocked": "the firmware blocks the signing key"}


def key_phrase(state: str) -> str:
    return KEY_PHRASES.get(state, f"the signing key is {state.replace('-', ' ')}")

from spark_memsaver.decide.mok import ENROLL_STEPS as ENROLL  # noqa: E402  (the Secure Boot path's one wording)
from spark_memsaver.decide.mok import state_loadable  # noqa: E402  (the one rule of the loadable states)


from spark_memsaver.versions import base_version  # noqa: E402  (the one base_version)


from spark_memsaver.decide.sources import branch_of, server_flavour, source_package  # noqa: E402  (the owners)


def _layout(snap) -> dict:
    """What decide/sources' rules read, from the world: every kernel's nvidia.ko path."""
    return {"nvidia_ko": [str(k.nvidia_selected.path) for k in snap.kernels
                          if k.nvidia_selected and k.nvidia_selected.path]}


def _source_package(snap, driver: str) -> str:
    """The package most likely to carry ``driver``'s open tree here (decide/sources.source_package's order)."""
    lay = _layout(snap)
    cands = source_package(driver, {**lay, "nvidia_ko": (lay["nvidia_ko"] or [""])[0]})
    if cands:
        return cands[0]["package"]
    br = branch_of(driver)                  # an odd version (580.142.01.1) still names its branch's package
    return f"nvidia-kernel-source-{br}{'-server' if server_flavour(lay, br) else ''}-open"


def source_search_remedy(snap, driver: str) -> str:
    """The remedy when no exact package version is known: which package to look for, and how."""
    pkg = _source_package(snap, driver)
    return (f"Install the NVIDIA open kernel-module source of exactly {driver}: 'apt-cache policy {pkg}' lists the "
            f"versions APT knows (run 'sudo apt-get update' first if none begins with {driver}-); install that "
            f"one with 'sudo apt-get install {pkg}=VERSION' (Debian: 'apt-cache policy nvidia-open-kernel-dkms').")


def _driver_remedy(snap, kernel: str, known: str | None) -> str:
    if not known:
        return "Install the NVIDIA open driver's kernel modules for this kernel first."
    br = branch_of(known)
    mods = f"linux-modules-nvidia-{br}{'-server' if server_flavour(_layout(snap), br) else ''}-open-{kernel}"
    return (f"Install the NVIDIA {br} driver's kernel modules for kernel {kernel}: "
            f"'sudo apt-get install {mods}' (Ubuntu, precompiled), or on Debian "
            f"'sudo apt-get install linux-headers-{kernel}' (nvidia-open-kernel-dkms then builds nvidia.ko for it).")


def _known_driver(snap) -> str | None:
    """A driver version this host has somewhere (loaded, another kernel's nvidia.ko, a source tree)."""
    loaded = base_version(snap.driver.loaded_version)
    if loaded:
        return loaded
    for k in snap.kernels:
        v = base_version(k.nvidia_selected.version) if k.nvidia_selected else None
        if v:
            return v
    srcs = snap.driver.sources
    return srcs[0].version if srcs else None


# with 4 or 16 KiB pages a page table's backing page is small already: 'kernels: all' would save nothing there
SMALL_PAGES_REMEDY = ("Nothing to do: packing saves memory only on arm64 kernels with 64 KiB pages; this kernel stays "
                      "on the stock nvidia-uvm.")


def policy_remedy(config, verdict) -> str:
    """The remedy of a policy refusal (decide/policy.verdict), by the rule that refused."""
    if verdict.rule == "preempt-rt":
        return ("Nothing is broken: the stock nvidia-uvm stays in use on this kernel. NVIDIA's modules do not "
                "build for PREEMPT_RT; boot a kernel without PREEMPT_RT to use packing.")
    if getattr(config, "kernels", "64k-only") == "64k-only":
        return SMALL_PAGES_REMEDY
    return "Nothing to do: this kernel stays stock."


def _missing(what: str, detail: str, remedy: str, code: str | None = None) -> dict:
    return {"what": what, "code": code or CODES[what], "detail": detail, "remedy": remedy}


def _source(snap, config, drv: str) -> tuple[dict | None, dict | None]:
    """(missing entry or None, fetch description or None) for driver ``drv``'s open tree."""
    trees = [s for s in snap.driver.sources if s.version == drv]
    local = trees[0] if trees else None
    ds = snap.driver_sources if isinstance(snap.driver_sources, dict) else {}
    entry = (ds.get("by_driver") or {}).get(drv) if isinstance(ds.get("by_driver"), dict) else None
    entry = entry if isinstance(entry, dict) else None
    if any(s.open and not s.problem for s in trees):     # the build takes the first complete one (world/tree)
        return None, None
    if local:
        pkg = (entry or {}).get("package")
        ver = (entry or {}).get("deb_version")
        remedy = (f"Reinstall it: 'sudo apt-get install --reinstall {pkg}={ver}'." if pkg and ver
                  else source_search_remedy(snap, drv))
        detail = local.problem if local.open else (f"{local.path} is not an open kernel-module tree (no "
                                                   "nvidia-uvm/ or Kbuild)")
        return _missing("driver-source", detail, remedy, code="driver-source-corrupt"), None
    if entry and entry.get("present") and entry.get("path"):
        return None, None
    if entry and entry.get("fetchable"):
        return None, {"driver": drv, "package": entry.get("package"), "deb_version": entry.get("deb_version")}
    want = f"the NVIDIA open kernel-module source of {drv} is not installed (no /usr/src/nvidia-{drv})"
    pkg, ver = (entry or {}).get("package"), (entry or {}).get("deb_version")
    if entry is None or (ds.get("apt") == "unknown" and not (pkg and ver)):
        why = "APT's lists could not be read here, so whether it can be fetched is not known"
    elif pkg and ver and entry.get("in_lists"):
        why = f"{pkg} {ver} is in the APT lists but source_fetch is '{ds.get('mode', 'never')}'"
    elif pkg and ver:
        why = f"{pkg} {ver} is not in the APT lists"
    else:
        why = f"no package of the APT lists carries {drv}'s source"
    remedy = entry.get("remedy") if entry and entry.get("remedy") else source_search_remedy(snap, drv)
    return _missing("driver-source", f"{want}; {why}", remedy), None


def installability(snap, config, support: dict | None, kernel_release: str) -> dict:
    """Can ``kernel_release`` get our module now (see the module docstring)."""
    from spark_memsaver.decide import policy
    out = {"kernel": kernel_release, "can_install": False, "needs_fetch": False, "driver": None,
           "qualification": None, "fetch": None, "missing": [], "then": []}
    kernels = {k.release: k for k in snap.kernels}
    k = kernels.get(kernel_release)
    if k is None:
        names = ", ".join(sorted(r for r in kernels if r)) or "none"
        out["missing"].append(_missing(
            "kernel", f"kernel {kernel_release} is not installed (no /lib/modules/{kernel_release}); installed "
            f"kernels: {names}", unknown_kernel_remedy(sorted(r for r in kernels if r))))
        return out
    miss = out["missing"]
    nvsel = k.nvidia_selected
    drv = base_version(nvsel.version) if nvsel else None
    out["driver"] = drv
    if not drv:
        err = f" (the selection cannot be read: {nvsel.error})" if nvsel and nvsel.error else ""
        miss.append(_missing("driver", f"no nvidia.ko is installed for kernel {kernel_release}{err}, so there is "
                             "no driver to build against", _driver_remedy(snap, kernel_release, _known_driver(snap))))
    pv = policy.verdict(k, config)
    if not pv.ok:
        miss.append(_missing("kernel-policy", pv.why, policy_remedy(config, pv)))
    if drv:
        # support None: the manifest was not consulted (a caller without it); the other checks still apply
        sup = {"supported": True} if support is None else (
            support.get(drv) or {"supported": False, "reason": f"driver {drv} is not in the patch manifest"})
        fetch_to_judge = src_missing = None
        if not sup.get("supported") and sup.get("content_unchecked"):
            # not in the manifest by version, and no tree to judge by content: its source decides (identical
            # hooked files -> compile-verified by content, as the build's apply step then finds). Fetchable:
            # fetch first; else what is missing is that source, with its exact remedy
            src_missing, fetch_to_judge = _source(snap, config, drv)
        if fetch_to_judge is not None:
            out["qualification"] = "content-pending"
            out["fetch"] = fetch_to_judge
            out["needs_fetch"] = True
        elif src_missing is not None:
            out["qualification"] = "content-pending"
            miss.append(dict(src_missing, detail=src_missing["detail"] + f"; NVIDIA {drv} is not in this "
                             "release's patch manifest by version, so its source decides (by the content of the "
                             "files the patch touches)"))
        elif not sup.get("supported"):
            miss.append(_missing(
                "manifest", sup.get("reason") or f"driver {drv} is not supported by this spark-memsaver release",
                "Nothing is broken: the stock nvidia-uvm is in use. Update spark-memsaver to a release that "
                f"supports NVIDIA {drv} ('spark-memsaver patch list' shows the versions this one knows); the "
                "patch then comes back by itself."))
        else:
            out["qualification"] = sup.get("qualification")
            m, fetch = _source(snap, config, drv)
            if m:
                miss.append(m)
            out["fetch"] = fetch
            out["needs_fetch"] = fetch is not None
    if not k.headers:
        miss.append(_missing("headers", f"kernel headers for {kernel_release} are not installed "
                             f"(/lib/modules/{kernel_release}/build)",
                             f"sudo apt-get install linux-headers-{kernel_release}"))
    if not snap.dkms.available:   # the build needs it: install says dkms-missing
        miss.append(_missing("dkms", "dkms is not installed, so nothing can be built", "sudo apt-get install dkms"))
    sb = snap.secure_boot if isinstance(snap.secure_boot, dict) else {}
    cert = sb.get("certificate") if isinstance(sb.get("certificate"), dict) else {}
    if cert.get("present") and cert.get("key_present") is False:   # what act/signing refuses: neither would sign
        miss.append(_missing("signing-key", f"the signing certificate {cert.get('path')} exists but its private key "
                             f"{cert.get('key_path')} does not: DKMS would sign with neither", SIGNING_PAIR_REMEDY))
    state = sb.get("state") or "unknown"
    if state == "unknown":
        miss.append(_missing("secure-boot", "Secure Boot / MOK state is unknown: "
                             + (sb.get("reason") or "it was not observed") + "; a module installed now might not load",
                             secure_boot_unknown_remedy(sb)))
    elif not state_loadable(state):
        out["then"].append({"what": "signing-key", "code": f"mok-{state}",
                            "detail": f"Secure Boot is enforcing and {key_phrase(state)}"
                                      + (f" ({sb['reason']})" if sb.get("reason") else "")
                                      + ": the module will not load until the key is trusted",
                            "remedy": signing_remedy(sb)})
    out["can_install"] = not miss
    return out


def signing_remedy(sb: dict) -> str:
    """What to do about a signing key that is not trusted at boot yet (the MOK verdict's own remedy where
    it names one for the state; enrollment otherwise)."""
    state = sb.get("state")
    if state in ("no-key", "not-enrolled"):
        return "After installing (it signs the module, creating the key if there is none), " + ENROLL + "."
    return sb.get("remedy") or ("R" + ENROLL[1:] + ".")


def secure_boot_unknown_remedy(sb: dict) -> str:
    """The MOK verdict's remedy for an unreadable state (it names the cause's fix), else the generic one."""
    if sb.get("remedy"):
        return sb["remedy"]
    from spark_memsaver.errors import SecureBootUnknown
    return "Installing is refused until the state can be read. " + SecureBootUnknown.remedy


from spark_memsaver.errors import unknown_kernel_remedy  # noqa: E402,F401  (errors.py is a leaf: the text lives there)


def first_missing(decision: dict) -> dict | None:
    return (decision.get("missing") or [None])[0]
