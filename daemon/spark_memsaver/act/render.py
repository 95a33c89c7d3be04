"""Rendering our DKMS source tree /usr/src/spark-memsaver-uvm-<ver>/ (only our files), and repairing
registrations whose tree vanished behind DKMS's back."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path


from spark_memsaver import __version__
from spark_memsaver.act import signing as sig
from spark_memsaver.host import Host, paths, records
from spark_memsaver.observe.dkms import DKMS_TREE, PACKAGE, SRC_ROOT, _SUFFIXES, built_module, dkms_version_string, installed_version, kernels_of, parse_dkms_version, registered_versions
from spark_memsaver.decide import policy
from spark_memsaver.act.dkms_run import PATCH_ID, _depmod, data_dir, log, sha256, source_candidates
from spark_memsaver.world.tree import source_tree


def plan_tree(config, driver: str, nvidia_source: str) -> dict:
    """What :func:`render` writes for ``driver``: {"version", "dest", "files": {name: (bytes, mode)}, "meta"}, from
    the configuration, the manifest and our templates only (no host state): an install prepares it before its
    first step (act/installable.prepare)."""
    import jinja2

    from spark_memsaver.act import patch as uvm_patch

    ver = dkms_version_string(driver)
    dest = f"{SRC_ROOT}/{PACKAGE}-{ver}"
    d = data_dir()
    manifest = uvm_patch.load_manifest()
    pyroot = str(Path(__file__).resolve().parents[2])
    values = {
        "package": PACKAGE, "dkms_version": ver, "driver_version": driver, "our_version": __version__,
        "nvidia_source": nvidia_source, "kernels_policy": config.kernels,
        "source_candidates": source_candidates(driver), "pythonpath": pyroot,
        "tier_default": policy.tier_value(config.tier),
        **policy.dkms_build_exclusive(config.kernels),      # the one kernel policy (decide/policy.RULES)
    }
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(d / "templates")), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    files: dict[str, tuple[bytes, int]] = {
        "dkms.conf": (env.get_template("dkms.conf.j2").render(**values).encode(), 0o644),
        "spark-memsaver-build": (env.get_template("spark-memsaver-build.j2").render(**values).encode(), 0o755),
        "spark-memsaver-kotool": ((d / "spark-memsaver-kotool").read_bytes(), 0o755),
    }
    mroot = manifest.root
    for rel in ["manifest.yaml"] + [str(p.relative_to(mroot)) for p in manifest.pool_files] + \
               [str(p.relative_to(mroot)) for ps in manifest.branches.values() for p in ps]:
        files[f"uvm_patch/{rel}"] = ((mroot / rel).read_bytes(), 0o644)
    content = hashlib.sha256()
    for name in sorted(files):
        content.update(name.encode() + b"\0" + files[name][0] + b"\0")
    meta = {"format": 1, "package": PACKAGE, "dkms_version": ver, "driver_version": driver,
            "our_version": __version__, "tier": policy.normalize_tier(config.tier), "tier_default": values["tier_default"],
            "kernels_policy": config.kernels, "nvidia_source": nvidia_source, "patch_id": PATCH_ID,
            "signing_record": sig.RECORD, "content_sha256": content.hexdigest()}
    files["spark-memsaver.json"] = (json.dumps(meta, indent=2).encode() + b"\n", 0o644)
    return {"version": ver, "dest": dest, "files": files, "meta": meta}


def render(host: Host, config, driver: str, nvidia_source: str, planned: dict | None = None) -> dict:
    """Write /usr/src/spark-memsaver-uvm-<ver>/ (only our files; never a link into /usr/src/nvidia-*).
    Atomic (temp dir + rename); unchanged content is left alone. Returns {"version", "path", "changed"}.
    ``planned``: :func:`plan_tree`'s answer for the same arguments, when the caller made it already."""
    planned = planned or plan_tree(config, driver, nvidia_source)
    ver, dest, files, meta = planned["version"], planned["dest"], planned["files"], planned["meta"]
    target = host.path(dest)
    old = records.one(host, "dkms-tree", f"{dest}/spark-memsaver.json")
    if target.is_dir() and not target.is_symlink() and old and old.get("content_sha256") == meta["content_sha256"] \
            and all((target / n).is_file() for n in files):
        return {"version": ver, "path": dest, "changed": False}
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, (data, mode) in files.items():
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.chmod(p, mode)
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    os.rename(tmp, target)
    return {"version": ver, "path": dest, "changed": True}


def recover_broken(host: Host, config, registered: list[str] | None = None) -> list[str]:
    """Registrations whose /usr/src tree vanished (DKMS 3.0.x then fails `status`/`autoinstall` for EVERY
    module): re-render our tree for them so DKMS works again. Returns the versions repaired. ``registered``: the
    versions registered as the operation read them (world/refresh.kernel), else read now."""
    repaired = []
    for ver in registered_versions(host) if registered is None else registered:
        if host.path(f"{SRC_ROOT}/{PACKAGE}-{ver}/dkms.conf").is_file():
            continue
        parsed = parse_dkms_version(ver)
        if parsed is None or parsed[1] != __version__:
            # Not a tree this release can reproduce: drop DKMS's record of it without running dkms
            # (which would fail on it), after taking back any file it installed.
            _forget_registration(host, ver)
            repaired.append(ver)
            continue
        drv = parsed[0]
        src = source_tree(host, drv) or source_candidates(drv)[0]          # world/tree.py: the one tree
        render(host, config, drv, src)
        repaired.append(ver)
        log.warning("re-created %s/%s-%s (it was deleted behind DKMS's back)", SRC_ROOT, PACKAGE, ver)
    return repaired


def _forget_registration(host: Host, ver: str, kernels: list[str] | None = None) -> None:
    """DKMS's record of ``ver`` taken away by hand (``kernels``: those built for it, as last read; else read)."""
    for kernel in kernels_of(host, ver) if kernels is None else kernels:
        if installed_version(host, kernel) == ver:
            built = built_module(host, ver, kernel)
            for s in _SUFFIXES:
                inst = host.path(paths.dkms_installed(kernel, s))
                if inst.is_file() and built is not None and sha256(inst) == sha256(built):
                    inst.unlink()
            for link in host.path(f"{DKMS_TREE}/{PACKAGE}").glob(f"kernel-{kernel}-*"):
                link.unlink()
            _depmod(host, kernel)
    shutil.rmtree(host.path(f"{DKMS_TREE}/{PACKAGE}/{ver}"), ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Build
