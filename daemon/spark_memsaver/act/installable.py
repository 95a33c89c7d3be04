"""The installability decision (decide/installability.py) applied to the observed host, for the doors that act.

* :func:`observe` -- world.facts: the snapshot the planner sees and the manifest's verdict for its drivers: what
  ``status``, ``install`` and ``reconcile`` decide from, so they cannot disagree.
* :func:`require` -- ``install --kernel K`` (and ``build``, Secure Boot aside) refuses before anything is written with the code and remedy that
  ``status`` shows for the same missing piece (the named error class of that code); when the driver's source
  can be fetched (decide: ``needs_fetch``) it is fetched first (act/source_fetch.py).
* :func:`check_kernel` -- the one ``unknown-kernel`` refusal (exit 2) of every command that names a kernel.
* :func:`prepare` -- what the install engine (act/override.install) needs for one kernel, read before the
  operation's first step (observe once per operation: the engine reads the host again only through world/refresh,
  after a step that changed it).

Called from act/executor.py (under its lock), act/activate.py and act/dryrun.py; reads only, except the fetch.
The status readers never come here: they call report/document.status_of over the same world.facts.
"""

from __future__ import annotations

from spark_memsaver import errors
from spark_memsaver.config import Config
from spark_memsaver.decide.installability import installability
from spark_memsaver.host import Host
from spark_memsaver import world


observe_for_plan = world.observe_for_plan     # the readers live in world/ (status reads them without act/)
versions_in = world.versions_in


def observe(host: Host, config: Config) -> tuple[dict, dict]:
    """(snapshot, support): world.facts -- what status shows is what the doors decide from."""
    return world.facts(host, config)


def _classes() -> dict:
    from spark_memsaver.act import dkms_errors as de, signing
    return {"unknown-kernel": errors.UnknownKernel, "nvidia-ko-missing": de.NoNvidiaDriver,
            "kernel-outside-policy": de.KernelOutsidePolicy, "driver-unsupported": errors.DriverUnsupported,
            "driver-source-missing": de.DriverSourceMissing, "driver-source-corrupt": de.DriverSourceCorrupt,
            "headers-missing": de.HeadersMissing, "secure-boot-unknown": errors.SecureBootUnknown,
            "dkms-missing": de.DkmsMissing, "signing-key-incomplete": signing.SigningKeyIncomplete}


def refusal(decision: dict) -> errors.MemsaverError:
    """The named error for the first missing piece: its class, code, detail and the remedy status gives."""
    first, rest = decision["missing"][0], decision["missing"][1:]
    cls = _classes().get(first["code"], errors.MemsaverError)
    msg = f"cannot install for kernel {decision['kernel']}: {first['detail']}"
    if rest:
        msg += "; also missing: " + ", ".join(m["what"] for m in rest) + " ('spark-memsaver status' lists each)"
    err = cls(msg, remedy=first["remedy"], kernel=decision["kernel"], missing=[m["code"] for m in decision["missing"]])
    err.code = first["code"]
    return err


def require(host: Host, config: Config, kernel: str, progress=None, ignore: tuple = (), fetch: bool = True,
            facts: tuple | None = None) -> dict:
    """Refuse (named, with status's code and remedy) unless ``kernel`` can get our module now; fetch the
    driver's source first when that is what is missing and it can be fetched. Returns the decision.
    ``ignore``: codes that do not block this operation (``build`` signs but loads nothing: not the Secure
    Boot state). ``facts``: (snapshot, support) when the operation observed them already, else observed here."""
    snap, support = facts or observe(host, config)
    d = installability(snap, config, support, kernel)
    d["missing"] = [m for m in d["missing"] if m["code"] not in ignore]
    if d["missing"]:
        raise refusal(d)
    if d["needs_fetch"] and fetch:       # a dry run (act/dryrun.py) plans the fetch, it does not do it
        from spark_memsaver.act import source_fetch
        source_fetch.fetch(host, config, d["fetch"]["driver"], progress=progress)
    return d


def targets(host: Host, config: Config, kernel: str | None, all_kernels: bool, ignore: tuple = (),
            facts: tuple | None = None) -> tuple[list, list]:
    """(decisions, skipped): the kernels ``install``/``build`` act on, judged by the one installability decision
    over one observation. --kernel K (default: the running kernel): its decision, or its refusal raised. --all:
    each installed kernel exactly as --kernel K would judge it; a refused one is a row {kernel, code, reason,
    remedy} (what --kernel K would have refused with); when none can get ours, the first refusal is raised,
    so --all on a one-kernel node says and exits what --kernel K does. Nothing is fetched here. ``facts``:
    (snapshot, support) when the operation observed them already (act/executor.recover), else observed here."""
    snap, support = facts or observe(host, config)
    if not all_kernels:
        if kernel is None:
            from spark_memsaver.act import dkms_run
            kernel = dkms_run.running_kernel(host)
        ks = [kernel]
    else:
        from spark_memsaver.observe.snapshot import installed_kernels
        ks = sorted(installed_kernels(host))
    decided, skipped, first = [], [], None
    for k in ks:
        d = installability(snap, config, support, k)
        d["missing"] = [m for m in d["missing"] if m["code"] not in ignore]
        if not d["missing"]:
            decided.append(d)
            continue
        err = refusal(d)
        if not all_kernels:
            raise err
        first = first or err
        skipped.append({"kernel": k, "code": err.code, "reason": d["missing"][0]["detail"], "remedy": err.remedy})
    if not decided and first is not None:
        raise first
    return decided, skipped


def fetch_missing(host: Host, config: Config, decided: list, progress=None) -> None:
    """Fetch each driver source the decisions need (once per driver), as require does for one kernel."""
    seen = set()
    for d in decided:
        if d.get("needs_fetch") and d["fetch"]["driver"] not in seen:
            seen.add(d["fetch"]["driver"])
            from spark_memsaver.act import source_fetch
            source_fetch.fetch(host, config, d["fetch"]["driver"], progress=progress)


def check_kernel(host: Host, kernel: str) -> str:
    """``kernel`` if it is a release name (versions.release: the same check as D-Bus; invalid-argument) and
    /lib/modules/<kernel> exists, else the one unknown-kernel error naming those that do."""
    from spark_memsaver.versions import release
    release(kernel)
    if host.path(f"/lib/modules/{kernel}").is_dir():
        return kernel
    from spark_memsaver.observe.snapshot import installed_kernels
    raise errors.unknown_kernel(kernel, sorted(installed_kernels(host)))


def prepare(host: Host, config: Config, snap, kernel: str, driver_version: str | None = None) -> dict:
    """What ``install`` needs for ``kernel`` before its first step, from the operation's one observation (``snap``:
    the Secure Boot section) and the readings of its preflight: {"kernel", "secure_boot", "state"
    (world/refresh.kernel), "preflight" (act/build's preflight answer, or its named refusal, raised by the engine
    where it always was), "tree" (act/render.plan_tree: our DKMS tree for that driver), "settings" (the build
    record's settings, decide/policy.build_settings)}. ``snap``: a model.World (None: Secure Boot is read here);
    ``driver_version``: the driver a build is asked for (the preflight refuses another)."""
    from spark_memsaver.act import build, render
    from spark_memsaver.decide import policy
    from spark_memsaver.world import refresh
    if snap is not None and isinstance(snap.secure_boot, dict):
        sb = snap.secure_boot
    else:                                   # no world of this operation at hand: the section read now
        sb = secure_boot(host)
    out = {"kernel": kernel, "secure_boot": sb, "state": refresh.kernel(host, kernel),
           "settings": policy.build_settings(config), "tree": None}
    try:
        out["preflight"] = build._preflight(host, config, kernel, driver_version)
    except errors.MemsaverError as e:
        out["preflight"] = e
        return out
    try:
        out["tree"] = render.plan_tree(config, out["preflight"]["driver"], out["preflight"]["source"])
    except errors.MemsaverError as e:      # our data directory is missing: raised where the tree is rendered
        out["tree"] = e
    return out


def secure_boot(host: Host) -> dict:
    """The Secure Boot section read now (world.secure_boot); a reading that fails is state "unknown" with why."""
    try:
        return world.secure_boot(host)
    except Exception as e:
        return {"state": "unknown", "reason": str(e)}
