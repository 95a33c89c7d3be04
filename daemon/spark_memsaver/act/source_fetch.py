"""Getting an NVIDIA driver's open kernel-module source into our cache, at exactly the installed version.

    fetch(host, config, driver_version, progress=None, keep=None) -> dict
    prune(host, keep) -> dict
    defer(host, driver_version, kernel, reason) / clear_pending(host, driver_version)

fetch: the exact package version is taken from APT's lists (observe/sources.py, decide/sources.py); then
``apt-get download <package>=<version>`` into a private staging directory under the cache (0700), the .deb's
SHA256 and size checked against the lists' fields, ``dpkg-deb -x`` into the staging directory (Debian's
tarball package: its nvidia-open-kernel.tar.xz unpacked with tar), the tree's own version (its Kbuild) checked,
a record written inside the tree, and the tree moved into place with one rename. Nothing is installed: no
package, no dpkg database change, no dpkg lock (apt-get download takes none). On any failure the staging
directory is removed: nothing is kept. Called by act/steps.py (plan step ``fetch-source``) inside
executor.perform, which holds the lifecycle lock, so two fetches never race.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from spark_memsaver.decide import sources as dsrc
from spark_memsaver.errors import (MemsaverError, SourceChecksumMismatch, SourceDownloadFailed,
                                   SourceFetchDisabled, SourceFetchError, SourceNotInLists, SourceUnpackFailed)
from spark_memsaver.host import Host, paths
from spark_memsaver.host.fsutil import atomic_write, sha256_file
from spark_memsaver.observe import sources as osrc

DOWNLOAD_TIMEOUT = 1800.0
UNPACK_TIMEOUT = 600.0


def _say(progress, frac: float, msg: str) -> None:
    if progress is not None:
        try:
            progress(frac, msg)
        except Exception:
            pass


def _candidates(host: Host, driver_version: str) -> tuple[list[dict], dict[str, str]]:
    installed = osrc.installed_packages(host)
    return dsrc.source_package(driver_version, {**osrc.os_release(host), "installed": installed}), installed


def resolve(host: Host, driver_version: str) -> dict:
    """The exact package and version to fetch: {"package", "deb_version", "in_lists", "lists_known"}."""
    cands, installed = _candidates(host, driver_version)
    lists = osrc.offered(host, sorted({c["package"] for c in cands}))
    chosen = dsrc.choose(driver_version, cands, lists or {}, installed)
    return {**chosen, "in_lists": bool(chosen["in_lists"]) and lists is not None, "lists_known": lists is not None,
            "candidates": [c["package"] for c in cands]}


def _remedy_for(chosen: dict) -> str | None:
    if chosen.get("package") and chosen.get("deb_version"):
        return dsrc.install_command(chosen["package"], chosen["deb_version"])
    return None


def present(host: Host, driver_version: str) -> str | None:
    """The path of a usable tree of ``driver_version`` already on the host (/usr/src or the cache): the one
    find_driver_source would build from (the same completeness rule, act/dkms_run.tree_problem)."""
    from spark_memsaver.act.dkms_run import complete_source
    return complete_source(host, driver_version)


def verify_deb(deb: Path, fields: dict) -> str:
    """The .deb's SHA256 (and Size, when the lists carry it) must equal the lists' fields; returns the sha256."""
    want = (fields.get("SHA256") or "").lower()
    if not want:
        raise SourceChecksumMismatch(f"APT's lists carry no SHA256 for {fields.get('Package')} "
                                     f"{fields.get('Version')}: the download cannot be verified, nothing was kept")
    got = sha256_file(deb)
    size = fields.get("Size")
    if got != want or (size and size.isdigit() and deb.stat().st_size != int(size)):
        raise SourceChecksumMismatch(f"{deb.name}: sha256 {got} (size {deb.stat().st_size}) does not match APT's "
                                     f"lists ({want}, size {size}); nothing was kept")
    return got


def _find_tree(root: Path, driver_version: str, depth: int = 4) -> Path | None:
    """The directory under ``root`` that is an open kernel-module tree (Kbuild + nvidia-uvm/), shallowest first."""
    level = [root]
    for _ in range(depth + 1):
        nxt = []
        for d in level:
            if (d / "Kbuild").is_file() and (d / "nvidia-uvm").is_dir():
                return d
            try:
                nxt += sorted(p for p in d.iterdir() if p.is_dir() and not p.is_symlink())
            except OSError:
                pass
        level = nxt
    return None


def _unpack(host: Host, deb: Path, staging: Path, driver_version: str) -> Path:
    from spark_memsaver.act import patch as uvm_patch
    out = staging / "root"
    r = host.run(["dpkg-deb", "-x", str(deb), str(out)], timeout=UNPACK_TIMEOUT)
    if not r.ok:
        raise SourceUnpackFailed(f"dpkg-deb -x {deb.name} failed: {(r.stderr or r.stdout).strip()[-300:]}")
    tree = _find_tree(out / "usr/src", driver_version)
    if tree is None:
        tarballs = sorted((out / "usr/src").glob("*.tar*")) if (out / "usr/src").is_dir() else []
        if tarballs:
            t = staging / "tar"
            t.mkdir()
            r = host.run(["tar", "-x", "-f", str(tarballs[0]), "-C", str(t), "--no-same-owner"],
                         timeout=UNPACK_TIMEOUT)
            if not r.ok:
                raise SourceUnpackFailed(f"unpacking {tarballs[0].name} from {deb.name} failed: "
                                         f"{(r.stderr or r.stdout).strip()[-300:]}")
            tree = _find_tree(t, driver_version)
    if tree is None:
        raise SourceUnpackFailed(f"{deb.name} holds no NVIDIA open kernel-module tree (no Kbuild beside "
                                 "nvidia-uvm/ under /usr/src)")
    try:
        v = uvm_patch.read_tree_version(tree)
    except uvm_patch.SourceTreeInvalid as e:
        raise SourceUnpackFailed(f"{deb.name}: {e.message}") from None
    if v != driver_version:
        raise SourceUnpackFailed(f"{deb.name} holds NVIDIA {v}, not {driver_version}")
    return tree


def _place(host: Host, tree: Path, driver_version: str) -> str:
    """Move the verified tree to paths.source_tree(driver_version) with one rename (an old one set aside first)."""
    dest_name = paths.source_tree(driver_version)
    dest = host.path(dest_name)
    if dest.exists() or dest.is_symlink():
        aside = dest.with_name(f".staging-old-{os.urandom(4).hex()}")
        os.rename(dest, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(tree, dest)
    return dest_name


def fetch(host: Host, config, driver_version: str, progress=None, keep: set[str] | None = None) -> dict:
    """Download, verify and unpack ``driver_version``'s source into the cache (see the module doc).
    ``keep``: the installed drivers; when given, the cache is pruned to them (plus this one) afterwards.
    Raises a SourceFetchError subclass (named, with a remedy); a file-system error (full disk, permissions) is
    one too, and leaves nothing behind but what prune() removes."""
    try:
        return _fetch(host, config, driver_version, progress, keep)
    except OSError as e:
        raise SourceFetchError(f"fetching the source of NVIDIA {driver_version} into {paths.SOURCES_CACHE} "
                               f"failed: {e.strerror or e}{f' ({e.filename})' if e.filename else ''}; nothing was kept",
                               remedy=f"Check the free space and permissions of {paths.SOURCES_CACHE}, then retry "
                               "(sudo spark-memsaver reconcile).", driver=driver_version) from None


def _fetch(host: Host, config, driver_version: str, progress, keep: set[str] | None) -> dict:
    t0 = time.monotonic()
    if not dsrc.DRIVER_RE.match(driver_version or ""):
        raise SourceNotInLists(f"{driver_version!r} is not an NVIDIA driver version")
    have = present(host, driver_version)
    if have:
        clear_pending(host, driver_version)
        return {"ok": True, "status": "present", "driver": driver_version, "path": have}
    chosen = resolve(host, driver_version)
    cmd = _remedy_for(chosen)
    if getattr(config, "source_fetch", "auto") == "never":
        raise SourceFetchDisabled(
            f"the NVIDIA {driver_version} open kernel-module source is missing and source_fetch is 'never'",
            remedy=(f"Run '{cmd}', or set source_fetch: auto in /etc/spark-memsaver/config.yaml." if cmd else
                    f"Install the open kernel-module source of NVIDIA {driver_version} "
                    f"({' or '.join(chosen['candidates'][:2])} at that version)."), driver=driver_version)
    if not chosen["lists_known"]:
        raise SourceNotInLists(f"APT's lists cannot be read on this host, so the source of NVIDIA {driver_version} "
                               "cannot be fetched", remedy="Run this on the node itself (APT installed, lists "
                               "updated); or install the source package there.", driver=driver_version)
    if not chosen["in_lists"]:
        where = f"{chosen['package']} {chosen['deb_version']}" if cmd else \
            f"a version {driver_version} of {', '.join(chosen['candidates'])}"
        raise SourceNotInLists(f"APT's lists do not offer {where} (the source of the installed NVIDIA driver "
                               f"{driver_version})", remedy=(f"Run 'sudo apt-get update', then '{cmd}'; if APT still "
                               "cannot find it, enable the repository that carries that exact version."
                               if cmd else None), driver=driver_version, package=chosen["package"],
                               deb_version=chosen["deb_version"])
    pkg, ver = chosen["package"], chosen["deb_version"]
    fields = osrc.package_record(host, pkg, ver)
    if not fields:
        raise SourceNotInLists(f"apt-cache show {pkg}={ver} gives no record", remedy=f"Run '{cmd}'.")
    base = host.path(paths.SOURCES_CACHE)
    base.mkdir(parents=True, exist_ok=True, mode=0o755)
    staging = Path(base / f".staging-{os.urandom(6).hex()}")
    staging.mkdir(mode=0o700)
    try:
        _say(progress, 0.05, f"downloading {pkg} {ver}")
        opts = osrc.apt_options(host) or []
        dl = staging / "deb"
        dl.mkdir(mode=0o700)
        try:
            # APT::Sandbox::User=root: apt would drop to _apt for the download, which needs CAP_SETUID/SETGID;
            # spark-memsaverd's unit has neither (its sandbox is the boundary), and the staging directory is
            # root-only 0700 anyway. The .deb is verified against the lists' SHA256 below either way.
            r = host.run(["apt-get", *opts, "-o", "APT::Sandbox::User=root", "-q", "download", f"{pkg}={ver}"],
                         cwd=str(dl), timeout=DOWNLOAD_TIMEOUT)
        except MemsaverError as e:
            raise SourceDownloadFailed(f"apt-get download {pkg}={ver}: {e.message}", remedy=f"Retry, or run '{cmd}'.")
        out = (r.stderr or "") + (r.stdout or "")
        if not r.ok:
            cls = SourceChecksumMismatch if ("Hash Sum mismatch" in out or "Size mismatch" in out
                                             or "Hashes of expected file" in out) else SourceDownloadFailed
            lines = [x.strip() for x in out.strip().splitlines() if x.strip()]
            tail = " | ".join([x for x in lines if x.startswith("E:")][:2] or lines[-3:])
            raise cls(f"apt-get download {pkg}={ver} failed (exit {r.returncode}): {tail}; nothing was kept",
                      **({} if cls is SourceChecksumMismatch else {"remedy": f"Check the network and the "
                                                                  f"repository, then retry; or run '{cmd}'."}))
        debs = sorted(dl.glob("*.deb"))
        if len(debs) != 1:
            raise SourceDownloadFailed(f"apt-get download {pkg}={ver} left {len(debs)} .deb files",
                                       remedy=f"Run '{cmd}'.")
        sha = verify_deb(debs[0], fields)
        _say(progress, 0.5, f"unpacking {debs[0].name}")
        tree = _unpack(host, debs[0], staging, driver_version)
        size = osrc._tree_bytes(tree)
        rec = {"format": 1, "driver": driver_version, "package": pkg, "deb_version": ver, "sha256": sha,
               "deb_bytes": debs[0].stat().st_size, "bytes": size, "fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                            time.gmtime())}
        atomic_write(tree / osrc.RECORD, json.dumps(rec, indent=2) + "\n", 0o644)
        dest = _place(host, tree, driver_version)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    clear_pending(host, driver_version)
    pruned = prune(host, set(keep) | {driver_version}) if keep is not None else None
    _say(progress, 1.0, f"NVIDIA {driver_version} source in {dest}")
    return {"ok": True, "status": "fetched", "driver": driver_version, "package": pkg, "deb_version": ver,
            "sha256": sha, "path": dest, "bytes": size, "seconds": round(time.monotonic() - t0, 2),
            **({"pruned": pruned["removed"]} if pruned else {})}


def prune(host: Host, keep: set[str]) -> dict:
    """Keep only the cached trees of ``keep`` (the installed drivers); remove the rest and any staging leftovers.
    Callers hold the lifecycle lock (no fetch runs meanwhile). A tree is renamed aside before it is deleted,
    so a half-deleted one never looks usable."""
    removed, kept = [], []
    for e in osrc.cache_entries(host):
        if e["driver"] in keep:
            kept.append(e["driver"])
            continue
        p = host.path(e["path"])
        aside = p.with_name(f".staging-prune-{os.urandom(4).hex()}")
        try:
            os.rename(p, aside)
        except OSError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
        removed.append(e["driver"])
    from spark_memsaver.host import staging
    staging.sweep(host)
    return {"removed": removed, "kept": kept}


# --- a fetch deferred past apt/dpkg (inside the APT/dpkg doors apt holds its locks) --------------------

def defer(host: Host, driver_version: str, kernel: str | None, reason: str) -> dict:
    rec = osrc.pending(host) or {}
    drivers = [d for d in rec.get("drivers", []) if isinstance(d, str)]
    if driver_version not in drivers:
        drivers.append(driver_version)
    rec = {"format": 1, "drivers": drivers, "kernel": kernel, "reason": reason,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write(host.path(paths.SOURCES_PENDING), json.dumps(rec, indent=2) + "\n", 0o644)
    return rec


def clear_pending(host: Host, driver_version: str | None = None) -> None:
    rec = osrc.pending(host)
    if rec is None:
        return
    left = [d for d in rec.get("drivers", []) if driver_version is not None and d != driver_version]
    p = host.path(paths.SOURCES_PENDING)
    try:
        if left:
            atomic_write(p, json.dumps({**rec, "drivers": left}, indent=2) + "\n", 0o644)
        else:
            p.unlink()
    except FileNotFoundError:
        pass


# --- the plan step and reconcile's pruning (act/steps.py, act/executor.py) ------------------------------

def _inside_apt(host: Host) -> int | None:
    """pid of the apt/dpkg that holds the dpkg locks (the APT/dpkg doors run inside it), else None."""
    from spark_memsaver.host.locks import dpkg_running
    return dpkg_running(host)


def run_step(host: Host, config, step, snap, problems: list, progress=None) -> dict:
    """Plan step ``fetch-source`` (kernel, driver): fetch, or -- inside the APT/dpkg doors, where apt holds its
    locks -- record the fetch as pending for the daemon to run once apt has exited (service/daemon.py). The
    kernel stays on the stock module meanwhile (the pre-install door removed ours; the build waits). A failed
    fetch leaves a rollback record with its code and exact remedy, so status says why the kernel is stock."""
    from spark_memsaver.act import records_io as rio
    driver = getattr(step, "driver", None) or step.driver_to
    pid = _inside_apt(host)
    if pid:
        defer(host, driver, step.kernel, f"apt/dpkg (pid {pid}) holds its locks")
        return {"ok": True, "deferred": True, "driver": driver,
                "reason": f"apt/dpkg (pid {pid}) is running: the source of NVIDIA {driver} is fetched by "
                          "spark-memsaverd once it exits"}
    keep = set(_installed_drivers(snap)) if snap else None
    try:
        return fetch(host, config, driver, progress=progress, keep=keep)
    except MemsaverError as e:
        if step.kernel:
            rio.write_rollback(host, step.kernel, f"the source of NVIDIA {driver} could not be fetched: {e.message}",
                               problems, code=e.code, remedy=e.remedy or "", driver_from=step.driver_from,
                               driver_to=driver)
        return {"ok": False, "driver": driver, "error": e.to_dict()}


def _installed_drivers(snap) -> list[str]:
    """observe/sources.installed_drivers over a world (model.World)."""
    return osrc.installed_drivers(snap.driver.as_json(), [k.as_json() for k in snap.kernels])


def prune_installed(host: Host, snap) -> dict | None:
    """After a reconcile (act/executor.py): outside apt/dpkg, that reconcile was the run a deferred fetch waited
    for, so the pending record is consumed (a failed fetch left its rollback record; the daemon never loops on
    it); then keep the cached trees of the installed drivers only. Both are skipped while apt/dpkg runs (the
    installed set is changing); pruning also when a kernel's nvidia.ko cannot be read (its driver is unknown)."""
    from spark_memsaver.host import staging
    staging.sweep(host)     # a killed fetch's leftover, whatever else happens (the caller holds the lock)
    if not snap or _inside_apt(host):
        return None
    clear_pending(host)
    if not osrc.cache_entries(host):
        return None
    if any(k.nvidia_selected and k.nvidia_selected.error for k in snap.kernels):
        return None
    # a driver whose source package is installed now (/usr/src, found first by the build) needs no cached copy;
    # a leftover there that the build would refuse (act/dkms_run.tree_problem) does not count
    from spark_memsaver.act.dkms_run import complete_source
    keep = {v for v in _installed_drivers(snap)
            if complete_source(host, v, cache=False) is None}
    return prune(host, keep)
