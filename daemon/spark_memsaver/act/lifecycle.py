"""Compatibility names for callers not yet on act/executor.py (the service's OPERATIONS table).

Everything here goes through :func:`spark_memsaver.act.executor.perform`; new code calls perform itself.
"""

from __future__ import annotations

from spark_memsaver.act.activate import UVM_DEVICE, ActivationFailed, ActivationRefused  # noqa: F401
from spark_memsaver.act.executor import LOCK, dpkg_running, locked, perform  # noqa: F401
from spark_memsaver.act.steps import StepFailed, execute, record_stock, support_for  # noqa: F401


def reconcile(host, config, progress=None, **kw) -> dict:
    return perform("reconcile", host, config, progress=progress, **kw)


def rollback(host, config, reason: str = "requested by the administrator", progress=None, **kw) -> dict:
    return perform("rollback", host, config, progress=progress, reason=reason, **kw)


def activate(host, config, progress=None, **kw) -> dict:
    return perform("activate", host, config, progress=progress, **kw)


def apt_pre_install(host, config, text: str, progress=None) -> dict:
    return perform("apt-pre-install", host, config, progress=progress, text=text)


def build(host, config, progress=None, **kw) -> dict:
    return perform("build", host, config, progress=progress, **kw)


def install(host, config, progress=None, **kw) -> dict:
    return perform("install", host, config, progress=progress, **kw)


def remove(host, config, progress=None, **kw) -> dict:
    return perform("remove", host, config, progress=progress, **kw)
