"""The exit codes of every spark-memsaver command: one table for the whole CLI, one for ``status --quiet``.

This module is the source of truth: README.md's and spark-memsaver(8)'s tables are generated from
:data:`TABLE` and :data:`QUIET_TABLE` (tools/gen-docs), and tests/test_exit_codes.py checks that every named
error and every command keeps to them. A number means one thing in both tables.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_PROBLEM = 1          # a problem was found, or the operation was refused (a missing piece: dkms, headers ...)
EXIT_USAGE = 2            # bad usage, bad configuration (build/install), or inspection impossible
EXIT_FAILED = 3           # the operation failed midway (a recovery record explains)
EXIT_NOT_APPLICABLE = 4   # nothing to do on this host (no NVIDIA driver, a kernel outside the policy, no GPU)

# (code, meaning): the whole CLI
TABLE = (
    (EXIT_OK, "consistent, or the operation was done"),
    (EXIT_PROBLEM, "a problem was found, or the operation was refused; the message says why and what to do "
                   "(a missing piece such as dkms or the kernel's headers is a refusal)"),
    (EXIT_USAGE, "bad usage, bad configuration for `build`, `install`, `activate` and `config show` (the way back "
                 "-- `rollback`, `remove`, `reconcile`, the package-manager doors -- and `status`, `metrics`, "
                 "`mok status` go on with the built-in defaults and one `config-invalid` finding), or inspection "
                 "impossible (a `--kernel` that is not installed is `unknown-kernel`, exit 2, in every command)"),
    (EXIT_FAILED, "the operation failed midway; a recovery record was left and `status` explains it"),
    (EXIT_NOT_APPLICABLE, "not applicable on this host (`validate`: no CUDA driver or GPU; `status --quiet`: "
                          "no NVIDIA driver, or a kernel outside the policy)"),
)

# status --quiet: the state as the exit status, like 'systemctl is-active'. 0-4 mean what they mean above;
# the states that need a word of their own take the numbers after them.
QUIET_STATE = {
    "active": EXIT_OK, "stock": EXIT_OK, "built": EXIT_OK, "installed": EXIT_OK,
    "needs-attention": EXIT_PROBLEM,
    "not-applicable": EXIT_NOT_APPLICABLE,
    "rolled-back": 5,
    "unverified": 6,
    "inactive": 7,
}

QUIET_TABLE = (
    (EXIT_OK, "active, stock, built or installed, and no warning"),
    (EXIT_PROBLEM, "needs-attention, or one of those above with a warning (as plain `status`)"),
    (EXIT_USAGE, "inspection impossible or bad usage (a bad configuration is a `config-invalid` warning: 1)"),
    (EXIT_NOT_APPLICABLE, "not-applicable"),
    (5, "rolled-back"),
    (6, "unverified"),
    (7, "inactive"),
)


def status_code(doc: dict) -> int:
    """Plain ``status``: 1 when a finding is a warning or an error, else 0."""
    return EXIT_PROBLEM if any(f.get("severity") in ("warning", "error") for f in doc.get("findings") or []) \
        else EXIT_OK


def quiet_code(doc: dict) -> int:
    """``status --quiet``: the state's own number where it has one (not-applicable, rolled-back, unverified,
    inactive); otherwise what plain ``status`` says (1 on a warning), so the two never disagree on a warning."""
    code = QUIET_STATE.get(doc.get("state"), EXIT_PROBLEM)
    if code != EXIT_OK:
        return code
    return status_code(doc)
