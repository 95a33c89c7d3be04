"""The documents say what the code does. Each check reads a fact out of README.md, spark-memsaver(8) or
docs/dbus-api.md and compares it with the code that decides it: config defaults (config.Config), the schema
number (report/document.py), the schema file's path, the Prometheus file name (service/monitor.py), which
commands take --json and which options each command has (click's own command tree), the exit-code tables
(exitcodes.py); and the generated sections are current (tools/gen-docs --check)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spark_memsaver import config_keys, exitcodes
from spark_memsaver.config import Config
from spark_memsaver.report.document import SCHEMA_VERSION

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
MAN = (REPO / "docs/spark-memsaver.8").read_text()
DBUS = (REPO / "docs/dbus-api.md").read_text()
sys.path.insert(0, str(REPO / "tools"))


def plain(roff: str) -> str:
    """Roff source as words: escapes and font changes gone, quotes of macro arguments gone."""
    t = re.sub(r"\\f(\[[^\]]*\]|\(..|.)", "", roff).replace("\\-", "-").replace("\\e", "\\")
    return re.sub(r'^\.(B|I|BR|RB|BI|IB|IR|RI)\s+', "", t, flags=re.M).replace('"', "")


def gen_docs():
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("gen_docs", str(REPO / "tools/gen-docs"))
    spec = importlib.util.spec_from_loader("gen_docs", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def man_config_defaults() -> dict:
    return {m.group(1): m.group(2) for m in re.finditer(r"^\.BR (\S+) \" \(default \" (\S+) \)", plain_lines(MAN),
                                                        re.M)}


def plain_lines(roff: str) -> str:
    return re.sub(r"\\f(\[[^\]]*\]|\(..|.)", "", roff).replace("\\-", "-")


def readme_config_defaults() -> dict:
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_]+)`(?:, `[a-z_]+`)? \| `?([^`|]+?)`? \|",
                                                        README, re.M)}


def test_man_config_defaults_are_the_codes():
    """e.g. the man page said tier's default is 4k (the code: leaf), and the config error points there."""
    got = man_config_defaults()
    want = {k["key"]: k["default"] for k in config_keys.keys()}
    assert got == want


def test_readme_config_defaults_are_the_codes():
    """e.g. prometheus_textfile's default was written 'off' although the file is written by default."""
    got = readme_config_defaults()
    want = {k["key"]: k["default"] for k in config_keys.keys()}
    assert got == want


def test_config_error_points_at_a_section_that_exists():
    from spark_memsaver.errors import ConfigError
    assert "spark-memsaver(8), CONFIGURATION" in ConfigError.remedy and "\n.SH CONFIGURATION\n" in MAN


@pytest.mark.parametrize("name", ["README.md", "docs/spark-memsaver.8", "docs/dbus-api.md"])
def test_schema_number_is_the_documents(name):
    text = {"README.md": README, "docs/spark-memsaver.8": plain(MAN), "docs/dbus-api.md": DBUS}[name]
    # the current number; an older one only in its migration note ("schema 1 documents ... lack ...")
    said = re.findall(r"\bschema:? `?(\d+)`?(?! documents)", text)
    assert said, f"{name} does not say the schema version"
    assert set(said) == {str(SCHEMA_VERSION)}, (name, said)


def test_schema_migration_note():
    assert re.search(r"schema 1 .*(hostname|machine_id|generated_at)", README.replace("\n", " "))


def test_schema_file_named_in_the_readme_exists():
    paths = re.findall(r"`(daemon/\S+\.json)`", README)
    assert paths and all((REPO / p).is_file() for p in paths), paths


def test_prometheus_file_name_is_the_daemons():
    from spark_memsaver.service.monitor import DEFAULT_TEXTFILE
    for name, text in (("README.md", README), ("docs/spark-memsaver.8", plain(MAN)),
                       ("monitoring/README.md", (REPO / "monitoring/README.md").read_text())):
        for prom in re.findall(r"[\w./-]+\.prom\b", text):
            assert os.path.basename(prom) == os.path.basename(DEFAULT_TEXTFILE), (name, prom)


def test_json_claim_is_the_command_trees():
    """The man page said every command accepts --json; `metrics` does not."""
    yes, no = gen_docs().json_commands()
    assert len(yes) > 10
    m = re.search(r"Every command(?: but ([^\n]+?))?\s+accepts\s+--json", plain(MAN))
    assert m, "the man page does not say which commands take --json"
    named = sorted(re.findall(r"[a-z]+(?: [a-z]+)?", m.group(1) or ""))
    assert named == sorted(no), (named, no)


def test_readme_sections_once():
    heads = re.findall(r"^#{1,3} (.+)$", re.sub(r"```.*?```", "", README, flags=re.S), re.M)
    assert len(heads) == len(set(heads)), [h for h in heads if heads.count(h) > 1]


def test_exit_code_tables_are_exitcodes():
    rows = re.findall(r"^\| (\d) \| (.+) \|$", README, re.M)
    want = [(str(c), m) for c, m in exitcodes.TABLE] + [(str(c), m) for c, m in exitcodes.QUIET_TABLE]
    assert rows == want
    man = plain(MAN).split("EXIT STATUS", 1)[1].split(".SH", 1)[0]
    for c, m in list(exitcodes.TABLE) + list(exitcodes.QUIET_TABLE):
        assert re.search(rf"^\.TP\n{c}\n", man, re.M), c
        assert m.replace("`", "").split(" (")[0].lower() in man.replace("\n", " ").lower(), m


def _tag_options(tag: str) -> set[str]:
    return set(re.findall(r"(--[a-z][a-z-]*)", tag))


def test_man_command_tags_name_each_commands_options():
    """Each COMMANDS entry's synopsis names exactly the options the command has (click's tree)."""
    text = plain_lines(MAN).split("\n.SH COMMANDS\n", 1)[1].split("\n.SH ", 1)[0]
    tags = {}
    for block in text.split("\n.TP\n")[1:]:
        tag = block.split("\n", 1)[0]
        tag = re.sub(r'^\.(B|BR|RB)\s+', "", tag).replace('"', "")
        words = tag.split()
        names = [" ".join(words[:2]), words[0]]
        tags[tag] = names
    by_path = dict(gen_docs().leaf_commands())
    problems = []
    for tag, names in tags.items():
        if "|" in tag and " | " in tag and tag.count("mok") + tag.count("patch") > 1:
            continue                     # 'mok status | mok enroll | mok cancel': a family line, no options
        path = next((n for n in names if n in by_path), None)
        if path is None:
            problems.append(f"{tag!r}: no such command")
            continue
        have = {o for p in by_path[path].params if not getattr(p, "hidden", False) for o in p.opts
                if o.startswith("--") and o != "--help"}
        said = _tag_options(tag)
        if said - have:
            problems.append(f"{path}: the man page names {sorted(said - have)}, which it does not have")
        if have - said:
            problems.append(f"{path}: the man page omits {sorted(have - said)}")
    assert problems == []


def test_generated_sections_are_current():
    p = subprocess.run([sys.executable, str(REPO / "tools/gen-docs"), "--check"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_readme_names_every_missing_piece_install_refuses_for():
    """README's list of the findings that block install is installability's list of codes."""
    import re as _re
    from spark_memsaver.decide.installability import CODES
    m = _re.search(r"one finding per missing piece\s*\(([^)]*)\)", README)
    assert m, "README does not list the missing pieces"
    said = set(_re.findall(r"`([a-z-]+)`", m.group(1)))
    assert said == set(CODES.values()) - {"unknown-kernel"}


def test_man_global_options_are_the_root_groups():
    import click
    from spark_memsaver.cli.main import cli
    text = plain_lines(MAN).split("\n.SH GLOBAL OPTIONS\n", 1)[1].split("\n.SH ", 1)[0]
    said = set(re.findall(r"^\.B[IR]? (--[a-z-]+)", text, re.M)) | set(re.findall(r"^\.BR -h.*(--help)", text, re.M))
    have = {o for p in cli.params if isinstance(p, click.Option) for o in p.opts if o.startswith("--")} | {"--help"}
    assert said == have, (said, have)


def test_readme_usage_lines_run_as_written():
    """Each line of README's 'Using it' block parses with the CLI's own parser (brackets and alternatives read
    as their first form) and carries sudo exactly where the command needs root."""
    from spark_memsaver import remedy
    from tests.support.cliparse import parse, split
    block = README.split("## Using it", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    for line in block.splitlines():
        cmd = line.split("#", 1)[0].strip()
        cmd = re.sub(r"\[([^\]|]+)(?:\|[^\]]*)?\]", r"\1", cmd)      # [--kernel K|--all] -> --kernel K
        cmd = cmd.replace("--max-gib N", "--max-gib 8")                    # a placeholder of a number
        sudo, argv = split(cmd)
        parse(" ".join(["sudo"] * sudo + argv))
        assert sudo == remedy.needs_root(" ".join(argv)), line


def test_secure_boot_state_table_remedies_run_as_written():
    """docs/secure-boot.md's States table: each command of the remedy column carries sudo exactly where the
    tool's own remedy does (it said `spark-memsaver mok enroll`, `mokutil --revoke-delete`)."""
    from spark_memsaver import remedy
    from tests.test_remedies import check_command
    text = (REPO / "docs/secure-boot.md").read_text().split("## States", 1)[1].split("\n\n", 2)[1]
    rows = [ln.split("|")[1:-1] for ln in text.splitlines() if ln.startswith("| `")]
    assert len(rows) >= 8, rows
    cmds = [c for row in rows for c in re.findall(r"`([^`]+)`", row[-1])
            if remedy._COMMAND_START.match(c)]
    assert len(cmds) >= 3 and [p for c in cmds for p in check_command(c)] == [], cmds


def test_metric_types_are_the_expositions():
    """monitoring/README.md's type column is the exposition's # TYPE of each family, every family is listed, and
    the Prometheus naming rule holds: a name ending in _total is a counter and a counter's name ends in _total
    (spark_memsaver_rollbacks_total, typed counter, counted the rollback records kept now, which go down)."""
    from spark_memsaver.report.metrics import exposition
    sample = {"backing_bytes": 1, "stock_bytes": 2, "mem_total": 3, "mem_available": 4, "saved_bytes": 1,
              "packing_active": True}
    text = exposition({"state": "active", "records": {"rollbacks": [{}]}}, sample_time=1, sample=sample)
    code = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    table = (REPO / "monitoring/README.md").read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    said = dict(re.findall(r"^\| `(spark_memsaver_\w+)` \| (\w+) \|", table, re.M))
    assert said == {n: t for n, t in code.items() if n in said}, "the README's types are not the code's"
    assert set(code) - set(said) <= {"spark_memsaver_pagetable_backing_bytes", "spark_memsaver_pagetable_stock_bytes",
                                     "spark_memsaver_memory_total_bytes", "spark_memsaver_memory_available_bytes"}
    for name, typ in {**code, **said}.items():
        assert name.endswith("_total") == (typ == "counter"), (name, typ)


def _man_section(name: str) -> str:
    return plain_lines(MAN).split(f"\n.SH {name}\n", 1)[1].split("\n.SH ", 1)[0]


def test_man_files_are_the_codes_locations():
    """FILES said build logs are in /var/cache/spark-memsaver/ while the code writes /var/lib/spark-memsaver/logs:
    each of the package's own locations the man page names is one of host/paths.py's, said as paths.DOCUMENTED
    says (tools/gen-docs writes them), and build logs are where act/build.py writes them."""
    from spark_memsaver.act import dkms_run
    from spark_memsaver.host import paths
    text = _man_section("FILES")
    entries = {}
    for block in text.split("\n.TP\n")[1:]:
        head, _, body = block.partition("\n")
        entries[re.sub(r"^\.I\s+", "", head).split(" ", 1)[0]] = body.replace("\n", " ")
    ours = {p: t for p, t in entries.items()
            if p.startswith(tuple(d.rstrip("/") for d in (paths.STATE_DIR, paths.CACHE_DIR, paths.RUN_DIR,
                                                          os.path.dirname(paths.CONFIG_FILE))))}
    documented = {p: plain(gen_docs().roff(t)).replace("\n", " ") for p, t in paths.DOCUMENTED}
    assert set(ours) - {"/etc/spark-memsaver/no-hooks"} == set(documented)
    for p, t in documented.items():
        assert ours[p].startswith(t.split(" (")[0]), (p, ours[p])
    logs = [p for p, t in entries.items() if re.search(r"\bbuild logs?\b", t, re.I)]
    assert logs == [paths.LOG_DIR + "/"] and dkms_run.LOG_DIR == paths.LOG_DIR
    assert "guard.log" in entries[paths.RUN_DIR + "/"] and paths.GUARD_LOG.startswith(paths.RUN_DIR + "/")


def test_man_examples_run_as_written():
    """EXAMPLES said `spark-memsaver install --all`: each line parses with the CLI's parser and carries sudo exactly
    where the command needs root (remedy.needs_root, what every remedy and --help example follows)."""
    from spark_memsaver import remedy
    from tests.support.cliparse import parse, split
    block = _man_section("EXAMPLES").split(".nf\n", 1)[1].split("\n.fi", 1)[0]
    lines = [ln.split("#", 1)[0].strip() for ln in block.splitlines() if ln.strip()]
    assert len(lines) >= 4 and any(ln.startswith("sudo ") for ln in lines)
    for line in lines:
        sudo, argv = split(line)
        parse(line)
        assert sudo == remedy.needs_root(" ".join(argv)), line


def test_history_limits_say_what_each_bounds():
    """history_size was "samples the daemon keeps" while the on-disk history is kept 7 days whatever it says: its
    meaning (README, the man page, config.yaml's comment) names what it bounds (the daemon's in-memory ring, what
    D-Bus GetHistory reads) and the on-disk retention, which the code bounds by time alone."""
    from spark_memsaver.config import Config
    from spark_memsaver.service import history
    days = history.RETENTION_S // 86400
    meaning = config_keys.MEANING["history_size"]
    assert "memory" in meaning and "GetHistory" in meaning, meaning
    assert f"kept {days} days" in meaning and "spark-memsaver history" in meaning, meaning
    shipped = (REPO / "systemd/config.yaml").read_text().split("# history_size:", 1)[1].split("\n#\n", 1)[0]
    assert "memory" in shipped and f"kept {days} days" in shipped, shipped
    assert f"{days} days" in _man_section("COMMANDS").split("history", 1)[1].split(".TP", 1)[0]
    # what the words claim: the ring is history_size long; the files are bounded by RETENTION_S, not by it
    interval = Config().interval
    assert history.capacity(interval) == history.RETENTION_S // interval != Config().history_size


DOC = "/usr/share/doc/spark-memsaver"


def _help(*args) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    return subprocess.run([sys.executable, "-m", "spark_memsaver", *args, "--help"], capture_output=True, text=True,
                          env=env).stdout


def package_doc_paths() -> dict[str, set[str]]:
    """Every /usr/share/doc/spark-memsaver/... path the README, the man page and `metrics --help` name."""
    texts = {"README.md": README, "spark-memsaver(8)": plain(MAN).replace("\n", " "),
             "metrics --help": _help("metrics"), "config.yaml": (REPO / "systemd/config.yaml").read_text()}
    return {name: set(re.findall(re.escape(DOC) + r"/[\w./-]*[\w/]", t)) for name, t in texts.items()}


def installed_files(tmp_path: Path) -> set[str]:
    """The files packaging/debian/install-files puts into the package (as debian/rules runs it), absolute."""
    src = tmp_path / "src"
    src.mkdir()
    for p in REPO.iterdir():
        if p.name not in ("debian", ".git"):
            (src / p.name).symlink_to(p)
    (src / "debian").mkdir()
    r = subprocess.run([sys.executable, str(REPO / "packaging/debian/install-files"), "debian/spark-memsaver",
                        str(REPO / "packaging/debian/spark-memsaver.files")], cwd=src, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    pkg = src / "debian/spark-memsaver"
    return {"/" + str(p.relative_to(pkg)) for p in pkg.rglob("*") if p.is_file()}


def test_examples_the_docs_point_at_are_in_the_package(tmp_path):
    """The man page, the README and `metrics --help` sent a node's administrator to monitoring/README.md and
    ansible/, which the .deb did not ship: they are shipped under /usr/share/doc/spark-memsaver/examples/, and
    every path there the documents name is a file the package installs (or a folder holding some)."""
    files = installed_files(tmp_path)
    for want in ("monitoring/README.md", "monitoring/alerts.yml", "monitoring/grafana-dashboard.json",
                 "ansible/README.md", "ansible/install.yml", "ansible/roles/spark_memsaver/tasks/main.yml"):
        assert f"{DOC}/examples/{want}" in files, want
    named = package_doc_paths()
    assert all(named.values()), named
    for where, found in named.items():
        for p in found:
            assert p in files or any(f.startswith(p.rstrip("/") + "/") for f in files), (where, p)
    # on a node (the man page, --help, the config file) no bare monitoring/ or ansible/ is left to look for
    for where, text in (("spark-memsaver(8)", plain(MAN)), ("metrics --help", _help("metrics")),
                        ("config.yaml", (REPO / "systemd/config.yaml").read_text())):
        flat = re.sub(r"\s+", " ", text)
        bare = re.findall(r"(?<![\w/.-])(?:monitoring|ansible)/README\.md", flat)
        assert bare == [], (where, bare)


def test_the_dbus_properties_are_the_one_table_in_the_code():
    """docs/dbus-api.md's Properties table names each property of service/dbus_service.PROPERTIES (the one list:
    introspection, GetAll and PropertiesChanged read it) with its D-Bus type, and none the code lacks."""
    from spark_memsaver.service.dbus_service import PROPERTIES
    section = DBUS.split("## Properties", 1)[1].split("\n## ", 1)[0]
    documented = {}
    for names, types in re.findall(r"^\| (`[^|]*`) \| ([^|]+) \|", section, re.M):
        for n, t in zip(re.findall(r"`(\w+)`", names), [x.strip() for x in types.split("/")]):
            documented[n] = t
    assert documented == PROPERTIES, (set(documented.items()) ^ set(PROPERTIES.items()))
