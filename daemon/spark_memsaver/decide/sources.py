"""Which package carries an NVIDIA driver's open kernel-module source, and the exact command that installs it.
Pure: no I/O (observe/sources.py reads APT and the cache; :func:`section` decides World.driver_sources over
its facts; act/source_fetch.py downloads).

Layouts that exist (package -> where its tree lands):
  Ubuntu (archive, DGX OS)  nvidia-kernel-source-<branch>-open         /usr/src/nvidia-<version>/
                            nvidia-kernel-source-<branch>-server-open  /usr/src/nvidia-<version>/  (server branch:
                                                                       modules in kernel/nvidia-<branch>srv-open/)
  NVIDIA's CUDA repository nvidia-kernel-source-open                 /usr/src/nvidia-<version>/  (branch 590 on:
  (590 and later)                                                    names without the branch; 580 as Ubuntu)
  Debian (contrib)          nvidia-open-kernel-dkms                    /usr/src/nvidia-current-open-<version>/
                            nvidia-open-kernel-source                  /usr/src/nvidia-open-kernel.tar.xz (a tarball)

A Debian package version is ``[epoch:]upstream[-revision]``; the driver version is the upstream part:
``580.178.04-0ubuntu0.24.04.1`` -> ``580.178.04``, ``1:550.163.01-4`` -> ``550.163.01``.
"""

from __future__ import annotations

import re

from spark_memsaver.versions import DEB_VERSION_RE, DRIVER_RE, driver_of_deb  # noqa: F401
# Debian policy 5.6.1 (package names) and 5.6.12 (versions): what an argument of apt-get may contain.
PACKAGE_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")

UBUNTU = "ubuntu"
UBUNTU_SERVER = "ubuntu-server"
NVIDIA_REPO = "nvidia-repo"
DEBIAN_DKMS = "debian-dkms"
DEBIAN_TARBALL = "debian-tarball"


def branch_of(driver_version: str) -> str:
    """The ONE driver version -> branch ('580.142' -> '580'): package names, the modules' directories."""
    return driver_version.split(".", 1)[0]


driver_of = driver_of_deb     # the one Debian version -> driver version (versions.py)


def _family(layout: dict) -> str | None:
    """'ubuntu', 'debian' or None (unknown) from os-release's ID / ID_LIKE."""
    ids = [str(layout.get("os_id") or "").lower()] + [s.lower() for s in str(layout.get("os_id_like") or "").split()]
    if "ubuntu" in ids:
        return "ubuntu"
    if "debian" in ids:
        return "debian"
    return None


def _kos(layout: dict) -> list[str]:
    ko = layout.get("nvidia_ko")
    return [str(k) for k in (ko if isinstance(ko, (list, tuple)) else [ko]) if k]


def _packaging(layout: dict, branch: str) -> str | None:
    """'ubuntu' or 'debian' from how the driver is installed, which outranks os-release: Ubuntu's precompiled
    layout (nvidia-kernel-common-<branch>[-server], linux-modules/objects-nvidia-*, or the stock nvidia.ko in
    kernel/nvidia-<branch>[srv]-open/) or Debian's DKMS packages. None when nothing says."""
    inst = layout.get("installed") or {}
    if (f"nvidia-kernel-common-{branch}" in inst or f"nvidia-kernel-common-{branch}-server" in inst
            or any(p.startswith(("linux-modules-nvidia-", "linux-objects-nvidia-")) for p in inst)
            or any(re.search(rf"/kernel/nvidia-{re.escape(branch)}(?:srv)?-open/", ko) for ko in _kos(layout))):
        return "ubuntu"
    if any(p in inst for p in ("nvidia-open-kernel-dkms", "nvidia-kernel-dkms", "nvidia-open-kernel-source")):
        return "debian"
    return None


def server_flavour(layout: dict, branch: str) -> bool:
    """The ONE rule for Ubuntu's server flavour (its packages end in -server: the source
    nvidia-kernel-source-<branch>-server-open, the modules linux-modules-nvidia-<branch>-server-open-<K>): a stock
    nvidia.ko in kernel/nvidia-<branch>srv-open/ (``layout["nvidia_ko"]``: one path or several), or the installed
    common package nvidia-kernel-common-<branch>-server."""
    if any(f"/nvidia-{branch}srv" in ko for ko in _kos(layout)):
        return True
    return any(p == f"nvidia-kernel-common-{branch}-server" for p in layout.get("installed", {}) or {})


def search_packages(driver_version: str) -> list[str]:
    """The packages that may carry ``driver_version``'s open tree on Ubuntu and from NVIDIA's repository (the
    unbranched name of branch 590 on), for a remedy that must name them without knowing the layout."""
    return [c["package"] for c in source_package(driver_version) if c["layout"] in (UBUNTU, UBUNTU_SERVER,
                                                                                     NVIDIA_REPO)]


def source_package(driver_version: str, layout: dict | None = None) -> list[dict]:
    """Candidate source packages for ``driver_version``, most likely first. ``layout``: {"os_id", "os_id_like"
    (os-release), "nvidia_ko" (path of the stock nvidia.ko), "installed" ({package: deb version} of the NVIDIA
    packages dpkg has)}; missing keys mean unknown. Each entry: {"package", "layout", "tree" (where the tree
    lands under /usr/src, or None for a tarball), "tarball" (or None)}."""
    layout = layout or {}
    if not DRIVER_RE.match(driver_version or ""):
        return []
    br = branch_of(driver_version)
    ubuntu = [{"package": f"nvidia-kernel-source-{br}-open", "layout": UBUNTU,
               "tree": f"/usr/src/nvidia-{driver_version}", "tarball": None},
              {"package": f"nvidia-kernel-source-{br}-server-open", "layout": UBUNTU_SERVER,
               "tree": f"/usr/src/nvidia-{driver_version}", "tarball": None}]
    if server_flavour(layout, br):
        ubuntu.reverse()
    ubuntu.append({"package": "nvidia-kernel-source-open", "layout": NVIDIA_REPO,
                   "tree": f"/usr/src/nvidia-{driver_version}", "tarball": None})
    debian = [{"package": "nvidia-open-kernel-dkms", "layout": DEBIAN_DKMS,
               "tree": f"/usr/src/nvidia-current-open-{driver_version}", "tarball": None},
              {"package": "nvidia-open-kernel-source", "layout": DEBIAN_TARBALL,
               "tree": None, "tarball": "/usr/src/nvidia-open-kernel.tar.xz"}]
    # an Ubuntu-shaped driver on a Debian system (or the reverse) takes its own family's source package:
    # Debian's nvidia-open-kernel-dkms there would add a second, DKMS-built driver beside the precompiled one
    family = _packaging(layout, br) or _family(layout)
    return debian + ubuntu if family == "debian" else ubuntu + debian


def install_command(package: str, deb_version: str) -> str:
    """The exact command that installs that version, e.g.
    ``sudo apt-get install nvidia-kernel-source-580-open=580.178.04-0ubuntu0.24.04.1``."""
    if not PACKAGE_RE.match(package or "") or not DEB_VERSION_RE.match(deb_version or ""):
        raise ValueError(f"not a package name and version: {package!r} {deb_version!r}")
    return f"sudo apt-get install {package}={deb_version}"


def choose(driver_version: str, candidates: list[dict], offered: dict[str, list[str]],
           installed: dict[str, str] | None = None) -> dict:
    """The exact package and version to get ``driver_version``'s source from.

    ``offered``: {package: [deb versions APT's lists carry, newest first]} for the candidates' packages (None:
    the lists could not be read). ``installed``: {package: deb version} from dpkg (the driver's other packages).
    Returns {"package", "deb_version", "in_lists"}: the first candidate (in preference order) whose lists carry a
    version of exactly this driver (the newest such); else a version inferred from the installed sibling
    package of the same source (Ubuntu builds nvidia-kernel-common-<branch> and nvidia-kernel-source-<branch>-open
    from one source at one version) with in_lists False; else package and deb_version None."""
    for c in candidates:
        for v in (offered or {}).get(c["package"], []) or []:
            if driver_of(v) == driver_version:
                return {"package": c["package"], "deb_version": v, "in_lists": True}
    br = branch_of(driver_version) if DRIVER_RE.match(driver_version or "") else None
    for c in candidates:
        sibling = {UBUNTU: f"nvidia-kernel-common-{br}", UBUNTU_SERVER: f"nvidia-kernel-common-{br}-server",
                   NVIDIA_REPO: "nvidia-kernel-common"}.get(c["layout"])
        v = (installed or {}).get(sibling) if sibling else None
        if v and driver_of(v) == driver_version and DEB_VERSION_RE.match(v):
            return {"package": c["package"], "deb_version": v, "in_lists": False}
    return {"package": None, "deb_version": None, "in_lists": False}


def entry(driver_version: str, mode: str, present: dict | None, chosen: dict, lists_known: bool) -> dict:
    """One ``by_driver`` entry of World.driver_sources (see observe/sources.py)."""
    pkg, dv = chosen.get("package"), chosen.get("deb_version")
    in_lists = bool(chosen.get("in_lists")) and lists_known
    remedy = install_command(pkg, dv) if pkg and dv else None
    return {"present": present is not None, "path": (present or {}).get("path"),
            "origin": (present or {}).get("origin"),
            "package": pkg, "deb_version": dv, "in_lists": in_lists,
            "fetchable": present is None and mode == "auto" and in_lists,
            "remedy": None if present is not None else remedy}


def candidates(facts: dict) -> dict[str, list[dict]]:
    """{driver version: its source packages, in preference order} for each installed driver whose source is
    missing (``facts``: observe/sources.facts)."""
    return {v: source_package(v, facts["layouts"][v]) for v in facts["missing"]}


def packages_to_ask(facts: dict) -> list[str]:
    """The packages whose versions APT's lists must be asked for (observe/sources.offered)."""
    return sorted({c["package"] for cs in candidates(facts).values() for c in cs})


def section(facts: dict, lists: dict | None, apt_known: bool) -> dict:
    """World.driver_sources: the mode, the cache, and per installed driver where its source is or how to get it.
    ``lists``: what APT's lists offer for :func:`packages_to_ask` (None: they could not be read);
    ``apt_known``: whether this host's APT state can be read at all."""
    mode, trees, entries, installed = facts["mode"], facts["trees"], facts["entries"], facts["installed"]
    cands = candidates(facts)
    by_driver = {}
    for v in facts["versions"]:
        tree = next((t for t in trees if t.get("version") == v), None)
        present = {"path": tree["path"], "origin": tree.get("origin", "usr-src")} if tree else None
        chosen = choose(v, cands.get(v, []), lists or {}, installed) if tree is None else \
            {"package": None, "deb_version": None, "in_lists": False}
        if tree is not None:
            rec = next((e for e in entries if e["path"] == tree["path"]), None)
            if rec:
                chosen = {"package": rec.get("package"), "deb_version": rec.get("deb_version"), "in_lists": False}
        by_driver[v] = entry(v, mode, present, chosen, lists_known=lists is not None)
    return {"mode": mode, "apt": "read" if apt_known else "unknown", "cache": facts["cache"],
            "by_driver": by_driver, "pending": facts["pending"]}
