"""Configuration: defaults, the shipped file, and every kind of bad file (exit 2, file + key named)."""

import os
import stat

import pytest

from spark_memsaver import config as cfg
from spark_memsaver.errors import ConfigError
from tests.test_status import cli, REPO


def test_defaults_without_file(tmp_path):
    c = cfg.load(root=str(tmp_path))
    # the default tier is "leaf" since the tier vocabulary of decide/policy.py (0.1.0: "4k", now "4k-all")
    assert (c.kernels, c.tier, c.interval, c.prometheus_textfile) == ("64k-only", "leaf", 60, None)
    assert c.source == "defaults"


def test_shipped_file_parses_to_defaults():
    shipped = REPO / "systemd/config.yaml"
    c = cfg.load(str(shipped))
    assert c == cfg.Config()


@pytest.mark.parametrize("text,key,expected", [
    ("kernels: 4k-only\n", "kernels", "one of: 64k-only, all"),
    ("tier: 512\n", "tier", "one of: leaf, 4k-all, 256"),   # 0.1.0's list was "4k, 256"
    ("interval: fast\n", "interval", "integer number of seconds"),
    ("interval: 1\n", "interval", "between 5 and 86400"),
    ("interval: true\n", "interval", "integer"),
    ("prometheus_textfile: metrics.prom\n", "prometheus_textfile", "absolute path"),
    ("auto_build: yes please\n", "auto_build", "true or false"),
    ("colour: blue\n", "colour", "known keys"),
])
def test_wrong_values_name_file_key_and_expectation(tmp_path, text, key, expected):
    p = tmp_path / "config.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        cfg.load(str(p))
    assert str(p) in e.value.message and key in e.value.message and expected in e.value.message
    assert e.value.details["line"] == 1 and f"{p}, line 1: " in e.value.message
    r = cli("--config", str(p), "build", "--dry-run")       # build and install refuse an unusable file
    assert r.returncode == 2
    assert key in r.stderr and str(p) in r.stderr and "remedy:" in r.stderr
    assert "Traceback" not in r.stderr


def test_tier_256_accepted_as_number_or_string(tmp_path):
    for text in ("tier: 256\n", "tier: '256'\n"):
        p = tmp_path / "c.yaml"
        p.write_text(text)
        assert cfg.load(str(p)).tier == "256"


@pytest.mark.parametrize("text,needle", [
    ("kernels: [unclosed\n", "not valid YAML (line"),
    ("- just\n- a list\n", "expected a mapping"),
    (b"\xff\xfe garbage", "not UTF-8"),
])
def test_not_yaml(tmp_path, text, needle):
    p = tmp_path / "config.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    r = cli("--config", str(p), "install", "--dry-run", "--json")
    assert r.returncode == 2, r.stdout
    import json
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "config-invalid" and needle in err["message"] and str(p) in err["message"]
    # status goes on over the built-in defaults and says it once (issue 35)
    r = cli("--config", str(p), "status", "--json", "--direct")
    assert r.returncode != 2 and "Traceback" not in r.stderr, r.stderr
    bad = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "config-invalid"]
    assert len(bad) == 1 and needle in bad[0]["message"] and str(p) in bad[0]["message"], bad


def test_missing_explicit_file_and_env(tmp_path):
    missing = tmp_path / "nope.yaml"
    r = cli("--config", str(missing), "install", "--dry-run")
    assert r.returncode == 2 and "not found" in r.stderr
    r = cli("install", "--dry-run", env={"SPARK_MEMSAVER_CONFIG": str(missing)})
    assert r.returncode == 2 and str(missing) in r.stderr


def test_unreadable_file(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("tier: 4k\n")
    os.chmod(p, 0)
    if os.geteuid() == 0:
        # root reads anything: make it a directory instead, which no one can read as a file
        os.chmod(p, stat.S_IRUSR)
        p.unlink()
        p.mkdir()
    r = cli("--config", str(p), "install", "--dry-run")
    assert r.returncode == 2 and ("cannot read" in r.stderr or "not a regular file" in r.stderr), r.stderr


def test_empty_file_means_defaults(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("# all defaults\n")
    assert cfg.load(str(p)) == cfg.Config()


def test_config_show_json(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("kernels: all\ninterval: 30\n")
    r = cli("--config", str(p), "config", "show", "--json")
    import json
    d = json.loads(r.stdout)
    assert d["kernels"] == "all" and d["interval"] == 30 and d["source"] == str(p)


def test_old_tier_name_still_works_and_says_it_was_renamed(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("tier: 4k\n")
    c = cfg.load(str(p))
    assert c.tier == "4k-all" and c.notes and "old name of '4k-all'" in c.notes[0] and str(p) in c.notes[0]
    from spark_memsaver.decide import policy
    assert policy.tier_value(c.tier) == 1 and policy.tier_value("4k") == 1
    assert (policy.tier_value("leaf"), policy.tier_value("256")) == (3, 2)
    r = cli("--config", str(p), "status", "--json")
    import json
    doc = json.loads(r.stdout)
    assert "config-renamed" in [f["code"] for f in doc.get("findings", [])], doc.get("findings")
