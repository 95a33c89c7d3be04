"""The README's first screen tells the truth the code and the other documents tell.

- its supported-drivers table is generated from uvm_patch/manifest.yaml (tools/gen-readme --check);
- the savings figure is the same in the README, the package description and the man page, and no older
  figure (~3 GiB, 3119.9 MiB) survives there;
- the shipped config and the README agree on the default tier.
"""

import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
FIGURE = "1.8 GiB"


def test_readme_supported_section_is_generated_from_the_manifest():
    p = subprocess.run([sys.executable, str(REPO / "tools/gen-readme"), "--check"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    manifest = yaml.safe_load((REPO / "uvm_patch/manifest.yaml").read_text())
    readme = (REPO / "README.md").read_text()
    for d in manifest["drivers"]:
        for v in d.get("versions", []):
            assert v in readme, f"driver {v} of the manifest is missing from the README"


def test_one_savings_figure_everywhere():
    docs = {"README.md": (REPO / "README.md").read_text(),
            "packaging/debian/control": (REPO / "packaging/debian/control").read_text(),
            "docs/spark-memsaver.8": (REPO / "docs/spark-memsaver.8").read_text().replace("\\", "")}
    for name, text in docs.items():
        assert FIGURE in text, f"{name} does not give the savings figure {FIGURE}"
        for stale in ("~3 GiB", "about 3 GiB", "3119.9", "3.26"):
            assert stale not in text, f"{name} still carries the old figure {stale!r}"


def test_readme_and_shipped_config_agree_on_the_default_tier():
    from spark_memsaver.config import Config
    readme = (REPO / "README.md").read_text()
    row = next(ln for ln in readme.splitlines() if ln.startswith("| `tier` |"))
    default = re.match(r"\| `tier` \| `([^`]+)` \|", row).group(1)
    assert default == str(Config().tier), (default, Config().tier)
    shipped = (REPO / "systemd/config.yaml").read_text()
    assert f"#tier: {default}" in shipped
