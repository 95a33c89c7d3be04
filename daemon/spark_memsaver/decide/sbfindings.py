"""Status's findings about the Secure Boot path that are not the MOK state itself (decide/status.py says that):
the guard's refusal in this boot, the running kernel's trust against the firmware's, and ours signed with
another key than the configured certificate (decide/mok.signed_with). Pure."""

from __future__ import annotations

from spark_memsaver.decide import mok as mok_decide
from spark_memsaver.decide import ours
from spark_memsaver.decide.findings import Finding


def signed_elsewhere(snap, sb: dict, sb_state: str):
    """The running kernel whose selected nvidia-uvm is ours and signed with another key than the configured
    certificate, while Secure Boot checks signatures (any known state but not-needed); else None."""
    if sb_state in ("not-needed", "unknown", None):
        return None
    k = next((k for k in snap.kernels if k.running), None)
    if k is None or not ours.is_ours(k.uvm_selected):
        return None
    return k if mok_decide.signed_with(k.uvm_selected, sb.get("certificate")) is False else None


def resign_remedy(sb: dict, sb_state: str, kernel: str) -> str:
    """Rebuild and reinstall ours (signed with the configured key), then what makes that key trusted."""
    from spark_memsaver.decide.plan import rebuild_command
    then = "" if mok_decide.state_loadable(sb_state) else \
        "; then " + _lower(mok_decide.enrollment_remedy(sb)).rstrip(".")
    return f"Run '{rebuild_command(kernel)}' to sign ours with the configured key{then}."


def _lower(text: str) -> str:
    return text[:1].lower() + text[1:]


def other_key_finding(snap, sb: dict, sb_state: str) -> Finding | None:
    """``signed-with-other-key``: enrolling the configured certificate would not make ours load (e.g. after a
    new key pair replaced a blocked one): build --force and install come first."""
    k = signed_elsewhere(snap, sb, sb_state)
    if k is None:
        return None
    cert = sb.get("certificate") or {}
    sel = k.uvm_selected
    return Finding("signed-with-other-key", "warning",
                   f"Our nvidia-uvm for kernel {k.release} is signed with another key (signer "
                   f"{sel.signer or '?'}, key {sel.sig_key}) than the configured signing certificate "
                   f"{cert.get('path') or '?'} (serial {cert.get('serial') or '?'}): enrolling that certificate "
                   "does not make it load.", resign_remedy(sb, sb_state, k.release), k.release)


def secure_boot_findings(snap, sb: dict, sb_state: str) -> list[Finding]:
    """ours-load-failed (the guard's last refusal in this boot, while ours is not loaded) and
    mok-not-trusted-by-kernel (enrolled in the firmware, absent from the running kernel's keyrings) and
    mok-trusted-by-kernel-only (the reverse: trusted by the running kernel, in neither MokListRT nor db)."""
    out = []
    uvm = snap.uvm
    fail = snap.guard.ours_load_failed
    if fail and not (uvm.loaded and ours.is_ours(uvm)):
        cause = mok_decide.LOAD_FAILURE_CAUSES.get(fail["cause"], fail["reason"])
        inuse = "the stock module is in use" if uvm.loaded else "no nvidia-uvm is loaded"
        if fail["cause"] in ("key-not-trusted", "signature-required"):
            other = signed_elsewhere(snap, sb, sb_state)
            remedy = resign_remedy(sb, sb_state, other.release) if other else \
                mok_decide.enrollment_remedy(sb) if not mok_decide.state_loadable(sb_state) \
                else mok_decide.KERNEL_DISTRUST_REMEDY
        else:
            remedy = "Run 'sudo spark-memsaver reconcile': it rebuilds ours for this kernel and driver, or rolls back."
        out.append(Finding("ours-load-failed", "warning",
                           f"Our module was refused by the kernel: {cause}; {inuse} (at {fail['time']}: "
                           f"{fail['reason']}).", remedy, fail["kernel"]))
    k = sb.get("kernel") or {}
    if sb_state == "enrolled" and k.get("trusted_by_kernel") == "no":
        out.append(Finding("mok-not-trusted-by-kernel", "warning",
                           "Our signing key is enrolled in the firmware but the running kernel does not trust it ("
                           + (k.get("trust_reason") or "not in its keyrings") + "): modules it signs will not load.",
                           mok_decide.KERNEL_DISTRUST_REMEDY))
    if sb_state == "not-enrolled" and k.get("trusted_by_kernel") == "yes":
        out.append(Finding("mok-trusted-by-kernel-only", "info",
                           "The running kernel trusts our signing key (" + (k.get("trust_reason") or "in its keyrings")
                           + ") although it is in neither MokListRT nor db: spark-memsaver activates only with a key "
                           "the firmware keeps for every kernel the node boots.", mok_decide.enrollment_remedy(sb)))
    return out
