"""Named errors of the DKMS engines and the DKMS exit-status table (dkms/README.md)."""

from __future__ import annotations



from spark_memsaver.decide.installability import SMALL_PAGES_REMEDY
from spark_memsaver.errors import EXIT_FAILED, EXIT_PROBLEM, EXIT_USAGE, MemsaverError
from spark_memsaver.observe.dkms import FORCE_FILE


class DkmsError(MemsaverError):
    code = "dkms-failed"
    exit_code = EXIT_FAILED
    remedy = "Run 'dkms status' and read the log named above; then retry."


class DkmsMissing(DkmsError):
    code = "dkms-missing"
    exit_code = EXIT_PROBLEM   # a missing piece, like headers-missing: refused, not bad usage
    remedy = "sudo apt-get install dkms"


class HeadersMissing(DkmsError):
    code = "headers-missing"
    exit_code = EXIT_PROBLEM
    remedy = "Install the headers package of the kernel named above (linux-headers- and its release), then retry."


class KernelOutsidePolicy(DkmsError):
    code = "kernel-outside-policy"
    exit_code = EXIT_PROBLEM
    remedy = SMALL_PAGES_REMEDY     # not 'kernels: all': with 4 or 16 KiB pages packing saves nothing


class NoNvidiaDriver(DkmsError):
    code = "no-nvidia-driver"
    exit_code = EXIT_PROBLEM
    remedy = "Install the NVIDIA open driver's kernel modules for this kernel first."


class DriverMismatch(DkmsError):
    code = "driver-mismatch"
    exit_code = EXIT_PROBLEM
    remedy = ("An nvidia-uvm is only ever built for the version of the nvidia.ko it will load beside; "
              "omit --driver, or install that driver version for this kernel.")


class DriverSourceMissing(DkmsError):
    code = "driver-source-missing"
    exit_code = EXIT_PROBLEM
    remedy = ("'spark-memsaver status' names the exact source package and version of the driver to install "
              "(or that spark-memsaver fetches itself with source_fetch: auto).")


class DriverSourceCorrupt(DkmsError):
    code = "driver-source-corrupt"
    exit_code = EXIT_PROBLEM
    remedy = ("Reinstall the NVIDIA open kernel-module source package: 'spark-memsaver status' names it and the "
              "exact 'sudo apt-get install --reinstall' command.")


class BuildSkipped(DkmsError):
    code = "dkms-build-skipped"
    exit_code = EXIT_PROBLEM
    remedy = KernelOutsidePolicy.remedy


class BuildFailed(DkmsError):
    code = "dkms-build-failed"
    remedy = "Read the build log named above (the last lines are shown); fix the cause, then run 'sudo spark-memsaver build' again."


class BuiltModuleMissing(DkmsError):
    code = "dkms-built-module-missing"
    remedy = BuildFailed.remedy


class PreInstallRefused(DkmsError):
    code = "dkms-pre-install-refused"
    exit_code = EXIT_PROBLEM
    remedy = "The guard's reasons are shown above; rebuild with 'sudo spark-memsaver build' after fixing them."


class InstallRefused(DkmsError):
    code = "dkms-install-refused"
    exit_code = EXIT_PROBLEM
    remedy = (f"DKMS did not put the override in place (its version sanity check). Make sure "
              f"{FORCE_FILE} exists (shipped by the spark-memsaver package), then retry.")


class InstallAborted(DkmsError):
    code = "dkms-install-aborted"
    remedy = "Read DKMS's message above; 'dkms status' shows the state. Nothing was left selected."


class DkmsTreeBroken(DkmsError):
    code = "dkms-tree-broken"
    remedy = "Run 'sudo spark-memsaver remove --all' to clear our registration, then build again."


class DkmsConfInvalid(DkmsError):
    code = "dkms-conf-invalid"
    remedy = "Reinstall spark-memsaver (its DKMS templates are damaged)."


class VerificationFailed(DkmsError):
    code = "module-verification-failed"
    exit_code = EXIT_PROBLEM
    remedy = "The module was not installed. Rebuild with 'sudo spark-memsaver build'; report the problems if they persist."


class StockNotRestored(DkmsError):
    code = "stock-not-restored"
    remedy = ("Reinstall the NVIDIA driver's kernel-module package for this kernel (it restores the stock "
              "nvidia-uvm), then run 'sudo depmod -a <kernel>'.")


class NothingToDo(DkmsError):
    code = "nothing-to-do"
    exit_code = EXIT_PROBLEM
    remedy = "Nothing is built or installed for that kernel; see 'spark-memsaver status'."


# dkms exit status -> (error class, what it means). 3.0.x exits 1 for missing headers (HEAD: 21).


DKMS_EXIT_ERRORS = {
    1: (DkmsError, "generic DKMS failure (3.0.x also: kernel headers missing; not root)"),
    2: (DkmsTreeBroken, "source directory missing"),
    3: (DkmsError, "already added/built"),
    4: (DkmsTreeBroken, "dkms.conf missing or module broken"),
    5: (DkmsError, "already installed / patch missing"),
    6: (InstallAborted, "installation aborted / patch failed / kernel missing / depmod failed"),
    7: (BuiltModuleMissing, "built module not found after make"),
    8: (DkmsConfInvalid, "bad dkms.conf / empty source directory"),
    10: (BuildFailed, "make failed"),
    11: (DkmsError, "autoinstall had failures"),
    12: (DkmsError, "unknown architecture"),
    13: (DkmsError, "BUILD_DEPENDS missing"),
    14: (DkmsError, "kernel hook failure"),
    16: (DkmsError, "empty kernel version or architecture"),
    21: (HeadersMissing, "kernel headers missing"),
    77: (BuildSkipped, "skipped: BUILD_EXCLUSIVE does not match this kernel"),
    101: (PreInstallRefused, "PRE_INSTALL guard refused"),
}


# ------------------------------------------------------------------------------------------------
# Small pure helpers
