"""CLI polish (issue 15, item 7): remedies name spark-memsaverd.service, `config show` is YAML, usage errors are
JSON under --json, `status --quiet` exits with the state's code, the text uses one unit (GiB) and headed tables,
holders of /dev/nvidia-uvm are shown, and a mounted image without /proc is inspected (unknown parts named).
Every call is the real command in a subprocess against tests/support/sparkroot.py roots."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.support import sparkroot

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "daemon" / "spark_memsaver"


def cli(*args, config=None):
    e = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    if config:
        e["SPARK_MEMSAVER_CONFIG"] = str(config)
    r = subprocess.run(["/usr/bin/python3", "-m", "spark_memsaver", *args], capture_output=True, text=True,
                       env=e, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_every_remedy_names_the_daemon_unit():
    bad = re.compile(r"(systemctl \w+|journalctl -u) spark-memsaver(?!d)|spark-memsaver\.service")
    hits = [f"{p.relative_to(REPO)}:{i}" for p in PKG.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert not hits, hits
    assert "systemctl start spark-memsaverd.service" in (PKG / "cli" / "client.py").read_text()


def test_config_show_prints_yaml_that_loads_back(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("tier: 4k-all\ninterval: 30\n")
    r = cli("config", "show", config=cfg)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# source: ")
    d = yaml.safe_load(r.stdout)
    assert d["tier"] == "4k-all" and d["interval"] == 30 and d["kernels"] == "64k-only"
    assert "source" not in d
    j = json.loads(cli("config", "show", "--json", config=cfg).stdout)
    assert {k: v for k, v in j.items() if k not in ("source", "notes")} == d
    # what it printed is itself a valid config file
    again = tmp_path / "again.yaml"
    again.write_text(r.stdout)
    assert yaml.safe_load(cli("config", "show", config=again).stdout) == d


def test_click_usage_errors_are_json_under_json():
    for args in (("status", "--json", "--no-such-option"), ("history", "--json", "--since", "soon"),
                 ("--json-not", "status", "--json")):
        r = cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        err = json.loads(r.stdout)["error"]
        assert err["code"] == "usage" and err["message"] and err["remedy"], err
        assert "--since" in args or "--help" in err["remedy"], err   # click's own point at --help
    r = cli("status", "--no-such-option")
    assert r.returncode == 2 and "No such option" in r.stderr and not r.stdout


def quiet(root):
    return cli("--root", str(root), "status", "--quiet")


def test_status_quiet_exits_with_the_state_code(tmp_path):
    active = sparkroot.make_spark_root(tmp_path / "active", uvm_loaded="ours", ours_installed="580.142")
    stock = sparkroot.make_spark_root(tmp_path / "stock")
    # ours installed for another driver than the loaded one: the guard's mismatch needs attention
    bad = sparkroot.make_spark_root(tmp_path / "bad", uvm_loaded="ours", ours_installed="580.95.05")
    codes = {}
    for name, root in (("active", active), ("stock", stock), ("bad", bad)):
        r = quiet(root)
        doc = json.loads(cli("--root", str(root), "status", "--json").stdout)
        assert r.stdout == "" and r.stderr == "", (r.stdout, r.stderr)
        codes[name] = (doc["state"], r.returncode)
    assert codes["active"] == ("active", 0) and codes["stock"] == ("stock", 0), codes
    state, rc = codes["bad"]
    table = {"needs-attention": 1, "inactive": 7, "rolled-back": 5, "unverified": 6}   # exitcodes.QUIET_STATE
    assert state in table and rc == table[state], codes
    helptext = cli("status", "--help").stdout
    for s, c in table.items():
        assert re.search(rf"^\s*{c}\s+{s}\b", helptext, re.M), (s, helptext)
    r = cli("--root", str(tmp_path / "missing"), "status", "--quiet")
    assert r.returncode == 2


def test_text_one_unit_kernel_header_and_holders(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "r", uvm_loaded="ours", ours_installed="580.142", holders=2)
    r = cli("--root", str(root), "status")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "MiB" not in re.sub(r"\b\d+ free 2 MiB blocks\b", "", out)     # amounts in GiB; a block size is a name
    assert re.search(r"^Memory:.*; \d+ free 2 MiB blocks$", out, re.M), out
    doc = json.loads(cli("--root", str(root), "status", "--json").stdout)
    avail = doc["memory"]["available"]
    assert isinstance(avail, int) and f"{avail / 1073741824:.2f} GiB available" in out
    assert re.search(r"^Saved:\s+\d+\.\d\d GiB$", out, re.M), out
    lines = out.splitlines()
    i = lines.index("Kernels:")
    assert lines[i + 1].split() == ["RELEASE", "PAGE", "HEADERS", "UVM", "VERSION"]
    assert sparkroot.SPARK_KERNEL in lines[i + 2] and lines[i + 2].lstrip().startswith("*")
    assert "Holding /dev/nvidia-uvm (2):" in out
    assert re.search(r"^\s+4242\s+vllm-worker$", out, re.M) and re.search(r"^\s+4243\s+python3$", out, re.M)
    none = sparkroot.make_spark_root(tmp_path / "n", uvm_loaded="ours", ours_installed="580.142")
    assert "Holding /dev/nvidia-uvm" not in cli("--root", str(none), "status").stdout


def test_image_without_proc_works_for_read_only_commands(tmp_path):
    root = sparkroot.make_spark_root(tmp_path / "img", uvm_loaded="ours", ours_installed="580.142")
    shutil.rmtree(root / "proc")
    shutil.rmtree(root / "sys")
    r = cli("--root", str(root), "status", "--json")
    assert r.returncode in (0, 1), r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["host"]["kernel"] is None
    assert set(doc["unknown"]) >= {"running kernel", "loaded modules", "memory"}
    assert doc["kernels"][0]["release"] == sparkroot.SPARK_KERNEL
    assert doc["kernels"][0]["uvm_selected"]["patched"] is True
    assert doc["host"]["hostname"] == sparkroot.HOSTNAME
    text = cli("--root", str(root), "status").stdout
    assert re.search(r"^Unknown:\s+running kernel, loaded modules", text, re.M), text
    assert re.search(r"^Kernel:\s+unknown", text, re.M), text
    for args in (("metrics",), ("patch", "list"), ("status", "--quiet")):
        r = cli("--root", str(root), *args)
        assert r.returncode in (0, 1), (args, r.stdout, r.stderr)
        assert "error[" not in r.stderr, (args, r.stderr)
    assert "spark_memsaver_info{" in cli("--root", str(root), "metrics").stdout
    # mok status reports, not refuses: the firmware part is unknown in an image (its exit 2 says so)
    r = cli("--root", str(root), "mok", "status")
    assert "error[" not in r.stderr and re.search(r"^State:\s+unknown$", r.stdout, re.M), r.stdout + r.stderr
    assert re.search(r"^Reason:\s+\S", r.stdout, re.M)
    # a root that is not a system at all is still refused, with a remedy
    empty = tmp_path / "empty"
    (empty / "proc").mkdir(parents=True)
    r = cli("--root", str(empty), "status")
    assert r.returncode == 2 and "remedy:" in r.stderr


def test_status_quiet_code_of_every_state_is_the_help_tables(tmp_path):
    """Every state `status --quiet` can report, reached on a real fixture root, exits with the code the help
    table gives it (swapping two entries of the code map, or moving one, fails here), and 2 is never a state."""
    from spark_memsaver.host import Host, intents
    helptext = cli("status", "--help").stdout
    table = {s: int(c) for c, s in re.findall(r"^\s*([0-9])\s+([a-z-]+)\s*$", helptext, re.M)}
    for line in re.findall(r"^\s*0\s+(.+), and no warning\s*$", helptext, re.M):
        table.update({s.strip(): 0 for s in re.split(r",| or ", line)})
    table.update({s: 1 for s in re.findall(r"^\s*1\s+([a-z-]+),", helptext, re.M)})
    assert table == {"active": 0, "stock": 0, "built": 0, "installed": 0, "needs-attention": 1,
                     "not-applicable": 4, "rolled-back": 5, "unverified": 6, "inactive": 7}, table
    K = sparkroot.SPARK_KERNEL
    roots = {
        "active": sparkroot.make_spark_root(tmp_path / "active", uvm_loaded="ours", ours_installed="580.142"),
        "stock": sparkroot.make_spark_root(tmp_path / "stock"),
        "installed": sparkroot.make_spark_root(tmp_path / "installed", ours_installed="580.142"),
        "needs-attention": sparkroot.make_spark_root(tmp_path / "bad", uvm_loaded="ours", ours_installed="580.95.05"),
        "inactive": sparkroot.make_spark_root(tmp_path / "inactive", uvm_loaded="ours", ours_installed="580.142",
                                              stats=sparkroot.stats_text(tier="off", packed=0, t256=0, t4k=0)),
        "unverified": sparkroot.make_spark_root(tmp_path / "unverified", uvm_loaded="ours",
                                                ours_installed="580.142", secure_boot=True),
        "rolled-back": sparkroot.make_spark_root(tmp_path / "rolled"),
        "not-applicable": sparkroot.make_spark_root(tmp_path / "na", loaded_driver=None, uvm_loaded=None),
    }
    # no NVIDIA driver at all: no nvidia.ko, no source tree
    shutil.rmtree(roots["not-applicable"] / f"lib/modules/{K}/kernel/nvidia-580-open")
    shutil.rmtree(roots["not-applicable"] / "usr/src/nvidia-580.142")
    # a SecureBoot variable without its value byte: the state cannot be read (unknown), ours is loaded
    sparkroot.write(roots["unverified"], f"/sys/firmware/efi/efivars/SecureBoot-{sparkroot.EFI_GLOBAL}",
                    b"\x06\x00\x00\x00")
    intents.write_rollback(Host(roots["rolled-back"]), K, "the driver moved to 580.200.01",
                           "sudo spark-memsaver install")
    seen = {}
    for want, root in roots.items():
        doc = json.loads(cli("--root", str(root), "status", "--json").stdout)
        r = quiet(root)
        assert r.stdout == "" and r.stderr == "", (want, r.stdout, r.stderr)
        seen[want] = (doc["state"], r.returncode)
    assert seen == {s: (s, table[s]) for s in roots}, seen
