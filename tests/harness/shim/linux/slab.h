/* shim stand-in for <linux/slab.h>: see ../shim.h */
#include "../shim.h"
