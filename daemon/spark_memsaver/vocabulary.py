"""The configuration's vocabulary: tier names and kernel policies (config ``tier``, ``kernels``). A leaf (layer
0): config.py validates with it, decide/policy.py decides with it (and re-exports every name), so the
configuration never imports decide/. What the rules mean: decide/policy.py's docstring.
"""

from __future__ import annotations

from spark_memsaver.errors import ConfigError

# --- the module's identity ----------------------------------------------------------------------

PATCH_ID = "uvm-pt-pack/1"     # modinfo ``spark_memsaver`` of the module this package builds (decide/ours.py decides
                               # over it; observe/modules.py reads it; the kotool and dkms.conf carry it)

# --- tiers -------------------------------------------------------------------------------------

TIERS = {"leaf": 3, "4k-all": 1, "256": 2}          # config name -> module value
DEFAULT_TIER = "leaf"
VALIDATED_TIERS = ("leaf",)                          # validated on hardware by the seed project
RENAMED = {"4k": "4k-all"}                           # old name -> current name
MODULE_TIERS = {0: "off", 1: "4k-all", 2: "256", 3: "leaf"}   # module value -> the name its counters print


class TierInvalid(ConfigError):
    code = "config-invalid"


def tier_values_text() -> str:
    return ", ".join(TIERS)


def normalize_tier(value) -> str:
    """The current name of a configured tier ('4k' -> '4k-all'; 256 -> '256'); TierInvalid otherwise."""
    v = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if v in TIERS:
        return v
    if v in RENAMED:
        return RENAMED[v]
    raise TierInvalid(f"tier {value!r} is not one of: {tier_values_text()}",
                      remedy=f"Set 'tier:' to one of {tier_values_text()} (leaf is the default).")


def tier_renamed(raw) -> str | None:
    """The note for an old tier name still in a config file, else None."""
    v = str(raw).strip() if raw is not None else None
    if v in RENAMED:
        return (f"config 'tier: {v}' is the old name of '{RENAMED[v]}' (4 KiB slots at every level); "
                f"it keeps working")
    return None


def tier_value(name) -> int:
    """The uvm_pt_pack module value of a tier name (old names accepted)."""
    return TIERS[normalize_tier(name)]


# --- kernel policy -----------------------------------------------------------------------------

KERNEL_POLICIES = ("64k-only", "all")
