"""A module root whose modprobe and insmod stand in for the kernel's answer to a load (no module can be loaded
on this machine), for the load-time guard run for real (not its dry run).

The guard looks kmod's programs up in its root first (SPARK_MEMSAVER_GUARD_ROOT: $R/usr/sbin, ...), so a root
made here brings these two:
- ``modprobe``: the real kmod modprobe for everything (``--version``, ``-c``, ``--show-depends``, a dry run);
  for a load it asks the real modprobe what it would insert (``--dry-run --show-depends``), then answers for each
  file in order as the kernel would: one listed in ``ROOT/kernel-refuses`` is refused with kmod's own error
  line ("modprobe: ERROR: could not insert 'NAME': TEXT") and exit status 1; one taken is printed on stdout as
  ``insmod FILE ARGS`` (what went in);
- ``insmod``: prints ``insmod FILE ARGS`` on stdout (what was inserted), or for a refused file kmod's line
  ("insmod: ERROR: could not insert module FILE: TEXT") and exit status 1.
The texts are the kernel's errno strings as kmod prints them (tests/test_guard_ours_refused.py REFUSALS).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support import needs

_SBIN = "/usr/local/sbin:/usr/sbin:/sbin:/usr/bin:/bin"

_REFUSED = r'''
refused() { # FILE -> the kernel's error text for FILE from ROOT/kernel-refuses ("FILE<TAB>TEXT" lines)
	[ -f "$ROOT/kernel-refuses" ] || return 1
	tab=$(printf '\t')
	while IFS= read -r line; do
		case $line in "$1$tab"*) printf '%s' "${line#*"$tab"}"; return 0 ;; esac
	done <"$ROOT/kernel-refuses"
	return 1
}
'''

MODPROBE = r'''#!/bin/sh
# stand-in for the kernel's answer to modprobe's load (tests/support/kernelstandin.py); kmod's modprobe otherwise
set -f
REAL=@REAL@
ROOT=@ROOT@
@REFUSED@
for a in "$@"; do
	case $a in --version | -V | -c | --showconfig | -n | --dry-run | -D | --show-depends) exec "$REAL" "$@" ;; esac
done
out=$("$REAL" --dry-run --show-depends "$@") || exit $?
while IFS= read -r line; do
	case $line in insmod\ *) ;; *) continue ;; esac
	f=${line#insmod }; f=${f%% *}
	if why=$(refused "$f"); then
		n=${f##*/}; n=${n%%.ko*}
		n=$(printf '%s' "$n" | tr - _)
		printf "modprobe: ERROR: could not insert '%s': %s\n" "$n" "$why" >&2
		exit 1
	fi
	printf '%s\n' "$line"          # inserted (the guard's dry-run output has the same shape)
done <<EOF
$out
EOF
exit 0
'''

INSMOD = r'''#!/bin/sh
# stand-in for the kernel's answer to insmod (tests/support/kernelstandin.py); kmod's insmod for --version
set -f
REAL=@REAL@
ROOT=@ROOT@
@REFUSED@
case ${1:-} in --version | -V) exec "$REAL" "$@" ;; esac
if why=$(refused "$1"); then
	printf 'insmod: ERROR: could not insert module %s: %s\n' "$1" "$why" >&2
	exit 1
fi
printf 'insmod %s\n' "$*"
exit 0
'''


def _quoted(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def install(root: Path) -> Path:
    """root/usr/sbin/{modprobe,insmod}: the stand-ins above over this machine's kmod. Returns root."""
    needs.require("modprobe", "insmod", remedy="tools/deps/lifecycle.txt (kmod)")
    sbin = root / "usr/sbin"
    sbin.mkdir(parents=True, exist_ok=True)
    for name, text in (("modprobe", MODPROBE), ("insmod", INSMOD)):
        real = shutil.which(name, path=_SBIN)
        f = sbin / name
        f.write_text(text.replace("@REAL@", _quoted(real)).replace("@ROOT@", _quoted(str(root)))
                     .replace("@REFUSED@", _REFUSED))
        f.chmod(0o755)
    return root


def refuse(root: Path, path: str, text: str) -> None:
    """The kernel refuses the module file ``path`` with ``text`` (kmod's words for the errno)."""
    with open(root / "kernel-refuses", "a") as f:
        f.write(f"{path}\t{text}\n")
