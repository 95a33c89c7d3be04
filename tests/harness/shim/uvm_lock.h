/* SPDX-License-Identifier: GPL-2.0-only OR MIT */
/*
 * Stand-in for the part of NVIDIA's nvidia-uvm/uvm_lock.h that uvm_pt_pack uses
 * (uvm_spinlock_t, uvm_spin_lock_init/uvm_spin_lock/uvm_spin_unlock and the lock
 * orders), as UVM's lock tracking behaves in a debug build: a thread may take a
 * lock only if its order is above every lock it already holds, so a second lock
 * taken under the pool's leaf lock (or the pool lock taken twice) aborts.
 */
#ifndef SHIM_UVM_LOCK_H
#define SHIM_UVM_LOCK_H
#include "shim.h"

typedef enum {
	UVM_LOCK_ORDER_INVALID = 0,
	UVM_LOCK_ORDER_PAGE_TREE = 20,   /* tree->lock (a mutex in UVM) */
	UVM_LOCK_ORDER_LEAF = 40,
} uvm_lock_order_t;

typedef struct {
	spinlock_t lock;
	uvm_lock_order_t lock_order;
} uvm_spinlock_t;

void shim_uvm_record_lock(uvm_lock_order_t order);
void shim_uvm_record_unlock(uvm_lock_order_t order);
extern long shim_uvm_lock_inits;

#define uvm_spin_lock_init(l, order) do { spin_lock_init(&(l)->lock); (l)->lock_order = (order); \
	__atomic_add_fetch(&shim_uvm_lock_inits, 1, __ATOMIC_RELAXED); } while (0)
#define uvm_spin_lock(l) do { shim_uvm_record_lock((l)->lock_order); spin_lock(&(l)->lock); } while (0)
#define uvm_spin_unlock(l) do { spin_unlock(&(l)->lock); shim_uvm_record_unlock((l)->lock_order); } while (0)

#endif
