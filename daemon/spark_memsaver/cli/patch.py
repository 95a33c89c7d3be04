"""CLI: the patch group (click commands only; the work is done in spark_memsaver.act.patch)."""

from __future__ import annotations

from pathlib import Path
import click
import json
from spark_memsaver.act.patch import (VERIFIED, apply_patch, check_source, load_manifest)


def register(root_group) -> None:
    """Called by cli.py: adds the `patch` group."""
    root_group.add_command(patch_group)


@click.group("patch")
def patch_group():
    """Prepare patched NVIDIA sources (page-table packing hooks)."""


def _print(doc: dict, as_json: bool, lines: list[str]) -> None:
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        for line in lines:
            click.echo(line)


@patch_group.command("apply")
@click.option("--source", "source", required=True, type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="NVIDIA open kernel-module tree (/usr/src layout = upstream kernel-open/).")
@click.option("--dest", "dest", required=True, type=click.Path(path_type=Path), metavar="DIR",
              help="New directory to receive the patched copy (must not exist).")
@click.option("--tier-default", type=click.IntRange(0, 3), default=None, metavar="0-3",
              help="Build-time default of uvm_pt_pack: 0 off, 3 leaf (default), 1 4k-all, 2 256 (opt-in).")
@click.option("--allow-untested", is_flag=True,
              help="Apply the nearest branch's patch to a version the manifest does not list, if clean.")
@click.option("--slim", is_flag=True, help="Leave out NVIDIA's prebuilt *.o_binary blobs (not used by nvidia-uvm).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def apply_cmd(source, dest, tier_default, allow_untested, slim, as_json):
    """Copy SOURCE to DEST, add the pool, apply the driver branch's patch with zero fuzz."""
    m = apply_patch(source, dest, tier_default, allow_untested=allow_untested, slim=slim)
    lines = [f"patched NVIDIA {m['version']} ({m['branch']}, {m['qualification']}) into {m['dest']}"]
    if m["qualification"] == "untested":
        lines.append("warning: this patch is UNTESTED for this driver version")
    _print(m, as_json, lines)
    return 0


@patch_group.command("check")
@click.option("--source", "source", required=True, type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="NVIDIA open kernel-module tree to check (e.g. /usr/src/nvidia-580.142; an absolute path is "
                   "read under --root).")
@click.option("--allow-untested", is_flag=True,
              help="Check the nearest branch's patch against a version the manifest does not list.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_obj
def check_cmd(obj, source, allow_untested, as_json):
    """Dry run: read the version, select the patch and check it applies with zero fuzz (writes nothing)."""
    typed = source
    if obj is not None and source.is_absolute():
        source = obj.host.path(source)        # the system under --root (itself when --root is /)
    r = check_source(source, allow_untested=allow_untested)
    r.pop("_selection", None)
    r["source"] = str(typed)
    _print(r, as_json, [f"NVIDIA {r['version']}: {r['branch']} patch ({r['match']} match, "
                        f"{_qualified(r)}) applies cleanly"] + _test_lines(r) + _drift_lines(r))
    return 0


def _qualified(r: dict) -> str:
    """'compile-verified by content, hooked files identical to 580.142's' / 'untested' / 'compile-verified'."""
    text = r["qualification"]
    if r.get("inherited_from"):
        text += f" by content, hooked files identical to {r['inherited_from']}'s"
    elif r.get("by") == "content":
        text += " by content"
    return text


def _test_lines(r: dict) -> list[str]:
    """One line per recorded run of NVIDIA's built-in tests that vouches for this tree (nvidia-tests)."""
    return [f"  NVIDIA's tests passed: {t['suite']}; {t['kernel']}; {int(t['page_size']) // 1024} KiB pages; "
            f"tiers {', '.join(map(str, t['tiers']))}; {t['date']}" for t in r.get("nvidia_tests") or []]


def _drift_lines(r: dict) -> list[str]:
    if not r.get("drifted"):
        return []
    return [f"hooked files that differ from the verified {r['compared_with']} tree: "
            + ", ".join(r["drifted"]),
            "warning: this tree is not the one that was compiled: UNTESTED (the zero-fuzz dry run decides)"]


@patch_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest's drivers as JSON.")
def list_cmd(as_json):
    """Driver versions the manifest knows: branch, qualification, verified_on, recorded content hashes."""
    m = load_manifest()
    rows = []
    for e in m.entries:
        what = ", ".join(e.versions) if e.versions else f">={e.range_min or '0'} <{e.range_below or 'inf'}"
        # the verified trees of this branch a tree may inherit from by content (identical hooked files)
        donors = sorted({v for d in m.entries if d.branch == e.branch and d.qualification in VERIFIED
                         for v in d.hooked_files}, key=lambda v: tuple(map(int, v.split("."))))
        rows.append({"versions": e.versions, "range": [e.range_min, e.range_below] if not e.versions else None,
                     "branch": e.branch, "qualification": e.qualification, "verified_on": e.verified_on,
                     "hashes_recorded": sorted(e.hooked_files, key=lambda v: tuple(map(int, v.split(".")))),
                     "hashes_missing": [v for v in e.versions
                                        if e.qualification in VERIFIED and v not in e.hooked_files],
                     "hooked_files": e.hooked_files, "nvidia_tests": e.nvidia_tests, "inherits_by_content_from": donors, "_what": what})
    lines = []
    for r in rows:
        lines.append(f"{r['_what']:<40} {r['branch']:<6} {r['qualification']}"
                     + (f" ({'; '.join(r['verified_on'])})" if r["verified_on"] else ""))
        lines += [f"{'':<40}{t}" for t in _test_lines(r)]
        if r["qualification"] in VERIFIED:
            lines.append(f"{'':<40} content hashes: " + (", ".join(r["hashes_recorded"]) or "none")
                         + (f"; MISSING for {', '.join(r['hashes_missing'])}" if r["hashes_missing"] else ""))
        elif r["inherits_by_content_from"]:
            lines.append(f"{'':<40} verified by content where the hooked files are identical to "
                         + ", ".join(r["inherits_by_content_from"]) + "'s")
    _print({"drivers": [{k: v for k, v in r.items() if k != "_what"} for r in rows]}, as_json, lines)
    return 0
