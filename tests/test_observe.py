"""Observers against real-format files and real tools (modinfo, depmod)."""

import os

import pytest

from spark_memsaver.observe import snapshot as observe
from spark_memsaver.observe.counters import CountersError, parse_stats
from spark_memsaver.host import Host
from tests.support import needs, sparkroot


@pytest.mark.parametrize("pmd,page", [(2097152, 4096), (33554432, 16384), (536870912, 65536), (12345, None)])
def test_page_size_from_thp_pmd(pmd, page):
    assert observe.page_size_from_pmd(pmd) == page


def test_live_thp_pmd_agrees_with_sysconf():
    p = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
    if not os.path.exists(p):
        needs.not_applicable("kernel without THP")
    assert observe.page_size_from_pmd(int(open(p).read())) == os.sysconf("SC_PAGE_SIZE")


def test_kernel_page_size_from_boot_config(tmp_path):
    h = Host(tmp_path)
    for opt, size in (("CONFIG_ARM64_64K_PAGES", 65536), ("CONFIG_ARM64_16K_PAGES", 16384),
                      ("CONFIG_ARM64_4K_PAGES", 4096)):
        sparkroot.write(tmp_path, "/boot/config-k", f"CONFIG_ARM64=y\n{opt}=y\n")
        assert observe.kernel_page_size(h, "k", "aarch64") == size
    sparkroot.write(tmp_path, "/boot/config-k", "CONFIG_ARM64=y\n")
    assert observe.kernel_page_size(h, "k", "aarch64") is None


def test_real_debian_kernel_config_if_present():
    # Debian's linux-headers package ships the kernel's .config (tools/deps/base.txt installs it).
    if not os.path.isdir("/lib/modules"):
        needs.absent("/lib/modules (no kernel modules or headers on this machine)", "tools/deps/base.txt")
    rel = [r for r in os.listdir("/lib/modules") if observe.kernel_config(Host("/"), r)]
    assert rel, "no kernel config found under /boot or /lib/modules/*/build"
    assert observe.kernel_page_size(Host("/"), rel[0], "x86_64") == 4096


def test_host_path_resolves_absolute_symlinks_inside_root(tmp_path):
    sparkroot.write(tmp_path, "/usr/src/linux-headers-k/Makefile", "x")
    (tmp_path / "lib/modules/k").mkdir(parents=True)
    os.symlink("/usr/src/linux-headers-k", tmp_path / "lib/modules/k/build")
    h = Host(tmp_path)
    assert h.path("/lib/modules/k/build/Makefile") == tmp_path / "usr/src/linux-headers-k/Makefile"
    # a link pointing "outside" stays inside the root
    os.symlink("../../../../../../etc", tmp_path / "escape")
    assert str(h.path("/escape/passwd")).startswith(str(tmp_path))


def test_modinfo_of_real_module_files(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", ours_installed="580.142")
    h = Host(root)
    ours = observe.describe_module(observe.module_info(h, sparkroot.SPARK_KERNEL, "nvidia_uvm"))
    assert ours["patched"] and ours["patch_id"] == "uvm-pt-pack/1"
    assert ours["path"].endswith("/updates/dkms/nvidia-uvm.ko")
    assert ours["signer"] == "spark-memsaver fixture signing key"
    assert ours["depends"] == ["nvidia"]
    nv = observe.describe_module(observe.module_info(h, sparkroot.SPARK_KERNEL, "nvidia"))
    assert nv["version"] == "580.142" and not nv["patched"]
    assert observe.module_info(h, sparkroot.SPARK_KERNEL, "no_such_module") is None


def test_driver_sources_recognised(tmp_path):
    for name in ("nvidia-580.142", "nvidia-current-open-550.163.01", "nvidia-srv-590.48.01"):
        sparkroot.write(tmp_path, f"/usr/src/{name}/Kbuild", "")
        sparkroot.write(tmp_path, f"/usr/src/{name}/nvidia-uvm/x", "")
    sparkroot.write(tmp_path, "/usr/src/spark-memsaver-uvm-0.1.0-580.142/dkms.conf", "")
    sparkroot.write(tmp_path, "/usr/src/linux-headers-6.1.0-57-amd64/Makefile", "")
    d = observe.observe_driver(Host(tmp_path))
    assert sorted(s["version"] for s in d["sources"]) == ["550.163.01", "580.142", "590.48.01"]
    assert all(s["open"] for s in d["sources"])


def test_holders_scan_real_proc_with_a_real_holder(tmp_path):
    # A real process holding a real file: stands in for /dev/nvidia-uvm (no such device here).
    import subprocess
    dev = tmp_path / "nvidia-uvm"
    dev.write_text("")
    p = subprocess.Popen(["sleep", "30"], stdin=open(dev))
    try:
        holders = observe.uvm_holders(Host("/"), device=str(dev))
        assert [x["pid"] for x in holders] == [p.pid] and holders[0]["comm"] == "sleep"
    finally:
        p.kill()
        p.wait()
    assert observe.uvm_holders(Host("/"), device=str(dev)) == []


def test_counters_parse_and_reject():
    s = parse_stats(sparkroot.stats_text())
    assert s["format"] == 1 and s["tier"] == "4k"
    assert s["classes"]["256"]["tables"] == 52989
    assert s["backing_bytes"] + s["saved_bytes"] == s["stock_bytes"]
    for bad, msg in (("tier 4k\n", "format"), ("format 3\ntier 4k\n", "newer"),
                     ("format 1\ntier 4k\nbacking_bytes x\n", "not an integer"),
                     ("format 1\nbacking_bytes 1\nstock_bytes 1\nsaved_bytes 0\n", "'tier' is missing"),
                     ("format 1\njunk\n", "expected 'key value'")):
        with pytest.raises(CountersError, match=msg):
            parse_stats(bad)


def test_dkms_tree_read_without_dkms(tmp_path):
    base = tmp_path / "var/lib/dkms/spark-memsaver-uvm"
    (base / "0.1.0-580.142/6.14.0-k/aarch64/module").mkdir(parents=True)
    (base / "0.1.0-580.142/6.14.0-k/aarch64/module/nvidia-uvm.ko").write_text("")
    os.symlink("0.1.0-580.142/6.14.0-k/aarch64", base / "kernel-6.14.0-k-aarch64")
    sparkroot.write(tmp_path, "/usr/src/spark-memsaver-uvm-0.1.0-580.142/dkms.conf", "")
    d = observe.observe_dkms(Host(tmp_path))
    (reg,) = d["registrations"]
    assert reg["version"] == "0.1.0-580.142" and reg["source_present"]
    assert reg["builds"] == [{"kernel": "6.14.0-k", "arch": "aarch64", "built": True, "installed": True}]
