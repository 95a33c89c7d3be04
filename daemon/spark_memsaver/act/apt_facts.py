"""Facts about the packages an APT run is about to change, read before the APT door plans (decide/apt.py).

For each NVIDIA driver package of the hook's list: from the .deb APT is about to unpack (its path is the
v3 line's action) its control fields (``dpkg-deb -f``), the kernel modules it ships under
/lib/modules/<K>/ and the /usr/src/nvidia-* trees (``dpkg-deb -c``), and, when its Depends does not pin
the driver, the version of each nvidia.ko it ships (``modinfo`` of the file read from ``dpkg-deb
--fsys-tarfile``, streamed: tarfile reads the pipe as it comes, each wanted .ko goes straight to a temporary
file, and at most :data:`MAX_TAR` bytes are read before it gives up -- nothing of the archive is held in
memory, inside apt's own transaction; a wanted member larger than :data:`MAX_MEMBER`, or sparse (GNU/pax
sparse members expand holes that the archive does not carry: a 10 KiB archive could write hundreds of MiB), is
refused, and the copy itself stops at :data:`MAX_MEMBER` bytes); for a package APT removes, its installed file list (``dpkg-query -L``). Nothing is
installed or unpacked on the system; no dpkg lock is taken. A fact that cannot be read is left out and
the package counts as "driver unknown" (the door then removes, fail safe).
"""

from __future__ import annotations

import logging
import os
import re
import tarfile
import tempfile

from spark_memsaver.errors import MemsaverError
from spark_memsaver.host import Host

MODULE_RE = re.compile(r"^/?(?:\./)?(?:usr/)?lib/modules/([^/]+)/(\S+\.ko(?:\.(?:xz|zst|gz))?)$")
NVIDIA_KO_RE = re.compile(r"(?:^|/)nvidia\.ko(?:\.(?:xz|zst|gz))?$")
TREE_RE = re.compile(r"^/?(?:\./)?usr/src/(nvidia[^/]*)/?$")
FIELDS = ("Package", "Version", "Depends", "Provides")
MAX_TAR = 1 << 30          # never read more than 1 GiB of a package's contents
MAX_MEMBER = 512 << 20     # never copy more than 512 MiB of one module (an nvidia.ko is well under 200 MiB)
log = logging.getLogger(__name__)


class TarTooLarge(Exception):
    pass


class _Capped:
    """A read-only file over ``raw`` that raises TarTooLarge once more than ``limit`` bytes were read."""

    def __init__(self, raw, limit: int):
        self.raw, self.limit, self.read_bytes = raw, limit, 0

    def read(self, n: int = -1) -> bytes:
        want = self.limit + 1 - self.read_bytes if n is None or n < 0 else min(n, self.limit + 1 - self.read_bytes)
        data = self.raw.read(max(want, 0)) if want > 0 else b""
        self.read_bytes += len(data)
        if self.read_bytes > self.limit:
            raise TarTooLarge(f"more than {self.limit} bytes")
        return data


def _control(text: str) -> dict:
    out, key = {}, None
    for ln in text.splitlines():
        if ln[:1] in (" ", "\t") and key:
            out[key] += " " + ln.strip()
        elif ":" in ln:
            key, _, val = ln.partition(":")
            key = key.strip().lower()
            out[key] = val.strip()
    return out


def paths_facts(paths) -> dict:
    """Kernel modules per kernel and the NVIDIA source trees in a list of package paths."""
    modules: dict[str, list[str]] = {}
    trees = set()
    for p in paths:
        p = p.split(" -> ", 1)[0].strip()
        m = MODULE_RE.match(p)
        if m:
            modules.setdefault(m.group(1), []).append("/" + re.sub(r"^\.?/", "", p))
            continue
        t = TREE_RE.match(p)
        if t:
            trees.add("/usr/src/" + t.group(1))
    return {"modules": modules, "trees": sorted(trees)}


def _deb_path(host: Host, action: str) -> str | None:
    if not action or action.startswith("**"):
        return None
    cands = [str(host.path(action))] if not host.is_live else []
    cands.append(action)
    return next((c for c in cands if os.path.isfile(c)), None)


def _modinfo_version(host: Host, member, name: str, limit: int = MAX_MEMBER) -> str | None:
    """modinfo's version of a tar member, copied in chunks to a temporary file (never whole in memory, never
    more than ``limit`` bytes: TarTooLarge)."""
    suffix = "".join(re.findall(r"\.ko(?:\.\w+)?$", name)) or ".ko"
    with tempfile.NamedTemporaryFile(prefix="spark-memsaver-apt-", suffix=suffix) as f:
        copied = 0
        while chunk := member.read(min(1 << 20, limit + 1 - copied)):
            copied += len(chunk)
            if copied > limit:
                raise TarTooLarge(f"{name}: more than {limit} bytes")
            f.write(chunk)
        f.flush()
        r = host.run(["modinfo", "-F", "version", f.name], timeout=30)
    v = r.stdout.strip() if r.ok else ""
    return v or None


def nvidia_ko_versions(host: Host, deb: str, wanted: dict[str, str], limit: int = MAX_TAR,
                       member_limit: int = MAX_MEMBER) -> dict[str, str]:
    """{kernel: version} of the nvidia.ko files ``wanted`` ({kernel: path}) inside ``deb``; {} when the
    archive cannot be read, holds more than ``limit`` bytes, or a wanted member is sparse or larger than
    ``member_limit`` (the caller then counts the driver unknown)."""
    by_path = {p.lstrip("/"): k for k, p in wanted.items()}
    out: dict[str, str] = {}
    with host.runner.stream(["dpkg-deb", "--fsys-tarfile", deb], timeout=300) as st:
        capped = _Capped(st.stdout, limit)
        try:
            with tarfile.open(fileobj=capped, mode="r|") as tf:      # a stream: read once, front to back
                for m in tf:
                    name = m.name[2:] if m.name.startswith("./") else m.name.lstrip("/")
                    if name in by_path and m.isfile():
                        if m.issparse() or m.size > member_limit:
                            raise TarTooLarge(f"{name}: " + ("a sparse member" if m.issparse()
                                                             else f"{m.size} bytes"))
                        v = _modinfo_version(host, tf.extractfile(m), name, member_limit)
                        if v:
                            out[by_path[name]] = v
                        del by_path[name]
                        if not by_path:
                            break       # the rest of the archive is never read
        except TarTooLarge as e:
            log.warning("%s: refused (%s; at most %d bytes in all, %d a module, no sparse member): its nvidia.ko "
                        "versions are not read", deb, e, limit, member_limit)
            return {}
        except tarfile.TarError as e:
            log.warning("%s: cannot read its contents: %s", deb, e)
            return {}
    return out          # each version came from a whole member (a torn archive raised above)


def deb_facts(host: Host, deb: str) -> dict:
    from spark_memsaver.decide.apt import driver_of_depends
    r = host.run(["dpkg-deb", "-f", deb, *FIELDS], timeout=60)
    if not r.ok:
        return {"readable": False, "error": (r.stderr or r.stdout).strip()[-300:]}
    ctl = _control(r.stdout)
    lst = host.run(["dpkg-deb", "-c", deb], timeout=120)
    if not lst.ok:
        return {"readable": False, "error": (lst.stderr or lst.stdout).strip()[-300:]}
    facts = {"readable": True, "from": deb, **{k.lower(): ctl.get(k.lower()) for k in FIELDS},
             **paths_facts(ln.split(None, 5)[-1] for ln in lst.stdout.splitlines() if ln.strip())}
    wanted = {k: next(p for p in ps if NVIDIA_KO_RE.search(p)) for k, ps in facts["modules"].items()
              if any(NVIDIA_KO_RE.search(p) for p in ps)}
    if wanted and not driver_of_depends(facts["depends"]):
        facts["nvidia_ko"] = nvidia_ko_versions(host, deb, wanted)
    return facts


def installed_facts(host: Host, name: str) -> dict:
    argv = ["dpkg-query"] + ([] if host.is_live else ["--admindir", str(host.path("/var/lib/dpkg"))])
    r = host.run(argv + ["-L", name], timeout=60)
    if not r.ok:
        return {"readable": False, "error": (r.stderr or r.stdout).strip()[-300:]}
    return {"readable": True, "from": "dpkg-query", **paths_facts(r.stdout.splitlines())}


def gather(host: Host, changes: list[dict]) -> list[dict]:
    """``changes`` (decide/apt.driver_changes) each with ``facts`` added; never raises for a package."""
    out = []
    for c in changes:
        try:
            if c.get("action") == "**REMOVE**":
                facts = installed_facts(host, c["name"])
            else:
                deb = _deb_path(host, c.get("action", ""))
                facts = deb_facts(host, deb) if deb else {"readable": False,
                                                          "error": f"no package file at {c.get('action')!r}"}
        except (MemsaverError, OSError, tarfile.TarError) as e:
            facts = {"readable": False, "error": str(getattr(e, "message", e))}
        out.append({**c, "facts": facts})
    return out
