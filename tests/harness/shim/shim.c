/* SPDX-License-Identifier: GPL-2.0-only OR MIT */
/* Userspace implementations behind shim.h (see there). */
#include "shim.h"
#include <errno.h>

long shim_warn_count;
long shim_pages_live;
int shim_warn_quiet;
long shim_pr_err_count, shim_pr_warn_rl_count, shim_kmemleak_not_leak_count;
unsigned int shim_last_kzalloc_gfp;

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

struct page *alloc_page(gfp_t gfp)
{
	struct page *p = calloc(1, sizeof(*p));

	if (!p)
		return NULL;
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
