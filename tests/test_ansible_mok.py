"""The role's MOK step never reboots a node into an unattended MokManager (issue 23).

Debian's ansible-playbook runs the role's console gate (roles/spark_memsaver/tasks/mok_console.yml, unchanged,
through `import_role: tasks_from`) on localhost: without a terminal (stdin from /dev/null, as under cron or CI)
it refuses and nothing after it runs; `-e mok_console_ready=true` passes; on a terminal (a pty here) typing
"ready" passes and anything else refuses. secure_boot.yml is read to show the gate comes before the request and
the reboot, and that the countdown is finite unless --wait-at-console is chosen.
"""

from __future__ import annotations

import os
import pty
import select
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
    pid, fd = pty.fork()
    if pid == 0:
        env = _env(playbook.parent)
        os.execvpe("ansible-playbook", ["ansible-playbook", "-i", "localhost,", str(playbook)], env)
    out, sent, deadline = b"", False, time.monotonic() + 300
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
        if not sent and b'Type "ready"' in out and out.rstrip().endswith(b":"):
            os.write(fd, answer.encode() + b"\r")
            sent = True
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def test_on_a_terminal_typing_ready_passes_and_anything_else_refuses(playbook):
    rc, out = _on_a_terminal(playbook, "ready")
    assert rc == 0 and MARK in out, out[-3000:]
    assert "MokManager counts down 300 s" in out and "boots on" in out
    rc, out = _on_a_terminal(playbook, "")
    assert rc != 0 and "MOK step refused" in out and MARK not in out, out[-3000:]


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
