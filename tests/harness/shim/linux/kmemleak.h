/* shim stand-in for <linux/kmemleak.h>: see ../shim.h */
#include "../shim.h"
