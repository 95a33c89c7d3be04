/* Stand-in nvidia.ko for NVIDIA's own UVM unit tests in a VM without a GPU (tests/test_kernel_pagetree.py).
 * Compiled inside an NVIDIA kernel-open tree (its conftest, its nv_uvm_interface.h), never shipped. */
#ifndef STANDIN_RM_H
#define STANDIN_RM_H
#include "nv-linux.h"
#include "nv_uvm_interface.h"

/* One line the first time each entry point is called: which part of RM nvidia-uvm asked for. */
#define STANDIN_RM_CALLED(name, what)                                        \
    do {                                                                      \
        static bool _once;                                                    \
        if (!_once) {                                                         \
            _once = true;                                                     \
            pr_info("standin-rm: %s -> %s\n", name, what);                    \
        }                                                                     \
    } while (0)
#endif
