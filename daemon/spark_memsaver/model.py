"""The typed world: what observe/ reads about a host, as records (record.py; one class per section), not nested dicts.

observe/snapshot.snapshot builds a :class:`World`; world/ adds the sections decided over readings (``secure_boot``,
``driver_sources``) and the planner's facts (each kernel's ``kconfig``, ``records.builds``); decide/, report/ and
act/ read it by attribute. A leaf module (no import of observe/, decide/ or anything above), so that observe/ and
decide/ both import it.

``World.as_json()`` renders the snapshot's JSON shape -- the one it had as a dict, key for key and in that order --
and ``World.from_json(d)`` parses that shape back (test fixtures written as dicts, a snapshot kept as JSON). A key
missing from the input takes its default (older documents, partial fixtures); a key that is not a field, or a value
of the wrong type, raises :class:`errors.WorldInvalid` naming where. Sections that are free-form by nature are
plain dict fields and say so: module parameters, the packing counters, the records' bodies (validated by
host/records.py), the decided ``secure_boot`` and ``driver_sources`` sections, the hazards' inputs.
"""

from __future__ import annotations

from spark_memsaver.errors import WorldInvalid
from spark_memsaver.record import MISSING, Record, field


class _Absent:
    """A key absent from the JSON shape (not the same as null): falsy, like None, for readers."""
    __slots__ = ()

    def __bool__(self):
        return False

    def __repr__(self):
        return "ABSENT"


ABSENT = _Absent()

# field kinds: a scalar kind (a tuple of accepted types, None included where null is allowed), a Section class
# (a nested object), (Class, None) (the object or null), [Class] (a list of them)
_STR, _STR_N, _INT_N, _BOOL, _BOOL_N = (str,), (str, type(None)), (int, type(None)), (bool,), (bool, type(None))
_NUM_N, _DICT, _DICT_N, _LIST = (int, float, type(None)), (dict,), (dict, type(None)), (list,)
_ANY = None


class Section(Record):
    """Base of the world's classes: JSON in and out by a per-class table of field kinds (``_KINDS``)."""
    __slots__ = ()
    _KINDS = {}

    def as_json(self) -> dict:
        out = {}
        for k in self._FIELDS:
            v = getattr(self, k)
            if v is not ABSENT:
                out[k] = _out(v)
        return out

    # keyword arguments only; one __init__, __eq__ and __repr__ for every class (record.py: no code generation)
    def __init__(self, **values):
        specs = self._SPECS
        for k in self._FIELDS:
            if k in values:
                setattr(self, k, values.pop(k))
            else:
                spec = specs[k]
                setattr(self, k, spec.default if spec.factory is MISSING else spec.factory())
        if values:
            raise TypeError(f"{type(self).__name__}: unknown field {next(iter(values))!r}")

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self._KINDS)

    __hash__ = None     # mutable, compared by value

    def __repr__(self):
        return f"{type(self).__name__}(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self._KINDS) + ")"

    @classmethod
    def from_json(cls, d, where: str = ""):
        where = where or cls.__name__.lower()
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise WorldInvalid(f"{where}: expected an object, got {type(d).__name__}")
        names = set(cls._FIELDS)
        extra = sorted(set(d) - names, key=str)
        if extra:
            raise WorldInvalid(f"{where}: unknown key {extra[0]!r}")
        return cls(**{k: _parse(cls._KINDS[k], v, f"{where}.{k}") for k, v in d.items()})


def _out(v):
    if isinstance(v, Section):
        return v.as_json()
    if isinstance(v, list):
        return [_out(x) for x in v]
    if isinstance(v, dict):
        return {k: _out(x) for k, x in v.items()}
    return v


def _parse(kind, v, where):
    if kind is _ANY:
        return v
    if isinstance(kind, list):
        if not isinstance(v, list):
            raise WorldInvalid(f"{where}: expected a list, got {type(v).__name__}")
        return [_parse(kind[0], x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(kind, tuple) and kind and isinstance(kind[0], type) and issubclass(kind[0], Section):
        return None if v is None else kind[0].from_json(v, where)        # (Class, None): the object or null
    if isinstance(kind, type) and issubclass(kind, Section):
        return kind.from_json(v, where)
    if not isinstance(v, kind) or (isinstance(v, bool) and bool not in kind):
        want = " or ".join("null" if t is type(None) else t.__name__ for t in kind)
        raise WorldInvalid(f"{where}: expected {want}, got {type(v).__name__}")
    return v


class Host(Section):
    """The running kernel's release, the machine and its page size (None where a root cannot tell)."""
    kernel: str | None = None
    arch: str | None = None
    page_size: int | None = None
    _KINDS = {"kernel": _STR_N, "arch": _STR_N, "page_size": _INT_N}


class ModuleSelection(Section):
    """The module file modprobe selects for a kernel (observe/modules.describe): ``state`` is ours | patched |
    stock | builtin | unreadable; ``patched`` is "carries a packing patch" (None when unreadable)."""
    path: str | None = None
    version: str | None = None
    srcversion: str | None = None
    vermagic: str | None = None
    signer: str | None = None
    sig_key: str | None = None         # modinfo's sig_key: the signing certificate's serial (or key id)
    depends: list = field(default_factory=list)
    patched: bool | None = False
    patch_id: str | None = None
    ours: bool | None = False
    state: str | None = None
    error: str | None = None
    _KINDS = {"path": _STR_N, "version": _STR_N, "srcversion": _STR_N, "vermagic": _STR_N, "signer": _STR_N,
              "sig_key": _STR_N, "depends": _LIST, "patched": _BOOL_N, "patch_id": _STR_N, "ours": _BOOL_N,
              "state": _STR_N, "error": _STR_N}


class Kernel(Section):
    """An installed kernel and which nvidia-uvm / nvidia modprobe selects for it (None: not found). ``kconfig``
    (free-form {CONFIG_X: value}, None when unreadable) is the planner's, absent until world/ adds it."""
    release: str = ""
    running: bool = False
    page_size: int | None = None
    headers: bool = False
    uvm_selected: ModuleSelection | None = None
    nvidia_selected: ModuleSelection | None = None
    kconfig: dict | None = ABSENT
    _KINDS = {"release": _STR, "running": _BOOL, "page_size": _INT_N, "headers": _BOOL,
              "uvm_selected": (ModuleSelection, None), "nvidia_selected": (ModuleSelection, None), "kconfig": _DICT_N}


class DriverSource(Section):
    """An NVIDIA source tree: /usr/src (``origin`` absent) or the source cache (``origin`` "cache")."""
    version: str = ""
    path: str = ""
    open: bool = True
    origin: str = ABSENT
    problem: str | None = None      # why it is not a complete tree to build from (world/tree.tree_problem), or None
    _KINDS = {"version": _STR, "path": _STR, "open": _BOOL, "origin": _STR, "problem": _STR_N}


class Driver(Section):
    """The loaded nvidia module's version and the driver source trees."""
    loaded_version: str | None = None
    sources: list[DriverSource] = field(default_factory=list)
    _KINDS = {"loaded_version": _STR_N, "sources": [DriverSource]}


class Uvm(Section):
    """The loaded nvidia_uvm. ``parameters`` (name -> value) and ``packing`` (the pool's counters, observe/
    counters.parse_stats, or {"error": ...}) are free-form dicts."""
    loaded: bool = False
    version: str | None = None
    srcversion: str | None = None
    patched: bool = False
    parameters: dict = field(default_factory=dict)
    packing: dict | None = None
    _KINDS = {"loaded": _BOOL, "version": _STR_N, "srcversion": _STR_N, "patched": _BOOL, "parameters": _DICT,
              "packing": _DICT_N}


class Holder(Section):
    """A process with /dev/nvidia-uvm open."""
    pid: int = 0
    comm: str = ""
    _KINDS = {"pid": (int,), "comm": _STR}


class Program(Section):
    """A program the safety paths run that is not installed here (observe/programs.py), and its Debian package."""
    name: str = ""
    package: str = ""
    _KINDS = {"name": _STR, "package": _STR}


class DkmsBuild(Section):
    """A build of a registered version for one kernel and arch: built, and installed into the kernel's tree."""
    kernel: str = ""
    arch: str = ""
    built: bool = False
    installed: bool = False
    _KINDS = {"kernel": _STR, "arch": _STR, "built": _BOOL, "installed": _BOOL}


class Registration(Section):
    """One version of our module registered with DKMS, and its builds."""
    module: str = ""
    version: str = ""
    source_present: bool = False
    builds: list[DkmsBuild] = field(default_factory=list)
    _KINDS = {"module": _STR, "version": _STR, "source_present": _BOOL, "builds": [DkmsBuild]}


class Dkms(Section):
    """Whether dkms is installed, and our module's registrations in its tree."""
    available: bool = True
    registrations: list[Registration] = field(default_factory=list)
    _KINDS = {"available": _BOOL, "registrations": [Registration]}


class Memory(Section):
    """Bytes: MemTotal, MemAvailable, MemFree, free blocks by size, and the pool's page-table figures (None when
    not known)."""
    total: int | None = None
    available: int | None = None
    pagetable_backing: int | None = None
    pagetable_stock_equivalent: int | None = None
    saved: int | None = None
    free: int | None = None                  # MemFree: what CUDA sees free on GB10
    free_blocks: list | None = None          # [{size_bytes, count}] from /proc/buddyinfo, all zones
    _KINDS = {"total": _INT_N, "available": _INT_N, "pagetable_backing": _INT_N,
              "pagetable_stock_equivalent": _INT_N, "saved": _INT_N, "free": _INT_N,
              "free_blocks": (list, type(None))}


class Records(Section):
    """The operations' records, read and validated by host/records.py: each body a free-form dict of its kind's
    fields. ``builds`` (what the installed builds were made with) is the planner's, absent until world/ adds it."""
    intents: list[dict] = field(default_factory=list)
    rollbacks: list[dict] = field(default_factory=list)
    holds: list[dict] = field(default_factory=list)
    last_validation: dict | None = None
    unreadable: list = field(default_factory=list)
    quarantined: list = field(default_factory=list)
    builds: list[dict] = ABSENT
    _KINDS = {"intents": _LIST, "rollbacks": _LIST, "holds": _LIST, "last_validation": _DICT_N,
              "unreadable": _LIST, "quarantined": _LIST, "builds": _LIST}


class Guard(Section):
    """The load-time guard's newest refusal of our module in this boot (observe/guardlog.parse), or None."""
    ours_load_failed: dict | None = None
    _KINDS = {"ours_load_failed": _DICT_N}


class World(Section):
    """The host, observed once. ``secure_boot`` is observe/'s reading (efi/mokvars.MokReading) until world/
    replaces it with decide/mok.section's dict; ``driver_sources`` likewise (observe/sources.facts, then
    decide/sources.section); ``hazard_inputs`` is observe/snapshot.observe_hazard_inputs's dict -- all three
    free-form."""
    host: Host = field(default_factory=Host)
    driver: Driver = field(default_factory=Driver)
    uvm: Uvm = field(default_factory=Uvm)
    kernels: list[Kernel] = field(default_factory=list)
    dkms: Dkms = field(default_factory=Dkms)
    secure_boot: object = field(default_factory=dict)
    holders: list[Holder] = field(default_factory=list)
    memory: Memory = field(default_factory=Memory)
    records: Records = field(default_factory=Records)
    driver_sources: object = None
    hazard_inputs: dict | None = None
    guard: Guard = field(default_factory=Guard)
    unknown: list[str] = field(default_factory=list)
    programs_missing: list[Program] = field(default_factory=list)
    observed_in_s: float | None = None
    _KINDS = {"host": Host, "driver": Driver, "uvm": Uvm, "kernels": [Kernel], "dkms": Dkms, "secure_boot": _ANY,
              "holders": [Holder], "memory": Memory, "records": Records, "driver_sources": _ANY,
              "hazard_inputs": _DICT_N, "guard": Guard, "unknown": [_STR],
              "programs_missing": [Program], "observed_in_s": _NUM_N}

    def kernel(self, release: str | None) -> Kernel | None:
        """The installed kernel ``release``, or None."""
        return next((k for k in self.kernels if k.release == release), None)

    def running(self) -> Kernel | None:
        """The running kernel's entry (None on an image root or when it has no modules directory)."""
        return self.kernel(self.host.kernel) if self.host.kernel else None


def world_of(snap) -> World:
    """``snap`` as a World: a World as it is, its JSON shape (a dict) parsed."""
    return snap if isinstance(snap, World) else World.from_json(snap, "snapshot")
