"""One world: the host observed once (observe/), decided once (decide/) -- the snapshot every reader and every
door works from. observe/ and decide/ never import each other; this module, one layer above both, hands each
reading to its verdict:

    snapshot(host, config)         observe/snapshot.snapshot, then the two sections that are decided over readings:
                                   "secure_boot" (decide/mok.section over observe/mok.read) and "driver_sources"
                                   (decide/sources.section over observe/sources.facts and APT's lists)
    secure_boot(host, cert, config)  the "secure_boot" section alone (mok status, mok enroll, install's check)
    driver_sources(host, config, driver, kernels)  the "driver_sources" section alone
    observe_for_plan(host, config)  snapshot(), with each kernel's policy facts and the build records
    facts(host, config)            (observe_for_plan, the manifest's verdict on each driver in it: world/support.py):
                                   what status, install and reconcile decide from, so they cannot disagree

The status readers (cli status/metrics, the daemon's status process, report/document.status_of) come here, never
to act/ (tests/test_layers.py); act/installable.py takes the same facts for the doors that act.
"""

from __future__ import annotations


def snapshot(host, config=None) -> dict:
    """Everything observed, with its decided sections. config: the caller's; never reloaded here when given."""
    from spark_memsaver.decide import mok as dmok
    from spark_memsaver.observe import snapshot as osnap

    snap = osnap.snapshot(host, config)
    snap["secure_boot"] = dmok.section(snap["secure_boot"])
    snap["driver_sources"] = _decide_sources(host, snap["driver_sources"])
    return snap


def secure_boot(host, cert: str | None = None, config=None) -> dict:
    """The ``secure_boot`` section: ``cert`` (--cert) or ``config``'s signing_cert names our certificate; with
    neither, the host's config file does."""
    from spark_memsaver.decide import mok as dmok
    from spark_memsaver.observe import mok as omok

    return dmok.section(omok.read(host, cert, config))


def driver_sources(host, config, driver: dict, kernels: list[dict], entries: list[dict] | None = None) -> dict:
    from spark_memsaver.observe import sources as osrc

    return _decide_sources(host, osrc.facts(host, config, driver, kernels, entries))


def _decide_sources(host, facts: dict) -> dict:
    from spark_memsaver.decide import sources as dsrc
    from spark_memsaver.observe import sources as osrc

    pkgs = dsrc.packages_to_ask(facts)
    lists = osrc.offered(host, pkgs) if pkgs else {}
    apt_known = lists is not None if pkgs else osrc.apt_options(host) is not None   # nothing to ask: readable?
    return dsrc.section(facts, lists, apt_known)


def observe_for_plan(host, config=None) -> dict:
    """The snapshot plus what the planner needs that the snapshot does not carry yet: each kernel's
    policy facts (decide/policy.py) and the build records (what the installed builds were made with)."""
    from spark_memsaver.decide import policy
    from spark_memsaver.observe import builds as obuilds
    from spark_memsaver.observe import snapshot as osnap
    from spark_memsaver.versions import base_version

    snap = snapshot(host, config)
    for k in snap.get("kernels", []):
        if "kconfig" not in k:
            k.update(policy.kernel_facts(osnap.kernel_config(host, k["release"])))
    recs = snap.setdefault("records", {})
    if "builds" not in recs:
        builds = {b["kernel"]: b for b in obuilds.read_builds(host)}
        for k in snap.get("kernels", []):
            sel = k.get("uvm_selected") or {}
            if sel.get("patched") and k["release"] not in builds:
                meta = obuilds.dkms_meta(host, base_version(sel.get("version")))
                if meta:
                    builds[k["release"]] = {"kernel": k["release"], **meta}
        recs["builds"] = list(builds.values())
    return snap


def versions_in(snap: dict) -> set[str]:
    from spark_memsaver.versions import base_version

    vs = {base_version((k.get("nvidia_selected") or {}).get("version")) for k in snap.get("kernels", [])}
    vs |= {s.get("version") for s in (snap.get("driver") or {}).get("sources", [])}
    return {v for v in vs if v}


def facts(host, config) -> tuple[dict, dict]:
    """(snapshot, support): the planner's snapshot and the manifest's verdict on every driver version in it."""
    from spark_memsaver.world import support

    snap = observe_for_plan(host, config)
    return snap, support.support_for(versions_in(snap), support.source_trees(host, snap))
