// SPDX-License-Identifier: GPL-2.0-only OR MIT
/*
 * pt_run: run nvidia-uvm's own built-in tests from PID 1's shell in the test VM
 * (tests/test_kernel_pagetree.py). Static arm64. The ioctl numbers and parameter structs come from
 * the NVIDIA tree being tested (uvm_linux_ioctl.h, uvm_test_ioctl.h on the include path at build time).
 *
 *   pt_run [TEST...]      TEST: page_tree (default) | lock | kvmalloc | range_tree | rb_tree
 *
 * One line per step: "PT-RUN step=<name> ioctl=<rc> errno=<n> rmStatus=0x<hex>"; exit 0 only when
 * the device opened, UVM_INITIALIZE and every test returned NV_OK.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "uvm_linux_ioctl.h"
#include "uvm_test_ioctl.h"

static int report(const char *step, int rc, NV_STATUS st)
{
    printf("PT-RUN step=%s ioctl=%d errno=%d rmStatus=0x%x\n", step, rc, rc ? errno : 0, (unsigned)st);
    fflush(stdout);
    return rc == 0 && st == NV_OK;
}

#define RUN(fd, name, NUM, TYPE)                                   \
    do {                                                           \
        TYPE p;                                                    \
        int rc;                                                    \
        memset(&p, 0, sizeof(p));                                  \
        rc = ioctl(fd, NUM, &p);                                   \
        ok &= report(name, rc, p.rmStatus);                        \
    } while (0)

int main(int argc, char **argv)
{
    UVM_INITIALIZE_PARAMS init;
    int fd, i, ok = 1;

    fd = open("/dev/nvidia-uvm", O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        printf("PT-RUN step=open ioctl=-1 errno=%d rmStatus=0x0 (%s)\n", errno, strerror(errno));
        return 1;
    }
    memset(&init, 0, sizeof(init));
    if (!report("initialize", ioctl(fd, UVM_INITIALIZE, &init), init.rmStatus))
        return 1;
    for (i = 1; i < argc || (argc == 1 && i == 1); i++) {
        const char *t = argc == 1 ? "page_tree" : argv[i];

        if (!strcmp(t, "page_tree"))
            RUN(fd, "page_tree", UVM_TEST_PAGE_TREE, UVM_TEST_PAGE_TREE_PARAMS);
        else if (!strcmp(t, "lock"))
            RUN(fd, "lock", UVM_TEST_LOCK_SANITY, UVM_TEST_LOCK_SANITY_PARAMS);
        else if (!strcmp(t, "kvmalloc"))
            RUN(fd, "kvmalloc", UVM_TEST_KVMALLOC, UVM_TEST_KVMALLOC_PARAMS);
        else if (!strcmp(t, "range_tree"))
            RUN(fd, "range_tree", UVM_TEST_RANGE_TREE_DIRECTED, UVM_TEST_RANGE_TREE_DIRECTED_PARAMS);
        else if (!strcmp(t, "rb_tree"))
            RUN(fd, "rb_tree", UVM_TEST_RB_TREE_DIRECTED, UVM_TEST_RB_TREE_DIRECTED_PARAMS);
        else {
            printf("PT-RUN step=%s unknown\n", t);
            ok = 0;
        }
    }
    close(fd);
    return ok ? 0 : 1;
}
