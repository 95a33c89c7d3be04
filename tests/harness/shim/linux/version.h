/* shim stand-in for <linux/version.h>: see ../shim.h. -DLINUX_VERSION_CODE=... plays an older kernel. */
#ifndef SHIM_LINUX_VERSION_H
#define SHIM_LINUX_VERSION_H
#define KERNEL_VERSION(a, b, c) (((a) << 16) + ((b) << 8) + ((c) > 255 ? 255 : (c)))
#ifndef LINUX_VERSION_CODE
#define LINUX_VERSION_CODE KERNEL_VERSION(6, 12, 0)
#endif
#endif
