"""DKMS for real: build -> install -> selected/signed/CRC-exact -> remove -> stock again, and every refusal.

Runs the host's real dkms (Debian 12: 3.0.10) as root against Debian's linux-headers-amd64, with a real
stock NVIDIA 550.163.01 nvidia.ko + nvidia-uvm.ko built from Debian's sources and installed where Ubuntu's
prebuilt driver packages put them (tests/support/stockdriver.py). Nothing is a double here.

Cost: one stock driver build (cached under $SPARK_MEMSAVER_TEST_CACHE) and ONE dkms build of our module,
shared by the module-scoped fixtures; every refusal test fails before anything compiles. Everything the
tests put on the host (registrations, /usr/src trees, stock modules, signing key if they created it, the
dummy DKMS module) is removed at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from spark_memsaver.act import build as dbuild
from spark_memsaver.act import dkms_errors as de
from spark_memsaver.act import dkms_run
from spark_memsaver.act import override
from spark_memsaver.act import render
from spark_memsaver.act import signing
from spark_memsaver.act import patch as uvm_patch
from spark_memsaver.config import Config
from spark_memsaver.errors import MemsaverError
from spark_memsaver.host import Host
from spark_memsaver.observe import dkms as odkms
from tests.support import needs, nvsrc, stockdriver

pytestmark = pytest.mark.dkms

DRIVER = "550.163.01"
CFG = Config(kernels="all", tier="4k")
DUMMY = "spark-memsaver-testdummy"
REPO = Path(__file__).resolve().parents[1]


def sh(*argv, check=False, **kw):
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{argv} failed rc={p.returncode}: {p.stdout[-2000:]} {p.stderr[-2000:]}")
    return p


@pytest.fixture(scope="module")
def modconf(tmp_path_factory) -> Path:
    """The module configuration the tests read with (modprobe -C): a private, empty one. Never the host's
    /etc/modprobe.d and /lib/modprobe.d, where an installed spark-memsaver's install rule for nvidia_uvm (or
    any administrator's options) changes what modprobe prints: `tools/run` then `tools/test` on one machine."""
    d = tmp_path_factory.mktemp("modprobe.d")
    (d / "empty.conf").write_text("# no module configuration: the tests read the module tree only\n")
    return d


def show_depends(kernel, name, conf: Path) -> list[str]:
    """modprobe --show-depends with the private configuration ``conf``: the files a load would insert."""
    return sh("modprobe", "-C", conf, "-S", kernel, "--show-depends", name, check=True).stdout.split("\n")


def ours_path(kernel) -> str:
    """Where DKMS installed our module: updates/dkms/nvidia-uvm.ko, compressed as the kernel's own modules are by
    DKMS >= 3.1 (Debian 13's 3.2: .ko.xz; Debian 12's 3.0.10 leaves it plain). Exactly one such file."""
    there = [p for p in (f"/lib/modules/{kernel}/updates/dkms/nvidia-uvm.ko{s}" for s in ("", ".xz", ".zst", ".gz"))
             if Path(p).exists()]
    assert len(there) == 1, there
    return there[0]


def archived_stock(kernel) -> list[Path]:
    """The stock nvidia-uvm DKMS >= 3.1 moved into its original_module archive on install (3.1.7+ adds a .origin
    record beside it)."""
    return [p for p in Path(f"/var/lib/dkms/{odkms.PACKAGE}/original_module/{kernel}").rglob("nvidia-uvm.ko*")
            if re.search(r"\.ko(\.xz|\.zst|\.gz)?$", p.name)]


def selected_path(kernel, name="nvidia-uvm"):
    p = sh("modinfo", "-k", kernel, "-n", name)
    return p.stdout.strip() if p.returncode == 0 else None


def nothing_of_ours(kernel, stock):
    """No registration, no /usr/src tree, the stock module selected."""
    assert not list(Path("/var/lib/dkms").glob(f"{odkms.PACKAGE}/*")), "a DKMS registration was left"
    assert not list(Path("/usr/src").glob(f"{odkms.PACKAGE}-*")), "our /usr/src tree was left"
    assert selected_path(kernel) == stock["nvidia_uvm"]
    assert not list(Path(f"/lib/modules/{kernel}/updates/dkms").glob("nvidia-uvm.ko*"))


# ------------------------------------------------------------------------------------------------
# Fixtures

@pytest.fixture(scope="module")
def host_env():
    needs.root("runs the real dkms and installs modules on this host")
    needs.require("dkms", remedy="tools/deps/dkms.txt")
    kernel, _ = nvsrc.x86_headers()
    host = Host("/")
    # Leftovers of an interrupted earlier run would make every assertion below meaningless.
    # SPARK_MEMSAVER_TEST_REUSE_BUILD=1 (by hand, with -k selecting the install/remove tests only) keeps an
    # existing verified build of the same rendered tree instead, to skip a rebuild on a slow machine.
    if list(Path("/var/lib/dkms").glob(f"{odkms.PACKAGE}/*")) and not os.environ.get("SPARK_MEMSAVER_TEST_REUSE_BUILD"):
        override.remove(host, CFG, all_kernels=True)
    before = {p: Path(p).exists() for p in (odkms.FORCE_FILE, odkms.DEPMOD_FILE, signing.DKMS_KEY, signing.DKMS_CERT,
                                             signing.RECORD, signing.SIGNED_LOG, signing.DROPIN)}
    stock = stockdriver.install_stock(DRIVER, kernel)
    stock["nvidia_uvm_sha256"] = dkms_run.sha256(stock["nvidia_uvm"])
    try:
        yield host, kernel, stock
    finally:
        try:
            if list(Path("/var/lib/dkms").glob(f"{odkms.PACKAGE}/*")):
                override.remove(host, CFG, all_kernels=True)
        finally:
            _remove_dummy(kernel)
            stockdriver.uninstall_stock(DRIVER, kernel)
            for p, existed in before.items():
                if not existed:
                    Path(p).unlink(missing_ok=True)
            for log in Path(dkms_run.LOG_DIR).glob(f"dkms-build-*-{kernel}.log"):
                log.unlink()
            shutil.rmtree(dkms_run.STATE_DIR, ignore_errors=True)
            sh("depmod", "-a", kernel)


@pytest.fixture(scope="module")
def built(host_env):
    host, kernel, stock = host_env
    seen = []
    res = dbuild.build(host, CFG, kernel=kernel, progress=lambda f, m: seen.append((f, m)))
    return res, seen


@pytest.fixture(scope="module")
def installed(host_env, built):
    host, kernel, stock = host_env
    return override.install(host, CFG, kernel=kernel)


def _remove_dummy(kernel):
    if Path(f"/var/lib/dkms/{DUMMY}").exists():
        sh("dkms", "remove", "-m", DUMMY, "-v", "1.0", "--all")
    shutil.rmtree(f"/usr/src/{DUMMY}-1.0", ignore_errors=True)
    shutil.rmtree(f"/var/lib/dkms/{DUMMY}", ignore_errors=True)


@pytest.fixture(scope="module")
def dummy_module(host_env):
    """Another DKMS module on the host (a 10-line real module), to prove we never break DKMS for others."""
    host, kernel, stock = host_env
    src = Path(f"/usr/src/{DUMMY}-1.0")
    _remove_dummy(kernel)
    src.mkdir(parents=True)
    (src / "smtestdummy.c").write_text(
        '#include <linux/module.h>\nstatic int __init d_init(void) { return 0; }\n'
        'static void __exit d_exit(void) { }\nmodule_init(d_init);\nmodule_exit(d_exit);\n'
        'MODULE_LICENSE("GPL");\nMODULE_VERSION("1.0");\n')
    (src / "Makefile").write_text("obj-m := smtestdummy.o\n")
    (src / "dkms.conf").write_text(f'PACKAGE_NAME="{DUMMY}"\nPACKAGE_VERSION="1.0"\nBUILT_MODULE_NAME[0]="smtestdummy"\n'
                                   'DEST_MODULE_LOCATION[0]="/updates/dkms"\nAUTOINSTALL="no"\n')
    sh("dkms", "add", "-m", DUMMY, "-v", "1.0", check=True)
    sh("dkms", "build", "-m", DUMMY, "-v", "1.0", "-k", kernel, check=True)
    return kernel


def dkms_release(suite: str = "trixie") -> Path:
    """The real dkms script of another Debian release (trixie: 3.2.2, i.e. DKMS >= 3.1 semantics), unpacked
    from Debian's .deb into the test cache (a private apt state; the system's apt is untouched)."""
    import fcntl
    base = nvsrc.cache_dir() / "dkms-release" / suite
    exe = base / "root/usr/sbin/dkms"
    if exe.exists():
        return exe
    (nvsrc.cache_dir() / "locks").mkdir(parents=True, exist_ok=True)
    with open(nvsrc.cache_dir() / "locks" / f"dkms-release-{suite}.lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        if exe.exists():
            return exe
        apt = base / "apt"
        for sub in ("lists/partial", "parts", "prefs", "cache/archives/partial"):
            (apt / sub).mkdir(parents=True, exist_ok=True)
        (apt / "sources.list").write_text(f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
                                          f"{nvsrc.debian_mirror()} {suite} main\n")
        opts = [f"-o=Dir::Etc::SourceList={apt}/sources.list", f"-o=Dir::Etc::SourceParts={apt}/parts",
                f"-o=Dir::Etc::PreferencesParts={apt}/prefs", f"-o=Dir::State::Lists={apt}/lists",
                f"-o=Dir::Cache={apt}/cache", "-o=APT::Architectures::=amd64"]
        sh("apt-get", *opts, "update", check=True)
        dl = base / "debs"
        dl.mkdir(exist_ok=True)
        sh("apt-get", *opts, "download", "dkms", cwd=dl, check=True)
        deb = sorted(dl.glob("dkms_*.deb"))[-1]
        tmp = base / "root.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        sh("dpkg-deb", "-x", deb, tmp, check=True)
        os.rename(tmp, base / "root")
    return exe


# ------------------------------------------------------------------------------------------------
# Pure parts (no root needed for these, but they live with the DKMS tests)

def test_version_string_roundtrip_and_order():
    v = odkms.dkms_version_string("550.163.01", "0.1.0")
    assert v == "550.163.01-sm0.1.0"
    assert odkms.parse_dkms_version(v) == ("550.163.01", "0.1.0")
    assert odkms.parse_dkms_version("nvidia-550") is None
    vs = ["555.58.02-sm0.1.0", "550.163.01-sm0.10.0", "550.163.01-sm0.9.0", "580.142-sm0.1.0"]
    out = sh("sort", "-V", input="\n".join(vs) + "\n").stdout.split()
    assert out == ["550.163.01-sm0.9.0", "550.163.01-sm0.10.0", "555.58.02-sm0.1.0", "580.142-sm0.1.0"]


def test_exit_code_table_names_every_documented_code():
    for code in (1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 21, 77, 101):
        cls, meaning = de.DKMS_EXIT_ERRORS[code]
        assert issubclass(cls, MemsaverError) and cls.remedy and meaning
    assert de.DKMS_EXIT_ERRORS[77][0] is de.BuildSkipped
    assert de.DKMS_EXIT_ERRORS[10][0] is de.BuildFailed
    assert de.DKMS_EXIT_ERRORS[101][0] is de.PreInstallRefused


@pytest.mark.parametrize("tier, value", [(None, 3), ("leaf", 3), ("4k-all", 1), ("4k", 1), ("256", 2)])
def test_render_passes_the_policy_tier_value(tmp_path, tier, value):
    """The configured tier reaches the build as decide/policy.py's module value (the default 'leaf' is 3,
    not 0.1.0's 1: a build record saying 'leaf' beside a module packing 4k-all was the bug)."""
    (tmp_path / "usr/src").mkdir(parents=True)
    cfg = Config() if tier is None else Config(tier=tier)
    r = render.render(Host(tmp_path), cfg, "550.163.01", "/usr/src/nvidia-550.163.01")
    root = tmp_path / r["path"].lstrip("/")
    meta = json.loads((root / "spark-memsaver.json").read_text())
    assert meta["tier_default"] == value
    assert f'kotool apply "$here/nvsrc" "$here/nv" {value}' in (root / "spark-memsaver-build").read_text()


@pytest.mark.parametrize("policy", ["64k-only", "all"])
def test_render_into_fixture_root(tmp_path, policy):
    """Rendering writes only our files, never links, with the policy's BUILD_EXCLUSIVE lines; bash and
    python accept the generated scripts."""
    (tmp_path / "usr/src").mkdir(parents=True)
    host = Host(tmp_path)
    cfg = Config(kernels=policy, tier="256")
    r = render.render(host, cfg, "550.163.01", "/usr/src/nvidia-550.163.01")
    root = tmp_path / r["path"].lstrip("/")
    assert r["changed"] and root.is_dir()
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert not [p for p in root.rglob("*") if p.is_symlink()]
    assert {"dkms.conf", "spark-memsaver-build", "spark-memsaver-kotool", "spark-memsaver.json",
            "uvm_patch/manifest.yaml"} <= set(files)
    assert not any("nvidia-" in f and not f.startswith("uvm_patch") for f in files)
    conf = (root / "dkms.conf").read_text()
    assert 'PACKAGE_NAME="spark-memsaver-uvm"' in conf and 'PACKAGE_VERSION="550.163.01-sm' in conf
    assert 'AUTOINSTALL="yes"' in conf and 'BUILT_MODULE_NAME[0]="nvidia-uvm"' in conf
    assert 'PRE_INSTALL="spark-memsaver-kotool guard ${kernelver} ${arch}"' in conf
    if policy == "64k-only":
        assert 'BUILD_EXCLUSIVE_ARCH="^aarch64$"' in conf and "CONFIG_ARM64_64K_PAGES" in conf
    else:
        assert "BUILD_EXCLUSIVE_ARCH" not in conf and "CONFIG_ARM64_64K_PAGES" not in conf
    meta = json.loads((root / "spark-memsaver.json").read_text())
    assert meta["tier_default"] == 2 and meta["driver_version"] == "550.163.01"
    assert "kotool apply \"$here/nvsrc\" \"$here/nv\" 2" in (root / "spark-memsaver-build").read_text()
    assert os.access(root / "spark-memsaver-build", os.X_OK)
    assert sh("bash", "-n", root / "spark-memsaver-build").returncode == 0
    assert sh("bash", "-n", root / "dkms.conf").returncode == 0
    assert sh("python3", "-m", "py_compile", root / "spark-memsaver-kotool").returncode == 0
    again = render.render(host, cfg, "550.163.01", "/usr/src/nvidia-550.163.01")
    assert again["changed"] is False


def test_policy_64k_only_refuses_x86_headers():
    kernel, _ = nvsrc.x86_headers()
    from spark_memsaver.decide import policy
    k = policy.kernel_of(kernel, dkms_run.kernel_config(Host("/"), kernel))     # the build preflight's reading
    v = policy.verdict(k, Config(kernels="64k-only"))
    assert not v.ok and v.rule == "page-size"
    assert policy.verdict(k, Config(kernels="all")).ok


# ------------------------------------------------------------------------------------------------
# Refusals: each one fails before compiling and leaves nothing installed

def test_refuses_driver_without_patch(host_env, tmp_path, monkeypatch):
    host, kernel, stock = host_env
    data = tmp_path / "uvm_patch"
    shutil.copytree(uvm_patch.patch_data_dir(), data)
    import yaml
    doc = yaml.safe_load((data / "manifest.yaml").read_text())
    doc["drivers"] = [d for d in doc["drivers"] if DRIVER not in d.get("versions", [])]
    (data / "manifest.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("SPARK_MEMSAVER_UVM_PATCH_DIR", str(data))
    with pytest.raises(uvm_patch.UnknownDriverVersion):
        dbuild.build(host, CFG, kernel=kernel)
    nothing_of_ours(kernel, stock)


def _patched_files():
    text = (uvm_patch.patch_data_dir() / "patches/r550/0001-uvm-pt-pack-hooks.patch").read_text()
    return re.findall(r"^\+\+\+ b/(\S+)", text, re.M)


def test_refuses_patch_that_does_not_apply(host_env):
    host, kernel, stock = host_env
    target = Path(stock["source_dir"]) / "nvidia-uvm/uvm_mmu.c"
    assert "nvidia-uvm/uvm_mmu.c" in _patched_files()
    orig = target.read_bytes()
    # Change lines the patch uses as context (a driver respin would), zero fuzz must refuse.
    text = orig.decode()
    lines = text.splitlines(keepends=True)
    hunk = (uvm_patch.patch_data_dir() / "patches/r550/0001-uvm-pt-pack-hooks.patch").read_text()
    ctx = [l[1:] for l in hunk.splitlines() if l.startswith(" ") and len(l.strip()) > 12]
    victims = [i for i, l in enumerate(lines) if l.rstrip("\n") in ctx]
    assert victims
    for i in victims:
        lines[i] = lines[i].rstrip("\n") + " /* respin */\n"
    target.write_text("".join(lines))
    try:
        with pytest.raises(uvm_patch.PatchDoesNotApply):
            dbuild.build(host, CFG, kernel=kernel)
    finally:
        target.write_bytes(orig)
    nothing_of_ours(kernel, stock)


def test_refuses_missing_headers(host_env):
    host, kernel, stock = host_env
    fake = "6.1.0-0-smtest-noheaders"
    mdir = Path(f"/lib/modules/{fake}")
    assert not mdir.exists()
    try:
        (mdir / "kernel/nvidia-550-open").mkdir(parents=True)
        for n in ("nvidia.ko", "nvidia-uvm.ko"):
            shutil.copy2(Path(stock["module_dir"]) / n, mdir / "kernel/nvidia-550-open" / n)
        sh("depmod", "-a", fake, check=True)
        assert selected_path(fake, "nvidia")  # a driver is there; only the headers are missing
        with pytest.raises(de.HeadersMissing):
            dbuild.build(host, CFG, kernel=fake)
        with pytest.raises(de.HeadersMissing):
            override.install(host, CFG, kernel=fake)
    finally:
        shutil.rmtree(mdir, ignore_errors=True)
    nothing_of_ours(kernel, stock)


@pytest.mark.parametrize("damage", ["truncate-conftest", "drop-nvidia-kbuild", "drop-uvm-dir"])
def test_refuses_corrupted_nvidia_source(host_env, damage):
    host, kernel, stock = host_env
    src = Path(stock["source_dir"])
    backup = src.parent / f".{src.name}.testbackup"
    shutil.rmtree(backup, ignore_errors=True)
    shutil.copytree(src, backup, symlinks=True)
    try:
        if damage == "truncate-conftest":
            (src / "conftest.sh").write_text("")
        elif damage == "drop-nvidia-kbuild":
            (src / "nvidia/nvidia.Kbuild").unlink()
        else:
            shutil.rmtree(src / "nvidia-uvm")
        with pytest.raises(de.DriverSourceCorrupt):
            dbuild.build(host, CFG, kernel=kernel)
    finally:
        shutil.rmtree(src)
        os.rename(backup, src)
    nothing_of_ours(kernel, stock)


def test_refuses_driver_version_mismatch(host_env):
    host, kernel, stock = host_env
    with pytest.raises(de.DriverMismatch):
        dbuild.build(host, CFG, kernel=kernel, driver_version="555.58.02")
    nothing_of_ours(kernel, stock)


# ------------------------------------------------------------------------------------------------
# The successful path (one real DKMS build shared by all of these)

def test_build_registers_and_builds(host_env, built):
    host, kernel, stock = host_env
    res, seen = built
    ver = odkms.dkms_version_string(DRIVER)
    assert res["status"] == "built" and res["dkms_version"] == ver and res["driver"] == DRIVER
    assert Path(res["module"]).is_file() and f"/var/lib/dkms/{odkms.PACKAGE}/{ver}/{kernel}/" in res["module"]
    st = sh("dkms", "status", "-m", odkms.PACKAGE, check=True).stdout
    assert re.search(rf"{odkms.PACKAGE}/{re.escape(ver)}, {re.escape(kernel)}, \S+: built", st), st
    # progress: monotonic enough to draw a bar, reached the end, and saw the compile phase
    fr = [f for f, _ in seen]
    assert fr[-1] == 1.0 and max(fr[:-1]) < 1.0
    assert any("compiling nvidia-uvm (" in m for _, m in seen), seen[-5:]
    assert Path(res["log"]).is_file() and "spark-memsaver-progress" in Path(res["log"]).read_text()
    # the stock module is still the selected one: building installs nothing
    assert selected_path(kernel) == stock["nvidia_uvm"]


def test_registered_tree_holds_only_our_files(host_env, built):
    res, _ = built
    root = Path(res["source"])
    assert root.is_dir() and not root.is_symlink()
    assert not [p for p in root.rglob("*") if p.is_symlink()]
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert size < 2_000_000, size  # no NVIDIA source in it
    assert os.readlink(f"/var/lib/dkms/{odkms.PACKAGE}/{res['dkms_version']}/source") == str(root)


def test_built_module_is_patched_versioned_and_signed(host_env, built):
    host, kernel, stock = host_env
    res, _ = built
    ko = res["module"]
    f = lambda field: sh("modinfo", "-F", field, ko).stdout.strip()
    assert f("version") == DRIVER
    assert f("vermagic").split()[0] == kernel
    assert f("depends") == "nvidia"
    assert f("spark_memsaver") == "uvm-pt-pack/1"
    parms = sh("modinfo", "-F", "parm", ko).stdout
    assert "uvm_pt_pack:" in parms and "uvm_pt_pack_stats:" in parms
    # signed by the key the record names, which is the certificate DKMS used
    rec = json.loads(Path(signing.RECORD).read_text())
    cert_out = sh("openssl", "x509", "-inform", "DER", "-in", rec["cert"], "-noout", "-serial", "-subject",
                  check=True).stdout
    serial = re.search(r"serial=([0-9A-F]+)", cert_out).group(1).lstrip("0")
    assert f("sig_key").replace(":", "").lstrip("0") == serial
    assert f("signer") in cert_out
    assert oct(os.stat(rec["key"]).st_mode & 0o777) == "0o600"
    assert res["signing"]["applies"] is True
    signed = json.loads(Path(signing.SIGNED_LOG).read_text())["signed"]
    assert any(e["module"] == ko and e["serial"] for e in signed)


def _crcs_by_objcopy(ko: str) -> dict:
    """Independent of our kotool: binutils only. objdump -t names each __crc_ symbol's section
    (__kcrctab, or __kcrctab_gpl for EXPORT_SYMBOL_GPL) and offset; objcopy dumps that section."""
    sections: dict[str, bytes] = {}
    out = {}
    for line in sh("objdump", "-t", ko, check=True).stdout.splitlines():
        m = re.match(r"^([0-9a-f]+)\s.*\s(__kcrctab\S*)\s+[0-9a-f]+\s+__crc_(\S+)$", line)
        if not m:
            continue
        off, sec, sym = int(m.group(1), 16), m.group(2), m.group(3)
        if sec not in sections:
            tmp = Path("/tmp") / f"kcrctab-{os.getpid()}"
            sh("objcopy", "-O", "binary", f"--only-section={sec}", ko, tmp, check=True)
            sections[sec] = tmp.read_bytes()
            tmp.unlink()
        out[sym] = int.from_bytes(sections[sec][off:off + 4], "little")
    return out


def test_symbol_crcs_equal_the_installed_nvidia_ko(host_env, built):
    host, kernel, stock = host_env
    res, _ = built
    nv = _crcs_by_objcopy(stock["nvidia"])
    dump = sh("modprobe", "-C", "/dev/null", "--dump-modversions", res["module"], check=True).stdout
    ours = {s: int(c, 16) for c, s in (l.split("\t")[:2] for l in dump.splitlines() if "\t" in l)}
    uvm = {s: c for s, c in ours.items() if s.startswith("nvUvmInterface")}
    assert len(uvm) >= 70, len(uvm)
    assert {s: nv.get(s) for s in uvm} == uvm
    # and our generator agrees with the independent reading, line for line
    gen = dkms_run.kotool().symvers_lines(stock["nvidia"])
    assert {l.split("\t")[1]: int(l.split("\t")[0], 16) for l in gen} == nv


def test_install_refusal_by_dkms_is_detected(host_env, built, monkeypatch):
    """DKMS 3.0.x (Debian 12, Ubuntu 24.04) refuses to replace a same-version stock module yet exits 0: without the
    force-install file we must report InstallRefused and leave the stock module selected and nothing registered as
    installed. DKMS >= 3.1 (Debian 13's system DKMS) replaces it: there the install goes through and selects ours,
    and is undone after (the next tests start from stock)."""
    host, kernel, stock = host_env
    monkeypatch.setattr(override, "ensure_host_files", lambda h: [])  # install lives in act/override.py
    force = Path(odkms.FORCE_FILE)
    saved = force.read_text() if force.exists() else None
    force.unlink(missing_ok=True)
    refuses = dkms_run.dkms_version(host).startswith("3.0.")
    try:
        if refuses:
            with pytest.raises(de.InstallRefused):
                override.install(host, CFG, kernel=kernel)
        else:
            r = override.install(host, CFG, kernel=kernel)["installed"][0]
            assert selected_path(kernel) == ours_path(kernel) == r["selected"]
            dkms_run._uninstall_kernel(host, r["dkms_version"], kernel)   # back to stock, build kept
    finally:
        if saved is not None:
            force.write_text(saved)
    assert selected_path(kernel) == stock["nvidia_uvm"]
    assert odkms.installed_version(host, kernel) is None
    assert dkms_run.sha256(stock["nvidia_uvm"]) == stock["nvidia_uvm_sha256"]


def test_pre_install_guard_refuses_a_mismatched_build(host_env, built):
    """The guard runs inside `dkms install` (PRE_INSTALL): a build whose recorded driver differs from the
    nvidia.ko it would load beside makes dkms exit 101 and installs nothing."""
    host, kernel, stock = host_env
    res, _ = built
    dkms_run.ensure_host_files(host)
    meta_p = Path(res["source"]) / "spark-memsaver.json"
    orig = meta_p.read_text()
    meta = json.loads(orig)
    meta["driver_version"] = "550.163.02"
    meta_p.write_text(json.dumps(meta))
    try:
        p = sh("dkms", "install", "-m", odkms.PACKAGE, "-v", res["dkms_version"], "-k", kernel)
    finally:
        meta_p.write_text(orig)
    assert p.returncode == 101, p.stdout + p.stderr
    assert "module version is '550.163.01', expected the driver version 550.163.02" in p.stdout + p.stderr
    assert selected_path(kernel) == stock["nvidia_uvm"]
    assert odkms.installed_version(host, kernel) is None


def test_install_selects_the_verified_override(host_env, installed, modconf):
    host, kernel, stock = host_env
    r = installed["installed"][0]
    want = ours_path(kernel)
    assert want.startswith(f"/lib/modules/{kernel}/updates/dkms/nvidia-uvm.ko")
    assert selected_path(kernel) == want == r["selected"]
    v = override.verify_installed(host, kernel)
    assert v["ok"], v["problems"]
    assert v["matches_dkms_copy"] and v["facts"]["nvidia_symbols"] >= 70
    # the files a load inserts, in order: the stock nvidia.ko (after what it needs: drm.ko on Debian 13's 6.12),
    # then ours, last
    deps = [d.split() for d in show_depends(kernel, "nvidia_uvm", modconf) if d.strip()]   # insmod PATH [options]
    nv = [i for i, d in enumerate(deps) if d[:2] == ["insmod", stock["nvidia"]]]
    assert nv and nv[0] < len(deps) - 1 and deps[-1][:2] == ["insmod", want], deps
    # the stock file is untouched where the driver package put it (DKMS 3.0.x), or byte for byte in DKMS's
    # original_module archive (DKMS >= 3.1 moves it there on install: Debian 13's system DKMS)
    if dkms_run.dkms_version(host).startswith("3.0."):
        assert dkms_run.sha256(stock["nvidia_uvm"]) == stock["nvidia_uvm_sha256"]
    else:
        archived = archived_stock(kernel)
        assert archived and dkms_run.sha256(archived[0]) == stock["nvidia_uvm_sha256"]
    assert r["stock"]["stock_path"] == stock["nvidia_uvm"]


def test_install_again_is_idempotent(host_env, installed):
    host, kernel, stock = host_env
    again = override.install(host, CFG, kernel=kernel)
    assert again["installed"][0]["build"] == "already-built"
    assert selected_path(kernel) == ours_path(kernel)


def test_dkms_3_2_install_moves_stock_into_original_module(host_env, installed, monkeypatch):
    """DKMS >= 3.1 (here Debian trixie's real 3.2.2 script) moves the stock nvidia-uvm into
    /var/lib/dkms/<pkg>/original_module on install. Our install must still verify the override; the
    removal test below then runs 3.0.10, which restores nothing and deletes original_module: only our
    backup + repair can bring the stock file back."""
    host, kernel, stock = host_env
    exe = dkms_release("trixie")
    ver = installed["installed"][0]["dkms_version"]
    dkms_run._uninstall_kernel(host, ver, kernel)   # back to stock, build kept
    assert selected_path(kernel) == stock["nvidia_uvm"]
    monkeypatch.setenv("SPARK_MEMSAVER_DKMS", str(exe))
    assert dkms_run.dkms_version(host).startswith("3.2")
    r = override.install(host, CFG, kernel=kernel)["installed"][0]
    assert r["build"] == "already-built"
    assert selected_path(kernel) == ours_path(kernel)
    assert not Path(stock["nvidia_uvm"]).exists(), "DKMS 3.2 should have moved the stock file away"
    archived = archived_stock(kernel)
    assert archived and dkms_run.sha256(archived[0]) == stock["nvidia_uvm_sha256"]
    assert override.verify_installed(host, kernel)["ok"]


def test_cli_refuses_kernel_outside_policy(host_env, installed, tmp_path):
    host, kernel, stock = host_env
    cfg = tmp_path / "config.yaml"
    cfg.write_text("kernels: 64k-only\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"), SPARK_MEMSAVER_CONFIG=str(cfg))
    p = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "build", "--kernel", kernel, "--json"],
                       capture_output=True, text=True, env=env,
                       input=None)
    # policy 64k-only: the CLI refuses this x86 kernel with the named error (exit 1), before touching DKMS
    assert p.returncode == 1, p.stdout + p.stderr
    assert json.loads(p.stdout)["error"]["code"] == "kernel-outside-policy"


def test_remove_after_source_deleted_restores_stock_and_spares_others(host_env, installed, dummy_module):
    host, kernel, stock = host_env
    ver = installed["installed"][0]["dkms_version"]
    shutil.rmtree(f"/usr/src/{odkms.PACKAGE}-{ver}")  # behind DKMS's back
    res = override.remove(host, CFG, kernel=kernel)  # the system's DKMS again (Debian 12: 3.0.10)
    assert res["recovered"] == [ver]
    if dkms_run.dkms_version(host).startswith("3.0."):
        # 3.0.10 restores nothing and deleted original_module: only our backup + repair brought the stock file back
        # (DKMS >= 3.1, Debian 13's system DKMS, puts its archived original back itself)
        assert any("restored" in a for r in res["restored"] for a in r["actions"]), res["restored"]
    assert selected_path(kernel) == stock["nvidia_uvm"]
    assert dkms_run.sha256(stock["nvidia_uvm"]) == stock["nvidia_uvm_sha256"]
    nothing_of_ours(kernel, stock)
    st = sh("dkms", "status")
    assert st.returncode == 0, st.stderr
    assert odkms.PACKAGE not in st.stdout
    assert re.search(rf"{DUMMY}/1.0, {re.escape(kernel)}, \S+: built", st.stdout), st.stdout
    assert res["registrations_left"] == []


def test_restore_keeps_a_stock_file_a_driver_package_replaced(tmp_path):
    """Plain `dpkg -i` of a newer driver replaced the stock nvidia-uvm we recorded at install time. Removing
    our override must keep the NEW stock file (restoring the recorded one would pair the old driver's UVM
    with the new nvidia.ko) and verify it as selected. Fixture root: real ELF modules, real depmod."""
    import hashlib

    from spark_memsaver.host import Host
    from tests.support import sparkroot

    root = sparkroot.make_spark_root(tmp_path / "root")
    k = sparkroot.SPARK_KERNEL
    stock = f"/lib/modules/{k}/kernel/nvidia-580-open/nvidia-uvm.ko"
    old = sparkroot.make_module(tmp_path / "old" / "nvidia-uvm.ko",
                                sparkroot.uvm_fields("575.51.02", "OLDSRCVERSION00000000000", k, ours=False))
    old_sha = hashlib.sha256(old.read_bytes()).hexdigest()
    backup = root / f"var/lib/spark-memsaver/dkms/original/{k}/kernel/nvidia-575-open/nvidia-uvm.ko"
    backup.parent.mkdir(parents=True)
    backup.write_bytes(old.read_bytes())
    sparkroot.write(root, f"/var/lib/spark-memsaver/dkms/{k}.json",
                    json.dumps({"kernel": k, "stock_path": stock, "stock_sha256": old_sha}))
    new_sha = hashlib.sha256((root / stock.lstrip("/")).read_bytes()).hexdigest()
    res = override.restore_stock(Host(root), k)
    assert res["ok"], res
    assert res["selected"] == stock
    assert hashlib.sha256((root / stock.lstrip("/")).read_bytes()).hexdigest() == new_sha
    assert any("replaced the recorded stock file" in a for a in res["actions"])


def test_engines_take_no_lock_of_their_own(host_env):
    """Issue 12 defect 1: a local user holding /run/lock/spark-memsaver-dkms.lock (world-writable /run/lock)
    hung every build/install/remove. The engines now take no lock (the executor holds "lifecycle" in the
    root-only RUN_DIR): with that old lock file held, a build still reaches its refusal at once."""
    import fcntl
    import threading

    host, kernel, stock = host_env
    old = Path("/run/lock/spark-memsaver-dkms.lock")
    old.parent.mkdir(parents=True, exist_ok=True)
    existed = old.exists()
    box = {}
    with open(old, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)

        def run():
            try:
                dbuild.build(host, CFG, kernel=kernel, driver_version="555.58.02")
            except Exception as e:  # the named refusal expected below
                box["err"] = e
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(120)
        fcntl.flock(fh, fcntl.LOCK_UN)
    if not existed:
        old.unlink(missing_ok=True)
    assert not t.is_alive(), "dbuild.build waited on the old /run/lock lock file"
    assert isinstance(box.get("err"), de.DriverMismatch), box
    nothing_of_ours(kernel, stock)
