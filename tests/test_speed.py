"""Speed and footprint mechanics (issue 25): what makes `status` fast and the daemon small, checked by
behaviour, not by timing (the figures are benchmarks/status_latency.py's and daemon_footprint.py's).

- lazy command registration: a command's module is imported only when that command runs; `--help` still
  lists every command with its short help, and the table of lazy commands names every command there is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = "/usr/bin/python3"


def _env(**extra):
    e = dict(os.environ, PYTHONPATH=str(REPO / "daemon"), **extra)
    e.pop("SPARK_MEMSAVER_CONFIG", None)
    return e


def _modules_after(*cli_args: str, root: str = "/") -> set[str]:
    """The spark_memsaver modules loaded once the real CLI has run ``cli_args`` in a fresh interpreter."""
    code = ("import sys, atexit, json\n"
            "atexit.register(lambda: sys.__stderr__.write('\\nMODULES ' + json.dumps(sorted(m for m in sys.modules"
            " if m.startswith('spark_memsaver'))) + '\\n'))\n"
            "sys.argv = ['spark-memsaver', *sys.argv[1:]]\n"
            "from spark_memsaver.cli.entry import main\nmain()\n")
    r = subprocess.run([PY, "-c", code, "--root", root, *cli_args], capture_output=True, text=True,
                       env=_env(), timeout=120)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("MODULES ")]
    assert line, r.stderr
    return set(json.loads(line[-1][len("MODULES "):]))


COMMAND_MODULES = {"spark_memsaver.cli.build", "spark_memsaver.cli.lifecycle", "spark_memsaver.cli.mok",
                   "spark_memsaver.cli.patch", "spark_memsaver.cli.validate", "spark_memsaver.cli.history",
                   "spark_memsaver.cli.events", "spark_memsaver.cli.metrics"}


def test_status_imports_no_command_module(tmp_path):
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.1.0-test\n")
    loaded = _modules_after("status", "--json", root=str(tmp_path))
    assert not loaded & COMMAND_MODULES, sorted(loaded & COMMAND_MODULES)
    assert "spark_memsaver.validate.command" not in loaded and "spark_memsaver.act.enroll" not in loaded


def test_a_command_imports_its_own_module_only():
    loaded = _modules_after("events", "--help")
    assert "spark_memsaver.cli.events" in loaded
    assert not loaded & (COMMAND_MODULES - {"spark_memsaver.cli.events", "spark_memsaver.cli.history"})


def test_help_lists_every_command_with_its_short_help():
    sys.path.insert(0, str(REPO / "daemon"))
    import click
    from spark_memsaver.cli import main as m

    r = subprocess.run([PY, "-m", "spark_memsaver", "--help"], capture_output=True, text=True, env=_env(),
                       timeout=60)
    assert r.returncode == 0, r.stderr
    # every module's register() adds exactly the commands the table names for it, no more, no fewer
    import importlib
    probe = click.Group("probe")
    for mod in sorted(set(m.LAZY_COMMANDS.values())):
        before = set(probe.commands)
        importlib.import_module(f"spark_memsaver.cli.{mod}").register(probe)
        added = set(probe.commands) - before
        assert added == {n for n, v in m.LAZY_COMMANDS.items() if v == mod}, (mod, added)
    commands = r.stdout.split("Commands:", 1)[1].split("\n\n", 1)[0]       # the examples follow
    listed = [ln.split()[0] for ln in commands.splitlines() if ln.strip()]
    assert listed == sorted(set(m.LAZY_COMMANDS) | {"status", "config"}), listed
    for name, cmd in probe.commands.items():
        short = " ".join(cmd.get_short_help_str(limit=300).split()[:3])
        line = next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == [name])
        assert short in line, (name, short, line)


def test_unknown_command_is_still_a_usage_error():
    r = subprocess.run([PY, "-m", "spark_memsaver", "bogus", "--json"], capture_output=True, text=True,
                       env=_env(), timeout=60)
    assert r.returncode == 2
    assert json.loads(r.stdout)["error"]["code"] == "usage"


def test_completion_offers_lazy_commands():
    r = subprocess.run([PY, "-c", "import sys; sys.argv[0] = 'spark-memsaver'; "
                        "from spark_memsaver.cli.main import main; main()"], capture_output=True, text=True,
                       env=_env(_SPARK_MEMSAVER_COMPLETE="bash_complete", COMP_WORDS="spark-memsaver re",
                                COMP_CWORD="1"), timeout=60)
    assert r.stdout.split() == ["plain,reclaim", "plain,reconcile", "plain,remove"], r.stdout


# --- YAML: libyaml's C parser, the pure-Python one as the fallback; comments-only texts without yaml -------

def test_c_loader_reads_the_product_files_as_the_pure_python_loader_does():
    import yaml
    from spark_memsaver import yamlio

    assert yamlio.loader() is yaml.CSafeLoader       # python3-yaml carries libyaml (tools/deps/base.txt)
    for rel in ("uvm_patch/manifest.yaml", "uvm_patch/hazards.yaml", "systemd/config.yaml",
                "tests/fixtures/config-full.yaml"):
        p = REPO / rel
        if not p.exists():
            continue
        text = p.read_text()
        assert yamlio.safe_load(text) == yaml.load(text, Loader=yaml.SafeLoader), rel


def test_pure_python_fallback_when_libyaml_is_absent(monkeypatch):
    import yaml
    from spark_memsaver import yamlio

    monkeypatch.delattr(yaml, "CSafeLoader")
    assert yamlio.loader() is yaml.SafeLoader
    assert yamlio.safe_load("a: [1, 2]\n") == {"a": [1, 2]}


def test_comments_only_text_is_empty_without_importing_yaml():
    code = ("import sys; from spark_memsaver import config\n"
            "c = config.parse(open(sys.argv[1]).read(), 'f')\n"
            "print(c.source, 'yaml' in sys.modules)")
    r = subprocess.run([PY, "-c", code, str(REPO / "systemd/config.yaml")], capture_output=True, text=True,
                       env=_env(), timeout=60)
    assert r.stdout.split() == ["f", "False"], r.stdout + r.stderr


def test_empty_shortcut_agrees_with_both_parsers():
    """Wherever the shortcut says 'empty document', both parsers say None; it never hides a key."""
    import yaml
    from hypothesis import given, settings, strategies as st
    from spark_memsaver import yamlio

    pieces = st.sampled_from([" ", "#", "\n", "\r", "\r\n", "\x85", "\u2028", "\u2029", "\t", "a", "a: 1", ":",
                              "-", "- x", "\ufeff", "---", "# k: v"])

    @settings(max_examples=400, deadline=None)
    @given(st.lists(pieces, max_size=12).map("".join))
    def check(text):
        if yamlio._EMPTY.fullmatch(text):
            for loader in (yaml.SafeLoader, yaml.CSafeLoader):
                assert yaml.load(text, Loader=loader) is None, (text, loader)
        elif "\ufeff" not in text:   # the parser decides; where both parse it, they agree (a byte-order
            try:                         # mark inside a text: libyaml drops it, PyYAML keeps it as a scalar)
                pure, c = yaml.load(text, Loader=yaml.SafeLoader), yamlio.safe_load(text)
            except yaml.YAMLError:
                return
            assert pure == c, text

    check()
    assert yamlio.safe_load("# only\n  # comments\r\n\n") is None
    assert yamlio.safe_load("# c\rinterval: 5\n") == {"interval": 5}      # \r ends a comment
    assert yamlio.safe_load("# c\x85interval: 5\n") == {"interval": 5}    # so does NEL


# --- status answered from the daemon's document only while it is fresh ----------------------------------

def test_fresh_is_one_interval_old_at_most():
    from spark_memsaver.cli.client import is_fresh
    from spark_memsaver.timefmt import utc_epoch

    t = utc_epoch("2026-12-02T12:00:00Z")
    assert t == 1796212800.0
    doc = {"generated_at": "2026-12-02T12:00:00Z", "config": {"interval": 60}}
    assert is_fresh(doc, now=t) and is_fresh(doc, now=t + 61.9)
    assert not is_fresh(doc, now=t + 62.1)               # older than the interval (+2 s for whole seconds)
    assert not is_fresh(doc, now=t - 10)                 # from the future: a clock jump, not trusted
    for bad in ({}, {"generated_at": "2026-12-02 12:00:00", "config": {"interval": 60}},
                {"generated_at": "2026-12-02T12:00:00Z", "config": {"interval": True}},
                {"generated_at": "2026-12-02T12:00:00Z"}):
        assert not is_fresh(bad, now=t)


def test_status_uses_the_daemon_document_while_fresh_and_looks_itself_when_stale(tmp_path):
    """On the private bus: right after the daemon's status, `status --json` is the daemon's document; once it is
    older than the interval (5 s here), the CLI inspects directly, and the stale GetStatus makes the daemon
    re-make it, after which the CLI uses the daemon's again."""
    import tempfile
    import shutil
    import time as _t
    from tests.support import needs, sparkroot
    from tests.support.privatebus import PrivateSystemBus, start_daemon, stop_process
    from spark_memsaver.service import names

    needs.require("dbus-daemon", "gdbus", remedy="tools/deps/dbus.txt")
    needs.root("the daemon owns its bus name only as root")
    root = sparkroot.make_spark_root(tmp_path / "root", uvm_loaded="ours", ours_installed=sparkroot.DRIVER)
    conf = tmp_path / "config.yaml"
    conf.write_text("interval: 5\n")
    d = Path(tempfile.mkdtemp(prefix="spark-memsaver-bus."))
    bus = PrivateSystemBus(d).start()
    daemon = start_daemon(bus, "--no-reconcile", "--root", str(root), "--config", str(conf),
                          log_path=tmp_path / "daemon.log")
    env = _env(DBUS_SYSTEM_BUS_ADDRESS=bus.address)

    def status():
        r = subprocess.run([PY, "-m", "spark_memsaver", "status", "--json"], capture_output=True, text=True,
                           env=env, timeout=60)
        assert r.returncode in (0, 1), r.stderr
        return json.loads(r.stdout)

    try:
        bus.wait_for_name(names.BUS_NAME, timeout=30, proc=daemon)
        deadline = _t.monotonic() + 60
        while (doc := status())["source"] != "daemon":       # the first status is being made
            assert _t.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            _t.sleep(0.2)
        assert doc["host"]["kernel"] == sparkroot.SPARK_KERNEL and doc["config"]["interval"] == 5
        _t.sleep(5 + 2 + 1.5)                                   # now older than interval + slack
        stale = status()
        assert stale["source"] == "direct" and stale["host"]["kernel"] != sparkroot.SPARK_KERNEL
        deadline = _t.monotonic() + 60
        while (doc := status())["source"] != "daemon":         # re-made by the daemon on that GetStatus
            assert _t.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            _t.sleep(0.2)
        assert doc["host"]["kernel"] == sparkroot.SPARK_KERNEL
    finally:
        stop_process(daemon)
        bus.stop()
        shutil.rmtree(d, ignore_errors=True)


# --- the source lookup: dpkg's answer memoised by its status file, as APT's lists are by theirs ------------

def test_installed_packages_are_memoised_by_dpkg_status(tmp_path):
    from spark_memsaver.host import Host
    from spark_memsaver.observe import sources

    root = tmp_path / "root"
    (root / "var/lib/dpkg/info").mkdir(parents=True)
    (root / "var/cache/spark-memsaver").mkdir(parents=True)       # the package's cache directory
    status = root / "var/lib/dpkg/status"
    stanza = ("Package: {p}\nStatus: install ok installed\nPriority: optional\nSection: kernel\nArchitecture: arm64\n"
              "Version: {v}\nMaintainer: x <x@example.org>\nDescription: d\n\n")
    status.write_text(stanza.format(p="nvidia-kernel-common-580", v="580.142-0ubuntu0.24.04.1"))
    host = Host(str(root))
    ran = []
    real = host.run
    host.run = lambda argv, **kw: (ran.append(argv[0]), real(argv, **kw))[1]
    want = {"nvidia-kernel-common-580": "580.142-0ubuntu0.24.04.1"}
    assert sources.installed_packages(host) == want and ran == ["dpkg-query"]
    assert sources.installed_packages(host) == want and ran == ["dpkg-query"]      # from the memo
    status.write_text(status.read_text() + stanza.format(p="nvidia-kernel-source-580-open", v="580.142-0ubuntu1"))
    got = sources.installed_packages(host)
    assert ran == ["dpkg-query", "dpkg-query"] and got["nvidia-kernel-source-580-open"] == "580.142-0ubuntu1"
    # a dpkg-query that fails is not memoised
    status.write_text(status.read_text() + "\n")
    host.run = lambda argv, **kw: (_ for _ in ()).throw(__import__("spark_memsaver.errors").errors.CommandFailed("x"))
    assert sources.installed_packages(host) == {}
    host.run = lambda argv, **kw: (ran.append(argv[0]), real(argv, **kw))[1]
    assert sources.installed_packages(host) == got and ran.count("dpkg-query") == 3


def test_utc_epoch_is_calendar_timegm():
    import calendar
    import random
    import time as _t
    from spark_memsaver.timefmt import utc_epoch

    rnd = random.Random(25)
    for t in [0, 951782400, 951868800, 4102444799] + [rnd.randrange(0, 4102444800) for _ in range(5000)]:
        s = _t.strftime("%Y-%m-%dT%H:%M:%SZ", _t.gmtime(t))
        assert utc_epoch(s) == calendar.timegm(_t.gmtime(t)) == utc_epoch(s[:-1] + "+00:00"), s
    for bad in ("2026-02-30T00:00:00Z", "2026-13-01T00:00:00Z", "2026-12-02 12:00:00", "x", None, 5):
        assert utc_epoch(bad) is None
    from spark_memsaver.report.metrics import _rfc3339_to_unix
    assert _rfc3339_to_unix("2026-12-02T12:00:00Z") == 1796212800 and _rfc3339_to_unix(None) == 0


# --- the product's data files (manifest, hazards table) parsed once per version of their text --------------

def test_data_files_are_parsed_once_per_text(tmp_path, monkeypatch):
    import stat
    from spark_memsaver import yamlio
    from tests.support import needs

    needs.root("the parsed copies are written by root (the status child, root's commands)")
    (tmp_path / "cache").mkdir()
    monkeypatch.setattr(yamlio, "DATA_CACHE", str(tmp_path / "cache" / "parsed"))
    parsed = []
    real = yamlio.safe_load
    monkeypatch.setattr(yamlio, "safe_load", lambda text: (parsed.append(text), real(text))[1])
    text = (REPO / "uvm_patch/manifest.yaml").read_text()
    want = real(text)
    assert yamlio.load_data(text, "manifest") == want and len(parsed) == 1
    kept = tmp_path / "cache/parsed/manifest.json"
    assert json.loads(kept.read_text())["text"] == text
    assert yamlio.load_data(text, "manifest") == want and len(parsed) == 1        # from the parsed copy
    assert yamlio.load_data(text + "\n# edited\n", "manifest") == want and len(parsed) == 2   # another text
    assert yamlio.load_data(text + "\n# edited\n", "manifest") == want and len(parsed) == 2
    kept.chmod(0o666)                                                            # writable by others: not believed
    assert yamlio.load_data(text + "\n# edited\n", "manifest") == want and len(parsed) == 3
    assert stat.S_IMODE(kept.stat().st_mode) == 0o644                            # and rewritten as ours
    # a value JSON would change (int keys, dates) is never kept
    assert yamlio.load_data("1: a\nd: 2026-12-02\n", "odd") is not None
    assert not (tmp_path / "cache/parsed/odd.json").exists()


def test_status_needs_no_yaml_once_the_data_files_are_parsed(tmp_path):
    from tests.support import needs

    needs.root("the parsed copies are written by root (the status child, root's commands)")
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.1.0-test\n")
    (tmp_path / "cache").mkdir()
    code = ("import sys\nfrom spark_memsaver import yamlio\n"
            f"yamlio.DATA_CACHE = {str(tmp_path / 'cache/parsed')!r}\n"
            "sys.argv = ['spark-memsaver', '--root', sys.argv[1], 'status', '--json', '--direct']\n"
            "import atexit; atexit.register(lambda: sys.stderr.write('YAML ' + str('yaml' in sys.modules)))\n"
            "from spark_memsaver.cli.entry import main; main()\n")
    runs = [subprocess.run([PY, "-c", code, str(tmp_path)], capture_output=True, text=True, env=_env(),
                           timeout=120) for _ in range(2)]
    for r in runs:
        assert r.returncode in (0, 1), r.stderr
    assert runs[0].stderr.endswith("YAML True") and runs[1].stderr.endswith("YAML False"), [r.stderr for r in runs]
    assert json.loads(runs[0].stdout)["findings"] == json.loads(runs[1].stdout)["findings"]


# --- the resident daemon: what it keeps loaded at idle -------------------------------------------------

IDLE_NEVER = ("dataclasses", "inspect", "ast", "pathlib", "ipaddress", "yaml", "jinja2", "click", "ctypes",
              "pyudev", "spark_memsaver.config", "spark_memsaver.act", "spark_memsaver.decide.status",
              "spark_memsaver.report.document")


def test_idle_daemon_loads_no_dataclasses_pathlib_or_config(tmp_path):
    """The daemon's core as it runs at idle (first status from the real child, the monitor with its uevent
    socket and file watches, a sample, GetStatus's document), in a fresh interpreter: none of the modules it
    does not need is loaded (dataclasses brings inspect/ast/dis, ~1 MiB; pathlib urllib.parse and ipaddress,
    ~0.6 MiB: benchmarks/daemon_footprint.py). The config arrives as the child's dict."""
    from tests.support import needs, sparkroot

    needs.require("depmod", "gcc", remedy="tools/deps/dbus.txt")
    root = sparkroot.make_spark_root(tmp_path / "root", uvm_loaded="ours")
    code = ("import sys, json\n"
            "from spark_memsaver.service import runtime\n"
            "from spark_memsaver.service.daemon import Daemon\n"
            "d = Daemon(root=sys.argv[1], reconcile=False, monitor_factory=runtime.monitor_class())\n"
            "assert d.props['Interval'] == 0 and d.config is None\n"
            "d.apply_answer(d._status_answer())\n"
            "d.monitor.sample('test'); doc = json.loads(d.status_json()); d.monitor.stop()\n"
            "print(json.dumps({'state': d.props['State'], 'interval': d.props['Interval'],\n"
            "                  'history': d.monitor.config.history_size, 'doc_state': doc['state'],\n"
            "                  'modules': sorted(sys.modules)}))\n")
    r = subprocess.run([PY, "-c", code, str(root)], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["state"] == out["doc_state"] != "starting"
    assert out["interval"] == 60 and out["history"] == 1440          # the defaults, from the child's config
    loaded = [m for m in out["modules"] if m in IDLE_NEVER or m.startswith(tuple(p + "." for p in IDLE_NEVER))]
    assert loaded == [], loaded


def test_certificate_times_agree_with_strptime_without_loading_it():
    """efi/x509 reads validity times by hand (no _strptime/calendar/locale on the status path): the same
    answers as datetime.strptime (UTCTime's RFC 5280 century, Feb 29, seconds 60/61 refused) on every form."""
    import datetime as dt
    import random

    sys.path.insert(0, str(REPO / "daemon"))
    from spark_memsaver.efi import x509

    def reference(t: str, tag: int):
        try:
            if tag == 0x17:
                d = dt.datetime.strptime(t, "%y%m%d%H%M%SZ")
                d = d.replace(year=d.year - 100) if d.year >= 2050 else d
            elif tag == 0x18:
                d = dt.datetime.strptime(t, "%Y%m%d%H%M%SZ")
            else:
                return "ERR"
        except ValueError:
            return "ERR"
        return d.replace(tzinfo=dt.timezone.utc).isoformat().replace("+00:00", "Z")

    def ours(t: str, tag: int):
        try:
            return x509._time(t.encode(), tag, 0, len(t))
        except x509._DerError:
            return "ERR"

    rnd = random.Random(25)
    cases = [("261202120005Z", 0x17), ("491231235959Z", 0x17), ("500101000000Z", 0x17), ("2612021200Z", 0x17),
             ("20240229000000Z", 0x18), ("20230229000000Z", 0x18), ("261202120060Z", 0x17), ("261202120005Z", 0x13),
             ("99991231235959Z", 0x18), ("26120212000aZ", 0x17), ("261202120005", 0x17)]
    for _ in range(3000):
        tag = rnd.choice((0x17, 0x18))
        year = f"{rnd.randrange(100):02d}" if tag == 0x17 else f"{rnd.randrange(1900, 2200):04d}"
        fields = [rnd.randrange(14), rnd.randrange(33), rnd.randrange(26), rnd.randrange(62), rnd.randrange(63)]
        cases.append((year + "".join(f"{f:02d}" for f in fields) + "Z", tag))
    assert [ours(t, tag) for t, tag in cases] == [reference(t, tag) for t, tag in cases]
    assert sum(ours(t, tag) != "ERR" for t, tag in cases) > 1000         # valid ones were drawn, too
    code = ("import sys; from spark_memsaver.efi import x509; x509._time(b'261202120005Z', 0x17, 0, 13); "
            "print(sorted({'_strptime', 'calendar', 'datetime', 'locale'} & set(sys.modules)))")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


def test_certificate_digests_are_hashlibs_without_openssl(tmp_path):
    """spark_memsaver/digest's SHA-256 (CPython's built-in one: hashlib would load libcrypto into status), used by
    efi/x509, act/patch's tree hashes and fsutil.sha256_file, is hashlib's."""
    import hashlib
    import random

    sys.path.insert(0, str(REPO / "daemon"))
    from spark_memsaver import digest
    from spark_memsaver.efi import x509
    from spark_memsaver.host.fsutil import sha256_file

    rnd = random.Random(25)
    for n in (0, 1, 55, 56, 63, 64, 65, 1000, 100_000):
        data = bytes(rnd.randrange(256) for _ in range(n))
        assert x509._sha256(data) == hashlib.sha256(data).digest()
        assert digest.sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()
        h = digest.sha256()
        h.update(data[:n // 3])
        h.update(data[n // 3:])
        assert h.hexdigest() == hashlib.sha256(data).hexdigest()
    f = tmp_path / "blob"
    f.write_bytes(bytes(range(256)) * 5000)
    assert sha256_file(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    code = ("import sys; from spark_memsaver.efi import x509; from spark_memsaver.host.fsutil import sha256_file; "
            "x509._sha256(b'x'); sha256_file(sys.executable); "
            "print('_hashlib' in sys.modules, 'hashlib' in sys.modules)")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert r.stdout.split() == ["False", "False"], r.stdout + r.stderr
