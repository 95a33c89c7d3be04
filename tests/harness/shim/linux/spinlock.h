/* shim stand-in for <linux/spinlock.h>: see ../shim.h */
#include "../shim.h"
