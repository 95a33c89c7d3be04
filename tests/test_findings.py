"""The finding codes are one list (issue 34, item 4): decide/findings.CODES. Every code decide/ can give is in it
with the severity it gives; docs/architecture.md's table is written from it (tools/gen-docs; the table is checked
current by tests/test_docs_vs_code.py); tests/test_remedies.py's walk reaches each (its every_finding_code is this
list). So a new finding without a registry row, a doc line or a state that shows it fails here or there."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from spark_memsaver.decide import installability as inst
from spark_memsaver.decide import mok as dm
from spark_memsaver.decide import wayback
from spark_memsaver.decide.findings import CODES, SEVERITIES
from spark_memsaver.hazard_table import HazardsInvalid, load_hazards

REPO = Path(__file__).resolve().parent.parent
DECIDE = REPO / "daemon/spark_memsaver/decide"
# the Finding(...) calls whose code is not a literal, and the codes each can give
DYNAMIC = {
    'f"mok-{sb_state}"': {f"mok-{s}" for s in dm.STATES if not dm.state_loadable(s) and s != "unknown"},
    'm["code"]': set(inst.CODES.values()) | {"driver-source-corrupt"},       # installability's missing pieces
    "other.code": {"signed-with-other-key"},
    "**x": set(),                                                             # the hazards' dicts, below
    "*x": {wayback.CODE, wayback.UNREADABLE},                                  # decide/wayback.findings' tuples
}


def finding_calls() -> list[tuple[str, str, str]]:
    """(file, first argument, second argument) of every Finding(...) call in decide/."""
    out = []
    for p in sorted(DECIDE.glob("*.py")):
        text = p.read_text()
        for m in re.finditer(r"\bFinding\(\s*((?:f?\"[^\"]*\")|[^,()]+(?:\[[^\]]*\])?)\s*(?:,\s*([^,\n]+))?", text):
            if "class Finding" in text[max(0, m.start() - 6):m.start() + 8]:
                continue
            out.append((p.name, m.group(1).strip(), (m.group(2) or "").strip()))
    return out


def test_every_code_decide_gives_is_in_the_one_list_with_its_severity():
    calls = finding_calls()
    assert len(calls) > 25, calls
    problems = []
    for name, code, sev in calls:
        if code.startswith('"'):
            c = code.strip('"')
            if c not in CODES:
                problems.append(f"{name}: {c} is not in decide/findings.CODES")
                continue
            lit = re.match(r'"(\w+)"', sev)
            if lit and lit.group(1) not in CODES[c][0]:
                problems.append(f"{name}: {c} given as {lit.group(1)}, CODES says {CODES[c][0]}")
        elif code not in DYNAMIC:
            problems.append(f"{name}: Finding({code}, ...): a code this test cannot follow; add it to DYNAMIC")
        else:
            problems += [f"{name}: {code} gives {c}, not in CODES" for c in DYNAMIC[code] - set(CODES)]
    assert problems == []
    # the hazards' own findings (decide/hazards.py builds them as dicts)
    text = (DECIDE / "hazards.py").read_text()
    own = set(re.findall(r'"code": "([a-z0-9-]+)"', text)) | {HazardsInvalid.code}
    assert own <= set(CODES), own - set(CODES)
    table = {h.code for h in load_hazards((REPO / "uvm_patch/hazards.yaml").read_text())}
    assert not table & set(CODES), "a hazard's code is also a finding of decide/: two meanings"


def test_the_list_is_well_formed_and_documented():
    doc = (REPO / "docs/architecture.md").read_text()
    section = doc.split("<!-- generated:findings begin -->", 1)[1].split("<!-- generated:findings end -->", 1)[0]
    for code, (sevs, what) in CODES.items():
        assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", code) and sevs and set(sevs) <= set(SEVERITIES) and what, code
        assert f"| `{code}` | {' or '.join(sevs)} |" in section, f"{code}: no line in docs/architecture.md"
    assert section.count("\n| `") == len(CODES)


def test_a_code_outside_the_list_is_seen(tmp_path, monkeypatch):
    """The scan sees a finding added without a row (it cannot pass by missing the call)."""
    fake = tmp_path / "decide"
    fake.mkdir()
    for p in DECIDE.glob("*.py"):
        (fake / p.name).write_text(p.read_text())
    (fake / "status.py").write_text((fake / "status.py").read_text() + '\nFinding("brand-new", "warning", "m")\n')
    monkeypatch.setattr(sys.modules[__name__], "DECIDE", fake)
    codes = {c for _, c, _ in finding_calls()}
    assert '"brand-new"' in codes and "brand-new" not in CODES
