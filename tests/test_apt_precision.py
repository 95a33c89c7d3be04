"""Issue 16: the APT door touches only the kernel whose NVIDIA driver changes; the doors' output stays readable.

Real parts: the hook input is what the real apt-get sends (Pre-Install-Pkgs protocol 3), captured from an
apt run in a private root (APT_CONFIG: the root's own status file, no host configuration, no lock; the
capturing hook then fails, so apt never calls dpkg); the packages are real .debs built with dpkg-deb and
named like Ubuntu's (``linux-modules-nvidia-580-open-<K>``: the version is the KERNEL's, the driver is in
the nvidia.ko it ships or in its Depends on nvidia-kernel-common-580); their nvidia.ko files are real ELF
objects with a real ``.modinfo`` (tests/support/sparkroot.py), read with the real modinfo; removals read
dpkg's real file lists with dpkg-query. The Spark root's overrides are removed by the real engine
(restore stock, depmod), as ``spark-memsaver --root``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest

from spark_memsaver.act import apt_facts, executor
from spark_memsaver.act import build as act_build
from spark_memsaver.config import Config
from spark_memsaver.decide import apt as apt_plan
from spark_memsaver.host import Host, events
from spark_memsaver.observe import modules
from tests.support import sparkroot
from tests.support.worlds import typed

apt_plan = typed(apt_plan)   # dict snapshots -> model.World (tests/support/worlds.py)

pytestmark = pytest.mark.lifecycle

REPO = Path(__file__).resolve().parent.parent
K1 = sparkroot.SPARK_KERNEL                 # running, ours for 580.142
K2 = "6.14.0-1013-nvidia-64k"               # older kernel, ours for 580.142
K3 = "6.14.0-1017-nvidia-64k"               # the next kernel, arriving in the transaction
DRV, NEW = sparkroot.DRIVER, "580.159"
ARCH = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()


def modules_pkg(k: str) -> str:
    return f"linux-modules-nvidia-580-open-{k}"


def kver(k: str, rev: int = 1) -> str:
    """Ubuntu's version of a per-kernel modules package: the kernel's ('6.14.0-1015.15+1')."""
    abi = k.split("-")[1]
    return f"{k.split('-')[0]}-{abi}.{abi[-2:]}+{rev}"


# --- real .debs ------------------------------------------------------------------------------------

def build_deb(out: Path, name: str, version: str, files: dict[str, object], depends: str | None = None) -> Path:
    tree = out / f"{name}_{version}.tree"
    (tree / "DEBIAN").mkdir(parents=True)
    ctl = f"Package: {name}\nVersion: {version}\nArchitecture: {ARCH}\nMaintainer: t <t@example.org>\n"
    ctl += (f"Depends: {depends}\n" if depends else "") + f"Description: {name}\n"
    (tree / "DEBIAN/control").write_text(ctl)
    for rel, data in files.items():
        p = tree / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        if callable(data):
            data(p)
        else:
            p.write_bytes(data if isinstance(data, bytes) else str(data).encode())
    deb = out / f"{name}_{version}_{ARCH}.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(tree), str(deb)], check=True, capture_output=True)
    return deb


def ko(version: str | None, k: str, name: str = "nvidia"):
    fields = [("license", "Dual MIT/GPL"), ("name", name), ("vermagic", f"{k} SMP mod_unload modversions")]
    return lambda p: sparkroot.make_module(p, ([("version", version)] if version else []) + fields)


def modules_deb(out: Path, k: str, driver: str | None, rev: int = 1, depends: str | None = None) -> Path:
    d = f"lib/modules/{k}/kernel/nvidia-580-open"
    return build_deb(out, modules_pkg(k), kver(k, rev), {f"{d}/nvidia.ko": ko(driver, k),
                                                         f"{d}/nvidia-uvm.ko": ko(driver, k, "nvidia_uvm")},
                     depends=depends)


# --- the root: a Spark node with two kernels, ours for 580.142 on both, dpkg's database of them ----

STATUS = "Package: {p}\nStatus: install ok installed\nPriority: optional\nSection: kernel\nMaintainer: t <t@example.org>\n" \
         "Architecture: {a}\nVersion: {v}\nDescription: {p}\n\n"


@pytest.fixture(scope="module")
def node_template(tmp_path_factory):
    base = tmp_path_factory.mktemp("apt-node")
    root = sparkroot.make_spark_root(base / "root", ours_installed=DRV, extra_kernels=(K2,))
    status, info = root / "var/lib/dpkg/status", root / "var/lib/dpkg/info"
    info.mkdir(parents=True, exist_ok=True)
    pkgs = {modules_pkg(k): kver(k) for k in (K1, K2)}
    pkgs.update({"nvidia-kernel-common-580": f"{DRV}-0ubuntu1", "nvidia-kernel-source-580-open": f"{DRV}-0ubuntu1",
                 "nvidia-open-kernel-dkms": f"{DRV}-1"})
    status.write_text("".join(STATUS.format(p=p, a=ARCH, v=v) for p, v in pkgs.items()))
    for k in (K1, K2):
        d = f"/lib/modules/{k}/kernel/nvidia-580-open"
        (info / f"{modules_pkg(k)}.list").write_text(f"/.\n/lib\n/lib/modules\n/lib/modules/{k}\n{d}\n"
                                                     f"{d}/nvidia.ko\n{d}/nvidia-uvm.ko\n")
    for d in ("etc/apt/apt.conf.d", "etc/apt/preferences.d", "etc/apt/sources.list.d", "var/lib/apt/lists/partial",
              "var/cache/apt/archives/partial", "var/log/apt", "var/lib/dpkg/updates"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc/apt/sources.list").touch()
    return root


@pytest.fixture
def node(node_template, tmp_path):
    """A fresh copy of the node (symlinks kept: /lib/modules/K/build)."""
    import shutil
    return Path(shutil.copytree(node_template, tmp_path / "root", symlinks=True))


def apt_hook_input(root: Path, tmp: Path, args: list[str]) -> str:
    """The v3 text the real apt-get sends its Pre-Install-Pkgs hooks for ``apt-get install ARGS``."""
    out, hook, conf = tmp / "hook-input.txt", tmp / "capture-hook", tmp / "apt.conf"
    out.unlink(missing_ok=True)
    hook.write_text(f"#!/bin/sh\ncat > {out}\nexit 1\n")
    hook.chmod(0o755)
    conf.write_text(f'Dir "{root}/";\nDir::Etc::parts "{root}/etc/apt/apt.conf.d";\n'
                    f'Dir::State::status "{root}/var/lib/dpkg/status";\nDir::Bin::dpkg "/usr/bin/dpkg";\n'
                    'Dir::Bin::methods "/usr/lib/apt/methods";\nDebug::NoLocking "1";\nAPT::Sandbox::User "root";\n'
                    f'DPkg::Options {{ "--root={root}"; }};\nDPkg::Pre-Install-Pkgs {{ "{hook}"; }};\n'
                    f'DPkg::Tools::Options::{hook}::Version "3";\n')
    r = subprocess.run(["apt-get", "-y", "-q", "install", *args], env=dict(os.environ, APT_CONFIG=str(conf)),
                       capture_output=True, text=True, timeout=120, cwd=tmp)
    assert out.exists(), r.stdout + r.stderr
    text = out.read_text()
    assert text.startswith("VERSION 3\n"), text[:200]
    return text


def door(root: Path, text: str) -> tuple[list[str], dict]:
    """The real APT door command (what systemd/apt/apt-pre-install runs), text then --json."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    argv = ["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), "reconcile", "--apt-pre-install"]
    r = subprocess.run(argv, input=text, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    hist = [e for e in events.read(Host(str(root))) if e["op"] == "apt-pre-install"]   # the one lifecycle log
    return lines, (hist[-1] if hist else {})


def override(root: Path, k: str) -> tuple | None:
    """(path, mtime_ns, inode) of our override for k, or None if ours is not selected."""
    sel = modules.selection(Host(root), k)
    if sel["state"] != "ours":
        return None
    st = os.stat(root / sel["path"].lstrip("/"))
    return sel["path"], st.st_mtime_ns, st.st_ino


# --- 1. a new kernel with the same driver: no removal anywhere ----------------------------------

def test_new_kernel_with_same_driver_removes_nothing(node, tmp_path):
    meta = build_deb(tmp_path, "linux-modules-nvidia-580-open-nvidia-64k", kver(K3), {})   # the flavour meta
    new = modules_deb(tmp_path, K3, DRV)                     # no Depends pin: the driver is read from nvidia.ko
    text = apt_hook_input(node, tmp_path, [str(new), str(meta)])
    assert f"{modules_pkg(K3)} - - none < {kver(K3)} {ARCH} none {new}" in text
    before = {k: override(node, k) for k in (K1, K2)}
    assert all(before.values())
    lines, hist = door(node, text)
    assert {k: override(node, k) for k in (K1, K2)} == before           # same files, same mtimes, same inodes
    assert lines == [f"spark-memsaver: new kernel {K3} (driver {DRV}): will build after configure"], lines
    assert hist["removed"] == []


def test_new_kernel_facts_come_from_the_deb(node, tmp_path):
    new = modules_deb(tmp_path, K3, DRV)
    meta = build_deb(tmp_path, "linux-modules-nvidia-580-open-nvidia-64k", kver(K3), {})
    chg = apt_plan.driver_changes(apt_plan.parse_apt_hook(apt_hook_input(node, tmp_path, [str(new), str(meta)])))
    facts = {c["name"]: c for c in apt_facts.gather(Host(node), chg)}
    f = facts[modules_pkg(K3)]["facts"]
    assert f["readable"] and f["version"] == kver(K3) and f["nvidia_ko"] == {K3: DRV}       # modinfo of the .ko
    assert sorted(f["modules"][K3]) == [f"/lib/modules/{K3}/kernel/nvidia-580-open/nvidia-uvm.ko",
                                        f"/lib/modules/{K3}/kernel/nvidia-580-open/nvidia.ko"]
    assert apt_plan.package_effect(facts[modules_pkg(K3)])["kernels"] == {K3: DRV}
    assert apt_plan.package_effect(facts["linux-modules-nvidia-580-open-nvidia-64k"])["scope"] == "none"
    # the package's own version is the kernel's: it never reads as a driver version
    assert apt_plan.upstream_of_deb(kver(K3)) is None


# --- 2. a driver upgrade for one kernel: that kernel only ------------------------------------------

def test_driver_upgrade_on_one_kernel_removes_that_kernels_override_only(node, tmp_path):
    # only K1's modules package changes (a driver-wide nvidia-kernel-common-580 upgrade in the same run would
    # count for every kernel: test_debian_driver_wide_upgrade_...); its nvidia.ko says 580.159
    up = modules_deb(tmp_path, K1, NEW, rev=2)
    text = apt_hook_input(node, tmp_path, [str(up)])
    assert f"{modules_pkg(K1)} {kver(K1)} {ARCH} none < {kver(K1, 2)} {ARCH} none {up}" in text
    kept = override(node, K2)
    lines, hist = door(node, text)
    assert override(node, K1) is None                                     # stock selected for K1
    assert modules.selection(Host(node), K1)["state"] == "stock"
    assert override(node, K2) == kept                                     # untouched
    assert f"spark-memsaver: {K1}: driver {DRV} \u2192 {NEW}: override removed" in lines, lines
    assert hist["removed"] == [K1]
    rb = json.loads((node / f"var/lib/spark-memsaver/rollbacks/{K1}.json").read_text())
    assert rb["driver_from"] == DRV and rb["driver_to"] == NEW
    assert not (node / f"var/lib/spark-memsaver/rollbacks/{K2}.json").exists()
    assert len([ln for ln in lines if "spark-memsaver" in ln]) < 10


def test_depends_pin_is_read_without_unpacking(node, tmp_path):
    pin = f"linux-image-{K1} | linux-image-unsigned-{K1}, nvidia-kernel-common-580 (>= {NEW}), " \
          f"nvidia-kernel-common-580 (<= {NEW}-1)"
    assert apt_plan.driver_of_depends(pin) == NEW
    assert apt_plan.driver_of_depends(f"nvidia-kernel-common-580 (= {NEW}-0ubuntu0.24.04.1)") == NEW
    assert apt_plan.driver_of_depends(f"nvidia-kernel-common-580 (>= {DRV})") is None        # a bound, not a pin
    up = modules_deb(tmp_path, K1, "999.99.99", rev=2, depends=f"nvidia-kernel-common-580 (= {NEW}-0ubuntu1)")
    f = apt_facts.deb_facts(Host(node), str(up))
    assert "nvidia_ko" not in f and apt_plan.package_effect(
        {"name": modules_pkg(K1), "action": str(up), "new": kver(K1, 2), "facts": f})["kernels"] == {K1: NEW}


def test_unknown_driver_for_a_kernel_with_our_override_removes_it_and_says_so(node, tmp_path):
    up = modules_deb(tmp_path, K1, None, rev=2)              # its nvidia.ko has no version, no Depends pin
    text = apt_hook_input(node, tmp_path, [str(up)])
    kept = override(node, K2)
    lines, _ = door(node, text)
    assert override(node, K1) is None and override(node, K2) == kept
    assert f"spark-memsaver: {K1}: driver {DRV} \u2192 unknown: override removed" in lines, lines


# --- 3. an old kernel's packages removed: its override goes, the others stay -----------------------

def test_removal_of_an_old_kernels_packages_removes_its_override_only(node, tmp_path):
    text = apt_hook_input(node, tmp_path, [f"{modules_pkg(K2)}-"])
    assert f"{modules_pkg(K2)} {kver(K2)} {ARCH} none > - - none **REMOVE**" in text
    kept = override(node, K1)
    lines, hist = door(node, text)
    assert override(node, K2) is None and override(node, K1) == kept
    assert hist["removed"] == [K2]
    assert f"spark-memsaver: {K2}: NVIDIA driver package removed: override removed" in lines, lines
    chg = apt_facts.gather(Host(node), apt_plan.driver_changes(apt_plan.parse_apt_hook(text)))
    assert chg[0]["facts"]["from"] == "dpkg-query" and list(chg[0]["facts"]["modules"]) == [K2]


# --- 4. Debian-style driver-wide packages ------------------------------------------------------------

def debian_shaped(root: Path) -> Path:
    """Each kernel's nvidia.ko built by DKMS from nvidia-open-kernel-dkms (updates/dkms/), as on Debian."""
    for k in (K1, K2):
        src = root / f"lib/modules/{k}/kernel/nvidia-580-open/nvidia.ko"
        src.rename(root / f"lib/modules/{k}/updates/dkms/nvidia.ko")
        subprocess.run(["depmod", "-b", str(root), k], check=True, capture_output=True)
        assert modules.read_selected(Host(root), k, "nvidia")["path"] == f"/lib/modules/{k}/updates/dkms/nvidia.ko"
    return root


def test_debian_driver_wide_upgrade_removes_every_kernels_override(node, tmp_path):
    debian_shaped(node)
    dkms_deb = build_deb(tmp_path, "nvidia-open-kernel-dkms", f"{NEW}-1",
                         {f"usr/src/nvidia-{NEW}/Kbuild": "# NVIDIA Kbuild\n"})
    lines, hist = door(node, apt_hook_input(node, tmp_path, [str(dkms_deb)]))
    assert override(node, K1) is None and override(node, K2) is None
    assert sorted(hist["removed"]) == sorted([K1, K2])
    assert f"spark-memsaver: {K2}: driver {DRV} \u2192 {NEW}: override removed" in lines, lines


def test_source_package_bump_with_the_same_driver_changes_nothing(node, tmp_path):
    debian_shaped(node)
    src = build_deb(tmp_path, "nvidia-kernel-source-580-open", f"{DRV}-0ubuntu2",
                    {f"usr/src/nvidia-{DRV}/Kbuild": "# NVIDIA Kbuild\n"})
    before = {k: override(node, k) for k in (K1, K2)}
    lines, hist = door(node, apt_hook_input(node, tmp_path, [str(src)]))
    assert {k: override(node, k) for k in (K1, K2)} == before
    assert hist["removed"] == [] and sorted(hist["kept"]) == sorted([K1, K2])
    assert f"spark-memsaver: {K1}: driver stays {DRV} (nvidia-kernel-source-580-open): override kept" in lines


def test_ubuntu_common_or_source_upgrade_alone_leaves_packaged_kernels_alone(node, tmp_path):
    """On an Ubuntu-shaped node each kernel's nvidia.ko is its modules package's file: a driver-wide package
    that ships no module (nvidia-kernel-common-580, nvidia-kernel-source-580-open) changes none of them."""
    common = build_deb(tmp_path, "nvidia-kernel-common-580", f"{NEW}-0ubuntu1", {})
    src = build_deb(tmp_path, "nvidia-kernel-source-580-open", f"{NEW}-0ubuntu1",
                    {f"usr/src/nvidia-{NEW}/Kbuild": "# NVIDIA Kbuild\n"})
    before = {k: override(node, k) for k in (K1, K2)}
    lines, hist = door(node, apt_hook_input(node, tmp_path, [str(common), str(src)]))
    assert {k: override(node, k) for k in (K1, K2)} == before and hist["removed"] == [] and lines == []
    # the same packages unread (no .deb where APT says): every kernel, fail safe
    snap = {"kernels": [{"release": k, "uvm_selected": {"patched": True, "version": DRV},
                         "nvidia_selected": {"path": f"/lib/modules/{k}/kernel/nvidia-580-open/nvidia.ko",
                                             "version": DRV}} for k in (K1, K2)]}
    unread = [{"name": "nvidia-kernel-common-580", "old": f"{DRV}-0ubuntu1", "new": f"{NEW}-0ubuntu1",
               "action": "/nowhere.deb", "facts": {"readable": False}}]
    assert sorted(s.kernel for s in apt_plan.pre_install_plan(snap, unread)) == sorted([K1, K2])
    read = [dict(unread[0], facts={"readable": True, "modules": {}, "trees": []})]
    assert apt_plan.pre_install_plan(snap, read) == []


def test_a_package_for_another_kernel_never_decides_for_this_one():
    """Pure: every combination of one per-kernel change and kernels with overrides."""
    from spark_memsaver.decide.plan import Step  # noqa: F401  (the plan's own Step type)
    snap = {"kernels": [{"release": k, "uvm_selected": {"patched": True, "version": DRV}} for k in (K1, K2)]}
    for target in (K1, K2, K3):
        for drv, removed in ((DRV, False), (NEW, False), (None, False), (None, True)):
            c = {"name": modules_pkg(target), "old": kver(target), "new": None if removed else kver(target, 2),
                 "action": "**REMOVE**" if removed else "/x.deb",
                 "facts": {"readable": True, "modules": {target: ["/lib/modules/x/nvidia.ko"]},
                           "nvidia_ko": {target: drv} if drv else {}}}
            got = {s.kernel for s in apt_plan.pre_install_plan(snap, [c])}
            want = set() if target == K3 or (drv == DRV and not removed) else {target}
            assert got == want, (target, drv, removed, got)


# --- the after-dpkg doors: a kernel hook reconciles its kernel only --------------------------------

def test_kernel_hook_reconciles_only_its_kernel(node, tmp_path):
    # K2's nvidia.ko is 580.159 now (its override is stale); the hook for K1 must not act on K2
    sparkroot.make_module(node / f"lib/modules/{K2}/kernel/nvidia-580-open/nvidia.ko",
                          [("version", NEW), ("name", "nvidia"), ("vermagic", f"{K2} SMP")])
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    base = ["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(node), "reconcile"]
    r = subprocess.run(base + ["--hook", "kernel-postinst", "--kernel", K1, "--json"], capture_output=True,
                       text=True, env=env, timeout=120)
    doc = json.loads(r.stdout)
    assert {s.get("kernel") for s in doc["steps"]} <= {K1}, doc["steps"]
    assert override(node, K2) is not None
    # the door script hands its kernel argument on (a copy of it whose spark-memsaver records its argv)
    rec = tmp_path / "argv"
    fake = tmp_path / "spark-memsaver"
    fake.write_text(f'#!/bin/sh\necho "$@" > {rec}\n')
    fake.chmod(0o755)
    script = tmp_path / "dpkg-post"
    script.write_text((REPO / "systemd/dpkg/dpkg-post").read_text().replace("/usr/bin/spark-memsaver", str(fake))
                      .replace("/etc/spark-memsaver/no-hooks", str(tmp_path / "no-hooks"))
                      .replace('"/lib/modules/$2"', f'"{node}/lib/modules/$2"'))
    for sh in ("dash", "bash"):
        subprocess.run([sh, str(script), "kernel-postinst", K2], check=True, timeout=30)
        assert rec.read_text().split() == ["reconcile", "--hook", "kernel-postinst", "--kernel", K2]
        rec.unlink()
        subprocess.run([sh, str(script), "kernel-postinst", K3], check=True, timeout=30)   # not installed
        assert not rec.exists()
        subprocess.run([sh, str(script), "dpkg-trigger"], check=True, timeout=30)
        assert rec.read_text().split() == ["reconcile", "--hook", "dpkg-trigger"]
        rec.unlink()
        subprocess.run([sh, str(script), "kernel-postinst", "6.1; rm -rf /"], check=True, timeout=30)
        assert not rec.exists()


# --- progress: one line per stage, a line per 10 % of the compiled files --------------------------

def _simulated_build(root: Path, ver: str, relative: bool):
    """The make.log a DKMS build of nvidia-uvm writes (our build step's marks, then kbuild's CC lines),
    grown line by line; the engine's poller runs ~3 times per line (it polls every second)."""
    from spark_memsaver.observe.dkms import DKMS_TREE, PACKAGE
    log = root / DKMS_TREE.lstrip("/") / PACKAGE / ver / "build/make.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    lines = [f"spark-memsaver-progress: 0.02 checking the NVIDIA driver for {K1}",
             "spark-memsaver-progress: 0.04 copying NVIDIA sources",
             "spark-memsaver-progress: 0.06 applying the page-table packing patch (zero fuzz)",
             "spark-memsaver-progress-total: 122",
             "spark-memsaver-progress: 0.10 compiling nvidia-uvm (122 files, -j2)"]
    prefix = "" if relative else f"/var/lib/dkms/{PACKAGE}/{ver}/build/nv/"
    lines += [f"  CC [M]  {prefix}nvidia-uvm/uvm_file{i}.o" for i in range(122)]
    lines += ["  CC [M]  nvconftest/conftest.o", f"  LD [M]  {prefix}nvidia-uvm.ko"]
    for ln in lines:
        with log.open("a") as f:
            f.write(ln + "\n")
        yield


@pytest.mark.parametrize("relative", [True, False], ids=["kbuild-relative", "kbuild-absolute"])
def test_non_tty_progress_counts_files_in_tens_and_never_repeats(tmp_path, relative):
    from spark_memsaver.cli.lifecycle import ProgressLines
    out = io.StringIO()
    printer = ProgressLines(stream=out, tty=False, prefix="spark-memsaver: ")
    ver = "580.142-spark1"
    poll = act_build._progress_poller(Host(tmp_path), ver, printer)
    for _ in _simulated_build(tmp_path, ver, relative):
        for _ in range(3):
            poll()
    lines = out.getvalue().splitlines()
    counted = [ln for ln in lines if ln.endswith(" files") and "/122" in ln]
    assert len(lines) == len(set(lines)), lines                        # never the same line twice
    assert 10 <= len(counted) <= 11, counted                           # one per 10 % at most
    assert counted[-1] == "spark-memsaver: compiling nvidia-uvm: 122/122 files"
    assert "spark-memsaver: compiling nvidia-uvm: 61/122 files" in counted
    assert len(lines) < 20, lines


def test_tty_progress_keeps_one_live_line(tmp_path):
    from spark_memsaver.cli.lifecycle import ProgressLines
    out = io.StringIO()
    printer = ProgressLines(stream=out, tty=True)
    ver = "580.142-spark1"
    poll = act_build._progress_poller(Host(tmp_path), ver, printer)
    for _ in _simulated_build(tmp_path, ver, relative=True):
        poll()
    printer.done()
    text = out.getvalue()
    assert text.count("\n") < 12                                      # stages on their own lines
    assert text.count("\r\033[K") >= 100                              # the file count updated in place
    assert "compiling nvidia-uvm: 122/122 files" in text


def test_after_dpkg_the_plan_touches_only_the_new_kernel(node, tmp_path):
    """After the new kernel's modules package is unpacked (dpkg-deb -x, depmod, as dpkg + its postinst do),
    the reconcile the trigger and Post-Invoke run plans nothing for the kernels whose override matches."""
    new = modules_deb(tmp_path, K3, DRV)
    lines, _ = door(node, apt_hook_input(node, tmp_path, [str(new)]))
    subprocess.run(["dpkg-deb", "-x", str(new), str(node)], check=True)
    subprocess.run(["depmod", "-b", str(node), K3], check=True, capture_output=True)
    before = {k: override(node, k) for k in (K1, K2)}
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(node), "reconcile", "--dry-run",
                        "--json"], capture_output=True, text=True, env=env, timeout=120)
    steps = json.loads(r.stdout)["steps"]
    assert {s["action"] for s in steps if s.get("kernel") in (K1, K2)} == {"ok"}, steps
    assert [s["kernel"] for s in steps if s["action"] not in ("ok",)] == [K3], steps
    assert {k: override(node, k) for k in (K1, K2)} == before


def test_build_and_install_commands_count_files_in_tens_too(tmp_path, capsys):
    """`spark-memsaver build/install` outside a TTY (ansible, a unit's journal): the same throttle."""
    from spark_memsaver.cli.build import _Line
    line = _Line(True)
    line.tty = False
    ver = "580.142-spark1"
    poll = act_build._progress_poller(Host(tmp_path), ver, line)
    for _ in _simulated_build(tmp_path, ver, relative=True):
        for _ in range(3):
            poll()
    lines = capsys.readouterr().err.splitlines()
    counted = [ln for ln in lines if ln.endswith("/122 files")]
    assert 10 <= len(counted) <= 11 and counted[-1].endswith("compiling nvidia-uvm: 122/122 files"), counted
    assert len(lines) == len(set(lines)) and len(lines) < 20, lines
