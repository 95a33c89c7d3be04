/* shim stand-in for <linux/bitops.h>: see ../shim.h */
#include "../shim.h"
