"""Named errors. Every failure a user can meet is one of these: a code, a message, a remedy.

The CLI prints them without a traceback; the daemon maps the class name to a D-Bus error name
(``<interface>.Error.<ClassName>``).
"""

from __future__ import annotations

# Exit codes: one table, exitcodes.py (README.md and spark-memsaver(8) are generated from it).
from spark_memsaver.exitcodes import (EXIT_FAILED, EXIT_NOT_APPLICABLE, EXIT_OK, EXIT_PROBLEM,  # noqa: F401
                                      EXIT_USAGE)


class MemsaverError(Exception):
    """Base of all named errors."""

    code = "error"
    exit_code = EXIT_PROBLEM
    remedy = ""

    def __init__(self, message: str, remedy: str | None = None, **details):
        super().__init__(message)
        self.message = message
        if remedy is not None:
            self.remedy = remedy
        self.details = details

    def to_dict(self) -> dict:
        d = {"code": self.code, "name": type(self).__name__, "message": self.message, "remedy": self.remedy}
        if self.details:
            d["details"] = {k: (v if isinstance(v, (int, float, bool, type(None), list, dict)) else str(v))
                            for k, v in self.details.items()}
        return d

    def __str__(self) -> str:
        return self.message

    @staticmethod
    def from_dict(d: dict) -> "MemsaverError":
        """to_dict's inverse for a named error reported as a dict (by the daemon's status child): an exception of
        that name, code, message and remedy."""
        cls = type(str(d.get("name") or "Failed"), (MemsaverError,), {"code": str(d.get("code") or "error")})
        return cls(str(d.get("message") or "failed"), remedy=d.get("remedy") or None)


class UsageError(MemsaverError):
    code = "usage"
    exit_code = EXIT_USAGE


class InvalidArgument(UsageError):
    """An argument that is not what it names (a kernel release with '/', a control character): refused alike at
    every door (D-Bus: service/checks.py; the CLI: versions.release through act/installable.check_kernel)."""
    code = "invalid-argument"


class ConfigError(MemsaverError):
    code = "config-invalid"
    exit_code = EXIT_USAGE
    remedy = "Fix the file (see spark-memsaver(8), CONFIGURATION) or remove it to use the defaults."


class InspectionError(MemsaverError):
    code = "inspection-impossible"
    exit_code = EXIT_USAGE


class WorldInvalid(MemsaverError):
    """A snapshot in its JSON shape that does not parse into the typed world (spark_memsaver/model.py)."""
    code = "world-invalid"
    exit_code = EXIT_FAILED
    remedy = "The snapshot was not written by this version of spark-memsaver: take a new one (spark-memsaver status)."


class CommandNotFound(MemsaverError):
    code = "command-not-found"
    exit_code = EXIT_FAILED


class CommandTimedOut(MemsaverError):
    code = "command-timed-out"
    exit_code = EXIT_FAILED


class CommandFailed(MemsaverError):
    code = "command-failed"
    exit_code = EXIT_FAILED


class NotPermitted(MemsaverError):
    code = "not-permitted"
    remedy = "Run it as root (sudo), or through the daemon with a polkit-authorized account."


class CannotReclaim(MemsaverError):
    """``reclaim --need``: more is needed than reclaim can free (MemAvailable), or less was freed than needed."""
    code = "cannot-reclaim"
    exit_code = EXIT_PROBLEM
    remedy = ("See where the memory goes with 'spark-memsaver memory': stop what holds it (a GPU process, a "
              "tmpfs file), or launch with less.")


class Busy(MemsaverError):
    code = "busy"
    remedy = "Wait for the running operation to finish (spark-memsaver status shows it)."


class Unsupported(MemsaverError):
    code = "unsupported"


class SafetyRefusal(MemsaverError):
    """Refused because acting could leave a mismatched or unloadable module selected."""

    code = "safety-refusal"


class SecureBootUnknown(SafetyRefusal):
    code = "secure-boot-unknown"
    remedy = ("Check that efivarfs is mounted (sudo mount -t efivarfs efivarfs /sys/firmware/efi/efivars) and "
              "readable; run 'spark-memsaver mok status' for the reason.")


class MokError(MemsaverError):
    """Secure Boot / MOK (decide/mok.py names the cases; observe/mok.py's refused certificate file)."""

    code = "mok-error"


class LockTimeout(Busy):
    """A spark-memsaver lock stayed held past the bounded wait."""

    code = "lock-timeout"
    remedy = ("Another spark-memsaver operation is running (see the holder named above); wait for it to "
              "finish, or stop it, then retry.")


# --- driver source acquisition (act/source_fetch.py) ----------------------------------------------------

class SourceFetchError(MemsaverError):
    """Getting the NVIDIA driver's open kernel-module source into the cache failed; nothing was kept."""

    code = "source-fetch-failed"
    exit_code = EXIT_FAILED


class SourceNotInLists(SourceFetchError):
    code = "source-not-in-lists"
    exit_code = EXIT_PROBLEM
    remedy = ("Run 'sudo apt-get update'; if APT still does not offer that exact version, enable the repository "
              "that carries the installed NVIDIA driver, or install a driver whose source APT offers.")


class SourceFetchDisabled(SourceFetchError):
    code = "source-fetch-disabled"
    exit_code = EXIT_PROBLEM


class SourceDownloadFailed(SourceFetchError):
    code = "source-download-failed"


class SourceChecksumMismatch(SourceFetchError):
    code = "source-checksum-mismatch"
    remedy = ("The downloaded package does not match the SHA256 in APT's lists (nothing was kept): run "
              "'sudo apt-get update' and retry; if it persists, check the mirror.")


class SourceUnpackFailed(SourceFetchError):
    code = "source-unpack-failed"


class UnknownKernel(UsageError):
    """A command named a kernel that is not installed: one behaviour (exit 2) for every command."""

    code = "unknown-kernel"


def unknown_kernel_remedy(installed: list[str]) -> str:
    if not installed:
        return "No kernel is installed under this root (no /lib/modules/*): install one, or check --root."
    return ("Name an installed kernel with --kernel: " + ", ".join(installed)
            + " (e.g. 'spark-memsaver status' lists them).")


def unknown_kernel(kernel: str, installed: list[str]) -> UnknownKernel:
    """The error every command raises for a kernel without /lib/modules/<kernel>, naming those that exist."""
    names = ", ".join(installed) or "none"
    return UnknownKernel(f"kernel {kernel} is not installed (no /lib/modules/{kernel}); installed kernels: {names}",
                         remedy=unknown_kernel_remedy(installed), kernel=kernel, installed=list(installed))


class DriverUnsupported(Unsupported):
    """The NVIDIA driver of the kernel is not in this release's patch manifest."""

    code = "driver-unsupported"
