"""The memory VMs of tests/test_kernel_memory.py: a guest (tests/kernel/memory/init.sh) with an ext2 virtio disk,
driven over its console.

The guest prints its /proc and /sys memory files between markers (``dumps``: written back as a root that
``spark-memsaver --root`` reads), asks at ``MEMASK <tag>`` (the host answers with ``KNOB <path> <value>`` lines and
``GO``: what the real reclaim code decided on the host), and is killed hard (SIGKILL) when ``kill_when`` says so.
"""

from __future__ import annotations

import queue
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

try:
    from . import qemu
except ImportError:  # pragma: no cover
    import qemu  # type: ignore

REPO = Path(__file__).resolve().parents[2]
MDIR = REPO / "tests" / "kernel" / "memory"
#: the 4 KiB Debian kernel's modules the guest needs, in load order (virtio_blk; ext4 serves the ext2 disk and
#: asks the crypto API for crc32c when it mounts)
DEBIAN_MODS = ("drivers/block/virtio_blk", "crypto/crc32c_generic", "lib/crc16", "fs/mbcache", "fs/jbd2/jbd2", "fs/ext4/ext4")


def memtool(dest: Path) -> Path:
    """tests/kernel/memory/memtool.c, static arm64, warnings as errors."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    qemu._run([f"{qemu.CROSS}gcc", "-static", "-O2", "-Wall", "-Wextra", "-Werror", "-o", dest, MDIR / "memtool.c"])
    return dest


def debian_modules(k: "qemu.Kernel", dest: Path) -> dict[str, Path]:
    """The Debian kernel's own modules (decompressed: busybox's insmod takes plain .ko), name in / -> file."""
    base = k.image.parent.parent / "usr/lib/modules" / k.release / "kernel"
    out = {}
    dest.mkdir(parents=True, exist_ok=True)
    for i, m in enumerate(DEBIAN_MODS):
        src = base / f"{m}.ko.xz"
        name = f"m{i}-{Path(m).name}.ko"
        with open(dest / name, "wb") as fh:
            subprocess.run(["xz", "-dc", str(src)], stdout=fh, check=True)
        out[name] = dest / name
    return out


def disk(dest: Path, fill_mib: int, size_mib: int = 1024) -> Path:
    """An ext2 image (4 KiB blocks) with /fill: a sparse file of fill_mib (read, it is page cache like any file's)."""
    src = dest.parent / (dest.name + ".src")
    shutil.rmtree(src, ignore_errors=True)
    (src / "var/lib/spark-memsaver/blackbox").mkdir(parents=True)
    with open(src / "fill", "wb") as fh:
        fh.truncate(fill_mib << 20)
    dest.unlink(missing_ok=True)
    qemu._run(["mkfs.ext2", "-q", "-F", "-b", "4096", "-d", src, dest, f"{size_mib}M"])
    shutil.rmtree(src)
    return dest


def run(k: "qemu.Kernel", initrd: Path, *, append: str, disk_image: Path | None = None, mem: str = "2G",
        smp: int = 2, timeout: float = 900, answer=None, kill_when=None, log_path: Path | None = None) -> str:
    """Boot k; answer(tag, log) -> lines for each MEMASK; kill_when(line) -> True kills qemu with SIGKILL (the
    log then ends with ``VM-KILLED``). Returns the console log (``VM-TIMEOUT after N s`` when it ran out), also
    written to log_path as it comes."""
    argv = ["qemu-system-aarch64", "-machine", "virt,iommu=smmuv3,gic-version=3", "-cpu", "max",
            "-smp", str(smp), "-m", mem, "-nographic", "-no-reboot", "-nic", "none", "-kernel", str(k.image),
            "-initrd", str(initrd), "-device", "pci-testdev",
            "-append", f"console=ttyAMA0 panic=-1 quiet {qemu.RCU_STALL_UNDER_TCG} {append}".strip()]
    if disk_image is not None:
        argv += ["-drive", f"file={disk_image},if=none,id=d0,format=raw,cache=writeback",
                 "-device", "virtio-blk-pci,drive=d0"]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: queue.Queue = queue.Queue()

    def reader():
        for raw in iter(p.stdout.readline, b""):
            lines.put(raw.decode(errors="replace").replace("\r", ""))
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    log: list[str] = []
    out = open(log_path, "w") if log_path else None
    deadline = time.monotonic() + timeout
    end = ""
    try:
        end = _drive(p, lines, log, out, deadline, timeout, answer, kill_when)
    finally:
        if p.poll() is None and not end:
            p.kill()                  # an exception on the way (a failed answer, Ctrl-C): no VM is left behind
        p.wait(timeout=30)
        if out:
            out.write(end)
            out.close()
    return "".join(log) + end


def _drive(p, lines, log, out, deadline, timeout, answer, kill_when) -> str:
    end = ""
    while True:
        try:
            ln = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            ln = ""
        if ln is None:
            break
        if ln == "" and time.monotonic() >= deadline:
            p.kill()
            end = f"\nVM-TIMEOUT after {timeout:.0f} s\n"
            break
        log.append(ln)
        if out:
            out.write(ln)
            out.flush()
        s = ln.strip()
        if s.startswith("MEMASK ") and answer is not None:
            reply = answer(s.split(" ", 1)[1], "".join(log))
            p.stdin.write(("".join(f"{r}\n" for r in reply) + "GO\n").encode())
            p.stdin.flush()
        if kill_when is not None and kill_when(s):
            p.send_signal(signal.SIGKILL)
            end = "\nVM-KILLED\n"
            break
    return end


def dumps(log: str) -> dict[str, dict[str, str | None]]:
    """{tag: {path: text or None (a write-only knob that exists)}} of the MEMDUMP blocks of a console log."""
    out: dict[str, dict[str, str | None]] = {}
    tag = path = None
    for ln in log.splitlines():
        if ln.startswith("MEMDUMP-BEGIN "):
            tag = ln.split(" ", 1)[1].strip()
            out[tag] = {}
        elif ln.startswith("MEMDUMP-END "):
            tag = path = None
        elif tag is None:
            continue
        elif ln.startswith("MEMFILE "):
            path = ln.split(" ", 1)[1].strip()
            out[tag][path] = ""
        elif ln.startswith("MEMFILE-EMPTY "):
            out[tag][ln.split(" ", 1)[1].strip()] = None
        elif ln == "MEMFILE-END":
            path = None
        elif path is not None and ln.startswith("@ "):
            out[tag][path] += ln[2:] + "\n"
        elif path is not None and ln == "@":
            out[tag][path] += "\n"
    return out


def write_root(files: dict[str, str | None], dest: Path) -> Path:
    """A root directory holding a dump's files at their paths (``--root``)."""
    for path, text in files.items():
        f = dest / path.lstrip("/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text or "")
    return dest
