/* SPDX-License-Identifier: GPL-2.0-only OR MIT */
/*
 * Userspace harness for uvm_patch/src/uvm_pt_pack.c, which is compiled
 * unchanged against tests/harness/shim/ and linked in as its own object.
 *
 *   pt_harness unit                      deterministic unit checks
 *   pt_harness fuzz  OPS SEED            random-op driver (single thread)
 *   pt_harness stress OPS SEED THREADS   multi-threaded stress (run under TSan)
 *   pt_harness recycle                   stale/double/wrong-pool frees with recycled pages
 *   (pt_fuzz: the same engine driven by libFuzzer input bytes)
 *
 * The checker keeps its own model of every live table and backing page and
 * compares the pool against it after every operation:
 *   - every slot aligned for its class and inside its backing page;
 *   - no two live tables overlap (granule ownership map per backing page,
 *     plus a per-table byte pattern verified at free);
 *   - a backing page is released exactly when its last table is freed;
 *   - a table is all-zero when handed out (the checker scribbles into freed
 *     tables whose page is still held, so a reused slot must be zeroed);
 *   - the counters text (uvm_pt_pack_stats, parsed) equals the recomputed truth;
 *   - every pool is empty at deinit and the global counters return to zero;
 *   - the pool never writes page->private (NVIDIA's) and never reads it: the
 *     checker plants stray values there (stray-private unit case).
 * A failed check prints "CHECK FAILED: <kind>: ..." and exits with status 3.
 */
#include "shim.h"
#include <errno.h>
#include <inttypes.h>
#include <malloc.h>
#include "../../uvm_patch/src/uvm_pt_pack.h"

extern int shim_warn_quiet;

#ifndef UVM_PT_PACK_DEFAULT
#define UVM_PT_PACK_DEFAULT_EXPECT 3   /* leaf */
#else
#define UVM_PT_PACK_DEFAULT_EXPECT UVM_PT_PACK_DEFAULT
#endif

#define EXIT_CHECK 3
#define GRANULE 256u
#define NGRAN (PAGE_SIZE / GRANULE)
#define MAX_TREES 8
#define MAX_TABLES 4096

static void fail(const char *kind, const char *fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));
static void fail(const char *kind, const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "CHECK FAILED: %s: ", kind);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(EXIT_CHECK);
}
#define CHECK(cond, kind, ...) do { if (!(cond)) fail(kind, __VA_ARGS__); } while (0)

/* ------------------------------------------------------------------ model */

struct bpage {                      /* a backing page handed out by get() */
	struct page *page;
	u64 base;                   /* fake GPU (DMA) address of the page start */
	int tree;
	int cls;                    /* -1 until its first table */
	int live;                   /* live tables per the model */
	bool alive;
	int reg;                    /* index in bp_reg[] */
	u32 owner[NGRAN];           /* table id owning each 256 B granule, 0 = free */
	unsigned long planted;      /* page->private as NVIDIA's side last set it (the pool never may) */
};

/* Every live backing page (the model's truth for pages held). Under bk. */
static struct bpage **bp_reg;
static int bp_n, bp_cap;

static void bp_reg_add(struct bpage *bp)
{
	if (bp_n == bp_cap) {
		bp_cap = bp_cap ? 2 * bp_cap : 1024;
		bp_reg = realloc(bp_reg, bp_cap * sizeof(*bp_reg));
		if (!bp_reg)
			abort();
	}
	bp->reg = bp_n;
	bp_reg[bp_n++] = bp;
}

static void bp_reg_del(struct bpage *bp)
{
	bp_reg[bp->reg] = bp_reg[--bp_n];
	bp_reg[bp->reg]->reg = bp->reg;
}

struct table {
	u32 id;                     /* nonzero */
	int tree;
	bool packed;
	u32 size;
	struct page *page;
	u64 addr;
	struct bpage *bp;           /* packed only */
	u32 tag;                    /* the pool's tag (0: NVIDIA's path) */
	bool whole;                 /* a whole page from get(), freed by NVIDIA's path */
	u8 pattern;
};

struct tree {
	struct uvm_pt_pack_pool pool;
	pthread_mutex_t lock;       /* stands in for tree->lock */
	bool used;
	bool user;                  /* a user tree: charged to its own memcg (idx + 100) */
	int tier;                   /* effective tier: OFF unless the predicate matched */
	enum uvm_pt_pack_reason reason;
	int idx;
};

static struct tree trees[MAX_TREES];
static pthread_mutex_t bk = PTHREAD_MUTEX_INITIALIZER;  /* the model's lock */
static u64 next_base = 0x100000000000ull;
static u64 base_misalign;            /* added to get()'s address (robustness test) */
static int get_fail_next;            /* get() returns -ENOMEM this many times */
static long n_gets, n_puts;
static u32 next_id = 1;
static bool mt_mode;                 /* stress: relax checks that need quiescence */
static long ops_done;
static const char *last_reason_truth = "none";   /* model of unpacked_reason */
static long pages_live_model;        /* alive bpages */
static long long bad_frees_model, whole_model, leaked_tables_model, leaked_pages_model;
/* recycle mode: put() keeps the page and get() hands the last one back with its address */
static bool recycle;
static struct page *recycled_page;
static u64 recycled_base;

/* Live-table registry (single-threaded engine). */
static struct table live[MAX_TABLES];
static int nlive;

static int get_cb(void *ctx, struct page **page, u64 *gpu_addr)
{
	struct tree *t = ctx;
	struct bpage *bp;
	struct page *p;

	pthread_mutex_lock(&bk);
	if (get_fail_next > 0) {
		get_fail_next--;
		pthread_mutex_unlock(&bk);
		return -ENOMEM;
	}
	pthread_mutex_unlock(&bk);

	pthread_mutex_lock(&bk);
	p = recycled_page;   /* the buddy allocator and the IOVA cache hand the same page and address back */
	recycled_page = NULL;
	pthread_mutex_unlock(&bk);
	if (p) {
		memset(p->virt, 0, PAGE_SIZE);   /* __GFP_ZERO */
		p->private = 0;
	} else {
		p = alloc_page(GFP_KERNEL | __GFP_ZERO);   /* NVIDIA: alloc_pages(__GFP_ZERO | ...) */
	}
	bp = calloc(1, sizeof(*bp));
	if (!p || !bp)
		fail("harness", "out of memory");
	pthread_mutex_lock(&bk);
	bp->page = p;
	if (p->harness == (void *)&recycled_base) {
		bp->base = recycled_base;
	} else {
		bp->base = next_base + base_misalign;
		next_base += PAGE_SIZE;
	}
	bp->tree = t->idx;
	bp->cls = -1;
	bp->alive = true;
	p->harness = bp;
	bp_reg_add(bp);
	n_gets++;
	pages_live_model++;
	pthread_mutex_unlock(&bk);
	*page = p;
	*gpu_addr = bp->base;
	return 0;
}

static void put_cb(void *ctx, struct page *page, u64 gpu_addr)
{
	struct tree *t = ctx;
	struct bpage *bp = page->harness;

	/* NVIDIA's free path asserts tree->lock: so does the model. */
	if (!mt_mode)
		CHECK(pthread_mutex_trylock(&t->lock) == EBUSY, "locking", "put() without tree lock");
	pthread_mutex_lock(&bk);
	CHECK(bp && bp->alive, "bad put", "put() of a page that is not a live backing page");
	CHECK(bp->tree == t->idx, "bad put", "put() on the wrong tree");
	CHECK(gpu_addr == bp->base, "bad put", "put() address %#" PRIx64 " != %#" PRIx64,
	      gpu_addr, bp->base);
	CHECK(bp->live == 0, "released in use", "backing page released with %d live tables", bp->live);
	CHECK(page_private(page) == bp->planted, "private", "the pool changed page->private (%#lx != %#lx)",
	      page_private(page), bp->planted);
	bp->alive = false;
	bp_reg_del(bp);
	n_puts++;
	pages_live_model--;
	pthread_mutex_unlock(&bk);
	page->harness = NULL;
	free(bp);
	if (recycle) {
		pthread_mutex_lock(&bk);
		if (recycled_page)
			__free_page(recycled_page);
		recycled_page = page;
		recycled_base = gpu_addr;
		page->harness = (void *)&recycled_base;
		pthread_mutex_unlock(&bk);
		return;
	}
	__free_page(page);
}

/*
 * What the hook does: run fn in the memcg that get() charges pages to (the
 * va_space mm's memcg for a user tree: here memcg idx + 100) with
 * __GFP_ACCOUNT; for the kernel tree, uncharged.
 */
static int charged_cb(void *ctx, int (*fn)(void *arg, gfp_t gfp), void *arg)
{
	struct tree *t = ctx;
	int old = shim_active_memcg, r;

	if (!t->user)
		return fn(arg, GFP_KERNEL);
	shim_active_memcg = t->idx + 100;
	r = fn(arg, GFP_KERNEL | __GFP_ACCOUNT);
	shim_active_memcg = old;
	return r;
}

static const struct uvm_pt_pack_ops ops = { .get = get_cb, .put = put_cb, .charged = charged_cb };

/* A freed-page stand-in for "NVIDIA's path freed this whole-page table". Caller holds nothing. */
static void nvidia_free_whole(struct table *tb)
{
	struct bpage *bp = tb->page->harness;

	pthread_mutex_lock(&bk);
	CHECK(bp && !bp->alive, "whole page", "whole-page table %u not NVIDIA's", tb->id);
	n_puts++;
	pthread_mutex_unlock(&bk);
	tb->page->harness = NULL;
	free(bp);
	__free_page(tb->page);
}

static unsigned int expect_align(int tier, u32 size)
{
	if (tier == UVM_PT_PACK_TIER_256 && size == 256)
		return 256;
	return 4096;
}

/* Reasons that mean "out of scope by configuration": counted nowhere. */
static bool reason_uncounted(enum uvm_pt_pack_reason r)
{
	return r == UVM_PT_PACK_R_DISABLED || r == UVM_PT_PACK_R_KERNEL_TREE;
}

static int size_cls(u32 size)
{
	return size == 256 ? UVM_PT_PACK_C256 : UVM_PT_PACK_C4096;
}

static bool expect_packed(const struct tree *t, unsigned int depth, u32 size)
{
	if (t->tier == UVM_PT_PACK_TIER_OFF || depth == 0)
		return false;
	if (size != 256 && size != 4096)
		return false;
	/* leaf: the validated scope, 256 B tables only (user trees: checked at tree init) */
	if (t->tier == UVM_PT_PACK_TIER_LEAF && size != 256)
		return false;
	/* a class whose slot would be a whole page is not packed */
	return PAGE_SIZE >= 2 * expect_align(t->tier, size);
}

/* ---------------------------------------------------------- tree helpers */

static struct uvm_pt_pack_facts good_facts(int tier)
{
	struct uvm_pt_pack_facts f = {
		.tier = tier, .has_pci_dev = true, .no_vidmem = true, .integrated = 1,
		.sysmem_tree = true, .dma_coherent = true, .user_tree = true, .page_size = PAGE_SIZE,
	};
	return f;
}

static void tree_init(int i, const struct uvm_pt_pack_facts *f)
{
	struct tree *t = &trees[i];

	memset(&t->pool, 0, sizeof(t->pool));     /* uvm_page_tree_init's memset(tree, 0) */
	pthread_mutex_init(&t->lock, NULL);
	t->idx = i;
	t->used = true;
	t->user = f->user_tree;
	t->reason = uvm_pt_pack_tree_init(&t->pool, f, &ops, t);
	CHECK(t->reason == uvm_pt_pack_check(f), "predicate", "tree_init reason differs from check");
	t->tier = t->reason == UVM_PT_PACK_OK ? f->tier : UVM_PT_PACK_TIER_OFF;
	if (t->reason != UVM_PT_PACK_OK && !reason_uncounted(t->reason))
		last_reason_truth = uvm_pt_pack_reason_str(t->reason);
	CHECK(uvm_pt_pack_active(&t->pool) == (t->reason == UVM_PT_PACK_OK), "predicate",
	      "active() disagrees with reason");
}

/* --------------------------------------------------------- alloc / free */

/* Record a returned table in the model and check it. Caller holds bk. */
static void model_add(struct table *tb, struct tree *t)
{
	struct bpage *bp;
	u64 off;
	unsigned int g, a = expect_align(t->tier, tb->size);
	const u8 *va;
	u32 i;

	bp = tb->page->harness;
	CHECK(bp && bp->alive, "foreign page", "table %u in a page that is not a live backing page", tb->id);
	CHECK(bp->tree == t->idx, "cross-tree", "table of tree %d in a page of tree %d", t->idx, bp->tree);
	CHECK(tb->addr % a == 0, "misaligned", "table %u at %#" PRIx64 " not %u-aligned", tb->id, tb->addr, a);
	CHECK(tb->addr >= bp->base && tb->addr - bp->base + tb->size <= PAGE_SIZE, "out of page",
	      "table %u at %#" PRIx64 " outside its page %#" PRIx64, tb->id, tb->addr, bp->base);
	if (bp->cls < 0)
		bp->cls = size_cls(tb->size);
	CHECK(bp->cls == size_cls(tb->size), "mixed classes", "page holds %d and %d", bp->cls,
	      size_cls(tb->size));
	off = tb->addr - bp->base;
	for (g = off / GRANULE; g < (off + tb->size) / GRANULE; g++) {
		CHECK(bp->owner[g] == 0, "overlap", "table %u overlaps live table %u at %#" PRIx64,
		      tb->id, bp->owner[g], bp->base + g * GRANULE);
		bp->owner[g] = tb->id;
	}
	va = (const u8 *)bp->page->virt + off;
	for (i = 0; i < tb->size; i++)
		CHECK(va[i] == 0, "not zeroed", "table %u byte %u is %#x", tb->id, i, va[i]);
	bp->live++;
	tb->bp = bp;
}

static void table_write(struct table *tb)
{
	u8 *va = (u8 *)tb->page->virt + (tb->packed ? tb->addr - tb->bp->base : 0);

	memset(va, tb->pattern, tb->size);   /* stands in for the GPU writing PTEs */
}

static void table_verify(const struct table *tb)
{
	const u8 *va = (const u8 *)tb->page->virt + (tb->packed ? tb->addr - tb->bp->base : 0);
	u32 i;

	for (i = 0; i < tb->size; i++)
		CHECK(va[i] == tb->pattern, "overlap", "table %u byte %u clobbered (%#x != %#x)",
		      tb->id, i, va[i], tb->pattern);
}

/* Returns 0, or the negative error of a failed alloc. */
static int do_alloc(struct tree *t, unsigned int depth, u32 size, struct table *tb)
{
	struct page *page = NULL;
	u64 addr = 0;
	u32 tag = 0;
	int r = uvm_pt_pack_alloc(&t->pool, depth, size, &page, &addr, &tag);

	memset(tb, 0, sizeof(*tb));
	tb->tree = t->idx;
	tb->size = size;
	if (r < 0)
		return r;
	CHECK(r == 0 || r == UVM_PT_PACK_NOT_PACKED, "api", "alloc returned %d", r);
	CHECK((r == 0) == expect_packed(t, depth, size), "routing",
	      "depth %u size %u tier %d: packed=%d", depth, size, t->tier, r == 0);
	pthread_mutex_lock(&bk);
	tb->id = next_id++;
	if (!tb->id)
		tb->id = next_id++;
	tb->pattern = (u8)(tb->id * 37 + 1) | 1;
	pthread_mutex_unlock(&bk);
	if (r == 0 && tag == 0) {
		/* no memory for the descriptor: the whole page, as NVIDIA's path makes it */
		struct bpage *bp = page->harness;

		pthread_mutex_lock(&bk);
		CHECK(bp && bp->alive && bp->cls < 0 && addr == bp->base, "whole page",
		      "untagged table %u is not a fresh whole page", tb->id);
		bp->alive = false;     /* NVIDIA's now, not the pool's */
		bp_reg_del(bp);
		pages_live_model--;
		whole_model++;
		pthread_mutex_unlock(&bk);
		tb->whole = true;
		tb->page = page;
		tb->addr = addr;
	} else if (r == 0) {
		tb->packed = true;
		tb->page = page;
		tb->addr = addr;
		tb->tag = tag;
		pthread_mutex_lock(&bk);
		model_add(tb, t);
		pthread_mutex_unlock(&bk);
	} else {
		/* NVIDIA's own path: one whole page for the table */
		tb->page = calloc(1, sizeof(*tb->page));
		if (!tb->page || !(tb->page->virt = calloc(1, size)))
			fail("harness", "out of memory");
		tb->addr = 0x7000000000000ull + (u64)tb->id * PAGE_SIZE;
	}
	table_write(tb);
	return 0;
}

static void do_free(struct tree *t, struct table *tb)
{
	struct bpage *bp = tb->bp;
	bool last = false, was_packed;
	long puts_before;
	u64 off = 0;
	unsigned int g;

	table_verify(tb);
	if (tb->packed) {
		/* drop it from the model before the pool can hand the slot out again */
		pthread_mutex_lock(&bk);
		off = tb->addr - bp->base;
		for (g = off / GRANULE; g < (off + tb->size) / GRANULE; g++) {
			CHECK(bp->owner[g] == tb->id, "overlap", "granule of table %u owned by %u",
			      tb->id, bp->owner[g]);
			bp->owner[g] = 0;
		}
		last = --bp->live == 0;
		pthread_mutex_unlock(&bk);
	}
	pthread_mutex_lock(&t->lock);
	/* (NVIDIA: uvm_tracker_wait() here, then the hook) */
	puts_before = mt_mode ? 0 : n_puts;
	was_packed = uvm_pt_pack_free(&t->pool, tb->page, tb->addr, tb->size, tb->tag);
	if (!tb->packed && !was_packed) {
		if (tb->whole) {
			nvidia_free_whole(tb);
		} else {
			free(tb->page->virt);        /* NVIDIA's path */
			free(tb->page);
		}
	}
	pthread_mutex_unlock(&t->lock);
	CHECK(was_packed == tb->packed, "routing", "free of table %u: packed=%d, pool said %d",
	      tb->id, tb->packed, was_packed);
	if (tb->packed && !mt_mode) {
		/* single thread: the page is released iff its last table went */
		CHECK(n_puts - puts_before == (last ? 1 : 0), last ? "empty page held" : "released in use",
		      "free of table %u (last=%d): %ld put() calls", tb->id, last, n_puts - puts_before);
		if (!last) {
			/* the page stays: scribble over the freed table; reuse must zero it */
			memset((u8 *)bp->page->virt + off, 0xA5, tb->size);
		}
	}
}

/* ------------------------------------------------------------- counters */

struct stats { long long v[32]; };
static const char *const stat_keys[] = {
	"format", "tier", "page_size", "trees_packed", "trees_unpacked", "unpacked_reason",
	"c256_tables", "c256_pages", "c256_backing_bytes", "c256_stock_bytes", "c256_saved_bytes",
	"c4096_tables", "c4096_pages", "c4096_backing_bytes", "c4096_stock_bytes", "c4096_saved_bytes",
	"backing_bytes", "stock_bytes", "saved_bytes",
	"leaked_tables", "leaked_pages", "leaked_bytes", "bad_frees", "whole_page_tables",
};
#define NKEYS (sizeof(stat_keys) / sizeof(stat_keys[0]))

/* Parse the stats text strictly: exactly these keys, in this order. */
static void read_stats(long long *v, char *tier, char *reason)
{
	char buf[8192], *line, *save = NULL;
	unsigned int k = 0;
	int n = shim_param_get("uvm_pt_pack_stats", buf, sizeof(buf));

	CHECK(n > 0, "counters", "stats getter returned %d", n);
	CHECK(buf[n - 1] == '\n', "counters", "stats text does not end in a newline");
	for (line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save), k++) {
		char key[64], val[64], extra[8];

		CHECK(k < NKEYS, "counters", "extra line '%s'", line);
		CHECK(sscanf(line, "%63s %63s %7s", key, val, extra) == 2, "counters", "bad line '%s'", line);
		CHECK(!strcmp(key, stat_keys[k]), "counters", "key %u is '%s', want '%s'", k, key, stat_keys[k]);
		if (!strcmp(key, "tier"))
			strcpy(tier, val);
		else if (!strcmp(key, "unpacked_reason"))
			strcpy(reason, val);
		else {
			char *end;
			v[k] = strtoll(val, &end, 10);
			CHECK(*end == 0, "counters", "value of %s is '%s'", key, val);
			CHECK(v[k] >= 0, "negative", "%s %lld", key, v[k]);
		}
	}
	CHECK(k == NKEYS, "counters", "%u lines, want %zu", k, NKEYS);
}


/* Compare the counters with the model. Quiescent callers only. */
static void check_counters(void)
{
	long long v[NKEYS], tables[2] = { 0, 0 }, pages[2] = { 0, 0 }, tp = 0, tu = 0;
	char tier[64], reason[64];
	int i, c;
	const char *tier_truth;
	int req = uvm_pt_pack_requested_tier();

	read_stats(v, tier, reason);
	for (i = 0; i < nlive; i++)
		if (live[i].packed)
			tables[size_cls(live[i].size)]++;
	for (i = 0; i < MAX_TREES; i++) {
		struct tree *t = &trees[i];

		if (!t->used)
			continue;
		if (t->reason == UVM_PT_PACK_OK)
			tp++;
		else if (!reason_uncounted(t->reason))
			tu++;
	}
	/* pages: every live backing page of the model, by class; none may be empty */
	for (i = 0; i < bp_n; i++) {
		CHECK(bp_reg[i]->cls >= 0, "counters", "backing page without a table");
		CHECK(bp_reg[i]->live > 0, "empty page held", "backing page %#" PRIx64 " held with no table",
		      bp_reg[i]->base);
		pages[bp_reg[i]->cls]++;
	}
	CHECK(bp_n == pages_live_model, "harness", "registry");
	tier_truth = req == UVM_PT_PACK_TIER_4K_ALL ? "4k-all" : req == UVM_PT_PACK_TIER_256 ? "256" :
		     req == UVM_PT_PACK_TIER_LEAF ? "leaf" : "off";
	CHECK(v[0] == UVM_PT_PACK_FORMAT, "counters", "format %lld", v[0]);
	CHECK(!strcmp(tier, tier_truth), "counters", "tier %s, want %s", tier, tier_truth);
	CHECK(v[2] == (long long)PAGE_SIZE, "counters", "page_size %lld", v[2]);
	CHECK(v[3] == tp, "counters", "trees_packed %lld, want %lld", v[3], tp);
	CHECK(v[4] == tu, "counters", "trees_unpacked %lld, want %lld", v[4], tu);
	/* uvm_pt_pack=0: "disabled" whatever the trees said before */
	CHECK(!strcmp(reason, req == UVM_PT_PACK_TIER_OFF ? "disabled" : last_reason_truth), "counters",
	      "unpacked_reason %s, want %s", reason, req == UVM_PT_PACK_TIER_OFF ? "disabled" : last_reason_truth);
	for (c = 0; c < 2; c++) {
		long long *cv = &v[6 + 5 * c];
		long long backing = pages[c] * (long long)PAGE_SIZE, stock = tables[c] * (long long)PAGE_SIZE;

		CHECK(cv[0] == tables[c], "counters", "%s %lld, want %lld", stat_keys[6 + 5 * c], cv[0], tables[c]);
		CHECK(cv[1] == pages[c], "counters", "%s %lld, want %lld", stat_keys[7 + 5 * c], cv[1], pages[c]);
		CHECK(cv[2] == backing, "counters", "%s wrong", stat_keys[8 + 5 * c]);
		CHECK(cv[3] == stock, "counters", "%s wrong", stat_keys[9 + 5 * c]);
		CHECK(cv[4] == stock - backing, "counters", "%s wrong", stat_keys[10 + 5 * c]);
	}
	CHECK(v[16] == (pages[0] + pages[1]) * (long long)PAGE_SIZE, "counters", "backing_bytes");
	CHECK(v[17] == (tables[0] + tables[1]) * (long long)PAGE_SIZE, "counters", "stock_bytes");
	CHECK(v[18] == v[17] - v[16], "counters", "saved_bytes");
	CHECK(v[19] == leaked_tables_model && v[20] == leaked_pages_model &&
	      v[21] == leaked_pages_model * (long long)PAGE_SIZE, "counters", "leaked %lld/%lld/%lld",
	      v[19], v[20], v[21]);
	CHECK(v[22] == bad_frees_model, "counters", "bad_frees %lld, want %lld", v[22], bad_frees_model);
	CHECK(v[23] == whole_model, "counters", "whole_page_tables %lld, want %lld", v[23], whole_model);
}

/* --------------------------------------------------------------- engine */

struct src {
	const u8 *data;             /* libFuzzer bytes, or NULL for the PRNG */
	size_t len, pos;
	u64 rng;
	bool done;
};

static u32 src_u32(struct src *s)
{
	u32 v = 0;
	int i;

	if (!s->data) {
		/* xorshift64* */
		s->rng ^= s->rng >> 12;
		s->rng ^= s->rng << 25;
		s->rng ^= s->rng >> 27;
		return (u32)((s->rng * 0x2545F4914F6CDD1Dull) >> 32);
	}
	for (i = 0; i < 4; i++) {
		if (s->pos >= s->len) {
			s->done = true;
			return v;
		}
		v = (v << 8) | s->data[s->pos++];
	}
	return v;
}

static void live_remove(int i)
{
	live[i] = live[--nlive];
}

static void random_facts(struct src *s, struct uvm_pt_pack_facts *f)
{
	u32 r = src_u32(s);

	static const int tiers[] = { UVM_PT_PACK_TIER_LEAF, UVM_PT_PACK_TIER_4K_ALL, UVM_PT_PACK_TIER_256 };

	*f = good_facts(tiers[(r >> 8) % 3]);
	if ((r >> 1) % 4 == 0) {
		switch ((r >> 3) % 10) {
		case 0: f->tier = UVM_PT_PACK_TIER_OFF; break;
		case 1: f->tier = 7; break;
		case 2: f->has_pci_dev = false; break;
		case 3: f->no_vidmem = false; break;
		case 4: f->integrated = 0; break;
		case 5: f->integrated = -1; break;   /* branch without is_integrated_gpu: not packed */
		case 6: f->sysmem_tree = false; break;
		case 7: f->dma_coherent = false; break;
		case 8: f->page_size = PAGE_SIZE * 2; break;
		case 9: f->user_tree = false; break;   /* UVM's kernel tree */
		}
	}
}

static void engine_tree_init(int i, const struct uvm_pt_pack_facts *f)
{
	tree_init(i, f);
}

static void engine_tree_deinit(int i)
{
	struct tree *t = &trees[i];
	int k;

	for (k = 0; k < nlive;) {
		if (live[k].tree == i) {
			do_free(t, &live[k]);
			live_remove(k);
		} else {
			k++;
		}
	}
	CHECK(uvm_pt_pack_pool_empty(&t->pool), "pool not empty", "tree %d at deinit", i);
	pthread_mutex_lock(&t->lock);
	uvm_pt_pack_tree_deinit(&t->pool, true);
	pthread_mutex_unlock(&t->lock);
	pthread_mutex_destroy(&t->lock);
	t->used = false;
}

static const unsigned int depths[] = { 5, 5, 5, 5, 4, 3, 2, 1, 0 };

static void engine_alloc(struct src *s, u32 r)
{
	static const u32 odd_sizes[] = { 16, 512, 2048 };
	int ti = r % MAX_TREES;
	unsigned int depth = depths[(r >> 4) % 9];
	u32 size, pick = (r >> 8) % 100;
	struct table tb;
	int err;

	if (!trees[ti].used)
		return;
	if (pick < 70)
		size = 256;
	else if (pick < 98)
		size = 4096;
	else
		size = odd_sizes[(r >> 16) % 3];
	if (nlive == MAX_TABLES)
		return;
	err = do_alloc(&trees[ti], depth, size, &tb);
	if (err) {
		CHECK(err == -ENOMEM, "api", "alloc error %d", err);
		return;
	}
	live[nlive++] = tb;
}

/* Run random operations from src; everything is torn down at the end. */
static void engine_run(struct src *s, long max_ops)
{
	struct uvm_pt_pack_facts f;
	int i, ntrees = 1 + src_u32(s) % MAX_TREES;
	long n;

	for (i = 0; i < ntrees; i++) {
		random_facts(s, &f);
		engine_tree_init(i, &f);
	}
	for (n = 0; n < max_ops && !s->done; n++) {
		u32 r = src_u32(s), op = r % 1000;

		r = src_u32(s);
		if (op < 520) {
			engine_alloc(s, r);
		} else if (op < 900) {
			if (nlive) {
				i = r % nlive;
				do_free(&trees[live[i].tree], &live[i]);
				live_remove(i);
			}
		} else if (op < 940) {
			/* get() failure: -ENOMEM unless a partial page had a free slot */
			if (r & 0x100000)
				get_fail_next = 1;
			else
				shim_xa_fail_next = 1;   /* no memory to record a fresh page */
			engine_alloc(s, r);
			get_fail_next = 0;
			shim_xa_fail_next = 0;
		} else if (op < 990) {
			check_counters();
		} else if (op < 996) {
			/* a burst of frees, as free_unused_directories() does */
			int k = 1 + r % 16;
			while (k-- && nlive) {
				i = src_u32(s) % nlive;
				do_free(&trees[live[i].tree], &live[i]);
				live_remove(i);
			}
		} else {
			/* a process exits and another starts: tree deinit + init */
			i = r % MAX_TREES;
			if (trees[i].used)
				engine_tree_deinit(i);
			random_facts(s, &f);
			engine_tree_init(i, &f);
		}
		ops_done++;
	}
	check_counters();
	for (i = 0; i < MAX_TREES; i++)
		if (trees[i].used)
			engine_tree_deinit(i);
	CHECK(nlive == 0, "harness", "tables left");
	check_counters();
	CHECK(bp_n == 0 && pages_live_model == 0, "leak", "%d backing pages left", bp_n);
	CHECK(n_gets == n_puts, "leak", "get %ld put %ld", n_gets, n_puts);
	CHECK(shim_pages_live == 0, "leak", "%ld pages still allocated", shim_pages_live);
	CHECK(shim_warn_count == 0, "warning", "%ld kernel warnings", shim_warn_count);
}

/* ---------------------------------------------------------------- stress */

struct worker {
	pthread_t th;
	u64 seed;
	long ops;
	struct table *tabs;
	int n;
};

#define WORKER_MAX 256
static int stress_ntrees = 3;
static int stress_stop;   /* __atomic */

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	struct src s = { .rng = w->seed };
	long k;

	int target = 1 + src_u32(&s) % WORKER_MAX;
	bool filling = true;

	/*
	 * Waves: fill to a random target, then drain to empty (mostly), so that
	 * backing pages keep being released and re-acquired while other threads
	 * allocate: concurrent get() for one class, release racing with alloc.
	 */
	for (k = 0; k < w->ops; k++) {
		u32 r = src_u32(&s), op = r % 100;
		struct tree *t = &trees[(r >> 8) % stress_ntrees];

		if (filling && w->n >= target)
			filling = false;
		if (!filling && w->n == 0) {
			filling = true;
			target = 1 + src_u32(&s) % WORKER_MAX;
		}
		if (((filling ? op < 85 : op < 15) && w->n < WORKER_MAX) || w->n == 0) {
			u32 size = ((r >> 16) % 10) < 7 ? 256 : 4096;
			unsigned int depth = 1 + (r >> 20) % 5;
			int err = do_alloc(t, depth, size, &w->tabs[w->n]);

			if (!err)
				w->n++;
		} else {
			int i = (r >> 12) % w->n;

			do_free(&trees[w->tabs[i].tree], &w->tabs[i]);
			w->tabs[i] = w->tabs[--w->n];
		}
	}
	return NULL;
}

static void *reader_main(void *arg)
{
	long *reads = arg;

	while (!__atomic_load_n(&stress_stop, __ATOMIC_ACQUIRE)) {
		long long v[NKEYS];
		char tier[64], reason[64];

		read_stats(v, tier, reason);   /* strict format while pools change */
		(*reads)++;
	}
	return NULL;
}

static void run_stress(long ops, u64 seed, int nthreads)
{
	struct worker *w = calloc(nthreads, sizeof(*w));
	struct src s = { .rng = seed | 1 };
	struct uvm_pt_pack_facts f;
	pthread_t reader;
	long reads = 0, total = 0;
	int i, j;

	mt_mode = true;
	for (i = 0; i < stress_ntrees; i++) {
		static const int tiers[] = { UVM_PT_PACK_TIER_4K_ALL, UVM_PT_PACK_TIER_256, UVM_PT_PACK_TIER_LEAF };

		f = good_facts(tiers[i % 3]);
		tree_init(i, &f);
	}
	pthread_create(&reader, NULL, reader_main, &reads);
	for (i = 0; i < nthreads; i++) {
		w[i].seed = src_u32(&s) | ((u64)src_u32(&s) << 32) | 1;
		w[i].ops = ops / nthreads;
		w[i].tabs = calloc(WORKER_MAX, sizeof(struct table));
		pthread_create(&w[i].th, NULL, worker_main, &w[i]);
	}
	for (i = 0; i < nthreads; i++) {
		pthread_join(w[i].th, NULL);
		total += w[i].ops;
	}
	__atomic_store_n(&stress_stop, 1, __ATOMIC_RELEASE);
	pthread_join(reader, NULL);
	/* quiescent: the model must match the pools exactly */
	mt_mode = false;
	for (i = 0; i < nthreads; i++)
		for (j = 0; j < w[i].n; j++)
			live[nlive++] = w[i].tabs[j];
	check_counters();
	for (i = 0; i < stress_ntrees; i++)
		engine_tree_deinit(i);
	check_counters();
	CHECK(bp_n == 0 && shim_pages_live == 0 && n_gets == n_puts, "leak", "pages left");
	CHECK(shim_warn_count == 0, "warning", "%ld kernel warnings", shim_warn_count);
	ops_done += total;
	printf("stress: page_size=%lu threads=%d ops=%ld stats_reads=%ld backing_gets=%ld\n",
	       PAGE_SIZE, nthreads, total, reads, n_gets);
	for (i = 0; i < nthreads; i++)
		free(w[i].tabs);
	free(w);
}

/* ------------------------------------------------------------------ unit */

static void unit_predicate(void)
{
	struct uvm_pt_pack_facts f;
	unsigned long ps = PAGE_SIZE;

#define EXPECT_REASON(mod, want) do { \
	f = good_facts(UVM_PT_PACK_TIER_4K_ALL); mod; \
	CHECK(uvm_pt_pack_check(&f) == (want), "predicate", "%s: got %s want %s", #mod, \
	      uvm_pt_pack_reason_str(uvm_pt_pack_check(&f)), uvm_pt_pack_reason_str(want)); \
} while (0)
	EXPECT_REASON((void)0, ps > 4096 ? UVM_PT_PACK_OK : UVM_PT_PACK_R_PAGE_SIZE);
	EXPECT_REASON(f.tier = UVM_PT_PACK_TIER_256, UVM_PT_PACK_OK);
	EXPECT_REASON(f.tier = UVM_PT_PACK_TIER_OFF, UVM_PT_PACK_R_DISABLED);
	EXPECT_REASON(f.tier = 4, UVM_PT_PACK_R_BAD_TIER);
	EXPECT_REASON(f.tier = UVM_PT_PACK_TIER_LEAF, ps > 4096 ? UVM_PT_PACK_OK : UVM_PT_PACK_R_PAGE_SIZE);
	EXPECT_REASON((f.tier = UVM_PT_PACK_TIER_LEAF, f.user_tree = false), UVM_PT_PACK_R_KERNEL_TREE);
	EXPECT_REASON((f.tier = UVM_PT_PACK_TIER_LEAF, f.integrated = 0), UVM_PT_PACK_R_NOT_INTEGRATED);
	EXPECT_REASON((f.tier = UVM_PT_PACK_TIER_LEAF, f.has_pci_dev = false), UVM_PT_PACK_R_NO_PCI_DEV);
	/* 4k-all and 256 pack the kernel tree too */
	EXPECT_REASON((f.tier = 2, f.user_tree = false), UVM_PT_PACK_OK);
	EXPECT_REASON(f.user_tree = false, ps > 4096 ? UVM_PT_PACK_OK : UVM_PT_PACK_R_PAGE_SIZE);
	EXPECT_REASON(f.tier = -1, UVM_PT_PACK_R_BAD_TIER);
	EXPECT_REASON((f.tier = 2, f.has_pci_dev = false), UVM_PT_PACK_R_NO_PCI_DEV);
	EXPECT_REASON((f.tier = 2, f.no_vidmem = false), UVM_PT_PACK_R_HAS_VIDMEM);
	EXPECT_REASON((f.tier = 2, f.integrated = 0), UVM_PT_PACK_R_NOT_INTEGRATED);
	/* a branch that cannot tell an integrated GPU from a discrete one without a framebuffer */
	EXPECT_REASON((f.tier = 2, f.integrated = -1), UVM_PT_PACK_R_INTEGRATED_UNKNOWN);
	EXPECT_REASON((f.tier = UVM_PT_PACK_TIER_LEAF, f.integrated = -1), UVM_PT_PACK_R_INTEGRATED_UNKNOWN);
	EXPECT_REASON((f.tier = 2, f.sysmem_tree = false), UVM_PT_PACK_R_NOT_SYSMEM);
	EXPECT_REASON((f.tier = 2, f.dma_coherent = false), UVM_PT_PACK_R_NOT_COHERENT);
	EXPECT_REASON((f.tier = 2, f.page_size = 2 * PAGE_SIZE), UVM_PT_PACK_R_PAGE_SIZE);
	/* the first failing condition is the one reported */
	EXPECT_REASON((f.has_pci_dev = false, f.dma_coherent = false), UVM_PT_PACK_R_NO_PCI_DEV);
#undef EXPECT_REASON
	CHECK(!strcmp(uvm_pt_pack_reason_str(UVM_PT_PACK_OK), "none"), "predicate", "token");
	CHECK(!strcmp(uvm_pt_pack_reason_str(UVM_PT_PACK_R_NOT_COHERENT), "not_coherent"), "predicate", "token");
	CHECK(!strcmp(uvm_pt_pack_reason_str(99), "unknown"), "predicate", "token");
	CHECK(!strcmp(uvm_pt_pack_reason_str(UVM_PT_PACK_R_KERNEL_TREE), "kernel_tree"), "predicate", "token");
	CHECK(!strcmp(uvm_pt_pack_reason_str(UVM_PT_PACK_R_INTEGRATED_UNKNOWN), "integrated_unknown"), "predicate",
	      "token");
}

static void unit_params(void)
{
	char buf[8192];
	long long v[NKEYS];
	char tier[64], reason[64];

	CHECK(shim_modinfo("spark_memsaver") && !strcmp(shim_modinfo("spark_memsaver"), "uvm-pt-pack/1"),
	      "modinfo", "spark_memsaver tag");
	CHECK(shim_param_perm("uvm_pt_pack") == 0444, "params", "uvm_pt_pack perm %o", shim_param_perm("uvm_pt_pack"));
	CHECK(shim_param_perm("uvm_pt_pack_stats") == 0444, "params", "stats perm");
	CHECK(shim_param_get("uvm_pt_pack", buf, sizeof(buf)) > 0, "params", "get");
	CHECK(atoi(buf) == UVM_PT_PACK_DEFAULT_EXPECT, "params", "default tier %s", buf);
	{
		long e0 = shim_pr_err_count;

		shim_warn_quiet = 1;
		/* a value for the read-only counters is logged and ignored: the module still loads */
		CHECK(shim_param_set("uvm_pt_pack_stats", "1") == 0, "params", "uvm_pt_pack_stats=1 fails the load");
		shim_warn_quiet = 0;
		CHECK(shim_pr_err_count - e0 == 1, "params", "uvm_pt_pack_stats=1 not logged");
	}

	shim_param_set("uvm_pt_pack", "2");
	CHECK(uvm_pt_pack_requested_tier() == UVM_PT_PACK_TIER_256, "params", "tier 2");
	read_stats(v, tier, reason);
	CHECK(!strcmp(tier, "256"), "counters", "tier %s", tier);
	shim_param_set("uvm_pt_pack", "0");
	read_stats(v, tier, reason);
	CHECK(!strcmp(tier, "off"), "counters", "tier %s", tier);
	/* packing off by configuration: the reason says so, before and after a tree (never "none") */
	CHECK(!strcmp(reason, "disabled"), "counters", "unpacked_reason %s after uvm_pt_pack=0, want disabled", reason);
	{
		struct uvm_pt_pack_facts f = good_facts(uvm_pt_pack_requested_tier());
		struct uvm_pt_pack_pool off;

		CHECK(uvm_pt_pack_tree_init(&off, &f, &ops, NULL) == UVM_PT_PACK_R_DISABLED, "predicate", "tier 0 tree");
		read_stats(v, tier, reason);
		CHECK(!strcmp(reason, "disabled") && v[3] == 0 && v[4] == 0, "counters",
		      "after a tier-0 tree: unpacked_reason %s, trees %lld/%lld", reason, v[3], v[4]);
		uvm_pt_pack_tree_deinit(&off, true);
	}
	CHECK(shim_param_set("uvm_pt_pack", "3") == 0, "params", "tier 3 refused");
	CHECK(uvm_pt_pack_requested_tier() == UVM_PT_PACK_TIER_LEAF, "params", "tier 3");
	read_stats(v, tier, reason);
	CHECK(!strcmp(tier, "leaf"), "counters", "tier %s", tier);
	/* names, as the description and the stats print them, and numbers */
	{
		static const struct { const char *val; int tier; } good[] = {
			{ "off", 0 }, { "4k-all", 1 }, { "256", 2 }, { "leaf", 3 }, { "leaf\n", 3 },
			{ "0", 0 }, { "1", 1 }, { "2", 2 }, { "3", 3 }, { "0x3", 3 },
		};
		unsigned int k;
		long e0 = shim_pr_err_count;

		for (k = 0; k < sizeof(good) / sizeof(good[0]); k++) {
			CHECK(shim_param_set("uvm_pt_pack", good[k].val) == 0, "params", "'%s' refused", good[k].val);
			CHECK(uvm_pt_pack_requested_tier() == good[k].tier, "params", "'%s' is tier %d, want %d",
			      good[k].val, uvm_pt_pack_requested_tier(), good[k].tier);
		}
		CHECK(shim_pr_err_count == e0, "params", "a valid value was logged");
	}
	/* anything else: logged, packing off, and the load goes on (a typo must not take CUDA out) */
	{
		static const char *const bad[] = { "9", "4", "-1", "7", "abc", "1x", "", "LEAF", "4k", "leaf2" };
		unsigned int k;
		long e0 = shim_pr_err_count;

		shim_warn_quiet = 1;
		for (k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
			shim_param_set("uvm_pt_pack", "3");
			CHECK(shim_param_set("uvm_pt_pack", bad[k]) == 0, "params", "'%s' fails the load", bad[k]);
			CHECK(uvm_pt_pack_requested_tier() == UVM_PT_PACK_TIER_OFF, "params",
			      "'%s' did not turn packing off", bad[k]);
			read_stats(v, tier, reason);
			CHECK(!strcmp(tier, "off"), "counters", "tier %s after '%s'", tier, bad[k]);
		}
		shim_warn_quiet = 0;
		CHECK(shim_pr_err_count - e0 == (long)k, "params", "%ld log lines for %u invalid values",
		      shim_pr_err_count - e0, k);
		shim_param_set("uvm_pt_pack", "3");
	}
	shim_param_set("uvm_pt_pack", "1");
	read_stats(v, tier, reason);
	CHECK(!strcmp(tier, "4k-all") && !strcmp(reason, "none"), "counters", "tier %s reason %s", tier, reason);
	check_counters();
}

static void unit_zeroed_pool(void)
{
	struct uvm_pt_pack_pool pool;
	struct page *pg = NULL;
	u64 a = 0;
	u32 tag = 0;

	memset(&pool, 0, sizeof(pool));
	CHECK(!uvm_pt_pack_active(&pool), "zeroed pool", "active");
	CHECK(uvm_pt_pack_alloc(&pool, 5, 256, &pg, &a, &tag) == UVM_PT_PACK_NOT_PACKED, "zeroed pool", "alloc");
	pg = alloc_page(GFP_KERNEL);
	CHECK(!uvm_pt_pack_free(&pool, pg, 0, 256, 0), "zeroed pool", "free");
	__free_page(pg);
	CHECK(uvm_pt_pack_pool_empty(&pool), "zeroed pool", "empty");
	uvm_pt_pack_tree_deinit(&pool, true);
}

/* Fill one backing page exactly, spill into a second, drain: check get/put counts. */
static void unit_fill_drain(int tier, u32 size)
{
	struct uvm_pt_pack_facts f = good_facts(tier);
	struct tree *t = &trees[0];
	unsigned int per, i;
	long g0 = n_gets, p0 = n_puts;

	tree_init(0, &f);
	if (!uvm_pt_pack_active(&t->pool) || !expect_packed(t, 5, size)) {
		engine_tree_deinit(0);
		return;
	}
	per = PAGE_SIZE / expect_align(tier, size);
	CHECK(t->pool.cls[size_cls(size)].slots_per_page == per, "geometry", "slots per page");
	for (i = 0; i < per + 1; i++) {
		struct table tb;

		CHECK(do_alloc(t, 5, size, &tb) == 0, "api", "alloc failed");
		live[nlive++] = tb;
		CHECK(n_gets - g0 == (i < per ? 1 : 2), "density", "table %u of %u needed %ld pages",
		      i + 1, per, n_gets - g0);
	}
	check_counters();
	/* free the spill table: its page goes; then the rest, last one releases */
	do_free(t, &live[nlive - 1]);
	nlive--;
	CHECK(n_puts - p0 == 1, "empty page held", "spill page kept");
	/* reuse: free table 0, scribbled by do_free; the next alloc takes the same slot */
	{
		u64 addr0 = live[0].addr;
		struct table tb;

		do_free(t, &live[0]);
		live_remove(0);
		CHECK(do_alloc(t, 5, size, &tb) == 0, "api", "alloc");
		CHECK(tb.addr == addr0, "reuse", "freed slot not reused first");
		live[nlive++] = tb;
	}
	check_counters();
	engine_tree_deinit(0);
	CHECK(n_puts - p0 == 2 && n_gets - g0 == 2, "leak", "get/put %ld/%ld", n_gets - g0, n_puts - p0);
	check_counters();
}

static void unit_routing(void)
{
	struct uvm_pt_pack_facts f = good_facts(UVM_PT_PACK_TIER_256);
	struct tree *t = &trees[0];
	static const u32 sizes[] = { 16, 256, 512, 4096 };
	unsigned int d, k;
	struct table tb;

	tree_init(0, &f);
	for (d = 0; d <= 5; d++)
		for (k = 0; k < 4; k++) {
			CHECK(do_alloc(t, d, sizes[k], &tb) == 0, "api", "alloc");   /* routing checked inside */
			live[nlive++] = tb;
		}
	check_counters();
	engine_tree_deinit(0);
}

static void unit_get_failure(void)
{
	struct uvm_pt_pack_facts f = good_facts(UVM_PT_PACK_TIER_256);
	struct tree *t = &trees[0];
	struct table tb;
	long g0 = n_gets;

	tree_init(0, &f);
	get_fail_next = 1;
	CHECK(do_alloc(t, 5, 256, &tb) == -ENOMEM, "api", "get failure not reported");
	CHECK(n_gets == g0 && bp_n == 0, "leak", "state changed on failure");
	check_counters();
	CHECK(do_alloc(t, 5, 256, &tb) == 0, "api", "alloc after failure");
	live[nlive++] = tb;
	get_fail_next = 1;
	/* a free slot exists: no get() needed, so the failure is not seen */
	CHECK(do_alloc(t, 5, 256, &tb) == 0, "api", "alloc from partial page");
	live[nlive++] = tb;
	get_fail_next = 0;
	check_counters();
	engine_tree_deinit(0);
}

static void unit_misaligned_base(void)
{
	struct uvm_pt_pack_facts f = good_facts(UVM_PT_PACK_TIER_4K_ALL);
	struct tree *t = &trees[0];
	struct table tb;
	long w0 = shim_warn_count;
	unsigned int i, per = PAGE_SIZE / 4096;

	if (per < 2)
		return;
	base_misalign = 512;
	shim_warn_quiet = 1;
	tree_init(0, &f);
	/* one slot is lost to alignment; every table must still be 4 KiB aligned */
	for (i = 0; i < per - 1; i++) {
		CHECK(do_alloc(t, 2, 4096, &tb) == 0, "api", "alloc");
		live[nlive++] = tb;
	}
		CHECK(bp_n == 1, "density", "misaligned page should hold %u tables", per - 1);
	CHECK(do_alloc(t, 2, 4096, &tb) == 0, "api", "alloc");
	live[nlive++] = tb;
	CHECK(bp_n == 2, "density", "spill");
	engine_tree_deinit(0);
	CHECK(shim_warn_count > w0, "warning", "misaligned base not warned about");
	shim_warn_count = w0;
	shim_warn_quiet = 0;
	base_misalign = 0;
	check_counters();
}

static void unit_bad_frees(void)
{
	struct uvm_pt_pack_facts f = good_facts(UVM_PT_PACK_TIER_256);
	struct table a, b;
	long w0 = shim_warn_count;

	tree_init(0, &f);
	tree_init(1, &f);
	CHECK(do_alloc(&trees[0], 5, 256, &a) == 0 && do_alloc(&trees[0], 5, 256, &b) == 0, "api", "alloc");
	shim_warn_quiet = 1;
	pthread_mutex_lock(&trees[0].lock);
	/* b is live: free a copy of it with the wrong size, a wrong address, via the wrong pool */
	CHECK(uvm_pt_pack_free(&trees[0].pool, b.page, b.addr, 4096, b.tag), "bad free", "wrong size");
	CHECK(uvm_pt_pack_free(&trees[0].pool, b.page, b.addr + 8, 256, b.tag), "bad free", "odd address");
	CHECK(uvm_pt_pack_free(&trees[0].pool, b.page, b.addr + 2 * PAGE_SIZE, 256, b.tag), "bad free",
	      "far address");
	/* a tagged table is a pool's: another pool refuses it, never hands it to NVIDIA's path */
	CHECK(uvm_pt_pack_free(&trees[1].pool, b.page, b.addr, 256, b.tag), "bad free", "wrong pool");
	/* an untagged table in a pool page, a wrong tag */
	CHECK(uvm_pt_pack_free(&trees[0].pool, b.page, b.addr, 256, 0), "bad free", "untagged");
	CHECK(uvm_pt_pack_free(&trees[0].pool, b.page, b.addr, 256, b.tag + 1000), "bad free", "wrong tag");
	pthread_mutex_unlock(&trees[0].lock);
	bad_frees_model += 6;
	CHECK(shim_warn_count - w0 == 6, "warning", "%ld warnings for 6 bad frees", shim_warn_count - w0);
	/* the slot survived all of that */
	live[nlive++] = a;
	live[nlive++] = b;
	check_counters();
	/* double free: the second is caught, nothing released twice */
	do_free(&trees[0], &live[0]);
	pthread_mutex_lock(&trees[0].lock);
	CHECK(uvm_pt_pack_free(&trees[0].pool, a.page, a.addr, 256, a.tag), "bad free", "double free");
	pthread_mutex_unlock(&trees[0].lock);
	bad_frees_model++;
	CHECK(shim_warn_count - w0 == 7, "warning", "double free not warned about");
	live_remove(0);
	check_counters();
	shim_warn_quiet = 0;
	shim_warn_count = w0;
	engine_tree_deinit(0);
	engine_tree_deinit(1);
	check_counters();
}

static void unit_unpacked_counters(void)
{
	struct uvm_pt_pack_facts f = good_facts(UVM_PT_PACK_TIER_4K_ALL);

	f.dma_coherent = false;
	engine_tree_init(0, &f);
	f = good_facts(UVM_PT_PACK_TIER_OFF);
	engine_tree_init(1, &f);
	f = good_facts(UVM_PT_PACK_TIER_LEAF);
	f.user_tree = false;
	engine_tree_init(2, &f);
	/* trees_unpacked 1 (disabled trees and, under leaf, the kernel tree are not counted) */
	check_counters();
	CHECK(!uvm_pt_pack_active(&trees[2].pool), "predicate", "leaf packs the kernel tree");
	engine_tree_deinit(0);
	engine_tree_deinit(1);
	engine_tree_deinit(2);
	check_counters();
}

/* deinit of a non-empty pool must WARN (run on its own: it leaves the counters dirty) */
static int run_deinit_warn(void)
{
	struct uvm_pt_pack_facts f = good_facts(UVM_PT_PACK_TIER_256);
	struct table tb;
	long w0 = shim_warn_count;

	shim_warn_quiet = 1;
	tree_init(0, &f);
	CHECK(do_alloc(&trees[0], 5, 256, &tb) == 0, "api", "alloc");
	CHECK(!uvm_pt_pack_pool_empty(&trees[0].pool), "pool not empty", "empty() with a live table");
	uvm_pt_pack_tree_deinit(&trees[0].pool, true);
	CHECK(shim_warn_count == w0 + 1, "warning", "deinit of a non-empty pool did not warn");
	CHECK(shim_kmemleak_not_leak_count == 1, "leak", "leaked descriptor not marked for kmemleak");
	nlive = 0;
	bp_n = 0;
	pages_live_model = 0;
	leaked_tables_model = 1;
	leaked_pages_model = 1;
	trees[0].used = false;
	check_counters();   /* live counters back to 0, the leak reported as such */
	/* the pool leaks by design; still reachable for LeakSanitizer through the harness's bpage registry */
	printf("deinit-warn: ok\n");
	return 0;
}

/*
 * After a UVM fatal error put_ptes_async() leaves tables in place; the hook
 * passes expect_empty = false (global status not OK). Then: no WARN (no taint,
 * no panic_on_warn), one rate-limited log line per tree, pages leaked (never
 * put), the trees_packed counter balanced. Run on its own: it leaves the
 * table/page counters dirty, as the leaked memory really is still held.
 */
static int run_fatal_teardown(void)
{
	/* leaf packs nothing at 4 KiB pages; the 256 tier does */
	struct uvm_pt_pack_facts f = good_facts(PAGE_SIZE >= 2 * 4096 ? UVM_PT_PACK_TIER_LEAF : UVM_PT_PACK_TIER_256);
	struct table tb[3];
	long w0 = shim_warn_count, r0 = shim_pr_warn_rl_count, p0;
	long long v[NKEYS];
	char tier[64], reason[64];
	int i, k;

	shim_warn_quiet = 1;
	for (i = 0; i < 2; i++) {
		tree_init(i, &f);
		for (k = 0; k < 3; k++)
			CHECK(do_alloc(&trees[i], 5, 256, &tb[k]) == 0, "api", "alloc");
	}
	p0 = n_puts;
	for (i = 0; i < 2; i++) {
		pthread_mutex_lock(&trees[i].lock);
		uvm_pt_pack_tree_deinit(&trees[i].pool, false);
		pthread_mutex_unlock(&trees[i].lock);
	}
	CHECK(shim_warn_count == w0, "warning", "fatal-path teardown WARNed (%ld)", shim_warn_count - w0);
	CHECK(shim_pr_warn_rl_count - r0 == 2, "log", "%ld rate-limited lines for 2 trees",
	      shim_pr_warn_rl_count - r0);
	CHECK(n_puts == p0, "released in use", "a page was put while the GPU may walk it");
	CHECK(shim_kmemleak_not_leak_count == 2, "leak", "leaked descriptors not marked for kmemleak");
	read_stats(v, tier, reason);
	CHECK(v[3] == 0, "counters", "trees_packed %lld after teardown", v[3]);
	CHECK(v[6] == 0 && v[7] == 0 && v[11] == 0 && v[16] == 0 && v[18] == 0, "counters",
	      "live c256 tables/pages %lld/%lld after teardown, want 0/0 (leaked ones are reported apart)", v[6], v[7]);
	CHECK(v[19] == 6 && v[20] == 2 && v[21] == 2 * (long long)PAGE_SIZE, "counters",
	      "leaked tables/pages %lld/%lld, want 6/2", v[19], v[20]);
	/* leaked by design; still reachable through trees[].pool for LeakSanitizer */
	shim_warn_quiet = 0;
	printf("fatal-teardown: ok\n");
	return 0;
}

/*
 * NVIDIA owns page->private of the pages it allocates. Plant stray values
 * (a wild pointer, a freed descriptor-sized block) in pages of NVIDIA's path
 * and in a live backing page: frees must route exactly as before. Under ASan
 * any read through such a value faults.
 */
static void unit_stray_private(void)
{
	struct uvm_pt_pack_facts f = good_facts(UVM_PT_PACK_TIER_256);
	struct tree *t = &trees[0];
	struct table a, b, n;
	void *freed = malloc(256);
	unsigned long freed_addr = (unsigned long)(uintptr_t)freed;   /* a dangling pointer value */

	free(freed);
	tree_init(0, &f);
	CHECK(do_alloc(t, 5, 256, &a) == 0 && a.packed, "api", "alloc");
	CHECK(shim_last_kzalloc_gfp == (GFP_KERNEL | __GFP_NOMEMALLOC | __GFP_ACCOUNT), "gfp",
	      "descriptor allocated with gfp %#x", shim_last_kzalloc_gfp);
	CHECK(shim_last_kzalloc_memcg == t->idx + 100, "memcg", "descriptor charged to memcg %d, the page to %d",
	      shim_last_kzalloc_memcg, t->idx + 100);
	CHECK(do_alloc(t, 5, 256, &b) == 0, "api", "alloc");
	CHECK(do_alloc(t, 0, 4096, &n) == 0 && !n.packed, "api", "root");
	set_page_private(n.page, freed_addr);
	set_page_private(a.page, 0xdead000000000100ul);
	a.bp->planted = 0xdead000000000100ul;
	live[nlive++] = a;
	live[nlive++] = b;
	live[nlive++] = n;
	check_counters();
	engine_tree_deinit(0);   /* frees all three: routing checked in do_free */
	check_counters();
}


/*
 * Recycle mode: put() keeps the page it was given and the next get() hands it
 * back with the same DMA address, as the buddy allocator (LIFO per-cpu lists)
 * and the IOVA cache do. A free the pool cannot match to a live table of its
 * own must WARN exactly once, never reach NVIDIA's __free_pages (the pool
 * returns true) and leave every live table, and the counters, intact.
 */
static void bad_free_expect(struct tree *t, const struct table *tb, const char *what)
{
	long w0 = shim_warn_count, p0 = n_puts;
	bool kept;

	shim_warn_quiet = 1;
	pthread_mutex_lock(&t->lock);
	kept = uvm_pt_pack_free(&t->pool, tb->page, tb->addr, tb->size, tb->tag);
	pthread_mutex_unlock(&t->lock);
	shim_warn_quiet = 0;
	CHECK(kept, "bad free", "%s: handed to NVIDIA's path (__free_pages of a pool page)", what);
	CHECK(shim_warn_count - w0 == 1, "bad free", "%s: %ld warnings, want 1", what, shim_warn_count - w0);
	CHECK(n_puts == p0, "bad free", "%s: a backing page was put", what);
	bad_frees_model++;
	shim_warn_count = w0;
}

static int run_recycle(void)
{
	struct uvm_pt_pack_facts f = good_facts(UVM_PT_PACK_TIER_256);
	struct table a, b, c, stale;
	int i;

	recycle = true;
	tree_init(0, &f);
	tree_init(1, &f);

	/* 1. double free of a table whose page went back (not reused yet) */
	CHECK(do_alloc(&trees[0], 5, 256, &a) == 0 && a.packed, "api", "alloc");
	stale = a;
	do_free(&trees[0], &a);                    /* last table: the page is put (kept by "the allocator") */
	CHECK(recycled_page == stale.page, "harness", "page not recycled");
	bad_free_expect(&trees[0], &stale, "double free after the page was released");
	check_counters();

	/* 2. the page comes back to the same pool at the same address: a stale free must not hit b */
	CHECK(do_alloc(&trees[0], 5, 256, &b) == 0 && b.packed, "api", "alloc");
	CHECK(b.page == stale.page && b.addr == stale.addr, "harness", "recycled page/address not reused");
	live[nlive++] = b;
	bad_free_expect(&trees[0], &stale, "stale free into a recycled page of the same pool");
	table_verify(&live[0]);
	check_counters();

	/* 3. freed again, the page comes back to another pool: stale and wrong-pool frees */
	do_free(&trees[0], &live[0]);
	nlive = 0;
	CHECK(do_alloc(&trees[1], 5, 256, &c) == 0 && c.page == stale.page && c.addr == stale.addr, "harness",
	      "not recycled into pool 1");
	live[nlive++] = c;
	bad_free_expect(&trees[0], &stale, "stale free, page now in another pool");
	bad_free_expect(&trees[1], &stale, "stale free through the pool now holding the page");
	bad_free_expect(&trees[0], &live[0], "wrong-pool free of a live table");
	/* 4. NVIDIA's own (untagged) table whose page was recycled into a pool */
	stale.tag = 0;
	bad_free_expect(&trees[1], &stale, "untagged free of a pool page");
	table_verify(&live[0]);
	check_counters();

	/* 5. a full page recycled while other slots stay live */
	for (i = 0; i < 3; i++) {
		CHECK(do_alloc(&trees[1], 5, 256, &a) == 0, "api", "alloc");
		live[nlive++] = a;
	}
	stale = live[1];
	do_free(&trees[1], &live[1]);
	live[1] = live[--nlive];
	CHECK(do_alloc(&trees[1], 5, 256, &a) == 0 && a.addr == stale.addr, "harness", "slot not reused");
	live[nlive++] = a;
	bad_free_expect(&trees[1], &stale, "stale free of a reused slot");
	for (i = 0; i < nlive; i++)
		table_verify(&live[i]);
	check_counters();

	engine_tree_deinit(0);
	engine_tree_deinit(1);
	check_counters();
	recycle = false;
	if (recycled_page) {
		recycled_page->harness = NULL;
		__free_page(recycled_page);
		recycled_page = NULL;
	}
	CHECK(shim_pages_live == 0 && bp_n == 0, "leak", "pages left");
	printf("recycle: page_size=%lu bad_frees=%lld ok\n", PAGE_SIZE, bad_frees_model);
	return 0;
}

/*
 * The descriptor is charged where the page is: for a user tree in the memcg
 * of the va_space's mm with __GFP_ACCOUNT (charged_cb stands in for the hook's
 * set_active_memcg context), for the kernel tree not at all.
 */
static void unit_memcg(void)
{
	struct uvm_pt_pack_facts f = good_facts(UVM_PT_PACK_TIER_256);
	struct table tb;

	shim_active_memcg = 7;   /* the faulting task's memcg: must not be charged */
	tree_init(0, &f);
	CHECK(do_alloc(&trees[0], 5, 256, &tb) == 0 && tb.packed, "api", "alloc");
	live[nlive++] = tb;
	CHECK((shim_last_kzalloc_gfp & __GFP_ACCOUNT) && shim_last_kzalloc_memcg == 100, "memcg",
	      "user tree: descriptor gfp %#x charged to memcg %d, want __GFP_ACCOUNT in memcg 100",
	      shim_last_kzalloc_gfp, shim_last_kzalloc_memcg);
	f.user_tree = false;
	tree_init(1, &f);
	CHECK(do_alloc(&trees[1], 5, 256, &tb) == 0 && tb.packed, "api", "alloc");
	live[nlive++] = tb;
	CHECK(!(shim_last_kzalloc_gfp & __GFP_ACCOUNT), "memcg", "kernel tree: descriptor charged (gfp %#x, memcg %d)",
	      shim_last_kzalloc_gfp, shim_last_kzalloc_memcg);
	shim_active_memcg = 0;
	engine_tree_deinit(0);
	engine_tree_deinit(1);
	check_counters();
}

/*
 * No memory to record a fresh page: the table gets the whole page with tag 0
 * and NVIDIA's path frees it (nothing put, nothing leaked).
 */
static void unit_whole_page(void)
{
	struct uvm_pt_pack_facts f = good_facts(UVM_PT_PACK_TIER_256);
	struct table tb;

	tree_init(0, &f);
	shim_xa_fail_next = 1;
	CHECK(do_alloc(&trees[0], 5, 256, &tb) == 0 && tb.whole && !tb.tag, "api", "no whole-page fallback");
	CHECK(shim_xa_fail_next == 0, "harness", "xarray insert not attempted");
	live[nlive++] = tb;
	CHECK(do_alloc(&trees[0], 5, 256, &tb) == 0 && tb.packed, "api", "alloc after the fallback");
	live[nlive++] = tb;
	check_counters();
	engine_tree_deinit(0);
	check_counters();
}

/*
 * The counters are read without a lock: a read between the two counter updates
 * of one free (tables, then pages) must show no negative figure. The shim calls
 * this hook after every atomic64 update of the pool.
 */
static long neg_reads;
static void read_between_updates(void)
{
	long long v[NKEYS];
	char tier[64], reason[64];

	read_stats(v, tier, reason);   /* fails on any negative value */
	neg_reads++;
}

static void unit_no_negative_read(void)
{
	struct uvm_pt_pack_facts f = good_facts(UVM_PT_PACK_TIER_256);
	struct table tb;
	int i;

	tree_init(0, &f);
	shim_atomic64_hook = read_between_updates;
	for (i = 0; i < 3; i++) {
		CHECK(do_alloc(&trees[0], 5, i == 2 ? 4096 : 256, &tb) == 0, "api", "alloc");
		live[nlive++] = tb;
	}
	engine_tree_deinit(0);
	shim_atomic64_hook = NULL;
	CHECK(neg_reads > 0, "harness", "hook never ran");
	check_counters();
}


static const char *unit_only;   /* "unit NAME": run that group only */
#define UNIT(call, name) do { if (!unit_only || !strcmp(unit_only, name)) call; } while (0)

static void run_unit(void)
{
	static const int tiers[] = { UVM_PT_PACK_TIER_4K_ALL, UVM_PT_PACK_TIER_256, UVM_PT_PACK_TIER_LEAF };
	static const u32 sizes[] = { 256, 4096 };
	int i, j;

	UNIT(unit_predicate(), "predicate");
	UNIT(unit_params(), "params");
	UNIT(unit_zeroed_pool(), "zeroed_pool");
	for (i = 0; i < 3; i++)
		for (j = 0; j < 2; j++)
			UNIT(unit_fill_drain(tiers[i], sizes[j]), "fill_drain");
	UNIT(unit_routing(), "routing");
	UNIT(unit_get_failure(), "get_failure");
	UNIT(unit_misaligned_base(), "misaligned_base");
	UNIT(unit_bad_frees(), "bad_frees");
	UNIT(unit_unpacked_counters(), "unpacked_counters");
	UNIT(unit_stray_private(), "stray_private");
	UNIT(unit_memcg(), "memcg");
	UNIT(unit_whole_page(), "whole_page");
	UNIT(unit_no_negative_read(), "no_negative_read");
	CHECK(shim_pages_live == 0 && bp_n == 0, "leak", "pages left");
	CHECK(shim_warn_count == 0, "warning", "%ld unexpected warnings", shim_warn_count);
	printf("unit: page_size=%lu ok\n", PAGE_SIZE);
}


#ifdef PT_LIBFUZZER
int LLVMFuzzerTestOneInput(const u8 *data, size_t len);
static void report_ops(void)
{
	fprintf(stderr, "fuzz-ops: page_size=%lu ops=%ld\n", PAGE_SIZE, ops_done);
}

int LLVMFuzzerTestOneInput(const u8 *data, size_t len)
{
	static bool once;
	struct src s = { .data = data, .len = len };

	if (!once) {
		once = true;
		atexit(report_ops);
	}
	engine_run(&s, 1L << 40);
	return 0;
}
#else
int main(int argc, char **argv)
{
	/* keep freed 64 KiB pages in the heap: no trim/mmap churn per backing page */
	mallopt(M_TRIM_THRESHOLD, 1 << 30);
	mallopt(M_MMAP_THRESHOLD, 1 << 30);
	mallopt(M_TOP_PAD, 64 << 20);
	if (argc >= 2 && !strcmp(argv[1], "unit")) {
		unit_only = argc >= 3 ? argv[2] : NULL;
		run_unit();
		return 0;
	}
	if (argc >= 2 && !strcmp(argv[1], "deinit-warn"))
		return run_deinit_warn();
	if (argc >= 2 && !strcmp(argv[1], "fatal-teardown"))
		return run_fatal_teardown();
	if (argc >= 2 && !strcmp(argv[1], "recycle"))
		return run_recycle();
	if (argc >= 4 && !strcmp(argv[1], "fuzz")) {
		long ops = atol(argv[2]);
		u64 seed = strtoull(argv[3], NULL, 0);
		long chunk = argc >= 5 ? atol(argv[4]) : 200000;
		long k = 0;

		/* chunks: each is a full run (trees up, random ops, all torn down) */
		while (ops_done < ops) {
			struct src s = { .rng = (seed + 0x9E3779B97F4A7C15ull * ++k) | 1 };

			engine_run(&s, ops - ops_done < chunk ? ops - ops_done : chunk);
		}
		printf("fuzz: page_size=%lu ops=%ld runs=%ld backing_gets=%ld seed=%llu\n", PAGE_SIZE,
		       ops_done, k, n_gets, (unsigned long long)seed);
		return 0;
	}
	if (argc >= 5 && !strcmp(argv[1], "stress")) {
		run_stress(atol(argv[2]), strtoull(argv[3], NULL, 0), atoi(argv[4]));
		return 0;
	}
	fprintf(stderr, "usage: %s unit [GROUP] | deinit-warn | fatal-teardown | recycle | fuzz OPS SEED [CHUNK] | stress OPS SEED THREADS\n", argv[0]);
	return 2;
}
#endif
