/* SPDX-License-Identifier: GPL-2.0-only OR MIT */
/*
 * Thin userspace stand-ins for the few Linux kernel APIs that
 * uvm_patch/src/uvm_pt_pack.c uses, so that file compiles UNCHANGED here
 * (style of tools/testing/memblock and radix-tree in the kernel tree).
 *
 * PAGE_SIZE is fixed per build: -DSHIM_PAGE_SHIFT=12|14|16 (4/16/64 KiB).
 * Spinlocks are pthread mutexes (so TSan sees them); WARN_ON counts and logs;
 * BUG_ON aborts; module_param*() register into a registry that the harness
 * reads back through shim_param_get(), like sysfs would.
 */
#ifndef SHIM_H
#define SHIM_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>

#ifndef SHIM_PAGE_SHIFT
#define SHIM_PAGE_SHIFT 16
#endif
#define PAGE_SHIFT SHIM_PAGE_SHIFT
#define PAGE_SIZE (1UL << PAGE_SHIFT)

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;
typedef int64_t s64;
typedef unsigned int gfp_t;
#define GFP_KERNEL 0x1u
#define __GFP_ZERO 0x2u
#define __GFP_NOMEMALLOC 0x4u
#define __GFP_ACCOUNT 0x8u
extern unsigned int shim_last_kzalloc_gfp;   /* flags of the last kzalloc() */
/* the memory cgroup a __GFP_ACCOUNT allocation is charged to: set_active_memcg() (0 = the task's) */
extern __thread int shim_active_memcg;
extern int shim_last_kzalloc_memcg;          /* shim_active_memcg at the last kzalloc() */

#define READ_ONCE(x) (*(const volatile __typeof__(x) *)&(x))
#define WRITE_ONCE(x, v) (*(volatile __typeof__(x) *)&(x) = (v))

/* ---- WARN/BUG ---- */
extern long shim_warn_count;
void shim_warn(const char *cond, const char *file, int line);
void shim_bug(const char *cond, const char *file, int line) __attribute__((noreturn));
#define WARN_ON(c) ({ int __c = !!(c); if (__c) shim_warn(#c, __FILE__, __LINE__); __c; })
#define WARN_ON_ONCE(c) WARN_ON(c)
#define BUG_ON(c) do { if (c) shim_bug(#c, __FILE__, __LINE__); } while (0)
#define WARN(c, ...) ({ int __c = !!(c); if (__c) { shim_warn(#c, __FILE__, __LINE__); \
	if (!shim_warn_quiet) fprintf(stderr, __VA_ARGS__); } __c; })
/* the _ONCE forms count every hit (the harness checks each bad free; the kernel prints the first only) */
#define WARN_ONCE(c, ...) WARN(c, __VA_ARGS__)

/* ---- printk: counted per level; the ratelimited variant counts as its own level ---- */
extern int shim_warn_quiet;
extern long shim_pr_err_count, shim_pr_warn_rl_count;
void shim_log(long *counter, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define pr_err(...) shim_log(&shim_pr_err_count, __VA_ARGS__)
#define pr_warn_ratelimited(...) shim_log(&shim_pr_warn_rl_count, __VA_ARGS__)

/* ---- kmemleak: counts the objects marked and, like kmemleak, keeps them known (LeakSanitizer: reachable) ---- */
extern long shim_kmemleak_not_leak_count;
void kmemleak_not_leak(const void *p);

/* ---- kstrtoint (strict: whole string, optional trailing newline) ---- */
int kstrtoint(const char *s, unsigned int base, int *res);

/* ---- lists ---- */
struct list_head { struct list_head *next, *prev; };
#define container_of(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))
static inline void INIT_LIST_HEAD(struct list_head *h) { h->next = h; h->prev = h; }
static inline void __list_add(struct list_head *n, struct list_head *p, struct list_head *nx)
{ nx->prev = n; n->next = nx; n->prev = p; p->next = n; }
static inline void list_add(struct list_head *n, struct list_head *h) { __list_add(n, h, h->next); }
static inline void list_add_tail(struct list_head *n, struct list_head *h) { __list_add(n, h->prev, h); }
static inline void __list_del(struct list_head *e) { e->next->prev = e->prev; e->prev->next = e->next; }
static inline void list_del(struct list_head *e) { __list_del(e); e->next = (void *)0x100; e->prev = (void *)0x122; }
static inline void list_move(struct list_head *e, struct list_head *h) { __list_del(e); list_add(e, h); }
static inline void list_move_tail(struct list_head *e, struct list_head *h) { __list_del(e); list_add_tail(e, h); }
static inline int list_empty(const struct list_head *h) { return READ_ONCE(h->next) == h; }
#define list_entry(p, t, m) container_of(p, t, m)
#define list_first_entry(h, t, m) list_entry((h)->next, t, m)

/* ---- spinlocks (pthread mutex) ---- */
typedef struct { pthread_mutex_t m; } spinlock_t;
#define spin_lock_init(l) pthread_mutex_init(&(l)->m, NULL)
#ifndef SHIM_BREAK_SPINLOCK
#define spin_lock(l) pthread_mutex_lock(&(l)->m)
#define spin_unlock(l) pthread_mutex_unlock(&(l)->m)
#else   /* self-check of the TSan stress: a pool without its lock must be caught */
#define spin_lock(l) ((void)(l))
#define spin_unlock(l) ((void)(l))
#endif

/* ---- atomics ---- */
typedef struct { int counter; } atomic_t;
typedef struct { long long counter; } atomic64_t;
#define atomic_read(a) __atomic_load_n(&(a)->counter, __ATOMIC_RELAXED)
#define atomic_set(a, v) __atomic_store_n(&(a)->counter, (v), __ATOMIC_RELAXED)
#define atomic_inc_return(a) __atomic_add_fetch(&(a)->counter, 1, __ATOMIC_RELAXED)
#define atomic64_read(a) __atomic_load_n(&(a)->counter, __ATOMIC_RELAXED)
#define atomic64_set(a, v) __atomic_store_n(&(a)->counter, (v), __ATOMIC_RELAXED)
/* every atomic64 update calls shim_atomic64_hook (when set) right after it: a reader between two updates */
extern void (*shim_atomic64_hook)(void);
#define SHIM_A64(expr) do { (void)(expr); if (shim_atomic64_hook) shim_atomic64_hook(); } while (0)
#define atomic64_inc(a) SHIM_A64(__atomic_add_fetch(&(a)->counter, 1, __ATOMIC_RELAXED))
#define atomic64_dec(a) SHIM_A64(__atomic_sub_fetch(&(a)->counter, 1, __ATOMIC_RELAXED))
#define atomic64_add(i, a) SHIM_A64(__atomic_add_fetch(&(a)->counter, (i), __ATOMIC_RELAXED))
#define atomic64_sub(i, a) SHIM_A64(__atomic_sub_fetch(&(a)->counter, (i), __ATOMIC_RELAXED))

/* ---- bitmaps (non-atomic variants, as in the kernel) ---- */
#define BITS_PER_LONG (8 * sizeof(long))
#define BITS_TO_LONGS(n) (((n) + BITS_PER_LONG - 1) / BITS_PER_LONG)
static inline void __set_bit(unsigned long nr, unsigned long *map)
{ map[nr / BITS_PER_LONG] |= 1UL << (nr % BITS_PER_LONG); }
static inline void __clear_bit(unsigned long nr, unsigned long *map)
{ map[nr / BITS_PER_LONG] &= ~(1UL << (nr % BITS_PER_LONG)); }
static inline int test_bit(unsigned long nr, const unsigned long *map)
{ return (map[nr / BITS_PER_LONG] >> (nr % BITS_PER_LONG)) & 1; }
static inline unsigned long find_first_zero_bit(const unsigned long *map, unsigned long size)
{
	unsigned long i;
	for (i = 0; i < size; i++)
		if (!test_bit(i, map))
			return i;
	return size;
}

/* ---- slab ---- */
static inline void *kzalloc(size_t n, gfp_t f)
{ __atomic_store_n(&shim_last_kzalloc_gfp, f, __ATOMIC_RELAXED);
  __atomic_store_n(&shim_last_kzalloc_memcg, shim_active_memcg, __ATOMIC_RELAXED); return calloc(1, n); }
static inline void kfree(const void *p) { free((void *)p); }

/* ---- pages ---- */
struct page {
	unsigned long pfn;       /* page_to_pfn(): unique per struct page */
	unsigned long private;
	void *virt;              /* PAGE_SIZE bytes, PAGE_SIZE aligned */
	void *harness;           /* test bookkeeping, not a kernel field */
};
#define page_private(p) ((p)->private)
#define set_page_private(p, v) ((p)->private = (unsigned long)(v))
extern long shim_pages_live;
struct page *alloc_page(gfp_t gfp);     /* zeroed when __GFP_ZERO */
void __free_page(struct page *p);
static inline void *kmap(struct page *p) { return p->virt; }
static inline void kunmap(struct page *p) { (void)p; }
static inline void *page_address(struct page *p) { return p->virt; }

/* ---- pfn, struct_size, sysfs_match_string ---- */
#define page_to_pfn(p) ((p)->pfn)
#define struct_size(p, member, n) (sizeof(*(p)) + (size_t)(n) * sizeof((p)->member[0]))
#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
int __sysfs_match_string(const char *const *array, size_t n, const char *str);
#define sysfs_match_string(a, s) __sysfs_match_string(a, ARRAY_SIZE(a), s)

/*
 * ---- xarray: stand-in for <linux/xarray.h> (lib/xarray.c) ----
 * The calls the pool makes, with the kernel's semantics: an all-zero xarray is
 * a valid empty one; xa_load() takes no lock (RCU in the kernel: here a mutex
 * inside, the caller sees no lock); xa_insert() returns -EBUSY when the index
 * is occupied and -ENOMEM when it cannot allocate (shim_xa_fail_next makes the
 * next N inserts fail so); xa_erase() returns the old entry; xa_for_each()
 * visits entries in index order; xa_destroy() frees the xarray's own memory,
 * never the entries. Storage: a sorted array (the kernel's is a radix tree).
 */
#define XA_PRESENT 0
struct xarray {
	pthread_mutex_t *lock;      /* created on first use: an all-zero xarray is valid */
	unsigned long *index;
	void **entry;
	size_t n, cap;
};
extern int shim_xa_fail_next;
extern long shim_xa_live;           /* xarrays holding memory (leak check) */
void xa_init(struct xarray *xa);
void *xa_load(struct xarray *xa, unsigned long index);
int xa_insert(struct xarray *xa, unsigned long index, void *entry, gfp_t gfp);
void *xa_erase(struct xarray *xa, unsigned long index);
void *xa_find(struct xarray *xa, unsigned long *index, unsigned long max, int filter);
void *xa_find_after(struct xarray *xa, unsigned long *index, unsigned long max, int filter);
void xa_destroy(struct xarray *xa);
#define xa_for_each(xa, index, entry) \
	for (index = 0, entry = xa_find(xa, &index, ~0UL, XA_PRESENT); entry; \
	     entry = xa_find_after(xa, &index, ~0UL, XA_PRESENT))

/* ---- printk-ish ---- */
int scnprintf(char *buf, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---- module parameters / modinfo ---- */
struct kernel_param;
struct kernel_param_ops {
	int (*set)(const char *val, const struct kernel_param *kp);
	int (*get)(char *buffer, const struct kernel_param *kp);
};
struct kernel_param {
	const char *name;
	const struct kernel_param_ops *ops;
	unsigned short perm;
	void *arg;
	int *intp;              /* module_param(name, int, perm) */
};
int param_get_int(char *buffer, const struct kernel_param *kp);
void shim_register_param(const char *name, const struct kernel_param_ops *ops, void *arg,
			 int *intp, unsigned short perm);
void shim_register_modinfo(const char *tag, const char *value);
/* Reads a parameter as sysfs would (buffer of PAGE_SIZE); returns length or -errno. */
int shim_param_get(const char *name, char *buf, size_t len);
int shim_param_set(const char *name, const char *val);
int shim_param_perm(const char *name);
const char *shim_modinfo(const char *tag);

#define module_param(name, type, perm) \
	static void __attribute__((constructor)) shim_reg_param_##name(void) \
	{ shim_register_param(#name, NULL, NULL, &name, perm); }
#define module_param_cb(name, ops, arg, perm) \
	static void __attribute__((constructor)) shim_reg_param_##name(void) \
	{ shim_register_param(#name, ops, arg, NULL, perm); }
#define MODULE_PARM_DESC(name, desc) \
	static const char shim_parm_desc_##name[] __attribute__((unused)) = desc
#define MODULE_INFO(tag, info) \
	static void __attribute__((constructor)) shim_reg_info_##tag(void) \
	{ shim_register_modinfo(#tag, info); }

#endif
