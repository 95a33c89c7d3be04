"""The pool's predicate per driver branch, through each branch's real hook: which GPUs and trees are packed.

For every branch of uvm_patch/patches/, the hook's own text is taken out of the generated patch (the
`pt_pack_dev_is_dma_coherent()` helper and the facts gathering of `pt_pack_tree_init()`), compiled with the pool
(uvm_patch/src/uvm_pt_pack.c, unchanged, against tests/harness/shim/) and with stand-ins for the few UVM types
the hook reads (`uvm_page_tree_t`, `uvm_gpu_t`, `uvm_parent_gpu_t`: only the fields it names; the parent has
`is_integrated_gpu` only on branches whose NVIDIA tree has it, so a hook reading a missing field fails to
compile). Each case sets the facts of one GPU and tree as UVM holds them, and the reason token the pool gives
is checked:

  GB10, GB20B: integrated (is_integrated_gpu set in uvm_blackwell.c), no vidmem, DMA-coherent;
  GH200: vidmem, coherent (C2C), not integrated;  a discrete GPU without a framebuffer: no vidmem, not integrated;
  a fake GPU of UVM's unit tests: no pci_dev;  a vidmem tree, a sys-fallback tree (vidmem tree allowed to fall
  back to sysmem); UVM's kernel tree.

Branches before 575 have no is_integrated_gpu: their hook passes -1, which must never pack ("integrated_unknown").
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "uvm_patch" / "patches"
SHIM = REPO / "tests" / "harness" / "shim"
BRANCHES = ("r535", "r550", "r555", "r580", "r590", "r595")
HAS_INTEGRATED = {"r535": False, "r550": False, "r555": False, "r580": True, "r590": True, "r595": True}

# name: (pci_dev, coherent, integrated, vidmem bytes, tree location, sys fallback, tree type, tier)
GB10 = dict(pci=1, coherent=1, integrated=1, vidmem=0)
CASES = {
    "gb10":               dict(GB10),
    "gb20b":              dict(GB10),    # same facts in UVM: integrated Blackwell without vidmem
    "gh200":              dict(pci=1, coherent=1, integrated=0, vidmem=96 << 30),
    "discrete_no_fb":     dict(pci=1, coherent=1, integrated=0, vidmem=0),
    "fake_gpu":           dict(pci=0, coherent=0, integrated=0, vidmem=0),
    "vidmem_tree":        dict(pci=1, coherent=1, integrated=0, vidmem=96 << 30, location="VID"),
    "gb10_tree_not_sys":  dict(GB10, location="VID"),
    "sys_fallback_tree":  dict(pci=1, coherent=1, integrated=0, vidmem=96 << 30, location="VID", fallback=1),
    "gb10_not_coherent":  dict(GB10, coherent=0),
    "kernel_tree":        dict(GB10, type="KERNEL"),
    "kernel_tree_tier2":  dict(GB10, type="KERNEL", tier="256"),
}

NEW = {   # 580, 590, 595: is_integrated_gpu known
    "gb10": "none", "gb20b": "none", "gh200": "has_vidmem", "discrete_no_fb": "not_integrated",
    "fake_gpu": "no_pci_dev", "vidmem_tree": "has_vidmem", "gb10_tree_not_sys": "not_sysmem",
    "sys_fallback_tree": "has_vidmem", "gb10_not_coherent": "not_coherent", "kernel_tree": "kernel_tree",
    "kernel_tree_tier2": "none",
}
OLD = {   # 535, 550, 555: no is_integrated_gpu: nothing with a PCI device and no vidmem is ever packed
    **NEW, "gb10": "integrated_unknown", "gb20b": "integrated_unknown", "discrete_no_fb": "integrated_unknown",
    "gb10_tree_not_sys": "integrated_unknown", "gb10_not_coherent": "integrated_unknown",
    "kernel_tree": "integrated_unknown", "kernel_tree_tier2": "integrated_unknown",
}
EXPECT = {b: (NEW if HAS_INTEGRATED[b] else OLD) for b in BRANCHES}


def hook_text(branch: str) -> tuple[str, str]:
    """(the coherence helper, the facts gathering) as the branch's patch adds them to uvm_mmu.c."""
    added = "\n".join(l[1:] for l in (PATCHES / branch / "0001-uvm-pt-pack-hooks.patch").read_text().split("\n")
                      if l.startswith("+") and not l.startswith("+++"))
    helper = re.search(r"^static bool pt_pack_dev_is_dma_coherent\(struct pci_dev \*pci_dev\)\n\{\n.*?^\}\n",
                       added, re.M | re.S)
    init = re.search(r"^static void pt_pack_tree_init\(uvm_page_tree_t \*tree\)\n\{\n(.*?)\n\n"
                     r"    uvm_pt_pack_tree_init\(", added, re.M | re.S)
    assert helper and init, f"{branch}: the hook's helper or facts gathering moved; adapt this test"
    return helper.group(0), init.group(1)


def program(branch: str) -> str:
    helper, facts = hook_text(branch)
    integrated_field = "    bool is_integrated_gpu;\n" if HAS_INTEGRATED[branch] else ""
    cases = []
    for name, c in CASES.items():
        setup = [f"parent.pci_dev = {'&pdev' if c['pci'] else 'NULL'};",
                 f"pdev.dev.coherent = {c['coherent']};",
                 f"gpu.mem_info.size = {c['vidmem']}ULL;",
                 f"tree.location = UVM_APERTURE_{c.get('location', 'SYS')};",
                 f"tree.location_sys_fallback = {c.get('fallback', 0)};",
                 f"tree.type = UVM_PAGE_TREE_TYPE_{c.get('type', 'USER')};",
                 f'shim_param_set("uvm_pt_pack", "{c.get("tier", "leaf")}");']
        if HAS_INTEGRATED[branch]:
            setup.append(f"parent.is_integrated_gpu = {c['integrated']};")
        cases.append(f'    {" ".join(setup)}\n    report("{name}", &tree);')
    return f"""/* generated by tests/test_uvm_pt_pack_predicates.py: branch {branch} */
#include "shim.h"
#include "uvm_pt_pack.h"
#define NV_LINUX_DMA_MAP_OPS_H_PRESENT 1
struct device {{ int coherent; }};
struct pci_dev {{ struct device dev; }};
static bool dev_is_dma_coherent(struct device *d) {{ return d->coherent; }}
typedef struct {{
    struct pci_dev *pci_dev;
{integrated_field}}} uvm_parent_gpu_t;
typedef struct {{ uvm_parent_gpu_t *parent; struct {{ u64 size; }} mem_info; }} uvm_gpu_t;
typedef enum {{ UVM_APERTURE_SYS = 1, UVM_APERTURE_VID = 2 }} uvm_aperture_t;
typedef enum {{ UVM_PAGE_TREE_TYPE_USER, UVM_PAGE_TREE_TYPE_KERNEL }} uvm_page_tree_type_t;
typedef struct {{
    uvm_gpu_t *gpu;
    uvm_page_tree_type_t type;
    uvm_aperture_t location;
    bool location_sys_fallback;
}} uvm_page_tree_t;

/* ---- the branch's hook text, verbatim ---- */
{helper}
static struct uvm_pt_pack_facts hook_facts(uvm_page_tree_t *tree)
{{
{facts}
    return facts;
}}
/* ---- end of the hook text ---- */

static void report(const char *name, uvm_page_tree_t *tree)
{{
    struct uvm_pt_pack_facts f = hook_facts(tree);

    printf("%s %s\\n", name, uvm_pt_pack_reason_str(uvm_pt_pack_check(&f)));
}}

int main(void)
{{
    struct pci_dev pdev;
    uvm_parent_gpu_t parent;
    uvm_gpu_t gpu = {{ .parent = &parent }};
    uvm_page_tree_t tree = {{ .gpu = &gpu }};

    memset(&parent, 0, sizeof(parent));
    memset(&pdev, 0, sizeof(pdev));
{chr(10).join(cases)}
    return 0;
}}
"""


def run_matrix(branch: str, tmp: Path, pool: Path = REPO / "uvm_patch" / "src") -> dict[str, str]:
    if shutil.which("gcc") is None:
        pytest.fail("gcc is required (apt-get install build-essential)")
    src = tmp / f"matrix_{branch}.c"
    src.write_text(program(branch))
    exe = tmp / f"matrix_{branch}"
    cc = subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Werror", "-Wno-unused-function", "-DUVM_PT_PACK_UVM_LOCKS",
                         "-DSHIM_PAGE_SHIFT=16", f"-I{SHIM}", f"-I{pool}", str(src), str(SHIM / "shim.c"),
                         str(pool / "uvm_pt_pack.c"), "-o", str(exe), "-lpthread"],
                        capture_output=True, text=True, timeout=300)
    assert cc.returncode == 0, f"{branch}: the hook's text does not compile against its branch:\n{cc.stderr[-3000:]}"
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


@pytest.mark.harness
@pytest.mark.parametrize("branch", BRANCHES)
def test_predicate_matrix_per_branch(branch, tmp_path):
    got = run_matrix(branch, tmp_path)
    assert got == EXPECT[branch], {k: (got.get(k), v) for k, v in EXPECT[branch].items() if got.get(k) != v}


def test_branch_field_presence_matches_nvidia_trees():
    """The stand-in parent GPU has is_integrated_gpu exactly where NVIDIA's tree of the branch has it (the trees
    gen-patches.py generates each branch's patch from: Debian's 535/550/555, the shared 580/590/595)."""
    import importlib.util
    import sys

    from tests.support import nvsrc
    spec = importlib.util.spec_from_file_location("gen_patches_m", REPO / "uvm_patch" / "gen-patches.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_patches_m"] = gen   # dataclasses look their module up
    spec.loader.exec_module(gen)
    for branch in BRANCHES:
        assert gen.BRANCHES[branch].has_integrated == HAS_INTEGRATED[branch], branch
        tree = nvsrc.nvidia_source(gen.BRANCHES[branch].source_version)
        has = "is_integrated_gpu;" in (tree / "nvidia-uvm" / "uvm_gpu.h").read_text()
        assert has == HAS_INTEGRATED[branch], branch
