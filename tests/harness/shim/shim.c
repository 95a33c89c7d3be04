/* SPDX-License-Identifier: GPL-2.0-only OR MIT */
/* Userspace implementations behind shim.h (see there). */
#include "shim.h"
#include <errno.h>

long shim_warn_count;
long shim_pages_live;
int shim_warn_quiet;
long shim_pr_err_count, shim_pr_warn_rl_count, shim_kmemleak_not_leak_count;
unsigned int shim_last_kzalloc_gfp;
int shim_last_kzalloc_memcg;
void (*shim_atomic64_hook)(void);
__thread int shim_active_memcg;

void shim_log(long *counter, const char *fmt, ...)
{
	va_list ap;

	__atomic_add_fetch(counter, 1, __ATOMIC_RELAXED);
	if (shim_warn_quiet)
		return;
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
}

int kstrtoint(const char *s, unsigned int base, int *res)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, (int)base);
	if (end == s || errno || v < -2147483648L || v > 2147483647L)
		return -EINVAL;
	if (*end == '\n')
		end++;
	if (*end)
		return -EINVAL;
	*res = (int)v;
	return 0;
}

int param_get_int(char *buffer, const struct kernel_param *kp)
{
	return scnprintf(buffer, 4096, "%d\n", *(int *)kp->arg);
}

void shim_warn(const char *cond, const char *file, int line)
{
	__atomic_add_fetch(&shim_warn_count, 1, __ATOMIC_RELAXED);
	if (!shim_warn_quiet)
		fprintf(stderr, "WARNING: %s at %s:%d\n", cond, file, line);
}

void shim_bug(const char *cond, const char *file, int line)
{
	fprintf(stderr, "BUG: %s at %s:%d\n", cond, file, line);
	abort();
}

static unsigned long shim_next_pfn = 0x1000;

struct page *alloc_page(gfp_t gfp)
{
	struct page *p = calloc(1, sizeof(*p));

	if (!p)
		return NULL;
	p->pfn = __atomic_fetch_add(&shim_next_pfn, 1, __ATOMIC_RELAXED);
	p->virt = aligned_alloc(PAGE_SIZE, PAGE_SIZE);
	if (!p->virt) {
		free(p);
		return NULL;
	}
	if (gfp & __GFP_ZERO)
		memset(p->virt, 0, PAGE_SIZE);
	__atomic_add_fetch(&shim_pages_live, 1, __ATOMIC_RELAXED);
	return p;
}

void __free_page(struct page *p)
{
	__atomic_sub_fetch(&shim_pages_live, 1, __ATOMIC_RELAXED);
	free(p->virt);
	free(p);
}

int scnprintf(char *buf, size_t size, const char *fmt, ...)
{
	va_list ap;
	int n;

	if (size == 0)
		return 0;
	va_start(ap, fmt);
	n = vsnprintf(buf, size, fmt, ap);
	va_end(ap);
	if (n < 0)
		return 0;
	return (size_t)n >= size ? (int)(size - 1) : n;
}

#define SHIM_MAX_PARAMS 16
static struct kernel_param shim_params[SHIM_MAX_PARAMS];
static int shim_nparams;
static struct { const char *tag, *value; } shim_info[SHIM_MAX_PARAMS];
static int shim_ninfo;

void shim_register_param(const char *name, const struct kernel_param_ops *ops, void *arg,
			 int *intp, unsigned short perm)
{
	struct kernel_param *kp;

	if (shim_nparams == SHIM_MAX_PARAMS)
		abort();
	kp = &shim_params[shim_nparams++];
	kp->name = name;
	kp->ops = ops;
	kp->arg = arg;
	kp->intp = intp;
	kp->perm = perm;
}

void shim_register_modinfo(const char *tag, const char *value)
{
	if (shim_ninfo == SHIM_MAX_PARAMS)
		abort();
	shim_info[shim_ninfo].tag = tag;
	shim_info[shim_ninfo].value = value;
	shim_ninfo++;
}

static struct kernel_param *shim_find(const char *name)
{
	int i;

	for (i = 0; i < shim_nparams; i++)
		if (!strcmp(shim_params[i].name, name))
			return &shim_params[i];
	return NULL;
}

int shim_param_get(const char *name, char *buf, size_t len)
{
	struct kernel_param *kp = shim_find(name);
	char page[PAGE_SIZE > 4096 ? PAGE_SIZE : 4096];
	int n;

	if (!kp)
		return -ENOENT;
	if (kp->ops)
		n = kp->ops->get(page, kp);
	else
		n = snprintf(page, sizeof(page), "%d\n", *kp->intp);
	if (n < 0)
		return n;
	if ((size_t)n >= len)
		return -ENOSPC;
	memcpy(buf, page, n);
	buf[n] = 0;
	return n;
}

/* Load-time assignment, as "modprobe nvidia-uvm name=val" would do. */
int shim_param_set(const char *name, const char *val)
{
	struct kernel_param *kp = shim_find(name);

	if (!kp)
		return -ENOENT;
	if (kp->ops)
		return kp->ops->set ? kp->ops->set(val, kp) : -EPERM;
	*kp->intp = atoi(val);
	return 0;
}

int shim_param_perm(const char *name)
{
	struct kernel_param *kp = shim_find(name);

	return kp ? kp->perm : -ENOENT;
}

const char *shim_modinfo(const char *tag)
{
	int i;

	for (i = 0; i < shim_ninfo; i++)
		if (!strcmp(shim_info[i].tag, tag))
			return shim_info[i].value;
	return NULL;
}

int __sysfs_match_string(const char *const *array, size_t n, const char *str)
{
	size_t i, len;

	for (i = 0; i < n; i++) {
		if (!array[i])
			continue;
		len = strlen(array[i]);
		/* the kernel's sysfs_streq(): equal, or equal but for one trailing newline */
		if (!strncmp(array[i], str, len) && (str[len] == 0 || (str[len] == '\n' && str[len + 1] == 0)))
			return (int)i;
	}
	return -EINVAL;
}

/* ---- xarray stand-in (see shim.h) ---- */
int shim_xa_fail_next;
long shim_xa_live;
static pthread_mutex_t shim_xa_init_lock = PTHREAD_MUTEX_INITIALIZER;

static pthread_mutex_t *xa_lk(struct xarray *xa)
{
	pthread_mutex_t *l = __atomic_load_n(&xa->lock, __ATOMIC_ACQUIRE);

	if (l)
		return l;
	pthread_mutex_lock(&shim_xa_init_lock);
	if (!xa->lock) {
		l = malloc(sizeof(*l));
		if (!l)
			abort();
		pthread_mutex_init(l, NULL);
		__atomic_store_n(&xa->lock, l, __ATOMIC_RELEASE);
		__atomic_add_fetch(&shim_xa_live, 1, __ATOMIC_RELAXED);
	}
	pthread_mutex_unlock(&shim_xa_init_lock);
	return xa->lock;
}

void xa_init(struct xarray *xa)
{
	memset(xa, 0, sizeof(*xa));
}

/* first position with index >= i (caller holds the lock) */
static size_t xa_pos(struct xarray *xa, unsigned long i)
{
	size_t lo = 0, hi = xa->n;

	while (lo < hi) {
		size_t mid = (lo + hi) / 2;

		if (xa->index[mid] < i)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

void *xa_load(struct xarray *xa, unsigned long index)
{
	void *e = NULL;
	size_t k;

	pthread_mutex_lock(xa_lk(xa));
	k = xa_pos(xa, index);
	if (k < xa->n && xa->index[k] == index)
		e = xa->entry[k];
	pthread_mutex_unlock(xa->lock);
	return e;
}

int xa_insert(struct xarray *xa, unsigned long index, void *entry, gfp_t gfp)
{
	size_t k;
	int err = 0;

	(void)gfp;
	if (!entry)
		return -EINVAL;   /* the pool never stores NULL (xa_insert of NULL reserves) */
	pthread_mutex_lock(xa_lk(xa));
	k = xa_pos(xa, index);
	if (k < xa->n && xa->index[k] == index) {
		err = -EBUSY;
	} else if (__atomic_load_n(&shim_xa_fail_next, __ATOMIC_RELAXED) > 0) {
		__atomic_sub_fetch(&shim_xa_fail_next, 1, __ATOMIC_RELAXED);
		err = -ENOMEM;
	} else {
		if (xa->n == xa->cap) {
			size_t cap = xa->cap ? 2 * xa->cap : 16;
			unsigned long *ni = realloc(xa->index, cap * sizeof(*ni));
			void **ne;

			if (!ni)
				abort();
			xa->index = ni;
			ne = realloc(xa->entry, cap * sizeof(*ne));
			if (!ne)
				abort();
			xa->entry = ne;
			xa->cap = cap;
		}
		memmove(&xa->index[k + 1], &xa->index[k], (xa->n - k) * sizeof(*xa->index));
		memmove(&xa->entry[k + 1], &xa->entry[k], (xa->n - k) * sizeof(*xa->entry));
		xa->index[k] = index;
		xa->entry[k] = entry;
		xa->n++;
	}
	pthread_mutex_unlock(xa->lock);
	return err;
}

void *xa_erase(struct xarray *xa, unsigned long index)
{
	void *e = NULL;
	size_t k;

	pthread_mutex_lock(xa_lk(xa));
	k = xa_pos(xa, index);
	if (k < xa->n && xa->index[k] == index) {
		e = xa->entry[k];
		memmove(&xa->index[k], &xa->index[k + 1], (xa->n - k - 1) * sizeof(*xa->index));
		memmove(&xa->entry[k], &xa->entry[k + 1], (xa->n - k - 1) * sizeof(*xa->entry));
		xa->n--;
	}
	pthread_mutex_unlock(xa->lock);
	return e;
}

void *xa_find(struct xarray *xa, unsigned long *index, unsigned long max, int filter)
{
	void *e = NULL;
	size_t k;

	(void)filter;
	pthread_mutex_lock(xa_lk(xa));
	k = xa_pos(xa, *index);
	if (k < xa->n && xa->index[k] <= max) {
		*index = xa->index[k];
		e = xa->entry[k];
	}
	pthread_mutex_unlock(xa->lock);
	return e;
}

void *xa_find_after(struct xarray *xa, unsigned long *index, unsigned long max, int filter)
{
	unsigned long next = *index + 1;
	void *e;

	if (next == 0)
		return NULL;
	e = xa_find(xa, &next, max, filter);
	if (e)
		*index = next;
	return e;
}

void xa_destroy(struct xarray *xa)
{
	if (xa->lock) {
		pthread_mutex_destroy(xa->lock);
		free(xa->lock);
		__atomic_sub_fetch(&shim_xa_live, 1, __ATOMIC_RELAXED);
	}
	free(xa->index);
	free(xa->entry);
	memset(xa, 0, sizeof(*xa));
}

/* ---- uvm_lock.h stand-in: per-thread held orders, as UVM's lock tracking checks them ---- */
#include "uvm_lock.h"
long shim_uvm_lock_inits;
static __thread int shim_held_top;   /* highest order held by this thread, 0 = none */

void shim_uvm_record_lock(uvm_lock_order_t order)
{
	if (order == UVM_LOCK_ORDER_INVALID || (int)order <= shim_held_top) {
		fprintf(stderr, "BUG: lock order %d taken while holding order %d\n", order, shim_held_top);
		abort();
	}
	shim_held_top = (int)order;
}

void shim_uvm_record_unlock(uvm_lock_order_t order)
{
	if (shim_held_top != (int)order) {
		fprintf(stderr, "BUG: unlock of order %d, held %d\n", order, shim_held_top);
		abort();
	}
	shim_held_top = 0;
}

static const void **shim_not_leaks;
static size_t shim_n_not_leaks;

void kmemleak_not_leak(const void *p)
{
	static pthread_mutex_t l = PTHREAD_MUTEX_INITIALIZER;

	pthread_mutex_lock(&l);
	shim_not_leaks = realloc(shim_not_leaks, (shim_n_not_leaks + 1) * sizeof(*shim_not_leaks));
	if (!shim_not_leaks)
		abort();
	shim_not_leaks[shim_n_not_leaks++] = p;
	shim_kmemleak_not_leak_count++;
	pthread_mutex_unlock(&l);
}
