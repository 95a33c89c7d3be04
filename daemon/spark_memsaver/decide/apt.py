"""APT's DPkg::Pre-Install-Pkgs protocol (versions 1-3) and the door's plan. Pure; no I/O.

Which NVIDIA driver packages an APT run changes, and which kernels' overrides must go before dpkg unpacks
them (act/executor.py acts on the plan, op "apt-pre-install").
"""

from __future__ import annotations

import re

from spark_memsaver.errors import UsageError

from spark_memsaver.versions import DRIVER_RE as DRIVER_VERSION_RE  # noqa: E402,F401  (the one driver shape)
from spark_memsaver.versions import driver_of_deb as upstream_of_deb  # noqa: E402  (the one deb -> driver rule)


DRIVER_PACKAGE_RE = re.compile(
    r"^(?:nvidia-(?:open-)?kernel-(?:source|dkms|open-dkms|common|support)(?:-[\w.+-]*)?"
    r"|nvidia-dkms-[\w.+-]+|nvidia-driver(?:-[\w.+-]*)?|nvidia-open(?:-[\w.+-]*)?"
    r"|linux-(?:modules|objects|signatures)-nvidia-[\w.+-]+)$")


class HookInputError(UsageError, ValueError):
    code = "hook-input-invalid"
    remedy = "Check DPkg::Tools::Options::<hook>::Version in /etc/apt/apt.conf.d/90spark-memsaver (expects 3)."


def parse_apt_hook(text: str) -> list[dict]:
    """Package actions from APT's Pre-Install-Pkgs protocol (version 2 or 3; version 1 = bare .deb paths).

    v3 line: name old-ver old-arch old-ma direction new-ver new-arch new-ma action
    v2 line: name old-ver direction new-ver action
    """
    lines = text.splitlines()
    if not lines:
        return []
    head = lines[0].strip()
    if not head.startswith("VERSION "):
        # version 1: one .deb path per line; package name/version from the file name
        out = []
        for ln in lines:
            ln = ln.strip()
            m = re.match(r"^(?:.*/)?([^/_]+)_([^_]+)_[^_]+\.deb$", ln)
            if m:
                ver = m.group(2).replace("%3a", ":")
                out.append({"name": m.group(1), "old": None, "new": ver, "action": ln})
        return out
    version = head.split()[1]
    if version not in ("2", "3"):
        raise HookInputError(f"unsupported APT hook protocol {head!r}")
    try:
        blank = lines.index("", 1)
    except ValueError:
        return []
    out = []
    for ln in lines[blank + 1:]:
        f = ln.split()
        if not f:
            continue
        if version == "3":
            if len(f) < 9:
                raise HookInputError(f"short v3 package line: {ln!r}")
            name, old, new, action = f[0], f[1], f[5], " ".join(f[8:])
        else:
            if len(f) < 5:
                raise HookInputError(f"short v2 package line: {ln!r}")
            name, old, new, action = f[0], f[1], f[3], " ".join(f[4:])
        out.append({"name": name, "old": None if old == "-" else old, "new": None if new == "-" else new,
                    "action": action})
    return out


def driver_changes(actions: list[dict]) -> list[dict]:
    """NVIDIA driver packages whose version changes or which go away in this APT run."""
    out = []
    for a in actions:
        if not DRIVER_PACKAGE_RE.match(a["name"]):
            continue
        if a["action"] == "**CONFIGURE**":
            continue
        if a["action"] == "**REMOVE**" or a["new"] != a["old"]:
            out.append({**a, "new_driver": None if a["action"] == "**REMOVE**" else upstream_of_deb(a["new"])})
    return out


# --- which kernels and which driver a package carries (facts from act/apt_facts.py) ---------------

# Ubuntu's per-kernel NVIDIA packages: linux-modules-nvidia-550-open-6.8.0-50-generic,
# linux-objects-nvidia-580-server-open-6.14.0-1011-oracle, linux-signatures-nvidia-6.8.0-50-generic.
# The kernel release starts with digits and a dot; a flavour name instead (-generic, -nvidia) is a meta package.
PER_KERNEL_RE = re.compile(r"^linux-(?:modules|objects|signatures)-nvidia-(?:\d+(?:-[a-z]+)*-)?(\d+\.\d+[\w.+-]*)$")
META_RE = re.compile(r"^linux-(?:modules|objects|signatures)-nvidia-")
COMMON_DEP_RE = re.compile(r"^nvidia-kernel-common-[\w.+-]+\s*\(\s*(=|>=|<=|<<|>>)\s*([^)\s]+)\s*\)$")
SOURCE_TREE_RE = re.compile(r"^/?(?:\./)?usr/src/nvidia(?:-[a-z-]+)?-(\d{3}\.\d{1,3}(?:\.\d{1,3})?)/?$")


def kernel_of_package(name: str) -> str | None:
    """The kernel release a per-kernel NVIDIA package is for, from its name (None: not per-kernel)."""
    m = PER_KERNEL_RE.match(name)
    return m.group(1) if m else None


def driver_of_depends(depends: str | None) -> str | None:
    """The exact driver a package's Depends pins on nvidia-kernel-common-<branch>: '(= 550.163.01-0ubuntu1)',
    or Ubuntu's '(>= 550.163.01)' with '(<= 550.163.01-1)' naming the same upstream. Else None."""
    eq, lower, upper = set(), set(), set()
    for alt in (depends or "").split(","):
        for dep in alt.split("|"):
            m = COMMON_DEP_RE.match(dep.strip())
            if not m:
                continue
            up = upstream_of_deb(m.group(2))
            if up:
                {"=": eq, ">=": lower, "<=": upper}.get(m.group(1), set()).add(up)
    if len(eq) == 1:
        return next(iter(eq))
    if len(lower) == 1 and lower == upper:
        return next(iter(lower))
    return None


def package_effect(change: dict) -> dict:
    """What one changing NVIDIA package does to the kernels, from its name, the versions APT reports and
    the facts read from its .deb (or, for a removal, its installed file list): ``change["facts"]``.

    Returns {"scope": "kernels"|"all"|"none", "kernels": {release: driver or None}, "driver": str|None,
             "removed": bool, "how": str}. A per-kernel package's version is the KERNEL's, never its driver's:
    the driver comes from the nvidia.ko it ships (modinfo) or its Depends on nvidia-kernel-common; None
    means unknown (the door then removes, fail safe)."""
    name, facts = change["name"], change.get("facts") or {}
    removed = change.get("action") == "**REMOVE**"
    kos = facts.get("modules") or {}                       # {kernel: [module paths]} it ships / has installed
    kernels = set(kos)
    named = kernel_of_package(name)
    if named:
        kernels.add(named)
    readable = bool(facts.get("readable"))
    if kernels:
        pinned = None if removed else driver_of_depends(facts.get("depends"))
        by_ko = facts.get("nvidia_ko") or {}                # {kernel: version of the nvidia.ko it ships}
        drivers = {k: None if removed else (by_ko.get(k) or pinned) for k in sorted(kernels)}
        how = "removed" if removed else ("nvidia.ko" if by_ko else "depends" if pinned else "unknown")
        return {"scope": "kernels", "kernels": drivers, "driver": None, "removed": removed, "how": how}
    if META_RE.match(name):
        if readable:                                        # a meta package: it carries no module
            return {"scope": "none", "kernels": {}, "driver": None, "removed": removed, "how": "no modules"}
        return {"scope": "all", "kernels": {}, "driver": None, "removed": removed, "how": "unreadable"}
    trees = {m.group(1) for t in facts.get("trees") or () if (m := SOURCE_TREE_RE.match(t))}
    drv = None if removed else (upstream_of_deb(change.get("new")) or (next(iter(trees)) if len(trees) == 1
                                                                        else None))
    # read, and it ships no module (Debian's nvidia-open-kernel-dkms, nvidia-kernel-source-*, -common-*): it
    # changes the nvidia.ko only of kernels whose nvidia.ko is not a kernel package's file (DKMS builds it
    # from the source in updates/, or none is known); unread: every kernel (fail safe)
    return {"scope": "all", "kernels": {}, "driver": drv, "removed": removed,
            "applies_to": "not-packaged" if readable else "all",
            "how": "removed" if removed else "package version" if drv else "unknown"}


# A nvidia.ko a package installed into the kernel's own tree (Ubuntu: kernel/nvidia-550-open/), as opposed to
# one DKMS built (updates/dkms/) from a driver-wide source package.
PACKAGED_KO_RE = re.compile(r"^/(?:usr/)?lib/modules/[^/]+/kernel/")


def _wide_applies(k, eff: dict) -> bool:
    if eff.get("applies_to", "all") == "all":
        return True
    path = k.nvidia_selected.path if k.nvidia_selected else None
    return not (path and PACKAGED_KO_RE.match(path))


def assess(snap, changes: list[dict]) -> dict:
    """Before dpkg unpacks: per kernel of the world (model.World), does its NVIDIA driver change in this APT run?

    A kernel's override is removed only when a package for THAT kernel (or a driver-wide one: Debian's
    nvidia-open-kernel-dkms, nvidia-kernel-source-*, nvidia-kernel-common-*, for a kernel whose nvidia.ko
    DKMS builds, or any kernel when the package could not be read) changes its driver away from the one the
    override was built for, removes it, or carries a driver that cannot be read (fail safe). A package for
    another kernel never touches it. Returns {"steps": [Step], "notes": [{"kernel", "kind", "message"}]}
    (steps: removals only; notes: what stays ("kept") and what comes ("new-kernel"), for the door's output)."""
    from spark_memsaver.decide import ours
    from spark_memsaver.decide.step import Step, base_version
    per_kernel: dict[str, list] = {}
    wide: list = []
    for c in changes:
        eff = c.get("effect") or package_effect(c)
        if eff["scope"] == "all":
            wide.append((c["name"], eff["driver"], eff["removed"], eff))
        for k, d in eff["kernels"].items():
            per_kernel.setdefault(k, []).append((c["name"], d, eff["removed"]))
    steps, notes = [], []
    known = {k.release: k for k in snap.kernels}
    for rel, k in known.items():
        sel = k.uvm_selected
        relevant = per_kernel.get(rel, []) + [w[:3] for w in wide if _wide_applies(k, w[3])]
        if not ours.is_ours(sel) or not relevant:      # the one predicate (decide/ours.py)
            continue
        built_for = ours.built_for(sel)
        names = ", ".join(sorted({n for n, _, _ in relevant}))
        gone = [n for n, _, r in relevant if r]
        tos = {d for _, d, r in relevant if not r}
        if not gone and tos == {built_for} and built_for:
            notes.append({"kernel": rel, "kind": "kept",
                          "message": f"{rel}: driver stays {built_for} ({names}): override kept"})
            continue
        to = next(iter(tos)) if len(tos) == 1 and not gone else None
        if gone:
            why = f"APT removes its NVIDIA driver package ({', '.join(sorted(gone))}; override was for {built_for})"
        elif to:
            why = f"APT is changing its NVIDIA driver from {built_for} to {to} ({names})"
        else:
            why = (f"APT is changing its NVIDIA driver from {built_for} to an unknown version ({names}: the "
                   "driver version it carries cannot be read)")
        steps.append(Step("remove-override", rel, why, driver_from=built_for, driver_to=to,
                          code="driver-removed" if gone else "driver-changing"))
    for rel in sorted(set(per_kernel) - set(known)):
        ds = {d for _, d, r in per_kernel[rel] if not r}
        if ds:
            drv = next(iter(ds)) if len(ds) == 1 and None not in ds else "unknown"
            notes.append({"kernel": rel, "kind": "new-kernel",
                          "message": f"new kernel {rel} (driver {drv}): will build after configure"})
    return {"steps": steps, "notes": notes}


def pre_install_plan(snap, changes: list[dict]) -> list:
    """The removals of :func:`assess` (the steps act/executor.py runs before dpkg unpacks)."""
    return assess(snap, changes)["steps"] if changes else []


def door_line(step: dict) -> str:
    """The APT door's line for an executed removal: '6.1.0-47-amd64: driver 550.163.01 → 550.163.02:
    override removed'."""
    k, frm, to = step.get("kernel"), step.get("driver_from") or "unknown", step.get("driver_to")
    if step.get("code") == "driver-removed":
        what = "NVIDIA driver package removed"
    else:
        what = f"driver {frm} \u2192 {to or 'unknown'}"
    return f"{k}: {what}: override " + ("removed" if step.get("ok") else "NOT removed: "
                                         + ((step.get("error") or {}).get("message") or "failed"))
