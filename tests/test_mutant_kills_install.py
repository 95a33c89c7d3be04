"""decide/installability.py: what a mutation run in full (tools/mutation-run, issue 29 item 3) found unguarded
by the fast tests. Each test pins, through installability() on a Spark-shaped snapshot, one answer that
status, install and reconcile give a user (the code, the sentence, the exact remedy) and names the mutants it
kills."""

from __future__ import annotations

import pytest

from spark_memsaver.config import Config
from spark_memsaver.decide.installability import installability
from tests.test_installability import DRV, K, _pure_snap
from tests.support.worlds import typed

installability = typed(installability)   # dict snapshots -> model.World (tests/support/worlds.py)


def _decide(snap, support=None):
    return installability(snap, Config(), {DRV: {"supported": True, "qualification": "compile-verified"}}
                          if support is None else support, K)


def test_enrolled_key_installs_with_nothing_left_to_do():
    """Secure Boot enforcing with our key enrolled: installable, and no 'then' step (the module loads) (kills:
    'enrolled' dropped from the loadable states)."""
    s = _pure_snap(K, sources=[DRV])
    s["secure_boot"] = {"state": "enrolled", "reason": "our key is enrolled"}
    d = _decide(s)
    assert (d["can_install"], d["missing"], d["then"]) == (True, [], []), d
    assert d["qualification"] == "compile-verified" and d["driver"] == DRV


@pytest.mark.parametrize("state,phrase", [
    ("no-key", "there is no signing key"),
    ("not-enrolled", "the signing key is not enrolled"),
    ("pending-enroll", "the signing key's enrollment waits for the console at the next boot"),
    ("pending-delete", "the signing key is being deleted at the next boot"),
    ("blocked", "the firmware blocks the signing key"),
    ("some-new-state", "the signing key is some new state"),
])
def test_untrusted_key_is_said_as_a_sentence_under_then(state, phrase):
    """Each MOK state reads as its own sentence in the 'then' step (install proceeds, the key must then be
    trusted) (kills: each KEY_PHRASES key and text, the fallback's wording)."""
    s = _pure_snap(K, sources=[DRV])
    s["secure_boot"] = {"state": state, "reason": "MokListRT read"}
    d = _decide(s)
    assert d["can_install"] and d["missing"] == []
    (t,) = d["then"]
    assert t["code"] == f"mok-{state}" and t["what"] == "signing-key"
    assert t["detail"] == (f"Secure Boot is enforcing and {phrase} (MokListRT read): the module will not load "
                           "until the key is trusted")


def test_no_nvidia_ko_for_the_kernel_names_the_modules_package():
    """No nvidia.ko for K (the driver is loaded for another kernel): missing 'nvidia-ko-missing' with the exact
    Ubuntu package of that driver for K, or Debian's headers (kills: the code table's 'driver' entry)."""
    s = _pure_snap(K, sources=[DRV])
    s["kernels"][0]["nvidia_selected"] = None
    d = _decide(s)
    assert not d["can_install"] and [m["code"] for m in d["missing"]] == ["nvidia-ko-missing"], d
    m = d["missing"][0]
    assert m["what"] == "driver" and m["detail"] == (f"no nvidia.ko is installed for kernel {K}, so there is no "
                                                      "driver to build against")
    assert m["remedy"] == (
        f"Install the NVIDIA 580 driver's kernel modules for kernel {K}: 'sudo apt-get install "
        f"linux-modules-nvidia-580-open-{K}' (Ubuntu, precompiled), or on Debian 'sudo apt-get install "
        f"linux-headers-{K}' (nvidia-open-kernel-dkms then builds nvidia.ko for it).")


def test_no_dkms_is_missing_with_its_install_command():
    """Without dkms nothing can be built: missing 'dkms-missing', remedy 'sudo apt-get install dkms' (kills:
    the code table's 'dkms' entry)."""
    s = _pure_snap(K, sources=[DRV])
    s["dkms"] = {"available": False, "registrations": []}
    d = _decide(s)
    assert not d["can_install"] and d["missing"] == [{
        "what": "dkms", "code": "dkms-missing", "detail": "dkms is not installed, so nothing can be built",
        "remedy": "sudo apt-get install dkms"}], d


def test_ubuntu_server_flavour_gets_its_own_packages_named():
    """An Ubuntu server-flavour node (nvidia.ko in kernel/nvidia-580srv-open/) is told the -server packages:
    the source to look for, and the modules package for a kernel without nvidia.ko (kills: _server's and
    _source_package's reads of the nvidia.ko path)."""
    k2 = "6.14.0-1020-nvidia-64k"
    s = _pure_snap(K, k2)
    for k in s["kernels"]:
        k["nvidia_selected"]["path"] = f"/lib/modules/{k['release']}/kernel/nvidia-580srv-open/nvidia.ko"
    d = _decide(s)
    (m,) = d["missing"]
    assert m["code"] == "driver-source-missing"
    assert "'apt-cache policy nvidia-kernel-source-580-server-open'" in m["remedy"], m
    assert "'sudo apt-get install nvidia-kernel-source-580-server-open=VERSION'" in m["remedy"]
    s["kernels"][0]["nvidia_selected"] = None
    d = _decide(s)
    assert [x["code"] for x in d["missing"]] == ["nvidia-ko-missing"], d
    assert f"'sudo apt-get install linux-modules-nvidia-580-server-open-{K}'" in d["missing"][0]["remedy"]


def test_no_source_remedy_is_the_whole_search_recipe():
    """No tree and nothing known about APT: the remedy is the full recipe a user follows (list the versions,
    update first if none matches, install that exact one; Debian's package named) (kills: its wording)."""
    d = _decide(_pure_snap(K))
    (m,) = d["missing"]
    pkg = "nvidia-kernel-source-580-open"
    assert m["remedy"] == (
        f"Install the NVIDIA open kernel-module source of exactly {DRV}: 'apt-cache policy {pkg}' lists the "
        f"versions APT knows (run 'sudo apt-get update' first if none begins with {DRV}-); install that one with "
        f"'sudo apt-get install {pkg}=VERSION' (Debian: 'apt-cache policy nvidia-open-kernel-dkms').")


def test_no_driver_anywhere_asks_for_the_driver_first():
    """No nvidia.ko for any kernel, none loaded, no source: the remedy asks for the driver's modules, naming
    no branch it cannot know (kills: that remedy's wording)."""
    s = _pure_snap(K)
    s["driver"] = {"loaded_version": None, "sources": []}
    s["kernels"][0]["nvidia_selected"] = None
    d = _decide(s)
    assert [(m["code"], m["remedy"]) for m in d["missing"]] == [
        ("nvidia-ko-missing", "Install the NVIDIA open driver's kernel modules for this kernel first.")], d


@pytest.mark.parametrize("where", ["other-kernel", "source-tree"])
def test_missing_nvidia_ko_names_the_branch_the_host_has_elsewhere(where):
    """No nvidia.ko for K and none loaded: the remedy names the modules package of the driver this host has
    elsewhere (another kernel's nvidia.ko, else an installed source tree) (kills: _known_driver's reads)."""
    k2 = "6.14.0-1020-nvidia-64k"
    s = _pure_snap(K, k2, nv="590.48.01", sources=["590.48.01"] if where == "source-tree" else [])
    s["driver"]["loaded_version"] = None
    s["kernels"][0]["nvidia_selected"] = None
    if where == "source-tree":
        s["kernels"][1]["nvidia_selected"] = None
    d = _decide(s)
    assert [m["code"] for m in d["missing"]] == ["nvidia-ko-missing"], d
    assert f"'sudo apt-get install linux-modules-nvidia-590-open-{K}'" in d["missing"][0]["remedy"]


def test_policy_refusals_say_nothing_is_broken_and_what_would_pack():
    """A kernel the policy leaves stock: the remedy says nothing is broken and what would change it: no
    PREEMPT_RT kernel (under either policy), or 64 KiB pages (kills: the rule test and both wordings)."""
    rt = ("Nothing is broken: the stock nvidia-uvm stays in use on this kernel. NVIDIA's modules do not build for "
          "PREEMPT_RT; boot a kernel without PREEMPT_RT to use packing.")
    for kernels in ("64k-only", "all"):
        s = _pure_snap(K, sources=[DRV])
        s["kernels"][0]["kconfig"] = {"CONFIG_ARM64": "y", "CONFIG_ARM64_64K_PAGES": "y", "CONFIG_PREEMPT_RT": "y"}
        d = installability(s, Config(kernels=kernels), {DRV: {"supported": True}}, K)
        assert [(m["code"], m["remedy"]) for m in d["missing"]] == [("kernel-outside-policy", rt)], d
    s = _pure_snap(K, sources=[DRV])
    s["kernels"][0]["page_size"] = 4096
    d = _decide(s)
    assert [(m["code"], m["remedy"]) for m in d["missing"]] == [(
        "kernel-outside-policy", "Nothing to do: packing saves memory only on arm64 kernels with 64 KiB pages; "
        "this kernel stays on the stock nvidia-uvm.")], d


def test_a_broken_local_tree_is_corrupt_with_the_exact_reinstall():
    """/usr/src/nvidia-<drv> that is no open tree: 'driver-source-corrupt' naming the path, and the exact
    reinstall command when APT knows the package and version, the search recipe otherwise (kills: that
    entry's what, code and wording)."""
    s = _pure_snap(K)
    s["driver"]["sources"] = [{"version": DRV, "path": f"/usr/src/nvidia-{DRV}", "open": False}]
    s["driver_sources"] = {"mode": "auto", "by_driver": {DRV: {"present": False, "path": None,
                                                                "package": "nvidia-kernel-source-580-open",
                                                                "deb_version": f"{DRV}-0ubuntu1", "in_lists": True,
                                                                "fetchable": True}}}
    d = _decide(s)
    assert d["missing"] == [{
        "what": "driver-source", "code": "driver-source-corrupt",
        "detail": f"/usr/src/nvidia-{DRV} is not an open kernel-module tree (no nvidia-uvm/ or Kbuild)",
        "remedy": f"Reinstall it: 'sudo apt-get install --reinstall nvidia-kernel-source-580-open={DRV}-0ubuntu1'."}]
    assert not d["can_install"] and not d["needs_fetch"] and d["fetch"] is None
    s["driver_sources"]["by_driver"][DRV]["deb_version"] = None       # a package without a version: no command
    assert _decide(s)["missing"][0]["remedy"].startswith("Install the NVIDIA open kernel-module source of exactly")
    del s["driver_sources"]
    (m,) = _decide(s)["missing"]
    assert m["code"] == "driver-source-corrupt" and m["remedy"].startswith(
        f"Install the NVIDIA open kernel-module source of exactly {DRV}: 'apt-cache policy ")


def _src(**entry):
    e = {"present": False, "path": None, "package": None, "deb_version": None, "in_lists": False,
         "fetchable": False}
    e.update(entry)
    return e


@pytest.mark.parametrize("apt,entry,why", [
    ("ok", None, "APT's lists could not be read here, so whether it can be fetched is not known"),
    ("unknown", _src(), "APT's lists could not be read here, so whether it can be fetched is not known"),
    ("ok", _src(package="nvidia-kernel-source-580-open", deb_version=f"{DRV}-1", in_lists=True),
     f"nvidia-kernel-source-580-open {DRV}-1 is in the APT lists but source_fetch is 'never'"),
    ("ok", _src(package="nvidia-kernel-source-580-open", deb_version=f"{DRV}-1"),
     f"nvidia-kernel-source-580-open {DRV}-1 is not in the APT lists"),
    ("ok", _src(), f"no package of the APT lists carries {DRV}'s source"),
    # a package without a version (or the reverse) names nothing installable
    ("unknown", _src(package="nvidia-kernel-source-580-open"),
     "APT's lists could not be read here, so whether it can be fetched is not known"),
    ("ok", _src(package="nvidia-kernel-source-580-open"), f"no package of the APT lists carries {DRV}'s source"),
])
def test_a_missing_source_says_why_it_cannot_be_fetched(apt, entry, why):
    """No tree of the driver: the detail says it is not installed and why it cannot be fetched (the lists
    unreadable, fetching off, not in the lists, no package carries it) (kills: each reason's test and wording)."""
    s = _pure_snap(K, by_driver={} if entry is None else {DRV: entry})
    s["driver_sources"].update(apt=apt, mode="never")
    (m,) = _decide(s)["missing"]
    assert (m["what"], m["code"]) == ("driver-source", "driver-source-missing")
    assert m["detail"] == (f"the NVIDIA open kernel-module source of {DRV} is not installed (no /usr/src/nvidia-{DRV})"
                           f"; {why}"), m


def test_a_present_tree_or_cache_entry_needs_nothing():
    """A tree known to the source observer (present, with its path) is enough: nothing missing, nothing to
    fetch (kills: the present/path test)."""
    s = _pure_snap(K, by_driver={DRV: _src(present=True, path=f"/var/cache/spark-memsaver/sources/{DRV}")})
    d = _decide(s)
    assert (d["can_install"], d["needs_fetch"], d["missing"], d["fetch"]) == (True, False, [], None), d
    s = _pure_snap(K, by_driver={DRV: _src(present=True)})           # present without a path: not usable
    assert [m["code"] for m in _decide(s)["missing"]] == ["driver-source-missing"]


def test_an_unreadable_nvidia_selection_says_why():
    """modprobe's selection of nvidia.ko for K could not be read: the 'nvidia-ko-missing' detail carries the
    reason, so the user can tell a broken module tree from a missing driver (kills: the error's read and
    wording)."""
    s = _pure_snap(K, sources=[DRV])
    s["kernels"][0]["nvidia_selected"] = {"error": "modinfo: nvidia.ko: Exec format error"}
    (m,) = _decide(s)["missing"]
    assert m["code"] == "nvidia-ko-missing" and m["detail"] == (
        f"no nvidia.ko is installed for kernel {K} (the selection cannot be read: modinfo: nvidia.ko: Exec format "
        "error), so there is no driver to build against")


def test_an_unknown_kernel_names_the_installed_ones():
    """A kernel that is not installed: only that is said, with the kernels that are (sorted), or 'none'
    (kills: the detail's wording)."""
    k2 = "6.14.0-1020-nvidia-64k"
    d = installability(_pure_snap(k2, K), Config(), {}, "9.9.9-nope")
    assert d["missing"] == [{
        "what": "kernel", "code": "unknown-kernel",
        "detail": f"kernel 9.9.9-nope is not installed (no /lib/modules/9.9.9-nope); installed kernels: {K}, {k2}",
        "remedy": f"Name an installed kernel with --kernel: {K}, {k2} (e.g. 'spark-memsaver status' lists them)."}]
    s = _pure_snap(K)
    s["kernels"] = []
    (m,) = installability(s, Config(), {}, K)["missing"]
    assert m["detail"].endswith("; installed kernels: none") and m["remedy"].startswith("No kernel is installed")


def test_an_unlisted_driver_without_its_source_is_content_pending():
    """A driver the manifest does not list by version, its tree absent and not fetchable: qualification
    'content-pending' (its content decides once the source is there), the source missing (kills: that
    branch's qualification)."""
    unchecked = {"supported": False, "reason": "not in the manifest", "content_unchecked": True}
    d = _decide(_pure_snap(K, by_driver={DRV: _src(package="nvidia-kernel-source-580-open",
                                                   deb_version=f"{DRV}-1")}), {DRV: unchecked})
    assert (d["qualification"], d["needs_fetch"], d["fetch"]) == ("content-pending", False, None), d
    assert [m["code"] for m in d["missing"]] == ["driver-source-missing"]
    assert d["missing"][0]["detail"].endswith(
        f"is not in the APT lists; NVIDIA {DRV} is not in this release's patch manifest by version, so its source "
        "decides (by the content of the files the patch touches)")


def test_an_unsupported_driver_says_nothing_is_broken_and_to_update():
    """A driver the manifest refuses (checked by content, drifted): missing 'driver-unsupported' with the
    manifest's reason (or a generic one) and the remedy to update spark-memsaver (kills: the reason's read,
    the fallback and the remedy's wording)."""
    remedy = ("Nothing is broken: the stock nvidia-uvm is in use. Update spark-memsaver to a release that supports "
              f"NVIDIA {DRV} ('spark-memsaver patch list' shows the versions this one knows); the patch then comes "
              "back by itself.")
    d = _decide(_pure_snap(K, sources=[DRV]), {DRV: {"supported": False, "reason": "hooked files drifted"}})
    assert d["missing"] == [{"what": "manifest", "code": "driver-unsupported", "detail": "hooked files drifted",
                             "remedy": remedy}]
    d = _decide(_pure_snap(K, sources=[DRV]), {DRV: {"supported": False}})
    assert d["missing"][0]["detail"] == f"driver {DRV} is not supported by this spark-memsaver release"
    d = _decide(_pure_snap(K, sources=[DRV]), {})
    assert d["missing"][0]["detail"] == f"driver {DRV} is not in the patch manifest"


def test_missing_headers_name_the_build_directory():
    """No headers for K: the detail names /lib/modules/K/build, the remedy the package (kills: the wording)."""
    s = _pure_snap(K, sources=[DRV])
    s["kernels"][0]["headers"] = False
    assert _decide(s)["missing"] == [{
        "what": "headers", "code": "headers-missing",
        "detail": f"kernel headers for {K} are not installed (/lib/modules/{K}/build)",
        "remedy": f"sudo apt-get install linux-headers-{K}"}]


@pytest.mark.parametrize("flavour", ["", "srv"])
def test_an_odd_driver_version_still_names_its_branch_package(flavour):
    """A driver version of a form the source table does not know (four parts, a local build): the remedy
    still names the branch's source package, server flavour included (kills: the fallback's branch and
    package names)."""
    odd = "580.142.01.1"
    s = _pure_snap(K, nv=odd)
    s["kernels"][0]["nvidia_selected"]["path"] = f"/lib/modules/{K}/kernel/nvidia-580{flavour}-open/nvidia.ko"
    d = installability(s, Config(), {odd: {"supported": True}}, K)
    pkg = f"nvidia-kernel-source-580{'-server' if flavour else ''}-open"
    (m,) = d["missing"]
    assert m["code"] == "driver-source-missing" and f"'apt-cache policy {pkg}'" in m["remedy"], m


def test_secure_boot_unknown_blocks_with_the_reason_and_its_fix():
    """Secure Boot state unreadable: installing is refused ('secure-boot-unknown') with the observer's reason
    (or 'it was not observed') and its remedy (or the generic one naming efivarfs) (kills: the detail's and the
    remedy's wording and fallbacks)."""
    s = _pure_snap(K, sources=[DRV])
    s["secure_boot"] = {"state": "unknown", "reason": "efivarfs is not mounted", "remedy": "sudo mount efivarfs"}
    assert _decide(s)["missing"] == [{
        "what": "secure-boot", "code": "secure-boot-unknown",
        "detail": "Secure Boot / MOK state is unknown: efivarfs is not mounted; a module installed now might not load",
        "remedy": "sudo mount efivarfs"}]
    s["secure_boot"] = {}
    (m,) = _decide(s)["missing"]
    assert m["detail"] == ("Secure Boot / MOK state is unknown: it was not observed; a module installed now might "
                           "not load")
    assert m["remedy"] == (
        "Installing is refused until the state can be read. Check that efivarfs is mounted (sudo mount -t efivarfs "
        "efivarfs /sys/firmware/efi/efivars) and readable; run 'spark-memsaver mok status' for the reason.")


def test_the_then_step_says_how_to_get_the_key_trusted():
    """The 'then' step's remedy: after installing, enroll (no key yet, or not enrolled); for a pending or
    blocked key the MOK verdict's own remedy, else the enrollment steps (kills: signing_remedy's states and
    wording)."""
    enroll = ("run 'sudo spark-memsaver mok enroll', then reboot with a person at the console and confirm the key "
              "in MokManager: our module becomes active by itself at that boot")
    for state in ("no-key", "not-enrolled"):
        s = _pure_snap(K, sources=[DRV])
        s["secure_boot"] = {"state": state, "remedy": "ignored here"}
        assert _decide(s)["then"][0]["remedy"] == ("After installing (it signs the module, creating the key if there "
                                                   f"is none), {enroll}."), state
    s["secure_boot"] = {"state": "pending-enroll", "remedy": "Reboot and confirm the key."}
    assert _decide(s)["then"][0]["remedy"] == "Reboot and confirm the key."
    s["secure_boot"] = {"state": "blocked"}
    assert _decide(s)["then"][0]["remedy"] == "R" + enroll[1:] + "."
    assert _decide(s)["then"][0]["detail"] == ("Secure Boot is enforcing and the firmware blocks the signing key: "
                                               "the module will not load until the key is trusted")    # no reason


def test_missing_nvidia_ko_names_the_loaded_driver_first():
    """No nvidia.ko for K while the loaded driver (590) differs from another kernel's nvidia.ko (580): the
    remedy names the loaded driver's modules package, the one K needs to boot into the same driver (kills:
    the loaded version's read)."""
    k2 = "6.14.0-1020-nvidia-64k"
    s = _pure_snap(K, k2)
    s["driver"]["loaded_version"] = "590.48.01-1"
    s["kernels"][0]["nvidia_selected"] = None
    (m,) = _decide(s)["missing"]
    assert m["code"] == "nvidia-ko-missing"
    assert f"'sudo apt-get install linux-modules-nvidia-590-open-{K}'" in m["remedy"], m


@pytest.mark.parametrize("mode,said", [("auto", "auto"), (None, "never")])
def test_a_listed_source_not_fetched_names_the_setting(mode, said):
    """In the APT lists yet not fetchable: the reason names source_fetch as configured ('never' when the
    observer said none) (kills: the mode's read and its default)."""
    s = _pure_snap(K, by_driver={DRV: _src(package="p", deb_version=f"{DRV}-1", in_lists=True)})
    s["driver_sources"]["apt"] = "ok"
    if mode is None:
        del s["driver_sources"]["mode"]
    else:
        s["driver_sources"]["mode"] = mode
    (m,) = _decide(s)["missing"]
    assert m["detail"].endswith(f"; p {DRV}-1 is in the APT lists but source_fetch is '{said}'"), m
