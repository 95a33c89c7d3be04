/* memtool: the guest side of tests/test_kernel_memory.py (static, no libc beyond what -static links).
 *
 *   memtool now                       CLOCK_MONOTONIC in ms (the init script times its steps with it)
 *   memtool pagesize                  this kernel's page size (busybox has no getconf)
 *   memtool frag PERCENT              fragment free memory: map PERCENT % of MemFree anonymous (no THP), touch
 *                                     every page, give every other page back (MADV_DONTNEED: to the buddy
 *                                     allocator, one page at a time), print FRAG-READY, hold the rest until killed
 *   memtool anon MIB                  touch MIB of anonymous memory and hold it until killed (part of a hog)
 *   memtool psi TRIGGER SECS CGROUP CMD...
 *                                     register TRIGGER on /proc/pressure/memory exactly as service/floor.py does
 *                                     (open O_RDWR|O_NONBLOCK, write the trigger and a NUL), start CMD in CGROUP,
 *                                     poll for POLLPRI; print PSI-FIRED ms=<from CMD's start> or PSI-TIMEOUT, then
 *                                     kill CMD's process group
 *   memtool bbrecord TRIGGER SECS CGROUP FILE CMD...
 *                                     the black box's stand-in: as psi, then on the first trigger event append one
 *                                     sample a second to FILE as service/blackbox.py does (sample(): the same keys,
 *                                     json.dumps(sort_keys=True) formatting; write(): O_APPEND, one line, fsync),
 *                                     echo each line to stdout after its fsync (BB-SAMPLE n=<n> <line>); CMD keeps
 *                                     running (the host kills the VM)
 *   memtool bbsample FILE             append one such sample now (a boot's own sample)
 * BB_NOSYNC=1 in the environment leaves out the fsync (the control: without it the samples do not survive a kill)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static long long meminfo(const char *key)
{
	char line[256];
	size_t n = strlen(key);
	long long v = -1;
	FILE *f = fopen("/proc/meminfo", "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof line, f))
		if (!strncmp(line, key, n) && line[n] == ':') {
			v = atoll(line + n + 1) * 1024;
			break;
		}
	fclose(f);
	return v;
}

static int frag(int percent)
{
	long page = sysconf(_SC_PAGESIZE);
	long long bytes = meminfo("MemFree") / 100 * percent;
	size_t len = (size_t)(bytes / page) * page;
	char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	size_t i, freed = 0;
	if (p == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	madvise(p, len, MADV_NOHUGEPAGE);
	for (i = 0; i < len; i += page)
		p[i] = 1;
	for (i = 0; i < len; i += 2 * page) {
		madvise(p + i, page, MADV_DONTNEED);
		freed++;
	}
	printf("FRAG-READY page_size=%ld pages=%zu freed=%zu held_bytes=%zu\n", page, len / page, freed,
	       (len / page - freed) * page);
	fflush(stdout);
	for (;;)
		pause();
}

static int anon(long mib)
{
	size_t len = (size_t)mib << 20, i;
	long page = sysconf(_SC_PAGESIZE);
	char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return 1;
	for (i = 0; i < len; i += page)
		p[i] = 1;
	for (;;)
		pause();
}

/* service/floor.py: os.open(PSI_MEMORY, O_RDWR|O_NONBLOCK|O_CLOEXEC); os.write(fd, TRIGGER + b"\0") */
static int arm(const char *trigger)
{
	int fd = open("/proc/pressure/memory", O_RDWR | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0 || write(fd, trigger, strlen(trigger) + 1) < 0) {
		printf("PSI-ARM-FAILED errno=%d %s\n", errno, strerror(errno));
		return -1;
	}
	return fd;
}

static pid_t start(const char *cgroup, char **argv)
{
	pid_t pid = fork();
	if (pid == 0) {
		char path[512], buf[32];
		int fd;
		setpgid(0, 0);
		snprintf(path, sizeof path, "%s/cgroup.procs", cgroup);
		fd = open(path, O_WRONLY);
		if (fd < 0 || write(fd, buf, snprintf(buf, sizeof buf, "%d", getpid())) < 0) {
			perror(path);
			_exit(126);
		}
		close(fd);
		execvp(argv[0], argv);
		_exit(127);
	}
	return pid;
}

/* Python's repr of float(s) for a decimal string with at most 2-3 fraction digits: "12.30" -> "12.3",
 * "0.00" -> "0.0" (what json.dumps prints for parse_psi's float) */
static void pyfloat(char *out, size_t n, const char *s)
{
	char *dot, *end;
	snprintf(out, n, "%s", s);
	dot = strchr(out, '.');
	if (!dot) {
		strncat(out, ".0", n - strlen(out) - 1);
		return;
	}
	end = out + strlen(out) - 1;
	while (end > dot + 1 && *end == '0')
		*end-- = 0;
}

static void psi_field(const char *line, const char *key, char *out, size_t n)
{
	const char *p = strstr(line, key);
	size_t i = 0;
	out[0] = 0;
	if (!p)
		return;
	p += strlen(key);
	while (p[i] && p[i] != ' ' && p[i] != '\n' && i < n - 1) {
		out[i] = p[i];
		i++;
	}
	out[i] = 0;
}

/* service/blackbox.py sample() + write(): keys sorted as json.dumps(sort_keys=True) writes them */
static int bbsample(const char *file, char *line, size_t n)
{
	char some[256] = "", full[256] = "", s10[32], f10[32], stot[32], ps10[40], pf10[40], traw[48], tbuf[48];
	struct timespec ts;
	FILE *f = fopen("/proc/pressure/memory", "r");
	int fd;
	if (f) {
		char l[256];
		while (fgets(l, sizeof l, f)) {
			if (!strncmp(l, "some ", 5))
				snprintf(some, sizeof some, "%s", l);
			else if (!strncmp(l, "full ", 5))
				snprintf(full, sizeof full, "%s", l);
		}
		fclose(f);
	}
	psi_field(some, "avg10=", s10, sizeof s10);
	psi_field(full, "avg10=", f10, sizeof f10);
	psi_field(some, "total=", stot, sizeof stot);
	pyfloat(ps10, sizeof ps10, s10);
	pyfloat(pf10, sizeof pf10, f10);
	clock_gettime(CLOCK_REALTIME, &ts);
	/* round(time.time(), 3): milliseconds, trailing zeros dropped as Python's repr does */
	snprintf(traw, sizeof traw, "%lld.%03ld", (long long)ts.tv_sec, ts.tv_nsec / 1000000);
	pyfloat(tbuf, sizeof tbuf, traw);
	snprintf(line, n,
		 "{\"anon\": %lld, \"cached\": %lld, \"mem_available\": %lld, \"mem_free\": %lld, "
		 "\"psi_full_avg10\": %s, \"psi_some_avg10\": %s, \"psi_some_total_us\": %s, \"reason\": \"pressure\", "
		 "\"shmem\": %lld, \"time\": %s}\n",
		 meminfo("AnonPages"), meminfo("Cached"), meminfo("MemAvailable"), meminfo("MemFree"), pf10, ps10,
		 stot, meminfo("Shmem"), tbuf);
	fd = open(file, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
	if (fd < 0 || write(fd, line, strlen(line)) < 0 || (!getenv("BB_NOSYNC") && fsync(fd) < 0)) {
		printf("BB-WRITE-FAILED %s errno=%d\n", file, errno);
		return -1;
	}
	close(fd);
	return 0;
}

static int psi(int record, char **argv)
{
	const char *trigger = argv[0], *cgroup = argv[2], *file = record ? argv[3] : NULL;
	int secs = atoi(argv[1]), fd = arm(trigger), r, n = 0;
	char line[1024];
	struct pollfd pfd;
	long long t0;
	pid_t pid;
	if (fd < 0)
		return 1;
	printf("PSI-ARMED trigger='%s'\n", trigger);
	fflush(stdout);
	t0 = now_ms();
	pid = start(cgroup, argv + (record ? 4 : 3));
	pfd.fd = fd;
	pfd.events = POLLPRI;
	r = poll(&pfd, 1, secs * 1000);
	if (r > 0 && (pfd.revents & POLLERR)) {
		printf("PSI-POLLERR\n");
		r = -1;
	} else if (r > 0) {
		printf("PSI-FIRED ms=%lld\n", now_ms() - t0);
	} else {
		printf("PSI-TIMEOUT after %d s\n", secs);
	}
	fflush(stdout);
	if (record && r > 0) {
		for (;;) {
			long long next = now_ms() + 1000;
			if (bbsample(file, line, sizeof line) == 0) {
				printf("BB-SAMPLE n=%d %s", ++n, line);
				fflush(stdout);
			}
			while (now_ms() < next)
				usleep(10000);
		}
	}
	kill(-pid, SIGKILL);
	waitpid(pid, NULL, 0);
	return r > 0 ? 0 : 1;
}

int main(int argc, char **argv)
{
	char line[1024];
	if (argc >= 2 && !strcmp(argv[1], "now")) {
		printf("%lld\n", now_ms());
		return 0;
	}
	if (argc == 2 && !strcmp(argv[1], "pagesize")) {
		printf("%ld\n", sysconf(_SC_PAGESIZE));
		return 0;
	}
	if (argc == 3 && !strcmp(argv[1], "frag"))
		return frag(atoi(argv[2]));
	if (argc == 3 && !strcmp(argv[1], "anon"))
		return anon(atol(argv[2]));
	if (argc >= 6 && !strcmp(argv[1], "psi"))
		return psi(0, argv + 2);
	if (argc >= 7 && !strcmp(argv[1], "bbrecord"))
		return psi(1, argv + 2);
	if (argc == 3 && !strcmp(argv[1], "bbsample")) {
		if (bbsample(argv[2], line, sizeof line))
			return 1;
		printf("BB-SAMPLE n=0 %s", line);
		return 0;
	}
	fprintf(stderr, "usage: memtool now|frag PCT|anon MIB|psi TRIGGER SECS CGROUP CMD...|"
			"bbrecord TRIGGER SECS CGROUP FILE CMD...|bbsample FILE\n");
	return 2;
}
