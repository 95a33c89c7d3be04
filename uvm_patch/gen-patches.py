#!/usr/bin/python3
"""Regenerate the per-branch hook patches in uvm_patch/patches/<branch>/ from pristine NVIDIA trees.

The hooks are written here once, as edits anchored on exact text of NVIDIA's files; each anchor must
occur exactly once or generation stops. Per-branch drift (see README "Branches and drift") is the
`Branch` fields below. The output is a plain unified diff (`patch -p1 --fuzz=0` from the tree root)
containing only our lines and their context lines, never whole NVIDIA files.

    uvm_patch/gen-patches.py BRANCH TREE      # print the patch for TREE (a /usr/src-layout tree)
    uvm_patch/gen-patches.py --write          # regenerate all branches from $SPARK_MEMSAVER_TEST_CACHE/nv/<ver>

The pool files (uvm_patch/src/uvm_pt_pack.[ch]) are NOT in the patch: the apply step copies them.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PATCH_NAME = "0001-uvm-pt-pack-hooks.patch"


@dataclasses.dataclass(frozen=True)
class Branch:
    name: str
    source_version: str          # tree the patch is generated from
    unmap_fn: str                # NVIDIA's sysmem DMA-unmap function in this branch
    has_integrated: bool         # uvm_parent_gpu_t.is_integrated_gpu exists (575+)


BRANCHES = {
    "r535": Branch("r535", "535.261.03", "uvm_gpu_unmap_cpu_pages", False),
    "r550": Branch("r550", "550.163.01", "uvm_parent_gpu_unmap_cpu_pages", False),
    "r555": Branch("r555", "555.58.02", "uvm_parent_gpu_unmap_cpu_pages", False),
    "r580": Branch("r580", "580.142", "uvm_parent_gpu_unmap_cpu_pages", True),
    "r590": Branch("r590", "590.48.01", "uvm_parent_gpu_unmap_cpu_pages", True),
    "r595": Branch("r595", "595.45.04", "uvm_parent_gpu_unmap_cpu_pages", True),
}

GLUE = """
// spark-memsaver (uvm-pt-pack/1): page-table packing hooks. The pool lives in
// uvm_pt_pack.c; its backing pages come from, and go back to, NVIDIA's own
// full-page sysmem path above, so memcg charging, DMA mapping, physical TLB
// invalidation and mapped_cpu_pages_size accounting are unchanged.
static int pt_pack_get_page(void *ctx, struct page **page, u64 *gpu_addr)
{
    uvm_page_tree_t *tree = ctx;
    uvm_mmu_page_table_alloc_t backing;
    NV_STATUS status;

    memset(&backing, 0, sizeof(backing));
    status = phys_mem_allocate_sysmem(tree, PAGE_SIZE, &backing);
    if (status == NV_ERR_NO_MEMORY)
        return -ENOMEM;
    if (status != NV_OK)
        return -EIO;

    *page = backing.handle.page;
    *gpu_addr = backing.addr.address;
    return 0;
}

// Called with tree->lock held, after the tree tracker wait, like
// phys_mem_deallocate_sysmem().
static void pt_pack_put_page(void *ctx, struct page *page, u64 gpu_addr)
{
    uvm_page_tree_t *tree = ctx;

    uvm_assert_mutex_locked(&tree->lock);
    if (tree->gpu->parent->pci_dev)
        @UNMAP@(tree->gpu->parent, gpu_addr, PAGE_SIZE);
    __free_pages(page, 0);
}

// Runs fn (the pool's descriptor and ownership-entry allocation) charged where
// phys_mem_allocate_sysmem() charges the backing page: in the memcg of the
// va_space's mm for a user tree, nowhere for the kernel tree.
static int pt_pack_charged(void *ctx, int (*fn)(void *arg, gfp_t gfp), void *arg)
{
    uvm_page_tree_t *tree = ctx;
    uvm_memcg_context_t memcg_context;
    uvm_va_space_t *va_space = NULL;
    struct mm_struct *mm = NULL;
    int ret;

    if (tree->type == UVM_PAGE_TREE_TYPE_USER &&
        tree->gpu_va_space &&
        UVM_CGROUP_ACCOUNTING_SUPPORTED()) {
        va_space = tree->gpu_va_space->va_space;
        mm = uvm_va_space_mm_retain(va_space);
        if (mm)
            uvm_memcg_context_start(&memcg_context, mm);
    }

    ret = fn(arg, mm ? GFP_KERNEL | __GFP_ACCOUNT : GFP_KERNEL);

    if (mm) {
        uvm_memcg_context_end(&memcg_context);
        uvm_va_space_mm_release(va_space);
    }
    return ret;
}

static const struct uvm_pt_pack_ops pt_pack_ops = {
    .get = pt_pack_get_page,
    .put = pt_pack_put_page,
    .charged = pt_pack_charged,
};

static bool pt_pack_dev_is_dma_coherent(struct pci_dev *pci_dev)
{
#if defined(NV_LINUX_DMA_MAP_OPS_H_PRESENT)
    return pci_dev != NULL && dev_is_dma_coherent(&pci_dev->dev);
#else
    return false;
#endif
}

// Evaluated once per tree, after the tree location is known and the root (never
// packed) is allocated, so every later table sees the decision. Allocates
// nothing.
static void pt_pack_tree_init(uvm_page_tree_t *tree)
{
    uvm_gpu_t *gpu = tree->gpu;
    struct uvm_pt_pack_facts facts = {
        .tier = uvm_pt_pack_requested_tier(),
        .has_pci_dev = gpu->parent->pci_dev != NULL,
        .no_vidmem = gpu->mem_info.size == 0,
        .integrated = @INTEGRATED@,
        .sysmem_tree = tree->location == UVM_APERTURE_SYS,
        .dma_coherent = pt_pack_dev_is_dma_coherent(gpu->parent->pci_dev),
        .user_tree = tree->type == UVM_PAGE_TREE_TYPE_USER,
        .page_size = PAGE_SIZE,
    };

    uvm_pt_pack_tree_init(&tree->pt_pack, &facts, &pt_pack_ops, tree);
}

// A packed slot for a non-root table, or NV_WARN_NOTHING_TO_DO when the table
// takes NVIDIA's path. Called without tree->lock, like phys_mem_allocate().
static NV_STATUS pt_pack_allocate(uvm_page_tree_t *tree,
                                  NvU32 depth,
                                  NvLength size,
                                  uvm_mmu_page_table_alloc_t *out)
{
    struct page *page;
    u64 gpu_addr;
    u32 tag;
    int ret;

    if (!uvm_pt_pack_active(&tree->pt_pack))
        return NV_WARN_NOTHING_TO_DO;

    ret = uvm_pt_pack_alloc(&tree->pt_pack, depth, size, &page, &gpu_addr, &tag);
    if (ret == UVM_PT_PACK_NOT_PACKED)
        return NV_WARN_NOTHING_TO_DO;
    if (ret < 0)
        return errno_to_nv_status(ret);

    memset(out, 0, sizeof(*out));
    out->handle.page = page;
    out->addr = uvm_gpu_phys_address(UVM_APERTURE_SYS, gpu_addr);
    out->size = size;
    out->pt_pack_tag = tag;
    return NV_OK;
}
"""


class AnchorError(RuntimeError):
    pass


def _once(text: str, anchor: str, what: str) -> int:
    n = text.count(anchor)
    if n != 1:
        raise AnchorError(f"{what}: anchor found {n} times: {anchor!r}")
    return text.index(anchor)


def _insert_after(text: str, anchor: str, new: str, what: str) -> str:
    i = _once(text, anchor, what) + len(anchor)
    return text[:i] + new + text[i:]


def edit_mmu_c(text: str, br: Branch) -> str:
    # 1. free hook: after the tracker wait and aperture check in phys_mem_deallocate_sysmem().
    free_fn = _once(text, "static void phys_mem_deallocate_sysmem(", "deallocate_sysmem")
    anchor = "    UVM_ASSERT(ptr->addr.aperture == UVM_APERTURE_SYS);\n"
    i = text.index(anchor, free_fn) + len(anchor)
    if text.index("\n}\n", free_fn) < i:
        raise AnchorError("aperture assert not inside phys_mem_deallocate_sysmem()")
    text = text[:i] + (
        "\n"
        "    // spark-memsaver: a packed slot goes back to its tree's pool (GPU-idle\n"
        "    // after the tracker wait above); so does any free the pool cannot match\n"
        "    // to a live table of its own (it WARNs and keeps the page). Only\n"
        "    // NVIDIA's own tables take NVIDIA's path.\n"
        "    if (uvm_pt_pack_free(&tree->pt_pack, ptr->handle.page, ptr->addr.address, ptr->size,\n"
        "                         ptr->pt_pack_tag))\n"
        "        return;\n"
        "\n") + text[i:]

    # 2. glue: right after phys_mem_deallocate().
    dealloc = _once(text, "static void phys_mem_deallocate(uvm_page_tree_t *tree, uvm_mmu_page_table_alloc_t *ptr)\n{",
                    "phys_mem_deallocate")
    end = text.index("\n}\n", dealloc) + len("\n}\n")
    glue = GLUE.replace("@UNMAP@", br.unmap_fn).replace(
        "@INTEGRATED@", "gpu->parent->is_integrated_gpu ? 1 : 0" if br.has_integrated
        else "-1, // no is_integrated_gpu before 575: never packed (integrated_unknown)")
    text = text[:end] + glue + text[end:]

    # 3. allocate hook in allocate_directory() (the only caller that knows the depth).
    old = "    status = phys_mem_allocate(tree, phys_alloc_size, tree->location, pmm_flags, &dir->phys_alloc);\n"
    new = ("    // spark-memsaver: a slot of a shared backing page when this tree packs.\n"
           "    status = pt_pack_allocate(tree, depth, phys_alloc_size, &dir->phys_alloc);\n"
           "    if (status == NV_WARN_NOTHING_TO_DO)\n"
           "        status = phys_mem_allocate(tree, phys_alloc_size, tree->location, pmm_flags,\n"
           "                                   &dir->phys_alloc);\n")
    _once(text, old, "allocate_directory")
    text = text.replace(old, new)

    # 4. tree init: once the location is known and the root exists. The root (depth 0) never goes to the
    #    pool, and callers skip uvm_page_tree_deinit() when the root allocation fails, so initialising the
    #    pool only after that check keeps its per-tree counters balanced on that failure path.
    text = _insert_after(text, "    tree->root = allocate_directory(tree, UVM_PAGE_SIZE_AGNOSTIC, 0, UVM_PMM_ALLOC_FLAGS_EVICT);\n"
                         "\n    if (tree->root == NULL)\n        return NV_ERR_NO_MEMORY;\n",
                         "\n    // spark-memsaver: decide once per tree whether its tables are packed.\n"
                         "    pt_pack_tree_init(tree);\n", "uvm_page_tree_init")

    # 5. tree deinit: at the very end, after the root (and map_remap tables) are freed.
    #    After a fatal UVM error put_ptes_async() leaves tables in place on purpose: the pool is told to
    #    expect emptiness only while UVM's global status is OK (else it logs rate-limited, no WARN).
    text = _insert_after(text, "    uvm_kvfree(tree->root);\n",
                         "\n    // spark-memsaver: every table of this tree is freed by now, unless a\n"
                         "    // fatal error left them in place (then the pool leaks, quietly).\n"
                         "    uvm_pt_pack_tree_deinit(&tree->pt_pack, uvm_global_get_status() == NV_OK);\n",
                         "uvm_page_tree_deinit")
    deinit = _once(text, "void uvm_page_tree_deinit(uvm_page_tree_t *tree)\n{", "deinit function")
    if not (deinit < text.index("uvm_pt_pack_tree_deinit(&tree->pt_pack,") < text.index("\n}\n", deinit)):
        raise AnchorError("uvm_kvfree(tree->root) is not in uvm_page_tree_deinit()")
    return text


def edit_mmu_h(text: str, br: Branch) -> str:
    text = _insert_after(text, '#include "uvm_test_ioctl.h"\n', '#include "uvm_pt_pack.h"\n', "uvm_mmu.h include")
    text = _insert_after(text, "        uvm_gpu_chunk_t *chunk;\n    } handle;\n",
                         "\n    // spark-memsaver: the pool's tag of a packed table (uvm_pt_pack_alloc()),\n"
                         "    // 0 for a table of NVIDIA's path. Stale and double frees of packed tables\n"
                         "    // are caught by it even after their page was recycled.\n"
                         "    NvU32 pt_pack_tag;\n", "uvm_mmu_page_table_alloc_t")
    text = _insert_after(text, "    bool location_sys_fallback;\n",
                         "\n    // spark-memsaver: pool packing this tree's small tables into shared\n"
                         "    // backing pages (uvm_pt_pack.h). All-zero (memset in init) = inactive.\n"
                         "    struct uvm_pt_pack_pool pt_pack;\n", "uvm_page_tree_struct")
    return text


def edit_kbuild(text: str, br: Branch) -> str:
    return _insert_after(text, "NVIDIA_UVM_SOURCES += nvidia-uvm/uvm_mmu.c\n",
                         "NVIDIA_UVM_SOURCES += nvidia-uvm/uvm_pt_pack.c\n", "sources Kbuild")


EDITS = [
    ("nvidia-uvm/uvm_mmu.h", edit_mmu_h),
    ("nvidia-uvm/uvm_mmu.c", edit_mmu_c),
    ("nvidia-uvm/nvidia-uvm-sources.Kbuild", edit_kbuild),
]


def make_patch(br: Branch, tree: Path) -> str:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for rel, fn in EDITS:
            old = (tree / rel).read_text()
            new = fn(old, br)
            a = Path(tmp) / "a" / rel
            b = Path(tmp) / "b" / rel
            a.parent.mkdir(parents=True, exist_ok=True)
            b.parent.mkdir(parents=True, exist_ok=True)
            a.write_text(old)
            b.write_text(new)
            p = subprocess.run(["diff", "-u", "--label", f"a/{rel}", "--label", f"b/{rel}", str(a), str(b)],
                               capture_output=True, text=True)
            if p.returncode != 1:
                raise RuntimeError(f"diff failed for {rel}: {p.stderr}")
            out.append(p.stdout)
    header = (f"spark-memsaver uvm-pt-pack/1 hooks, branch {br.name} (generated from NVIDIA {br.source_version}\n"
              f"by uvm_patch/gen-patches.py). Apply with: patch -p1 --fuzz=0, after copying\n"
              f"uvm_patch/src/uvm_pt_pack.[ch] into nvidia-uvm/.\n\n")
    return header + "".join(out)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--write"]:
        sys.path.insert(0, str(HERE.parent / "tests"))
        from support import nvsrc  # noqa: E402
        for br in BRANCHES.values():
            tree = nvsrc.nvidia_source(br.source_version)
            dest = HERE / "patches" / br.name / PATCH_NAME
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(make_patch(br, tree))
            print(f"{dest.relative_to(HERE.parent)} <- {tree}")
        return 0
    if len(argv) == 2 and argv[0] in BRANCHES:
        sys.stdout.write(make_patch(BRANCHES[argv[0]], Path(argv[1])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
