/* shim stand-in for <linux/printk.h>: see ../shim.h */
#include "../shim.h"
