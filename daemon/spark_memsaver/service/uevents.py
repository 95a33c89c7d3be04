"""Kernel uevents straight from netlink (NETLINK_KOBJECT_UEVENT, multicast group 1), with the socket module
only: the same events pyudev's ``Monitor.from_netlink(source="kernel")`` gives, without libudev and ctypes in
the resident daemon. Works without udevd and in containers. Only datagrams from the kernel (sender port 0)
are read; others are dropped.

``KernelUevents(subsystem)`` has the small part of pyudev's Monitor that service/monitor.py uses:
``fileno()`` and ``poll(timeout=0)`` -> an object with ``sys_name``, ``action``, ``subsystem`` or None.
"""

from __future__ import annotations

import socket

NETLINK_KOBJECT_UEVENT = 15
KERNEL_GROUP = 1
RCVBUF = 256 * 1024


class Uevent:
    __slots__ = ("action", "devpath", "subsystem", "sys_name", "properties")

    def __init__(self, props: dict):
        self.properties = props
        self.action = props.get("ACTION", "")
        self.devpath = props.get("DEVPATH", "")
        self.subsystem = props.get("SUBSYSTEM", "")
        self.sys_name = self.devpath.rsplit("/", 1)[-1]


def parse(data: bytes) -> Uevent | None:
    """One kernel datagram (``ACTION@DEVPATH\\0KEY=VALUE\\0...``) -> Uevent; None when it is not one."""
    parts = data.split(b"\0")
    if not parts or b"@" not in parts[0]:
        return None
    props = {}
    for p in parts[1:]:
        k, sep, v = p.partition(b"=")
        if sep:
            props[k.decode("ascii", "replace")] = v.decode("utf-8", "replace")
    return Uevent(props) if "ACTION" in props and "DEVPATH" in props else None


class KernelUevents:
    def __init__(self, subsystem: str | None = None):
        self.subsystem = subsystem
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                                  NETLINK_KOBJECT_UEVENT)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
            self.sock.bind((0, KERNEL_GROUP))
        except OSError:
            self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def poll(self, timeout=0) -> Uevent | None:
        """The next event of the subsystem, or None when none is queued (never waits)."""
        while True:
            try:
                data, addr = self.sock.recvfrom(16384)
            except (BlockingIOError, InterruptedError):
                return None
            if addr[0] != 0:          # not from the kernel
                continue
            ev = parse(data)
            if ev is None or (self.subsystem and ev.subsystem != self.subsystem):
                continue
            return ev

    def close(self) -> None:
        self.sock.close()
