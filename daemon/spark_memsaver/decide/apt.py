"""APT's DPkg::Pre-Install-Pkgs protocol (versions 1-3) and the door's plan. Pure; no I/O.

Which NVIDIA driver packages an APT run changes, and which kernels' overrides must go before dpkg unpacks
them (act/executor.py acts on the plan, op "apt-pre-install").
"""

from __future__ import annotations

import re

from spark_memsaver.errors import UsageError

DRIVER_VERSION_RE = re.compile(r"^\d{3}\.\d{1,3}(?:\.\d{1,3})?$")


def upstream_of_deb(v: str | None) -> str | None:
    """Debian package version -> upstream driver version: '1:555.58.02-1' -> '555.58.02' (or None)."""
    if not v or v == "-":
        return None
    v = v.split(":", 1)[-1]
    up = v.rsplit("-", 1)[0] if "-" in v else v
    up = re.split(r"[+~]", up, maxsplit=1)[0]
    return up if DRIVER_VERSION_RE.match(up) else None



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


def pre_install_plan(snap: dict, changes: list[dict]) -> list:
    """Before dpkg unpacks: remove our override from every kernel whose driver is about to change.

    A kernel keeps its override only when every changing driver package names a driver version and it
    equals the one the override was built for (a re-install or a packaging-only bump).
    """
    from spark_memsaver.decide.plan import Step, base_version
    if not changes:
        return []
    new_versions = {c["new_driver"] for c in changes}
    names = ", ".join(sorted({c["name"] for c in changes}))
    steps = []
    for k in snap.get("kernels", []):
        sel = k.get("uvm_selected") or {}
        if not sel.get("patched"):
            continue
        built_for = base_version(sel.get("version"))
        if new_versions == {built_for}:
            continue
        to = next(iter(new_versions)) if len(new_versions) == 1 else None
        steps.append(Step("remove-override", k["release"],
                          f"APT is about to change the NVIDIA driver ({names}) from {built_for} to "
                          f"{to or 'another version'}", driver_from=built_for, driver_to=to))
    return steps
