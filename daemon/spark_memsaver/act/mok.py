"""Secure Boot / MOK, the stable names in one place (the CLI, the D-Bus operations, the build preflight and
the tests import them from here). The work lives in three modules:

* observe/mok.py -- reading efivarfs, shim's MOK table, the certificate file, the kernel side; :func:`observe`.
* decide/mok.py -- the pure verdict (:func:`decide`), the named MOK errors, :func:`require_installable`.
* act/enroll.py -- ``mokutil --import`` / ``--revoke-import`` (:func:`request_enrollment`, :func:`cancel_enrollment`).
"""

from __future__ import annotations

from spark_memsaver.act.enroll import (CONSOLE_STEPS, PASSWORD_MAX, PASSWORD_MIN, _der_file, _mokutil_message,  # noqa: F401
                                       _refuse_for, _require_live_root, cancel_enrollment, check_console_timeout,
                                       check_password,
                                       clear_request_record, request_enrollment, run_mokutil_import, sha512_crypt,
                                       write_request_record)
from spark_memsaver.decide.mok import (EFI_DIR, EFIVARS_DIR, LISTS, LOADABLE, MOKVAR_DIR, MOKVAR_NAMES,  # noqa: F401
                                       PRESENCE, SCALARS, STATES, SYSFS_MISSING_REMEDY, CertInfo, Decision,
                                       MokAlreadyEnrolled, MokAlreadyPending, MokBadPassword, MokError,
                                       MokKeyBlocked, MokNoKey, MokNotNeeded, MokPendingDelete, MokutilFailed,
                                       ParsedEfi, RawEfi, Var, decide, exit_code, parse_efi, require_installable)
from spark_memsaver.errors import SecureBootUnknown  # noqa: F401
from spark_memsaver.observe import efivars as ev  # noqa: F401
from spark_memsaver.observe.mok import (BOOT_ID, DKMS_DEFAULT_CERT, FRAMEWORK_CONF, FRAMEWORK_CONF_D,  # noqa: F401
                                        MAX_CERT_BYTES, REQUEST_RECORD, UBUNTU_DEFAULT_CERT, CertFileRefused,
                                        dkms_signing_config, locate_certificate, observe, parse_lockdown,
                                        parse_proc_keys, read_cert_file, read_efi, read_kernel,
                                        read_request_record, sysfs_mounted)



# --- CLI ------------------------------------------------------------------------------------------------

def render_text(sb: dict) -> str:
    c = sb.get("certificate") or {}
    k = sb.get("kernel") or {}
    rows = [("State", sb["state"]), ("Reason", sb["reason"])]
    if sb.get("remedy"):
        rows.append(("Remedy", sb["remedy"]))
    rows += [("EFI", "yes" if sb["efi"] else "no"),
             ("Secure Boot", {True: "on", False: "off", None: "unknown"}[sb["secure_boot"]]),
             ("Setup mode", {True: "yes", False: "no", None: "n/a"}[sb["setup_mode"]]),
             ("Validation disabled", {True: "yes (MokSBStateRT)", False: "no", None: "n/a"}[sb["validation_disabled"]]),
             ("Certificate", f"{c.get('path')} ({c.get('origin')}" + ("" if c.get("present") else ", missing") + ")")]
    if c.get("sha256"):
        rows += [("  subject", c["subject"]), ("  sha256", c["sha256"]), ("  not after", c["not_after"])]
    if sb.get("where"):
        rows.append(("Found in", ", ".join(sb["where"])))
    if k:
        rows.append(("Kernel", f"lockdown={k.get('lockdown') or 'n/a'} sig_enforce="
                               f"{ {True: 'Y', False: 'N', None: 'n/a'}[k.get('sig_enforce')] }"
                     + ("" if k.get("key_loaded") is None else f" key loaded={'yes' if k['key_loaded'] else 'no'}")))
    w = max(len(r[0]) for r in rows) + 2
    return "\n".join(f"{a + ':':<{w}}{b}" for a, b in rows)
