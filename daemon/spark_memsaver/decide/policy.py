"""The ONE kernel policy and the ONE tier vocabulary. Pure: no I/O.

Kernel policy (config ``kernels``): which kernels get our nvidia-uvm. The rules are data (``RULES``): the
planner (decide/plan.py), the status verdict (decide/status.py), the DKMS engine's preflight and the
rendered dkms.conf (``BUILD_EXCLUSIVE_ARCH``/``BUILD_EXCLUSIVE_CONFIG``, from :func:`dkms_build_exclusive`)
all read them, so DKMS never skips (exit 77) a build the planner asked for.

- ``64k-only``: arm64 kernels with CONFIG_ARM64_64K_PAGES, where packing saves memory;
- ``all``: every kernel (testing);
- in both, never a PREEMPT_RT kernel: NVIDIA's kernel modules refuse to build there (NVIDIA's own dkms.conf
  excludes it), so a build would only fail.

Tier vocabulary (config ``tier``) -> the module's ``uvm_pt_pack`` value (uvm_patch/src/uvm_pt_pack.h):
- ``leaf``   (3) the default: leaf tables in 4 KiB slots -- the scope the seed project validated on GB10s;
- ``4k-all`` (1) every level in 4 KiB slots -- opt-in, not validated on hardware;
- ``256``    (2) 256 B slots -- opt-in, not validated on hardware.
``4k`` (0.1.0's name of tier 1) is still read, as ``4k-all``, with an info finding saying it was renamed.
"""

from __future__ import annotations

from spark_memsaver.errors import ConfigError

# --- tiers and policy names: spark_memsaver/vocabulary.py (a leaf, so config.py need not import decide/) ---

from spark_memsaver.record import Record
from spark_memsaver.vocabulary import (DEFAULT_TIER, KERNEL_POLICIES, MODULE_TIERS, RENAMED, TIERS,  # noqa: E402,F401
                                       VALIDATED_TIERS, TierInvalid, normalize_tier, tier_renamed, tier_value,
                                       tier_values_text)

# policy -> (arch regex DKMS matches against its arch, CONFIG terms: "SYM" must be y/m, "!SYM" must not be)
RULES = {
    "64k-only": ("^aarch64$", ("CONFIG_ARM64_64K_PAGES", "!CONFIG_PREEMPT_RT")),
    "all": (None, ("!CONFIG_PREEMPT_RT",)),
}
SYMBOLS = ("CONFIG_ARM64", "CONFIG_ARM64_64K_PAGES", "CONFIG_ARM64_16K_PAGES", "CONFIG_ARM64_4K_PAGES",
           "CONFIG_X86_64", "CONFIG_X86", "CONFIG_PREEMPT_RT")


def dkms_build_exclusive(kernels_policy: str) -> dict:
    """The dkms.conf BUILD_EXCLUSIVE values of a policy (rendered by dkms/templates/dkms.conf.j2)."""
    arch, terms = RULES[kernels_policy]
    return {"build_exclusive_arch": arch or "", "build_exclusive_config": " ".join(terms)}


def kernel_facts(kconfig: dict | None) -> dict:
    """What the policy needs from a kernel's configuration (a {CONFIG_X: 'y'} mapping; None = unreadable)."""
    if not kconfig:
        return {"kconfig": None}
    return {"kconfig": {k: kconfig[k] for k in SYMBOLS if k in kconfig}}


def _arch(kc: dict) -> str | None:
    if kc.get("CONFIG_ARM64") == "y":
        return "aarch64"
    if kc.get("CONFIG_X86_64") == "y":
        return "x86_64"
    return None


class PolicyVerdict(Record, frozen=True):
    """Whether our policy builds for a kernel: ``ok``, and when not, ``why`` (one sentence naming the kernel)
    and ``rule`` -- which rule refused: ``preempt-rt``, ``page-size`` or ``config-unreadable``."""
    ok: bool
    why: str = ""
    rule: str = ""


def kernel_of(release: str, kconfig: dict | None) -> dict:
    """A kernel as :func:`verdict` reads it, from its release and its configuration (None: unreadable)."""
    return {"release": release, **kernel_facts(kconfig)}


def verdict(kernel, config) -> PolicyVerdict:
    """Whether our policy builds for this kernel, and why not.

    ``kernel`` is a world's kernel (model.Kernel) or a dict of the same keys: ``release``, ``page_size`` and,
    when observed, ``kconfig`` (the
    :data:`SYMBOLS` of its configuration, ``None`` when unreadable) or ``preempt_rt``. With ``kconfig`` the
    rules are evaluated exactly as DKMS evaluates BUILD_EXCLUSIVE (an unreadable config leaves the CONFIG
    terms unchecked, as DKMS does without a .config). A kernel known only by its configuration (:func:`kernel_of`,
    the DKMS engines' preflight) whose configuration cannot be read is refused by 64k-only with that reason."""
    policy = getattr(config, "kernels", "64k-only")
    if not isinstance(kernel, dict):        # a model.Kernel: its kconfig is absent until world/ gathers it
        kernel = {"release": kernel.release, "page_size": kernel.page_size,
                  **({"kconfig": kernel.kconfig} if kernel.kconfig or kernel.kconfig is None else {})}
    rel = kernel.get("release", "?")
    kc = kernel.get("kconfig")
    rt = kernel.get("preempt_rt")
    if kc is not None:
        rt = kc.get("CONFIG_PREEMPT_RT") in ("y", "m")
    if rt:
        return PolicyVerdict(False, f"kernel {rel} is a PREEMPT_RT kernel; NVIDIA's kernel modules do not build "
                             "for PREEMPT_RT, so spark-memsaver leaves it stock (policy 'kernels: " + policy + "')",
                             "preempt-rt")
    if policy == "all":
        return PolicyVerdict(True)
    ps = kernel.get("page_size")
    if kc is not None:
        arch = _arch(kc)
        if arch == "aarch64" and kc.get("CONFIG_ARM64_64K_PAGES") in ("y", "m"):
            return PolicyVerdict(True)
        what = ("is an arm64 kernel without 64 KiB pages" if arch == "aarch64"
                else f"has {ps // 1024} KiB pages" if ps else "is not an arm64 64 KiB kernel")
        return PolicyVerdict(False, f"kernel {rel} {what}; policy 'kernels: 64k-only' builds only for 64 KiB "
                             "kernels", "page-size")
    if ps == 65536:
        return PolicyVerdict(True)
    if "kconfig" in kernel and "page_size" not in kernel:     # known by its (unreadable) configuration only
        return PolicyVerdict(False, f"kernel {rel} is a kernel whose configuration cannot be read; policy "
                             "'kernels: 64k-only' builds only for arm64 kernels with CONFIG_ARM64_64K_PAGES",
                             "config-unreadable")
    what = f"{ps // 1024} KiB pages" if ps else "an unknown page size"
    return PolicyVerdict(False, f"kernel {rel} has {what}; policy 'kernels: 64k-only' builds only for 64 KiB "
                         "kernels", "page-size")


def kernel_in_policy(kernel, config) -> tuple[bool, str]:
    """:func:`verdict` as (ok, why)."""
    v = verdict(kernel, config)
    return v.ok, v.why


# --- what a build was made with (recorded with it; compared by reconcile) -----------------------

def build_settings(config) -> dict:
    """The configuration that shapes a build: recorded in the build record, compared by reconcile."""
    return {"tier": normalize_tier(config.tier), "tier_value": tier_value(config.tier),
            "kernels": config.kernels}


def settings_changed(recorded: dict | None, config) -> list[str]:
    """What differs between the settings a build was made with and the current config ([] = nothing)."""
    if not recorded:
        return []
    now = build_settings(config)
    out = []
    rt = recorded.get("tier")
    if rt is not None:
        try:
            rt = normalize_tier(rt)
        except ConfigError:
            pass
        if rt != now["tier"]:
            out.append(f"tier {rt} -> {now['tier']}")
    rk = recorded.get("kernels") or recorded.get("kernels_policy")
    if rk is not None and rk != now["kernels"]:
        out.append(f"kernels {rk} -> {now['kernels']}")
    return out
