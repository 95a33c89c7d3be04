"""One world: the host observed once (observe/), decided once (decide/) -- the snapshot every reader and every
door works from. observe/ and decide/ never import each other; this module, one layer above both, hands each
reading to its verdict:

    snapshot(host, config)         observe/snapshot.snapshot, then the two sections that are decided over readings:
                                   "secure_boot" (decide/mok.section over observe/mok.read) and "driver_sources"
                                   (decide/sources.section over observe/sources.facts and APT's lists)
    secure_boot(host, cert, config)  the "secure_boot" section alone (mok status, mok enroll, install's check)
    driver_sources(host, config, driver, kernels)  the "driver_sources" section alone
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
