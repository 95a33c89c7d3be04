"""Ours installed, the stock nvidia-uvm still loaded: what makes ours the loaded one, as act/activate.py decides
it (so Next is what activate would do, never what it refuses). Pure."""

from __future__ import annotations

from spark_memsaver import remedy as rm
from spark_memsaver.decide import ours
from spark_memsaver.versions import base_version


def pending(snap, running) -> tuple[str, str]:
    """(message, remedy) of the ``activation-pending`` finding for the running kernel ``running``."""
    built, loaded = ours.built_for(running.uvm_selected), base_version(snap.driver.loaded_version)
    if built and loaded and built != loaded:     # activate refuses: the driver on disk loads at boot with ours
        return ("Our nvidia-uvm is installed but the stock module is still loaded, beside the running nvidia "
                f"{loaded}.", f"Reboot: nvidia.ko {built} on disk (and our nvidia-uvm for it) loads at boot in place "
                f"of the running {loaded}.")
    act = rm.run("spark-memsaver activate")
    if snap.holders:                              # activate waits for them (its dry run says so): a person first
        users = ", ".join(f"{h.comm}[{h.pid}]" for h in snap.holders)
        return ("Our nvidia-uvm is installed but the stock module is still loaded, and in use.",
                f"Stop the CUDA work holding /dev/nvidia-uvm ({users}), then {act[:1].lower()}{act[1:]}; or reboot.")
    return "Our nvidia-uvm is installed but the stock module is still loaded.", \
        f"{act} (needs /dev/nvidia-uvm unused), or reboot."
