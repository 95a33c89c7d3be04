"""Node states built on Spark-shaped fixture roots (tests/support/sparkroot.py), cheaply: DKMS's own tree
layout for a build of ours, and (tests/test_state_space.py) every dimension a node varies in."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.support import sparkroot, standins

PACKAGE = "spark-memsaver-uvm"
ARCH = "aarch64"


def dkms_version(driver: str) -> str:
    from spark_memsaver.observe.dkms import dkms_version_string
    return dkms_version_string(driver)


def add_dkms_build(root: Path, kernel: str, driver: str, installed: bool, built_ko: Path | None = None) -> str:
    """A registration of ours in DKMS's tree (as 'dkms add' and 'dkms build' leave it: the source link, the
    built module under <ver>/<kernel>/<arch>/module) and, ``installed``, DKMS's kernel-<k>-<arch> link; the
    built module is a real .ko with our .modinfo (what DKMS would have built; no compiler run)."""
    ver = dkms_version(driver)
    tree = root / "var/lib/dkms" / PACKAGE
    src = root / "usr/src" / f"{PACKAGE}-{ver}"
    src.mkdir(parents=True, exist_ok=True)
    (src / "dkms.conf").write_text(f'PACKAGE_NAME="{PACKAGE}"\nPACKAGE_VERSION="{ver}"\nBUILT_MODULE_NAME[0]='
                                   '"nvidia-uvm"\nDEST_MODULE_LOCATION[0]="/updates/dkms"\nAUTOINSTALL="yes"\n')
    (tree / ver).mkdir(parents=True, exist_ok=True)
    link = tree / ver / "source"
    if not link.is_symlink():
        os.symlink(f"../../../../../usr/src/{PACKAGE}-{ver}", link)
    ko = tree / ver / kernel / ARCH / "module" / "nvidia-uvm.ko"
    installed_ko = root / f"lib/modules/{kernel}/updates/dkms/nvidia-uvm.ko"
    ko.parent.mkdir(parents=True, exist_ok=True)
    if installed_ko.is_file():
        shutil.copy2(installed_ko, ko)
    elif built_ko is not None:
        shutil.copy2(built_ko, ko)
    else:
        sparkroot.make_module(ko, sparkroot.uvm_fields(driver, sparkroot.OURS_UVM_SRCVERSION, kernel, ours=True))
    if installed:
        k = tree / f"kernel-{kernel}-{ARCH}"
        if not k.is_symlink():
            os.symlink(f"{ver}/{kernel}/{ARCH}", k)
    return ver


# --- the dimensions of a node (issue 34, item 6) -------------------------------------------------------------

K = sparkroot.SPARK_KERNEL
K2 = "6.14.0-1020-nvidia-64k"
DRIVER = sparkroot.DRIVER
OLD = "580.95.05"          # a driver ours was built for that is no longer installed

# (name, values): the first value of each is the plain node (a state's size is how many dimensions differ)
DIMS = (
    ("base", ("stock", "ours", "ours-old", "two", "two-ours")),
    ("dkms", ("none", "built", "installed")),
    ("loaded", ("stock", "none", "ours", "ours-256", "ours-off", "ours-unmet")),
    ("nvidia", (DRIVER, "none", OLD)),
    ("holders", (0, 1)),
    ("sb", ("off", "no-efi", "on", "on-key", "on-newkey")),
    ("hold", ("none", "kernel", "all", "unreadable")),
    ("intent", ("none", "install", "remove", "corrupt")),
    ("record", ("none", "rollback", "bad-rollback", "bad-build", "stock-record")),
    ("config", ("default", "no-auto-build", "tier-256", "kernels-all")),
    ("source", ("present", "absent")),
)
NAMES = tuple(n for n, _ in DIMS)
BASES = {"stock": {}, "ours": {"ours_installed": DRIVER}, "ours-old": {"ours_installed": OLD},
         "two": {"extra_kernels": (K2,)}, "two-ours": {"extra_kernels": (K2,), "ours_installed": DRIVER}}


def size(state: dict) -> int:
    return sum(1 for n, vals in DIMS if state[n] != vals[0])


def describe(state: dict) -> str:
    return ", ".join(f"{n}={state[n]}" for n in NAMES if state[n] != dict(DIMS)[n][0]) or "the plain stock node"


def sample(rng, n: int) -> list[dict]:
    """``n`` distinct states, drawn with ``rng`` (random.Random(seed)); the plain node of each base first."""
    seen, out = set(), []
    for b in BASES:
        st = {name: vals[0] for name, vals in DIMS}
        st["base"] = b
        seen.add(tuple(st.values()))
        out.append(st)
    while len(out) < n:
        st = {name: rng.choice(vals) for name, vals in DIMS}
        key = tuple(st.values())
        if key not in seen:
            seen.add(key)
            out.append(st)
    return out


# What a build's preflight reads of NVIDIA's source tree (world/tree._REQUIRED, the hooked files it hashes, the
# files the patch applies to), byte for byte from NVIDIA's own 580.142 tree; common/inc is only looked for.
SOURCE_FILES = ("Kbuild", "Makefile", "conftest.sh", "nvidia-uvm/uvm_mmu.c", "nvidia-uvm/uvm_mmu.h",
                "nvidia-uvm/nvidia-uvm-sources.Kbuild", "nvidia-uvm/nvidia-uvm.Kbuild", "nvidia-uvm/uvm.c",
                "nvidia/nvidia.Kbuild")


def real_source(root: Path) -> None:
    """/usr/src/nvidia-<DRIVER> as nvidia-kernel-source-580-open installs it, the parts a build's preflight reads
    (the real tree, tests/support/nvsrc.py): a build on the node passes its checks as on a Spark."""
    from tests.support import nvsrc
    tree, dest = nvsrc.nvidia_source(DRIVER), root / f"usr/src/nvidia-{DRIVER}"
    shutil.rmtree(dest, ignore_errors=True)
    for rel in SOURCE_FILES:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tree / rel, dest / rel)
    (dest / "common/inc").mkdir(parents=True)


def make_bases(where: Path) -> dict[str, Path]:
    """One real fixture root per base (gcc-built modules, real depmod), copied for each state."""
    out = {}
    key, crt = sparkroot.make_signing_key(where / "mok-keys", "DKMS module signing key")
    for name, kw in BASES.items():       # ours signed with DKMS's key pair, as DKMS signs it
        out[name] = sparkroot.make_spark_root(where / name, uvm_loaded=None, loaded_driver=None, secure_boot=None,
                                              signing=(key, crt), **kw)
        real_source(out[name])
        standins.exporting_nvidia(out[name], (K,) + kw.get("extra_kernels", ()))
    out["_mok_pub"] = crt
    # a new pair (the blocked key replaced, mok-blocked's remedy): ours on disk is still signed with the old one
    out["_new_pub"] = sparkroot.make_signing_key(where / "new-keys", "spark-memsaver-signing")[1]
    for drv in (DRIVER, OLD):      # what DKMS would have built for K (a copy per state, no compiler run)
        out[f"_ko_{drv}"] = sparkroot.make_module(where / f"ko-{drv}/nvidia-uvm.ko", sparkroot.uvm_fields(
            drv, sparkroot.OURS_UVM_SRCVERSION, K, ours=True))
    return out


def _w(root: Path, rel: str, data) -> None:
    sparkroot.write(root, rel, data)


def _config(root: Path, which: str) -> None:
    text = {"default": None, "no-auto-build": "auto_build: false\n", "tier-256": "tier: '256'\n",
            "kernels-all": "kernels: all\n"}[which]
    if text:
        _w(root, "/etc/spark-memsaver/config.yaml", text)


def build(state: dict, bases: dict, dest: Path) -> Path:
    """The node ``state`` as a fixture root at ``dest`` (a copy of its base, then each dimension applied)."""
    from spark_memsaver.host import Host, holds, intents
    # NVIDIA's source tree is only read (a build renders our own tree beside it): linked, not copied
    src = f"/usr/src/nvidia-{DRIVER}/"
    shutil.copytree(bases[state["base"]], dest, symlinks=True,
                    copy_function=lambda a, b: os.link(a, b) if src in a else shutil.copy2(a, b))
    host = Host(dest)
    ours_ver = OLD if state["base"] == "ours-old" else DRIVER
    if state["dkms"] != "none":
        add_dkms_build(dest, K, ours_ver, installed=state["dkms"] == "installed", built_ko=bases[f"_ko_{ours_ver}"])
    loaded = state["loaded"]
    if loaded != "none":
        ours = loaded.startswith("ours")
        _w(dest, "/sys/module/nvidia_uvm/version", (ours_ver if ours else DRIVER) + "\n")
        _w(dest, "/sys/module/nvidia_uvm/srcversion",
           (sparkroot.OURS_UVM_SRCVERSION if ours else sparkroot.STOCK_UVM_SRCVERSION) + "\n")
        _w(dest, "/sys/module/nvidia_uvm/parameters/uvm_page_table_location", "(null)\n")
        if ours:
            stats = {"ours": sparkroot.stats_text(tier="leaf"), "ours-256": sparkroot.stats_text(tier="256"),
                     "ours-off": sparkroot.stats_text(tier="off", packed=0, t256=0, t4k=0),
                     "ours-unmet": sparkroot.stats_text(tier="leaf", packed=0, unpacked=2, t256=0, t4k=0)}[loaded]
            _w(dest, "/sys/module/nvidia_uvm/parameters/uvm_pt_pack", "0\n" if loaded == "ours-off" else "3\n")
            _w(dest, "/sys/module/nvidia_uvm/parameters/uvm_pt_pack_stats", stats)
    if state["nvidia"] != "none":
        _w(dest, "/sys/module/nvidia/version", state["nvidia"] + "\n")
    for i in range(state["holders"]):
        _w(dest, f"/proc/{4242 + i}/comm", "vllm-worker\n")
        os.symlink("/dev/nvidia-uvm", dest / f"proc/{4242 + i}/fd/7") if (dest / f"proc/{4242 + i}/fd").mkdir(
            parents=True, exist_ok=True) is None else None
    sb = state["sb"]
    if sb != "no-efi":
        efi = f"/sys/firmware/efi/efivars/%s-{sparkroot.EFI_GLOBAL}"
        _w(dest, efi % "SecureBoot", b"\x06\x00\x00\x00" + (b"\x01" if sb.startswith("on") else b"\x00"))
        _w(dest, efi % "SetupMode", b"\x06\x00\x00\x00\x00")
        if sb in ("on-key", "on-newkey"):       # DKMS's pair (a build signs with it: the key beside it, 0600)
            crt = bases["_mok_pub" if sb == "on-key" else "_new_pub"]
            _w(dest, "/var/lib/dkms/mok.pub", crt.read_bytes())
            sparkroot.write(dest, "/var/lib/dkms/mok.key", (crt.parent / "signing.key").read_bytes(), 0o600)
    hold = state["hold"]
    if hold in ("kernel", "all"):
        holds.hold(host, "rollback" if hold == "kernel" else "remove", K if hold == "kernel" else None, "requested")
    elif hold == "unreadable":
        _w(dest, "/var/lib/spark-memsaver/holds/all.json", "{not json")
    intent = state["intent"]
    if intent in ("install", "remove"):
        rec = intents.write_intent(host, intent, K)
        p = dest / f"var/lib/spark-memsaver/intents/{rec['id']}.json"
        import json
        body = json.loads(p.read_text())
        body.update(pid=999999, start_time=1)         # its process is gone: an interrupted operation
        p.write_text(json.dumps(body))
    elif intent == "corrupt":
        _w(dest, "/var/lib/spark-memsaver/intents/install-x.json", "{\"op\": ")
    record = state["record"]
    if record == "rollback":
        intents.write_rollback(host, K, "the driver moved", code="stock-selected")
    elif record == "bad-rollback":
        _w(dest, f"/var/lib/spark-memsaver/rollbacks/{K}.json", "not json\n")
    elif record == "bad-build":
        _w(dest, f"/var/lib/spark-memsaver/builds/{K}.json", "[1, 2]\n")
    elif record == "stock-record":
        import hashlib
        import json
        stock = f"/lib/modules/{K}/kernel/nvidia-580-open/nvidia-uvm.ko"
        _w(dest, f"/var/lib/spark-memsaver/dkms/{K}.json", json.dumps({
            "kernel": K, "stock_path": stock, "stock_sha256": hashlib.sha256((dest / stock.lstrip("/")).read_bytes())
            .hexdigest(), "stock_version": DRIVER, "recorded": "2026-12-01T00:00:00Z"}))
    _config(dest, state["config"])
    if state["source"] == "absent":
        shutil.rmtree(dest / f"usr/src/nvidia-{DRIVER}")
    return dest
