"""Issue 12 defect 1, validate's part: its single-run lock is host/locks' "validate" in RUN_DIR (root-only),
not the world-writable /run/lock (0.1.0: /run/lock/spark-memsaver-validate.lock, 0644, followed links)."""

from __future__ import annotations

import os
import stat

import pytest

from spark_memsaver.host import paths
from spark_memsaver.validate import command as V
from tests.support import needs


def test_validate_lock_lives_in_run_dir():
    needs.root("RUN_DIR is root-only")
    old = "/run/lock/spark-memsaver-validate.lock"
    had_old = os.path.exists(old)
    with V._single_run():
        st = os.lstat(paths.lock("validate"))
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
        assert stat.S_IMODE(os.stat(paths.RUN_DIR).st_mode) & 0o077 == 0
        with pytest.raises(V.ValidateBusy) as ei:
            with V._single_run():
                pass
        assert f"pid {os.getpid()}" in str(ei.value)          # the holder is named
    assert os.path.exists(old) == had_old                     # nothing created in /run/lock
    with V._single_run():                                     # free again
        pass
