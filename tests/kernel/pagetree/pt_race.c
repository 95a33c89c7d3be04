// SPDX-License-Identifier: GPL-2.0-only OR MIT
/*
 * TEST BUILD ONLY (tests/support/uvmvm.py, build(race=True)): a concurrent stress of NVIDIA's page-tree code,
 * inserted into the test copy of NVIDIA's uvm_page_tree_test.c just before uvm_test_page_tree(), which runs it
 * instead of NVIDIA's own suite when the module parameter uvm_pt_pack_test_race_threads is > 0. Never part of
 * the product (tests/test_kernel_pagetree.py checks the apply step's output and the DKMS tree for it).
 *
 * One fake Blackwell GB10B (fake_gpu_init_blackwell, as NVIDIA's own test sets it up), one user tree in sysmem
 * (the pool packs its tables in tiers 1-3). N kthreads, each looping over: uvm_page_tree_get_ptes_async() +
 * uvm_page_tree_wait() of 1-4 64K PTEs or 1-16 4K PTEs, or uvm_page_tree_get_entry(2M) +
 * uvm_page_tree_alloc_table(4K or 64K) under it (as uvm_va_block.c does), in 8 2 MiB regions spread over
 * 2 x 2 x 2 entries of the upper directory levels; each holds up to 2 ranges and drops a random one
 * (uvm_page_tree_put_ptes()). With every range of a region dropped its tables are freed, so the next get
 * allocates them again, concurrently: the dir_cache retry of uvm_page_tree_get_ptes_async() (a directory
 * allocated outside tree->lock found already present: free_unused_directories() frees it) and
 * uvm_page_tree_alloc_table()'s should_free path. They are counted by one statement each that uvmvm.py adds
 * to the test copy of uvm_mmu.c (uvm_pt_race_hit()): retries = the lock dropped to allocate a directory (also
 * single-threaded), dir_cache_unused = a directory so allocated found already present and freed (only another
 * thread can have inserted it), should_free = alloc_table found the table present (also single-threaded, after
 * a get_ptes of the same table), should_free_raced = of those, the ones where this thread had seen the table
 * absent, under tree->lock, just before the call (another thread inserted it while alloc_table allocated).
 *
 * Checks, under tree->lock, every 8th operation of each thread and at the end: every live directory is linked
 * from its parent, no two live tables overlap in memory (a pool that hands out one slot twice shows here), a
 * held range's table is live. One result line:
 *   uvm_pt_race: RESULT threads=N ops=... get_ptes=... alloc_table=... put_ptes=... retries=...
 *       dir_cache_unused=... should_free=... should_free_raced=... checks=... tables_max=... overlaps=0 bad_links=0 errors=0 packed=1
 *       secs=... status=0x0
 */
#include <linux/kthread.h>
#include <linux/completion.h>
#include <linux/jiffies.h>
#include <linux/sort.h>
#include "uvm_api.h"

static int uvm_pt_pack_test_race_threads;
module_param(uvm_pt_pack_test_race_threads, int, 0444);
MODULE_PARM_DESC(uvm_pt_pack_test_race_threads, "TEST BUILD ONLY: kthreads of the page-tree race (0: NVIDIA's suite)");
static int uvm_pt_pack_test_race_iters = 2000;
module_param(uvm_pt_pack_test_race_iters, int, 0444);
static int uvm_pt_pack_test_race_secs = 300;
module_param(uvm_pt_pack_test_race_secs, int, 0444);

#define PT_RACE_MAX_THREADS 64
#define PT_RACE_HOLD 2
#define PT_RACE_MAX_DIRS 1024

/* 0: try_get_ptes() dropped tree->lock to allocate a directory (the retry), 1: a directory so allocated was found
 * unused and freed (another thread inserted one first), 2: uvm_page_tree_alloc_table()'s should_free */
static atomic64_t pt_race_hits[3];

typedef struct pt_race_thread_struct pt_race_thread_t;
static pt_race_thread_t *pt_race_threads;
static int pt_race_nthreads;
static void pt_race_hit_here(int what);

void uvm_pt_race_hit(int what);
void uvm_pt_race_hit(int what)
{
    atomic64_inc(&pt_race_hits[what]);
    pt_race_hit_here(what);
}

typedef struct {
    uvm_page_table_range_t range;
    uvm_page_table_range_t parent;      /* alloc_table's 2M entry; parent.table == NULL for a get_ptes range */
    bool held;
} pt_race_hold_t;

struct pt_race_thread_struct {
    uvm_page_tree_t *tree;
    struct completion *go;
    struct completion done;
    struct task_struct *task;
    unsigned long deadline;
    u64 rng;
    NV_STATUS status;
    u64 ops, gets, allocs, puts, checks, overlaps, bad_links, tables_max;
    u64 should_free_here, should_free_raced;
    pt_race_hold_t hold[PT_RACE_HOLD];
};

/* alloc_table's should_free, in the thread that took it (the threads are known before they start) */
static void pt_race_hit_here(int what)
{
    int i;

    for (i = 0; what == 2 && i < pt_race_nthreads; i++) {
        if (pt_race_threads[i].task == current)
            pt_race_threads[i].should_free_here++;
    }
}

typedef struct {
    u64 start, end;
} pt_race_span_t;

static u32 pt_race_rand(pt_race_thread_t *t)
{
    t->rng ^= t->rng << 13;
    t->rng ^= t->rng >> 7;
    t->rng ^= t->rng << 17;
    return (u32)(t->rng >> 16);
}

static int pt_race_span_cmp(const void *a, const void *b)
{
    const pt_race_span_t *x = a, *y = b;

    return x->start < y->start ? -1 : x->start > y->start;
}

static void pt_race_span(uvm_page_directory_t *dir, pt_race_span_t *spans, u32 *n)
{
    if (*n < PT_RACE_MAX_DIRS) {
        spans[*n].start = dir->phys_alloc.addr.address;
        spans[*n].end = dir->phys_alloc.addr.address + dir->phys_alloc.size;
        (*n)++;
    }
}

/* Walk the tree from dir (tree->lock held): every child linked back to its parent one level down, the memory of
 * every live table into spans. PTE tables (the deepest level) have no entries (allocate_directory()). */
static void pt_race_walk(uvm_page_tree_t *tree, uvm_page_directory_t *dir, pt_race_span_t *spans, u32 *n,
                         u64 *bad_links)
{
    uvm_mmu_mode_hal_t *hal = tree->hal;
    NvU32 i, count;

    pt_race_span(dir, spans, n);
    if (dir->depth == hal->page_table_depth(UVM_PAGE_SIZE_AGNOSTIC))
        return;
    count = hal->entries_per_index(dir->depth) << hal->index_bits(dir->depth, UVM_PAGE_SIZE_4K);
    for (i = 0; i < count; i++) {
        uvm_page_directory_t *child = dir->entries[i];

        if (child == NULL)
            continue;
        if (child->host_parent != dir || child->depth != dir->depth + 1 || dir->ref_count == 0)
            (*bad_links)++;
        else
            pt_race_walk(tree, child, spans, n, bad_links);
    }
}

/* The invariants, under tree->lock. Returns the number of live tables. */
static u32 pt_race_check(pt_race_thread_t *t, pt_race_span_t *spans)
{
    uvm_page_tree_t *tree = t->tree;
    u64 end;
    u32 n = 0, i;

    uvm_mutex_lock(&tree->lock);
    pt_race_walk(tree, tree->root, spans, &n, &t->bad_links);
    for (i = 0; i < PT_RACE_HOLD; i++) {
        uvm_page_directory_t *d = t->hold[i].range.table;

        if (!t->hold[i].held)
            continue;
        /* a held range's table is still referenced and hangs below the root */
        if (d->ref_count < t->hold[i].range.entry_count)
            t->bad_links++;
        while (d->host_parent)
            d = d->host_parent;
        if (d != tree->root)
            t->bad_links++;
    }
    uvm_mutex_unlock(&tree->lock);

    /* no two live tables share a byte */
    sort(spans, n, sizeof(*spans), pt_race_span_cmp, NULL);
    for (i = 1, end = n ? spans[0].end : 0; i < n; i++) {
        if (spans[i].start < end)
            t->overlaps++;
        end = max(end, spans[i].end);
    }
    t->checks++;
    return n;
}

static NvU64 pt_race_va(uvm_page_tree_t *tree, NvU64 va)
{
    /* as test_page_tree_get_ptes(): canonical form where the GPU uses it */
    uvm_mmu_mode_hal_t *hal = tree->gpu->parent->arch_hal->mmu_mode_hal(UVM_PAGE_SIZE_64K);

    return hal->num_va_bits() > 40 ? uvm_parent_gpu_canonical_address(tree->gpu->parent, va) : va;
}

static NV_STATUS pt_race_get(pt_race_thread_t *t, pt_race_hold_t *h)
{
    uvm_page_tree_t *tree = t->tree;
    u32 r = pt_race_rand(t) % 8, what = pt_race_rand(t) % 4;
    /* 8 regions of 2 MiB: 2 x 2 x 2 entries at the 512 GiB, 1 GiB and 2 MiB levels */
    NvU64 base = ((NvU64)(r >> 2) << 39) | ((NvU64)((r >> 1) & 1) << 30) | ((NvU64)(r & 1) << 21);
    NV_STATUS status;

    memset(h, 0, sizeof(*h));
    if (what == 0) {
        /* uvm_va_block.c's way: the 2M entry, then a 4K or 64K PTE table under it */
        NvU64 ps = (pt_race_rand(t) & 1) ? UVM_PAGE_SIZE_64K : UVM_PAGE_SIZE_4K;
        uvm_page_directory_t *pd;
        u64 before = t->should_free_here;
        bool absent;

        status = uvm_page_tree_get_entry(tree, UVM_PAGE_SIZE_2M, pt_race_va(tree, base), UVM_PMM_ALLOC_FLAGS_NONE,
                                         &h->parent);
        if (status != NV_OK)
            return status;
        /* the table absent just before the call, and should_free inside it: another thread inserted it meanwhile */
        pd = h->parent.table;
        uvm_mutex_lock(&tree->lock);
        absent = pd->entries[tree->hal->entries_per_index(pd->depth) * h->parent.start_index +
                             tree->hal->entry_offset(pd->depth, ps)] == NULL;
        uvm_mutex_unlock(&tree->lock);
        status = uvm_page_tree_alloc_table(tree, ps, UVM_PMM_ALLOC_FLAGS_NONE, &h->parent, &h->range);
        if (absent && t->should_free_here != before)
            t->should_free_raced++;
        if (status != NV_OK) {
            uvm_page_tree_put_ptes(tree, &h->parent);
            h->parent.table = NULL;
            return status;
        }
        t->allocs++;
    }
    else {
        /* 2 in 4: 64K PTEs (256 B tables), 1 in 4: 4K PTEs (4 KiB tables) */
        NvU64 ps = what == 1 ? UVM_PAGE_SIZE_4K : UVM_PAGE_SIZE_64K;
        u32 entries = UVM_PAGE_SIZE_2M / ps;
        u32 count = 1 + pt_race_rand(t) % (ps == UVM_PAGE_SIZE_4K ? 16 : 4);
        u32 idx = pt_race_rand(t) % (entries - count + 1);

        status = uvm_page_tree_get_ptes_async(tree, ps, pt_race_va(tree, base + idx * ps), count * ps,
                                              UVM_PMM_ALLOC_FLAGS_NONE, &h->range);
        if (status != NV_OK)
            return status;
        status = uvm_page_tree_wait(tree);
        t->gets++;
    }
    h->held = true;
    return status;
}

static void pt_race_put(pt_race_thread_t *t, pt_race_hold_t *h)
{
    uvm_page_tree_put_ptes(t->tree, &h->range);
    if (h->parent.table)
        uvm_page_tree_put_ptes(t->tree, &h->parent);
    h->held = false;
    t->puts++;
}

static void pt_race_loop(pt_race_thread_t *t)
{
    pt_race_span_t *spans = uvm_kvmalloc(sizeof(*spans) * PT_RACE_MAX_DIRS);
    u32 i, n;

    if (!spans) {
        t->status = NV_ERR_NO_MEMORY;
        return;
    }
    wait_for_completion(t->go);
    for (t->ops = 0; t->ops < uvm_pt_pack_test_race_iters && time_before(jiffies, t->deadline); t->ops++) {
        pt_race_hold_t *h = &t->hold[pt_race_rand(t) % PT_RACE_HOLD];

        if (h->held)
            pt_race_put(t, h);
        else if ((t->status = pt_race_get(t, h)) != NV_OK)
            break;
        if (t->ops % 8 == 7) {
            n = pt_race_check(t, spans);
            t->tables_max = max_t(u64, t->tables_max, n);
        }
        cond_resched();
    }
    pt_race_check(t, spans);
    for (i = 0; i < PT_RACE_HOLD; i++) {
        if (t->hold[i].held)
            pt_race_put(t, &t->hold[i]);
    }
    uvm_kvfree(spans);
}

static int pt_race_thread(void *arg)
{
    pt_race_thread_t *t = arg;

    UVM_ENTRY_VOID(pt_race_loop(t));
    complete(&t->done);
    /* stay until kthread_stop(), so that the caller's stop never races our exit */
    set_current_state(TASK_INTERRUPTIBLE);
    while (!kthread_should_stop()) {
        schedule();
        set_current_state(TASK_INTERRUPTIBLE);
    }
    __set_current_state(TASK_RUNNING);
    return 0;
}

static NV_STATUS pt_race_run(uvm_gpu_t *gpu)
{
    int nthreads = min(uvm_pt_pack_test_race_threads, PT_RACE_MAX_THREADS);
    pt_race_thread_t *threads;
    uvm_page_tree_t *tree;
    struct completion go;
    NV_STATUS status = NV_OK;
    u64 sum[9] = {0};
    unsigned long t0 = jiffies;
    bool packed = false;
    int i, started = 0;

    TEST_CHECK_RET(fake_gpu_init_blackwell(gpu, NV2080_CTRL_MC_ARCH_INFO_IMPLEMENTATION_GB10B) == NV_OK);
    tree = uvm_kvmalloc_zero(sizeof(*tree));
    threads = uvm_kvmalloc_zero(sizeof(*threads) * nthreads);
    if (!tree || !threads) {
        uvm_kvfree(tree);
        uvm_kvfree(threads);
        return NV_ERR_NO_MEMORY;
    }
    for (i = 0; i < 3; i++)
        atomic64_set(&pt_race_hits[i], 0);
    status = test_page_tree_init(gpu, BIG_PAGE_SIZE_PASCAL, tree);
    if (status != NV_OK)
        goto out;
    packed = uvm_pt_pack_active(&tree->pt_pack);
    init_completion(&go);
    pt_race_threads = threads;
    for (i = 0; i < nthreads; i++) {
        pt_race_thread_t *t = &threads[i];

        t->tree = tree;
        t->go = &go;
        t->rng = (u64)(i + 1) * 0x9E3779B97F4A7C15ull;
        t->deadline = jiffies + (unsigned long)uvm_pt_pack_test_race_secs * HZ;
        init_completion(&t->done);
        t->task = kthread_run(pt_race_thread, t, "uvm_pt_race/%d", i);
        if (IS_ERR(t->task)) {
            t->task = NULL;
            status = NV_ERR_NO_MEMORY;
            break;
        }
        started++;
    }
    pt_race_nthreads = started;
    complete_all(&go);
    for (i = 0; i < started; i++) {
        pt_race_thread_t *t = &threads[i];

        wait_for_completion(&t->done);
        kthread_stop(t->task);
        if (t->status != NV_OK && status == NV_OK)
            status = t->status;
        sum[0] += t->ops;
        sum[1] += t->gets;
        sum[2] += t->allocs;
        sum[3] += t->puts;
        sum[4] += t->checks;
        sum[5] += t->overlaps;
        sum[6] += t->bad_links;
        sum[7] = max(sum[7], t->tables_max);
        sum[8] += t->should_free_raced;
    }
    pt_race_nthreads = 0;
    pt_race_threads = NULL;
    if (tree->root->ref_count != 0)
        sum[6]++;
    pr_info("uvm_pt_race: RESULT threads=%d ops=%llu get_ptes=%llu alloc_table=%llu put_ptes=%llu retries=%lld "
            "dir_cache_unused=%lld should_free=%lld should_free_raced=%llu checks=%llu tables_max=%llu overlaps=%llu bad_links=%llu "
            "errors=%d packed=%d secs=%u status=0x%x\n",
            started, sum[0], sum[1], sum[2], sum[3], (long long)atomic64_read(&pt_race_hits[0]),
            (long long)atomic64_read(&pt_race_hits[1]), (long long)atomic64_read(&pt_race_hits[2]), sum[8], sum[4], sum[7],
            sum[5], sum[6], status != NV_OK, packed, jiffies_to_msecs(jiffies - t0) / 1000, status);
    if (status == NV_OK && (sum[5] || sum[6]))
        status = NV_ERR_INVALID_STATE;
    uvm_page_tree_deinit(tree);
out:
    uvm_kvfree(threads);
    uvm_kvfree(tree);
    return status;
}

