"""The Debian package: real dpkg-buildpackage, lintian, and install/remove/purge in a Debian 12 container
booted with a real systemd (tests/support/nspawn.py).

What stands in for what: the container shares this machine's kernel, so nothing is loaded; the NVIDIA
driver is the lifecycle area's test package (tests/support/driverdeb.py: NVIDIA's real open tree from
Debian plus real stock nvidia.ko/nvidia-uvm.ko compiled for Debian's 6.1 kernel headers, which the
container sees read-only). The kernel is x86_64 with 4 KiB pages, so the test config says ``kernels: all``
(the shipped default builds only for 64 KiB arm64 kernels).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import needs, nspawn, suites

pytestmark = pytest.mark.package

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "daemon/spark_memsaver/report/status.schema.json"
BUS_NAME = (REPO / "systemd/BUSNAME").read_text().strip()
OBJECT_PATH = "/" + BUS_NAME.replace(".", "/")
DKMS_NAME = "spark-memsaver-uvm"
DRIVER = "550.163.01"

RUNTIME_DEPENDS = ("python3", "python3-pydbus", "python3-gi", "python3-psutil", "python3-pyudev",
                   "python3-jinja2", "python3-click", "python3-yaml", "dkms", "kmod", "patch", "openssl",
                   "mokutil", "keyutils", "make", "gcc", "dbus", "zstd")
# the oldest dkms whose behaviour the code relies on (docs/distributions.md): Debian 12's 3.0.10-8 carries
# BUILD_EXCLUSIVE_CONFIG and exit 77 for an excluded kernel, which upstream has from 3.0.11 on
DKMS_DEPENDS = "dkms (>= 3.0.10-8)"


def _need_root():
    needs.root("building and installing the package needs root (run through tools/test as root)")


def _tail(text: str, n: int = 30) -> str:
    return "\n".join((text or "").strip().splitlines()[-n:])


@pytest.fixture(scope="module")
def deb() -> Path:
    """packaging/build-deb as tools/run calls it (real dpkg-buildpackage; lintian runs in its own test)."""
    _need_root()
    needs.require("dpkg-buildpackage", "dh", remedy="tools/deps/package.txt")
    t = time.monotonic()
    r = subprocess.run([str(REPO / "packaging/build-deb"), "--no-lintian"], cwd=REPO, text=True, capture_output=True,
                       timeout=1200)
    assert r.returncode == 0, f"build-deb failed (rc={r.returncode}):\n{_tail(r.stdout)}\n{_tail(r.stderr)}"
    path = Path(r.stdout.strip().splitlines()[-1])
    assert path.is_file() and re.fullmatch(r"spark-memsaver_[0-9][^_]*_all\.deb", path.name), path
    print(f"build-deb: {time.monotonic() - t:.1f}s -> {path}")
    return path


def _deb_files(deb: Path) -> list[str]:
    out = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    names = subprocess.run(["tar", "-t", "-v"], input=out, capture_output=True, check=True).stdout.decode()
    files = []
    for line in names.splitlines():
        if line.startswith("d"):
            continue
        files.append("/" + line.split()[-1].lstrip("./") if "->" not in line else
                     "/" + line.split(" -> ")[0].split()[-1].lstrip("./"))
    return files


def test_deb_fields_and_contents(deb):
    fields = {k: subprocess.run(["dpkg-deb", "-f", str(deb), k], capture_output=True, text=True,
                                check=True).stdout.strip() for k in ("Package", "Architecture", "Depends",
                                                                     "Recommends", "Version")}
    assert fields["Package"] == "spark-memsaver" and fields["Architecture"] == "all"
    from spark_memsaver import __version__
    assert fields["Version"] == __version__
    depends = {d.strip().split()[0].split(":")[0] for d in fields["Depends"].split(",")}
    missing = [d for d in RUNTIME_DEPENDS if d not in depends]
    assert not missing, f"Depends lacks {missing}: {fields['Depends']}"
    assert DKMS_DEPENDS in [d.strip() for d in fields["Depends"].split(",")], fields["Depends"]
    assert "polkitd" in fields["Recommends"]
    files = set(_deb_files(deb))
    for want in ("/usr/bin/spark-memsaver", "/usr/bin/spark-memsaverd",
                 "/usr/lib/python3/dist-packages/spark_memsaver/cli/main.py",
                 "/usr/lib/python3/dist-packages/spark_memsaver/report/status.schema.json",
                 "/lib/systemd/system/spark-memsaverd.service",
                 "/usr/lib/tmpfiles.d/spark-memsaver.conf",
                 "/etc/spark-memsaver/config.yaml",
                 f"/usr/share/dbus-1/system.d/{BUS_NAME}.conf",
                 "/usr/share/spark-memsaver/uvm_patch/manifest.yaml",
                 "/usr/share/spark-memsaver/uvm_patch/hazards.yaml",
                 "/usr/share/spark-memsaver/dkms/templates/dkms.conf.j2",
                 "/usr/share/man/man8/spark-memsaver.8.gz",
                 "/usr/share/bash-completion/completions/spark-memsaver"):
        assert want in files, f"{want} is not in the package"
    # every file the lifecycle area lists is shipped where it says
    for line in (REPO / "systemd/LIFECYCLE-FILES").read_text().splitlines():
        parts = line.split("#", 1)[0].split()
        if len(parts) >= 2 and parts[1] != "DEBIAN/triggers":
            assert parts[1] in files, f"LIFECYCLE-FILES: {parts[1]} is not in the package"
    assert not any("/daemon/" in f or f.startswith("/usr/lib/python3/dist-packages/daemon") for f in files)
    # the examples the man page, README and `metrics --help` point at are shipped there, uncompressed
    from tests.test_docs_vs_code import package_doc_paths
    for where, named in package_doc_paths().items():
        for p in named:
            assert p in files or any(f.startswith(p.rstrip("/") + "/") for f in files), (where, p)
    for want in ("monitoring/README.md", "monitoring/alerts.yml", "monitoring/grafana-dashboard.json",
                 "ansible/README.md", "ansible/roles/spark_memsaver/tasks/main.yml"):
        assert f"/usr/share/doc/spark-memsaver/examples/{want}" in files, want
    # the command's script enters through cli/entry.py: status without click (issue 38)
    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    script = subprocess.run(["tar", "-x", "-O", "./usr/bin/spark-memsaver"], input=tar, capture_output=True,
                            check=True).stdout.decode()
    assert "spark_memsaver.cli.entry" in script, script
    ctrl = subprocess.run(["dpkg-deb", "-I", str(deb), "conffiles"], capture_output=True, text=True).stdout
    assert "/etc/spark-memsaver/config.yaml" in ctrl.split()


def _unit_settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_unit_keeps_what_the_daemon_must_do():
    """The unit's sandbox leaves writable exactly what DKMS, depmod, initramfs and our state need."""
    s = _unit_settings((REPO / "systemd/spark-memsaverd.service").read_text())
    assert s["Type"] == ["dbus"] and s["BusName"] == [BUS_NAME]
    assert s["ExecStart"] == ["/usr/bin/spark-memsaverd"] and s["Restart"] == ["on-failure"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]       # the daemon re-reads its config on SIGHUP
    assert s["ProtectSystem"] == ["strict"]
    rw = {p.lstrip("-") for v in s["ReadWritePaths"] for p in v.split()}
    for path in ("/var/lib/dkms", "/lib/modules", "/usr/lib/modules", "/usr/src", "/boot", "/etc/dkms"):
        assert path in rw, f"{path} is not writable for the daemon"
    assert s["StateDirectory"] == ["spark-memsaver"] and s["CacheDirectory"] == ["spark-memsaver"]
    assert s["ConfigurationDirectory"] == ["spark-memsaver"]
    assert "PrivateUsers" not in s and "PrivateNetwork" not in s       # they break uevents
    assert s.get("ProtectKernelModules", ["no"]) == ["no"]             # it loads modules
    caps = s["CapabilityBoundingSet"][0].split()
    assert "CAP_SYS_MODULE" in caps
    assert "AF_NETLINK" in s["RestrictAddressFamilies"][0].split()     # pyudev
    assert "@module" in s["SystemCallFilter"][0].split()
    # every hardening line is documented: a comment right above each group
    text = (REPO / "systemd/spark-memsaverd.service").read_text().splitlines()
    for i, line in enumerate(text):
        key = line.split("=", 1)[0]
        if key in ("ReadWritePaths", "ProtectSystem", "CapabilityBoundingSet", "SystemCallFilter",
                   "ProtectKernelTunables", "ProtectKernelModules", "RestrictAddressFamilies"):
            j = i - 1
            while j >= 0 and text[j].split("=", 1)[0] in s and not text[j].startswith("#"):
                j -= 1
            assert j >= 0 and text[j].startswith("#"), f"undocumented hardening line: {line}"


def test_maintainer_scripts(deb, tmp_path):
    subprocess.run(["dpkg-deb", "-e", str(deb), str(tmp_path / "c")], check=True)
    for name in ("postinst", "prerm", "postrm"):
        script = tmp_path / "c" / name
        r = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{name}: {r.stderr}"
    post = (tmp_path / "c/postinst").read_text()
    assert "deb-systemd-invoke" in post and "spark-memsaverd.service" in post  # dh_installsystemd ran
    assert "systemd-tmpfiles" in post                                         # dh_installtmpfiles ran
    assert "py3compile -p spark-memsaver" in post                             # dh_python3 ran
    # postrm purge never touches shared signing keys (it reads only our drop-in's mok_* lines); it names mokutil
    # in its note on an enrolled fleet certificate, never runs it
    postrm = (tmp_path / "c/postrm").read_text()
    assert "mok" not in postrm.replace("# (/var/lib/dkms/mok.*, /var/lib/shim-signed)", "") \
        .replace("mok_signing_key", "").replace("mok_certificate", "").replace("sudo mokutil --", "")
    assert "shim-signed" not in postrm.replace("# (/var/lib/dkms/mok.*, /var/lib/shim-signed)", "")


def test_bash_completion_is_clicks(deb, tmp_path):
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp_path / "x")], check=True)
    comp = tmp_path / "x/usr/share/bash-completion/completions/spark-memsaver"
    text = comp.read_text()
    assert "_SPARK_MEMSAVER_COMPLETE=bash_complete" in text and "complete -o nosort -F" in text
    r = subprocess.run(["bash", "-n", str(comp)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # bash completes "spark-memsaver mo<TAB>" to "mok" through the shipped function and the real CLI
    wrapper = tmp_path / "spark-memsaver"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={REPO}/daemon exec /usr/bin/python3 -c "
                       "'import sys; sys.argv[0] = \"spark-memsaver\"; from spark_memsaver.cli.main import main; main()'\n")
    wrapper.chmod(0o755)
    r = subprocess.run(["bash", "-c", f'source "{comp}"; COMP_WORDS=(spark-memsaver mo); COMP_CWORD=1; '
                        f'_spark_memsaver_completion "{wrapper}"; echo "${{COMPREPLY[@]}}"'],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["mok"], (r.stdout, r.stderr)


def test_lintian_no_errors(deb):
    needs.require("lintian", remedy="tools/deps/package.txt")
    r = subprocess.run(["lintian", "--pedantic", "--display-info", str(deb)], capture_output=True, text=True,
                       timeout=600)
    out = r.stdout + r.stderr
    errors = [ln for ln in out.splitlines() if ln.startswith("E: ")]
    assert not errors, "lintian errors:\n" + "\n".join(errors)
    # every remaining warning is explained in packaging/README.md
    readme = (REPO / "packaging/README.md").read_text()
    for ln in out.splitlines():
        m = re.match(r"W: \S+: (\S+)", ln)
        if m:
            assert m.group(1) in readme, f"lintian warning not explained in packaging/README.md: {ln}"


# ------------------------------------------------------------------------------------------------
# in a container

@pytest.fixture(scope="module")
def driver_deb() -> Path | None:
    """The lifecycle area's NVIDIA 550 test package (cached; the first build compiles nvidia.ko)."""
    _need_root()
    from tests.support import driverdeb
    return driverdeb.driver_deb(DRIVER)


@pytest.fixture(scope="module", params=suites.SUITES)
def suite(request) -> str:
    """The Debian release of the container (tests/support/suites.py: Debian 12 and 13)."""
    return suites.suite_param(request.param)


@contextlib.contextmanager
def _container(suite: str = "bookworm", **kw):
    needs.containers()
    with nspawn.Container(suite=suite, extra=suites.extra(suite), kernels=nspawn.kernel_headers(), **kw) as c:
        yield c


def _ok(c, argv, timeout=300, **kw):
    return c.run(argv, timeout=timeout, **kw).stdout


def _status_json(c) -> dict:
    r = c.run(["spark-memsaver", "status", "--json"], check=False, timeout=120)
    assert r.returncode in (0, 1), f"status --json exit {r.returncode}:\n{r.stdout}\n{r.stderr}"
    doc = json.loads(r.stdout)
    if SCHEMA.is_file():
        import jsonschema
        jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    return doc


def _wait_daemon_idle(c, timeout=600):
    """Until the daemon has no job running (it may react to the driver installation itself)."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        r = c.run(["busctl", "get-property", BUS_NAME, OBJECT_PATH, BUS_NAME, "JobState"], check=False, timeout=30)
        state = r.stdout.strip()
        if r.returncode == 0 and '"running"' not in state and '"queued"' not in state:
            return state
        time.sleep(2)
    raise AssertionError(f"daemon job still {state} after {timeout}s:\n{c.journal('spark-memsaverd.service')}")


def _selected_uvm(c, kernel) -> str:
    return _ok(c, ["modinfo", "-k", kernel, "-n", "nvidia-uvm"]).strip()


def _modinfo(c, field, path) -> str:
    return _ok(c, ["modinfo", "-F", field, path]).strip()


def test_install_build_remove_purge_in_container(deb, driver_deb, suite):
    kernels = nspawn.kernel_headers()
    if not kernels:
        needs.absent("kernel headers", "tools/deps/base.txt installs linux-headers-amd64")
    kernel = driver_deb.parent.name if driver_deb.parent.name in kernels else kernels[0]
    timings = {}
    t0 = time.monotonic()
    with _container(suite) as c:
        timings["boot"] = time.monotonic() - t0
        pkg = c.copy_in(deb, "/root/")
        drv = c.copy_in(driver_deb, "/root/")

        # 1. apt install ./spark-memsaver_*.deb: the daemon runs and owns its name
        t = time.monotonic()
        r = c.run(["apt-get", "install", "-y", pkg], check=False, timeout=600)
        timings["install"] = time.monotonic() - t
        assert r.returncode == 0, f"apt install failed:\n{_tail(r.stdout)}\n{_tail(r.stderr)}"
        active = c.run(["systemctl", "is-active", "spark-memsaverd"], check=False).stdout.strip()
        assert active == "active", f"spark-memsaverd is {active}:\n{c.journal('spark-memsaverd.service')}"
        assert _ok(c, ["systemctl", "is-enabled", "spark-memsaverd"]).strip() == "enabled"

        # 2. busctl introspect shows our interface, with its methods and properties
        intro = _ok(c, ["busctl", "introspect", "--no-pager", BUS_NAME, OBJECT_PATH])
        assert re.search(rf"^{re.escape(BUS_NAME)}\s+interface", intro, re.M), intro
        for member in (".GetStatus", ".State"):
            assert re.search(rf"^{re.escape(member)}\s", intro, re.M), f"{member} missing:\n{intro}"

        # 3. status --json (through the daemon) is valid; no driver yet
        doc = _status_json(c)
        assert doc.get("source") == "daemon", doc.get("source")
        assert doc["state"] == "not-applicable", doc["state"]
        assert c.exists("/var/lib/spark-memsaver") and c.exists("/run/spark-memsaver")

        # 4. a supported driver arrives: our hooks build, sign, install and select the override
        # (the daemon reads its config at start: restart it after editing, as config.yaml says)
        c.sh("printf 'kernels: all\\n' >> /etc/spark-memsaver/config.yaml && systemctl restart spark-memsaverd")
        t = time.monotonic()
        r = c.run(["apt-get", "install", "-y", drv], check=False, timeout=1200)
        _wait_daemon_idle(c)
        timings["driver+build"] = time.monotonic() - t
        assert r.returncode == 0, f"driver install failed:\n{_tail(r.stdout)}\n{_tail(r.stderr)}"
        dkms = _ok(c, ["dkms", "status", "-m", DKMS_NAME])
        assert re.search(rf"^{DKMS_NAME}/\S*{re.escape(DRIVER)}\S*, {re.escape(kernel)}, \S+: installed", dkms, re.M), \
            f"dkms status:\n{dkms}\napt output:\n{_tail(r.stdout, 60)}\n{_tail(r.stderr, 30)}\n" \
            f"{c.journal('spark-memsaverd.service', 60)}"
        sel = _selected_uvm(c, kernel)
        assert "/updates/dkms/" in sel, f"selected nvidia-uvm for {kernel}: {sel}"
        assert _modinfo(c, "spark_memsaver", sel) == "uvm-pt-pack/1"
        assert _modinfo(c, "version", sel) == DRIVER
        assert _modinfo(c, "signer", sel), f"{sel} is not signed"
        assert c.exists("/var/lib/dkms/mok.key") and c.exists("/var/lib/dkms/mok.pub")
        doc = _status_json(c)
        kdoc = next(k for k in doc["kernels"] if k["release"] == kernel)
        assert kdoc["uvm_selected"] and kdoc["uvm_selected"]["patched"] is True, kdoc
        assert doc["state"] in ("installed", "unverified", "built"), doc["state"]
        ours = [s for s in c.run(["sh", "-c", f"ls -d /usr/src/{DKMS_NAME}-* 2>/dev/null"], check=False)
                .stdout.split()]
        assert ours, "no rendered source tree under /usr/src"

        # 5. apt remove: stock selected again (verified), no DKMS registration of ours left
        t = time.monotonic()
        r = c.run(["apt-get", "remove", "-y", "spark-memsaver"], check=False, timeout=900)
        timings["remove"] = time.monotonic() - t
        assert r.returncode == 0, f"apt remove failed:\n{_tail(r.stdout)}\n{_tail(r.stderr)}"
        assert c.run(["systemctl", "is-active", "spark-memsaverd"], check=False).stdout.strip() != "active"
        assert _ok(c, ["dkms", "status", "-m", DKMS_NAME]).strip() == ""
        assert not c.exists(f"/var/lib/dkms/{DKMS_NAME}")
        for s in ours:
            assert not c.exists(s), f"{s} left after remove"
        sel = _selected_uvm(c, kernel)
        assert f"/kernel/nvidia-{DRIVER.split('.')[0]}-open/" in sel, f"after remove, {kernel} selects {sel}"
        assert _modinfo(c, "spark_memsaver", sel) == ""
        assert not c.sh(f"ls /lib/modules/{kernel}/updates/dkms/ 2>/dev/null | grep -i uvm || true").stdout.strip()
        status = _ok(c, ["dpkg-query", "-W", "-f=${db:Status-Abbrev}", "spark-memsaver"]).strip()
        assert status == "rc", status                      # removed, config files kept
        assert c.exists("/etc/spark-memsaver/config.yaml")

        # 6. apt purge: nothing of ours left; shared signing keys and the driver untouched
        r = c.run(["apt-get", "purge", "-y", "spark-memsaver"], check=False, timeout=600)
        assert r.returncode == 0, f"apt purge failed:\n{_tail(r.stdout)}\n{_tail(r.stderr)}"
        q = c.run(["dpkg-query", "-W", "-f=${db:Status-Abbrev}", "spark-memsaver"], check=False)
        assert q.returncode != 0 or q.stdout.strip() in ("", "un", "pn"), q.stdout
        left = [f for f in _deb_files(deb) if c.exists(f)]
        assert not left, f"files of the package left after purge: {left}"
        for d in ("/etc/spark-memsaver", "/var/lib/spark-memsaver", "/var/cache/spark-memsaver",
                  "/run/spark-memsaver", "/usr/share/spark-memsaver", "/usr/lib/spark-memsaver",
                  "/etc/systemd/system/multi-user.target.wants/spark-memsaverd.service"):
            assert not c.exists(d), f"{d} left after purge: " + c.sh(f"find {d} | head -20", check=False).stdout
        found = c.sh("find / -xdev \\( -path /proc -o -path /sys -o -path /root \\) -prune -o "
                     "\\( -iname '*spark-memsaver*' -o -iname '*spark_memsaver*' -o -iname '*sparkmemsaver*' \\) "
                     "-print", timeout=120).stdout.split()
        assert not found, f"left after purge: {found}"
        assert c.exists("/var/lib/dkms/mok.key") and c.exists("/var/lib/dkms/mok.pub"), \
            "purge removed DKMS's shared signing key"
        drvpkg = _ok(c, ["dpkg-deb", "-f", drv, "Package"]).strip()
        assert _ok(c, ["dpkg-query", "-W", "-f=${db:Status-Abbrev}", drvpkg]).strip() == "ii"
        assert _modinfo(c, "version", _selected_uvm(c, kernel)) == DRIVER
    timings["total"] = time.monotonic() - t0
    print(f"timings ({suite}):", {k: round(v, 1) for k, v in timings.items()})


def test_install_never_fails_when_it_cannot_build(deb, driver_deb, suite):
    """A supported driver but no kernel headers: the install succeeds, stays stock, and status says why."""
    with _container(suite) as c:
        # the container sees the driver's modules but no headers for its kernel: DKMS cannot build
        c.sh("for k in /lib/modules/*; do rm -f $k/build $k/source; done")
        drv = c.copy_in(driver_deb, "/root/")
        pkg = c.copy_in(deb, "/root/")
        _ok(c, ["apt-get", "install", "-y", drv], timeout=600)
        c.sh("mkdir -p /etc/spark-memsaver && printf 'kernels: all\\n' > /etc/spark-memsaver/config.yaml")
        r = c.run(["apt-get", "install", "-y", "-o", "Dpkg::Options::=--force-confold", pkg], check=False,
                  timeout=900)
        assert r.returncode == 0, f"apt install failed although only the build is impossible:\n{_tail(r.stdout)}\n{_tail(r.stderr)}"
        assert _ok(c, ["dpkg-query", "-W", "-f=${db:Status-Abbrev}", "spark-memsaver"]).strip() == "ii"
        assert c.run(["systemctl", "is-active", "spark-memsaverd"], check=False).stdout.strip() == "active"
        _wait_daemon_idle(c)
        assert _ok(c, ["dkms", "status", "-m", DKMS_NAME]).strip() == ""
        doc = _status_json(c)
        assert doc["state"] != "active"
        assert doc["findings"], "status gives no finding explaining why nothing was built"
        # and it can still be removed cleanly
        r = c.run(["apt-get", "purge", "-y", "spark-memsaver"], check=False, timeout=600)
        assert r.returncode == 0, f"purge failed:\n{_tail(r.stdout)}\n{_tail(r.stderr)}"


# a second DKMS module, not ours: what DKMS does for every other module on the node after our purge
HELLO = {
    "dkms.conf": 'PACKAGE_NAME="smhello"\nPACKAGE_VERSION="1.0"\nBUILT_MODULE_NAME[0]="smhello"\n'
                 'DEST_MODULE_LOCATION[0]="/updates/dkms"\nAUTOINSTALL="no"\n'
                 'MAKE[0]="make -C ${kernel_source_dir} M=${dkms_tree}/${PACKAGE_NAME}/${PACKAGE_VERSION}/build modules"\n'
                 'CLEAN="true"\n',
    "Makefile": "obj-m := smhello.o\n",
    "smhello.c": '#include <linux/module.h>\nstatic int __init h_init(void) { return 0; }\n'
                 'static void __exit h_exit(void) { }\nmodule_init(h_init);\nmodule_exit(h_exit);\n'
                 'MODULE_LICENSE("GPL");\n',
}
FLEET_KEY, FLEET_CERT = "/etc/spark-memsaver/private/fleet-signing.key", "/etc/spark-memsaver/fleet-signing.crt"
DROPIN = "/etc/dkms/framework.conf.d/spark-memsaver.conf"


def _build_hello(c, kernel) -> tuple[str, str, str]:
    """dkms build of the second module: (its output, signer, sig_key) of the module DKMS built."""
    c.run(["dkms", "remove", "-m", "smhello", "-v", "1.0", "--all"], check=False, timeout=120)
    r = c.run(["dkms", "build", "-m", "smhello", "-v", "1.0", "-k", kernel], check=False, timeout=900)
    assert r.returncode == 0, f"dkms build of a second module failed:\n{_tail(r.stdout)}\n{_tail(r.stderr)}"
    ko = c.sh(f"ls /var/lib/dkms/smhello/1.0/{kernel}/*/module/smhello.ko*").stdout.split()[0]
    return r.stdout + r.stderr, _modinfo(c, "signer", ko), _modinfo(c, "sig_key", ko).replace(":", "").upper()


def test_purge_with_a_fleet_key_leaves_other_modules_signed(deb):
    """A node with the Ansible role's fleet key (/etc/spark-memsaver/private/fleet-signing.key, our drop-in
    naming it for every DKMS module), then apt purge: the drop-in goes with the key, and DKMS 3.0.10 (Debian
    12) signs a second module with its own default key (/var/lib/dkms/mok.key, made on first use). What the
    purge used to leave -- the drop-in naming the deleted key -- is put back by hand at the end: DKMS then
    builds that module unsigned ("can't be generated, modules won't be signed")."""
    kernels = nspawn.kernel_headers()
    if not kernels:
        needs.absent("kernel headers", "tools/deps/base.txt installs linux-headers-amd64")
    kernel = kernels[0]
    with _container("bookworm") as c:
        pkg = c.copy_in(deb, "/root/")
        r = c.run(["apt-get", "install", "-y", pkg], check=False, timeout=600)
        assert r.returncode == 0, f"apt install failed:\n{_tail(r.stdout)}\n{_tail(r.stderr)}"
        c.sh(f"install -d -m 700 /etc/spark-memsaver/private && umask 077 && "
             f"openssl req -new -x509 -nodes -days 3650 -subj '/CN=test fleet key' -newkey rsa:2048 "
             f"-keyout {FLEET_KEY} -out {FLEET_CERT} 2>/dev/null && chmod 644 {FLEET_CERT} && "
             f"printf 'signing_key: {FLEET_KEY}\\nsigning_cert: {FLEET_CERT}\\n' >> /etc/spark-memsaver/config.yaml")
        # what a build does first (act/build.py): DKMS is pointed at the configured key
        c.run(["python3", "-c", "from spark_memsaver.act import signing; from spark_memsaver.config import load; "
               "from spark_memsaver.host import Host; signing.ensure(Host('/'), load())"], timeout=120)
        dropin = c.sh(f"cat {DROPIN}").stdout
        assert f"mok_signing_key={FLEET_KEY}" in dropin, dropin
        stale = dropin

        r = c.run(["apt-get", "purge", "-y", "spark-memsaver"], check=False, timeout=600)
        assert r.returncode == 0, f"apt purge failed:\n{_tail(r.stdout)}\n{_tail(r.stderr)}"
        assert not c.exists("/etc/spark-memsaver") and not c.exists(DROPIN), c.sh(f"ls -l {DROPIN}", check=False)
        # the purge says that the deleted fleet certificate stays enrolled, and how to revoke it
        note = [ln for ln in r.stderr.splitlines() if ln.startswith(f"spark-memsaver: deleted {FLEET_CERT} ")]
        assert len(note) == 1 and "CN = test fleet key" in note[0] and "sudo mokutil --delete" in note[0], \
            _tail(r.stderr)
        print(note[0])

        for rel, text in HELLO.items():
            c.sh(f"mkdir -p /usr/src/smhello-1.0 && cat > /usr/src/smhello-1.0/{rel}", input=text)
        c.run(["dkms", "add", "-m", "smhello", "-v", "1.0"], timeout=120)
        out, signer, sig_key = _build_hello(c, kernel)
        serial = c.sh("openssl x509 -inform DER -in /var/lib/dkms/mok.pub -noout -serial").stdout
        assert signer and sig_key and serial.strip().split("=")[1].upper().lstrip("0") == sig_key.lstrip("0"), \
            f"after purge the second module is not signed with DKMS's own key: signer={signer!r} " \
            f"sig_key={sig_key!r} mok.pub {serial!r}\n{_tail(out)}"
        print(f"after purge: smhello signed by {signer!r} ({sig_key}), DKMS's default key")

        # the state the purge used to leave: the drop-in naming the deleted fleet key
        c.sh(f"cat > {DROPIN}", input=stale)
        out, signer, _ = _build_hello(c, kernel)
        assert not signer and "won't be signed" in out, f"signer={signer!r}\n{_tail(out)}"
        print("with the stale drop-in: smhello unsigned (DKMS: " +
              next(ln for ln in out.splitlines() if "won't be signed" in ln).strip() + ")")
