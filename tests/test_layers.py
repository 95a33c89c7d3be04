"""The package's layers, checked from its source (issue 22 item 7): every import -- at module level and inside
functions, ``import x`` and ``from x import y`` alike -- between modules of spark_memsaver.

Bottom to top: host/, config, errors (and the package's own small leaf modules) -> decide/ | observe/ -> world/
(where observe/'s readings meet decide/'s verdicts: the snapshot, the manifest's verdict) -> report/ -> act/ | validate/ -> service/ ->
cli/ (and ``__main__``). An import may go down, never up; decide/ and observe/ never
import each other, nor do act/ and validate/; and there is no import cycle at all, also inside one folder (a
cycle hides an order nobody can read). docs/architecture.md describes the layers.

A ratchet while the last of them are taken apart: KNOWN_CYCLES and KNOWN_AGAINST list what main still has
(issue 22; each entry with where it is cut). A new cycle or upward import fails; so does an entry that is gone
(delete it here): the lists only ever shrink, and the test is strict once they are empty.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "daemon" / "spark_memsaver"

# layer of each top-level folder/module; the same number means side by side (no imports between them). Every
# top-level module and folder is listed: one missing fails test_every_module_has_a_layer (it is not layer 0).
LAYER = {"host": 0, "config": 0, "errors": 0, "exitcodes": 0, "config_keys": 0, "versions": 0, "vocabulary": 0,
         "record": 0, "logs": 0, "yamlio": 0, "hazard_table": 0, "efi": 0, "model": 0, "digest": 0, "remedy": 0,
         "timefmt": 0, "opnames": 0, "": 0,
         "decide": 1, "observe": 1, "world": 2, "report": 3, "act": 4, "validate": 4, "service": 5, "cli": 6,
         "__main__": 7}


# Groups of modules that still import each other in a circle (a cycle found must lie inside one of them).
KNOWN_CYCLES: list[set[str]] = []
# Imports against the flow still on main.
KNOWN_AGAINST: set[str] = set()


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _resolve(name: str, mods: dict) -> str | None:
    """'spark_memsaver.act.dkms' -> 'act.dkms' when that is a module of ours, else its nearest package."""
    if name != "spark_memsaver" and not name.startswith("spark_memsaver."):
        return None
    parts = name.split(".")[1:]
    while parts and ".".join(parts) not in mods:
        parts.pop()
    return ".".join(parts)


_MODNAME = re.compile(r"^spark_memsaver(?:\.[A-Za-z_]\w*)+$")
_BY_NAME = ("import_module", "__import__", "run_module", "find_spec")


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _by_name(nodes: list, pkg: list[str], mods: dict) -> list[str]:
    """Modules of ours named by a string (issue 34 item 7): ``importlib.import_module("spark_memsaver.x")``,
    ``__import__``, ``runpy.run_module``, ``python3 -m spark_memsaver.x`` argv, a relative ``import_module(".x",
    package)``, and string module tables (``import_module(f"spark_memsaver.cli.{TABLE[name]}")``: every string of
    the module that completes the f-string's constant prefix to a module of ours). Logger names are not imports."""
    calls = [n for n in nodes if isinstance(n, ast.Call)]
    logger_args = {id(a) for n in calls if _call_name(n) == "getLogger" for a in n.args}
    strings = [n for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    out = [n.value for n in strings if _MODNAME.match(n.value) and id(n) not in logger_args
           and ".".join(n.value.split(".")[1:]) in mods]
    for n in nodes:
        if isinstance(n, ast.Call) and _call_name(n) in _BY_NAME and n.args:
            a = n.args[0]
            if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("."):
                dots = len(a.value) - len(a.value.lstrip("."))
                base = pkg[:len(pkg) - dots + 1] if dots > 1 else pkg
                out.append(".".join(["spark_memsaver", *base, a.value.lstrip(".")]))
        if isinstance(n, ast.JoinedStr) and n.values and isinstance(n.values[0], ast.Constant) \
                and str(n.values[0].value).startswith("spark_memsaver."):
            prefix = str(n.values[0].value)
            out += [prefix + c.value for c in strings if ".".join((prefix + c.value).split(".")[1:]) in mods]
    return out


def imports(mods: dict | None = None) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (every import statement, wherever it stands, and every module it
    names to import or run by name)."""
    mods = mods or modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        deps: set[str] = set()
        nodes = list(ast.walk(ast.parse(path.read_text(), str(path))))
        for node in nodes:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg[:len(pkg) - node.level + 1] if node.level > 1 else pkg
                    src = ".".join(["spark_memsaver", *base] + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                names = [f"{src}.{a.name}" for a in node.names] + [src]
                # 'from pkg import mod' names a module; 'from mod import name' the module itself
                names = [n for n in names if _resolve(n, mods) is not None]
                names = [max(names, key=lambda n: len(_resolve(n, mods) or ""))] if names and all(
                    _resolve(n, mods) == _resolve(src, mods) for n in names) else names
            for n in names:
                r = _resolve(n, mods)
                if r is not None and r != mod:
                    deps.add(r)
        for n in _by_name(nodes, pkg, mods):
            r = _resolve(n, mods)
            if r is not None and r != mod:
                deps.add(r)
        graph[mod] = deps
    return graph


def layer(mod: str) -> tuple[str, int]:
    """(top-level name, layer); a module whose top level is not in LAYER is an error, never layer 0."""
    top = mod.split(".")[0] if mod else ""
    if top not in LAYER:
        raise KeyError(f"{mod}: its top level {top!r} has no layer in LAYER (tests/test_layers.py)")
    return top, LAYER[top]


def against_the_flow(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for a, deps in sorted(graph.items()):
        ta, la = layer(a)
        for b in sorted(deps):
            tb, lb = layer(b)
            if ta == tb:
                continue
            if lb > la or (lb == la and ta != tb and la != 0):
                bad.append(f"{a} -> {b}")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def test_the_checker_sees_imports_inside_functions_and_cycles():
    """The checker itself: a lazy import counts, a two-module cycle is found, an upward import is named."""
    g = {"decide.a": {"observe.b"}, "observe.b": set(), "act.c": {"act.d"}, "act.d": {"act.c"},
         "host.x": {"cli.y"}, "cli.y": set()}
    assert cycles(g) == [["act.c", "act.d"]]
    assert against_the_flow(g) == ["decide.a -> observe.b", "host.x -> cli.y"]
    mods = modules()
    graph = imports(mods)
    assert "cli.main" in graph and graph["__main__"]        # the real package was read
    lazy = [m for m, p in mods.items() if "    from spark_memsaver." in p.read_text()]
    assert lazy and all(graph[m] for m in lazy)               # function-level imports are counted


def _graph_with(tmp_path, mod: str, extra: str) -> dict[str, set[str]]:
    """The package's graph with ``extra`` appended to module ``mod``'s source (a copy; the package is untouched)."""
    mods = modules()
    p = tmp_path / (mod.replace(".", "_") + ".py")
    p.write_text(mods[mod].read_text() + "\n" + extra)
    return imports({**mods, mod: p})


def test_the_checker_sees_imports_by_name(tmp_path):
    """Issue 34 item 7: an import by name counted nowhere -- importlib.import_module, __import__, runpy, a relative
    import_module, a string module table behind an f-string -- each is now an edge, so an upward one fails."""
    cases = {
        'def f():\n    import importlib\n    return importlib.import_module("spark_memsaver.cli.main")\n': "cli.main",
        'def f():\n    return __import__("spark_memsaver.service.daemon")\n': "service.daemon",
        'def f():\n    import runpy\n    runpy.run_module("spark_memsaver.act.executor", run_name="__main__")\n':
            "act.executor",
        'T = {"x": "lifecycle"}\ndef f(n):\n    import importlib\n    '
        'return importlib.import_module(f"spark_memsaver.cli.{T[n]}")\n': "cli.lifecycle",
        'def f():\n    import importlib\n    return importlib.import_module(".status", "spark_memsaver.report")\n':
            "report",
    }
    for extra, target in cases.items():
        g = _graph_with(tmp_path, "decide.ours", extra)
        assert target in g["decide.ours"], (extra, g["decide.ours"])
        assert f"decide.ours -> {target}" in against_the_flow(g), extra
    g = _graph_with(tmp_path, "decide.ours", 'log = __import__("logging").getLogger("spark_memsaver.cli.main")\n')
    assert "cli.main" not in g["decide.ours"]          # a logger's name is not an import


def test_every_module_has_a_layer():
    """A module missing from LAYER counted as layer 0 (below everything, so nothing it imported was 'upward')."""
    tops = {m.split(".")[0] for m in modules()} | {""}
    assert not tops - set(LAYER), f"modules without a layer: {sorted(tops - set(LAYER))}"
    import pytest
    with pytest.raises(KeyError):
        layer("newfolder.x")


def test_hacking_names_every_layer():
    """HACKING.md's Layers rule names every folder of the map (world/ was missing)."""
    text = (PKG.parent.parent / "HACKING.md").read_text()
    rule = text[text.index("- **Layers**"):]
    rule = rule[:rule.index("\n- ")]
    folders = sorted(t for t in LAYER if t and (PKG / t).is_dir())
    assert [f for f in folders if f"`{f}/`" not in rule] == []


def test_no_import_cycle():
    found = cycles(imports())
    new = [c for c in found if not any(set(c) <= k for k in KNOWN_CYCLES)]
    assert not new, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in new)
    gone = [sorted(k) for k in KNOWN_CYCLES if not any(set(c) <= k for c in found)]
    assert not gone, "cycles taken apart: delete them from KNOWN_CYCLES:\n" + "\n".join(map(str, gone))


def test_no_import_against_the_flow():
    bad = set(against_the_flow(imports()))
    assert not bad - KNOWN_AGAINST, "imports against the flow (host/config/errors -> decide | observe -> world -> " \
        "report -> act | validate -> service -> cli):\n" + "\n".join(sorted(bad - KNOWN_AGAINST))
    assert not KNOWN_AGAINST - bad, "gone: delete from KNOWN_AGAINST:\n" + "\n".join(sorted(KNOWN_AGAINST - bad))


def test_decide_and_observe_never_import_each_other():
    g = imports()
    bad = {f"{a} -> {b}" for a, deps in g.items() for b in deps
           if {layer(a)[0], layer(b)[0]} == {"decide", "observe"}}
    assert bad <= KNOWN_AGAINST, "\n".join(sorted(bad - KNOWN_AGAINST))


def test_decide_is_pure():
    """decide/ imports nothing of observe/ or act/ (nor anything above): it maps facts to decisions."""
    g = imports()
    bad = {f"{a} -> {b}" for a, deps in g.items() if layer(a)[0] == "decide" for b in deps
           if layer(b)[1] > 0 and layer(b)[0] != "decide"}
    assert bad <= KNOWN_AGAINST, "\n".join(sorted(bad - KNOWN_AGAINST))


def test_one_base_version():
    """One definition (spark_memsaver/versions.py) for the planner, the APT door, installability, the module reader,
    status and metrics; it cuts where the load-time guard's driver_of() cuts."""
    from spark_memsaver import versions
    from spark_memsaver.decide import apt, installability, plan, step
    from spark_memsaver.observe import modules
    assert plan.base_version is step.base_version is installability.base_version is modules.base_version \
        is versions.base_version
    assert apt.upstream_of_deb("580.142-0ubuntu1") == "580.142"
    b = versions.base_version
    assert b("550.163.01-spark1") == "550.163.01" and b(" 580.142\n") == "580.142"
    assert b("550.163.01+sm") == b("550.163.01~rc") == b("550.163.01 x") == b("550.163.01\tx") == "550.163.01"
    assert b(None) is None and b("") is None and b("-x") is None
    defs = [p for p in PKG.rglob("*.py") if "def base_version" in p.read_text()]
    assert [p.name for p in defs] == ["versions.py"]


def test_one_ours_predicate():
    """decide/ours.py decides "ours, and built for the nvidia.ko beside it" for the planner, the APT door and status
    alike, by base_version (a suffixed module version is not a mismatch anywhere)."""
    from spark_memsaver.decide import ours
    from spark_memsaver.model import Kernel, ModuleSelection, Uvm
    def k(u, n):
        return Kernel.from_json({"uvm_selected": u, "nvidia_selected": {"version": n} if n else None})
    mine = {"patched": True, "version": "580.142-sm0.2"}
    assert ours.selection(k(mine, "580.142")) == "consistent" and ours.driver_mismatch(k(mine, "580.142")) is None
    assert ours.selection(k(mine, "590.44.01")) == "mismatch"
    assert ours.driver_mismatch(k(mine, "590.44.01")) == ("580.142", "590.44.01")
    assert ours.selection(k(mine, None)) == "mismatch" and ours.driver_mismatch(k(mine, None)) is None
    assert ours.selection(k({"patched": True, "version": ""}, "580.142")) == "mismatch"
    assert ours.selection(k({"patched": False, "version": "580.142"}, "590.44.01")) == "stock"
    assert ours.loaded_mismatch(Uvm(loaded=True, patched=True, version="580.142"), "580.95.05") == \
        ("580.142", "580.95.05")
    assert ours.loaded_mismatch(Uvm(loaded=False, patched=True, version="580.142"), "580.95.05") is None
    assert ours.loaded_mismatch(Uvm(loaded=True, patched=True, version="580.142-x"), "580.142") is None
    assert ours.is_ours(ModuleSelection(patched=True)) and not ours.is_ours(None)
    src = "\n".join(p.read_text() for p in (PKG / "decide").glob("*.py") if p.name not in ("ours.py", "packing.py"))
    assert '.get("patched")' not in src and ".patched" not in src   # every other reader in decide/ asks ours.py


# The read paths (issue 22 item 3): act/ is the one door to change; status, metrics and the daemon's reads never
# reach it. Modules in READ_CLOSED import nothing of act/, nor does anything they import (transitively, lazy imports
# counted); READ_DIRECT, which also start doors (click commands, D-Bus methods that queue a job), not by themselves.
READ_CLOSED = ("report", "world", "cli.status", "cli.metrics", "cli.events", "cli.history", "service.statusproc",
               "service.history")
READ_DIRECT = ("cli.main", "cli.entry", "service.daemon", "service.runtime", "service.monitor", "service.dbus_service")


def _in(mod: str, names) -> bool:
    return any(mod == n or mod.startswith(n + ".") for n in names)


def test_read_paths_import_no_act():
    g = imports()
    assert all(any(_in(m, (r,)) for m in g) for r in READ_CLOSED + READ_DIRECT)    # every name is a module here
    bad = []
    for start in sorted(m for m in g if _in(m, READ_CLOSED)):
        seen, todo, via = {start}, [start], {start: None}
        while todo:
            m = todo.pop()
            for d in g.get(m, ()):
                if d not in seen:
                    seen.add(d)
                    via[d] = m
                    todo.append(d)
        for d in sorted(x for x in seen if layer(x)[0] == "act"):
            path, m = [d], via[d]
            while m is not None:
                path.append(m)
                m = via[m]
            bad.append(" -> ".join(reversed(path)))
    bad += [f"{m} -> {d}" for m in sorted(g) if _in(m, READ_DIRECT) for d in sorted(g[m]) if layer(d)[0] == "act"]
    assert not bad, "read paths that reach act/:\n" + "\n".join(bad)


MAX_LINES = 400   # HACKING.md: "No module over 400 lines"


def test_no_module_over_400_lines():
    """A module that grows past HACKING's limit is split before it lands (the limit keeps each module readable
    in one sitting; service/daemon.py had reached 401)."""
    over = {name: n for name, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
