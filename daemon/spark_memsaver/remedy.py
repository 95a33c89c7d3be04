"""One place that writes a remedy's command so the person reading it can run it as printed.

    cmd("spark-memsaver install --kernel K")   -> "sudo spark-memsaver install --kernel K"
    cmd("spark-memsaver status")               -> "spark-memsaver status"
    run("spark-memsaver activate")             -> "Run 'sudo spark-memsaver activate'"
    RESTART_DAEMON                             -> "sudo systemctl restart spark-memsaverd.service"

Root is needed exactly for what changes the system: the spark-memsaver commands in :data:`ROOT_COMMANDS`
(polkit's actions are auth_admin, which an SSH session cannot answer: sudo is the form that works), and the
system commands in :data:`ROOT_PROGRAMS`. tests/test_remedies.py walks every finding and every named error and
checks each command against this module and the CLI's own parser.
"""

from __future__ import annotations

import re

PROG = "spark-memsaver"
UNIT = "spark-memsaverd.service"
# spark-memsaver commands that change the system (or run GPU work as root: validate)
from spark_memsaver.opnames import ROOT_COMMANDS  # noqa: E402  (the one table of operations)
# system programs a remedy names; those that change the system need root (the value)
PROGRAMS = {"apt-get": None, "apt": None, "systemctl": None, "mount": True, "mokutil": None, "dkms": None,
            "update-secureboot-policy": True, "modprobe": True, "depmod": True, "update-initramfs": True, "journalctl": False,
            "reboot": True}
_READ_ONLY = {"apt-get": ("download", "source", "check", "changelog"), "apt": ("show", "list", "search", "policy"),
              "systemctl": ("status", "is-active", "is-enabled", "show", "cat"),
              "mokutil": ("--sb-state", "--list-enrolled", "--list-new", "--test-key", "--list-delete"),
              "dkms": ("status",)}

RESTART_DAEMON = f"sudo systemctl restart {UNIT}"
START_DAEMON = f"sudo systemctl start {UNIT}"


def needs_root(command: str) -> bool:
    """Whether ``command`` (without sudo) changes the system."""
    words = command.split()
    if not words or "--help" in words or "-h" in words:
        return False
    if words[0] == PROG:
        rest = [w for w in words[1:] if not w.startswith("-")]
        sub = " ".join(rest[:2]) if rest[:1] in (["mok"], ["patch"], ["config"]) else " ".join(rest[:1])
        return sub in ROOT_COMMANDS
    fixed = PROGRAMS.get(words[0])
    if fixed is not None:
        return fixed
    if words[0] in _READ_ONLY:
        return not (len(words) > 1 and words[1] in _READ_ONLY[words[0]])
    return False


def cmd(command: str) -> str:
    """``command`` with sudo exactly when it needs root (an existing sudo is dropped first and decided anew)."""
    command = re.sub(r"^\s*sudo\s+", "", command).strip()
    return f"sudo {command}" if needs_root(command) else command


def run(command: str) -> str:
    """"Run 'COMMAND'" with sudo decided by :func:`cmd`."""
    return f"Run '{cmd(command)}'"


def sm(args: str) -> str:
    """A spark-memsaver command line: ``sm("install --kernel K")``."""
    return cmd(f"{PROG} {args}")


# --- reading remedies back (the remedy walk, tests) ------------------------------------------------------

# a quoted segment: its quotes are not an apostrophe inside a word ("the driver's", "spark-memsaverd's next")
_QUOTED = r"(?<!\w)'([^']*)'(?!\w)"
_COMMAND_START = re.compile(r"^(?:sudo\s+)?(?:" + "|".join(re.escape(p) for p in (PROG, *PROGRAMS)) + r")(?:\s|$)")


def commands_in(remedy: str) -> list[str]:
    """The commands a remedy asks the reader to run: its quoted segments that start with a program we know,
    and the remedy itself when it is a bare command line."""
    out = [q for q in re.findall(_QUOTED, remedy) if _COMMAND_START.match(q)]
    bare = remedy.strip().rstrip(".")
    if _COMMAND_START.match(bare) and "'" not in bare:
        out.append(bare)
    return out


def unquoted_root_mentions(remedy: str) -> list[str]:
    """'spark-memsaver install' written outside quotes and without sudo: an instruction the reader would run
    as themselves and be refused (polkit's auth_admin over SSH). Prose about the program ('spark-memsaver
    rebuilds ...') is not a command and is not matched."""
    text = re.sub(_QUOTED, "''", remedy)
    pat = r"(?<!sudo )\bspark-memsaver (" + "|".join(re.escape(c) for c in ROOT_COMMANDS) + r")\b"
    return [m.group(0) for m in re.finditer(pat, text)]
