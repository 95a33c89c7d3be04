"""The override engines: install (prove the override is selected), restore_stock and remove (prove the stock
module is selected again). Take no lock and write no intent (act/executor.py does both)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path


from spark_memsaver.act import signing as sig
from spark_memsaver.decide.ours import built_here, is_ours
from spark_memsaver.errors import MemsaverError, SecureBootUnknown
from spark_memsaver.host import Host, paths, records
from spark_memsaver.observe import modules
from spark_memsaver.observe.dkms import DEST, DKMS_TREE, MODULE, PACKAGE, _SUFFIXES, built_module, installed_version, kernels_of, parse_dkms_version, registered_versions
from spark_memsaver.act.dkms_errors import DkmsMissing, InstallRefused, StockNotRestored, VerificationFailed
from spark_memsaver.act.dkms_run import PATCH_ID, _depmod, _dkms, _noop, _raise_for_dkms, _require_root, _scaled, _uninstall_kernel, _write_json, dkms_version, ensure_host_files, kotool, refresh_initramfs, running_kernel, selected, sha256, shape
from spark_memsaver.act.build import _build_locked, _drop_if_empty, _unbuild
from spark_memsaver.act.render import recover_broken
from spark_memsaver.act.removal import _stock_record, has_dkms, reloads_after, remove_plan, remove_prepare, remove_targets  # noqa: F401


def _stock_record_path(kernel: str) -> str:
    return paths.stock_record(kernel)       # host/paths.py: the one location (safe_name'd)


def record_stock(host: Host, kernel: str, state: dict | None = None) -> dict | None:
    """The ONE writer of the stock record (``paths.stock_record``; host/records.py's "stock" kind; the load-time
    guard reads its stock_path): which stock nvidia-uvm modprobe selects for ``kernel`` before our override.
    Only a stock module is recorded (decide/ours.is_stock): a packing module of any tag (decide/ours.is_ours --
    ``uvm-pt-pack/2`` included) or an unreadable selection never is; the record already there is kept then. The
    same file recorded again keeps its record. Nothing selected: a record without a stock file (when none is
    there yet). The older one-line text record goes once the JSON one names the file. Returns the record now in
    force (None: none). ``state``: world/refresh.kernel as the operation read it last, else read now."""
    from spark_memsaver.world import refresh
    old = _stock_record(host, kernel)
    state = state or refresh.kernel(host, kernel)
    sel = state["uvm"]
    if sel["state"] in ("none", "builtin"):
        rec = old or {"kernel": kernel, "stock_path": None, "stock_sha256": None, "recorded": sig._now()}
    elif not state["is_stock"]:
        return old
    elif old and old.get("stock_path") == sel["path"] and old.get("stock_sha256") == sel.get("sha256"):
        rec = old
    else:
        rec = {"kernel": kernel, "stock_path": sel["path"], "stock_sha256": sel.get("sha256"),
               "stock_version": sel.get("version"),
               "stock_owner_dkms": _other_dkms_owner(host, kernel, sel["path"]) if DEST in sel["path"] else None,
               "recorded": sig._now()}
    if rec is not old:
        _write_json(host, _stock_record_path(kernel), rec)
    if rec.get("stock_path"):
        host.path(paths.legacy_stock_record(kernel)).unlink(missing_ok=True)
    return rec


def _other_dkms_owner(host: Host, kernel: str, path: str) -> dict | None:
    """Another DKMS package's built copy identical to the file at `path` (e.g. Ubuntu's `nvidia` package
    installs nvidia-uvm to the same updates/dkms path)."""
    digest = sha256(host.path(path))
    if digest is None:
        return None
    for cand in host.path(DKMS_TREE).glob(f"*/*/{kernel}/*/module/{MODULE}.ko*"):
        if cand.parts[-6] == PACKAGE:
            continue
        if sha256(cand) == digest:
            return {"package": cand.parts[-6], "version": cand.parts[-5], "copy": str(cand)}
    return None


def verify_installed(host: Host, kernel: str, state: dict | None = None) -> dict:
    """What is selected for `kernel` and whether it is our verified override.

    Returns {"kernel", "selected": path|None, "ours": bool, "installed_version": dkms version|None,
    "matches_dkms_copy": bool, "nvidia": {...}, "ok": bool, "problems": [...], "facts": {...}}.
    ``ok`` means: our module is selected, identical to DKMS's built copy, and passes the same checks
    as the PRE_INSTALL guard against the nvidia.ko selected for that kernel. ``state``: world/refresh.kernel
    read after the step that installed (else read now): what kmod selects, never a cached answer.
    """
    from spark_memsaver.world import refresh
    state = state or refresh.kernel(host, kernel)
    raw = state["uvm"]
    sel, nv = shape(raw), shape(state["nvidia"])
    ver = state["installed"]
    out = {"kernel": kernel, "selected": sel and sel.get("path"), "ours": state["built_here"],
           "state": raw["state"], "installed_version": ver, "nvidia": nv, "matches_dkms_copy": False,
           "ok": False, "problems": []}
    if raw["state"] == "unreadable":
        out["problems"].append(f"the {MODULE} selected for {kernel} cannot be read: {raw.get('error')}")
        return out
    if sel is None:
        out["problems"].append(f"no {MODULE} is selected for {kernel}")
        return out
    if not state["built_here"]:
        out["problems"].append(f"the selected {MODULE} ({sel['path']}) is not ours" if not state["is_ours"] else
                               f"the selected {MODULE} ({sel['path']}) is a packing module this package did not "
                               f"build (tag {sel.get('patch_id')!r}, not {PATCH_ID!r})")
        return out
    built = state["built"].get(ver) if ver else None
    out["matches_dkms_copy"] = bool(built and sha256(built) == sel.get("sha256"))
    if not out["matches_dkms_copy"]:
        out["problems"].append("the selected file differs from DKMS's built copy (another package overwrote it?)")
    driver = state["installed_driver"] or (sel.get("version") or "")
    record = sig.read_record(host)
    signs = None                    # live: verify reads the kernel's config itself (unreadable -> a problem)
    if not host.is_live:            # --root: the fixture kernel's config, never the machine's own
        try:
            signs = sig.kernel_signs(host, kernel)
        except sig.KernelSigningUnknown as e:
            out["problems"].append(e.message)
            signs = True            # unknown is never "does not sign": the signer is still checked
    v = kotool().verify(str(host.path(sel["path"])), kernel, driver,
                        nvidia_ko=str(host.path(nv["path"])) if nv and nv.get("path") else None,
                        signing=record, tag=PATCH_ID, signs=signs)
    out["facts"] = v["facts"]
    out["problems"] += v["problems"]
    out["ok"] = not out["problems"]
    return out


def _install_one(host: Host, config, kernel: str, progress, prep: dict | None = None) -> dict:
    """``prep``: act/installable.prepare's answer for ``kernel`` (read before the operation's first step); the
    host is read again through world/refresh only after a step that changed it."""
    from spark_memsaver.world import refresh
    sb = prep["secure_boot"] if prep else _secure_boot(host)
    if sb.get("state") == "unknown":
        raise SecureBootUnknown("Secure Boot state is unknown: " + (sb.get("reason") or "unreadable")
                                + "; refusing to install a module that might not load")
    b = _build_locked(host, config, kernel, None, _scaled(progress, 0.0, 0.9), False, prep)
    ver = b["dkms_version"]
    progress(0.9, f"installing {PACKAGE}/{ver} for {kernel}")
    unchanged = prep and b["status"] == "already-built" and not b["recovered"]
    state = prep["state"] if unchanged else refresh.kernel(host, kernel)      # the build changed DKMS's tree
    rec = record_stock(host, kernel, state) or {}
    written = ensure_host_files(host)
    if written:
        _depmod(host, kernel)
    if state["installed"] not in (None, ver):
        _uninstall_kernel(host, state["installed"], kernel)
        state = refresh.kernel(host, kernel)
    if state["installed"] != ver:
        # A foreign copy at our path (another DKMS package's nvidia-uvm) is restored on remove from its
        # DKMS tree (recorded above); DKMS itself just overwrites it.
        r = _dkms(host, ["install", "-m", PACKAGE, "-v", ver, "-k", kernel], timeout=900)
        if not r.ok:
            restore_stock(host, kernel)
            _raise_for_dkms(r, f"dkms install {PACKAGE}/{ver} -k {kernel}")
        out = r.stdout + r.stderr
    else:
        out = ""
    now = refresh.kernel(host, kernel)            # a fresh read: what kmod selects after dkms install
    v = verify_installed(host, kernel, now)
    if not v["ok"]:
        refusal = [l for l in out.splitlines() if re.search(r"exactly matches|not newer|will not replace|obsoleted"
                                                            r"|--force", l)]
        if v["installed_version"] == ver:
            _uninstall_kernel(host, ver, kernel)
        restore_stock(host, kernel)
        if refusal or not now["built_here"]:      # the selection verify_installed read
            raise InstallRefused(f"dkms install exited 0 but {PACKAGE}/{ver} is not the selected {MODULE} for "
                                 f"{kernel} (selected: {v['selected']})" + ("; DKMS said: " + " ".join(refusal)
                                                                            if refusal else ""),
                                 selected=v["selected"], dkms_output=refusal)
        raise VerificationFailed(f"the installed override for {kernel} failed verification: "
                                 + "; ".join(v["problems"]), problems=v["problems"])
    _depmod(host, kernel)
    initramfs = refresh_initramfs(host, kernel)
    progress(1.0, f"installed for {kernel}")
    return {"kernel": kernel, "dkms_version": ver, "driver": b["driver"], "build": b["status"],
            "selected": v["selected"], "verification": v, "stock": rec, "initramfs": initramfs,
            "host_files_written": written, "signing": b["signing"], "log": b.get("log")}


def _secure_boot(host: Host) -> dict:
    from spark_memsaver.act import installable
    return installable.secure_boot(host)


def install(host: Host, config, kernel: str | None = None, all_kernels: bool = False, progress=None,
            kernels: list[str] | None = None, skipped: list[dict] | None = None, preps: list | None = None) -> dict:
    """Build (if needed) and install the override; prove it is selected (modinfo -k K -n nvidia-uvm).
    ``kernels``: those the executor chose (act/installable.targets: the one installability decision, for
    --kernel and for each kernel of --all); ``skipped``: the rows of those it refused; ``preps``: for each of
    ``kernels``, act/installable.prepare's answer (read before the first step)."""
    _require_root(host)
    progress = progress or _noop
    if kernels is None:
        if all_kernels:
            from spark_memsaver.act import installable
            decided, skipped = installable.targets(host, config, None, True)
            kernels = [d["kernel"] for d in decided]
        else:
            kernels = [kernel or running_kernel(host)]
    skipped = list(skipped or [])
    results = []
    for i, k in enumerate(kernels):
        prep = preps[i] if preps else None
        if prep and i:            # an earlier kernel's install changed DKMS's tree: this kernel's state read again
            from spark_memsaver.world import refresh
            prep = dict(prep, state=refresh.kernel(host, k))
        results.append(_install_one(host, config, k, _scaled(progress, i / len(kernels), (i + 1) / len(kernels)),
                                    prep))
    return {"installed": results, "skipped": skipped}


def restore_stock(host: Host, kernel: str) -> dict:
    """Make the stock nvidia-uvm the selected one for `kernel` again, whatever DKMS did; verify it. What DKMS left
    is read fresh (world/refresh.kernel) before and after: the files at our install path and at the recorded stock
    path, then what modprobe selects once depmod ran."""
    from spark_memsaver.world import refresh
    rec = _stock_record(host, kernel) or {}
    actions = []
    stock_path, stock_sha = rec.get("stock_path"), rec.get("stock_sha256")
    ours_at = [paths.dkms_installed(kernel, s) for s in _SUFFIXES]
    now = refresh.kernel(host, kernel, files=tuple(ours_at) + ((stock_path,) if stock_path else ()))
    # 1. Any copy of ours left at our install path (DKMS 3.0.x refused/partial runs) goes.
    for path in ours_at:
        f = now["files"].get(path)
        if f is not None and f["built_here"] and now["installed"] is None:
            host.path(path).unlink()
            actions.append(f"removed leftover {path}")
    # 2. The stock file must be back where the driver package put it (DKMS >= 3.1 moves it to
    #    original_module/; 3.1.0-3.1.6 restore it to DEST_MODULE_LOCATION instead of its origin).
    cur_sha = sha256(host.path(stock_path)) if stock_path else None
    replaced = False
    stock_now = now["files"].get(stock_path) if stock_path else None
    if stock_path and stock_sha and cur_sha is not None and cur_sha != stock_sha and \
            not (stock_now is not None and stock_now["is_ours"]):
        # Another stock file stands there now: a driver package replaced it since we recorded it (a driver
        # update, e.g. plain dpkg -i). It is the stock module of the installed driver. Putting the recorded
        # one back would pair the OLD driver's nvidia-uvm with the NEW nvidia.ko: never.
        replaced = True
        actions.append(f"kept {stock_path}: a driver package replaced the recorded stock file since")
    if stock_path and stock_sha and cur_sha != stock_sha and not replaced:
        cands = list(host.path(f"{DKMS_TREE}/{PACKAGE}/original_module/{kernel}").rglob(f"{MODULE}.ko*")) + \
            [host.path(paths.dkms_installed(kernel, s)) for s in _SUFFIXES] + \
            list(host.path(paths.stock_original(kernel)).glob(f"**/{MODULE}.ko*"))
        owner = rec.get("stock_owner_dkms")
        if owner and owner.get("copy"):
            cands.append(Path(owner["copy"]))
        for c in cands:
            if c.is_file() and sha256(c) == stock_sha:
                dst = host.path(stock_path)
                dst.parent.mkdir(parents=True, exist_ok=True)
                tmp = dst.with_name(f".{dst.name}.spark-memsaver-tmp")
                shutil.copy2(c, tmp)
                os.rename(tmp, dst)
                if c.parent != dst.parent and str(c).startswith(str(host.path(f"/lib/modules/{kernel}"))):
                    c.unlink()
                actions.append(f"restored {stock_path} from {c}")
                break
    _depmod(host, kernel)
    now = refresh.kernel(host, kernel)           # the stock module selected again: kmod's answer now
    after = shape(now["uvm"])
    problems = []
    if now["is_ours"]:
        problems.append(f"our module {after['path']} is still selected")
    if stock_path and stock_sha:
        if after is None or after.get("path") != stock_path or (after.get("sha256") != stock_sha and not replaced):
            problems.append(f"the stock {stock_path} is not the selected {MODULE} "
                            f"(selected: {after and after.get('path')})")
    return {"kernel": kernel, "selected": after and after.get("path"), "actions": actions,
            "ok": not problems, "problems": problems, "stock": rec}


def remove(host: Host, config, kernel: str | None = None, all_kernels: bool = False, progress=None,
           prep: dict | None = None) -> dict:
    """Uninstall and unregister our module for the kernel(s); restore and VERIFY the stock module. ``prep``:
    :func:`remove_prepare`'s answer, read before the operation's first step (else read here); DKMS's tree is
    read again (world/refresh) only after the steps that changed it."""
    from spark_memsaver.world import refresh
    _require_root(host)
    progress = progress or _noop
    prep = prep or remove_prepare(host, kernel, all_kernels)
    have_dkms = has_dkms(host)                           # its first dkms run (the plan only looked for it)
    recovered = recover_broken(host, config, prep["registered"]) if have_dkms else []   # and verified by hand;
    if recovered or have_dkms != prep["have_dkms"]:      # DKMS's record waits. A repair changed DKMS's tree:
        prep = remove_prepare(host, kernel, all_kernels, have_dkms)  # what to remove is read again
    done, restored = [], []
    kernels = prep["kernels"]
    for i, k in enumerate(kernels):
        progress(i / max(1, len(kernels)), f"removing from {k}")
        plan = prep["plans"][k]
        for s in plan:
            if s["action"] == "uninstall":
                _uninstall_kernel(host, s["version"], k, prep["built"].get((s["version"], k)))
                done.append({"kernel": k, "dkms_version": s["version"], "action": "uninstalled"})
            elif s["action"] == "unbuild":
                _unbuild(host, s["version"], k)
                done.append({"kernel": k, "dkms_version": s["version"], "action": "unbuilt"})
        res = restore_stock(host, k)
        res["steps"] = [s["action"] for s in plan]
        restored.append(res)
        if not res["ok"]:
            raise StockNotRestored(f"after removing our module from {k}: " + "; ".join(res["problems"]),
                                   kernel=k, actions=res["actions"])
        if "initramfs" in res["steps"]:
            res["initramfs"] = refresh_initramfs(host, k)
            host.path(_stock_record_path(k)).unlink(missing_ok=True)
            host.path(paths.legacy_stock_record(k)).unlink(missing_ok=True)     # an older text one, if any
            shutil.rmtree(host.path(paths.stock_original(k)), ignore_errors=True)
    tree = refresh.dkms(host) if have_dkms else {"registered": [], "kernels": {}}     # after the removals
    for ver in tree["registered"]:
        _drop_if_empty(host, ver, tree["kernels"][ver])
    progress(1.0, "removed")
    return {"removed": done, "restored": restored, "recovered": recovered,
            "registrations_left": refresh.dkms(host)["registered"]}
