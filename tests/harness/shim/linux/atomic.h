/* shim stand-in for <linux/atomic.h>: see ../shim.h */
#include "../shim.h"
