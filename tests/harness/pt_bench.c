/* SPDX-License-Identifier: GPL-2.0-only OR MIT */
/*
 * libptbench.so: the real pool (uvm_patch/src/uvm_pt_pack.c, unchanged) behind a
 * small C API for benchmarks/pagetable_backing.py (ctypes). Backing pages are
 * real PAGE_SIZE allocations from the shim; tables NVIDIA's path would allocate
 * (the root, unpacked sizes, inactive pools) are counted as one page each
 * without allocating memory.
 */
#include "shim.h"
#include <errno.h>
#include "../../uvm_patch/src/uvm_pt_pack.h"

#define PTB_MAX_POOLS 256

struct ptb_table {
	int pool;              /* -1: free handle */
	int packed;
	struct page *page;
	u64 addr;
	u32 tag;
	u32 size;
};

static struct uvm_pt_pack_pool *pools[PTB_MAX_POOLS];
static struct ptb_table *tabs;
static long ntabs, captabs, *freeh, nfreeh;
static long stock_tables, backing_pages_held;
static u64 next_base = 0x100000000000ull;

static int get_cb(void *ctx, struct page **page, u64 *gpu_addr)
{
	struct page *p = alloc_page(GFP_KERNEL | __GFP_ZERO);

	if (!p)
		return -ENOMEM;
	*page = p;
	*gpu_addr = next_base;
	next_base += PAGE_SIZE;
	backing_pages_held++;
	return 0;
}

static void put_cb(void *ctx, struct page *page, u64 gpu_addr)
{
	backing_pages_held--;
	__free_page(page);
}

static const struct uvm_pt_pack_ops ops = { .get = get_cb, .put = put_cb };

unsigned long ptb_page_size(void)
{
	return PAGE_SIZE;
}

/*
 * A pool as a tree would hold it; tier 0 = NVIDIA's path for everything.
 * user_tree 0 = UVM's kernel tree (the leaf tier leaves it unpacked). Returns an id or -1.
 */
int ptb_pool_new_kind(int tier, int user_tree)
{
	struct uvm_pt_pack_facts f = {
		.tier = tier, .has_pci_dev = true, .no_vidmem = true, .integrated = 1,
		.sysmem_tree = true, .dma_coherent = true, .user_tree = user_tree != 0, .page_size = PAGE_SIZE,
	};
	int i;

	for (i = 0; i < PTB_MAX_POOLS; i++)
		if (!pools[i])
			break;
	if (i == PTB_MAX_POOLS)
		return -1;
	pools[i] = calloc(1, sizeof(*pools[i]));
	uvm_pt_pack_tree_init(pools[i], &f, &ops, NULL);
	return i;
}

int ptb_pool_new(int tier)
{
	return ptb_pool_new_kind(tier, 1);
}

/* Returns 0 if the pool was empty at deinit (it must be), 1 otherwise. */
int ptb_pool_destroy(int id)
{
	int empty = uvm_pt_pack_pool_empty(pools[id]);

	uvm_pt_pack_tree_deinit(pools[id], true);
	free(pools[id]);
	pools[id] = NULL;
	return !empty;
}

/* Allocate a table; depth 0 forces NVIDIA's path. Returns a handle >= 0, or -errno. */
long ptb_alloc(int pool, unsigned int depth, unsigned int size)
{
	struct ptb_table *t;
	long h;
	int r;

	if (nfreeh) {
		h = freeh[--nfreeh];
	} else {
		if (ntabs == captabs) {
			captabs = captabs ? 2 * captabs : 65536;
			tabs = realloc(tabs, captabs * sizeof(*tabs));
			freeh = realloc(freeh, captabs * sizeof(*freeh));
			if (!tabs || !freeh)
				return -ENOMEM;
		}
		h = ntabs++;
	}
	t = &tabs[h];
	memset(t, 0, sizeof(*t));
	t->pool = pool;
	t->size = size;
	r = uvm_pt_pack_alloc(pools[pool], depth, size, &t->page, &t->addr, &t->tag);
	if (r < 0) {
		t->pool = -1;
		freeh[nfreeh++] = h;
		return r;
	}
	t->packed = r == 0;
	if (!t->packed)
		stock_tables++;
	return h;
}

int ptb_free(long h)
{
	struct ptb_table *t = &tabs[h];
	bool packed;

	if (h < 0 || h >= ntabs || t->pool < 0)
		return -EINVAL;
	packed = uvm_pt_pack_free(pools[t->pool], t->page, t->addr, t->size, t->tag);
	if (packed != !!t->packed)
		return -EIO;
	if (!t->packed)
		stock_tables--;
	t->pool = -1;
	freeh[nfreeh++] = h;
	return 0;
}

/* Tables that took NVIDIA's path (one page each). */
long ptb_stock_tables(void)
{
	return stock_tables;
}

long ptb_backing_pages(void)
{
	return backing_pages_held;
}

/* The counters text, exactly as sysfs would show it. */
int ptb_stats(char *buf, int len)
{
	return shim_param_get("uvm_pt_pack_stats", buf, len);
}
