"""A finding of status (code, severity, message, remedy, kernel) and the verdict that carries them: the types
decide/status.py and the modules it draws findings from (decide/sbfindings.py) share, and :func:`needs_first`,
the one rule that puts a missing piece's remedy before an install or build that would be refused. Pure."""

from __future__ import annotations

import re

from spark_memsaver import remedy as rm
from spark_memsaver.record import Record, asdict, field

SEVERITIES = ("info", "warning", "error")

# The ONE list of the finding codes status gives (decide/status.py and what it draws from: installability's
# missing pieces, decide/sbfindings.py, decide/hazards.py): code -> (the severities it comes with, what it says).
# docs/architecture.md's "Findings" table is written from it (tools/gen-docs); tests/test_findings.py fails on a
# code decide/ gives that is not here, tests/test_remedies.py on one here that no state of its walk reaches. The
# hazards of uvm_patch/hazards.yaml add their own codes (warning), each described in that table.
_I, _W, _E, _IW = ("info",), ("warning",), ("error",), ("info", "warning")
CODES: dict[str, tuple[tuple[str, ...], str]] = {
    "config-invalid": (_W, "the configuration file cannot be used: the built-in defaults are in force for safety"),
    "config-renamed": (_I, "an old configuration key name is still read"),
    "no-nvidia-driver": (_I, "no NVIDIA driver is installed or loaded: nothing to patch"),
    "program-missing": (("warning", "error"), "a program the way back to stock runs is not installed "
                        "(decide/wayback.py)"),
    "selection-unreadable": (_W, "the module kmod selects for a kernel cannot be read (decide/wayback.py)"),
    "override-driver-mismatch": (_E, "ours is selected beside another driver's nvidia.ko"),
    "loaded-driver-mismatch": (_E, "ours is loaded beside another loaded nvidia driver"),
    "config-changed": (_W, "the installed build was made with other settings than the configuration's now"),
    "operation-interrupted": (_W, "an interrupted operation's intent record was found"),
    "state-record-unreadable": (_W, "a state record is not valid JSON"),
    "record-quarantined": (_W, "a state record is not trusted and is (or will be) set aside"),
    "secure-boot-unknown": (_W, "the Secure Boot / MOK state cannot be read: installing is refused"),
    "signed-with-other-key": (_W, "ours is signed with another key than the configured certificate"),
    "mok-no-key": (_W, "Secure Boot enforces and there is no signing key"),
    "mok-not-enrolled": (_W, "Secure Boot enforces and the signing key is not enrolled"),
    "mok-pending-enroll": (_W, "the signing key's enrollment waits for the console at the next boot"),
    "mok-pending-delete": (_W, "the signing key is being deleted at the next boot"),
    "mok-blocked": (_W, "the firmware blocks the signing key (dbx or MokListXRT)"),
    "ours-load-failed": (_W, "the kernel refused our module at its last load in this boot (the guard loaded stock)"),
    "mok-not-trusted-by-kernel": (_W, "the key is enrolled in the firmware but the running kernel does not trust it"),
    "mok-trusted-by-kernel-only": (_I, "the running kernel trusts the key, the firmware's lists do not hold it"),
    "kernel-outside-policy": (_I, "the running kernel is outside the kernel policy (page size, PREEMPT_RT)"),
    "headers-missing": (_IW, "kernel headers are not installed: nothing can be built for that kernel"),
    "unknown-kernel": (_W, "the running kernel has no /lib/modules directory"),
    "nvidia-ko-missing": (_W, "no nvidia.ko for the kernel: no driver version to build against"),
    "driver-unsupported": (_W, "the driver is not in this release's patch manifest"),
    "driver-source-missing": (_W, "no open source tree of exactly the driver's version, and none to fetch"),
    "driver-source-corrupt": (_W, "the driver's source tree does not check out"),
    "dkms-missing": (_W, "dkms is not installed"),
    "signing-key-incomplete": (_W, "the signing certificate is there, its private key is not: nothing would sign"),
    "driver-source-fetchable": (_I, "the driver's source is not here; installing fetches it through APT"),
    "ours-loaded-stock-selected": (_I, "ours is still loaded, the stock module is selected (reload or reboot)"),
    "counters-unreadable": (_W, "ours is loaded but its counters cannot be read"),
    "packing-disabled": (_I, "ours is loaded with packing turned off (uvm_pt_pack=0)"),
    "packing-predicates-unmet": (_W, "ours is loaded but the GPU does not qualify for packing"),
    "held": (_I, "the administrator's rollback/remove holds the kernel on the stock module"),
    "rolled-back": (_W, "rolled back to the stock module (the rollback record's reason)"),
    "installed-awaiting-key": (_I, "ours is installed and becomes active once the key is enrolled and trusted"),
    "activation-pending": (_I, "ours is installed, the stock module is loaded: activate or reboot"),
    "stock": (_I, "the stock module is selected: whether ours can be installed"),
    "hazards-table-unreadable": (_I, "the table of known NVIDIA driver faults cannot be read"),
    "hazards-invalid": (_I, "the table of known NVIDIA driver faults is malformed"),
    "hazard-check-failed": (_I, "a known-fault check could not run"),
}


class Finding(Record, frozen=True):
    code: str
    severity: str
    message: str
    remedy: str = ""
    kernel: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["kernel"] is None:
            del d["kernel"]
        return d


class Verdict(Record):
    state: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def problem(self) -> bool:
        return any(f.severity in ("warning", "error") for f in self.findings)


def needs_first(decision: dict | None, remedy: str, joint: str = "then:") -> str:
    """``remedy`` as it stands, or -- when it starts with an install or build that would be refused for the
    running kernel now (decide/installability.py) -- the missing piece's own remedy first."""
    first = (rm.commands_in(remedy) or [""])[0]
    if decision is None or not decision["missing"] or not re.search(r"spark-memsaver (install|build)\b", first):
        return remedy
    return f"{decision['missing'][0]['remedy'].rstrip('.')}; {joint} {remedy[:1].lower()}{remedy[1:]}"
