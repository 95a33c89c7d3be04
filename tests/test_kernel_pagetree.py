"""NVIDIA's own page-tree tests (UVM_TEST_PAGE_TREE) through our packing hooks, in an arm64 VM.

The real patched nvidia-uvm.ko (NVIDIA 580.142's open tree through the product's apply step, built by
NVIDIA's own Makefile) loads beside a stand-in nvidia.ko built in the same Kbuild run from NVIDIA's
headers (tests/kernel/standin-rm: session and callback registration succeed, every other RM entry point
returns NV_ERR_NOT_SUPPORTED). PID 1 (tests/kernel/pagetree/init.sh) loads nvidia-uvm with
uvm_enable_builtin_tests=1 and uvm_pt_pack=0,1,2,3 in turn, and /pt_run (static arm64, the tree's own
ioctl headers) opens /dev/nvidia-uvm, calls UVM_INITIALIZE and UVM_TEST_PAGE_TREE, which runs UVM's page
tree tests on fake Maxwell..Blackwell GPUs (pci_dev == NULL: the test build's -DUVM_PT_PACK_TEST_FAKE_GPU
lets the pool take them). The pool's cumulative test counters prove what was packed in each run.

Kernel: Debian trixie's linux-image-arm64-16k 6.12 (16 KiB pages, so leaf and 4k-all are active; NVIDIA
580 does not compile against Debian's 7.2/7.3: linux/of_gpio.h is gone). Details: docs/kernel-tests.md.

The two VM tests are `slow` (cold: kernel tree ~4 min, NVIDIA build 6-9 min at -j2, VM ~1-3 min per kernel).
NVIDIA 580.142's tree comes from the shared directory (tests/support/nvsrc.py). CI runs the 4 KiB kernel (the
whole suite); the 16 KiB kernel and the broken-pool run (one more NVIDIA build each, ~10-15 min) run where
SPARK_MEMSAVER_TEST_PAGETREE_ALL=1 is set. The switch must never reach the product: test_switch_absent_from_the_dkms_build checks the rendered DKMS
tree and the apply step's output for every tier, and a pool object built with the DKMS flags.
"""

from __future__ import annotations

import os
import re
import subprocess
import shutil
import time
from pathlib import Path

import pytest

from tests.support import needs, nvsrc, qemu, uvmvm

KINDS = ("debian-6.12-16k", "debian-6.12-4k")
KIND = KINDS[0]
VERSION = "580.142"
TIERS = (0, 1, 2, 3)
TOKENS = {0: "off", 1: "4k-all", 2: "256", 3: "leaf"}
#: the switch as a build input would spell it (a -D flag or a #define), not the pool's own #ifdef lines
SWITCH_SET = re.compile(rb"-D\s*" + uvmvm.SWITCH.encode() + rb"|#\s*define\s+" + uvmvm.SWITCH.encode())
DEBIAN_DEBUG = "slub_debug=FZPU kfence.sample_interval=10 page_poison=1 init_on_free=1"
#: NVIDIA's own check_sizes() (uvm_page_tree_test.c) expects user chunk sizes of a 4 KiB or 64 KiB kernel; on a
#: 16 KiB kernel uvm_mmu_init_gpu_chunk_sizes() adds PAGE_SIZE (16K) and the check fails, with the pool off too.
#: pascal_test_page_tree() stops there, so volta..blackwell do not run on 16 KiB (they do on 4 KiB).
NV_16K_FAILURE = ["check_sizes Test check failed, condition 'gpu->parent->mmu_user_chunk_sizes == user_sizes' not true",
                  "pascal_test_page_tree Test check failed, call 'check_sizes(pascal)' returned "
                  "'Generic Error: Invalid state [NV_ERR_INVALID_STATE]', expected 'Success [NV_OK]'",
                  "uvm_test_page_tree Test check failed, call 'pascal_test_page_tree(gpu)' returned "
                  "'Generic Error: Invalid state [NV_ERR_INVALID_STATE]', expected 'Success [NV_OK]'"]
NV_ERR_INVALID_STATE = "0x40"
FAILED = re.compile(r"nvidia-uvm: uvm_page_tree_test\.c:\d+ (\w+)\[pid:\d+\] (Test check failed.*)$", re.M)


CI_KIND = "debian-6.12-4k"    # NVIDIA's whole suite runs at 4 KiB; 16 KiB stops at NVIDIA's own check_sizes()
ALL_ENV = "SPARK_MEMSAVER_TEST_PAGETREE_ALL"


def _opt_in(what: str) -> None:
    if os.environ.get(ALL_ENV) != "1":
        needs.beyond_ci(what, f"one more NVIDIA build and VM (~10-15 min cold, beyond CI's share): set {ALL_ENV}=1")


@pytest.fixture(scope="module", params=KINDS)
def vm(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pagetree")
    if request.param != CI_KIND:
        _opt_in(f"NVIDIA's page-tree tests on {request.param}")
    nvsrc.nvidia_source(VERSION)      # the shared directory's tree (a failure under tools/test if absent)
    k = qemu.kernel(request.param)
    t0 = time.time()
    built = uvmvm.cached_build(k, VERSION)
    runner = uvmvm.pt_run(built, tmp / "pt_run")
    rd = uvmvm.initramfs(built, runner, tmp / "initrd.gz")
    t1 = time.time()
    log = qemu.boot(k, rd, append=DEBIAN_DEBUG, timeout=1500)
    (tmp / "console.log").write_text(log)
    print(f"build/cache {t1 - t0:.0f}s (NVIDIA build {built.seconds:.0f}s), VM {time.time() - t1:.0f}s, log {tmp}")
    return k, built, log.replace("\r", "")


def _stats(log: str, tier: int) -> dict[str, str]:
    block = log.split(f"STATS-BEGIN tier={tier}\n", 1)[1].split("STATS-END", 1)[0]
    return dict(ln.split(" ", 1) for ln in block.splitlines() if " " in ln)


def _run_of(log: str, tier: int) -> str:
    return log.split(f"PT-BEGIN tier={tier}\n", 1)[1].split(f"PT-RC tier={tier}", 1)[0]


def _failures(run: str) -> list[str]:
    return [f"{m.group(1)} {m.group(2).strip()}" for m in FAILED.finditer(run)]


@pytest.mark.kernel
@pytest.mark.slow
def test_page_tree_passes_in_every_tier(vm):
    """4 KiB: UVM_TEST_PAGE_TREE returns NV_OK in every tier. 16 KiB: NVIDIA's own check_sizes() fails with
    the pool off; every tier gives exactly that result (the same three lines, NV_ERR_INVALID_STATE) and
    nothing else, and the tests before it ran through the pool."""
    k, built, log = vm
    assert "VM-DONE" in log, "the VM did not finish its script:\n" + log[-4000:]
    bad = qemu.bad_lines(log)
    assert not bad, "kernel reported problems:\n" + "\n".join(bad[:40])
    assert "NVIDIA-LOAD rc=0" in log and "NVIDIA-UNLOAD rc=0" in log, log[-4000:]
    # the RM calls of a whole run: session and callbacks only, no stubbed entry point
    called = re.findall(r"standin-rm: (nvUvmInterface\w+) -> (\S+)", log)
    assert called == [("nvUvmInterfaceSessionCreate", "NV_OK"), ("nvUvmInterfaceRegisterUvmCallbacks", "NV_OK"),
                      ("nvUvmInterfaceDeRegisterUvmOps", "void"), ("nvUvmInterfaceSessionDestroy", "NV_OK")], called
    for t in TIERS:
        assert f"UVM-LOAD tier={t} rc=0" in log, log[-4000:]
        run = _run_of(log, t)
        assert "PT-RUN step=initialize ioctl=0 errno=0 rmStatus=0x0" in run, run[-3000:]
        if k.page_size == 16384:
            assert _failures(run) == NV_16K_FAILURE, run[-3000:]
            assert f"PT-RUN step=page_tree ioctl=0 errno=0 rmStatus={NV_ERR_INVALID_STATE}" in run, run[-3000:]
        else:
            assert _failures(run) == [], run[-3000:]
            assert "PT-RUN step=page_tree ioctl=0 errno=0 rmStatus=0x0" in run, run[-3000:]
            assert f"PT-RC tier={t} rc=0" in log
        assert f"UVM-UNLOAD tier={t} rc=0" in log


@pytest.mark.kernel
@pytest.mark.slow
def test_counters_prove_tables_were_packed(vm):
    """Per tier, what the pool packed during UVM's own page-tree tests (cumulative test counters), and the
    live counters back at zero after the run (every packed table freed, every backing page returned)."""
    k, built, log = vm
    for t in TIERS:
        s = _stats(log, t)
        assert s["tier"] == TOKENS[t] and s["test_fake_gpu_build"] == "1", s
        for key in ("trees_packed", "c256_tables", "c4096_tables", "c256_pages", "c4096_pages", "saved_bytes"):
            assert s[key] == "0", (t, key, s)
        trees, t256, t4k = (int(s[f"test_total_{n}"]) for n in ("trees_packed", "c256_tables", "c4096_tables"))
        p256, p4k = int(s["test_total_c256_pages"]), int(s["test_total_c4096_pages"])
        # at 4 KiB only the 256 tier saves anything (a 4 KiB slot is a whole page): 4k-all and leaf are inactive
        if t == 0 or (k.page_size == 4096 and t != 2):
            assert trees == t256 == t4k == p256 == p4k == 0, s
            continue
        assert trees > 0 and t256 > 0 and p256 > 0, s        # 64K-page PTE tables (256 B) in every tier
        if t == 3 or k.page_size == 4096:
            assert t4k == p4k == 0, s                          # leaf: 256 B tables only; 4 KiB: no 4 KiB slots
        else:
            assert t4k > 0 and p4k > 0, s                      # 4k-all and 256: directories too
        # slots were shared: fewer backing pages than tables
        assert p256 < t256, s
    # the fake GPUs reached the pool only through the test build's switch
    assert "uvm_pt_pack TEST BUILD (UVM_PT_PACK_TEST_FAKE_GPU): fake GPUs accepted" in log


@pytest.mark.kernel
@pytest.mark.slow
def test_nvidia_tests_catch_a_broken_pool(tmp_path):
    """Not vacuous: with the pool built to hand out overlapping slots (UVM_PT_PACK_FAULT_INJECT=1), NVIDIA's
    own page-tree test fails in the packing tier (a PTE of one table overwritten through another)."""
    _opt_in("the broken-pool run")
    nvsrc.nvidia_source(VERSION)
    k = qemu.kernel("debian-6.12-4k")              # the whole suite runs at 4 KiB; tier 256 packs there
    built = uvmvm.cached_build(k, VERSION, inject=1)
    rd = uvmvm.initramfs(built, uvmvm.pt_run(built, tmp_path / "pt_run"), tmp_path / "initrd.gz")
    log = qemu.boot(k, rd, append="PT_TIERS=2", timeout=1500).replace("\r", "")
    (tmp_path / "console.log").write_text(log)
    run = _run_of(log, 2)
    assert f"PT-RUN step=page_tree ioctl=0 errno=0 rmStatus={NV_ERR_INVALID_STATE}" in run, run[-3000:]
    assert re.search(r"assert_range_vec_ptes\[pid:\d+\] PTE is 0x[0-9a-f]+ instead of 0x[0-9a-f]+", run), run[-3000:]


def _switch_hits(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and SWITCH_SET.search(p.read_bytes())]


def test_switch_absent_from_the_dkms_build(tmp_path):
    """No rendered DKMS file and no apply-step output (every tier) sets UVM_PT_PACK_TEST_FAKE_GPU; the
    scanner finds it in a tree prepared the way the test build prepares its own (not vacuous)."""
    from spark_memsaver.act import dkms, patch
    from spark_memsaver.config import Config
    from spark_memsaver.decide import policy
    from spark_memsaver.host import Host

    for tier in policy.TIERS:
        root = tmp_path / f"root-{tier}"
        (root / "usr/src").mkdir(parents=True)
        r = dkms.render(Host(root), Config(tier=tier), VERSION, f"/usr/src/nvidia-{VERSION}")
        rendered = root / r["path"].lstrip("/")
        assert (rendered / "uvm_patch/src/uvm_pt_pack.c").is_file()
        assert _switch_hits(rendered) == [], tier
    src = nvsrc.nvidia_source(VERSION)
    for value in (None, *policy.TIERS.values()):
        dest = tmp_path / f"apply-{value}"
        patch.apply_patch(src, dest, value, slim=True)
        assert _switch_hits(dest) == [], value
    # the same scan catches the test build's line
    probe = tmp_path / "probe"
    shutil.copytree(tmp_path / "apply-None" / "nvidia-uvm", probe)
    with open(probe / "nvidia-uvm-sources.Kbuild", "a") as fh:
        fh.write(f"CFLAGS_uvm_pt_pack.o += -D{uvmvm.SWITCH}\n")
    assert _switch_hits(probe) == ["nvidia-uvm-sources.Kbuild"]


@pytest.mark.kernel
def test_switch_absent_from_a_module_built_with_the_dkms_flags(tmp_path):
    """The pool built for the VM kernel with the flags the apply step gives it (-DUVM_PT_PACK_DEFAULT=n)
    carries none of the switch's strings; built with the switch, it does (the check is not vacuous).
    Built against test_kernel_qemu.py's Debian 16 KiB tree (cached in CI already): the pool alone compiles on 7.x."""
    k = qemu.kernel("debian-16k")
    found = {}
    for name, flags in (("dkms", "-DUVM_PT_PACK_DEFAULT=3"), ("test", f"-DUVM_PT_PACK_DEFAULT=3 -D{uvmvm.SWITCH}")):
        d = tmp_path / name
        d.mkdir()
        for f in ("uvm_pt_pack.c", "uvm_pt_pack.h"):
            shutil.copy(uvmvm.REPO / "uvm_patch/src" / f, d / f)
        (d / "Kbuild").write_text(f"obj-m := ptpack.o\nptpack-y := uvm_pt_pack.o lic.o\nccflags-y := {flags}\n")
        (d / "lic.c").write_text('#include <linux/module.h>\nMODULE_LICENSE("Dual MIT/GPL");\n')
        qemu._run(["make", "-C", k.tree, f"M={d}", "ARCH=arm64", f"CROSS_COMPILE={qemu.CROSS}", "modules"])
        data = (d / "ptpack.ko").read_bytes()
        found[name] = (uvmvm.SWITCH_MARKER in data, uvmvm.SWITCH.encode() in data)
    assert found == {"dkms": (False, False), "test": (True, True)}


def test_dkms_build_script_drops_compiler_flags_from_the_environment(tmp_path):
    """kbuild adds KCFLAGS/KCPPFLAGS/KAFLAGS from the environment to every compile, so a DKMS environment with
    KCFLAGS=-DUVM_PT_PACK_TEST_FAKE_GPU would switch the test mode on: the rendered build script's prologue
    (everything before its first action) must unset them. Runs the real rendered script's prologue in bash."""
    from spark_memsaver.act import dkms
    from spark_memsaver.config import Config
    from spark_memsaver.host import Host

    root = tmp_path / "root"
    (root / "usr/src").mkdir(parents=True)
    r = dkms.render(Host(root), Config(), VERSION, f"/usr/src/nvidia-{VERSION}")
    script = (root / r["path"].lstrip("/") / "spark-memsaver-build").read_text().splitlines()
    first_action = next(i for i, ln in enumerate(script) if ln.startswith("progress "))
    prologue = "\n".join(script[:first_action] + ['env'])
    env = dict(os.environ, KCFLAGS=f"-D{uvmvm.SWITCH}", KCPPFLAGS=f"-D{uvmvm.SWITCH}", KAFLAGS="-Dx")
    out = subprocess.run(["bash", "-c", prologue, "spark-memsaver-build", "6.1.0-0-test"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not [ln for ln in out.stdout.splitlines() if ln.split("=", 1)[0] in ("KCFLAGS", "KCPPFLAGS", "KAFLAGS")]
