// SPDX-License-Identifier: GPL-2.0-only OR MIT
/*
 * In-kernel selftest of the page-table packing pool (spark-memsaver).
 *
 * Linked with uvm_patch/src/uvm_pt_pack.c UNCHANGED (the test copies it next
 * to this file). The pool's get/put are backed like NVIDIA's sysmem path:
 * alloc_pages(__GFP_ZERO) + dma_map_page() on a real PCI device of the VM
 * (QEMU's pci-testdev, 1b36:0005) that sits behind the virt machine's SMMUv3.
 * Several kthreads allocate tables without the tree lock and free them under
 * it, as UVM does, and check every table: IOVA aligned for its tier/class and
 * inside its backing page's mapping, zeroed when handed out, pattern intact
 * at free (no overlap); at the end every backing page was put (release of
 * empty pages), gets == puts, no mapping left.
 *
 * Out-of-memory mode (oom=1, tests/test_kernel_oom.py): each kthread marks
 * itself for fault injection (current->make_it_fail: fail_page_alloc and
 * failslab with task-filter fail its allocations as configured under
 * /sys/kernel/debug), and the user trees' backing pages and the pool's
 * descriptors are charged to the loader's memory cgroup (__GFP_ACCOUNT under
 * set_active_memcg(), as UVM charges a user tree to its va_space's mm), so a
 * memory.max limit on that cgroup fails them. A failed allocation is then an
 * outcome, not an error: -ENOMEM (enomem) or a failed DMA mapping (eio) and a
 * table handed out as a whole page (whole: the pool could not record a new
 * backing page; freed by the caller's path, as NVIDIA's). Every other check
 * stays: gets == puts, empty pools, no mapping left.
 *
 * Result (one line, parsed by tests/test_kernel_qemu.py and test_kernel_oom.py):
 *   PTPACK-SELFTEST tier=<n> result=<pass|fail> iommu=<0|1> threads=<n> ops=<n>
 *       tables_max=<n> gets=<n> puts=<n> errors=<n> page_size=<n> oom=<0|1>
 *       enomem=<n> eio=<n> whole=<n>
 */
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/dma-mapping.h>
#include <linux/dma-map-ops.h>
#include <linux/iommu.h>
#include <linux/kthread.h>
#include <linux/completion.h>
#include <linux/mutex.h>
#include <linux/xarray.h>
#include <linux/random.h>
#include <linux/slab.h>
#include <linux/mm.h>
#include <linux/sched.h>
#include <linux/sched/mm.h>
#include <linux/memcontrol.h>
#include "uvm_pt_pack.h"

#define NTREES 3
#define MAX_LIVE 96

static int threads = 4;
module_param(threads, int, 0444);
static int ops = 20000;
module_param(ops, int, 0444);
static int oom;
module_param(oom, int, 0444);

struct st_tree {
	struct uvm_pt_pack_pool pool;
	struct mutex lock;          /* stands in for tree->lock */
	int tier;
	bool user;                  /* a user tree: charged to st_memcg in oom mode */
};

struct st_table {
	struct page *page;
	u64 addr;
	u32 tag;               /* the pool's tag of the table */
	u32 size;
	u8 pattern;
	int tree;
};

static struct device *st_dev;
static struct st_tree st_trees[NTREES];
static DEFINE_XARRAY(st_maps);   /* pfn -> dma address >> PAGE_SHIFT of every live backing page */
static atomic_t st_gets, st_puts, st_errors, st_ops, st_live_max, st_live;
static atomic_t st_enomem, st_eio, st_whole;
static int st_tier_param;
static struct mem_cgroup *st_memcg;   /* oom mode: the loader's memory cgroup */

/* oom mode, a user tree: charge to st_memcg (returns the gfp to use; *old for st_uncharge_scope) */
static gfp_t st_charge_scope(struct st_tree *t, gfp_t gfp, struct mem_cgroup **old)
{
	*old = NULL;
	if (!oom || !t->user || !st_memcg)
		return gfp;
	*old = set_active_memcg(st_memcg);
	return gfp | __GFP_ACCOUNT;
}

static void st_uncharge_scope(gfp_t gfp, struct mem_cgroup *old)
{
	if (gfp & __GFP_ACCOUNT)
		set_active_memcg(old);
}

#define ST_ERR(fmt, ...) do { \
	if (atomic_inc_return(&st_errors) <= 10) \
		pr_err("pt_pack_selftest: " fmt "\n", ##__VA_ARGS__); \
} while (0)

/*
 * The DMA mapping is never failed on purpose: DMA-API debug switches itself off
 * for good when its own tracking allocation fails ("cacheline tracking ENOMEM"),
 * and the rest of the run would be checked less.
 */
static dma_addr_t st_map(struct page *page)
{
	dma_addr_t dma;
#ifdef CONFIG_FAULT_INJECTION
	int mif = current->make_it_fail;

	current->make_it_fail = 0;
#endif
	dma = dma_map_page(st_dev, page, 0, PAGE_SIZE, DMA_BIDIRECTIONAL);
#ifdef CONFIG_FAULT_INJECTION
	current->make_it_fail = mif;
#endif
	return dma;
}

static int st_get(void *ctx, struct page **pagep, u64 *gpu_addr)
{
	struct mem_cgroup *old;
	gfp_t gfp = st_charge_scope(ctx, GFP_KERNEL | __GFP_ZERO, &old);
	struct page *page = alloc_pages(gfp, 0);
	dma_addr_t dma;

	st_uncharge_scope(gfp, old);
	if (!page)
		return -ENOMEM;
	dma = st_map(page);
	if (dma_mapping_error(st_dev, dma)) {
		__free_pages(page, 0);
		return -EIO;
	}
	if (xa_err(xa_store(&st_maps, page_to_pfn(page), xa_mk_value(dma >> PAGE_SHIFT), GFP_KERNEL))) {
		dma_unmap_page(st_dev, dma, PAGE_SIZE, DMA_BIDIRECTIONAL);
		__free_pages(page, 0);
		return -ENOMEM;
	}
	if (dma & (PAGE_SIZE - 1))
		ST_ERR("dma address %pad not page aligned", &dma);
	atomic_inc(&st_gets);
	*pagep = page;
	*gpu_addr = dma;
	return 0;
}

static void st_put(void *ctx, struct page *page, u64 gpu_addr)
{
	struct st_tree *t = ctx;
	void *ent = xa_erase(&st_maps, page_to_pfn(page));

	if (!mutex_is_locked(&t->lock))
		ST_ERR("put() without the tree lock");
	if (!ent || ((u64)xa_to_value(ent) << PAGE_SHIFT) != gpu_addr)
		ST_ERR("put() of %llx: not a live backing page", gpu_addr);
	dma_unmap_page(st_dev, gpu_addr, PAGE_SIZE, DMA_BIDIRECTIONAL);
	__free_pages(page, 0);
	atomic_inc(&st_puts);
}

/* the pool's descriptors, charged where st_get() charges (UVM's pt_pack_charged()) */
static int st_charged(void *ctx, int (*fn)(void *arg, gfp_t gfp), void *arg)
{
	struct mem_cgroup *old;
	gfp_t gfp = st_charge_scope(ctx, GFP_KERNEL, &old);
	int ret = fn(arg, gfp);

	st_uncharge_scope(gfp, old);
	return ret;
}

static const struct uvm_pt_pack_ops st_ops_cb = { .get = st_get, .put = st_put, .charged = st_charged };

static unsigned int st_align(int tier, u32 size)
{
	return (tier == UVM_PT_PACK_TIER_256 && size == 256) ? 256 : 4096;
}

static bool st_expect_packed(const struct st_tree *t, unsigned int depth, u32 size)
{
	if (!uvm_pt_pack_active(&t->pool) || depth == 0)
		return false;
	if (t->tier == UVM_PT_PACK_TIER_LEAF && size != 256)
		return false;
	return PAGE_SIZE >= 2 * st_align(t->tier, size);
}

/* Returns 1 if a packed table was allocated into *tb, 0 if not packed, <0 on error. */
static int st_alloc(int ti, unsigned int depth, u32 size, struct st_table *tb)
{
	struct st_tree *t = &st_trees[ti];
	struct page *page = NULL;
	u64 addr = 0, base;
	void *ent, *va;
	u32 tag = 0;
	int r = uvm_pt_pack_alloc(&t->pool, depth, size, &page, &addr, &tag);

	if (r < 0)
		return r;
	if ((r == 0) != st_expect_packed(t, depth, size)) {
		ST_ERR("routing: tier %d depth %u size %u packed=%d", t->tier, depth, size, r == 0);
		return -EINVAL;
	}
	if (r)
		return 0;
	ent = xa_load(&st_maps, page_to_pfn(page));
	if (!ent) {
		ST_ERR("table in a page that is not a live backing page");
		return -EINVAL;
	}
	base = (u64)xa_to_value(ent) << PAGE_SHIFT;
	if (addr % st_align(t->tier, size))
		ST_ERR("IOVA %llx of a %u B table not %u-aligned", addr, size, st_align(t->tier, size));
	if (addr < base || addr - base + size > PAGE_SIZE)
		ST_ERR("IOVA %llx outside its backing page %llx", addr, base);
	va = page_address(page) + (addr - base);
	if (memchr_inv(va, 0, size))
		ST_ERR("table at %llx not zeroed", addr);
	if (!tag) {
		/* handed out whole (no memory to record the page): the caller's page */
		atomic_inc(&st_whole);
		if (addr != base)
			ST_ERR("whole-page table at %llx is not its page %llx", addr, base);
	}
	tb->page = page;
	tb->addr = addr;
	tb->tag = tag;
	tb->size = size;
	tb->tree = ti;
	tb->pattern = (u8)(get_random_u32() | 1);
	memset(va, tb->pattern, size);          /* the GPU writing PTEs */
	return 1;
}

static void st_free(struct st_table *tb)
{
	struct st_tree *t = &st_trees[tb->tree];
	void *ent = xa_load(&st_maps, page_to_pfn(tb->page));
	u64 base = ent ? (u64)xa_to_value(ent) << PAGE_SHIFT : 0;

	if (!ent || memchr_inv(page_address(tb->page) + (tb->addr - base), tb->pattern, tb->size))
		ST_ERR("table at %llx clobbered (overlap) or its page gone", tb->addr);
	memset(page_address(tb->page) + (tb->addr - base), 0xa5, tb->size);   /* reuse must zero */
	mutex_lock(&t->lock);
	if (!tb->tag) {
		/* a whole-page table: not the pool's; the caller's path frees it, as NVIDIA's does */
		if (uvm_pt_pack_free(&t->pool, tb->page, tb->addr, tb->size, 0))
			ST_ERR("the pool claimed the whole-page table at %llx", tb->addr);
		else
			st_put(t, tb->page, tb->addr);
	} else if (!uvm_pt_pack_free(&t->pool, tb->page, tb->addr, tb->size, tb->tag)) {
		ST_ERR("free of a packed table at %llx not recognised", tb->addr);
	}
	mutex_unlock(&t->lock);
}

struct st_worker {
	struct completion done;
	unsigned int seed;
};

static int st_thread(void *arg)
{
	struct st_worker *w = arg;
	struct st_table *tabs = kcalloc(MAX_LIVE, sizeof(*tabs), GFP_KERNEL);
	int n = 0, k, live;

	if (!tabs) {
		ST_ERR("no memory");
		complete(&w->done);
		return 0;
	}
#ifdef CONFIG_FAULT_INJECTION
	if (oom)
		current->make_it_fail = 1;   /* fail_page_alloc / failslab task-filter */
#endif
	for (k = 0; k < ops; k++) {
		u32 r = get_random_u32();
		bool fill = (k / 500) % 2 == 0;      /* waves: pages get released and re-acquired */

		if (n < MAX_LIVE && (n == 0 || (r % 100) < (fill ? 80 : 20))) {
			u32 size = (r >> 8) % 10 < 7 ? 256 : 4096;
			unsigned int depth = (r >> 12) % 6;   /* 0 = root: never packed */
			int ret = st_alloc((r >> 16) % NTREES, depth, size, &tabs[n]);

			if (ret == 1) {
				n++;
				live = atomic_inc_return(&st_live);
				if (live > atomic_read(&st_live_max))
					atomic_set(&st_live_max, live);
			} else if (oom && ret == -ENOMEM) {
				atomic_inc(&st_enomem);
			} else if (oom && ret == -EIO) {
				atomic_inc(&st_eio);     /* st_get()'s DMA mapping failed */
			} else if (ret < 0 && ret != -EINVAL) {
				ST_ERR("alloc failed: %d", ret);
			}
		} else if (n) {
			int i = (r >> 8) % n;

			st_free(&tabs[i]);
			tabs[i] = tabs[--n];
			atomic_dec(&st_live);
		}
		atomic_inc(&st_ops);
		if ((k & 255) == 0)
			cond_resched();
	}
#ifdef CONFIG_FAULT_INJECTION
	current->make_it_fail = 0;
#endif
	while (n) {
		st_free(&tabs[--n]);
		atomic_dec(&st_live);
	}
	kfree(tabs);
	complete(&w->done);
	return 0;
}

static int st_run(struct pci_dev *pdev)
{
	struct st_worker *w;
	int i, pass;
	bool iommu = iommu_get_domain_for_dev(&pdev->dev) != NULL;

	st_tier_param = uvm_pt_pack_requested_tier();
	if (oom && current->mm)
		st_memcg = get_mem_cgroup_from_mm(current->mm);   /* probe runs in insmod's context */
	for (i = 0; i < NTREES; i++) {
		/* tree 0 stands in for UVM's kernel tree, the others for user trees */
		struct uvm_pt_pack_facts f = {
			.tier = st_tier_param, .has_pci_dev = true, .no_vidmem = true, .integrated = 1,
			.sysmem_tree = true, .dma_coherent = dev_is_dma_coherent(&pdev->dev),
			.user_tree = i != 0, .page_size = PAGE_SIZE,
		};

		mutex_init(&st_trees[i].lock);
		st_trees[i].user = i != 0;
		uvm_pt_pack_tree_init(&st_trees[i].pool, &f, &st_ops_cb, &st_trees[i]);
		st_trees[i].tier = uvm_pt_pack_active(&st_trees[i].pool) ? st_tier_param : 0;
	}
	w = kcalloc(threads, sizeof(*w), GFP_KERNEL);
	if (!w)
		return -ENOMEM;
	for (i = 0; i < threads; i++) {
		init_completion(&w[i].done);
		if (IS_ERR(kthread_run(st_thread, &w[i], "pt_pack_st/%d", i))) {
			ST_ERR("kthread_run failed");
			complete(&w[i].done);
		}
	}
	for (i = 0; i < threads; i++)
		wait_for_completion(&w[i].done);
	kfree(w);
	for (i = 0; i < NTREES; i++) {
		if (!uvm_pt_pack_pool_empty(&st_trees[i].pool))
			ST_ERR("pool %d not empty after every table was freed", i);
		mutex_lock(&st_trees[i].lock);
		uvm_pt_pack_tree_deinit(&st_trees[i].pool, true);
		mutex_unlock(&st_trees[i].lock);
	}
	if (atomic_read(&st_gets) != atomic_read(&st_puts) || !xa_empty(&st_maps))
		ST_ERR("backing pages left: gets %d puts %d", atomic_read(&st_gets), atomic_read(&st_puts));
	if (st_tier_param != UVM_PT_PACK_TIER_OFF && PAGE_SIZE > 4096 && atomic_read(&st_gets) == 0)
		ST_ERR("tier %d packed nothing", st_tier_param);
	pass = atomic_read(&st_errors) == 0 && iommu;
	pr_info("PTPACK-SELFTEST tier=%d result=%s iommu=%d threads=%d ops=%d tables_max=%d gets=%d puts=%d errors=%d page_size=%lu oom=%d enomem=%d eio=%d whole=%d\n",
		st_tier_param, pass ? "pass" : "fail", iommu, threads, atomic_read(&st_ops),
		atomic_read(&st_live_max), atomic_read(&st_gets), atomic_read(&st_puts),
		atomic_read(&st_errors), PAGE_SIZE, oom, atomic_read(&st_enomem),
		atomic_read(&st_eio), atomic_read(&st_whole));
	mem_cgroup_put(st_memcg);
	st_memcg = NULL;
	return 0;
}

static int st_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	int err = pcim_enable_device(pdev);

	if (err)
		return err;
	err = dma_set_mask_and_coherent(&pdev->dev, DMA_BIT_MASK(64));
	if (err)
		return err;
	st_dev = &pdev->dev;
	return st_run(pdev);
}

static const struct pci_device_id st_ids[] = {
	{ PCI_DEVICE(0x1b36, 0x0005) },   /* QEMU pci-testdev */
	{ }
};
MODULE_DEVICE_TABLE(pci, st_ids);

static struct pci_driver st_driver = {
	.name = "pt_pack_selftest",
	.id_table = st_ids,
	.probe = st_probe,
};
module_pci_driver(st_driver);

MODULE_LICENSE("Dual MIT/GPL");
MODULE_DESCRIPTION("spark-memsaver: in-kernel selftest of the uvm_pt_pack pool on a DMA-mapped PCI device");
