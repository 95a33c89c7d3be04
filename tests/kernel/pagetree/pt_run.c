// SPDX-License-Identifier: GPL-2.0-only OR MIT
/*
 * pt_run: run nvidia-uvm's own built-in tests from PID 1's shell in the test VM
 * (tests/test_kernel_pagetree.py). Static arm64. The ioctl numbers and parameter structs come from
 * the NVIDIA tree being tested (uvm_linux_ioctl.h, uvm_test_ioctl.h on the include path at build time).
 *
 *   pt_run [TEST...]      TEST: page_tree (default) | gpu_free (every test below) | one of them:
 *                         rng range_tree range_tree_random rb_tree rb_tree_random lock kvmalloc perf_utils
 *                         range_allocator kthread_q thread_context mem cpu_chunk perf_events
 *
 * The GPU-free ones are NVIDIA's built-in tests that do real work without a registered GPU (the list and why
 * each other test is not run: docs/kernel-tests.md); one the tree cannot run without a GPU is skipped by name
 * (-DPT_RUN_SKIP_<TEST>). kthread_q runs only by name: its multithreaded stress
 * stalls RCU under TCG on a loaded host (docs/kernel-tests.md). Parameters of the random tests: fixed seeds, sizes small
 * enough for a KASAN kernel under TCG.
 *
 * One line per step: "PT-RUN step=<name> ioctl=<rc> errno=<n> rmStatus=0x<hex>"; exit 0 only when
 * the device opened, UVM_INITIALIZE and every test returned NV_OK.
 *
 * Out of memory (tests/test_kernel_oom.py, tests/kernel/oom/init.sh):
 *   pt_run oom task CALLS       UVM_TEST_PAGE_TREE CALLS times, each with this task marked for fault
 *                               injection (/proc/self/make-it-fail = 1 around the ioctl only: fail_page_alloc /
 *                               failslab with task-filter, configured by init.sh, fail its allocations)
 *   pt_run oom nth CALLS SEED   each call with /proc/self/fail-nth = n: the n-th allocation (slab or page) of the
 *                               call fails; n from SEED (log-uniform in 1..32768, the same SEED gives the same n)
 *   pt_run oom none CALLS       no injection (the memory cgroup and memory hog cases)
 * One line per call: "PT-OOM call=<i> ioctl=<rc> errno=<n> rmStatus=0x<hex> nth=<n> injected=<0|1|-1> ms=<n>"
 * (injected: nth mode only, whether the n-th allocation was reached; -1 elsewhere). Exit 0 when every call
 * returned (any status: the test judges them).
 *   pt_run hog OVER_KIB         a memory hog: touches 1 MiB blocks until MemAvailable is 0, then OVER_KIB more
 *                               (into the reserves: below the watermarks), then churns (frees a random block,
 *                               takes another) until killed; oom_score_adj 1000, so the OOM killer, when it
 *                               comes, takes the hog first. Prints "HOG-READY blocks=<n> avail_kib=<n>".
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include "uvm_linux_ioctl.h"
#include "uvm_test_ioctl.h"

static int report(const char *step, int rc, NV_STATUS st)
{
    printf("PT-RUN step=%s ioctl=%d errno=%d rmStatus=0x%x\n", step, rc, rc ? errno : 0, (unsigned)st);
    fflush(stdout);
    return rc == 0 && st == NV_OK;
}

/* SET: statements on `p` (the test's parameters) before the call */
#define RUN_SET(fd, name, NUM, TYPE, SET)                          \
    do {                                                           \
        TYPE p;                                                    \
        int rc;                                                    \
        memset(&p, 0, sizeof(p));                                  \
        SET;                                                       \
        rc = ioctl(fd, NUM, &p);                                   \
        ok &= report(name, rc, p.rmStatus);                        \
    } while (0)
#define RUN(fd, name, NUM, TYPE) RUN_SET(fd, name, NUM, TYPE, (void)0)

static const char *const gpu_free[] = {
    "rng", "range_tree", "range_tree_random", "rb_tree", "rb_tree_random", "lock", "kvmalloc", "perf_utils",
    "range_allocator", "thread_context", "mem", "cpu_chunk", "perf_events", NULL,
};

/* -DPT_RUN_SKIP_<TEST>: the tree's own test needs a GPU (tests/support/uvmvm.py gpu_free_skips() reads that
 * from the tree, e.g. r535's mem test); reported as "PT-SKIP step=<name>", never run */
static int skipped(const char *t)
{
#ifdef PT_RUN_SKIP_MEM
    if (!strcmp(t, "mem"))
        return 1;
#endif
    (void)t;
    return 0;
}

static int run_one(int fd, const char *t)
{
    int ok = 1;

    if (!strcmp(t, "page_tree"))
        RUN(fd, "page_tree", UVM_TEST_PAGE_TREE, UVM_TEST_PAGE_TREE_PARAMS);
    else if (!strcmp(t, "rng"))
        RUN(fd, t, UVM_TEST_RNG_SANITY, UVM_TEST_RNG_SANITY_PARAMS);
    else if (!strcmp(t, "range_tree"))
        RUN(fd, t, UVM_TEST_RANGE_TREE_DIRECTED, UVM_TEST_RANGE_TREE_DIRECTED_PARAMS);
    else if (!strcmp(t, "range_tree_random"))
        RUN_SET(fd, t, UVM_TEST_RANGE_TREE_RANDOM, UVM_TEST_RANGE_TREE_RANDOM_PARAMS,
                (p.seed = 1, p.main_iterations = 2000, p.high_probability = 80,
                 p.add_remove_shrink_group_probability = 50, p.shrink_probability = 20, p.collision_checks = 4,
                 p.iterator_checks = 4, p.max_end = 1ull << 32, p.max_ranges = 500, p.max_batch_count = 10,
                 p.max_attempts = 20));
    else if (!strcmp(t, "rb_tree"))
        RUN(fd, t, UVM_TEST_RB_TREE_DIRECTED, UVM_TEST_RB_TREE_DIRECTED_PARAMS);
    else if (!strcmp(t, "rb_tree_random"))
        RUN_SET(fd, t, UVM_TEST_RB_TREE_RANDOM, UVM_TEST_RB_TREE_RANDOM_PARAMS,
                (p.iterations = 20000, p.range_max = 1ull << 20, p.node_limit = 500, p.seed = 1));
    else if (!strcmp(t, "lock"))
        RUN(fd, t, UVM_TEST_LOCK_SANITY, UVM_TEST_LOCK_SANITY_PARAMS);
    else if (!strcmp(t, "kvmalloc"))
        RUN(fd, t, UVM_TEST_KVMALLOC, UVM_TEST_KVMALLOC_PARAMS);
    else if (!strcmp(t, "perf_utils"))
        RUN(fd, t, UVM_TEST_PERF_UTILS_SANITY, UVM_TEST_PERF_UTILS_SANITY_PARAMS);
    else if (!strcmp(t, "range_allocator"))
        RUN_SET(fd, t, UVM_TEST_RANGE_ALLOCATOR_SANITY, UVM_TEST_RANGE_ALLOCATOR_SANITY_PARAMS,
                (p.seed = 1, p.iters = 2000));
    else if (!strcmp(t, "kthread_q"))
        RUN(fd, t, UVM_TEST_NV_KTHREAD_Q, UVM_TEST_NV_KTHREAD_Q_PARAMS);
    else if (!strcmp(t, "thread_context"))
        RUN_SET(fd, t, UVM_TEST_THREAD_CONTEXT_SANITY, UVM_TEST_THREAD_CONTEXT_SANITY_PARAMS, (p.iterations = 100));
    else if (!strcmp(t, "mem"))
        RUN(fd, t, UVM_TEST_MEM_SANITY, UVM_TEST_MEM_SANITY_PARAMS);
    else if (!strcmp(t, "cpu_chunk"))
        RUN(fd, t, UVM_TEST_CPU_CHUNK_API, UVM_TEST_CPU_CHUNK_API_PARAMS);
    else if (!strcmp(t, "perf_events"))
        RUN(fd, t, UVM_TEST_PERF_EVENTS_SANITY, UVM_TEST_PERF_EVENTS_SANITY_PARAMS);
    else {
        printf("PT-RUN step=%s unknown\n", t);
        ok = 0;
    }
    return ok;
}

static long now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000L + ts.tv_nsec / 1000000;
}

static void put_str(int fd, const char *v)
{
    if (fd >= 0 && pwrite(fd, v, strlen(v), 0) < 0)
        printf("PT-OOM write %s errno=%d\n", v, errno);
}

/* pt_run oom MODE CALLS [SEED] (see the head comment) */
static int oom_run(int fd, const char *mode, int calls, unsigned long seed)
{
    int mif = -1, nth = -1, i;

    if (!strcmp(mode, "task") && (mif = open("/proc/self/make-it-fail", O_WRONLY)) < 0) {
        printf("PT-OOM make-it-fail errno=%d\n", errno);
        return 1;
    }
    if (!strcmp(mode, "nth") && (nth = open("/proc/self/fail-nth", O_RDWR)) < 0) {
        printf("PT-OOM fail-nth errno=%d\n", errno);
        return 1;
    }
    printf("PT-OOM pid=%d mode=%s calls=%d\n", (int)getpid(), mode, calls);   /* kmemleak names leaks by pid */
    for (i = 0; i < calls; i++) {
        UVM_TEST_PAGE_TREE_PARAMS p;
        unsigned long n = 0;
        int rc, err, injected = -1;
        long t0;
        char buf[32];

        memset(&p, 0, sizeof(p));
        if (nth >= 0) {
            seed = seed * 6364136223846793005ul + 1442695040888963407ul;    /* the same seed, the same n */
            n = 1 + (seed >> 33) % (1ul << (1 + (seed >> 20) % 15));
            snprintf(buf, sizeof(buf), "%lu", n);
            put_str(nth, buf);
        }
        put_str(mif, "1");
        t0 = now_ms();
        rc = ioctl(fd, UVM_TEST_PAGE_TREE, &p);
        err = errno;
        put_str(mif, "0");
        if (nth >= 0) {
            ssize_t r = pread(nth, buf, sizeof(buf) - 1, 0);

            buf[r > 0 ? r : 0] = 0;
            injected = strtoul(buf, NULL, 10) == 0;     /* counted down to 0: the n-th allocation failed */
            put_str(nth, "0");
        }
        printf("PT-OOM call=%d ioctl=%d errno=%d rmStatus=0x%x nth=%lu injected=%d ms=%ld\n", i, rc,
               rc ? err : 0, (unsigned)p.rmStatus, n, injected, now_ms() - t0);
        fflush(stdout);
    }
    return 0;
}

static long mem_available_kib(void)
{
    char line[128];
    long v = -1;
    FILE *f = fopen("/proc/meminfo", "r");

    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "MemAvailable: %ld kB", &v) == 1)
            break;
    if (f)
        fclose(f);
    return v;
}

#define HOG_BLOCK (1L << 20)
#define HOG_MAX 8192

static void __attribute__((noreturn)) hog(long over_kib)
{
    static char *blk[HOG_MAX];
    int n = 0, ready = 0, fd = open("/proc/self/oom_score_adj", O_WRONLY);
    unsigned long r = 1;
    long over = 0;

    put_str(fd, "1000");
    for (;;) {
        if (n < HOG_MAX && (mem_available_kib() > 0 || over < over_kib)) {
            if (mem_available_kib() <= 0)
                over += HOG_BLOCK / 1024;
            if (!(blk[n] = malloc(HOG_BLOCK)))
                continue;
            memset(blk[n++], 0x5a, HOG_BLOCK);
            continue;
        }
        if (!ready) {
            printf("HOG-READY blocks=%d avail_kib=%ld\n", n, mem_available_kib());
            fflush(stdout);
            ready = 1;
        }
        if (n) {                       /* churn: give one block back, take it again at once */
            struct timespec ts = { 0, 5 * 1000 * 1000 };

            int k;

            r = r * 1103515245 + 12345;
            k = r % n;
            free(blk[k]);
            n--;
            blk[k] = blk[n];
            nanosleep(&ts, NULL);
        }
    }
}

int main(int argc, char **argv)
{
    UVM_INITIALIZE_PARAMS init;
    int fd, i, ok = 1;

    if (argc == 3 && !strcmp(argv[1], "hog"))
        hog(atol(argv[2]));

    fd = open("/dev/nvidia-uvm", O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        printf("PT-RUN step=open ioctl=-1 errno=%d rmStatus=0x0 (%s)\n", errno, strerror(errno));
        return 1;
    }
    memset(&init, 0, sizeof(init));
    if (!report("initialize", ioctl(fd, UVM_INITIALIZE, &init), init.rmStatus))
        return 1;
    if (argc >= 4 && !strcmp(argv[1], "oom"))
        return oom_run(fd, argv[2], atoi(argv[3]), argc > 4 ? strtoul(argv[4], NULL, 0) : 0);
    for (i = 1; i < argc || (argc == 1 && i == 1); i++) {
        const char *t = argc == 1 ? "page_tree" : argv[i];

        if (!strcmp(t, "gpu_free")) {
            const char *const *g;

            for (g = gpu_free; *g; g++) {
                if (skipped(*g)) {
                    printf("PT-SKIP step=%s\n", *g);
                    fflush(stdout);
                    continue;
                }
                ok &= run_one(fd, *g);
            }
        } else {
            ok &= run_one(fd, t);
        }
    }
    close(fd);
    return ok ? 0 : 1;
}
