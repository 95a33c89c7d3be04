"""The role's MOK step never reboots a node into an unattended MokManager (issue 23).

Debian's ansible-playbook runs the role's console gate (roles/spark_memsaver/tasks/mok_console.yml, unchanged,
through `import_role: tasks_from`) on localhost: without a terminal (stdin from /dev/null, as under cron or CI)
it refuses and nothing after it runs; `-e mok_console_ready=true` passes; on a terminal (a pty here) typing
"ready" passes and anything else refuses. secure_boot.yml is read to show the gate comes before the request and
the reboot, and that the countdown is finite unless --wait-at-console is chosen.

The whole MOK step (secure_boot.yml) also runs without a terminal against the real CLI: `spark-memsaver` on the
play's PATH is the checkout's CLI with `--root` at a Spark fixture root whose byte-exact efivarfs files say
Secure Boot on and the key not enrolled (the EFI firmware is what stands in). It refuses at the gate: `mok
status` is the only command run, nothing is requested (the role's reboot is switched off here in any case:
the play runs on this machine).
"""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.support import needs

REPO = Path(__file__).resolve().parent.parent
ROLE = REPO / "ansible/roles/spark_memsaver"
MARK = "PAST-THE-CONSOLE-GATE"

PLAY = f"""
- name: The MOK console gate alone
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Gate
      ansible.builtin.import_role:
        name: spark_memsaver
        tasks_from: mok_console.yml
    - name: After the gate
      ansible.builtin.debug:
        msg: {MARK}
"""


def _env(tmp: Path) -> dict:
    return dict(os.environ, ANSIBLE_ROLES_PATH=str(REPO / "ansible/roles"), ANSIBLE_NOCOLOR="1",
                ANSIBLE_LOCAL_TEMP=str(tmp / "at"), ANSIBLE_HOME=str(tmp / "ah"), ANSIBLE_LOCALHOST_WARNING="False",
                ANSIBLE_INVENTORY_UNPARSED_WARNING="False")


@pytest.fixture
def playbook(tmp_path):
    needs.require("ansible-playbook", remedy="apt-get install ansible-core (tools/deps/ops.txt)")
    p = tmp_path / "gate.yml"
    p.write_text(PLAY)
    return p


def _run(playbook, *extra):
    return subprocess.run(["ansible-playbook", "-i", "localhost,", str(playbook), *extra], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, env=_env(playbook.parent))


def test_without_a_terminal_the_mok_step_refuses(playbook):
    r = _run(playbook)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "MOK step refused: nobody confirmed being at the console" in out, out
    assert "-e mok_console_ready=true" in out
    assert MARK not in out


def test_mok_console_ready_lets_it_pass(playbook):
    r = _run(playbook, "-e", "mok_console_ready=true")
    assert r.returncode == 0, r.stdout + r.stderr
    assert MARK in r.stdout


def _on_a_terminal(playbook, answer: str) -> tuple[int, str]:
    """Run the gate on a pty and type ``answer`` at its prompt. Ansible's pause prints the prompt and only then
    puts the terminal in raw mode, flushing what was typed (setraw with TCSAFLUSH, tcflush): an answer typed
    in between is lost, so it is typed again until the play moves on. The play is killed at the deadline."""
    pid, fd = pty.fork()
    if pid == 0:
        env = _env(playbook.parent)
        os.execvpe("ansible-playbook", ["ansible-playbook", "-i", "localhost,", str(playbook)], env)
    out, sent_at, mark, deadline = b"", None, 0, time.monotonic() + 300
    moved_on = (b"TASK [", b"PLAY RECAP", b"fatal:")
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 1)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        if sent_at is None:
            type_it = b'Type "ready"' in out and out.rstrip().endswith(b":")
            mark = len(out)
        else:   # typed again while the play has not moved on past the prompt
            type_it = time.monotonic() - sent_at > 5 and not any(m in out[mark:] for m in moved_on)
        if type_it:
            os.write(fd, answer.encode() + b"\r")
            sent_at = time.monotonic()
    else:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def test_on_a_terminal_typing_ready_passes_and_anything_else_refuses(playbook):
    rc, out = _on_a_terminal(playbook, "ready")
    assert rc == 0 and MARK in out, out[-3000:]
    assert "MokManager counts down 300 s" in out and "boots on" in out
    rc, out = _on_a_terminal(playbook, "")
    assert rc != 0 and "MOK step refused" in out and MARK not in out, out[-3000:]


STEP = """
- name: The role's MOK step
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: MOK step
      ansible.builtin.import_role:
        name: spark_memsaver
        tasks_from: secure_boot.yml
"""


@pytest.fixture
def not_enrolled_node(tmp_path):
    """A PATH whose spark-memsaver is the real CLI on a Spark root with Secure Boot on and our key not enrolled,
    logging each call's arguments."""
    needs.require("ansible-playbook", remedy="apt-get install ansible-core (tools/deps/ops.txt)")
    from tests.test_secure_boot_path import node, not_enrolled
    from tests.test_mok import _openssl_cert
    keys = {"ours": _openssl_cert(tmp_path, "ours", "/CN=DKMS module signing key").read_bytes(),
            "vendor": _openssl_cert(tmp_path, "vendor", "/O=Example/CN=Example Vendor CA").read_bytes()}
    root = node(tmp_path / "root", keys["ours"], not_enrolled(keys))
    bindir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bindir.mkdir()
    (bindir / "spark-memsaver").write_text(
        f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> {calls}\n"
        f"PYTHONPATH={REPO / 'daemon'} exec /usr/bin/python3 -m spark_memsaver --root {root} \"$@\"\n")
    (bindir / "spark-memsaver").chmod(0o755)
    play = tmp_path / "step.yml"
    play.write_text(STEP)
    return play, bindir, calls


def _step(play, bindir, *extra):
    env = dict(_env(play.parent), PATH=f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    return subprocess.run(["ansible-playbook", "-i", "localhost,", str(play), "-e", "spark_memsaver_mok_reboot=false",
                           "-e", "spark_memsaver_mok_password=one-time-pw", *extra], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, env=env)


def test_the_whole_mok_step_without_a_terminal_refuses_before_requesting(not_enrolled_node):
    play, bindir, calls = not_enrolled_node
    r = _step(play, bindir)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "MOK step refused: nobody confirmed being at the console" in out, out[-3000:]
    assert calls.read_text().splitlines() == ["mok status --json"], calls.read_text()
    # with someone declared at the console the same run goes on to the request (which the real CLI refuses
    # here: --root inspects, it never writes firmware variables), so the gate is what stopped the first run
    r = _step(play, bindir, "-e", "mok_console_ready=true")
    assert r.returncode != 0 and "MOK step refused" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    assert calls.read_text().splitlines()[1:] == [
        "mok status --json", "mok enroll --password-stdin --json --console-timeout 300"], calls.read_text()


def test_the_gate_comes_before_the_request_and_the_reboot_and_the_countdown_is_finite():
    tasks = yaml.safe_load((ROLE / "tasks/secure_boot.yml").read_text())
    block = next(t for t in tasks if "block" in t)["block"]
    names = [next(k for k in t if k.startswith("ansible.builtin.")) + ":" + t["name"] for t in block]
    gate = next(i for i, n in enumerate(names) if "include_tasks" in n)
    assert block[gate]["ansible.builtin.include_tasks"] == "mok_console.yml"
    request = next(i for i, n in enumerate(names) if "Request enrollment" in n)
    reboot = next(i for i, n in enumerate(names) if n.startswith("ansible.builtin.reboot:"))
    assert gate < request < reboot, names
    argv = block[request]["ansible.builtin.command"]["argv"] + block[request]["vars"]["countdown"]
    assert "--console-timeout" in argv and "--wait-at-console" in argv     # one or the other, by the flag
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    assert defaults["spark_memsaver_mok_console_timeout"] == 300
    assert defaults["spark_memsaver_mok_wait_at_console"] is False
    assert defaults["spark_memsaver_mok_console_ready"] == "{{ mok_console_ready | default(false) }}"
