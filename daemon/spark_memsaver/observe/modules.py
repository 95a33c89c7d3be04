"""The ONE reader of "which nvidia-uvm does modprobe select for kernel K, and is it ours".

observe (the snapshot), the build/install/remove verification (act/override.py) and the lifecycle's checks
(act/steps.py) all read the selection here, so they give the same answer. The rule is the one the load-time
guard (systemd/guard/uvm-guard) and the kotool (dkms/spark-memsaver-kotool) apply:

* selected: the one ``filename:`` that ``modinfo [-b ROOT] -k K NAME`` prints (modprobe's own resolution
  through modules.dep, so depmod.d's search order - ``updates/dkms`` before ``kernel/``, Ubuntu's
  ``search updates ubuntu built-in`` - and .ko/.ko.xz/.ko.zst are decided by the real kmod, never re-implemented
  here), trusted only when modinfo exits 0, prints exactly one module and the file exists.
* state: ``ours`` (modinfo ``spark_memsaver`` == "uvm-pt-pack/1"), ``patched`` (the field is set to another
  value, or a ``uvm_pt_pack*`` parameter without our tag: not this spark-memsaver's), ``stock`` (neither),
  ``none`` (modinfo says the module is not found), ``builtin``, or ``unreadable`` (modinfo fails in any other
  way - e.g. it cannot decompress a .ko.zst -, hangs, is missing, or names several files). ``unreadable`` is
  never ``stock``.
* versions_match: the base version (cut at the first '-', '+', '~' or space) of the selected nvidia-uvm equals
  the base version of the nvidia.ko modprobe selects for the same kernel; None when either cannot be read.

A module FILE (not a selection) is read with :func:`read_file` through the kotool's stdlib ELF reader (the
same code the PRE_INSTALL guard runs) and classified by the same :func:`classify`.
"""

from __future__ import annotations

import os
import re

from spark_memsaver.host import Host
from spark_memsaver.host.fsutil import sha256_file
from spark_memsaver.host.safetext import safe

from spark_memsaver.vocabulary import PATCH_ID  # noqa: E402  (one definition)
TAG_FIELD = "spark_memsaver"
UVM = "nvidia_uvm"
NVIDIA = "nvidia"
STATES = ("ours", "patched", "stock", "none", "builtin", "unreadable")
MODINFO_TIMEOUT = 30.0
_LIST_FIELDS = ("parm", "parmtype", "alias", "firmware", "import_ns")


def parse_modinfo(text: str) -> dict:
    """modinfo's 'field: value' lines; repeated fields (parm, alias, ...) become lists; ``filename`` lines are
    also collected in ``_filenames`` (more than one: modinfo printed several modules)."""
    info: dict = {}
    last = None
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9_]+):\s*(.*)$", line)
        if m:
            key, value = m.group(1), m.group(2).strip()
            if key in _LIST_FIELDS:
                info.setdefault(key, []).append(value)
            else:
                if key == "filename":
                    info.setdefault("_filenames", []).append(value)
                    info.setdefault(key, value)  # the first module's file
                else:
                    info[key] = value
            last = key
        elif last == "sig_hashalgo" or (last and line.startswith("\t")):
            # continuation lines of signature / sig_key dumps
            info[last] = (info.get(last, "") + line.strip()) if isinstance(info.get(last), str) else info.get(last)
    return info


from spark_memsaver.versions import base_version  # noqa: E402  (the one base_version)


def classify(info: dict) -> str:
    """ours | patched | stock for a readable module's fields (modinfo text or the kotool's .modinfo dict)."""
    tag = info.get(TAG_FIELD)
    if tag == PATCH_ID:
        return "ours"
    parms = [p.split(":", 1)[0] for p in (info.get("parm") or []) + (info.get("parmtype") or [])]
    if tag or any(p.startswith("uvm_pt_pack") for p in parms):
        return "patched"
    return "stock"


def _sig_key(text) -> str | None:
    """modinfo's ``sig_key`` (the signing certificate's serial, or its subject key id: ``AB:CD:..``), kept only
    in that shape: it is read from a module file we may not have written."""
    if not isinstance(text, str):
        return None
    text = text.strip()
    return text if re.fullmatch(r"[0-9A-Fa-f]{1,2}(?::[0-9A-Fa-f]{1,2}){0,63}", text) else None


def _fields(info: dict) -> dict:
    parms = sorted({safe(p.split(":", 1)[0], 128) for p in (info.get("parm") or []) + (info.get("parmtype") or [])})
    state = classify(info)
    signer = info.get("signer")      # shown only: a module's parameters and signer are text we did not write
    return {"state": state, "version": info.get("version"), "srcversion": info.get("srcversion"),
            "vermagic": info.get("vermagic"), "signer": safe(signer, 256) if signer is not None else None,
            "sig_key": _sig_key(info.get("sig_key")),
            "patch_id": info.get(TAG_FIELD), "ours": state == "ours", "patched": state != "stock",
            "depends": [d for d in (info.get("depends") or "").split(",") if d], "parameters": parms,
            "name": info.get("name"), "error": None}


def _unreadable(error: str, path: str | None = None) -> dict:
    return {"state": "unreadable", "path": path, "version": None, "srcversion": None, "vermagic": None,
            "signer": None, "sig_key": None, "patch_id": None, "ours": False, "patched": None, "depends": [],
            "parameters": [], "name": None, "error": error}


def _unroot(host: Host, p: str) -> str:
    if not host.is_live and p.startswith(str(host.root) + "/"):
        return "/" + os.path.relpath(p, host.root)
    return p


def read_selected(host: Host, kernel: str, name: str = UVM, *, digest: bool = False,
                  timeout: float = MODINFO_TIMEOUT, cached: bool = False) -> dict:
    """The module modprobe selects for ``name`` on ``kernel`` and its fields (see the module docstring).
    ``path`` is a host path (without the root prefix); ``sha256`` when ``digest``. ``cached``: an inspection may
    take kmod's answer kept from an earlier run when nothing it read has changed (observe/modcache.py); a
    verification after a change (act/) always asks kmod."""
    if not cached:
        return _digested(host, _ask_kmod(host, kernel, name, timeout), digest)
    from spark_memsaver.observe import modcache
    now = modcache.inputs(host, kernel)
    out = modcache.lookup(host, kernel, name, now)
    if out is None:
        out = _ask_kmod(host, kernel, name, timeout)
        modcache.store(host, kernel, name, now, out)
    return _digested(host, out, digest)


def _digested(host: Host, out: dict, digest: bool) -> dict:
    if digest and out.get("path") and out["state"] not in ("none", "builtin", "unreadable"):
        out["sha256"] = sha256_file(host.path(out["path"]))
    return out


def _ask_kmod(host: Host, kernel: str, name: str, timeout: float) -> dict:
    """modinfo's answer for (kernel, name), read as :func:`read_selected` says (no digest)."""
    argv = ["modinfo", "-k", kernel, name]
    if not host.is_live:
        argv[1:1] = ["-b", str(host.root)]
    try:
        r = host.run(argv, timeout=timeout)
    except Exception as e:  # modinfo missing or hung: unreadable, never stock
        return dict(_unreadable(f"modinfo could not be run: {e}"), kernel=kernel, module=name, sha256=None)
    err = (r.stderr or "").strip().splitlines()
    if r.returncode != 0:
        text = " ".join(err)[-300:]
        if re.search(r"\bnot found\b", text):
            out = {"state": "none", "path": None, "error": None, "ours": False, "patched": False}
        else:
            out = _unreadable(f"modinfo -k {kernel} {name} failed (exit {r.returncode})" + (f": {text}" if text else ""))
        return dict(out, kernel=kernel, module=name, sha256=None)
    info = parse_modinfo(r.stdout)
    names = info.get("_filenames") or []
    if len(names) != 1:
        return dict(_unreadable(f"modinfo -k {kernel} {name} named {len(names)} files"), kernel=kernel,
                    module=name, sha256=None)
    if names[0] == "(builtin)":
        return {"state": "builtin", "path": None, "error": None, "ours": False, "patched": False,
                "kernel": kernel, "module": name, "sha256": None}
    path = _unroot(host, names[0])
    if not host.path(path).is_file():
        return dict(_unreadable(f"modinfo names {path}, which is not a file", path), kernel=kernel,
                    module=name, sha256=None)
    return dict(_fields(info), path=path, kernel=kernel, module=name, sha256=None)


def read_file(host: Host, path: str) -> dict:
    """The fields of the module FILE at host path ``path`` (stdlib ELF reader of the kotool; .ko/.xz/.gz, .zst
    through zstd); ``unreadable`` when it cannot be read or decompressed."""
    from spark_memsaver.host.datadir import kotool  # the kotool is imported by file path (dkms data dir)
    kt = kotool()
    try:
        info, _ = kt.modinfo(str(host.path(path)))
    except Exception as e:  # OSError, KoError (timeout, cannot decompress), struct.error, ValueError: unreadable
        return _unreadable(f"cannot read {path}: {e}", path)
    return dict(_fields(info), path=path)


def selection(host: Host, kernel: str, *, digest: bool = False, timeout: float = MODINFO_TIMEOUT) -> dict:
    """The selected nvidia-uvm for ``kernel`` (see :func:`read_selected`) with ``nvidia`` (the nvidia.ko
    modprobe selects, read the same way; ``beside`` whether it sits in the same directory) and
    ``versions_match`` (base versions equal; None when either is unreadable/absent)."""
    uvm = read_selected(host, kernel, UVM, digest=digest, timeout=timeout)
    nv = read_selected(host, kernel, NVIDIA, timeout=timeout)
    a = base_version(uvm.get("version")) if uvm["state"] in ("ours", "patched", "stock") else None
    b = base_version(nv.get("version")) if nv["state"] in ("stock", "patched", "ours") else None
    uvm["nvidia"] = nv
    uvm["nvidia_beside"] = bool(uvm.get("path") and nv.get("path")
                                and os.path.dirname(uvm["path"]) == os.path.dirname(nv["path"]))
    uvm["versions_match"] = (a == b) if (a and b) else None
    return uvm


def describe(sel: dict) -> dict | None:
    """The snapshot's view of a :func:`read_selected` answer: None for 'none', {'path': None, 'error', ...} for
    'unreadable' (the shape decide/ reads), else the fields."""
    if sel["state"] == "none":
        return None
    keys = ("path", "version", "srcversion", "vermagic", "signer", "sig_key", "depends", "patched", "patch_id",
            "ours", "state", "error")
    return {k: sel.get(k) for k in keys}
