"""The proof that every path agrees (issue 34, item 6): node states generated over the fixture's dimensions
(tests/support/statespace.py: base roots from tests/support/sparkroot.py -- kernels, ours installed or not,
DKMS registered / built / installed, what is loaded, the driver loaded, holders, Secure Boot and the MOK key,
holds, interrupted operations, records of each kind (also corrupt), configurations, the driver source), and for
each state, with the real CLI called in this process (tests/support/inproc.py):

  a. status text, --json, --quiet and metrics agree (state, exit codes, hold, tier, findings, Next), and the lean status
     entry says byte for byte what the click command says (text, --json, -q);
  b. Next names a command whose --dry-run does not refuse and whose first planned step is what Next asks for; a
     Next that enrolls a key names the key ours (installed for the running kernel) is signed with;
  d. install/build/remove --all plan (or refuse) exactly what --kernel K does for each kernel K;
then, for a subset (the first PER_KIND states of each kind of Next, and every FOLLOW-th state if set: a real run
costs real dkms, depmod and records):
  c. following Next for real on the state's own copy (every command of its '&&' chain) changes the state or its
     findings, and reaches "nothing to do" or a step for a person (the console, a reboot, stopping the CUDA work,
     apt, a GPU for validate) within 6 steps; install, build, reconcile's builds, activate, reloads and
     `mok enroll` are followed through the stand-ins of tests/support/standins.py (the compile in `dkms build`,
     modprobe through the guard's rule, mokutil --import's firmware variables);
  e. each remove/rollback it runs records the steps its dry run planned;
and once (it does not depend on the node): f. every mutating command run by a user without root on the live
system refuses with not-permitted (exit 1), never an internal error.

For a read-only check the observation is made once per state (world.facts memoised while the state's read-only
commands run: each CLI path renders the same reading, as each would on a node that does not change between
them). SPARK_MEMSAVER_STATE_SPACE=N runs N states (default 500), SPARK_MEMSAVER_STATE_SEED the seed,
SPARK_MEMSAVER_STATE_FOLLOW / _PER_KIND the followed subset. A failure names the seed and the smallest failing
state. With -s it prints `state-space: N states, M checks` and a second line: how many followed states began with
each kind of Next, and how often each command was run while following."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spark_memsaver import exitcodes, remedy as rm
from spark_memsaver.decide import plan as rc
from spark_memsaver.decide.packing import running_tier, tier_of
from spark_memsaver.report.summary import next_step
from tests.support import needs, standins, statespace as ss
from tests.support.cliparse import parse, split
from tests.support.inproc import cli

N = int(os.environ.get("SPARK_MEMSAVER_STATE_SPACE", "500"))
SEED = int(os.environ.get("SPARK_MEMSAVER_STATE_SEED", "34"))
# followed for real (c, e): the first PER_KIND states of each kind of Next, and every FOLLOW-th state (0: none)
FOLLOW = int(os.environ.get("SPARK_MEMSAVER_STATE_FOLLOW", "0"))
PER_KIND = int(os.environ.get("SPARK_MEMSAVER_STATE_PER_KIND", "6"))
MAX_STEPS = 6
REPO = Path(__file__).resolve().parent.parent
FIRST_STEP = {"install": ("release-hold", "fetch-source", "build"), "build": ("fetch-source", "build"),
              "remove": ("hold",), "rollback": ("remove", "reload-uvm")}
DRY = {"install", "build", "remove", "rollback", "activate", "reconcile", "mok enroll", "mok cancel"}


@contextlib.contextmanager
def observed_once():
    """world.facts memoised per (root, config): the read-only commands of one state share one observation."""
    from spark_memsaver import world
    real, memo = world.facts, {}

    def facts(host, config):
        key = (str(host.root), repr(config))
        if key not in memo:
            memo[key] = real(host, config)
        return memo[key]
    world.facts = facts
    try:
        yield
    finally:
        world.facts = real


def rows_of(text: str) -> dict:
    rows = {}
    for ln in text.split("\nKernels:", 1)[0].splitlines():
        m = re.match(r"^([A-Za-z][A-Za-z -]*):\s+(.*)$", ln)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


_STAMP = re.compile(r'"generated_at": "[^"]*"')


def check_agree(root: str) -> tuple[dict, list[str]]:
    """a. One reading, four renderings."""
    code_j, out, err = cli("--root", root, "status", "--json")
    if not out.startswith("{") or "error" in json.loads(out):
        return {}, [f"status --json failed (exit {code_j}): {out[:300]} {err[:300]}"]
    doc = json.loads(out)
    code_t, text, text_err = cli("--root", root, "status")
    quiet, _, _ = cli("--root", root, "status", "--quiet")
    _, metrics, _ = cli("--root", root, "metrics")
    rows, p = rows_of(text), []
    # the lean status entry (cli/status.py) and the click command say the same, byte for byte (issue 38)
    for form, lean in ((["--json"], (code_j, out, err)), ([], (code_t, text, text_err)), (["--quiet"], (quiet,))):
        via_click = cli("--root", root, "status", *form, click=True)[:len(lean)]
        if tuple(_STAMP.sub("<time>", x) if isinstance(x, str) else x for x in via_click) != \
                tuple(_STAMP.sub("<time>", x) if isinstance(x, str) else x for x in lean):
            p.append(f"status {' '.join(form)}: the lean entry and click differ")
    if rows.get("State") != doc["state"]:
        p.append(f"text State {rows.get('State')!r} != json {doc['state']!r}")
    if code_t != exitcodes.status_code(doc) or quiet != exitcodes.quiet_code(doc):
        p.append(f"exit codes: status {code_t}, -q {quiet}; the document says {exitcodes.status_code(doc)}, "
                 f"{exitcodes.quiet_code(doc)}")
    if f'spark_memsaver_state{{state="{doc["state"]}"}} 1' not in metrics:
        p.append(f"metrics state is not {doc['state']}")
    held_m = sum(int(v) for v in re.findall(r'^spark_memsaver_held\{by="[^"]+"\} (\d+)$', metrics, re.M))
    if (("Hold" in rows), held_m) != (bool(doc.get("hold")),) * 2 and not (bool(doc.get("hold")) == ("Hold" in rows)
                                                                          == bool(held_m)):
        p.append(f"hold: json {bool(doc.get('hold'))}, text {'Hold' in rows}, metrics held {held_m}")
    m = re.search(r'^spark_memsaver_info\{[^}]*tier="([^"]*)"', metrics, re.M)
    if not m or m.group(1) != tier_of(doc):
        p.append(f"metrics tier {m and m.group(1)!r} != the document's {tier_of(doc)!r}")
    run = running_tier(doc.get("uvm"))
    if run and f"tier {run}" not in rows.get("nvidia-uvm", ""):
        p.append(f"plain status does not show the running tier {run}: {rows.get('nvidia-uvm')!r}")
    for f in doc["findings"]:
        if f"[{f['severity']}] {f['code']}:" not in text:
            p.append(f"finding {f['code']} not in the text")
    for sev in ("info", "warning", "error"):
        n = sum(1 for f in doc["findings"] if f["severity"] == sev)
        if f'spark_memsaver_findings{{severity="{sev}"}} {n}' not in metrics:
            p.append(f"metrics findings {sev} != {n}")
    if rows.get("Next") != (next_step(doc) or "nothing to do"):
        p.append(f"text Next {rows.get('Next')!r} != {next_step(doc)!r}")
    return doc, p


def next_command(doc: dict, chain: bool = False):
    """The first command Next asks for (before any '&&': the first step), or None; ``chain``: every command of
    that first step's '&&' chain."""
    nxt = next_step(doc)
    cmds = rm.commands_in(nxt or "")
    if chain:
        return cmds[0].split(" && ") if cmds else []
    return cmds[0].split(" && ")[0] if cmds else None


def dry_run(root: str, cmd: str) -> tuple[int, dict | None, str]:
    _, argv = split(cmd)
    code, out, err = cli("--root", root, *argv[1:], "--dry-run", "--json")
    try:
        return code, json.loads(out), err
    except ValueError:
        return code, None, out + err


def check_next(root: str, doc: dict) -> list[str]:
    """b. Next's command: its dry run does not refuse and plans what Next asks for first."""
    cmd = next_command(doc)
    if cmd is None:
        return []
    _, argv = split(cmd)
    if argv[:1] != ["spark-memsaver"]:
        return []                       # a system program (apt-get, mokutil, modprobe): a person's step
    path, _ = parse(cmd)
    if path not in DRY:
        return []
    code, plan, err = dry_run(root, cmd)
    if path == "activate" and (plan or {}).get("at_next_boot") and (next_step(doc) or "").startswith("Stop "):
        return []                       # a person stops the CUDA work first: Next says so, activate waits for it
    if path == "reconcile" and (next_step(doc) or "").startswith("Stop ") and \
            any(s["action"] == "blocked" for s in own(plan or {})):
        return []                       # the same: reconcile waits (blocked) until /dev/nvidia-uvm is unused
    if code != 0 or plan is None or "error" in plan:
        return [f"Next {cmd!r}: its dry run refuses (exit {code}): {(plan or {}).get('error') or err[:300]}"]
    steps = own(plan)
    if path in FIRST_STEP and (not steps or steps[0]["action"] not in FIRST_STEP[path]):
        return [f"Next {cmd!r}: its dry run plans {[s['action'] for s in steps]}, not {FIRST_STEP[path]} first"]
    if path == "reconcile" and not any(s["action"] in rc.ACTING for s in steps):
        return [f"Next {cmd!r}: its dry run plans nothing that acts: {[s['action'] for s in steps]}"]
    if path == "activate" and plan.get("already"):
        return [f"Next {cmd!r}: ours is already loaded, activate would do nothing"]
    if path == "mok enroll":
        return enrolls_the_key_ours_is_signed_with(root, doc, cmd)
    return []


def _hex(x) -> str:
    return (x or "").replace(":", "").lower().lstrip("0")


def enrolls_the_key_ours_is_signed_with(root: str, doc: dict, cmd: str) -> list[str]:
    """Next enrolls a key: the nvidia-uvm installed for the running kernel, if ours, is signed with that key (its
    modinfo sig_key is the certificate's serial or key id), else enrolling it makes nothing load."""
    from spark_memsaver.host import Host
    from spark_memsaver.observe import modules
    run = next((k["release"] for k in doc["kernels"] if k.get("running")), None)
    sel = modules.read_selected(Host(root), run) if run else {}
    cert = (doc.get("secure_boot") or {}).get("certificate") or {}
    if sel.get("state") != "ours" or not sel.get("sig_key") or not cert.get("serial"):
        return []
    if _hex(sel["sig_key"]) not in {_hex(cert.get("serial")), _hex(cert.get("key_id"))}:
        return [f"Next {cmd!r}: ours for {run} is signed with key {sel['sig_key']}, not the certificate to enroll "
                f"(serial {cert.get('serial')})"]
    return []


def own(plan: dict) -> list[dict]:
    """A dry run's own steps, after what the run recovers first (act/dryrun.py lists that first)."""
    return (plan.get("steps") or [])[plan.get("recovery", 0):]


def _plan(root: str, *args) -> tuple[int, dict]:
    code, out, _ = cli("--root", root, *args, "--dry-run", "--json")
    plan = json.loads(out)
    if "steps" in plan:
        plan["steps"] = own(plan)
    return code, plan


def check_all(root: str, doc: dict) -> list[str]:
    """d. --all is --kernel K for each kernel (install, build, remove): plan, refusal, skipped rows."""
    p, kernels = [], sorted(k["release"] for k in doc["kernels"])
    for op in ("install", "build"):
        code_a, every = _plan(root, op, "--all")
        one = {k: _plan(root, op, "--kernel", k) for k in kernels}
        if code_a:
            first = next((one[k][1]["error"] for k in kernels if one[k][0]), None)
            if every.get("error") != first:
                p.append(f"{op} --all refuses with {every.get('error')}, --kernel K with {first}")
            continue
        want = [s for k in kernels if not one[k][0] for s in one[k][1]["steps"] if s["action"] != "release-hold"]
        got = [s for s in every["steps"] if s["action"] != "release-hold"]
        if got != want:
            p.append(f"{op} --all plans {[(s['action'], s['kernel']) for s in got]}, --kernel K "
                     f"{[(s['action'], s['kernel']) for s in want]}")
        skipped = {s["kernel"]: s["code"] for s in every.get("skipped", [])}
        if skipped != {k: one[k][1]["error"]["code"] for k in kernels if one[k][0]}:
            p.append(f"{op} --all skips {skipped}; --kernel K refuses {[k for k in kernels if one[k][0]]}")
    _, every = _plan(root, "remove", "--all")
    per = [s for k in kernels for s in _plan(root, "remove", "--kernel", k)[1]["steps"][1:]]
    strip = [s for s in per if s["action"] != "reload-uvm"]
    if [s for s in every["steps"][1:] if s["action"] != "reload-uvm"] != strip:
        p.append("remove --all plans other steps than remove --kernel K for each kernel")
    if any(s["action"] == "reload-uvm" for s in every["steps"]) != any(s["action"] == "reload-uvm" for s in per):
        p.append("remove --all and remove --kernel K disagree on reloading nvidia-uvm")
    return p


def recorded_remove(done: dict) -> list[tuple[str, str]]:
    out = []
    for r in done["restored"]:
        k = r["kernel"]
        out += [(d["action"][:-2] if d["action"].endswith("ed") else d["action"], k) for d in done["removed"]
                if d["kernel"] == k]
        out += [("restore-stock", k), ("depmod", k)] + ([("initramfs", k)] if "initramfs" in r else [])
    return [("uninstall" if a == "uninstall" else "unbuild" if a.startswith("unbuil") else a, k) for a, k in out] + \
        ([("reload-uvm", None)] if done.get("reload") else [])


def next_kind(doc: dict) -> str:
    """What Next asks for, by kind: a spark-memsaver command's path, a person's step, or nothing."""
    nxt = next_step(doc)
    if nxt is None:
        return "nothing to do"
    cmd = next_command(doc)
    _, argv = split(cmd or "")
    if argv[:1] != ["spark-memsaver"] or nxt.startswith(("Stop ", "Reboot ")):
        return "a person"               # the command it names is for afterwards, or another way
    return parse(cmd)[0]


def _running(doc: dict) -> str | None:
    return next((k["release"] for k in doc["kernels"] if k.get("running")), None)


def _der(root: str, cert: dict) -> bytes:
    """The certificate `mok enroll` hands mokutil (DER; a PEM file converted as enroll does)."""
    data = Path(root, (cert.get("path") or "").lstrip("/")).read_bytes()
    if data.lstrip().startswith(b"-----BEGIN"):
        data = subprocess.run(["openssl", "x509", "-outform", "DER"], input=data, capture_output=True,
                              check=True).stdout
    return data


def run_next(root: str, cmd: str, doc: dict, tier: str, ran: list) -> tuple[str | None, list[str]]:
    """One command of Next, run for real (the stand-ins where the node's own program is needed); (why following
    stops here or None, problems)."""
    p: list[str] = []
    _, argv = split(cmd)
    path = parse(cmd)[0]
    if path == "mok enroll":
        # mok enroll refuses --root (it writes the running machine's firmware): its dry run names the
        # certificate, and mokutil --import's effect on the firmware variables is made here (standins)
        code, plan, err = dry_run(root, cmd)
        if code != 0 or not plan or "error" in plan:
            return "failed", p + [f"{cmd!r}: its dry run refuses (exit {code}): {(plan or {}).get('error')}"]
        standins.mokutil_import(Path(root), _der(root, plan["certificate"]))
        ran.append(path)
        return None, p
    if path not in ("install", "build", "remove", "rollback", "reconcile", "activate"):
        return f"{path} (a person or a GPU)", p
    _, plan, _ = dry_run(root, cmd)
    code, out, err = cli("--root", root, *argv[1:], "--json")
    ran.append(path)
    if code != 0:
        return "failed", p + [f"{cmd!r} failed for real (exit {code}): {out[:400]} {err[:400]}"]
    done = json.loads(out)
    if path == "activate":
        # under --root activate plans modprobe (it loads on the running kernel only): the stand-in loads
        loaded = standins.modprobe_reload(Path(root), _running(doc), tier) if done.get("would_run") else {}
        if done.get("would_run") and loaded.get("srcversion") != done.get("expect_srcversion"):
            p.append(f"activate expects srcversion {done.get('expect_srcversion')}, the guard loaded "
                     f"{loaded.get('filename')} ({loaded.get('srcversion')})")
        return None, p
    first = [s["action"] for s in plan["steps"][:plan.get("recovery", 0)]]
    if first != [r["action"] for r in done.get("recovered", [])]:
        p.append(f"{path}: planned to recover {first}, recovered {done.get('recovered')}")
    if first:
        plan["steps"] = []          # its own steps were planned before recovery changed the node: not compared
    elif path == "remove":
        want = [(s["action"], s["kernel"]) for s in plan["steps"] if s["action"] != "hold"]
        if recorded_remove(done) != want:
            p.append(f"remove: planned {want}, recorded {recorded_remove(done)}")
    elif path == "rollback":
        want = sorted(s["kernel"] for s in plan["steps"] if s["action"] == "remove")
        if want != sorted(k["kernel"] for k in done["kernels"]) or \
                any(s["action"] == "reload-uvm" for s in plan["steps"]) != (done.get("reload") is not None):
            p.append(f"rollback: planned {plan['steps']}, did {done}")
    reloads = [done.get("reload")] + [s.get("result") for s in done.get("steps") or []
                                      if isinstance(s, dict) and s.get("action") == "reload-uvm"]
    if any((r or {}).get("skipped") == "not the running system" for r in reloads):
        standins.modprobe_reload(Path(root), _running(doc), tier)     # modprobe acts on the running node only
        ran.append("reload")
    return None, p


def follow(root: str, tier: str) -> tuple[str, list[str], list[str]]:
    """c and e: run Next for real until nothing is left or a person's step (the console, a reboot, stopping the
    CUDA work, apt, a GPU for validate), on this root with the stand-ins (tests/support/standins.py: the compile
    in dkms build, modprobe's reload through the guard, mokutil --import). Returns (how it ended, problems, the
    kinds of Next it ran)."""
    p, seen, ran = [], [], []
    for _ in range(MAX_STEPS + 1):
        code, out, err = cli("--root", root, "status", "--json")
        doc = json.loads(out)
        nxt, kind = next_step(doc), next_kind(doc)
        fp = (doc["state"], sorted(f["code"] for f in doc["findings"]), nxt)
        if nxt is None:
            return "nothing to do", p, ran
        if fp in seen:
            return "loop", p + [f"following Next loops: {fp} (after {ran})"], ran
        seen.append(fp)
        if len(seen) > MAX_STEPS:
            return "too long", p + [f"Next not done within {MAX_STEPS} steps: {seen}"], ran
        if kind == "a person":
            return "a person's step", p, ran
        for cmd in next_command(doc, chain=True):      # "A && B": a person runs both
            end, q = run_next(root, cmd, doc, tier, ran)
            p += q
            if end:
                return end, p, ran
    return "too long", p, ran


def _as_nobody(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "daemon"))
    env.pop("SPARK_MEMSAVER_CONFIG", None)
    kw = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    return subprocess.run([sys.executable, "-m", "spark_memsaver", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd="/", **kw)


MUTATING = (("install",), ("install", "--all"), ("build",), ("build", "--all"), ("remove",), ("remove", "--all"), ("rollback",),
            ("activate",), ("reconcile",))


def test_state_space(tmp_path, monkeypatch):
    needs.require("gcc", "depmod", "modinfo", "openssl", "dkms")
    rng = random.Random(SEED)
    bases = ss.make_bases(tmp_path / "bases")
    states = ss.sample(rng, N)
    prebuilt = standins.prebuild(tmp_path / "prebuilt", (ss.DRIVER, ss.OLD), (ss.K, ss.K2))
    failures, checks, ends, kinds, started = [], 0, {}, {}, {}
    for i, st in enumerate(states):
        root = str(ss.build(st, bases, tmp_path / f"s{i}"))
        with observed_once():
            doc, p = check_agree(root)
            checks += 1
            if doc:
                p += check_next(root, doc) + check_all(root, doc)
                checks += 2
        kind = next_kind(doc) if doc else None
        if doc and ((FOLLOW and i % FOLLOW == 0) or started.get(kind, 0) < PER_KIND):
            # the real dkms on this root's tree for the arm64 node it stands for, its compile stood in for
            monkeypatch.setenv("SPARK_MEMSAVER_DKMS", str(standins.dkms_wrapper(tmp_path / f"dkms{i}", Path(root),
                                                                                prebuilt)))
            end, q, ran = follow(root, "256" if st["config"] == "tier-256" else "leaf")
            started[kind] = started.get(kind, 0) + 1
            ends[end] = ends.get(end, 0) + 1
            for k in ran:
                kinds[k] = kinds.get(k, 0) + 1
            p += q
            checks += 2
        failures += [(ss.size(st), i, st, x) for x in p]
    for args in MUTATING:                    # f: once, on the live system, as a user without root
        r = _as_nobody(*args)
        checks += 1
        if r.returncode != 1 or "error[not-permitted]" not in r.stderr:
            failures.append((0, -1, None, f"{' '.join(args)} without root: exit {r.returncode}: {r.stderr[-300:]}"))
    print(f"\nstate-space: {len(states)} states, {checks} checks (seed {SEED}; followed {sum(started.values())}: "
          f"{dict(sorted(ends.items()))})\nstate-space follow: first Next {dict(sorted(started.items()))}; ran "
          f"{dict(sorted(kinds.items()))}")
    if failures:
        failures.sort(key=lambda x: (x[0], x[1]))
        size_, i, st, _ = failures[0]
        smallest = [x for _, j, _, x in failures if j == i]
        kinds: dict = {}           # each kind of failure, with its smallest state
        for _, j, s_, x in failures:
            kinds.setdefault(re.sub(r"[0-9a-f]{8,}|'[^']*'|\{.*|\(exit.*", "…", x)[:100],
                             f"#{j} {ss.describe(s_) if s_ else 'the live system'}: {x[:1500]}")
        pytest.fail(f"seed {SEED}: {len(failures)} failures in {len({f[1] for f in failures})} states; smallest "
                    f"state #{i}: {ss.describe(st) if st else 'the live system'}:\n  " + "\n  ".join(smallest)
                    + "\neach kind, smallest state:\n  " + "\n  ".join(kinds.values()))
