/* shim stand-in for <linux/errno.h>: the uapi errno values (glibc includes this header too) */
#include_next <linux/errno.h>
