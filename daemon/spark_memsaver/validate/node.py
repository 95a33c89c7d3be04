"""What validate reads of the node before and after a run (and its dry run): identity and nvidia-uvm."""

from __future__ import annotations

import os
import socket


def identity(host) -> dict:
    from spark_memsaver.observe.snapshot import observe_driver, observe_host
    h = observe_host(host)
    drv = observe_driver(host)
    u = os.uname()
    return {"node": socket.gethostname(), "kernel": h["kernel"], "kernel_version": u.version, "arch": h["arch"],
            "page_size": h["page_size"], "nvidia_driver": drv["loaded_version"],
            "nvidia_srcversion": (host.read_text("/sys/module/nvidia/srcversion") or "").strip() or None}


def uvm(host) -> dict:
    from spark_memsaver.observe.snapshot import observe_uvm
    return observe_uvm(host)
