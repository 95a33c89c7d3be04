"""Untrusted text is made safe where it is read (issue 35 item 6; host/safetext.py, the one sanitizer).

Any local user names its process, and /dev/nvidia-uvm is mode 0666: a holder called ``x\\e[8m`` made status and
`reconcile --dry-run` (also run by the APT hook during `apt upgrade`) print an escape that hides what follows on
root's terminal (click strips escapes only from pipes). Module parameters, the guard's log (the kernel's and
modprobe's words), kernel-log lines and config keys shown back are text we did not write either.

Real parts: the CLI as a subprocess on Spark-like roots (tests/support/sparkroot.py: the /proc/PID/fd links and
comm files stand in for processes of another user holding /dev/nvidia-uvm on a GB10 node).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from spark_memsaver import config as cfg
from spark_memsaver.errors import ConfigError
from spark_memsaver.host import Host
from spark_memsaver.host.safetext import is_safe, safe
from spark_memsaver.observe import guardlog
from spark_memsaver.observe.snapshot import observe_uvm, uvm_holders
from spark_memsaver.validate.checks import scan_messages
from tests.support import sparkroot

REPO = Path(__file__).resolve().parent.parent
HOSTILE = "x\x1b[8mhidden\u202eevil\r\nforged"
SHOWN = "x\\x1b[8mhidden\\u202eevil\\x0d\\x0aforged"
BAD = ("\x1b", "\u202e", "\r", "\x9b")       # ESC, RIGHT-TO-LEFT OVERRIDE, CR, the C1 CSI


def cli(root: Path, *args):
    e = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    return subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", "--root", str(root), *args],
                          capture_output=True, text=True, env=e, timeout=120)


def clean(text: str) -> bool:
    return not any(c in text for c in BAD)


@pytest.fixture(scope="module")
def hostile_root(tmp_path_factory):
    """Our nvidia-uvm for 580.95.05 loaded beside nvidia 580.142 and held by two processes, one of them named by
    a hostile user; a module parameter with an escape in it."""
    root = sparkroot.make_spark_root(tmp_path_factory.mktemp("h") / "root", uvm_loaded="ours",
                                     ours_installed="580.95.05", holders=2)
    (root / "proc/4242/comm").write_text(HOSTILE[:15] + "\n")      # the kernel keeps 15 bytes of a name
    (root / "sys/module/nvidia_uvm/parameters/uvm_page_table_location").write_text("vid\x1b]0;owned\x07\n")
    return root


def test_safe_escapes_control_bidi_and_separators_only():
    assert safe(HOSTILE) == SHOWN and is_safe(SHOWN)
    assert safe("vllm-worker") == "vllm-worker" and safe("Größe — ok ✓") == "Größe — ok ✓"
    for c, shown in (("\x00", "\\x00"), ("\x7f", "\\x7f"), ("\x9b", "\\x9b"), ("\u2066", "\\u2066"),
                     ("\u200b", "\\u200b"), ("\u2028", "\\u2028"), ("\ufeff", "\\ufeff"), ("\udcff", "\\udcff"),
                     ("\U000e0041", "\\U000e0041"), ("\t", "\\x09")):
        assert safe(f"a{c}b") == f"a{shown}b", c
    assert safe("y" * 100, 10) == "y" * 10 + "..." and safe(7) == "7"


def test_readers_escape_what_they_read(hostile_root):
    host = Host(str(hostile_root))
    names = {h["pid"]: h["comm"] for h in uvm_holders(host)}
    assert names == {4242: safe(HOSTILE[:15]), 4243: "python3"}
    assert observe_uvm(host)["parameters"]["uvm_page_table_location"] == "vid\\x1b]0;owned\\x07"
    line = ("2026-12-02T12:05:05Z kernel=K ours-load-failed: the kernel refused our nvidia-uvm /x/nvidia-uvm.ko: "
            "Invalid argument uvm_x=\x1b[2J\u202e [abi-mismatch]")
    got = guardlog.parse(line, "K")
    assert got["cause"] == "abi-mismatch" and got["reason"] == "Invalid argument uvm_x=\\x1b[2J\\u202e"
    from spark_memsaver.observe import modules     # modinfo's words about a module: its signer, its parameters
    f = modules._fields({"signer": "Build key\u202e", "parm": ["uvm_x\x1b[8m:a parameter (int)"], "parmtype": []})
    assert f["signer"] == "Build key\\u202e" and f["parameters"] == ["uvm_x\\x1b[8m"]
    ev = scan_messages(["Out of memory: Killed process 4242 (x\x1b[8mhidden) total-vm:1kB"])
    assert ev[0]["kind"] == "oom-kill"
    assert ev[0]["line"] == "Out of memory: Killed process 4242 (x\\x1b[8mhidden) total-vm:1kB"


def test_status_text_and_json_show_a_hostile_process_name_escaped(hostile_root):
    r = cli(hostile_root, "status", "--direct")
    assert r.returncode in (0, 1), r.stderr
    assert clean(r.stdout) and clean(r.stderr), repr(r.stdout)
    assert safe(HOSTILE[:15]) in r.stdout, r.stdout
    r = cli(hostile_root, "status", "--direct", "--json")
    doc = json.loads(r.stdout)
    assert {"pid": 4242, "comm": safe(HOSTILE[:15])} in doc["uvm_holders"]
    assert clean(json.dumps(doc, ensure_ascii=False)), "a value still holds a control or bidi character"


def test_reconcile_dry_run_shows_a_hostile_process_name_escaped(hostile_root):
    r = cli(hostile_root, "reconcile", "--dry-run")
    assert r.returncode in (0, 1), r.stderr
    assert "blocked" in r.stdout and f"{safe(HOSTILE[:15])}[4242]" in r.stdout, r.stdout
    assert clean(r.stdout) and clean(r.stderr), repr(r.stdout)
    r = cli(hostile_root, "reconcile", "--dry-run", "--json")
    blocked = [s for s in json.loads(r.stdout)["steps"] if s["action"] == "blocked"]
    assert blocked and blocked[0]["reason"].endswith(f"{safe(HOSTILE[:15])}[4242]"), blocked
    assert clean(json.dumps(json.loads(r.stdout), ensure_ascii=False))


def test_config_keys_and_paths_shown_back_are_safe(tmp_path):
    with pytest.raises(ConfigError) as e:
        cfg.parse("tier: leaf\n\"kern\u202eels\": x\n", str(tmp_path / "config.yaml"))
    assert "kern\\u202eels" in e.value.message and clean(e.value.message)
    with pytest.raises(ConfigError) as e:
        cfg.parse("signing_cert: \"/etc/\u202ekey.pem\"\n", str(tmp_path / "config.yaml"))
    assert "signing_cert" in e.value.message and clean(e.value.message)
    fleet = "/etc/spark-memsaver/fleet.pem"
    assert cfg.parse(f"signing_cert: {fleet}\n", "x").signing_cert == fleet
