"""The ONE door through which acting code reads the host again once an operation has begun (issue 34, item 3).

An operation observes the world once (world.facts) and plans; its engines (act/build.py, act/override.py) act
from that world and from what was prepared before the first step (act/installable.prepare). A fact that a
mutating step changed -- DKMS's tree after ``dkms build``/``uninstall``, the module modprobe selects after
``dkms install`` and depmod -- is read again only here, by an explicit call after that step:

    kernel(host, K)   what modprobe selects for K (observe/modules.selection: nvidia-uvm with its digest, the
                      nvidia.ko beside it, ``versions_match``), the verdicts over it (decide/ours: ``built_here``,
                      ``is_ours``, ``is_stock``) and our DKMS registration for K (observe/dkms: registered versions,
                      the installed one and the driver it was built for, each version's built module), and
                      module files asked for by path (restore_stock: what stands at our install path now)
    dkms(host)        our DKMS registrations alone (after a removal: which versions are left, built for whom)

The version-match check before ours is recorded as installed is such a read, fresh from kmod (never cached): a
patched nvidia-uvm is never taken for installed beside a different driver's nvidia.ko. tests/test_observe_once.py
counts the returns from act/ to a lower layer while an install runs."""

from __future__ import annotations


def kernel(host, kernel: str, files: tuple = ()) -> dict:
    """The state of ``kernel``'s module selection and of our DKMS registration for it, read now (see above).
    ``files``: module files (host paths) to read too, each one that exists: "files" {path: its fields
    (observe/modules.read_file) with the verdicts ``built_here`` and ``is_ours``}."""
    from spark_memsaver.decide import ours
    from spark_memsaver.observe import dkms as odkms
    from spark_memsaver.observe import modules

    sel = modules.selection(host, kernel, digest=True)
    registered = odkms.registered_versions(host)
    installed = odkms.installed_version(host, kernel)
    parsed = odkms.parse_dkms_version(installed) if installed else None
    return {"kernel": kernel, "uvm": sel, "nvidia": sel["nvidia"], "versions_match": sel["versions_match"],
            "described": modules.describe(sel), "built_here": ours.built_here(sel), "is_ours": ours.is_ours(sel),
            "is_stock": ours.is_stock(sel), "registered": registered, "installed": installed,
            "installed_driver": parsed[0] if parsed else None,
            "built": {v: odkms.built_module(host, v, kernel) for v in registered},
            "build_dirs": [v for v in registered if kernel in odkms.kernels_of(host, v)],
            "files": {p: _verdicts(modules.read_file(host, p)) for p in files if host.path(p).is_file()}}


def _verdicts(f: dict) -> dict:
    from spark_memsaver.decide import ours
    return dict(f, built_here=ours.built_here(f), is_ours=ours.is_ours(f))


def dkms(host) -> dict:
    """Our DKMS registrations read now: {"registered": [versions], "kernels": {version: [kernels built]}}."""
    from spark_memsaver.observe import dkms as odkms

    registered = odkms.registered_versions(host)
    return {"registered": registered, "kernels": {v: odkms.kernels_of(host, v) for v in registered}}
