"""One world: the host observed once (observe/), decided once (decide/) -- the snapshot every reader and every
door works from, a typed model.World (spark_memsaver/model.py) read by attribute. observe/ and decide/ never
import each other; this module, one layer above both, hands each reading to its verdict:

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


def snapshot(host, config=None):
    """Everything observed (a model.World), with its decided sections. config: the caller's; never reloaded here
    when given."""
    from spark_memsaver.decide import mok as dmok
    from spark_memsaver.observe import snapshot as osnap

    from spark_memsaver.world.tree import tree_problem

    w = osnap.snapshot(host, config)
    w.secure_boot = dmok.section(w.secure_boot)
    w.driver_sources = _decide_sources(host, w.driver_sources)
    for s in w.driver.sources:      # the build's one completeness rule, so status and install's plan see it too
        if s.open:
            s.problem = tree_problem(host, s.path, s.version)
    return w


def secure_boot(host, cert: str | None = None, config=None) -> dict:
    """The ``secure_boot`` section: ``cert`` (--cert) or ``config``'s signing_cert names our certificate; with
    neither, the host's config file does."""
    from spark_memsaver.decide import mok as dmok
    from spark_memsaver.observe import mok as omok

    return dmok.section(omok.read(host, cert, config))


def driver_sources(host, config, driver, kernels, entries: list[dict] | None = None) -> dict:
    """The ``driver_sources`` section alone (``driver``/``kernels``: the world's, or their JSON shape)."""
    from spark_memsaver.observe import sources as osrc

    return _decide_sources(host, osrc.facts(host, config, driver, kernels, entries))


def _decide_sources(host, facts: dict) -> dict:
    from spark_memsaver.decide import sources as dsrc
    from spark_memsaver.observe import sources as osrc

    pkgs = dsrc.packages_to_ask(facts)
    lists = osrc.offered(host, pkgs) if pkgs else {}
    apt_known = lists is not None if pkgs else osrc.apt_options(host) is not None   # nothing to ask: readable?
    return dsrc.section(facts, lists, apt_known)


def observe_for_plan(host, config=None):
    """The snapshot plus what the planner needs that the snapshot does not carry yet: each kernel's
    policy facts (decide/policy.py: ``Kernel.kconfig``) and the build records (``Records.builds``: what the
    installed builds were made with)."""
    from spark_memsaver.decide import ours, policy
    from spark_memsaver.model import ABSENT
    from spark_memsaver.observe import builds as obuilds
    from spark_memsaver.observe import snapshot as osnap
    from spark_memsaver.versions import base_version

    w = snapshot(host, config)
    for k in w.kernels:
        if k.kconfig is ABSENT:
            k.kconfig = policy.kernel_facts(osnap.kernel_config(host, k.release))["kconfig"]
    if w.records.builds is ABSENT:
        builds = {b["kernel"]: b for b in obuilds.read_builds(host)}
        for k in w.kernels:
            sel = k.uvm_selected
            if ours.is_ours(sel) and k.release not in builds:
                meta = obuilds.dkms_meta(host, base_version(sel.version))
                if meta:
                    builds[k.release] = {"kernel": k.release, **meta}
        w.records.builds = list(builds.values())
    return w


def versions_in(w) -> set[str]:
    """The driver versions a world names: each kernel's nvidia.ko and each source tree."""
    from spark_memsaver.versions import base_version

    vs = {base_version(k.nvidia_selected.version) for k in w.kernels if k.nvidia_selected}
    vs |= {s.version for s in w.driver.sources}
    return {v for v in vs if v}


def facts(host, config) -> tuple:
    """(snapshot, support): the planner's snapshot and the manifest's verdict on every driver version in it."""
    from spark_memsaver.world import support

    snap = observe_for_plan(host, config)
    return snap, support.support_for(versions_in(snap), support.source_trees(host, snap))
