"""One stock record format (issue 22 item 4): which stock nvidia-uvm module loading selected for a kernel before
our module is kept in ONE record -- JSON at /var/lib/spark-memsaver/dkms/<kernel>.json (host/records.py's "stock"
kind; act/override.py keeps it, the load-time guard reads its stock_path: tests/test_guard_* and
test_lifecycle's test_guard_uses_dkms_stock_record). The build-install step used to write a second, one-line
text record (stock/<kernel>) beside it; it now writes the JSON one and migrates the text one away. The guard
still reads an older text record it finds (tests/test_guard_failclosed.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from spark_memsaver.act import steps
from spark_memsaver.host import Host, paths, records
from tests.support import sparkroot

K = sparkroot.SPARK_KERNEL


def test_build_install_records_the_stock_module_in_the_one_json_record(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "root")          # the stock nvidia-uvm is selected
    h = Host(root)
    legacy = Path(root) / paths.legacy_stock_record(K).lstrip("/")
    legacy.parent.mkdir(parents=True)
    legacy.write_text(f"/lib/modules/{K}/kernel/old/nvidia-uvm.ko\n")     # written by an older version
    path = steps.record_stock(h, K)
    assert path and path.startswith(f"/lib/modules/{K}/") and "nvidia-uvm.ko" in path
    rec = records.one(h, "stock", paths.stock_record(K))
    assert rec is not None, "no JSON stock record"
    assert rec["kernel"] == K and rec["stock_path"] == path
    assert rec["stock_sha256"] == hashlib.sha256(h.path(path).read_bytes()).hexdigest()
    assert not legacy.exists()
    # the guard's reading of the record (systemd/guard/uvm-guard: sed of "stock_path") finds the same file
    text = h.path(paths.stock_record(K)).read_text()
    assert f'"stock_path": "{path}"' in text
    # recorded again (a second build-install): the record stays, its owner data kept
    assert steps.record_stock(h, K) == path
    assert records.one(h, "stock", paths.stock_record(K))["recorded"] == rec["recorded"]


def test_no_stock_record_while_ours_is_selected(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "root", ours_installed=sparkroot.DRIVER)
    h = Host(root)
    assert steps.record_stock(h, K) is None
    assert records.one(h, "stock", paths.stock_record(K)) is None
