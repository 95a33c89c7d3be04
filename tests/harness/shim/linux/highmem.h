/* shim stand-in for <linux/highmem.h>: see ../shim.h */
#include "../shim.h"
