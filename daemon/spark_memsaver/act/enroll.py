"""Secure Boot / MOK, acting: ``mokutil --import`` / ``--revoke-import`` through ``Host.run``, the one-time
SHA-512-crypt hash file (the password never reaches argv, the environment or a log), and our request record.
Every step refuses (named error) unless decide/mok.py's state allows it."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import secrets
import shutil
import tempfile

from spark_memsaver.decide.mok import (PASSWORD_MAX, PASSWORD_MIN, MokAlreadyEnrolled, MokAlreadyPending, MokBadPassword, MokKeyBlocked,
                                       MokNoKey, MokNotNeeded, MokPendingDelete, MokutilFailed)
from spark_memsaver.errors import MemsaverError, NotPermitted, SecureBootUnknown, Unsupported
from spark_memsaver.opnames import ENROLL, ENROLL_CANCEL
from spark_memsaver import efi as ev
from spark_memsaver.observe.mok import BOOT_ID, REQUEST_RECORD, locate_certificate
from spark_memsaver.world import secure_boot


CONSOLE_STEPS = (
    "Reboot this node with a screen and a (US-layout) keyboard attached; stay at the console.",
    "The blue 'Shim UEFI key management' screen appears: 'Press any key to perform MOK management' counts down "
    "10 s: press a key. (With --wait-at-console there is no countdown: the 'Perform MOK management' menu opens "
    "and waits.)",
    "Choose 'Enroll MOK'.",
    "Optionally 'View key 0' to check the subject and fingerprint printed below; then choose 'Continue'.",
    "'Enroll the key(s)?': choose 'Yes'.",
    "'Password:': type the one-time password given to 'spark-memsaver mok enroll' and press Enter.",
    "Choose 'Reboot'.",
)



# --- SHA-512-crypt (the format of `mokutil --generate-hash` and of --hash-file) --------------------------

_ITOA64 = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_SHA512_ORDER = ((0, 21, 42), (22, 43, 1), (44, 2, 23), (3, 24, 45), (25, 46, 4), (47, 5, 26), (6, 27, 48),
                 (28, 49, 7), (50, 8, 29), (9, 30, 51), (31, 52, 10), (53, 11, 32), (12, 33, 54), (34, 55, 13),
                 (56, 14, 35), (15, 36, 57), (37, 58, 16), (59, 17, 38), (18, 39, 60), (40, 61, 19),
                 (62, 20, 41))


def sha512_crypt(password: str, salt: str | None = None) -> str:
    """``$6$<salt>$<86 chars>`` (Drepper's SHA-crypt, 5000 rounds), as crypt(3) and mokutil produce it."""
    pw = password.encode("utf-8")
    s = (salt if salt is not None else "".join(secrets.choice(_ITOA64) for _ in range(16)))[:16].encode()
    n = len(pw)
    b = hashlib.sha512(pw + s + pw).digest()
    a = hashlib.sha512(pw + s)
    for _ in range(n // 64):
        a.update(b)
    a.update(b[:n % 64])
    k = n
    while k:
        a.update(b if k & 1 else pw)
        k >>= 1
    da = a.digest()
    dp = hashlib.sha512(pw * n).digest()
    p = (dp * (n // 64 + 1))[:n]
    ds = hashlib.sha512(s * (16 + da[0])).digest()
    sb = (ds * (len(s) // 64 + 1))[:len(s)]
    c = da
    for i in range(5000):
        h = hashlib.sha512(p if i & 1 else c)
        if i % 3:
            h.update(sb)
        if i % 7:
            h.update(p)
        h.update(c if i & 1 else p)
        c = h.digest()
    out = []
    for b2, b1, b0 in _SHA512_ORDER:
        w = (c[b2] << 16) | (c[b1] << 8) | c[b0]
        for _ in range(4):
            out.append(_ITOA64[w & 0x3F])
            w >>= 6
    w = c[63]
    for _ in range(2):
        out.append(_ITOA64[w & 0x3F])
        w >>= 6
    return f"$6${s.decode()}${''.join(out)}"


def check_password(password: str) -> None:
    if not (PASSWORD_MIN <= len(password) <= PASSWORD_MAX):
        raise MokBadPassword(f"the one-time password must be {PASSWORD_MIN}-{PASSWORD_MAX} characters long "
                             f"(got {len(password)})")
    bad = sorted({ch for ch in password if not (" " <= ch <= "~")})
    if bad:
        raise MokBadPassword("the one-time password contains characters MokManager may not be able to type "
                             "(only printable ASCII is safe)")


def write_request_record(host, cert_sha256: str) -> None:
    """Remember the request (no secret in it) so a later boot can tell that the prompt was missed."""
    import datetime

    rec = {"cert_sha256": cert_sha256, "boot_id": (host.read_text(BOOT_ID) or "").strip() or None,
           "requested_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    from spark_memsaver.host.fsutil import atomic_write

    try:
        atomic_write(host.path(REQUEST_RECORD), json.dumps(rec) + "\n", 0o644)
    except OSError:
        pass                     # only a hint is lost


def clear_request_record(host) -> None:
    try:
        host.path(REQUEST_RECORD).unlink()
    except OSError:
        pass

# --- acting: mokutil ------------------------------------------------------------------------------------

def _refuse_for(sb: dict) -> None:
    state, reason = sb["state"], sb["reason"]
    if state == "unknown":
        raise SecureBootUnknown(f"refusing to enroll: the Secure Boot state is unknown ({reason})",
                                remedy=sb.get("remedy") or None)
    if state == "not-needed":
        raise MokNotNeeded(f"no enrollment needed: {reason}")
    if state == "no-key":
        raise MokNoKey(f"nothing to enroll: {reason}")
    if state == "enrolled":
        raise MokAlreadyEnrolled(f"the key is already enrolled ({', '.join(sb['where'])})")
    if state == "pending-enroll":
        raise MokAlreadyPending("an enrollment request for this key is already waiting for the next boot")
    if state == "pending-delete":
        raise MokPendingDelete("the key is enrolled but a deletion request is pending")
    if state == "blocked":
        raise MokKeyBlocked(f"the key is blocked ({', '.join(sb['where'])}) and cannot be enrolled")


def _require_live_root(host, what: str) -> None:
    if not host.is_live:
        raise Unsupported(f"{what} writes the running machine's firmware variables; --root is for inspection only",
                          remedy="Run it on the node itself, without --root.")
    if os.geteuid() != 0:
        raise NotPermitted(f"{what} needs root (mokutil writes EFI variables)")


def _mokutil_message(r) -> str:
    lines = [x.strip() for x in (r.stdout + "\n" + r.stderr).splitlines() if x.strip()]
    return " | ".join(lines[-6:]) or f"exit code {r.returncode}"


def run_mokutil_import(host, der_path: str, password: str, timeout: float = 120) -> dict:
    """``mokutil --ignore-keyring --import DER --hash-file F``; the password never reaches argv, the environment or a log.
    The hash file (SHA-512-crypt of the password) lives in a 0700 directory and is removed afterwards."""
    check_password(password)
    d = tempfile.mkdtemp(prefix="spark-memsaver-mok.")
    try:
        hf = os.path.join(d, "hash")
        fd = os.open(hf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(sha512_crypt(password) + "\n")
        # --ignore-keyring: mokutil skips ("Already in kernel trusted keyring") a key the running kernel already
        # trusts; we want it in MokList all the same, so that every kernel the node boots trusts it
        r = host.run(["mokutil", "--ignore-keyring", "--import", der_path, "--hash-file", hf], timeout=timeout)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    msg = _mokutil_message(r)
    if r.returncode != 0:
        raise MokutilFailed(f"mokutil --import failed (exit {r.returncode}): {msg}", returncode=r.returncode)
    return {"argv": ["mokutil", "--ignore-keyring", "--import", der_path, "--hash-file", "<one-time hash file>"],
            "returncode": r.returncode, "message": msg}


def _der_file(ci_path: str, cert: ev.Certificate, workdir: str) -> str:
    p = os.path.join(workdir, "key.der")
    with open(p, "wb") as f:
        f.write(cert.der)
    os.chmod(p, 0o644)
    return p


CONSOLE_TIMEOUT_MAX = 0x7FFF      # mokutil --timeout: 1..32767 seconds, or -1 (no countdown, wait forever)


def check_console_timeout(wait_at_console: bool, console_timeout: int | None) -> None:
    from spark_memsaver.decide.mok import MokBadTimeout
    if wait_at_console and console_timeout is not None:
        raise MokBadTimeout("--wait-at-console and --console-timeout exclude each other")
    if console_timeout is not None and not 1 <= console_timeout <= CONSOLE_TIMEOUT_MAX:
        raise MokBadTimeout(f"--console-timeout {console_timeout} is outside 1..{CONSOLE_TIMEOUT_MAX} seconds")


def _recorded(kind: str):
    """Each finished request or cancellation is one lifecycle event (host/events.py, kind ``opnames.ENROLL`` or
    ``ENROLL_CANCEL``): done, or refused by the Secure Boot state, or mokutil failed -- as the executor records
    its operations. Not recorded: bad usage (an option, a password: nothing was attempted), no root, the refusal of --root
    (an inspected image is not written), a cancellation with nothing pending. The password is never in it."""
    def deco(fn):
        import functools

        @functools.wraps(fn)
        def run(host, *args, **kw):
            from spark_memsaver.decide.mok import MokBadTimeout
            from spark_memsaver.errors import UsageError
            from spark_memsaver.host import events
            try:
                doc = fn(host, *args, **kw)
            except (UsageError, Unsupported, NotPermitted, MokBadPassword, MokBadTimeout):
                raise
            except MemsaverError as e:
                events.record(host, kind, {"cert": kw.get("cert")}, error=e)
                raise
            if doc.get("requested") or doc.get("cancelled"):
                c = doc.get("certificate") or {}
                events.record(host, kind, {"cert": c.get("path") or kw.get("cert")},
                              result={"ok": True, "state_before": doc.get("state_before"),
                                      "state_now": doc.get("state_now") or doc.get("state"),
                                      "sha256": c.get("sha256")})
            return doc
        return run
    return deco


@_recorded(ENROLL)
def request_enrollment(host, config, password: str, cert: str | None = None,
                       wait_at_console: bool = False, console_timeout: int | None = None) -> dict:
    """Queue the signing certificate for enrollment at the next boot (MokNew + MokAuth).

    Refuses (named error) unless the state is not-enrolled; verifies afterwards that the request is recorded."""
    check_console_timeout(wait_at_console, console_timeout)
    before = secure_boot(host, cert=cert, config=config)
    _refuse_for(before)
    check_password(password)
    _require_live_root(host, "mok enroll")
    ci = locate_certificate(host, cert, config)
    if ci.cert is None:  # raced with a file change since observe()
        raise MokNoKey(f"the certificate at {ci.path} disappeared or changed")
    work = tempfile.mkdtemp(prefix="spark-memsaver-cert.")
    try:
        der = _der_file(ci.path, ci.cert, work)
        imp = run_mokutil_import(host, der, password)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    warnings = []
    timeout_set = None
    if wait_at_console or console_timeout is not None:
        arg = "-1" if wait_at_console else str(console_timeout)
        r = host.run(["mokutil", "--timeout", arg], timeout=60)
        timeout_set = r.returncode == 0
        if not timeout_set:
            warnings.append(f"mokutil --timeout {arg} failed (" + _mokutil_message(r) + "): MokManager will wait "
                            "only 10 seconds for a key press")
    after = secure_boot(host, cert=cert, config=config)
    if after["state"] != "pending-enroll":
        raise MokutilFailed(f"mokutil reported success but the key is not in MokNew (state {after['state']}: "
                            f"{after['reason']}); mokutil said: {imp['message']}",
                            remedy="mokutil skips keys the kernel already trusts ('Already in kernel trusted "
                                   "keyring') and keys already enrolled; read its message.")
    write_request_record(host, after["certificate"]["sha256"])
    return {
        "requested": True,
        "certificate": after["certificate"],
        "mokutil": imp,
        "wait_at_console": bool(timeout_set) and wait_at_console,
        # seconds MokManager counts down before it boots on without enrolling (the request is then discarded,
        # the stock nvidia-uvm stays loaded, status says not-enrolled); None: waits at its menu forever
        "console_timeout": None if wait_at_console and timeout_set else
        (console_timeout if console_timeout is not None and timeout_set else 10),
        "warnings": warnings,
        "state_before": before["state"],
        "state_now": after["state"],
        "state_after_confirmed_reboot": "enrolled",
        "state_after_missed_prompt": "not-enrolled",
        "console_steps": list(CONSOLE_STEPS),
    }


@_recorded(ENROLL_CANCEL)
def cancel_enrollment(host, config=None, cert: str | None = None) -> dict:
    """``mokutil --revoke-import``: drop the pending request (all keys in MokNew, and MokAuth)."""
    before = secure_boot(host, cert=cert, config=config)
    v = before.get("variables", {})
    pending = bool(v.get("MokNew", {}).get("present")) or bool(v.get("MokAuth", {}).get("present"))
    if not pending:
        return {"cancelled": False, "message": "no enrollment request is pending", "state": before["state"]}
    _require_live_root(host, "mok cancel")
    r = host.run(["mokutil", "--revoke-import"], timeout=60)
    if r.returncode != 0:
        raise MokutilFailed(f"mokutil --revoke-import failed (exit {r.returncode}): {_mokutil_message(r)}",
                            returncode=r.returncode)
    clear_request_record(host)
    after = secure_boot(host, cert=cert, config=config)
    return {"cancelled": True, "dropped_entries": v.get("MokNew", {}).get("entries", {}),
            "state_before": before["state"], "state": after["state"]}


# --- --dry-run: what `mok enroll` / `mok cancel` would request, from the same refusals; nothing written -------

_DRY_NOTE_ROOT = ("--root inspects an image: the real run refuses there (it writes the running machine's firmware "
                  "variables)")


def plan_enrollment(host, config, cert: str | None = None, wait_at_console: bool = False,
                    console_timeout: int | None = None) -> dict:
    """What ``request_enrollment`` would ask mokutil for: the same option check and state refusals (named
    errors), then the commands; no password is read, mokutil is not called, no record is written."""
    check_console_timeout(wait_at_console, console_timeout)
    before = secure_boot(host, cert=cert, config=config)
    _refuse_for(before)
    c = before.get("certificate") or {}
    would = [["mokutil", "--ignore-keyring", "--import", f"<DER copy of {c.get('path')}>", "--hash-file",
              "<one-time hash of the password you will type>"]]
    if wait_at_console or console_timeout is not None:
        would.append(["mokutil", "--timeout", "-1" if wait_at_console else str(console_timeout)])
    return {"dry_run": True, "requested": False, "certificate": c, "would_run": would,
            "state_now": before["state"], "state_after": "pending-enroll",
            "console_timeout": None if wait_at_console else (console_timeout or 10),
            "notes": [] if host.is_live else [_DRY_NOTE_ROOT]}


def plan_cancel(host, config=None, cert: str | None = None) -> dict:
    """What ``cancel_enrollment`` would do: ``mokutil --revoke-import`` when a request is pending, else nothing."""
    before = secure_boot(host, cert=cert, config=config)
    v = before.get("variables", {})
    pending = bool(v.get("MokNew", {}).get("present")) or bool(v.get("MokAuth", {}).get("present"))
    return {"dry_run": True, "cancelled": False, "pending": pending, "state": before["state"],
            "would_run": [["mokutil", "--revoke-import"]] if pending else [],
            "would_drop": v.get("MokNew", {}).get("entries", {}) if pending else {},
            "message": "" if pending else "no enrollment request is pending",
            "notes": [] if host.is_live or not pending else [_DRY_NOTE_ROOT]}
