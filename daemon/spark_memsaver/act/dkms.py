"""DKMS: render, build, sign, install and remove the patched nvidia-uvm (package ``spark-memsaver-uvm``).

Entry points (``progress`` is an optional ``callable(fraction: float, message: str)``):

* :func:`build` (host, config, kernel=None, driver_version=None, progress=None) -> dict
* :func:`install` (host, config, kernel=None, all_kernels=False, progress=None) -> dict
* :func:`remove` (host, config, kernel=None, all_kernels=False, progress=None) -> dict
  (restores and VERIFIES the stock module)
* :func:`verify_installed` (host, kernel) -> dict
* :func:`restore_stock` (host, kernel) -> dict

This module only re-exports the engines (stable names for act/executor.py, act/steps.py, tests and benchmarks):
act/build.py (build), act/override.py (install, restore_stock, remove, verify_installed), act/render.py (our DKMS
tree), act/dkms_run.py (dkms/depmod/initramfs runners, policy, driver source, kotool), act/dkms_errors.py (named
errors, exit table), observe/dkms.py (DKMS's tree read without dkms). Which module is selected and whether it is
ours is read by observe/modules.py only. The engines take NO lock and write NO intent: act/executor.perform holds
the "lifecycle" lock and writes the intents; the CLI and D-Bus call only the executor.

The path a build takes, each step refusing with a named error before anything is compiled:
headers present (:class:`HeadersMissing`) -> kernel inside the config's policy
(:class:`KernelOutsidePolicy`) -> an nvidia.ko is selected for the kernel; its version is THE driver
version (:class:`NoNvidiaDriver`, :class:`DriverMismatch`) -> that version's NVIDIA open tree is under
/usr/src and intact (:class:`DriverSourceMissing`, :class:`DriverSourceCorrupt`) -> the manifest has a
patch and it applies with zero fuzz (uvm_patch's ``UnknownDriverVersion``, ``PatchDoesNotApply``) ->
signing key settled (signing.py) -> our tree rendered into ``/usr/src/spark-memsaver-uvm-<ver>/`` ->
``dkms add`` / ``dkms build`` -> the built module verified (version, vermagic, parameters,
``depends: nvidia``, nvidia.ko's CRCs, signer). DKMS exit codes map to named errors
(:data:`DKMS_EXIT_ERRORS`). Install then proves the override with ``modinfo -k K -n nvidia-uvm``;
remove proves the stock module is selected again (and repairs what DKMS versions leave wrong).

DKMS version string: ``<driver>-sm<spark-memsaver version>``, e.g. ``550.163.01-sm0.1.0``: one
registration per driver version, so a driver upgrade gets its own tree, and version sorting (DKMS
autoinstall picks the highest) puts the newest driver first, then our newest release.
See dkms/README.md for location/priority, signing and the exit-code table.
"""

from __future__ import annotations

from spark_memsaver.observe.dkms import PACKAGE, MODULE, DKMS_TREE, SRC_ROOT, FORCE_FILE, DEPMOD_FILE, DEST, _SUFFIXES, dkms_version_string, parse_dkms_version, registered_versions, _arch_dirs, built_module, installed_version, kernels_of, installed_path  # noqa: F401
from spark_memsaver.act.dkms_errors import DkmsError, DkmsMissing, HeadersMissing, KernelOutsidePolicy, NoNvidiaDriver, DriverMismatch, DriverSourceMissing, DriverSourceCorrupt, BuildSkipped, BuildFailed, BuiltModuleMissing, PreInstallRefused, InstallRefused, InstallAborted, DkmsTreeBroken, DkmsConfInvalid, VerificationFailed, StockNotRestored, NothingToDo, DKMS_EXIT_ERRORS  # noqa: F401
from spark_memsaver.act.dkms_run import log, PATCH_ID, STATE_DIR, LOG_DIR, BUILD_TIMEOUT, NICE, data_dir, _KOTOOL, kotool, sha256, _tail, _noop, _scaled, running_kernel, dkms_cmd, dkms_version, _modinfo_path, selected, kernel_config, policy_check, source_candidates, find_driver_source, _require_root, _raise_for_dkms, _dkms, _depmod, refresh_initramfs, _write_json, _read_json, ensure_host_files, _protect_foreign, _uninstall_kernel, _backup_originals  # noqa: F401
from spark_memsaver.act.render import render, recover_broken, _forget_registration  # noqa: F401
from spark_memsaver.act.build import _preflight, _signing_for, _progress_poller, _save_log, _verify_built, _unbuild, _drop_if_empty, _jobs, _build_locked, build  # noqa: F401
from spark_memsaver.act.override import _stock_record_path, _other_dkms_owner, verify_installed, _target_kernels, _install_one, _secure_boot, install, restore_stock, _file_is_ours, remove  # noqa: F401
