"""The text of `spark-memsaver mok status`: the Secure Boot / MOK section (world.secure_boot) as rows."""

from __future__ import annotations


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
        rows += [("  subject", c["subject"]), ("  sha256", c["sha256"])]
        if c.get("sha1"):
            rows.append(("  sha1", f"{c['sha1']} (MokManager's 'View key' shows this one)"))
        rows.append(("  not after", c["not_after"]))
    if sb.get("where"):
        rows.append(("Found in", ", ".join(sb["where"])))
    if k:
        rows.append(("Kernel", f"lockdown={k.get('lockdown') or 'n/a'} sig_enforce="
                               f"{ {True: 'Y', False: 'N', None: 'n/a'}[k.get('sig_enforce')] }"
                     + ("" if k.get("key_loaded") is None else f" key loaded={'yes' if k['key_loaded'] else 'no'}")))
    w = max(len(r[0]) for r in rows) + 2
    return "\n".join(f"{a + ':':<{w}}{b}" for a, b in rows)
