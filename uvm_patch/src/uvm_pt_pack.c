// SPDX-License-Identifier: GPL-2.0-only OR MIT
/*
 * uvm_pt_pack: packing pool for nvidia-uvm GPU page tables kept in CPU memory.
 * Part of spark-memsaver. See uvm_pt_pack.h for the interface and the locking
 * contract, and uvm_patch/README.md for the design and the counters format.
 *
 * This file is identical for every NVIDIA driver branch. It is also compiled
 * unchanged in userspace by tests/harness/.
 *
 * Layout: each size class keeps backing pages (one full PAGE_SIZE page from the
 * caller's get() callback) on a "partial" list (at least one free slot) or a
 * "full" list. A per-page descriptor holds a bitmap of used slots and the tag
 * of each live table; the pool finds it through its own xarray keyed by pfn
 * (it never touches a field of struct page). A page whose last table is freed
 * is handed back through put() at once, so the pool never holds an empty page.
 */
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/kernel.h>
#include <linux/errno.h>
#include <linux/types.h>
#include <linux/bug.h>
#include <linux/atomic.h>
#include <linux/bitops.h>
#include <linux/list.h>
#include <linux/spinlock.h>
#include <linux/slab.h>
#include <linux/mm.h>
#include <linux/string.h>
#include <linux/printk.h>
#include <linux/kmemleak.h>
#include <linux/xarray.h>
#include <linux/overflow.h>

#include "uvm_pt_pack.h"

/*
 * Compiled-in default of the uvm_pt_pack parameter; the DKMS template passes
 * -DUVM_PT_PACK_DEFAULT=<n>.
 */
#ifndef UVM_PT_PACK_DEFAULT
#define UVM_PT_PACK_DEFAULT 3      /* UVM_PT_PACK_TIER_LEAF */
#endif
#if UVM_PT_PACK_DEFAULT < 0 || UVM_PT_PACK_DEFAULT > 3
#error "UVM_PT_PACK_DEFAULT must be 0 (off), 1 (4k-all), 2 (256) or 3 (leaf)"
#endif

/*
 * Test-only fault injection, used by tests/harness to prove that its checker
 * catches a broken allocator. Never defined by any kernel build.
 *   1: a slot is handed out without being marked used (overlapping tables)
 *   2: returned table addresses are off by 128 bytes (misaligned tables)
 *   3: a reused slot is not zeroed
 *   4: a backing page that becomes empty is kept instead of released
 *   5: the leaf tier also packs 4096 B tables and kernel trees (scope leak)
 * and two on the out-of-memory paths, for the kernel VM tests only
 * (tests/test_kernel_oom.py; the userspace harness does not build them):
 *   6: a backing page whose descriptor cannot be allocated is dropped, neither
 *      handed out whole nor put (a leaked page, and its mapping)
 *   7: a failed get() is reported as success (no page, address 0)
 */
#ifndef UVM_PT_PACK_FAULT_INJECT
#define UVM_PT_PACK_FAULT_INJECT 0
#endif
#define PT_PACK_FI(n) (UVM_PT_PACK_FAULT_INJECT == (n))

/*
 * TEST-ONLY: UVM_PT_PACK_TEST_FAKE_GPU (defined by test builds only) lets the
 * pool accept the fake GPUs of NVIDIA's own unit tests (UVM_TEST_PAGE_TREE: pci_dev == NULL, tables
 * addressed by physical address, no DMA mapping) and keeps cumulative counters
 * (test_total_* lines of uvm_pt_pack_stats). Only tests/support/uvmvm.py passes
 * it; the DKMS build never does (tests/test_kernel_pagetree.py checks the
 * rendered DKMS tree and the built module's strings).
 */
#ifdef UVM_PT_PACK_TEST_FAKE_GPU
static atomic64_t pt_pack_test_total[5];  /* trees packed, tables c256/c4096, pages c256/c4096 */
#define PT_PACK_TEST_COUNT(i) atomic64_inc(&pt_pack_test_total[i])
#else
#define PT_PACK_TEST_COUNT(i) do { } while (0)
#endif

#define PT_PACK_MIN_SLOT   256u
#define PT_PACK_MAX_SLOT   4096u
#define PT_PACK_MAX_SLOTS  (PAGE_SIZE / PT_PACK_MIN_SLOT)
#define PT_PACK_MAGIC      0x75707470u   /* "uptp" */

/* Pool states (struct uvm_pt_pack_pool.state); 0 = zero-filled, never initialised. */
enum {
	PT_PACK_STATE_NONE = 0,
	PT_PACK_STATE_PACKED,      /* counted in trees_packed */
	PT_PACK_STATE_UNPACKED,    /* counted in trees_unpacked */
	PT_PACK_STATE_DISABLED,    /* tier OFF: counted nowhere */
	PT_PACK_STATE_DEAD,        /* after deinit */
};

/* One backing page. */
struct pt_pack_backing {
	struct list_head link;          /* on cls->partial or cls->full */
	struct uvm_pt_pack_pool *pool;
	struct page *page;
	u64 gpu_addr;                   /* address of the page start, from get() */
	unsigned int magic;
	unsigned int cls;
	unsigned int first;             /* offset of slot 0 (0 unless gpu_addr is misaligned) */
	unsigned int nslots;            /* usable slots in this page */
	unsigned int used;              /* slots in use */
	unsigned long map[BITS_TO_LONGS(PT_PACK_MAX_SLOTS)];
	u32 tag[];                      /* tag of the live table in each slot */
};

static int uvm_pt_pack = UVM_PT_PACK_DEFAULT;

static const char *const pt_pack_tier_names[UVM_PT_PACK_TIER_NR] = {
	[UVM_PT_PACK_TIER_OFF]    = "off",
	[UVM_PT_PACK_TIER_4K_ALL] = "4k-all",
	[UVM_PT_PACK_TIER_256]    = "256",
	[UVM_PT_PACK_TIER_LEAF]   = "leaf",
};

/*
 * A tier by number (0-3) or by name. Anything else is never read as another
 * tier and never fails the load (a typo must not take CUDA out): it is logged
 * and packing stays off, the one value that is always safe.
 */
static int pt_pack_tier_set(const char *val, const struct kernel_param *kp)
{
	int tier;

	if (kstrtoint(val, 0, &tier) || tier < UVM_PT_PACK_TIER_OFF || tier >= UVM_PT_PACK_TIER_NR)
		tier = sysfs_match_string(pt_pack_tier_names, val);
	if (tier < 0) {
		pr_err("nvidia-uvm: uvm_pt_pack=%s is not a tier (0 off, 1 4k-all, 2 256, 3 leaf): packing off\n",
		       val);
		tier = UVM_PT_PACK_TIER_OFF;
	}
	*(int *)kp->arg = tier;
	return 0;
}

static const struct kernel_param_ops pt_pack_tier_ops = {
	.set = pt_pack_tier_set,
	.get = param_get_int,
};

module_param_cb(uvm_pt_pack, &pt_pack_tier_ops, &uvm_pt_pack, 0444);
MODULE_PARM_DESC(uvm_pt_pack,
		 "Pack GPU page tables into shared CPU pages (read at load time; number or name): 0 off, 1 4k-all (every non-root table in 4 KiB slots, opt-in), 2 256 (256 B slots, opt-in, not hardware-validated), 3 leaf (default: 256 B leaf tables of user trees in 4 KiB slots)");

MODULE_INFO(spark_memsaver, UVM_PT_PACK_ID);

/* Global counters, summed over every pool of every GPU. */
static atomic64_t pt_pack_tables[UVM_PT_PACK_NR_CLASSES];
static atomic64_t pt_pack_pages[UVM_PT_PACK_NR_CLASSES];
static atomic64_t pt_pack_trees_packed;
static atomic64_t pt_pack_trees_unpacked;
static atomic_t pt_pack_last_reason;   /* UVM_PT_PACK_OK until a tree is not packed */
/* left allocated by fatal-error teardowns (no longer in the live counters above) */
static atomic64_t pt_pack_leaked_tables;
static atomic64_t pt_pack_leaked_pages;
static atomic64_t pt_pack_bad_frees;    /* frees refused with a WARN */
static atomic64_t pt_pack_whole_pages;  /* tables handed out as a whole page (descriptor ENOMEM) */

static const char *const pt_pack_reason_names[UVM_PT_PACK_R_NR] = {
	[UVM_PT_PACK_OK]               = "none",
	[UVM_PT_PACK_R_DISABLED]       = "disabled",
	[UVM_PT_PACK_R_BAD_TIER]       = "bad_tier",
	[UVM_PT_PACK_R_NO_PCI_DEV]     = "no_pci_dev",
	[UVM_PT_PACK_R_HAS_VIDMEM]     = "has_vidmem",
	[UVM_PT_PACK_R_NOT_INTEGRATED] = "not_integrated",
	[UVM_PT_PACK_R_NOT_SYSMEM]     = "not_sysmem",
	[UVM_PT_PACK_R_NOT_COHERENT]   = "not_coherent",
	[UVM_PT_PACK_R_PAGE_SIZE]      = "page_size",
	[UVM_PT_PACK_R_KERNEL_TREE]    = "kernel_tree",
	[UVM_PT_PACK_R_INTEGRATED_UNKNOWN] = "integrated_unknown",
};

const char *uvm_pt_pack_reason_str(enum uvm_pt_pack_reason reason)
{
	if ((unsigned int)reason >= UVM_PT_PACK_R_NR)
		return "unknown";
	return pt_pack_reason_names[reason];
}

int uvm_pt_pack_requested_tier(void)
{
	int tier = READ_ONCE(uvm_pt_pack);

	/* the set callback stores only known tiers; stay safe if that ever changes */
	if (tier > UVM_PT_PACK_TIER_OFF && tier < UVM_PT_PACK_TIER_NR)
		return tier;
	return UVM_PT_PACK_TIER_OFF;
}

/*
 * Slot size of a class under a tier at a page size; 0 when the class is not
 * packed because packing it would save nothing (one slot per page).
 */
static unsigned int pt_pack_slot_size(int tier, unsigned int cls, unsigned long page_size)
{
	unsigned int slot;

	if (tier == UVM_PT_PACK_TIER_4K_ALL)
		slot = PT_PACK_MAX_SLOT;
	else if (tier == UVM_PT_PACK_TIER_256)
		slot = (cls == UVM_PT_PACK_C256) ? PT_PACK_MIN_SLOT : PT_PACK_MAX_SLOT;
	else if (tier == UVM_PT_PACK_TIER_LEAF && (cls == UVM_PT_PACK_C256 || PT_PACK_FI(5)))
		slot = PT_PACK_MAX_SLOT;   /* 256 B leaf tables in 4 KiB slots only */
	else
		return 0;

	if (page_size < 2 * (unsigned long)slot)
		return 0;
	return slot;
}

enum uvm_pt_pack_reason uvm_pt_pack_check(const struct uvm_pt_pack_facts *facts)
{
	unsigned int cls;
	bool saves = false;
#ifdef UVM_PT_PACK_TEST_FAKE_GPU
	struct uvm_pt_pack_facts fake;

	if (!facts->has_pci_dev) {   /* a fake GPU of UVM's unit tests: no device to ask */
		fake = *facts;
		fake.has_pci_dev = true;
		fake.integrated = 1;
		fake.dma_coherent = true;
		facts = &fake;
		pr_warn_once("nvidia-uvm: uvm_pt_pack TEST BUILD (UVM_PT_PACK_TEST_FAKE_GPU): fake GPUs accepted\n");
	}
#endif

	if (facts->tier == UVM_PT_PACK_TIER_OFF)
		return UVM_PT_PACK_R_DISABLED;
	if (facts->tier <= UVM_PT_PACK_TIER_OFF || facts->tier >= UVM_PT_PACK_TIER_NR)
		return UVM_PT_PACK_R_BAD_TIER;
	if (!facts->has_pci_dev)
		return UVM_PT_PACK_R_NO_PCI_DEV;
	if (!facts->no_vidmem)
		return UVM_PT_PACK_R_HAS_VIDMEM;
	/*
	 * Only a GPU known to be integrated: a branch without is_integrated_gpu
	 * (-1) cannot tell GB10 from a discrete GPU without a framebuffer.
	 */
	if (facts->integrated < 0)
		return UVM_PT_PACK_R_INTEGRATED_UNKNOWN;
	if (facts->integrated == 0)
		return UVM_PT_PACK_R_NOT_INTEGRATED;
	if (!facts->sysmem_tree)
		return UVM_PT_PACK_R_NOT_SYSMEM;
	if (!facts->dma_coherent)
		return UVM_PT_PACK_R_NOT_COHERENT;
	/* The validated scope: user trees only. UVM's kernel tree is per GPU and global. */
	if (facts->tier == UVM_PT_PACK_TIER_LEAF && !facts->user_tree && !PT_PACK_FI(5))
		return UVM_PT_PACK_R_KERNEL_TREE;

	/* The pool's descriptors are sized for this kernel's PAGE_SIZE. */
	if (facts->page_size != PAGE_SIZE)
		return UVM_PT_PACK_R_PAGE_SIZE;
	for (cls = 0; cls < UVM_PT_PACK_NR_CLASSES; cls++)
		if (pt_pack_slot_size(facts->tier, cls, facts->page_size))
			saves = true;
	if (!saves)
		return UVM_PT_PACK_R_PAGE_SIZE;

	return UVM_PT_PACK_OK;
}

enum uvm_pt_pack_reason uvm_pt_pack_tree_init(struct uvm_pt_pack_pool *pool,
					      const struct uvm_pt_pack_facts *facts,
					      const struct uvm_pt_pack_ops *ops,
					      void *ctx)
{
	enum uvm_pt_pack_reason reason = uvm_pt_pack_check(facts);
	unsigned int cls;

	memset(pool, 0, sizeof(*pool));
	uvm_pt_pack_lock_init(&pool->lock);
	xa_init(&pool->owners);
	pool->ops = ops;
	pool->ctx = ctx;
	for (cls = 0; cls < UVM_PT_PACK_NR_CLASSES; cls++) {
		INIT_LIST_HEAD(&pool->cls[cls].partial);
		INIT_LIST_HEAD(&pool->cls[cls].full);
	}

	if (reason == UVM_PT_PACK_OK && (!ops || !ops->get || !ops->put)) {
		WARN_ON(1);
		reason = UVM_PT_PACK_R_NO_PCI_DEV;
	}

	if (reason == UVM_PT_PACK_OK) {
		pool->tier = facts->tier;
		for (cls = 0; cls < UVM_PT_PACK_NR_CLASSES; cls++) {
			struct uvm_pt_pack_class *c = &pool->cls[cls];

			c->slot_size = pt_pack_slot_size(facts->tier, cls, PAGE_SIZE);
			c->slots_per_page = c->slot_size ? PAGE_SIZE / c->slot_size : 0;
		}
		pool->state = PT_PACK_STATE_PACKED;
		atomic64_inc(&pt_pack_trees_packed);
		PT_PACK_TEST_COUNT(0);
	} else if (reason == UVM_PT_PACK_R_DISABLED || reason == UVM_PT_PACK_R_KERNEL_TREE) {
		/* out of scope by configuration, not "enabled but inactive": counted nowhere */
		pool->state = PT_PACK_STATE_DISABLED;
	} else {
		pool->state = PT_PACK_STATE_UNPACKED;
		atomic64_inc(&pt_pack_trees_unpacked);
		atomic_set(&pt_pack_last_reason, reason);
	}
	return reason;
}

bool uvm_pt_pack_active(const struct uvm_pt_pack_pool *pool)
{
	return pool->state == PT_PACK_STATE_PACKED && pool->tier != UVM_PT_PACK_TIER_OFF;
}

static int pt_pack_class_of(const struct uvm_pt_pack_pool *pool, unsigned int depth, u64 size)
{
	int cls;

	if (!uvm_pt_pack_active(pool) || depth == 0)
		return -1;
	if (size == 256)
		cls = UVM_PT_PACK_C256;
	else if (size == 4096)
		cls = UVM_PT_PACK_C4096;
	else
		return -1;
	if (!pool->cls[cls].slot_size)
		return -1;
	return cls;
}

static inline u64 pt_pack_slot_offset(const struct uvm_pt_pack_class *c,
				      const struct pt_pack_backing *b, unsigned int slot)
{
	return (u64)b->first + (u64)slot * c->slot_size;
}

/*
 * Tags are unique across every pool (a page may move between pools through
 * the buddy allocator), nonzero, and repeat only after 2^32 allocations.
 */
static atomic_t pt_pack_last_tag;

static u32 pt_pack_new_tag(void)
{
	u32 tag;

	do {
		tag = (u32)atomic_inc_return(&pt_pack_last_tag);
	} while (!tag);
	return tag;
}

/*
 * Take a free slot of b and give it a fresh tag; -1 if b (on the partial list)
 * has none, which is a bookkeeping bug: warn once, park b on the full list,
 * let the caller fall back to NVIDIA's path. Pool lock held.
 */
static int pt_pack_take_slot(struct uvm_pt_pack_class *c, struct pt_pack_backing *b, u32 *tag)
{
	unsigned int slot = find_first_zero_bit(b->map, b->nslots);

	if (WARN_ON_ONCE(slot >= b->nslots)) {
		list_move(&b->link, &c->full);
		return -1;
	}
	if (!PT_PACK_FI(1))
		__set_bit(slot, b->map);
	b->tag[slot] = pt_pack_new_tag();
	*tag = b->tag[slot];
	b->used++;
	c->tables++;
	atomic64_inc(&pt_pack_tables[b->cls]);
	PT_PACK_TEST_COUNT(1 + b->cls);
	if (b->used == b->nslots)
		list_move(&b->link, &c->full);
	return (int)slot;
}

/*
 * Backing pages come from alloc_pages() without __GFP_HIGHMEM (NVIDIA's flags
 * are GFP_KERNEL based), so they are in the kernel's linear map.
 */
static void pt_pack_zero_slot(struct page *page, u64 offset, unsigned int len)
{
	memset((char *)page_address(page) + offset, 0, len);
}

struct pt_pack_new {
	struct uvm_pt_pack_pool *pool;
	struct page *page;
	unsigned int nslots;
	struct pt_pack_backing *b;
};

/*
 * The descriptor of a fresh backing page and its ownership entry, allocated
 * where the page is charged (ops->charged). No lock held.
 */
static int pt_pack_new_backing(void *arg, gfp_t gfp)
{
	struct pt_pack_new *n = arg;
	struct pt_pack_backing *b;
	int err;

	/* __GFP_NOMEMALLOC: page-table bookkeeping must not dip into the reserves */
	b = kzalloc(struct_size(b, tag, n->nslots), gfp | __GFP_NOMEMALLOC);
	if (!b)
		return -ENOMEM;
	err = xa_insert(&n->pool->owners, page_to_pfn(n->page), b, gfp | __GFP_NOMEMALLOC);
	if (err) {
		kfree(b);
		return err;
	}
	n->b = b;
	return 0;
}

int uvm_pt_pack_alloc(struct uvm_pt_pack_pool *pool, unsigned int depth, u64 size,
		      struct page **page_out, u64 *gpu_addr_out, u32 *tag_out)
{
	struct uvm_pt_pack_class *c;
	struct pt_pack_backing *b;
	struct pt_pack_new n;
	struct page *page = NULL;
	u64 gpu_addr = 0, offset;
	u32 tag = 0;
	int slot;
	int cls = pt_pack_class_of(pool, depth, size);
	int err;

	if (cls < 0)
		return UVM_PT_PACK_NOT_PACKED;
	c = &pool->cls[cls];

	uvm_pt_pack_lock(&pool->lock);
	if (!list_empty(&c->partial)) {
		b = list_first_entry(&c->partial, struct pt_pack_backing, link);
		slot = pt_pack_take_slot(c, b, &tag);
		uvm_pt_pack_unlock(&pool->lock);
		if (slot < 0)
			return UVM_PT_PACK_NOT_PACKED;
		goto found;
	}
	uvm_pt_pack_unlock(&pool->lock);

	/*
	 * No free slot: get a new backing page with no lock held (get() may sleep,
	 * allocate, DMA-map and push GPU work). Another thread may do the same for
	 * this class at the same time; both pages are kept, the spare slots are used
	 * by later allocations, so alloc never needs put() (which wants tree->lock).
	 */
	err = pool->ops->get(pool->ctx, &page, &gpu_addr);
	if (PT_PACK_FI(7) && (err || !page)) {
		*page_out = NULL;
		*gpu_addr_out = 0;
		*tag_out = 0;
		return 0;
	}
	if (err || !page)
		return err < 0 ? err : -ENOMEM;

	n.pool = pool;
	n.page = page;
	n.nslots = c->slots_per_page;
	n.b = NULL;
	if (pool->ops->charged)
		err = pool->ops->charged(pool->ctx, pt_pack_new_backing, &n);
	else
		err = pt_pack_new_backing(&n, GFP_KERNEL);
	if (err == -EBUSY) {
		/* get() handed out a page this pool still holds: leave it alone */
		WARN(1, "uvm_pt_pack: backing page %lx is already in the pool\n",
		     page_to_pfn(page));
		return -EIO;
	}
	if (err && PT_PACK_FI(6))
		return -ENOMEM;
	if (err) {
		/*
		 * No memory to record the page: the table gets the whole page, exactly
		 * as NVIDIA's path would have made it (zeroed, order 0, mapped whole),
		 * with tag 0, so NVIDIA's path frees it. No put() needed here.
		 */
		atomic64_inc(&pt_pack_whole_pages);
		*page_out = page;
		*gpu_addr_out = gpu_addr;
		*tag_out = 0;
		return 0;
	}
	b = n.b;

	INIT_LIST_HEAD(&b->link);
	b->pool = pool;
	b->page = page;
	b->gpu_addr = gpu_addr;
	b->magic = PT_PACK_MAGIC;
	b->cls = cls;
	/*
	 * Slots must be aligned in the GPU's address space. NVIDIA's full-page
	 * mapping is page aligned; should a mapping ever be less aligned, start at
	 * the first aligned offset instead of handing out misaligned tables.
	 */
	b->first = (unsigned int)(-gpu_addr & (u64)(c->slot_size - 1));
	WARN_ON_ONCE(b->first);
	b->nslots = (PAGE_SIZE - b->first) / c->slot_size;

	uvm_pt_pack_lock(&pool->lock);
	list_add(&b->link, &c->partial);
	c->pages++;
	atomic64_inc(&pt_pack_pages[cls]);
	PT_PACK_TEST_COUNT(3 + cls);
	slot = pt_pack_take_slot(c, b, &tag);
	uvm_pt_pack_unlock(&pool->lock);

found:
	/*
	 * The slot is ours alone now; zero it with no lock held. A fresh page is
	 * already zeroed by get(); a reused slot holds the previous table.
	 */
	offset = pt_pack_slot_offset(c, b, (unsigned int)slot);
	if (!PT_PACK_FI(3))
		pt_pack_zero_slot(b->page, offset, c->slot_size);
	*page_out = b->page;
	*gpu_addr_out = b->gpu_addr + offset;
	*tag_out = tag;
	if (PT_PACK_FI(2))
		*gpu_addr_out += 128;
	return 0;
}

/*
 * A free the pool cannot match to a live table of its own. The page holds, or
 * may again hold, other tables: keep it (a leak is safer than a page freed
 * under live tables) and report the caller's bug once.
 */
static bool pt_pack_bad_free(const char *what, struct page *page, u64 gpu_addr, u64 size, u32 tag)
{
	atomic64_inc(&pt_pack_bad_frees);
	/* once: every further one is counted (bad_frees); a splat each would flood the log */
	WARN_ONCE(1, "uvm_pt_pack: bad free (%s): pfn %lx addr 0x%llx size %llu tag %u; page kept\n",
	     what, page ? page_to_pfn(page) : 0UL, (unsigned long long)gpu_addr,
	     (unsigned long long)size, tag);
	return true;
}

bool uvm_pt_pack_free(struct uvm_pt_pack_pool *pool, struct page *page, u64 gpu_addr,
		      u64 size, u32 tag)
{
	struct pt_pack_backing *b;
	struct uvm_pt_pack_class *c;
	u64 offset;
	unsigned int slot;
	bool release = false;

	if (!uvm_pt_pack_active(pool) || !page) {
		/* a tagged table exists only in an active pool */
		if (tag)
			return pt_pack_bad_free("packed table, not of this pool", page, gpu_addr,
						size, tag);
		return false;
	}

	/*
	 * Descriptors leave the xarray only when their page is put, which needs
	 * tree->lock (held by the caller), so b stays valid below.
	 */
	b = xa_load(&pool->owners, page_to_pfn(page));
	if (!b) {
		if (!tag)
			return false;   /* NVIDIA's table in NVIDIA's page */
		return pt_pack_bad_free("packed table whose page the pool no longer holds", page,
					gpu_addr, size, tag);
	}
	if (!tag)
		return pt_pack_bad_free("untagged table in a pool page", page, gpu_addr, size, tag);
	if (b->magic != PT_PACK_MAGIC || b->pool != pool || b->page != page)
		return pt_pack_bad_free("corrupt descriptor", page, gpu_addr, size, tag);
	c = &pool->cls[b->cls];
	if (size != (b->cls == UVM_PT_PACK_C256 ? 256 : 4096))
		return pt_pack_bad_free("wrong size", page, gpu_addr, size, tag);
	if (gpu_addr < b->gpu_addr + b->first || gpu_addr - b->gpu_addr - b->first >= PAGE_SIZE)
		return pt_pack_bad_free("address outside the page", page, gpu_addr, size, tag);
	offset = gpu_addr - b->gpu_addr - b->first;
	if ((unsigned int)offset % c->slot_size || (unsigned int)offset / c->slot_size >= b->nslots)
		return pt_pack_bad_free("address not a slot", page, gpu_addr, size, tag);
	slot = (unsigned int)offset / c->slot_size;

	uvm_pt_pack_lock(&pool->lock);
	if (!test_bit(slot, b->map) || b->tag[slot] != tag) {
		uvm_pt_pack_unlock(&pool->lock);
		return pt_pack_bad_free("stale or double free", page, gpu_addr, size, tag);
	}
	__clear_bit(slot, b->map);
	b->tag[slot] = 0;
	if (b->used == b->nslots)
		list_move(&b->link, &c->partial);   /* the fullest partial page goes first */
	b->used--;
	c->tables--;
	atomic64_dec(&pt_pack_tables[b->cls]);
	if (b->used == 0 && !PT_PACK_FI(4)) {
		list_del(&b->link);
		c->pages--;
		atomic64_dec(&pt_pack_pages[b->cls]);
		release = true;
	}
	uvm_pt_pack_unlock(&pool->lock);

	if (release) {
		/* Unreachable from every list; out of the xarray before the page goes. */
		xa_erase(&pool->owners, page_to_pfn(page));
		b->magic = 0;
		pool->ops->put(pool->ctx, page, b->gpu_addr);
		kfree(b);
	}
	return true;
}

bool uvm_pt_pack_pool_empty(const struct uvm_pt_pack_pool *pool)
{
	unsigned int cls;

	if (pool->state != PT_PACK_STATE_PACKED)
		return true;
	for (cls = 0; cls < UVM_PT_PACK_NR_CLASSES; cls++) {
		const struct uvm_pt_pack_class *c = &pool->cls[cls];

		if (c->tables || c->pages || !list_empty(&c->partial) || !list_empty(&c->full))
			return false;
	}
	return true;
}

/*
 * Leave a non-empty pool's pages and descriptors allocated for good: the GPU
 * may still walk the tables. They move from the live counters to the leaked
 * ones; the descriptors are marked for kmemleak, since the pool that pointed
 * at them is about to be freed with its tree.
 */
static void pt_pack_leak(struct uvm_pt_pack_pool *pool, unsigned long *tables, unsigned long *pages)
{
	struct pt_pack_backing *b;
	unsigned long index;

	*tables = 0;
	*pages = 0;
	xa_for_each(&pool->owners, index, b) {
		*tables += b->used;
		(*pages)++;
		atomic64_sub(b->used, &pt_pack_tables[b->cls]);
		atomic64_dec(&pt_pack_pages[b->cls]);
		kmemleak_not_leak(b);
	}
	atomic64_add(*tables, &pt_pack_leaked_tables);
	atomic64_add(*pages, &pt_pack_leaked_pages);
}

void uvm_pt_pack_tree_deinit(struct uvm_pt_pack_pool *pool, bool expect_empty)
{
	unsigned long tables, pages;

	switch (pool->state) {
	case PT_PACK_STATE_PACKED:
		/*
		 * Normally every table was freed before the tree went away, so every
		 * backing page was put. After a fatal UVM error put_ptes_async()
		 * leaves tables in place on purpose: then the hook passes
		 * expect_empty = false and this is expected, not a bug.
		 */
		if (!uvm_pt_pack_pool_empty(pool)) {
			pt_pack_leak(pool, &tables, &pages);
			if (expect_empty)
				WARN(1, "uvm_pt_pack: page tree torn down with %lu tables in %lu backing pages\n",
				     tables, pages);
			else
				pr_warn_ratelimited("nvidia-uvm: uvm_pt_pack: UVM fatal error: leaving %lu page tables in %lu backing pages allocated\n",
						    tables, pages);
		}
		xa_destroy(&pool->owners);
		atomic64_dec(&pt_pack_trees_packed);
		break;
	case PT_PACK_STATE_UNPACKED:
		atomic64_dec(&pt_pack_trees_unpacked);
		break;
	default:
		break;
	}
	pool->tier = UVM_PT_PACK_TIER_OFF;
	pool->state = PT_PACK_STATE_DEAD;
}

/* ---- counters: /sys/module/nvidia_uvm/parameters/uvm_pt_pack_stats, format 2 ---- */

/*
 * The counters are read without a lock while tables come and go: a read may
 * see a class's tables and pages counters a step apart. No figure is shown
 * below 0 (at rest every held page holds a table, so none is negative).
 */
static long long pt_pack_read(atomic64_t *v)
{
	long long x = atomic64_read(v);

	return x < 0 ? 0 : x;
}

static long long pt_pack_nonneg(long long x)
{
	return x < 0 ? 0 : x;
}

#define PT_PACK_STATS_BUF 4096   /* sysfs hands .get a buffer of at least 4 KiB */

/* One "key value" line (key = prefix_key when prefix is set) at buf + n; returns the new length. */
static int pt_pack_kv(char *buf, int n, const char *prefix, const char *key, long long v)
{
	return n + scnprintf(buf + n, PT_PACK_STATS_BUF - n, "%s%s%s %lld\n",
			     prefix ? prefix : "", prefix ? "_" : "", key, v);
}

static int pt_pack_stats_get(char *buf, const struct kernel_param *kp)
{
	static const char *const cls_names[UVM_PT_PACK_NR_CLASSES] = { "c256", "c4096" };
	long long sum_backing = 0, sum_stock = 0, leaked_pages;
	enum uvm_pt_pack_reason reason;
	unsigned int cls;
	int n = 0;

	n = pt_pack_kv(buf, n, NULL, "format", UVM_PT_PACK_FORMAT);
	n += scnprintf(buf + n, PT_PACK_STATS_BUF - n, "tier %s\n",
		       pt_pack_tier_names[uvm_pt_pack_requested_tier()]);
	n = pt_pack_kv(buf, n, NULL, "page_size", PAGE_SIZE);
	n = pt_pack_kv(buf, n, NULL, "trees_packed", pt_pack_read(&pt_pack_trees_packed));
	n = pt_pack_kv(buf, n, NULL, "trees_unpacked", pt_pack_read(&pt_pack_trees_unpacked));
	/* uvm_pt_pack=0 (read at load time): every tree is off by configuration */
	reason = uvm_pt_pack_requested_tier() == UVM_PT_PACK_TIER_OFF ?
		 UVM_PT_PACK_R_DISABLED : atomic_read(&pt_pack_last_reason);
	n += scnprintf(buf + n, PT_PACK_STATS_BUF - n, "unpacked_reason %s\n",
		       uvm_pt_pack_reason_str(reason));

	for (cls = 0; cls < UVM_PT_PACK_NR_CLASSES; cls++) {
		const char *c = cls_names[cls];
		long long tables = pt_pack_read(&pt_pack_tables[cls]);
		long long pages = pt_pack_read(&pt_pack_pages[cls]);
		long long backing = pages * (long long)PAGE_SIZE;
		/* alloc_pages(get_order(size)) takes one whole page per table */
		long long stock = tables * (long long)PAGE_SIZE;

		sum_backing += backing;
		sum_stock += stock;
		n = pt_pack_kv(buf, n, c, "tables", tables);
		n = pt_pack_kv(buf, n, c, "pages", pages);
		n = pt_pack_kv(buf, n, c, "backing_bytes", backing);
		n = pt_pack_kv(buf, n, c, "stock_bytes", stock);
		n = pt_pack_kv(buf, n, c, "saved_bytes", pt_pack_nonneg(stock - backing));
	}
	n = pt_pack_kv(buf, n, NULL, "backing_bytes", sum_backing);
	n = pt_pack_kv(buf, n, NULL, "stock_bytes", sum_stock);
	n = pt_pack_kv(buf, n, NULL, "saved_bytes", pt_pack_nonneg(sum_stock - sum_backing));
	leaked_pages = pt_pack_read(&pt_pack_leaked_pages);
	n = pt_pack_kv(buf, n, NULL, "leaked_tables", pt_pack_read(&pt_pack_leaked_tables));
	n = pt_pack_kv(buf, n, NULL, "leaked_pages", leaked_pages);
	n = pt_pack_kv(buf, n, NULL, "leaked_bytes", leaked_pages * (long long)PAGE_SIZE);
	n = pt_pack_kv(buf, n, NULL, "bad_frees", pt_pack_read(&pt_pack_bad_frees));
	n = pt_pack_kv(buf, n, NULL, "whole_page_tables", pt_pack_read(&pt_pack_whole_pages));
#ifdef UVM_PT_PACK_TEST_FAKE_GPU
	n = pt_pack_kv(buf, n, NULL, "test_fake_gpu_build", 1);
	n = pt_pack_kv(buf, n, "test_total", "trees_packed", atomic64_read(&pt_pack_test_total[0]));
	n = pt_pack_kv(buf, n, "test_total", "c256_tables", atomic64_read(&pt_pack_test_total[1]));
	n = pt_pack_kv(buf, n, "test_total", "c4096_tables", atomic64_read(&pt_pack_test_total[2]));
	n = pt_pack_kv(buf, n, "test_total", "c256_pages", atomic64_read(&pt_pack_test_total[3]));
	n = pt_pack_kv(buf, n, "test_total", "c4096_pages", atomic64_read(&pt_pack_test_total[4]));
#endif
	return n;
}

/* Read-only counters: a value given at load time is logged and ignored (the load goes on). */
static int pt_pack_stats_set(const char *val, const struct kernel_param *kp)
{
	pr_err("nvidia-uvm: uvm_pt_pack_stats is read-only: value ignored\n");
	return 0;
}

static const struct kernel_param_ops pt_pack_stats_ops = {
	.set = pt_pack_stats_set,
	.get = pt_pack_stats_get,
};

module_param_cb(uvm_pt_pack_stats, &pt_pack_stats_ops, NULL, 0444);
MODULE_PARM_DESC(uvm_pt_pack_stats,
		 "Page-table packing counters, one 'key value' per line (format 2, see spark-memsaver uvm_patch/README.md)");
