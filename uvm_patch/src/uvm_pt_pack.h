/* SPDX-License-Identifier: GPL-2.0-only OR MIT */
/*
 * uvm_pt_pack: packing pool for nvidia-uvm GPU page tables kept in CPU memory.
 *
 * Part of spark-memsaver. This header and uvm_pt_pack.c are identical for every
 * NVIDIA driver branch. They use only Linux kernel APIs (and, where
 * UVM_PT_PACK_UVM_LOCKS, UVM's lock type from uvm_lock.h). The per-branch hunks in
 * uvm_mmu.c / uvm_mmu.h adapt UVM's types to this interface.
 *
 * What it does: a GPU page table of 256 B or 4096 B normally costs one whole CPU
 * page (64 KiB on a 64 KiB kernel). The pool hands out table-sized slots of shared
 * backing pages instead. A backing page is one full PAGE_SIZE page obtained and
 * returned through the caller's callbacks, which wrap NVIDIA's own full-page path
 * (alloc_pages + DMA map), so memcg accounting, DMA mapping, physical TLB
 * invalidation and mapped_cpu_pages_size accounting all stay NVIDIA's.
 *
 * Tiers (module parameter uvm_pt_pack, read when a tree is initialised):
 *   0 OFF    : every table takes NVIDIA's path.
 *   1 4K_ALL : opt-in ("4k-all"). 4096 B tables and 256 B tables of every
 *              tree (the kernel tree too) each in a 4 KiB-aligned slot
 *              (16 per 64 KiB page): parity with a stock 4 KiB kernel.
 *   2 256    : opt-in, not validated on hardware. 256 B tables at 256 B
 *              granularity (256 per 64 KiB page); 4096 B tables in 4 KiB slots.
 *   3 LEAF   : default ("leaf"), the scope validated on GB10 hardware by the
 *              seed project: only 256 B tables (64K-page PTE tables, depth 5)
 *              of USER trees, each in a 4 KiB-aligned slot. Directories,
 *              4 KiB tables and UVM's kernel tree take NVIDIA's path.
 * The root table (depth 0) is never packed: RM takes its page directly.
 *
 * Lifetime and locking contract for the hooks (one pool per page tree):
 *   - A zero-filled struct uvm_pt_pack_pool is a valid, inactive pool (so the
 *     memset(tree, 0) at the top of uvm_page_tree_init() is enough before
 *     uvm_pt_pack_tree_init() runs). Inactive pools pass every call through.
 *   - uvm_pt_pack_tree_init(): once per tree, no allocation, cannot fail.
 *   - uvm_pt_pack_alloc(): called WITHOUT tree->lock, possibly concurrently.
 *     It may call ops->get() (which may sleep, allocate, DMA-map and push GPU
 *     work) and ops->charged(); it never calls ops->put().
 *   - uvm_pt_pack_free(): called WITH tree->lock held, after the tree tracker
 *     wait (the slot is GPU-idle). It may call ops->put() for a backing page
 *     that became empty (still under tree->lock, as NVIDIA's free path is).
 *     A free the pool cannot match to a live table of its own (a stale or
 *     double free, another pool's table, an unpacked table in one of its pages)
 *     WARNs once and returns true: the caller must not free that page, which
 *     holds, or may again hold, other tables.
 *   - uvm_pt_pack_tree_deinit(pool, expect_empty): after the last table (and
 *     the root) is freed. A non-empty pool is a bug (WARN) when expect_empty;
 *     when not (UVM's global status is an error: put_ptes_async() leaves
 *     tables in place after a fatal error) it logs one rate-limited line.
 *     Either way the leftover pages are leaked, never freed under a GPU that
 *     may still walk them.
 *   - Ownership is recorded only in the pool's own descriptors (a per-pool
 *     xarray keyed by pfn, one entry per backing page held) and in a nonzero
 *     tag per live table that the caller keeps beside the table (0: NVIDIA's
 *     path). A page recycled by the buddy allocator (and its DMA address by the
 *     IOVA cache) gets a new descriptor and new tags, so a stale free of a
 *     table that lived in it before is told apart from a live one. The pool
 *     never reads or writes any field of a struct page (page->private stays
 *     NVIDIA's).
 *   - pool->lock is a leaf lock (UVM_LOCK_ORDER_LEAF), taken under tree->lock
 *     or with no lock held. The pool never allocates, DMA-maps, calls a
 *     callback or waits while holding it.
 */
#ifndef _UVM_PT_PACK_H
#define _UVM_PT_PACK_H

#include <linux/version.h>
#include <linux/types.h>
#include <linux/list.h>
#include <linux/spinlock.h>

/*
 * Kernel floor: Linux 5.0. The ownership map is an XArray (<linux/xarray.h>
 * arrived in 4.20) iterated with xa_for_each(xa, index, entry), the form
 * since 5.0 (4.20 had a five-argument one). NVIDIA's branches build down to
 * 4.15: on 4.15-4.19 and 4.20 this module cannot be built with the pool;
 * stop with the reason instead of an unrelated header or macro error.
 */
#if LINUX_VERSION_CODE < KERNEL_VERSION(5, 0, 0)
#error "uvm_pt_pack needs Linux 5.0 or newer (XArray, xa_for_each(xa, index, entry)); build this kernel's nvidia-uvm unpatched"
#endif
#include <linux/xarray.h>

/*
 * The pool lock: UVM's leaf spinlock (lock order UVM_LOCK_ORDER_LEAF) where
 * UVM_PT_PACK_UVM_LOCKS (the upstream series, the userspace harness); a plain
 * leaf spinlock in the DKMS build, so that the pool includes no UVM header and
 * compiles wherever the kernel's own headers do.
 */
#ifdef UVM_PT_PACK_UVM_LOCKS
#include "uvm_lock.h"
#define UVM_PT_PACK_LOCK_T       uvm_spinlock_t
#define uvm_pt_pack_lock_init(l) uvm_spin_lock_init((l), UVM_LOCK_ORDER_LEAF)
#define uvm_pt_pack_lock(l)      uvm_spin_lock(l)
#define uvm_pt_pack_unlock(l)    uvm_spin_unlock(l)
#else  /* DKMS build, standalone selftests: a plain spinlock */
#define UVM_PT_PACK_LOCK_T       spinlock_t
#define uvm_pt_pack_lock_init(l) spin_lock_init(l)
#define uvm_pt_pack_lock(l)      spin_lock(l)
#define uvm_pt_pack_unlock(l)    spin_unlock(l)
#endif

struct page;

#define UVM_PT_PACK_FORMAT   2                  /* counters text format (README) */
#define UVM_PT_PACK_ID       "uvm-pt-pack/1"    /* MODULE_INFO(spark_memsaver, ...) */

enum uvm_pt_pack_tier {
	UVM_PT_PACK_TIER_OFF    = 0,
	UVM_PT_PACK_TIER_4K_ALL = 1,
	UVM_PT_PACK_TIER_256    = 2,
	UVM_PT_PACK_TIER_LEAF   = 3,
	UVM_PT_PACK_TIER_NR
};

/* Why a tree is (not) packed. Stable short tokens: uvm_pt_pack_reason_str(). */
enum uvm_pt_pack_reason {
	UVM_PT_PACK_OK = 0,           /* "none"          packed */
	UVM_PT_PACK_R_DISABLED,       /* "disabled"      tier is OFF */
	UVM_PT_PACK_R_BAD_TIER,       /* "bad_tier"      tier value unknown */
	UVM_PT_PACK_R_NO_PCI_DEV,     /* "no_pci_dev"    fake GPU (unit tests) */
	UVM_PT_PACK_R_HAS_VIDMEM,     /* "has_vidmem"    mem_info.size != 0 */
	UVM_PT_PACK_R_NOT_INTEGRATED, /* "not_integrated" is_integrated_gpu false */
	UVM_PT_PACK_R_NOT_SYSMEM,     /* "not_sysmem"    tree location is not SYS */
	UVM_PT_PACK_R_NOT_COHERENT,   /* "not_coherent"  !dev_is_dma_coherent() */
	UVM_PT_PACK_R_PAGE_SIZE,      /* "page_size"     tier saves nothing at PAGE_SIZE */
	UVM_PT_PACK_R_KERNEL_TREE,    /* "kernel_tree"   leaf tier: UVM's kernel tree (uncounted) */
	/* "integrated_unknown": the branch cannot tell an integrated GPU from a discrete one */
	UVM_PT_PACK_R_INTEGRATED_UNKNOWN,
	UVM_PT_PACK_R_NR
};

/* Facts the hook gathers once per tree (in uvm_page_tree_init()). */
struct uvm_pt_pack_facts {
	int tier;               /* requested tier: pass uvm_pt_pack_requested_tier() */
	bool has_pci_dev;       /* gpu->parent->pci_dev != NULL */
	bool no_vidmem;         /* gpu->mem_info.size == 0 */
	int integrated;         /* 1: is_integrated_gpu, 0: not, -1: unknown (not packed) */
	bool sysmem_tree;       /* tree->location == UVM_APERTURE_SYS */
	bool dma_coherent;      /* dev_is_dma_coherent(&pci_dev->dev); false if no pci_dev */
	bool user_tree;         /* tree->type == UVM_PAGE_TREE_TYPE_USER */
	unsigned long page_size;/* PAGE_SIZE */
};

/*
 * Backing-page callbacks. ctx is the hook's cookie (the uvm_page_tree_t *).
 * get: obtain one zeroed, DMA-mapped page of exactly PAGE_SIZE bytes through
 *      NVIDIA's path; return 0 and fill *page and *gpu_addr (GPU/DMA address of
 *      the page start, PAGE_SIZE aligned), or a negative errno. Called without
 *      any pool lock; may sleep.
 * put: unmap and free a page previously returned by get. Called with tree->lock
 *      held (free path), never with the pool lock held.
 * charged (optional): return fn(arg, gfp) run in the memory cgroup context
 *      that get() charges its pages to, with gfp GFP_KERNEL plus __GFP_ACCOUNT
 *      where get() charges (a user tree), plain GFP_KERNEL where it does not
 *      (the kernel tree). The pool's per-page descriptor and ownership entry are
 *      allocated through it. NULL: allocated uncharged. Called without locks.
 */
struct uvm_pt_pack_ops {
	int  (*get)(void *ctx, struct page **page, u64 *gpu_addr);
	void (*put)(void *ctx, struct page *page, u64 gpu_addr);
	int  (*charged)(void *ctx, int (*fn)(void *arg, gfp_t gfp), void *arg);
};

/* Size classes. */
enum {
	UVM_PT_PACK_C256 = 0,  /* 256 B tables (64K-page PTE tables, depth 5) */
	UVM_PT_PACK_C4096,     /* 4096 B tables (directories depth 1-4, 4K-page PTE tables) */
	UVM_PT_PACK_NR_CLASSES
};

struct uvm_pt_pack_class {
	struct list_head partial;   /* backing pages with at least one free slot */
	struct list_head full;      /* backing pages with no free slot */
	unsigned int slot_size;     /* bytes per slot (alignment of every table) */
	unsigned int slots_per_page;
	unsigned long tables;       /* live tables in this class */
	unsigned long pages;        /* backing pages held by this class */
};

/* Per-tree pool; embed it in uvm_page_tree_t. Fields are private to uvm_pt_pack.c. */
struct uvm_pt_pack_pool {
	UVM_PT_PACK_LOCK_T lock;
	/* every backing page of this pool: pfn -> descriptor (ownership) */
	struct xarray owners;
	int tier;                   /* UVM_PT_PACK_TIER_OFF => inactive */
	int state;                  /* 0 never initialised (zero-filled), else counted state */
	const struct uvm_pt_pack_ops *ops;
	void *ctx;
	struct uvm_pt_pack_class cls[UVM_PT_PACK_NR_CLASSES];
};

/* Return value of uvm_pt_pack_alloc() when the table must take NVIDIA's path. */
#define UVM_PT_PACK_NOT_PACKED 1

/* The module parameter uvm_pt_pack (0..3; anything else was turned into 0 at load). */
int uvm_pt_pack_requested_tier(void);

/* Pure predicate: every condition required; no side effects. */
enum uvm_pt_pack_reason uvm_pt_pack_check(const struct uvm_pt_pack_facts *facts);

/* Stable short token for a reason ("none", "no_pci_dev", ...). */
const char *uvm_pt_pack_reason_str(enum uvm_pt_pack_reason reason);

/*
 * Set up the pool of one tree: evaluates uvm_pt_pack_check(facts), updates the
 * trees_packed / trees_unpacked / unpacked_reason counters and activates the
 * pool when the predicate holds. Never allocates; returns the reason.
 */
enum uvm_pt_pack_reason uvm_pt_pack_tree_init(struct uvm_pt_pack_pool *pool,
					      const struct uvm_pt_pack_facts *facts,
					      const struct uvm_pt_pack_ops *ops,
					      void *ctx);

/* True when the pool packs tables (predicates matched at tree init). */
bool uvm_pt_pack_active(const struct uvm_pt_pack_pool *pool);

/*
 * Allocate a table of `size` bytes at `depth` (0 = root).
 * Returns 0 and fills *page (the backing page), *gpu_addr (backing page
 * address + slot offset; aligned to the class slot size; the slot is zeroed)
 * and *tag (nonzero; keep it with the table and pass it to uvm_pt_pack_free()).
 * When the pool cannot record a fresh backing page (no memory for its
 * descriptor), it returns 0 with *tag = 0 and the whole zeroed page from get():
 * exactly what NVIDIA's path makes for one table, freed by NVIDIA's path.
 * Or UVM_PT_PACK_NOT_PACKED: pool inactive, depth 0, or a size the tier does
 * not pack -> take NVIDIA's path; or a negative errno from ops->get.
 * Called without tree->lock.
 */
int uvm_pt_pack_alloc(struct uvm_pt_pack_pool *pool, unsigned int depth, u64 size,
		      struct page **page, u64 *gpu_addr, u32 *tag);

/*
 * Free a table (tag: as returned by uvm_pt_pack_alloc(), 0 for a table of
 * NVIDIA's path). Returns false only for a table of NVIDIA's path whose page
 * is not one of this pool's (the caller frees it); true when the pool released
 * the table, or refused a bad free with a WARN (the caller frees nothing).
 * Called with tree->lock held after the tracker wait. May call ops->put().
 */
bool uvm_pt_pack_free(struct uvm_pt_pack_pool *pool, struct page *page, u64 gpu_addr,
		      u64 size, u32 tag);

/* True if the pool holds no table and no backing page. */
bool uvm_pt_pack_pool_empty(const struct uvm_pt_pack_pool *pool);

/*
 * Tear down at the end of uvm_page_tree_deinit(). expect_empty: pass
 * uvm_global_get_status() == NV_OK. A non-empty pool WARNs when expect_empty,
 * else logs a rate-limited line; leftover pages are leaked either way, and
 * move from the live counters to the leaked_* ones of uvm_pt_pack_stats.
 */
void uvm_pt_pack_tree_deinit(struct uvm_pt_pack_pool *pool, bool expect_empty);

#endif /* _UVM_PT_PACK_H */
