"""Observe: one snapshot of the host, read through a root prefix, as the typed world (spark_memsaver/model.py).

The section readers (observe_host, observe_uvm, observe_memory, ...) return their plain JSON shape: the idle
daemon samples observe_uvm/observe_memory and loads no dataclasses. :func:`snapshot` gathers them once and
returns a :class:`model.World`.

Nothing here decides anything: two sections are readings that spark_memsaver/world/ hands to decide/ before
anyone else sees the snapshot -- "secure_boot" (an efi/mokvars.MokReading; decide/mok.section) and
"driver_sources" (observe/sources.facts; decide/sources.section). world.snapshot is the snapshot to use.
"""

from __future__ import annotations

import os
import re
import time

from spark_memsaver.observe import modules
from spark_memsaver.observe.counters import CountersError, parse_stats
from spark_memsaver.host import Host
from spark_memsaver.host import paths
from spark_memsaver.host.safetext import safe


EFI_GLOBAL_GUID = "8be4df61-93ca-11d2-aa0d-00e098032b8c"
OUR_TAG = "spark_memsaver"          # modinfo field carried by our patched module
OUR_DKMS_NAME = "spark-memsaver-uvm"
UVM_NAMES = ("nvidia-uvm", "nvidia_uvm")
_SRC_RE = re.compile(r"^nvidia(?:-[a-z][a-z-]*?)?-(\d+\.\d+(?:\.\d+)?)$")
_PAGE_CFG = (("CONFIG_ARM64_64K_PAGES", 65536), ("CONFIG_ARM64_16K_PAGES", 16384), ("CONFIG_ARM64_4K_PAGES", 4096))


def _strip(s: str | None) -> str | None:
    return s.strip() if s is not None else None


# --- host --------------------------------------------------------------------------------------

def page_size_from_pmd(pmd_bytes: int) -> int | None:
    """CPU page size from THP's PMD size: a PMD maps PAGE_SIZE/8 pages, so pmd = page**2 / 8."""
    for ps in (4096, 16384, 65536):
        if ps * ps // 8 == pmd_bytes:
            return ps
    return None


def kernel_config(host: Host, release: str) -> dict[str, str]:
    for p in (f"/boot/config-{release}", f"/lib/modules/{release}/build/.config",
              f"/usr/lib/modules/{release}/config"):
        text = host.read_text(p)
        if text:
            cfg = {}
            for line in text.splitlines():
                if line.startswith("CONFIG_") and "=" in line:
                    k, v = line.split("=", 1)
                    cfg[k] = v
            return cfg
    return {}


def kernel_page_size(host: Host, release: str, arch: str | None) -> int | None:
    cfg = kernel_config(host, release)
    for key, size in _PAGE_CFG:
        if cfg.get(key) == "y":
            return size
    if cfg and cfg.get("CONFIG_X86_64") == "y" or (not cfg and arch == "x86_64" and "amd64" in release):
        return 4096
    if cfg.get("CONFIG_X86") == "y":
        return 4096
    return None


def observe_host(host: Host) -> dict:
    release = _strip(host.read_text("/proc/sys/kernel/osrelease"))
    arch = _strip(host.read_text("/proc/sys/kernel/arch"))
    if host.is_live:
        u = os.uname()
        release, arch = release or u.release, arch or u.machine
        page_size = os.sysconf("SC_PAGE_SIZE")
    else:
        page_size = None
        pmd = _strip(host.read_text("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"))
        if pmd and pmd.isdigit():
            page_size = page_size_from_pmd(int(pmd))
        if page_size is None and release:
            page_size = kernel_page_size(host, release, arch)
    return {"kernel": release, "arch": arch, "page_size": page_size}


# --- modules -----------------------------------------------------------------------------------

def parse_modinfo(text: str) -> dict:
    """modinfo's 'field: value' lines (the one parser lives in observe/modules.py)."""
    return modules.parse_modinfo(text)


def module_info(host: Host, release: str, name: str) -> dict | None:
    """Which file module loading would select for ``name`` on kernel ``release`` (observe/modules.py):
    None when modinfo says it is not found; {"error": ...} when the selection cannot be read."""
    sel = modules.read_selected(host, release, name, cached=True)
    return None if sel["state"] == "none" else sel


def describe_module(info: dict | None) -> dict | None:
    if info is None:
        return None
    if "state" not in info:  # an old-style {"error": ...} answer
        return {"path": None, "error": info.get("error"), "state": "unreadable"}
    return modules.describe(info)


def installed_kernels(host: Host) -> list[str]:
    out = []
    for rel in host.listdir("/lib/modules"):
        if host.path(f"/lib/modules/{rel}").is_dir() and (
                host.exists(f"/lib/modules/{rel}/modules.dep") or host.exists(f"/lib/modules/{rel}/kernel")
                or host.exists(f"/lib/modules/{rel}/build")):
            out.append(rel)
    return out


def observe_kernels(host: Host, running_arch: str | None) -> list[dict]:
    kernels = []
    for rel in installed_kernels(host):
        build = f"/lib/modules/{rel}/build"
        headers = host.exists(f"{build}/Makefile")
        kernels.append({
            "release": rel,
            "running": False,
            "page_size": kernel_page_size(host, rel, running_arch),
            "headers": headers,
            "uvm_selected": describe_module(module_info(host, rel, "nvidia_uvm")),
            "nvidia_selected": describe_module(module_info(host, rel, "nvidia")),
        })
    return kernels


# --- driver ------------------------------------------------------------------------------------

def observe_driver(host: Host) -> dict:
    loaded = _strip(host.read_text("/sys/module/nvidia/version"))
    sources = []
    for name in host.listdir("/usr/src"):
        m = _SRC_RE.match(name)
        if not m:
            continue
        p = f"/usr/src/{name}"
        sources.append({
            "version": m.group(1),
            "path": p,
            "open": host.exists(f"{p}/nvidia-uvm") and host.exists(f"{p}/Kbuild"),
        })
    return {"loaded_version": loaded, "sources": sources}


def observe_uvm(host: Host) -> dict:
    base = "/sys/module/nvidia_uvm"
    if not host.exists(base):
        return {"loaded": False, "version": None, "srcversion": None, "patched": False,
                "parameters": {}, "packing": None}
    params = {}
    for name in host.listdir(f"{base}/parameters"):
        if name == "uvm_pt_pack_stats":
            continue
        v = host.read_text(f"{base}/parameters/{name}")
        if v is not None:
            params[safe(name, 128)] = safe(v.strip(), 4096)
    packing = None
    stats = host.read_text(f"{base}/parameters/uvm_pt_pack_stats")
    if stats is not None:
        try:
            packing = parse_stats(stats)
        except CountersError as e:
            packing = {"error": str(e)}
    return {
        "loaded": True,
        "version": _strip(host.read_text(f"{base}/version")),
        "srcversion": _strip(host.read_text(f"{base}/srcversion")),
        "patched": "uvm_pt_pack" in params or stats is not None,
        "parameters": params,
        "packing": packing,
    }


def uvm_holders(host: Host, device: str = "/dev/nvidia-uvm") -> list[dict]:
    """Processes with ``device`` open (scans /proc/<pid>/fd; unreadable processes are skipped)."""
    holders = []
    proc = host.path("/proc")
    try:
        pids = [d for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return holders
    for pid in pids:
        fddir = proc / pid / "fd"
        try:
            fds = os.listdir(fddir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fddir / fd)
            except OSError:
                continue
            if target == device:
                comm = (host.read_text(f"/proc/{pid}/comm") or "?").rstrip("\n")   # any user names its process
                holders.append({"pid": int(pid), "comm": safe(comm, 64) or "?"})
                break
    return holders


# --- DKMS --------------------------------------------------------------------------------------

def observe_dkms(host: Host) -> dict:
    """Our DKMS registrations, read from DKMS's tree (/var/lib/dkms) without running dkms."""
    base = f"/var/lib/dkms/{OUR_DKMS_NAME}"
    regs = []
    installed_links = {}
    for entry in host.listdir(base):
        p = host.path(f"{base}/{entry}", follow=False)
        if entry.startswith("kernel-") and p.is_symlink():
            installed_links[entry[len("kernel-"):]] = os.readlink(p)
    for ver in host.listdir(base):
        if ver.startswith("kernel-") or not host.path(f"{base}/{ver}").is_dir():
            continue
        source_ok = host.exists(f"/usr/src/{OUR_DKMS_NAME}-{ver}/dkms.conf")
        builds = []
        for kver in host.listdir(f"{base}/{ver}"):
            if kver in ("source", "build") or not host.path(f"{base}/{ver}/{kver}").is_dir():
                continue
            for arch in host.listdir(f"{base}/{ver}/{kver}"):
                built = bool([f for f in host.listdir(f"{base}/{ver}/{kver}/{arch}/module") if ".ko" in f])
                link = installed_links.get(f"{kver}-{arch}", "")
                builds.append({"kernel": kver, "arch": arch, "built": built,
                               "installed": link.rstrip("/").startswith(f"{ver}/")})
        regs.append({"module": OUR_DKMS_NAME, "version": ver, "source_present": source_ok, "builds": builds})
    return {"available": host.exists("/usr/sbin/dkms") or host.exists("/usr/bin/dkms"), "registrations": regs}


# --- memory ------------------------------------------------------------------------------------

def observe_memory(host: Host, uvm: dict, page_size: int | None = None) -> dict:
    """MemTotal, MemAvailable and MemFree from the root's /proc/meminfo (what psutil.virtual_memory reports on
    Linux, read directly: the idle daemon samples this and keeps psutil out of its memory), and the free blocks
    by size from /proc/buddyinfo (status's Memory line: two small files, no command)."""
    from spark_memsaver.observe import procmem
    mi = procmem.parse_meminfo(host.read_text("/proc/meminfo") or "")
    total, available, free = (mi.get(k) for k in ("MemTotal", "MemAvailable", "MemFree"))
    if total is None or available is None:      # a fixture root without meminfo
        total = available = free = None
    if page_size is None and host.is_live:
        page_size = os.sysconf("SC_PAGE_SIZE")
    buddy = host.read_text("/proc/buddyinfo")
    blocks = procmem.free_blocks(procmem.parse_buddyinfo(buddy), page_size) if buddy is not None else []
    packing = uvm.get("packing") or {}
    ok = "error" not in packing and bool(packing)
    return {
        "total": total,
        "available": available,
        "pagetable_backing": packing.get("backing_bytes") if ok else None,
        "pagetable_stock_equivalent": packing.get("stock_bytes") if ok else None,
        "saved": packing.get("saved_bytes") if ok else None,
        "free": free,
        "free_blocks": [{"size_bytes": b["size_bytes"], "count": b["count"]} for b in blocks] or None,
    }


# --- state records (lifecycle) -------------------------------------------------------------------

STATE_DIR = paths.STATE_DIR   # host/paths.py is the one list


def observe_records(host: Host) -> dict:
    """Records left by operations, read typed through host/records.py: a record of the wrong type or
    fields (or not JSON) is quarantined -- renamed aside, listed under 'quarantined' -- never trusted."""
    from spark_memsaver.host import records

    got = records.read_all(host)
    strip = lambda recs: [{k: v for k, v in r.items() if k != "_path"} for r in recs]  # noqa: E731
    return {"intents": strip(got["intent"]), "rollbacks": strip(got["rollback"]), "holds": strip(got["hold"]),
            "last_validation": got["validate"], "unreadable": [], "quarantined": got["quarantined"]}


# --- known driver hazards (decided in decide/hazards.py; the table's format: hazard_table.py) ------------------------------------------

HAZARDS_FILE = "hazards.yaml"
_HAZARD_TEXT_MAX = 2 << 20      # decide/c_macros.py reads no more


def _hazards_table() -> dict:
    """The product's hazards table (product data, never under --root): like world/manifest.py's data dir."""
    from pathlib import Path
    env = os.environ.get("SPARK_MEMSAVER_UVM_PATCH_DIR")
    dirs = ([Path(env)] if env else []) + [Path(__file__).resolve().parents[3] / "uvm_patch",
                                           Path("/usr/share/spark-memsaver/uvm_patch")]
    for d in dirs:
        p = d / HAZARDS_FILE
        if p.is_file():
            try:
                return {"path": str(p), "text": p.read_text(), "error": None}
            except (OSError, UnicodeError) as e:
                return {"path": str(p), "text": None, "error": f"{p}: {e}"}
    return {"path": None, "text": None, "error": "not found in " + ", ".join(str(d) for d in dirs)}


def observe_hazard_inputs(host: Host, h: dict | None = None, driver: dict | None = None,
                          kernels: list[dict] | None = None) -> dict:
    """The inputs of decide/hazards.py: the table, the driver version in effect (loaded nvidia, else the
    running kernel's nvidia.ko), the running kernel's arch and page size, and, when that driver's source is
    in /usr/src, the text of the files the table's signatures name (read through the root prefix)."""
    from spark_memsaver.hazard_table import HazardsInvalid, load_hazards
    h = h if h is not None else observe_host(host)
    driver = driver if driver is not None else observe_driver(host)
    table = _hazards_table()
    version = driver.get("loaded_version")
    if not version:
        for k in kernels if kernels is not None else observe_kernels(host, h.get("arch")):
            if k.get("release") == h.get("kernel"):
                version = (k.get("nvidia_selected") or {}).get("version")
    files: list[str] = []
    if table["text"] is not None:
        try:
            for hz in load_hazards(table["text"], table["path"]):
                files += [f for f in hz.signature.files if f not in files]
        except HazardsInvalid:
            pass
    sources: dict[str, str] = {}
    errors: dict[str, str] = {}         # a file there that could not be read (decide/hazards.py says so)
    src_path = None
    for s in driver.get("sources", []):
        if version and s.get("version") == version:
            src_path = s["path"]
            for rel in files:
                p = host.path(f"{src_path}/{rel}")
                try:
                    if p.is_file():
                        with open(p, "rb") as f:        # never more than the cap (+1 byte to know it is over)
                            data = f.read(_HAZARD_TEXT_MAX + 1)
                        if len(data) > _HAZARD_TEXT_MAX:
                            errors[rel] = f"the file is larger than {_HAZARD_TEXT_MAX >> 20} MiB"
                        else:
                            sources[rel] = data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
                except OSError as e:
                    errors[rel] = f"cannot read it: {e.strerror or e}"
            break
    return {"table": table, "driver_version": version, "arch": h.get("arch"), "page_size": h.get("page_size"),
            "source_path": src_path, "sources": sources, "source_errors": errors}


# --- the snapshot ------------------------------------------------------------------------------

def snapshot(host: Host, config=None):
    """Everything observed, as a model.World. config: the caller's (--config, the daemon's); never reloaded here
    when given."""
    from spark_memsaver.model import World
    from spark_memsaver.observe import mok, programs
    t0 = time.monotonic()
    h = observe_host(host)
    unknown = []
    if h["kernel"] is None and not host.is_live and not os.path.isdir(host.path("/proc")) \
            and (os.path.isdir(host.path("/lib/modules")) or os.path.isdir(host.path("/usr/lib/modules"))):
        # A mounted image: nothing runs there. Say which parts are unknown instead of refusing.
        unknown = ["running kernel", "loaded modules", "memory", "holders of /dev/nvidia-uvm"]
    elif h["kernel"] is None:
        from spark_memsaver.errors import InspectionError
        raise InspectionError(f"{host.root}: no kernel release found at proc/sys/kernel/osrelease",
                              remedy="Point --root at a system root with /proc and /sys mounted.")
    kernels = observe_kernels(host, h["arch"])
    for k in kernels:
        k["running"] = k["release"] == h["kernel"]
    uvm = observe_uvm(host)
    shape = {
        "host": h,
        "driver": observe_driver(host),
        "uvm": uvm,
        "kernels": kernels,
        "dkms": observe_dkms(host),
        "secure_boot": mok.read(host, config=config),      # config's signing_cert names our certificate
        "holders": uvm_holders(host),
        "memory": observe_memory(host, uvm, h["page_size"]),
        "records": observe_records(host),
    }
    # the driver sources fetched into our cache count as sources (origin "cache"); how to get a missing one
    from spark_memsaver.observe import sources as driver_sources
    cached = driver_sources.cache_entries(host)
    shape["driver"]["sources"] += driver_sources.cache_sources(host, cached)
    shape["driver_sources"] = driver_sources.facts(host, config, shape["driver"], kernels, cached)
    shape["hazard_inputs"] = observe_hazard_inputs(host, h, shape["driver"], kernels)
    from spark_memsaver.observe import guardlog
    shape["guard"] = {"ours_load_failed": guardlog.ours_load_failed(host, h["kernel"])}
    shape["unknown"] = unknown
    shape["programs_missing"] = programs.missing(host)      # the guard's and the way back's, by name
    shape["observed_in_s"] = round(time.monotonic() - t0, 4)
    return World.from_json(shape, "snapshot")   # each section typed
