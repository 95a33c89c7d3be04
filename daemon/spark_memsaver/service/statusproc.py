"""The status document, computed in a short-lived child process so the resident daemon never imports the
observers, decisions, YAML or the engines they reach (idle RSS, see benchmarks/daemon_footprint.py).

    python3 -m spark_memsaver.service.statusproc --root R [--config FILE]   (stdin: the daemon's config, JSON)

Writes one JSON object to stdout: ``{"config": {...} | null, "config_error": {...} | null,
"doc": {...} | null, "error": {...} | null}``. The config file is re-read on every run (so an edit is
picked up by the next refresh); when it is bad the daemon's current config (stdin; the defaults when it has
none yet) is used, returned as ``config``, and the error is returned beside it. :func:`compute` is the
daemon's side: it runs this with a time limit and parses the answer. The daemon holds the config as that
dict behind :class:`Settings`: config.py (a record) stays out of the resident process.
"""

from __future__ import annotations

import json
import os
import sys

TIMEOUT_S = 600


def _config_from(d: dict | None):
    from spark_memsaver import config as cfg

    if not d:
        return cfg.Config()
    d = dict(d)
    d["notes"] = tuple(d.get("notes") or ())
    return cfg.Config(**d)


def config_dict(c) -> dict:
    d = {k: getattr(c, k) for k in c._FIELDS if k != "invalid"}
    d["notes"] = list(d.get("notes") or ())
    return d


class Settings:
    """The daemon's config: the child's dict read by attribute (``interval``, ``history_size``...), equal as
    ``config.Config`` instances are (``source`` and ``notes`` aside). :meth:`to_config` makes the real one
    (in a job's thread, where importing config.py costs the idle daemon nothing)."""

    __slots__ = ("_d",)
    NOT_COMPARED = ("source", "notes")

    def __init__(self, d: dict):
        self._d = dict(d)

    def __getattr__(self, name):
        try:
            return self._d[name]
        except KeyError:
            raise AttributeError(name) from None

    def __eq__(self, other) -> bool:
        if not isinstance(other, Settings):
            return NotImplemented
        return self._compared() == other._compared()

    def _compared(self) -> dict:
        return {k: v for k, v in self._d.items() if k not in self.NOT_COMPARED}

    def to_dict(self) -> dict:
        return dict(self._d)

    def to_config(self):
        return _config_from(self._d)

    def __repr__(self) -> str:
        return f"Settings({self._d!r})"


def default_settings() -> Settings:
    """The built-in defaults (only when no status child answered at all)."""
    from spark_memsaver import config as cfg
    return Settings(config_dict(cfg.Config()))


def child(root: str, config_path: str | None, fallback: dict | None) -> dict:
    from spark_memsaver import config as cfg
    from spark_memsaver.errors import MemsaverError
    from spark_memsaver.host import Host
    from spark_memsaver.service.jobs import error_dict

    out = {"config": None, "config_error": None, "doc": None, "error": None}
    bad = None
    try:
        c = cfg.load(config_path, root=root)
    except MemsaverError as e:
        out["config_error"] = error_dict(e)
        c = _config_from(fallback)
        bad = cfg.invalid_dict(e) if isinstance(e, cfg.ConfigError) else None
    out["config"] = config_dict(c)
    try:
        from spark_memsaver.record import replace
        from spark_memsaver.report.document import status_of as status
        # the document says the file is unusable (one config-invalid finding), over the config in force
        out["doc"], _verdict = status(Host(root), replace(c, invalid=bad) if bad else c)
    except MemsaverError as e:
        out["error"] = error_dict(e)
    except Exception as e:   # a bug: report it as a named internal error, never a silent empty status
        import traceback
        traceback.print_exc(file=sys.stderr)
        out["error"] = error_dict(e)
    return out


def compute(root: str, config_path: str | None, current: dict | None, env: dict | None = None) -> dict:
    """Daemon side (a worker thread): run the child, return its answer (``error`` set when it failed)."""
    import subprocess

    argv = [sys.executable, "-m", "spark_memsaver.service.statusproc", "--root", root]
    if config_path:
        argv += ["--config", config_path]
    try:
        r = subprocess.run(argv, input=json.dumps(current), capture_output=True, text=True, timeout=TIMEOUT_S,
                           env=env)
    except subprocess.TimeoutExpired:
        return _failed(f"the status computation took longer than {TIMEOUT_S} s")
    except OSError as e:
        return _failed(f"cannot run the status computation: {e.strerror or e}")
    if r.stderr.strip():
        sys.stderr.write(r.stderr)
    try:
        ans = json.loads(r.stdout)
        if isinstance(ans, dict):
            return ans
    except ValueError:
        pass
    return _failed(f"the status computation exited {r.returncode} without an answer")


def _failed(message: str) -> dict:
    return {"config": None, "config_error": None, "doc": None,
            "error": {"code": "internal-error", "name": "Failed", "message": f"internal error: {message}",
                      "remedy": "See 'journalctl -u spark-memsaverd.service' and report it as a bug.", "exit_code": 3}}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    root, config_path = "/", None
    while argv:
        a = argv.pop(0)
        if a == "--root" and argv:
            root = argv.pop(0)
        elif a == "--config" and argv:
            config_path = argv.pop(0)
        else:
            print(f"usage: statusproc [--root DIR] [--config FILE] (unknown {a!r})", file=sys.stderr)
            return 2
    try:
        fallback = json.loads(sys.stdin.read() or "null")
    except ValueError:
        fallback = None
    out = child(root, config_path, fallback if isinstance(fallback, dict) else None)
    sys.stdout.write(json.dumps(out))
    return 0


if __name__ == "__main__":
    os.environ.pop("JOURNAL_STREAM", None)
    sys.exit(main())
