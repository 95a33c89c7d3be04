"""The examples that end each command's --help (1-3 each, runnable as written: sudo where root is needed).

Attached by cli/main.py's group when a command is looked up (lazy modules included); tests/test_cli_surface.py
parses every one with the CLI's own parser.
"""

from __future__ import annotations

EXAMPLES = {
    "": ["spark-memsaver status", "sudo spark-memsaver install --dry-run", "sudo spark-memsaver install"],
    "mok": ["spark-memsaver mok status", "sudo spark-memsaver mok enroll --dry-run"],
    "patch": ["spark-memsaver patch list", "spark-memsaver patch check --source /usr/src/nvidia-580.142"],
    "config": ["spark-memsaver config show"],
    "status": ["spark-memsaver status", "spark-memsaver status --json | jq .state",
               "spark-memsaver status --quiet || spark-memsaver status --verbose"],
    "install": ["sudo spark-memsaver install --dry-run", "sudo spark-memsaver install",
                "sudo spark-memsaver install --all"],
    "build": ["sudo spark-memsaver build --dry-run", "sudo spark-memsaver build --kernel \"$(uname -r)\"",
              "sudo spark-memsaver build --all --dry-run"],
    "remove": ["sudo spark-memsaver remove --dry-run", "sudo spark-memsaver remove --all"],
    "rollback": ["sudo spark-memsaver rollback --dry-run",
                 "sudo spark-memsaver rollback --reason 'CUDA errors after the upgrade'"],
    "activate": ["sudo spark-memsaver activate --dry-run", "sudo spark-memsaver activate"],
    "reconcile": ["sudo spark-memsaver reconcile --dry-run", "sudo spark-memsaver reconcile"],
    "mok status": ["spark-memsaver mok status", "spark-memsaver mok status --json"],
    "mok enroll": ["sudo spark-memsaver mok enroll --dry-run", "sudo spark-memsaver mok enroll",
                   "sudo spark-memsaver mok enroll --wait-at-console"],
    "mok cancel": ["sudo spark-memsaver mok cancel --dry-run", "sudo spark-memsaver mok cancel"],
    "patch list": ["spark-memsaver patch list"],
    "patch check": ["spark-memsaver patch check --source /usr/src/nvidia-580.142"],
    "patch apply": ["spark-memsaver patch apply --source /usr/src/nvidia-580.142 --dest /tmp/nvidia-580.142-packed"],
    "validate": ["sudo spark-memsaver validate", "sudo spark-memsaver validate --max-gib 8 --report /root/validate.json"],
    "history": ["spark-memsaver history --since 2h", "spark-memsaver history --since 1d --json"],
    "events": ["spark-memsaver events", "spark-memsaver events --since 1d --json"],
    "metrics": ["spark-memsaver metrics", "spark-memsaver metrics --output /tmp/spark-memsaver.prom"],
    "memory": ["spark-memsaver memory", "spark-memsaver memory --need 100G",
               "spark-memsaver memory --json | jq .free_blocks_of"],
    "reclaim": ["sudo spark-memsaver reclaim --need 100G --dry-run", "sudo spark-memsaver reclaim --need 100G",
                "sudo spark-memsaver reclaim --need 64G --json"],
    "config show": ["spark-memsaver config show", "spark-memsaver --config /tmp/new.yaml config show"],
}


def attach(cmd, path: str) -> None:
    """Set the examples of ``cmd`` (a group's too, and its subcommands') as its --help epilog; "" is the CLI."""
    import click
    if cmd is None:
        return
    ex = EXAMPLES.get(path)
    if ex and not cmd.epilog:
        cmd.epilog = "\b\nExamples:\n" + "\n".join(f"  {e}" for e in ex)
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            attach(sub, f"{path} {name}".strip())
